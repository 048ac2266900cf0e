//! `vhca-run bench`: the same suite from the snapshot and cold, in one session, at each parallelism asked for; wall
//! time and per-run median of each, and whether both paths gave every run the same verdict.

use std::collections::BTreeMap;
use std::fmt::Write;

use vhca_suite::{ConcreteRun, Suite, SuiteReport};

use crate::run::{RunContext, RunError};
use crate::suite_run::{run_suite, SuiteEvent, SuiteOptions};

/// One suite run of the bench.
#[derive(Debug, Clone)]
pub struct Measurement {
    pub jobs: usize,
    pub path: &'static str,
    pub wall_s: f64,
    pub median_s: f64,
    pub min_s: f64,
    pub max_s: f64,
    pub runs: usize,
    pub passed: usize,
    /// Runs whose boot path was not the one measured (a snapshot run that fell back to cold).
    pub off_path: usize,
    /// Run name → its actual verdict, to compare the paths.
    pub verdicts: BTreeMap<String, String>,
}

impl Measurement {
    fn of(jobs: usize, path: &'static str, report: &SuiteReport) -> Measurement {
        let mut secs: Vec<f64> = report.runs.iter().map(|r| r.seconds).collect();
        secs.sort_by(f64::total_cmp);
        Measurement {
            jobs,
            path,
            wall_s: report.totals.wall_seconds,
            median_s: median(&secs),
            min_s: secs.first().copied().unwrap_or(0.0),
            max_s: secs.last().copied().unwrap_or(0.0),
            runs: report.totals.runs,
            passed: report.totals.passed,
            off_path: report.runs.iter().filter(|r| r.path.as_str() != path).count(),
            verdicts: report.runs.iter().map(|r| (r.name.clone(), r.actual_text.clone())).collect(),
        }
    }
}

/// The median of sorted values (the mean of the middle two for an even count).
pub fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Runs `runs` at each parallelism, snapshot first then cold. `ctx` must carry the snapshot.
pub fn measure(
    ctx: &RunContext,
    suite: &Suite,
    runs: &[ConcreteRun],
    jobs: &[usize],
    program: &str,
    on: &mut dyn FnMut(&str, SuiteEvent),
) -> Result<Vec<Measurement>, RunError> {
    let cold = RunContext { snapshot: None, ..ctx.clone() };
    let mut out = Vec::new();
    for &j in jobs {
        for (path, c) in [("snapshot", ctx), ("cold", &cold)] {
            let opts = SuiteOptions {
                jobs: j,
                artifacts: None,
                program: program.to_string(),
                suite_file: None,
                expand_fail_points: true,
            };
            let label = format!("-j {j} {path}");
            let report = run_suite(c, suite, runs, &opts, &mut |e| on(&label, e))?;
            out.push(Measurement::of(j, path, &report));
        }
    }
    Ok(out)
}

/// Runs whose verdict differs between the paths at the same parallelism: (jobs, run, snapshot's, cold's).
pub fn verdict_differences(ms: &[Measurement]) -> Vec<(usize, String, String, String)> {
    let mut diffs = Vec::new();
    for snap in ms.iter().filter(|m| m.path == "snapshot") {
        let Some(cold) = ms.iter().find(|m| m.path == "cold" && m.jobs == snap.jobs) else { continue };
        for (name, verdict) in &snap.verdicts {
            let other = cold.verdicts.get(name).cloned().unwrap_or_else(|| "(not run)".into());
            if *verdict != other {
                diffs.push((snap.jobs, name.clone(), verdict.clone(), other));
            }
        }
    }
    diffs
}

/// A Markdown table of the measurements, with the speed-up of each parallelism.
pub fn render(ms: &[Measurement]) -> String {
    let mut t = String::from(
        "| -j | path | wall (s) | per-run median (s) | per-run min–max (s) | passed | not on this path |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for m in ms {
        let _ = writeln!(
            t,
            "| {} | {} | {:.1} | {:.2} | {:.2}–{:.2} | {}/{} | {} |",
            m.jobs, m.path, m.wall_s, m.median_s, m.min_s, m.max_s, m.passed, m.runs, m.off_path
        );
    }
    for snap in ms.iter().filter(|m| m.path == "snapshot") {
        if let Some(cold) = ms.iter().find(|m| m.path == "cold" && m.jobs == snap.jobs) {
            let _ = writeln!(
                t,
                "\n-j {}: wall {:.1}x faster, per-run median {:.1}x faster from the snapshot",
                snap.jobs,
                cold.wall_s / snap.wall_s.max(1e-9),
                cold.median_s / snap.median_s.max(1e-9)
            );
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(jobs: usize, path: &'static str, verdicts: &[(&str, &str)]) -> Measurement {
        Measurement {
            jobs,
            path,
            wall_s: if path == "cold" { 30.0 } else { 10.0 },
            median_s: if path == "cold" { 4.0 } else { 0.5 },
            min_s: 0.0,
            max_s: 0.0,
            runs: verdicts.len(),
            passed: verdicts.len(),
            off_path: 0,
            verdicts: verdicts.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
        }
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 9.0]), 3.0);
    }

    #[test]
    fn differing_verdicts_are_found_per_parallelism() {
        let ms = vec![
            m(2, "snapshot", &[("a/verifier-off", "pass"), ("b/verifier-on", "bugcheck 0xC4")]),
            m(2, "cold", &[("a/verifier-off", "pass"), ("b/verifier-on", "hang")]),
        ];
        assert_eq!(
            verdict_differences(&ms),
            [(2, "b/verifier-on".to_string(), "bugcheck 0xC4".to_string(), "hang".to_string())]
        );
        let table = render(&ms);
        assert!(table.contains("| 2 | snapshot | 10.0 | 0.50 |"), "{table}");
        assert!(table.contains("wall 3.0x faster, per-run median 8.0x faster"), "{table}");
    }
}
