//! `vhca-run soak -n N`: N back-to-back runs through the same machinery a suite uses, cycling through passes,
//! bugchecks, a device fault, a hang, a guest panic, and runs whose QEMU or device the soak kills mid-run. After every
//! run it samples the runner's own memory, fds and locks, and every run samples its vhca-device's and QEMU's memory
//! and fds while it is live (`proc_usage`). It passes when every verdict is as expected, the runner's fds and locks end
//! where they began, no child, work dir or socket outlives its run, and no one's memory or fds grow over the soak.

use std::path::Path;
use std::sync::Arc;

use serde::Serialize;
use vhca_suite::{Actual, ConcreteRun, Suite};

use crate::next_guest;
use crate::phase_hook::{self, Phase};
use crate::proc_usage::{self, Pair};
use crate::run::RunError;
use crate::run_context::RunContext;
use crate::run_progress::Progress;
use crate::suite_run::{one_run, SuiteOptions};
use crate::supervise::process_alive;

/// The seed runs in the mix, both verifier modes: a pass, two bugchecks and a device fault. Their expectations come
/// from the built-in seed suite, the one place the seed verdicts are written.
const FROM_SEED: [&str; 3] = ["smoke", "fast-mutex-create-cq", "use-after-unmap"];

/// The rest of the mix: the runner's own test modes, a hang and a guest panic, and two hung guests whose QEMU or device
/// the soak kills mid-run (`KILLED`: their suite expectation is replaced by the device failure the kill must give;
/// the long silence limit keeps the hang from coming first).
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

[[run]]
name = "qemu-killed"
modes = ["off"]
guest = { scenario = "smoke", silence_s = 30, extra = { init = "hang" } }
expect = "hang"

[[run]]
name = "device-killed"
modes = ["off"]
guest = { scenario = "smoke", silence_s = 30, extra = { init = "hang" } }
expect = "hang"
"#;

/// Which child of a run the soak kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Victim {
    Qemu,
    Device,
}

/// The runs whose child is SIGKILLed at the run's first console output, and the device failure each must then be
/// judged (the verdict's words, as `ProcessExit::describe` writes them).
const KILLED: [(&str, Victim, &str); 2] = [
    ("qemu-killed/verifier-off", Victim::Qemu, "QEMU killed by signal 9 (SIGKILL)"),
    ("device-killed/verifier-off", Victim::Device, "vhca-device killed by signal 9 (SIGKILL)"),
];

