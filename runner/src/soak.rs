//! `vhca-run soak -n N`: N back-to-back runs through the same machinery a suite uses, cycling through passes,
//! bugchecks, a device fault, a hang and a guest panic, with the runner's own memory and fds sampled after every run
//! and its children's peak memory alongside. It passes when every verdict is as expected, the runner's fds end where
//! they began, its memory stops growing, and no work dir is left in the temp dir.

use std::path::Path;

use serde::Serialize;
use vhca_suite::{ConcreteRun, Suite};

use crate::run::{Progress, RunContext, RunError};
use crate::suite_run::{one_run, SuiteOptions};

/// The seed runs in the mix, both verifier modes: a pass, two bugchecks and a device fault. Their expectations come
/// from the built-in seed suite, the one place the seed verdicts are written.
const FROM_SEED: [&str; 3] = ["smoke", "fast-mutex-create-cq", "use-after-unmap"];

/// The rest of the mix: the runner's own test modes, a hang and a guest panic.
pub const RIG_FAULTS_SUITE: &str = r#"
name = "soak"
[defaults]
timeout_s = 60

[[run]]
name = "hang"
modes = ["off"]
guest = { scenario = "smoke", silence_s = 5, extra = { init = "hang" } }
expect = "hang"

[[run]]
name = "panic"
modes = ["off"]
guest = { scenario = "smoke", extra = { init = "panic" } }
expect = "guest-panic"
"#;

/// One run of the soak, and the runner as it stood after it.
#[derive(Debug, Clone, Serialize)]
pub struct SoakSample {
    pub index: usize,
    pub run: String,
    pub passed: bool,
    pub seconds: f64,
    /// The runner's resident memory (VmRSS) after the run, KiB.
    pub runner_rss_kib: u64,
    /// The runner's open fds after the run.
    pub runner_fds: usize,
    /// Peak resident memory of the largest child reaped so far (QEMU or vhca-device), KiB: flat if no run grows.
    pub children_peak_rss_kib: u64,
    /// Work dirs (`vhca-run-*`) in the temp dir after the run.
    pub work_dirs_left: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub samples: Vec<SoakSample>,
    pub failed_runs: usize,
    /// The runner's fds before the first run.
    pub fds_before: usize,
    /// Why the soak failed, if it did.
    pub problems: Vec<String>,
}

impl SoakReport {
    pub fn passed(&self) -> bool {
        self.problems.is_empty()
    }
}

pub fn soak_runs() -> Vec<ConcreteRun> {
    // Both suites are constants this crate's tests parse: a parse error is a bug here or in seed.toml.
    let seed = Suite::seed().map(|s| s.expand()).unwrap_or_default();
    let mut runs: Vec<ConcreteRun> =
        // The native personality only: the sys twins of these runs are the parity test's (sys_parity.rs).
        seed.into_iter()
            .filter(|r| r.guest.driver == vhca_suite::DriverKind::Native)
            .filter(|r| FROM_SEED.iter().any(|name| r.name.split('/').next() == Some(name)))
            .collect();
    runs.extend(Suite::parse(RIG_FAULTS_SUITE, "<soak>").map(|s| s.expand()).unwrap_or_default());
    runs
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn children_peak_rss_kib() -> u64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_CHILDREN with a valid out pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) } != 0 {
        return 0;
    }
    u64::try_from(usage.ru_maxrss).unwrap_or(0)
}

fn work_dirs(temp: &Path) -> usize {
    std::fs::read_dir(temp)
        .map(|d| d.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("vhca-run-")).count())
        .unwrap_or(0)
}

