//! `vhca-run bench`: the same suite from the snapshot and cold, in one session, at each parallelism asked for; wall
//! time and per-run median of each, and whether both paths gave every run the same verdict. `--roundtrip`: the
//! guest-visible latency of one QUERY_DEVICE against one read from QEMU's in-process virtio-rng (guest `roundtrip`),
//! once per completion mode. `--alternate-completion`: the suite from the snapshot with each `vhca.completion` in
//! turn, round after round, so polling and interrupts are compared in the same minutes.

use std::collections::BTreeMap;
use std::fmt::Write;

use vhca_suite::{ConcreteRun, Suite, SuiteReport};

use crate::run::RunError;
use crate::run_context::RunContext;
use crate::run_plan::ROUNDTRIP_SCENARIO;
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

/// One suite run of the completion bench.
#[derive(Debug, Clone)]
pub struct ModeMeasurement {
    pub round: usize,
    pub jobs: usize,
    /// The `vhca.completion` every run was given.
    pub mode: String,
    pub wall_s: f64,
    /// Every run's seconds, sorted.
    pub run_s: Vec<f64>,
    pub runs: usize,
    pub passed: usize,
    /// Runs whose guest did not report this mode (vhca.sys, which connects no interrupt; an older guest).
    pub off_mode: usize,
}

impl ModeMeasurement {
    pub fn median_s(&self) -> f64 {
        median(&self.run_s)
    }
}

/// `runs`, each told to wait for completions as `mode` says, whatever the guest's default is.
pub fn with_completion(runs: &[ConcreteRun], mode: &str) -> Vec<ConcreteRun> {
    runs.iter()
        .cloned()
        .map(|mut run| {
            run.guest.extra.insert("completion".into(), mode.into());
            run
        })
        .collect()
}

/// Runs `runs` from the snapshot `rounds` times; in each round at each parallelism once per mode, in the order
/// given (poll, interrupt, poll, interrupt...): alternated, so a slow minute of a shared host lands on both.
#[allow(clippy::too_many_arguments)]
pub fn measure_completion(
    ctx: &RunContext,
    suite: &Suite,
    runs: &[ConcreteRun],
    jobs: &[usize],
    modes: &[String],
    rounds: usize,
    program: &str,
    on: &mut dyn FnMut(&str, SuiteEvent),
) -> Result<Vec<ModeMeasurement>, RunError> {
    let mut out = Vec::new();
    for round in 1..=rounds {
        for &j in jobs {
            for mode in modes {
                // The runs a recording run would expand to are not timed: the same runs in every mode.
                let opts = SuiteOptions {
                    jobs: j,
                    artifacts: None,
                    program: program.to_string(),
                    suite_file: None,
                    expand_fail_points: false,
                };
                let label = format!("round {round} -j {j} {mode}");
                let report = run_suite(ctx, suite, &with_completion(runs, mode), &opts, &mut |e| on(&label, e))?;
                let mut run_s: Vec<f64> = report.runs.iter().map(|r| r.seconds).collect();
                run_s.sort_by(f64::total_cmp);
                out.push(ModeMeasurement {
                    round,
                    jobs: j,
                    mode: mode.clone(),
                    wall_s: report.totals.wall_seconds,
                    run_s,
                    runs: report.totals.runs,
                    passed: report.totals.passed,
                    off_mode: report
                        .runs
                        .iter()
                        .filter(|r| r.completion.as_ref().map(|c| c.mode.as_str()) != Some(mode.as_str()))
                        .count(),
                });
            }
        }
    }
    Ok(out)
}