/// One run of the soak, and the runner and the run's children as they stood.
#[derive(Debug, Clone, Serialize)]
pub struct SoakSample {
    pub index: usize,
    pub run: String,
    /// What the soak expected: the suite's expectation, or for a killed run the device failure naming the victim.
    pub expected: String,
    pub actual: String,
    pub passed: bool,
    pub seconds: f64,
    /// The runner's resident memory (VmRSS) after the run, KiB.
    pub runner_rss_kib: u64,
    /// The runner's open fds after the run.
    pub runner_fds: usize,
    /// Locks the runner holds after the run (/proc/locks lines with its pid).
    pub runner_locks: usize,
    /// The run's vhca-device and QEMU at the guest's first console output (both live; for a killed run, just before
    /// the kill) and at its result or crash line, else when its wait ended (None for a process already exiting).
    pub at_first_output: Pair,
    pub at_end: Pair,
    /// Peak resident memory of the largest child reaped so far (QEMU or vhca-device), KiB: flat if no run grows.
    pub children_peak_rss_kib: u64,
    /// The runner's children still there after the run (alive or unreaped), and the run's own device or QEMU if alive.
    pub processes_left: Vec<u32>,
    /// Work dirs (`vhca-run-*`) in the temp dir after the run, the kept guest's not counted.
    pub work_dirs_left: usize,
    /// A guest the run left clean is kept for the next run (its QEMU, sockets and work dir live on).
    pub guest_kept: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub samples: Vec<SoakSample>,
    pub failed_runs: usize,
    /// The runner's fds and locks before the first run.
    pub fds_before: usize,
    pub locks_before: usize,
    /// The device's and QEMU's memory and fds over the soak (`growth`).
    pub growth: Vec<Growth>,
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
    let runs: Vec<ConcreteRun> =
        // The native personality only: the sys twins of these runs are the parity test's (sys_parity.rs).
        seed.into_iter()
            .filter(|r| r.guest.driver == vhca_suite::Personality::Native)
            .filter(|r| FROM_SEED.iter().any(|name| r.name.split('/').next() == Some(name)))
            .collect();
    let rig: Vec<ConcreteRun> = Suite::parse(RIG_FAULTS_SUITE, "<soak>").map(|s| s.expand()).unwrap_or_default();
    // Each kill follows a run that leaves its guest clean, so it hits a reused guest: smoke/off, QEMU killed,
    // smoke/on, device killed, then the rest in suite order.
    let (kills, rest): (Vec<ConcreteRun>, Vec<ConcreteRun>) =
        rig.into_iter().partition(|r| KILLED.iter().any(|(name, _, _)| *name == r.name));
    let mut order = Vec::new();
    let mut kills = kills.into_iter();
    for (i, run) in runs.into_iter().enumerate() {
        order.push(run);
        // After each of the first two seed runs (smoke, both modes), which leave their guest clean.
        if i < 2 {
            order.extend(kills.next());
        }
    }
    order.extend(kills);
    order.extend(rest);
    order
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

/// The runner's children, zombies included: between runs it has none.
fn children() -> Vec<u32> {
    let me = std::process::id().to_string();
    let Ok(proc) = std::fs::read_dir("/proc") else { return Vec::new() };
    proc.flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // After the parenthesised name: state, then ppid.
            stat.rsplit_once(") ").and_then(|(_, rest)| rest.split(' ').nth(1)).is_some_and(|ppid| ppid == me)
        })
        .collect()
}

/// Locks held by this process: /proc/locks names the owner's pid in its fifth column.
fn locks_held() -> usize {
    let me = std::process::id().to_string();
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    locks.lines().filter(|l| l.split_whitespace().nth(4) == Some(me.as_str())).count()
}

/// Kills the victim at the run's first console output: removed again when dropped, whatever the run came to.
struct KillAtMidRun;