/// Runs `n` runs one after the other, calling `on` with each sample as it is taken. Err only for an interrupt.
pub fn soak(
    ctx: &RunContext,
    n: usize,
    opts: &SuiteOptions,
    on: &mut dyn FnMut(&SoakSample),
) -> Result<SoakReport, RunError> {
    let runs = soak_runs();
    let temp = std::env::temp_dir();
    let fds_before = open_fds();
    let mut samples = Vec::with_capacity(n);
    let mut quiet = |_: Progress| {};
    for (index, run) in runs.iter().cycle().take(n).enumerate() {
        let report = one_run(ctx, run, opts, &mut quiet)?;
        let sample = SoakSample {
            index,
            run: run.name.clone(),
            passed: report.passed(),
            seconds: report.seconds,
            runner_rss_kib: rss_kib(),
            runner_fds: open_fds(),
            children_peak_rss_kib: children_peak_rss_kib(),
            work_dirs_left: work_dirs(&temp),
        };
        on(&sample);
        samples.push(sample);
    }
    let problems = judge(&samples, fds_before);
    let failed_runs = samples.iter().filter(|s| !s.passed).count();
    Ok(SoakReport { samples, failed_runs, fds_before, problems })
}

/// What makes a soak fail: a wrong verdict, an fd or work dir left after a run, or memory that keeps growing (the
/// last tenth of the runs above the first tenth, after the first run's warm-up, by more than 8 MiB).
pub fn judge(samples: &[SoakSample], fds_before: usize) -> Vec<String> {
    let mut problems = Vec::new();
    for s in samples {
        if !s.passed {
            problems.push(format!("run {} ({}) did not get its expected verdict", s.index, s.run));
        }
        if s.runner_fds != fds_before {
            problems.push(format!(
                "after run {} the runner has {} fds, {} before the soak",
                s.index, s.runner_fds, fds_before
            ));
        }
        if s.work_dirs_left != 0 {
            problems.push(format!("after run {}: {} work dirs left in the temp dir", s.index, s.work_dirs_left));
        }
    }
    let tenth = (samples.len() / 10).max(1);
    if samples.len() > 2 * tenth + 1 {
        let mean = |s: &[SoakSample]| s.iter().map(|x| x.runner_rss_kib).sum::<u64>() / s.len() as u64;
        let (early, late) = (mean(&samples[1..1 + tenth]), mean(&samples[samples.len() - tenth..]));
        if late > early + 8 * 1024 {
            problems.push(format!("the runner's memory grew from {early} KiB to {late} KiB over the soak"));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(index: usize, rss: u64, fds: usize) -> SoakSample {
        SoakSample {
            index,
            run: "smoke/verifier-off".into(),
            passed: true,
            seconds: 1.0,
            runner_rss_kib: rss,
            runner_fds: fds,
            children_peak_rss_kib: 0,
            work_dirs_left: 0,
        }
    }

    #[test]
    fn the_mix_parses_and_covers_every_verdict_kind() {
        let runs = soak_runs();
        assert_eq!(runs.len(), 8);
        let kinds: std::collections::BTreeSet<String> =
            runs.iter().map(|r| r.expected.to_string().split(' ').next().unwrap().to_string()).collect();
        let want: std::collections::BTreeSet<String> =
            ["pass", "bugcheck", "device-fault", "hang", "guest-panic"].iter().map(|s| s.to_string()).collect();
        assert_eq!(kinds, want);
    }

    #[test]
    fn growth_leaks_and_failures_fail_the_soak() {
        let flat: Vec<SoakSample> = (0..30).map(|i| sample(i, 20_000, 5)).collect();
        assert!(judge(&flat, 5).is_empty());
        let growing: Vec<SoakSample> = (0..30).map(|i| sample(i, 20_000 + 1024 * i as u64, 5)).collect();
        assert!(judge(&growing, 5).iter().any(|p| p.contains("memory grew")));
        let mut leaking = flat.clone();
        leaking[7].runner_fds = 6;
        assert!(judge(&leaking, 5).iter().any(|p| p.contains("after run 7")));
        let mut failing = flat;
        failing[3].passed = false;
        assert!(judge(&failing, 5).iter().any(|p| p.contains("run 3")));
    }
}
