//! The runner shows the interrupt path: under QEMU with the real device, a run that waits by interrupt has its mode,
//! MSI-X messages and the driver's ISR and DPC counts in report.json, junit.xml and the table, a polling run only
//! its mode, and timeline.svg marks every interrupt the device raised and draws ISR and DPC lanes with a mark for
//! every run the guest timed (all of them, for an interrupt run), while no command of that run polled. And the two interrupt benches run: `bench --roundtrip` prints the interrupt ratio,
//! `bench --alternate-completion` both modes.
//! Prerequisites missing: the test fails under CI=true, and is skipped with the reason elsewhere.

use std::path::PathBuf;

use serde_json::Value;

mod common;
use common::*;

const SUITE: &str = r#"
name = "interrupt-reports"

[[run]]
name = "verbs-interrupt"
modes = ["off"]
guest = { scenario = "verbs-loopback", extra = { completion = "interrupt" } }
expect = "pass"

[[run]]
name = "verbs-poll"
modes = ["off"]
guest = { scenario = "verbs-loopback", extra = { completion = "poll" } }
expect = "pass"
"#;

/// `vhca-run ARGS` with the scratch's TMPDIR and no artifact root (`bench` takes none).
fn bench(s: &Scratch, args: &[&str]) -> std::process::Output {
    std::process::Command::new(RUNNER).env("TMPDIR", s.tmp.path()).args(args).output().expect("run vhca-run")
}

fn artifact(run: &Value, file: &str) -> String {
    let dir = PathBuf::from(run["artifact_dir"].as_str().unwrap());
    std::fs::read_to_string(dir.join(file)).unwrap_or_else(|e| panic!("{file} of {}: {e}", run["name"]))
}

#[test]
fn each_runs_report_says_how_it_waited_and_its_timeline_marks_what_the_guest_timed() {
    if !ready("each_runs_report_says_how_it_waited_and_its_timeline_marks_what_the_guest_timed") {
        return;
    }
    let s = Scratch::new();
    let file = s.artifacts.path().join("interrupt-reports.toml");
    std::fs::write(&file, SUITE).unwrap();
    let out = s.command(&["suite", file.to_str().unwrap(), "-j", "1"]).output().expect("run vhca-run");
    assert!(out.status.success(), "a run failed:\n{}", show(&out));
    s.assert_nothing_left("interrupt-reports");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("completion: 1 runs by interrupt ("), "the table's summary:\n{stdout}");
    assert!(stdout.contains("), 1 polled"), "the table's summary:\n{stdout}");

    let report = s.report();
    let runs = report["runs"].as_array().unwrap();
    let by_interrupt = &runs[0]["completion"];
    assert_eq!(by_interrupt["mode"], "interrupt", "{}", runs[0]);
    let messages: u64 = by_interrupt["interrupts"].as_array().unwrap().iter().filter_map(Value::as_u64).sum();
    assert!(messages > 0, "{by_interrupt}");
    for count in ["isr_calls", "dpc_calls", "cqes"] {
        assert!(by_interrupt[count].as_u64().is_some_and(|n| n > 0), "{count}: {by_interrupt}");
    }
    assert_eq!(runs[1]["completion"], serde_json::json!({"mode": "poll"}), "{}", runs[1]);

    let junit = std::fs::read_to_string(s.artifacts.path().join("junit.xml")).unwrap();
    assert!(junit.contains("completion: interrupt: ") && junit.contains("completion: poll\n"), "{junit}");

    // The interrupt run's guest timed every ISR and DPC run (the driver core's observer), the polling run's none;
    // the runner draws exactly what it is given, one mark per time, never a guess.
    for (run, interrupt) in runs.iter().zip([true, false]) {
        let observation: Value = serde_json::from_str(&artifact(run, "observation.json")).unwrap();
        let result = &observation["guest_result"];
        let svg = artifact(run, "timeline.svg");
        if !interrupt {
            assert!(result["completion_times"].is_null(), "{}: {}", run["name"], result["completion_times"]);
        }
        for (routine, class, calls) in [("isr", "ISR", "isr_calls"), ("dpc", "DPC", "dpc_calls")] {
            let times = &result["completion_times"];
            let timed = times[format!("{routine}_us_before_result")].as_array().map_or(0, Vec::len);
            let untimed = times[format!("{routine}_untimed")].as_u64().unwrap_or(0);
            assert_eq!(timed > 0, interrupt, "{}: {routine} times: {times}", run["name"]);
            if interrupt {
                // Every run seen, whatever thread ran it: the timed and the untimed add up to the path's count.
                let counted = result["completion_path"][calls].as_u64();
                assert_eq!(Some(timed as u64 + untimed), counted, "{}: {routine} runs seen: {result}", run["name"]);
            }
            let marks = svg.matches(&format!("class=\"{routine}\"")).count();
            assert_eq!(marks, timed, "{}: one {class} mark per time:\n{svg}", run["name"]);
            assert_eq!(svg.contains(&format!(">{class} ×")), interrupt, "{}: a {class} legend entry", run["name"]);
            eprintln!("{}: {timed} {class} runs timed, {untimed} untimed", run["name"]);
        }
        if interrupt {
            // The path connects before the first command and disconnects after the last: none polls.
            let waits = &result["details"]["command_waits"];
            assert_eq!(waits["poll"], 0, "{}: commands polled: {waits}", run["name"]);
            assert!(waits["kevent"].as_u64().is_some_and(|n| n > 0), "{}: {waits}", run["name"]);
            eprintln!("{}: command waits {waits}", run["name"]);
        }
        // The interrupts the device raised are its own notify lines, drawn on its clock.
        let raised = artifact(run, "events.jsonl").lines().filter(|l| l.contains("\"kind\":\"notify\"")).count();
        assert_eq!(svg.matches("class=\"notify\"").count(), raised, "{}: one mark per notify line", run["name"]);
        assert_eq!(svg.contains(&format!(">interrupt raised ×{raised}<")), raised > 0, "{}", run["name"]);
        eprintln!("{}: {raised} interrupts raised by the device", run["name"]);
    }
    let raised = artifact(&runs[0], "events.jsonl").matches("\"kind\":\"notify\"").count();
    assert!(raised > 0, "the interrupt run's device raised no interrupt");
}