/// The completion bench as Markdown: one row per suite run, then per parallelism each mode's per-run median over
/// every round's runs pooled, the median wall, and both as ratios to the first mode's.
pub fn render_completion(ms: &[ModeMeasurement]) -> String {
    let mut t = String::from(
        "| round | -j | completion | wall (s) | per-run median (s) | per-run min–max (s) | passed | not in this mode |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for m in ms {
        let _ = writeln!(
            t,
            "| {} | {} | {} | {:.2} | {:.3} | {:.2}–{:.2} | {}/{} | {} |",
            m.round,
            m.jobs,
            m.mode,
            m.wall_s,
            m.median_s(),
            m.run_s.first().copied().unwrap_or(0.0),
            m.run_s.last().copied().unwrap_or(0.0),
            m.passed,
            m.runs,
            m.off_mode
        );
    }
    let mut jobs: Vec<usize> = ms.iter().map(|m| m.jobs).collect();
    jobs.sort_unstable();
    jobs.dedup();
    let mut modes: Vec<&str> = Vec::new();
    for m in ms {
        if !modes.contains(&m.mode.as_str()) {
            modes.push(&m.mode);
        }
    }
    for j in jobs {
        let pooled = |mode: &str| {
            let of: Vec<&ModeMeasurement> = ms.iter().filter(|m| m.jobs == j && m.mode == mode).collect();
            let mut runs: Vec<f64> = of.iter().flat_map(|m| m.run_s.iter().copied()).collect();
            runs.sort_by(f64::total_cmp);
            let mut walls: Vec<f64> = of.iter().map(|m| m.wall_s).collect();
            walls.sort_by(f64::total_cmp);
            (median(&runs), median(&walls), of.len())
        };
        let Some(first) = modes.first() else { break };
        let (base_run, base_wall, _) = pooled(first);
        for mode in &modes {
            let (run, wall, rounds) = pooled(mode);
            let _ =
                write!(t, "\n-j {j} {mode}: per-run median {run:.3} s, median wall {wall:.2} s over {rounds} rounds");
            if mode != first {
                let _ = write!(
                    t,
                    "; {mode} / {first}: per-run median {:.2}x, wall {:.2}x",
                    run / base_run.max(1e-9),
                    wall / base_wall.max(1e-9)
                );
            }
        }
        t.push('\n');
    }
    t
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

/// The one-run suite of the round-trip bench: verifier off, a pass expected, `samples` of each kind, QUERY_DEVICE
/// waiting as `completion` says (`poll` or `interrupt`, passed explicitly whatever the guest's default).
pub fn roundtrip_suite(samples: usize, completion: &str) -> Suite {
    let text = format!(
        "name = \"roundtrip\"\n[[run]]\nname = \"{ROUNDTRIP_SCENARIO}\"\nmodes = [\"off\"]\nexpect = \"pass\"\n\
         guest = {{ scenario = \"{ROUNDTRIP_SCENARIO}\", timeout_s = 600, silence_s = 600, \
         extra = {{ samples = \"{samples}\", completion = {completion:?} }} }}\n"
    );
    // The text is fixed but for a number: a parse error is a bug here, caught by the unit test below.
    Suite::parse(&text, "<roundtrip bench>").unwrap_or_else(|e| panic!("round-trip suite: {e}"))
}

/// Runs the round-trip scenario once, booted cold (the snapshot's machine has no virtio-rng), and returns the
/// guest's `details.roundtrip` with the run's verdict.
pub fn roundtrip(
    ctx: &RunContext,
    samples: usize,
    completion: &str,
    program: &str,
    on: &mut dyn FnMut(SuiteEvent),
) -> Result<(serde_json::Value, SuiteReport), RunError> {
    let suite = roundtrip_suite(samples, completion);
    let runs = suite.expand();
    let cold = RunContext { snapshot: None, ..ctx.clone() };
    let root = tempfile::tempdir()?;
    let opts = SuiteOptions {
        jobs: 1,
        artifacts: Some(root.path().to_path_buf()),
        program: program.to_string(),
        suite_file: None,
        expand_fail_points: false,
    };
    let report = run_suite(&cold, &suite, &runs, &opts, on)?;
    let observation = report
        .runs
        .first()
        .and_then(|r| r.artifact_dir.as_ref())
        .and_then(|dir| std::fs::read_to_string(dir.join(crate::artifacts::OBSERVATION)).ok())
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .unwrap_or_default();
    let measured = observation.pointer("/guest_result/details/roundtrip").cloned().unwrap_or_default();
    Ok((measured, report))
}

/// The round trip as a Markdown table, with the ratios of the medians and p99s to the in-process device: with
/// QUERY_DEVICE waiting by interrupt, against the rng read waiting by interrupt; polling, against the faster of the
/// rng's two polled modes.
pub fn render_roundtrip(measured: &serde_json::Value) -> String {
    let by_interrupt = measured["completion"] == "interrupt";
    let row = |key: &str, what: &str| -> String {
        let s = &measured[key];
        format!(
            "| {what} | {} | {:.1} | {:.1} | {:.1}–{:.1} |\n",
            s["samples"],
            s["median_us"].as_f64().unwrap_or(0.0),
            s["p99_us"].as_f64().unwrap_or(0.0),
            s["min_us"].as_f64().unwrap_or(0.0),
            s["max_us"].as_f64().unwrap_or(0.0)
        )
    };
    let mut t = String::from("| what | samples | median (µs) | p99 (µs) | min–max (µs) |\n|---|---|---|---|---|\n");
    t.push_str(&row(
        "vhca_query_device",
        if by_interrupt {
            "QUERY_DEVICE via vhca (vIOMMU, vhost-user), waiting for its MSI-X message"
        } else {
            "QUERY_DEVICE via vhca (vIOMMU, vhost-user), polling"
        },
    ));
    if measured.get("rng_read_interrupt").is_some() {
        t.push_str(&row(
            "rng_read_interrupt",
            "64-byte read, QEMU's virtio-rng (in-process), waiting for its MSI-X message",
        ));
    }
    if measured.get("rng_read_interrupt_seen").is_some() {
        t.push_str(&row(
            "rng_read_interrupt_seen",
            "the same read, until the interrupt thread counted its message (the waiter spinning, yielding)",
        ));
    }
    t.push_str(&row("rng_read", "the same read, interrupts asked for, polling"));
    t.push_str(&row("rng_read_no_interrupt", "the same read, interrupts declined (as vhca's queues)"));
    t.push_str(&row("rng_read_sleeping", "the same read, sleeps only (no spin first)"));
    t.push_str(&row("rng_read_spinning", "the same read, spinning on the used ring"));
    t.push_str(&row("kick", "the kick alone (one notify write)"));
    t.push_str(&row("vhca_query_device_back_to_back", "QUERY_DEVICE via vhca, back to back"));
    // Against the in-process device in whichever of its two modes was faster at that quantile (an older guest
    // reports only `rng_read`).
    let ratio = |q: &str, against: &[&str]| {
        let a = measured["vhca_query_device"][q].as_f64().unwrap_or(f64::NAN);
        let b = against.iter().filter_map(|k| measured[*k][q].as_f64()).fold(f64::NAN, f64::min);
        a / b
    };
    if by_interrupt {
        let against = ["rng_read_interrupt"];
        let _ = writeln!(
            t,
            "\nvhca by interrupt / virtio-rng by interrupt: median {:.2}x, p99 {:.2}x (target: at most 1.0x)",
            ratio("median_us", &against),
            ratio("p99_us", &against)
        );
    } else {
        let against = ["rng_read", "rng_read_no_interrupt"];
        let _ = writeln!(
            t,
            "\nvhca polling / virtio-rng polling (the faster of its two modes): median {:.2}x, p99 {:.2}x",
            ratio("median_us", &against),
            ratio("p99_us", &against)
        );
    }
    if let Some(n) = measured["rng_messages"].as_u64() {
        let _ = writeln!(t, "virtio-rng MSI-X messages in the run: {n}");
    }
    if let Some(ns) = measured["spin_poll_ns"].as_f64() {
        let spin = measured["spin_us"].as_f64().unwrap_or(0.0);
        let _ = writeln!(
            t,
            "one spin poll of the used ring: {ns:.0} ns; the guest's wait spins {spin:.0} µs (~{:.0} polls) before \
             sleeping",
            spin * 1000.0 / ns.max(1.0)
        );
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
    fn the_roundtrip_suite_is_one_run_of_the_roundtrip_scenario_with_its_samples() {
        let runs = roundtrip_suite(123, "poll").expand();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].guest.scenario, ROUNDTRIP_SCENARIO);
        assert!(runs[0].guest_params().contains(&("vhca.samples".to_string(), "123".to_string())));
        let m: serde_json::Value = serde_json::json!({
            "vhca_query_device": {"samples": 3, "median_us": 50.0, "p99_us": 90.0, "min_us": 1.0, "max_us": 99.0},
            "rng_read": {"samples": 3, "median_us": 100.0, "p99_us": 90.0, "min_us": 1.0, "max_us": 99.0},
            "spin_poll_ns": 250.0, "spin_us": 50.0,
        });
        let table = render_roundtrip(&m);
        assert!(table.contains("median 0.50x, p99 1.00x"), "{table}");
        // With both rng modes measured, each quantile is taken against the faster one.
        let mut both = m.clone();
        both["rng_read_no_interrupt"] =
            serde_json::json!({"samples": 3, "median_us": 40.0, "p99_us": 180.0, "min_us": 1.0, "max_us": 99.0});
        let table = render_roundtrip(&both);
        assert!(table.contains("median 1.25x, p99 1.00x"), "{table}");
        assert!(
            table.contains("| the same read, interrupts declined (as vhca's queues) | 3 | 40.0 | 180.0 |"),
            "{table}"
        );
        assert!(
            table.contains("one spin poll of the used ring: 250 ns; the guest's wait spins 50 µs (~200 polls)"),
            "{table}"
        );
    }

    #[test]
    fn an_interrupt_round_trip_is_taken_against_the_rng_read_by_interrupt() {
        let series = |median: f64, p99: f64| serde_json::json!({"samples": 3, "median_us": median, "p99_us": p99, "min_us": 1.0, "max_us": 99.0});
        let m = serde_json::json!({
            "completion": "interrupt",
            "vhca_query_device": series(60.0, 150.0),
            "rng_read_interrupt": series(50.0, 100.0),
            "rng_read_interrupt_seen": series(45.0, 90.0),
            "rng_read": series(30.0, 40.0),
            "rng_messages": 9,
        });
        let table = render_roundtrip(&m);
        assert!(table.contains("vhca by interrupt / virtio-rng by interrupt: median 1.20x, p99 1.50x"), "{table}");
        assert!(table.contains("waiting for its MSI-X message | 3 | 60.0 | 150.0 |"), "{table}");
        assert!(table.contains("virtio-rng MSI-X messages in the run: 9"), "{table}");
        assert!(table
            .contains("until the interrupt thread counted its message (the waiter spinning, yielding) | 3 | 45.0 |"));
        let runs = roundtrip_suite(5, "interrupt").expand();
        assert!(runs[0].guest_params().contains(&("vhca.completion".to_string(), "interrupt".to_string())));
    }

    fn mode_run(round: usize, jobs: usize, mode: &str, run_s: &[f64], wall_s: f64) -> ModeMeasurement {
        ModeMeasurement {
            round,
            jobs,
            mode: mode.into(),
            wall_s,
            run_s: run_s.to_vec(),
            runs: run_s.len(),
            passed: run_s.len(),
            off_mode: 0,
        }
    }

    #[test]
    fn the_completion_bench_pools_each_modes_runs_and_gives_ratios_to_the_first_mode() {
        let ms = vec![
            mode_run(1, 1, "poll", &[0.1, 0.2, 0.3], 2.0),
            mode_run(1, 1, "interrupt", &[0.2, 0.3, 0.4], 3.0),
            mode_run(2, 1, "poll", &[0.2, 0.2, 0.2], 4.0),
            mode_run(2, 1, "interrupt", &[0.3, 0.3, 0.3], 5.0),
        ];
        let t = render_completion(&ms);
        assert!(t.contains("| 1 | 1 | interrupt | 3.00 | 0.300 | 0.20–0.40 | 3/3 | 0 |"), "{t}");
        // Pooled: poll's six runs have median 0.2, interrupt's 0.3; walls 3.0 and 4.0.
        assert!(t.contains("-j 1 poll: per-run median 0.200 s, median wall 3.00 s over 2 rounds\n"), "{t}");
        assert!(t.contains("interrupt / poll: per-run median 1.50x, wall 1.33x"), "{t}");
        let runs = with_completion(&roundtrip_suite(1, "poll").expand(), "interrupt");
        assert_eq!(runs[0].guest.extra["completion"], "interrupt", "the mode given wins over the suite's");
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
