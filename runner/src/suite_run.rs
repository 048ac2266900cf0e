//! Running a list of concrete runs: up to `jobs` at a time on worker threads, each judged by vhca-suite as it ends and
//! stored as artifacts, then the runs the recording runs' failure points expand to (the exhaustive low-resources
//! mode) and their schedule choices (the interleaving modes), then one `SuiteReport`. An interrupt or a runner panic stops every worker's children.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::Instant;

use vhca_suite::{
    completion_seen, expand_interleavings, expand_recording, fault_points, injected_faults, judge_fail_point,
    judge_interleaving, judge_run, races, schedule_points, schedule_points_dropped, schedule_points_passed,
    unreached_timing_counted_points, BootPath, ConcreteRun, Observation, Outcome, RunReport, Suite, SuiteReport,
};

use crate::artifacts;
use crate::finished_runs;
use crate::next_guest;
use crate::phase_hook::{self, Phase, Pids};
use crate::run::{execute, RunError, RunRecord};
use crate::run_context::RunContext;
use crate::run_progress::Progress;
use crate::supervise::interrupted;

/// How a suite is run and where its files go.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    pub jobs: usize,
    /// Artifact folders go to `<artifacts>/<run>/verifier-<mode>/`.
    pub artifacts: Option<PathBuf>,
    /// The reproducer's program and suite file (None: the built-in suite).
    pub program: String,
    pub suite_file: Option<String>,
    /// A recording run (`each_fail_point`) that passed is followed by one run per failure point it found; off for
    /// `boot`, which runs exactly the one run it names.
    pub expand_fail_points: bool,
}

/// What the UI hears while the suite runs.
#[derive(Debug, Clone)]
pub enum SuiteEvent {
    Started {
        index: usize,
        name: String,
    },
    Progress(Progress),
    Finished {
        index: usize,
        report: Box<RunReport>,
    },
    /// Recording runs found `runs` failure points or schedule choices, each now a run of its own; `what` says
    /// which, and what a budget left out.
    Expanded {
        runs: usize,
        what: String,
    },
}

/// Runs `runs` (from `suite`) and reports every one; then, with `expand_fail_points`, the failure points every
/// recording run found, one run each. Err only for an interrupt (or a panic, which propagates).
pub fn run_suite(
    ctx: &RunContext,
    suite: &Suite,
    runs: &[ConcreteRun],
    opts: &SuiteOptions,
    on: &mut dyn FnMut(SuiteEvent),
) -> Result<SuiteReport, RunError> {
    let start = Instant::now();
    if let Some(root) = &opts.artifacts {
        finished_runs::begin(root);
    }
    let mut reports = run_batch(ctx, runs, 0, opts, on)?;
    if opts.expand_fail_points {
        // A recording that failed has no trustworthy list: its own verdict says so, and nothing expands.
        let mut more: Vec<ConcreteRun> = Vec::new();
        let (mut fail_points, mut schedules, mut left_out) = (0, 0, 0);
        for (run, report) in runs.iter().zip(reports.iter_mut()).filter(|(_, report)| report.passed()) {
            let points = expand_recording(run, &report.fault_points);
            fail_points += points.len();
            more.extend(points);
            let expanded = expand_interleavings(run, &report.schedule_points, report.schedule_points_passed);
            if let Some(plan) = run.interleaving.plan {
                report.notes.push(format!(
                    "interleavings {}: {} run(s), {} schedule choice(s) left out by max_interleavings = {}",
                    plan.expansion,
                    expanded.runs.len(),
                    expanded.left_out,
                    plan.budget
                ));
            }
            (schedules, left_out) = (schedules + expanded.runs.len(), left_out + expanded.left_out);
            more.extend(expanded.runs);
        }
        if !more.is_empty() {
            let what = format!(
                "{fail_points} failure point(s) and {schedules} schedule choice(s) recorded: one run each{}",
                if left_out > 0 {
                    format!(" ({left_out} schedule choice(s) left out by the budgets)")
                } else {
                    String::new()
                }
            );
            on(SuiteEvent::Expanded { runs: more.len(), what });
            reports.extend(run_batch(ctx, &more, runs.len(), opts, on)?);
        }
    }
    Ok(SuiteReport::new(suite, reports, start.elapsed().as_secs_f64()))
}

/// Runs `runs` on up to `jobs` workers; event indexes start at `first_index`. Reports in `runs` order.
fn run_batch(
    ctx: &RunContext,
    runs: &[ConcreteRun],
    first_index: usize,
    opts: &SuiteOptions,
    on: &mut dyn FnMut(SuiteEvent),
) -> Result<Vec<RunReport>, RunError> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<RunReport>>> = Mutex::new(vec![None; runs.len()]);
    let failure: Mutex<Option<RunError>> = Mutex::new(None);
    let (tx, rx) = mpsc::channel::<SuiteEvent>();
    std::thread::scope(|scope| {
        for _ in 0..opts.jobs.clamp(1, runs.len().max(1)) {
            let tx = tx.clone();
            let (next, results, failure) = (&next, &results, &failure);
            scope.spawn(move || loop {
                if interrupted() {
                    return;
                }
                let slot = next.fetch_add(1, Ordering::SeqCst);
                let Some(run) = runs.get(slot) else { return next_guest::discard() };
                let index = first_index + slot;
                // A guest is loaded ahead for this worker's next run only while runs are left to take.
                next_guest::expect_more_runs(slot + 1 < runs.len());
                let _ = tx.send(SuiteEvent::Started { index, name: run.name.clone() });
                let mut progress = |p: Progress| {
                    let _ = tx.send(SuiteEvent::Progress(p));
                };
                match one_run(ctx, run, opts, &mut progress) {
                    Ok(report) => {
                        let report = record_finished(opts, report);
                        let _ = tx.send(SuiteEvent::Finished { index, report: Box::new(report.clone()) });
                        if let Ok(mut r) = results.lock() {
                            r[slot] = Some(report);
                        }
                    }
                    Err(e) => {
                        if let Ok(mut f) = failure.lock() {
                            f.get_or_insert(e);
                        }
                        return;
                    }
                }
            });
        }
        // Only the workers hold senders now: the loop ends when the last worker does.
        drop(tx);
        for event in rx {
            on(event);
        }
    });
    if let Some(e) = failure.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok(results.into_inner().unwrap_or_default().into_iter().flatten().collect())
}