#[test]
fn the_round_trip_bench_times_both_modes_and_the_interrupt_ratio() {
    if !ready("the_round_trip_bench_times_both_modes_and_the_interrupt_ratio") {
        return;
    }
    let s = Scratch::new();
    let out = bench(&s, &["bench", "--roundtrip", "--samples", "50"]);
    assert!(out.status.success(), "{}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for wanted in [
        "vhca.completion=poll",
        "vhca.completion=interrupt",
        "vhca polling / virtio-rng polling",
        "vhca by interrupt / virtio-rng by interrupt: median ",
        "QUERY_DEVICE via vhca (vIOMMU, vhost-user), waiting for its MSI-X message | 50 |",
        "virtio-rng (in-process), waiting for its MSI-X message | 50 |",
    ] {
        assert!(stdout.contains(wanted), "{wanted:?} missing:\n{stdout}");
    }
    s.assert_nothing_left("bench --roundtrip");
}

#[test]
fn the_completion_bench_runs_each_mode_in_turn_and_every_run_in_its_mode() {
    if !ready("the_completion_bench_runs_each_mode_in_turn_and_every_run_in_its_mode") {
        return;
    }
    let s = Scratch::new();
    let args = ["bench", "--alternate-completion", "-j", "1", "--rounds", "1", "--filter", "^smoke/verifier-off$"];
    let out = bench(&s, &args);
    // Exit 0 means every run passed in the mode it was given (none "not in this mode").
    assert!(out.status.success(), "{}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("| 1 | 1 |")).collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(rows[0].contains("| poll |") && rows[1].contains("| interrupt |"), "poll first, then interrupt:\n{stdout}");
    assert!(rows.iter().all(|r| r.ends_with("| 1/1 | 0 |")), "{stdout}");
    assert!(stdout.contains("interrupt / poll: per-run median "), "{stdout}");
    s.assert_nothing_left("bench --alternate-completion");
}
