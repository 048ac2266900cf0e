//! Interleaving runs in the suite's machinery: a recording's expansion judged, sharded and reported (JSON and
//! JUnit), each expanded run with its own verdict and a `boot --interleaving` reproducer.

use std::collections::BTreeMap;

use serde_json::json;
use vhca_suite::{
    expand_interleavings, judge_interleaving, judge_run, races, render_junit, schedule_points, shard_runs, BootPath,
    ConcreteRun, Observation, RunReport, Shard, Suite, SuiteReport,
};

const SUITE: &str = "name = \"t\"\n\
    [[run]]\nname = \"a\"\nmodes = [\"on\"]\ninterleavings = \"preempt1\"\nexpect = \"pass\"\n\
    [[run]]\nname = \"b\"\nmodes = [\"on\"]\ninterleavings = \"pct:3\"\nexpect = \"pass\"\n\
    [[run]]\nname = \"c\"\nmodes = [\"off\", \"on\"]\nexpect = \"pass\"\n";

fn suite() -> Suite {
    Suite::parse(SUITE, "t.toml").unwrap()
}

/// A recording that listed passive#1 and dpc-0#4, as the guest's `schedule` table prints them.
fn recorded() -> Observation {
    let schedule = json!({"passed": 120, "dropped": 0, "threads": ["passive", "dpc-0"], "kinds": ["acquire 0x10"],
                          "sites": ["cq.rs:1:1"], "points": [[0, 1, 0, 0, 0], [1, 4, 0, 0, 0]]});
    Observation { guest_result: Some(json!({"ok": true, "details": {"schedule": schedule}})), ..Default::default() }
}

fn raced() -> Observation {
    let race = json!({"object": "memory 0x2000+0x8",
        "earlier": {"thread": "passive", "processor": 0, "access": "write", "site": "cq.rs:7:3"},
        "later": {"thread": "dpc-0", "processor": 1, "access": "read", "site": "dpc.rs:9:1"}});
    let paused = json!({"point": "passive#1", "kind": "k", "site": "", "paused_us": 1, "resumed": "quiescent"});
    let details = json!({"races": [race], "preemptions": [paused]});
    Observation { guest_result: Some(json!({"ok": true, "details": details})), ..Default::default() }
}

fn report_of(run: &ConcreteRun, o: &Observation) -> RunReport {
    let mut verdict = judge_run(run, o);
    judge_interleaving(run, o, &mut verdict);
    let mut report = RunReport::new(run, verdict, 1.0, "tcg", BootPath::Cold);
    report.races = races(o);
    report.set_reproducer("vhca-run", Some("t.toml"));
    report
}

#[test]
fn shards_split_the_recordings_and_each_recording_expands_in_its_own_shard() {
    let runs = suite().expand();
    let shards: Vec<Vec<ConcreteRun>> =
        (1..=2).map(|index| shard_runs(&runs, Shard { index, count: 2 }, &BTreeMap::new())).collect();
    let recordings: Vec<&str> =
        shards.iter().flatten().filter(|r| r.interleaving.plan.is_some()).map(|r| r.name.as_str()).collect();
    assert_eq!(recordings.len(), 2, "each recording in exactly one shard: {recordings:?}");
    for shard in &shards {
        for run in shard {
            let points = schedule_points(&recorded());
            for expanded in expand_interleavings(run, &points, 120).runs {
                assert!(expanded.name.starts_with(&run.name), "{} expanded from {}", expanded.name, run.name);
                assert!(!runs.iter().any(|r| r.name == expanded.name), "an expanded name clashes with a suite run");
            }
        }
    }
}

