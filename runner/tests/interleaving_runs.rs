//! The interleaving modes end to end under QEMU: a recording run lists its contended scheduling points, the suite
//! expands two of them into runs of their own, each paused at its point on two vCPUs, and all pass on the fixed
//! driver. Prerequisites missing: the test fails under CI=true, and is skipped with the reason elsewhere.

use serde_json::Value;

mod common;
use common::*;

#[test]
fn a_recording_expands_into_preempt_runs_that_pause_where_it_listed() {
    if !ready("a_recording_expands_into_preempt_runs_that_pause_where_it_listed") {
        return;
    }
    let s = Scratch::new();
    let file = suite_file("interleavings.toml");
    let out = s.command(&["suite", file.to_str().unwrap(), "-j", "2"]).output().expect("run vhca-run");
    assert_eq!(out.status.code(), Some(0), "every run passes on the fixed driver:\n{}", show(&out));
    s.assert_nothing_left("interleavings");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("2 schedule choice(s) recorded: one run each"), "{stderr}");
    let report = s.report();
    let runs = report["runs"].as_array().unwrap();
    let recording = &runs[0];
    assert_eq!(recording["name"], "verbs-preempted/verifier-off");
    let points = recording["schedule_points"].as_array().expect("the recording lists its contended points");
    assert!(points.len() > 2, "verbs-loopback has more contended points than the budget: {points:?}");
    let left_out = format!("2 run(s), {} schedule choice(s) left out by max_interleavings = 2", points.len() - 2);
    assert!(
        recording["notes"].as_array().unwrap().iter().any(|n| n.as_str().unwrap().contains(&left_out)),
        "{recording}"
    );
    assert_eq!(runs.len(), 3, "the recording and two preempt runs: {}", show(&out));
    // The expansion chooses evenly among the points a replay surely meets (the ISR's thread only early on).
    let seen: Vec<vhca_suite::SchedulePointSeen> = points
        .iter()
        .map(|p| vhca_suite::SchedulePointSeen {
            point: p["point"].as_str().unwrap().to_string(),
            kind: p["kind"].as_str().unwrap_or_default().to_string(),
            site: p["site"].as_str().unwrap_or_default().to_string(),
            processor: p["processor"].as_u64().unwrap_or_default() as u32,
        })
        .collect();
    let reachable = vhca_suite::reachable_points(&seen);
    for (run, point) in runs[1..].iter().zip([&reachable[0], &reachable[reachable.len() / 2]]) {
        let id = point.point.as_str();
        assert_eq!(run["name"], format!("verbs-preempted/verifier-off/interleaving-{id}"));
        assert_eq!(run["interleaving"]["spec"], format!("preempt:{id}"));
        assert_eq!(run["outcome"]["result"], "pass", "{run}");
        let dir = run["artifact_dir"].as_str().expect("its own artifacts");
        let qemu = std::fs::read_to_string(std::path::Path::new(dir).join("qemu.cmdline")).unwrap();
        assert!(qemu.contains("-smp 2"), "processors = 2 gives two vCPUs: {qemu}");
        let serial = std::fs::read_to_string(std::path::Path::new(dir).join("serial.log")).unwrap();
        let result: Value = serial
            .lines()
            .find_map(|l| l.split_once("VHCA-RESULT ").and_then(|(_, j)| serde_json::from_str(j).ok()))
            .expect("a result line");
        let paused: Vec<&str> =
            result["details"]["preemptions"].as_array().unwrap().iter().filter_map(|p| p["point"].as_str()).collect();
        assert_eq!(paused, [id], "the run paused exactly at its point: {result}");
    }
}