/// Puts the run's report on disk as soon as it is judged (see `finished_runs`); a failure to is noted in it.
fn record_finished(opts: &SuiteOptions, mut report: RunReport) -> RunReport {
    if let Some(root) = &opts.artifacts {
        if let Err(e) = finished_runs::record(root, &report) {
            report.notes.push(format!("report not written to {} as the run ended: {e}", root.display()));
        }
    }
    report
}

/// Executes, judges and stores one run. A runner error other than an interrupt (QEMU would not start, the work dir
/// could not be written) becomes that run's device failure, so one broken run does not hide the others.
pub fn one_run(
    ctx: &RunContext,
    run: &ConcreteRun,
    opts: &SuiteOptions,
    on: &mut dyn FnMut(Progress),
) -> Result<RunReport, RunError> {
    let mut again = None;
    for attempt in 1..=2 {
        let mut record = match execute(ctx, run, on) {
            Ok(record) => record,
            Err(e) if e.is_interrupt() => return Err(e),
            Err(e) => {
                let observation = Observation { rig_problems: vec![format!("runner: {e}")], ..Observation::default() };
                let path = if ctx.snapshot.is_some() { BootPath::Snapshot } else { BootPath::Cold };
                let mut report = RunReport::new(run, judge_run(run, &observation), 0.0, ctx.accel.name(), path);
                report.set_reproducer(&opts.program, opts.suite_file.as_deref());
                return Ok(report);
            }
        };
        // A preempt run whose ISR or DPC thread made fewer points than its recording (the host coalesced the
        // interrupts) did not meet the schedule it names: one more attempt, said in its report. Only when the run
        // passed otherwise: a driver verdict stands as it came.
        let observation = &record.evidence.observation;
        let unreached = unreached_timing_counted_points(run, observation);
        if attempt == 1 && !unreached.is_empty() && judge_run(run, observation).outcome == Outcome::Pass {
            again = Some(format!(
                "the first attempt never reached {} (the host's timing gave the ISR fewer calls than the recording): \
                 this is the second",
                unreached.join("; ")
            ));
            continue;
        }
        record.notes.extend(again.take());
        return Ok(report_of(ctx, run, opts, record));
    }
    unreachable!("the second attempt returns")
}

fn report_of(ctx: &RunContext, run: &ConcreteRun, opts: &SuiteOptions, mut record: RunRecord) -> RunReport {
    // vhca.sys's sites by the PDB's routines before anything reads them (the guest has only the entry point).
    if run.guest.driver == vhca_suite::Personality::Sys {
        if let (Some(names), Some(result)) =
            (crate::driver_sites::package_names(), record.evidence.observation.guest_result.as_mut())
        {
            names.rename_all(result);
        }
    }
    let observation = &record.evidence.observation;
    let mut verdict = judge_run(run, observation);
    judge_fail_point(run, observation, &mut verdict);
    judge_interleaving(run, observation, &mut verdict);
    let dropped = schedule_points_dropped(observation);
    if dropped > 0 {
        verdict
            .notes
            .push(format!("the guest left {dropped} contended point(s) out of its list (it lists 500 at most)"));
    }
    let mut report = RunReport::new(run, verdict, record.seconds, ctx.accel.name(), record.path);
    report.schedule_points = schedule_points(observation);
    report.schedule_points_passed = schedule_points_passed(observation);
    report.races = races(observation);
    report.fault_points = fault_points(observation);
    report.injected_faults = injected_faults(observation);
    report.completion = completion_seen(observation);
    report.notes.extend(record.notes.iter().cloned());
    if let Some(root) = &opts.artifacts {
        match artifacts::store(root, run, record.work.path(), &record.evidence) {
            Ok(stored) => {
                report.artifact_dir = Some(stored.dir);
                report.timeline_svg = Some(stored.timeline);
            }
            // The verdict stands without its files; the report says they are missing.
            Err(e) => report.notes.push(format!("artifacts under {} not written: {e}", root.display())),
        }
    }
    if let crate::run::WorkDir::Kept(dir) = &record.work {
        report.notes.push(format!("work dir kept: {}", dir.display()));
    }
    report.set_reproducer(&opts.program, opts.suite_file.as_deref());
    // The record goes when this returns, and with it the work dir.
    phase_hook::at(Phase::WorkDirRemoval, Pids::default());
    report
}