#[test]
fn an_expanded_run_that_raced_fails_alone_with_a_boot_reproducer_in_json_and_junit() {
    let s = suite();
    let recording = s.expand().remove(0);
    let expanded = expand_interleavings(&recording, &schedule_points(&recorded()), 120).runs;
    assert_eq!(expanded.len(), 2);
    let reports = vec![
        report_of(&recording, &recorded()),
        report_of(&expanded[0], &raced()),
        report_of(&expanded[1], &Observation { guest_result: Some(json!({"ok": true})), ..Default::default() }),
    ];
    assert!(reports[0].passed(), "{:?}", reports[0].outcome);
    assert!(!reports[1].passed(), "a race fails a pass expectation");
    assert!(!reports[2].passed(), "dpc-0#4 was never paused at");
    assert_eq!(
        reports[1].reproducer.as_deref(),
        Some("vhca-run boot --run a/verifier-on --suite t.toml --interleaving 'preempt:passive#1'")
    );
    let report = SuiteReport::new(&s, reports, 3.0);
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    let raced = &json["runs"][1];
    assert_eq!(raced["name"], "a/verifier-on/interleaving-passive#1");
    assert_eq!(raced["interleaving"], json!({"of": "a/verifier-on", "spec": "preempt:passive#1"}));
    assert_eq!(raced["races"][0]["later"]["site"], "dpc.rs:9:1");
    let junit = render_junit(&report);
    assert_eq!(junit.matches("<testcase").count(), 3, "{junit}");
    assert!(junit.contains("interleaving: preempt:passive#1 (of a/verifier-on)"), "{junit}");
    assert!(junit.contains("race on memory 0x2000+0x8"), "{junit}");
    assert!(junit.contains("--interleaving"), "{junit}");
}

/// A PCT run's reproducer boots it with the horizon it ran with, the points its recording passed: without it the
/// guest draws the change points among its default 2000 and the run is another schedule.
#[test]
fn a_pct_run_s_reproducer_names_its_horizon() {
    let recording = suite().expand().remove(1);
    let pct = expand_interleavings(&recording, &schedule_points(&recorded()), 120).runs.remove(0);
    let report = report_of(&pct, &raced());
    assert_eq!(
        report.reproducer.as_deref(),
        Some("vhca-run boot --run b/verifier-on --suite t.toml --interleaving pct:1 --pct-horizon 120")
    );
}

fn problem(text: &str) -> (usize, String, String) {
    let err = Suite::parse(text, "bad.toml").expect_err("a bad file was accepted");
    let p = &err.problems[0];
    (p.line, p.field.clone(), p.message.clone())
}

#[test]
fn interleaving_keys_are_checked_strictly_and_name_their_field() {
    let run = |keys: &str| format!("name = \"t\"\n[[run]]\nname = \"a\"\n{keys}\nexpect = \"pass\"\n");
    let (line, field, message) = problem(&run("interleavings = \"preempt3\""));
    assert_eq!((line, field.as_str()), (4, "run[0].interleavings"));
    assert!(message.contains("preempt1, preempt2 or pct:<runs>"), "{message}");
    assert_eq!(problem(&run("interleavings = \"pct:0\"")).1, "run[0].interleavings");
    assert_eq!(problem(&run("max_interleavings = 8")).1, "run[0].max_interleavings", "a budget alone");
    assert_eq!(problem(&run("interleavings = \"preempt1\"\nmax_interleavings = 0")).1, "run[0].max_interleavings");
    assert_eq!(problem(&run("processors = 65")).1, "run[0].processors");
    let (_, field, message) =
        problem(&run("interleavings = \"preempt1\"\nguest = { extra = { interleave = \"record\" } }"));
    assert!(field.contains("extra") && message.contains("interleave"), "{field}: {message}");
    let both = "modes = [\"on\"]\nverifier_flags = \"0x400AA\"\neach_fail_point = true\ninterleavings = \"preempt1\"";
    assert!(problem(&run(both)).2.contains("a run expands one way"));
    let ok = Suite::parse(&run("interleavings = \"preempt2\"\nprocessors = 4"), "ok.toml").unwrap();
    assert_eq!(ok.runs[0].processors, Some(4));
    assert_eq!(ok.runs[0].interleavings.map(|p| p.budget), Some(vhca_suite::DEFAULT_MAX_INTERLEAVINGS));
}
