//! The scenarios that only fail on several processors (dpc-polls-destroyed-cq, late-adapter-routine,
//! two-requests-race, isr-passive-unsynchronized and their fixes) through `vhca_scenarios::run` on a two-processor
//! NT model with the interrupt path connected (support/interrupting.rs). Each bug is a race report in a recording
//! run, whatever the schedule, naming both sides' call sites; where a preemption makes it a wrong result, one
//! single preemption among the recording's points shows it; each fix runs clean, with no race, in both checks.

mod support;

use support::interrupting::{run_interrupting, InterruptingRun, Machine};
use support::{model_config, STANDARD};
use vhca_ntmodel::interleaving::SchedulePoint;
use vhca_ntmodel::{InterleavingConfig, InterleavingMode, PointId, RaceReport, TimingConfig};
use vhca_scenarios::Scenario;

/// The bug builds, each with the source file both sides of its race are in (the driver core's ring reader and ring
/// free for the CQ: the DPC reads through `CqReader`, the destroy frees through `Ring`).
const BUGS: [(Scenario, [&str; 2]); 4] = [
    (Scenario::DpcPollsDestroyedCq, ["cq_reader.rs", "ring.rs"]),
    (Scenario::LateAdapterRoutine, ["adapter_routine.rs", "adapter_routine.rs"]),
    (Scenario::TwoRequestsRace, ["two_requests.rs", "two_requests.rs"]),
    (Scenario::IsrPassiveUnsynchronized, ["isr_passive.rs", "isr_passive.rs"]),
];

/// Each bug's fixed twin (whose break_fix is the bug again).
const FIXES: [(Scenario, Scenario); 4] = [
    (Scenario::DpcPollsDestroyedCq, Scenario::DestroyCqFlushesDpcs),
    (Scenario::LateAdapterRoutine, Scenario::AdapterRoutineAwaited),
    (Scenario::TwoRequestsRace, Scenario::TwoRequestsLocked),
    (Scenario::IsrPassiveUnsynchronized, Scenario::IsrPassiveSynchronized),
];

fn machine(flags: u32, mode: InterleavingMode) -> Machine {
    let interleaving = InterleavingConfig { mode, ..InterleavingConfig::default() };
    let config = vhca_ntmodel::NtModelConfig { processors: 2, interleaving, ..model_config(flags, &[]) };
    Machine { config, timing: TimingConfig::default(), hold_ms: 0 }
}

fn recorded(scenario: Scenario, flags: u32, break_fix: bool) -> InterruptingRun {
    run_interrupting(scenario, machine(flags, InterleavingMode::Record), break_fix)
}