impl KillAtMidRun {
    fn arm(victim: Victim) -> KillAtMidRun {
        phase_hook::set(Some(Arc::new(move |phase, pids| {
            let pid = match victim {
                Victim::Qemu => pids.qemu,
                Victim::Device => pids.device,
            };
            if let (Phase::MidRun, Some(pid)) = (phase, pid.and_then(|p| libc::pid_t::try_from(p).ok())) {
                // SAFETY: kill(2) on a child of this runner that is not reaped yet (the run holds its guard), so the
                // pid is still that child's; it touches no memory.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        })));
        KillAtMidRun
    }
}

impl Drop for KillAtMidRun {
    fn drop(&mut self) {
        phase_hook::set(None);
    }
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
    let fds_before = proc_usage::of("self").map_or(0, |u| u.fds);
    let locks_before = locks_held();
    let mut samples = Vec::with_capacity(n);
    let mut quiet = |_: Progress| {};
    proc_usage::collect(true);
    for (index, run) in runs.iter().cycle().take(n).enumerate() {
        let killed = KILLED.iter().find(|(name, _, _)| *name == run.name);
        let armed = killed.map(|(_, victim, _)| KillAtMidRun::arm(*victim));
        let _ = proc_usage::take_last();
        // As in a suite: a guest the run leaves clean serves the next run.
        next_guest::expect_more_runs(index + 1 < n);
        let report = one_run(ctx, run, opts, &mut quiet)?;
        drop(armed);
        let children_usage = proc_usage::take_last().unwrap_or_default();
        let (expected, passed) = match killed {
            Some((_, _, words)) => (
                format!("device-failure: {words}"),
                matches!(&report.actual, Actual::DeviceFailure { detail } if detail.contains(words)),
            ),
            None => (report.expected.to_string(), report.passed()),
        };
        // The guest kept for the next run is no leftover: its QEMU and work dir live on by design (and are checked
        // at the soak's end, once it is dropped).
        let kept = next_guest::kept_guest();
        let kept_pid = kept.as_ref().map(|(pid, _)| *pid);
        let mut processes_left: Vec<u32> = children().into_iter().filter(|pid| Some(*pid) != kept_pid).collect();
        for pid in [children_usage.device_pid, children_usage.qemu_pid].into_iter().flatten() {
            if process_alive(pid) && !processes_left.contains(&pid) && Some(pid) != kept_pid {
                processes_left.push(pid);
            }
        }
        let me = proc_usage::of("self");
        let sample = SoakSample {
            index,
            run: run.name.clone(),
            expected,
            actual: report.actual_text.clone(),
            passed,
            seconds: report.seconds,
            runner_rss_kib: me.map_or(0, |u| u.rss_kib),
            runner_fds: me.map_or(0, |u| u.fds),
            runner_locks: locks_held(),
            at_first_output: children_usage.first_output,
            at_end: children_usage.end,
            children_peak_rss_kib: children_peak_rss_kib(),
            processes_left,
            work_dirs_left: work_dirs(&temp).saturating_sub(usize::from(kept.is_some())),
            guest_kept: kept.is_some(),
        };
        on(&sample);
        samples.push(sample);
    }
    next_guest::discard();
    let growth = children_growth(&samples);
    let mut problems = judge(&samples, fds_before, locks_before);
    // With the last guest dropped, the runner is back where it began.
    let (left, dirs) = (children(), work_dirs(&temp));
    let me = proc_usage::of("self").map_or(0, |u| u.fds);
    if !left.is_empty() || dirs != 0 || me != fds_before || locks_held() != locks_before {
        problems.push(format!(
            "after the soak: processes {left:?}, {dirs} work dirs, {me} fds ({fds_before} before), {} locks ({} before)",
            locks_held(),
            locks_before
        ));
    }
    problems.extend(growth.iter().filter_map(Growth::problem));
    let failed_runs = samples.iter().filter(|s| !s.passed).count();
    Ok(SoakReport { samples, failed_runs, fds_before, locks_before, growth, problems })
}

/// What makes a soak fail: a wrong verdict; an fd, lock, process or work dir left after a run; runner memory that
/// keeps growing (the last tenth of the runs above the first tenth, after the first run's warm-up, by more than
/// 8 MiB). The children's growth is `children_growth`'s.
pub fn judge(samples: &[SoakSample], fds_before: usize, locks_before: usize) -> Vec<String> {
    let mut problems = Vec::new();
    // While a guest is kept for the next run, the runner holds its sockets, console log and work-dir lock: the same
    // count every time one is kept.
    let kept = samples.iter().find(|s| s.guest_kept).map(|s| (s.runner_fds, s.runner_locks));
    for s in samples {
        let ((fds_before, locks_before), when) = match (s.guest_kept, kept) {
            (true, Some(baseline)) => (baseline, "when a guest was first kept"),
            _ => ((fds_before, locks_before), "before the soak"),
        };
        if !s.passed {
            problems.push(format!(
                "run {} ({}) did not get its expected verdict: expected {}, got {}",
                s.index, s.run, s.expected, s.actual
            ));
        }
        if s.runner_fds != fds_before {
            problems.push(format!("after run {} the runner has {} fds, {} {when}", s.index, s.runner_fds, fds_before));
        }
        if s.runner_locks != locks_before {
            problems.push(format!(
                "after run {} the runner holds {} locks, {} {when}",
                s.index, s.runner_locks, locks_before
            ));
        }
        if !s.processes_left.is_empty() {
            problems.push(format!("after run {}: processes left {:?}", s.index, s.processes_left));
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

/// One child metric over the soak. Each run has its own vhca-device and QEMU, so "does not grow" means the per-run
/// values show no upward trend: every value is taken relative to a baseline of its run kind (a bugcheck run's QEMU
/// is not a hang run's), and the last quarter of the sampled runs must not sit above the first quarter by more than
/// the tolerance, both quarters summed up by the metric's `Reading`.
#[derive(Debug, Clone, Serialize)]
pub struct Growth {
    pub what: &'static str,
    pub reading: Reading,
    pub samples: usize,
    /// First and last sampled values, as they were.
    pub first: u64,
    pub last: u64,
    /// The first and the last quarter's deviation from the run kind's baseline, as `reading` sums them up.
    pub early: i64,
    pub late: i64,
    pub tolerance: i64,
}

/// How a metric's readings are summed up, chosen by which way its noise goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reading {
    /// Memory: the guest keeps touching pages while the run is read, so a reading taken a little later is higher and
    /// never lower; the noise is one-sided. Measured on the CI machine: QEMU at the first output 139.4-139.9 MiB in
    /// most runs of a kind and ~148.7 MiB in 11 of 30 (the same kind, the same commit), which put the median of one
    /// quarter 9 MiB up with nothing leaking. A leak carried from run to run lifts every reading, the lowest too, so
    /// the baseline is the kind's lowest reading and a quarter counts by its lowest deviation.
    Floor,
    /// Counts such as fds: a child read while it sets up or tears down a queue has one more or one fewer, both ways;
    /// the baseline is the kind's median and a quarter counts by its median deviation.
    Median,
}

impl Reading {
    fn of(self, values: &mut [i64]) -> i64 {
        match self {
            Reading::Floor => values.iter().copied().min().unwrap_or(0),
            Reading::Median => median(values),
        }
    }

    fn words(self) -> &'static str {
        match self {
            Reading::Floor => "lowest",
            Reading::Median => "median",
        }
    }
}

impl Growth {
    fn problem(&self) -> Option<String> {
        (self.late - self.early > self.tolerance).then(|| {
            format!(
                "{} grew over the soak: {} above its run kind's {} in the last quarter, {} in the first (tolerance {})",
                self.what,
                self.late,
                self.reading.words(),
                self.early,
                self.tolerance
            )
        })
    }

    /// The line the soak prints for this metric.
    pub fn summary(&self) -> String {
        let words = self.reading.words();
        format!(
            "{}: first {} last {}; {words} above its run kind's {words}: first quarter {}, last quarter {} (tolerance {})",
            self.what, self.first, self.last, self.early, self.late, self.tolerance
        )
    }
}

/// RSS tolerances. A leak a run leaves to the next (an fd inherited, a file that grows) adds up run after run, while
/// runs of one kind spread by the guest's timing at the reading. Measured (docs/fuzz.md): the device is about 4.4 MiB
/// with the runs of a kind within 0.4 MiB; QEMU about 137-165 MiB with the runs of a kind in two groups 9 MiB apart
/// (see `Reading::Floor`), and below the upper group, within 2.5 MiB. Floors compared, so the device's 1 MiB is 2.5
/// times its spread and QEMU's 8 MiB is three times the spread of its lower group; a QEMU leak of 0.7 MiB a run
/// fails a 30-run soak even on readings as split as the CI run's (0.4 MiB on readings all in the lower group), and the
/// 200-run soak one of about 0.1 MiB.
const DEVICE_RSS_TOLERANCE_KIB: i64 = 1024;
const QEMU_RSS_TOLERANCE_KIB: i64 = 8 * 1024;
/// fds: a run's children open the same files every run, but a QEMU or device read while it sets up or tears down a
/// vhost-user queue has a few more or fewer; 2 absorbs a median moved by one such reading.
const FD_TOLERANCE: i64 = 2;

/// The device's and QEMU's memory and fds at both reading points over the soak; at least 8 readings of a metric are
/// needed to judge it.
pub fn children_growth(samples: &[SoakSample]) -> Vec<Growth> {
    type Pick = fn(&SoakSample) -> Option<u64>;
    use Reading::{Floor, Median};
    let metrics: [(&'static str, Pick, Reading, i64); 8] = [
        (
            "vhca-device RSS at first output (KiB)",
            |s| s.at_first_output.device.map(|u| u.rss_kib),
            Floor,
            DEVICE_RSS_TOLERANCE_KIB,
        ),
        ("vhca-device fds at first output", |s| s.at_first_output.device.map(|u| u.fds as u64), Median, FD_TOLERANCE),
        (
            "QEMU RSS at first output (KiB)",
            |s| s.at_first_output.qemu.map(|u| u.rss_kib),
            Floor,
            QEMU_RSS_TOLERANCE_KIB,
        ),
        ("QEMU fds at first output", |s| s.at_first_output.qemu.map(|u| u.fds as u64), Median, FD_TOLERANCE),
        ("vhca-device RSS at the end (KiB)", |s| s.at_end.device.map(|u| u.rss_kib), Floor, DEVICE_RSS_TOLERANCE_KIB),
        ("vhca-device fds at the end", |s| s.at_end.device.map(|u| u.fds as u64), Median, FD_TOLERANCE),
        ("QEMU RSS at the end (KiB)", |s| s.at_end.qemu.map(|u| u.rss_kib), Floor, QEMU_RSS_TOLERANCE_KIB),
        ("QEMU fds at the end", |s| s.at_end.qemu.map(|u| u.fds as u64), Median, FD_TOLERANCE),
    ];
    metrics
        .into_iter()
        .filter_map(|(what, pick, reading, tolerance)| growth(samples, what, pick, reading, tolerance))
        .collect()
}

fn median(values: &mut [i64]) -> i64 {
    values.sort_unstable();
    values[values.len() / 2]
}

fn growth(
    samples: &[SoakSample],
    what: &'static str,
    pick: fn(&SoakSample) -> Option<u64>,
    reading: Reading,
    tolerance: i64,
) -> Option<Growth> {
    let taken: Vec<(&str, i64)> =
        samples.iter().filter_map(|s| Some((s.run.as_str(), i64::try_from(pick(s)?).ok()?))).collect();
    if taken.len() < 8 {
        return None;
    }
    let mut kinds: std::collections::BTreeMap<&str, Vec<i64>> = std::collections::BTreeMap::new();
    for (run, v) in &taken {
        kinds.entry(run).or_default().push(*v);
    }
    let baselines: std::collections::BTreeMap<&str, i64> =
        kinds.into_iter().map(|(run, mut values)| (run, reading.of(&mut values))).collect();
    let deviations: Vec<i64> = taken.iter().map(|(run, v)| v - baselines[run]).collect();
    let quarter = deviations.len() / 4;
    Some(Growth {
        what,
        reading,
        samples: taken.len(),
        first: taken[0].1 as u64,
        last: taken[taken.len() - 1].1 as u64,
        early: reading.of(&mut deviations[..quarter].to_vec()),
        late: reading.of(&mut deviations[deviations.len() - quarter..].to_vec()),
        tolerance,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc_usage::ProcUsage;

    fn sample(index: usize, rss: u64, fds: usize) -> SoakSample {
        SoakSample {
            index,
            run: "smoke/verifier-off".into(),
            passed: true,
            seconds: 1.0,
            expected: "pass".into(),
            actual: "pass".into(),
            runner_rss_kib: rss,
            runner_fds: fds,
            runner_locks: 1,
            at_first_output: Pair {
                device: Some(ProcUsage { rss_kib: 9000, fds: 20 }),
                qemu: Some(ProcUsage { rss_kib: 300_000, fds: 40 }),
            },
            at_end: Pair::default(),
            children_peak_rss_kib: 0,
            processes_left: vec![],
            work_dirs_left: 0,
            guest_kept: false,
        }
    }

    #[test]
    fn a_kept_guest_holds_the_same_fds_each_time_and_a_leak_under_it_still_fails() {
        // Runs 1, 2, 4 keep their guest (its sockets and lock: 4 fds, 1 lock more), 0 and 3 do not.
        let kept = |i: usize, extra: usize| {
            let mut s = sample(i, 20_000, 5 + extra);
            s.guest_kept = true;
            s.runner_locks = 2;
            s
        };
        let fine = vec![sample(0, 20_000, 5), kept(1, 4), kept(2, 4), sample(3, 20_000, 5), kept(4, 4)];
        assert_eq!(judge(&fine, 5, 1), Vec::<String>::new());
        // One fd more each time a guest is kept: a leak, whatever the guest holds.
        let leaking = vec![sample(0, 20_000, 5), kept(1, 4), kept(2, 5), sample(3, 20_000, 5), kept(4, 6)];
        let problems = judge(&leaking, 5, 1);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems[0].contains("after run 2 the runner has 10 fds, 9 when a guest was first kept"),
            "{problems:?}"
        );
        // A run that keeps no guest must be back at the soak's start.
        let left = vec![sample(0, 20_000, 5), kept(1, 4), sample(2, 20_000, 6)];
        assert_eq!(judge(&left, 5, 1).len(), 1);
    }

    #[test]
    fn the_mix_parses_and_covers_every_verdict_kind() {
        let runs = soak_runs();
        assert_eq!(runs.len(), 10);
        let kinds: std::collections::BTreeSet<String> =
            runs.iter().map(|r| r.expected.to_string().split(' ').next().unwrap().to_string()).collect();
        let want: std::collections::BTreeSet<String> =
            ["pass", "bugcheck", "device-fault", "hang", "guest-panic"].iter().map(|s| s.to_string()).collect();
        assert_eq!(kinds, want);
        for (name, _, _) in KILLED {
            assert!(runs.iter().any(|r| r.name == name), "{name} is not in the mix");
        }
    }

    #[test]
    fn a_child_that_grows_from_run_to_run_fails_the_soak_and_kinds_do_not_count_as_growth() {
        // Ten kinds in the mix, each with its own size; flat over time: no growth.
        let kind = |i: usize| format!("kind-{}", i % 10);
        let mut flat: Vec<SoakSample> = (0..60).map(|i| sample(i, 20_000, 5)).collect();
        for (i, s) in flat.iter_mut().enumerate() {
            s.run = kind(i);
            s.at_first_output.qemu = Some(ProcUsage { rss_kib: 200_000 + 50_000 * (i % 10) as u64, fds: 40 + i % 10 });
        }
        let growth = children_growth(&flat);
        // Nothing read at the end in these samples: only the four first-output metrics are judged.
        assert_eq!(growth.len(), 4);
        assert!(growth.iter().all(|g| g.problem().is_none()), "{growth:?}");
        // One fd more for every run, in QEMU: the last quarter is far above the first.
        let mut leaking = flat.clone();
        for (i, s) in leaking.iter_mut().enumerate() {
            s.at_first_output.qemu = s.at_first_output.qemu.map(|u| ProcUsage { fds: u.fds + i, ..u });
        }
        let problems: Vec<String> = children_growth(&leaking).iter().filter_map(Growth::problem).collect();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("QEMU fds at first output grew"), "{problems:?}");
        // 1 MiB more device memory every run.
        let mut growing = flat;
        for (i, s) in growing.iter_mut().enumerate() {
            s.at_first_output.device =
                s.at_first_output.device.map(|u| ProcUsage { rss_kib: u.rss_kib + 1024 * i as u64, ..u });
        }
        let problems: Vec<String> = children_growth(&growing).iter().filter_map(Growth::problem).collect();
        assert!(problems.len() == 1 && problems[0].starts_with("vhca-device RSS at first output"), "{problems:?}");
    }

    /// QEMU's RSS at the first output in the CI run of b137468 that failed the soak under the old medians (the mix's
    /// ten kinds in order, three times): 11 of the 30 near 148.7 MiB, the rest near 139.5 MiB, nothing leaking.
    const CI_QEMU_FIRST_OUTPUT_KIB: [u64; 30] = [
        139444, 149032, 148700, 139624, 139508, 139696, 139708, 139756, 144636, 139560, 137424, 139652, 146548, 139808,
        148804, 139696, 139760, 137436, 139668, 139684, 139704, 148792, 148628, 149088, 139416, 139860, 148732, 148816,
        139656, 148780,
    ];

    fn mix_with_qemu_at_first_output(rss: impl Fn(usize) -> u64) -> Vec<SoakSample> {
        let runs = soak_runs();
        (0..30)
            .map(|i| {
                let mut s = sample(i, 20_000, 5);
                s.run = runs[i % runs.len()].name.to_string();
                s.at_first_output.qemu = Some(ProcUsage { rss_kib: rss(i), fds: 27 });
                s
            })
            .collect()
    }

    #[test]
    fn memory_read_late_in_some_runs_is_not_growth_but_a_leak_under_it_is() {
        let ci = mix_with_qemu_at_first_output(|i| CI_QEMU_FIRST_OUTPUT_KIB[i]);
        let growth = children_growth(&ci);
        let qemu = growth.iter().find(|g| g.what == "QEMU RSS at first output (KiB)").unwrap();
        assert_eq!(qemu.reading, Reading::Floor);
        assert!(qemu.problem().is_none(), "{qemu:?}");
        // The same readings with 0.75 MiB more every run: the lowest of the last quarter rises past the tolerance. (On
        // these readings 0.7 MiB a run is the least that fails: a kind whose first reading was in the upper group has
        // a baseline 9 MiB high. Without that group, 0.4 MiB would.)
        let leaking = mix_with_qemu_at_first_output(|i| CI_QEMU_FIRST_OUTPUT_KIB[i] + 768 * i as u64);
        let problems: Vec<String> = children_growth(&leaking).iter().filter_map(Growth::problem).collect();
        assert!(problems.len() == 1 && problems[0].starts_with("QEMU RSS at first output (KiB) grew"), "{problems:?}");
    }

    #[test]
    fn growth_leaks_and_failures_fail_the_soak() {
        let flat: Vec<SoakSample> = (0..30).map(|i| sample(i, 20_000, 5)).collect();
        assert!(judge(&flat, 5, 1).is_empty());
        let growing: Vec<SoakSample> = (0..30).map(|i| sample(i, 20_000 + 1024 * i as u64, 5)).collect();
        assert!(judge(&growing, 5, 1).iter().any(|p| p.contains("memory grew")));
        let mut leaking = flat.clone();
        leaking[7].runner_fds = 6;
        assert!(judge(&leaking, 5, 1).iter().any(|p| p.contains("after run 7")));
        let mut failing = flat.clone();
        failing[3].passed = false;
        assert!(judge(&failing, 5, 1).iter().any(|p| p.contains("run 3")));
        let mut locked = flat.clone();
        locked[4].runner_locks = 2;
        assert!(judge(&locked, 5, 1).iter().any(|p| p.contains("after run 4 the runner holds 2 locks")));
        let mut orphan = flat;
        orphan[5].processes_left = vec![4242];
        assert!(judge(&orphan, 5, 1).iter().any(|p| p.contains("after run 5: processes left [4242]")));
    }
}