fn describe(races: &[RaceReport]) -> String {
    races
        .iter()
        .map(|r| {
            format!("{}: {} ({}) / {} ({})", r.object, r.earlier.site, r.earlier.thread, r.later.site, r.later.thread)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// One of the run's races has one side in each of `files` (in either order) on two threads.
fn assert_race_between(scenario: Scenario, run: &InterruptingRun, files: [&str; 2]) {
    let races = run.kernel.race_reports();
    let found = races.iter().any(|r| {
        let (a, b) = (&r.earlier.site, &r.later.site);
        r.earlier.thread != r.later.thread
            && ((a.contains(files[0]) && b.contains(files[1])) || (a.contains(files[1]) && b.contains(files[0])))
    });
    assert!(
        found,
        "{scenario:?}: no race between {files:?} (outcome {:?}); races: [{}]",
        run.outcome,
        describe(&races)
    );
}

fn assert_clean(scenario: Scenario, run: &InterruptingRun) {
    assert!(matches!(run.outcome, Ok(Ok(()))), "{scenario:?}: {:?}", run.outcome);
    let races = run.kernel.race_reports();
    assert!(races.is_empty(), "{scenario:?}: races [{}]", describe(&races));
}

#[test]
fn every_bug_is_a_race_report_naming_both_sides_in_a_recording_run() {
    for (scenario, files) in BUGS {
        for flags in [0, STANDARD] {
            assert_race_between(scenario, &recorded(scenario, flags, false), files);
        }
    }
}

#[test]
fn every_fix_taken_back_by_break_fix_is_the_same_race() {
    for ((_, fixed), (_, files)) in FIXES.into_iter().zip(BUGS) {
        assert_race_between(fixed, &recorded(fixed, STANDARD, true), files);
    }
}

#[test]
fn every_fix_runs_clean_with_no_race_on_two_processors() {
    for (_, fixed) in FIXES {
        for flags in [0, STANDARD] {
            assert_clean(fixed, &recorded(fixed, flags, false));
        }
    }
}

/// The routine runs 250 ms after its request was given up in every run: request C finds B's map-register base in
/// the context it took over, with or without the verifier, and the fix's wait puts it right.
#[test]
fn a_late_adapter_routine_writes_into_the_next_request_s_context_and_waiting_for_it_does_not() {
    for flags in [0, STANDARD] {
        let run = recorded(Scenario::LateAdapterRoutine, flags, false);
        match run.outcome {
            Ok(Err(e)) => assert!(e.to_string().contains("request C's context holds"), "flags {flags:#x}: {e:#}"),
            other => panic!("flags {flags:#x}: {other:?}"),
        }
    }
    let run = recorded(Scenario::AdapterRoutineAwaited, STANDARD, true);
    assert!(matches!(run.outcome, Ok(Err(_))), "break_fix: {:?}", run.outcome);
}

/// The recording's points at the scenario's own copies of the shared words (its source file): where one
/// preemption can split a load from its store. Contended or not: whether the other side was active at that instant
/// of the recording is timing, and the preempted run waits for it either way.
fn copy_points(run: &InterruptingRun, file: &str) -> Vec<SchedulePoint> {
    let points = run.kernel.schedule_points();
    points.into_iter().filter(|p| p.kind.contains("RtlCopy") && p.site.contains(file)).collect()
}

/// How often a preemption is run again when the run paused at another call than the recording saw at its point.
const RETRIES: usize = 4;

/// The run preempted at `p` that paused at the call the recording saw there, or the last try. A thread's k-th point
/// is not always the same call from run to run: an interrupt delivered on the passive path's processor, or a wait
/// that looks at its timers once more, adds points before it (more often on a loaded host), and a pause at another
/// call than the copy under test tests nothing.
fn preempted_at(scenario: Scenario, p: &SchedulePoint) -> InterruptingRun {
    let mut tries = 0;
    loop {
        let run = run_interrupting(scenario, machine(0, InterleavingMode::Preempt(vec![p.id.clone()])), false);
        tries += 1;
        let paused_there = run.kernel.preemptions().iter().any(|q| q.kind == p.kind && q.site == p.site);
        if paused_there || tries == RETRIES {
            return run;
        }
    }
}

/// The first single preemption among the recording's copy points in `file` (at most `budget` tried, the last ones
/// first: a teardown race sits at the end) that turns the run into a failure other than a race report, with that
/// outcome; the list is tried `rounds` times. Why more than once for a bug: a pause ends when the other threads are
/// quiescent, so it loses an update only if the other side is under way then (an ISR in flight, the worker past its
/// start), and on a loaded host the other side is late more often (its wake-up is not seen until it runs).
fn some_preemption_fails(scenario: Scenario, file: &str, budget: usize, rounds: usize) -> Option<(PointId, Outcome)> {
    let points = copy_points(&recorded(scenario, 0, false), file);
    assert!(!points.is_empty(), "{scenario:?}: the recording listed no copy point in {file}");
    let tried: Vec<&SchedulePoint> = points.iter().rev().take(budget).collect();
    (0..rounds).flat_map(|_| tried.iter()).find_map(|p| {
        let run = preempted_at(scenario, p);
        (!matches!(run.outcome, Ok(Ok(())))).then(|| (p.id.clone(), run.outcome))
    })
}

type Outcome = Result<anyhow::Result<()>, vhca_ntmodel::Bugcheck>;

#[test]
fn one_preemption_loses_an_update_or_reads_a_freed_ring_where_the_fix_is_missing() {
    let pairs = [
        (Scenario::TwoRequestsRace, Scenario::TwoRequestsLocked, "two_requests.rs"),
        (Scenario::IsrPassiveUnsynchronized, Scenario::IsrPassiveSynchronized, "isr_passive.rs"),
        (Scenario::DpcPollsDestroyedCq, Scenario::DestroyCqFlushesDpcs, "cq_reader.rs"),
    ];
    for (bug, fixed, file) in pairs {
        // 16 rounds: on a loaded host (this binary's other tests beside it, a build) 6 missed the ISR pair's lost
        // update in about 1 run of 7; a round that finds it returns at once, so the fixed cost is only the misses'.
        let found = some_preemption_fails(bug, file, 24, 16);
        match (bug, &found) {
            // The DPC held at its last ring read until the destroy freed the ring: the model's 0x50, P2 0 a read.
            (Scenario::DpcPollsDestroyedCq, Some((_, Err(b)))) => {
                assert_eq!((b.code, b.params[1]), (0x50, 0), "{b:?}")
            }
            (Scenario::DpcPollsDestroyedCq, other) => panic!("{bug:?}: {other:?}"),
            (_, Some((_, Ok(Err(e))))) => {
                assert!(e.to_string().contains("generation") || e.to_string().contains("took"))
            }
            (_, other) => panic!("{bug:?}: no single preemption lost an update: {other:?}"),
        }
        let fixed_found = some_preemption_fails(fixed, file, 24, 1).map(|(id, _)| id);
        assert_eq!(fixed_found, None, "{fixed:?}");
    }
}
