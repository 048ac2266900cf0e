//! Interrupts end to end (`vhca.completion=interrupt`, the default): the guest program enables MSI-X through VFIO,
//! routes its queues' vectors, asks for interrupts on queue 0 and waits for them. Under QEMU (TCG, intel-iommu)
//! with the real device, vhca's smoke run (the command queue, natively and through the driver core) and QEMU's
//! virtio-rng self-test pass with messages counted on queue 0's vector; runs that ask to poll enable no vector.
//! Prerequisites missing: the test fails under CI=true, and is skipped with the reason elsewhere.

use std::path::PathBuf;

use serde_json::Value;

mod common;
use common::*;

/// What the guest reported for run `index` of the scratch's suite report (its `VHCA-RESULT` object).
fn guest_result(report: &Value, index: usize) -> Value {
    let dir = PathBuf::from(report["runs"][index]["artifact_dir"].as_str().unwrap());
    let text = std::fs::read_to_string(dir.join("observation.json")).unwrap();
    let observation: Value = serde_json::from_str(&text).unwrap();
    observation["guest_result"].clone()
}

/// Runs a suite written from `toml` with `args`; returns the report, after checking every run passed.
fn run_suite(test: &str, toml: &str, args: &[&str]) -> (Scratch, Value) {
    let s = Scratch::new();
    let file = s.artifacts.path().join(format!("{test}.toml"));
    std::fs::write(&file, toml).unwrap();
    let mut all = vec!["suite", file.to_str().unwrap()];
    all.extend_from_slice(args);
    let out = s.command(&all).output().expect("run vhca-run");
    assert!(out.status.success(), "{test}: a run failed:\n{}", show(&out));
    s.assert_nothing_left(test);
    let report = s.report();
    (s, report)
}

/// Checks a run that waited by interrupt: queue 0 asked for them, and its vector delivered at least one message.
/// Returns (queue 0's vector, the messages per vector).
fn assert_interrupts_on_queue_0(run: &str, result: &Value) -> (u64, Vec<u64>) {
    assert_eq!(result["ok"], true, "{run}: {result}");
    assert_eq!(result["completion"], "interrupt", "{run}: the option did not reach the guest: {result}");
    let interrupts = &result["interrupts"];
    assert_eq!(interrupts["waiting_queues"], serde_json::json!([0]), "{run}: {interrupts}");
    let vector = interrupts["queue_vectors"][0].as_u64().unwrap_or_else(|| panic!("{run}: no vector: {interrupts}"));
    let per_vector: Vec<u64> =
        interrupts["per_vector"].as_array().unwrap().iter().map(|n| n.as_u64().unwrap()).collect();
    assert!(
        per_vector.get(vector as usize).is_some_and(|n| *n > 0),
        "{run}: no message on queue 0's vector {vector}: {interrupts}"
    );
    (vector, per_vector)
}

fn assert_polled(run: &str, result: &Value) {
    assert_eq!(result["ok"], true, "{run}: {result}");
    assert_eq!(result["completion"], "poll", "{run}: the run asked to poll: {result}");
    assert!(result["interrupts"].is_null(), "{run}: a polling run enables no vector: {result}");
}

#[test]
fn vhca_smoke_waits_for_its_command_queue_interrupt_and_a_polling_run_takes_none() {
    if !ready("vhca_smoke_waits_for_its_command_queue_interrupt_and_a_polling_run_takes_none") {
        return;
    }
    // -j 1: the runs share one restored guest in this order, so the polling run also shows that an interrupt run
    // leaves the guest clean enough to serve again (its process, thread and eventfds gone, MSI-X off, HCA ejected).
    let toml = r#"
name = "interrupts"

[[run]]
name = "smoke-interrupt"
guest = { scenario = "smoke", extra = { completion = "interrupt" } }
expect = "pass"

[[run]]
name = "smoke"
modes = ["off"]
guest = { extra = { completion = "poll" } }
expect = "pass"
"#;
    let (_s, report) = run_suite("vhca-smoke-interrupts", toml, &["-j", "1"]);
    let names: Vec<&str> = report["runs"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["smoke-interrupt/verifier-off", "smoke-interrupt/verifier-on", "smoke/verifier-off"]);
    for (index, run) in names.iter().enumerate().take(2) {
        let result = guest_result(&report, index);
        let (vector, per_vector) = assert_interrupts_on_queue_0(run, &result);
        // The carrier (vhost-user-snd-pci) has one MSI-X entry: config and every queue share it.
        assert_eq!(result["interrupts"]["table_entries"], 1, "{run}: {result}");
        assert_eq!((vector, per_vector.len()), (0, 1), "{run}: {result}");
        eprintln!("{run}: {} message(s) on vector {vector}", per_vector[0]);
    }
    assert_polled(names[2], &guest_result(&report, 2));
    for index in 1..3 {
        let dir = PathBuf::from(report["runs"][index]["artifact_dir"].as_str().unwrap());
        let restore = std::fs::read_to_string(dir.join("restore.log")).unwrap_or_default();
        assert!(restore.contains("guest reused"), "{}: the guest was not served again:\n{restore}", names[index]);
    }
}

#[test]
fn virtio_rng_self_test_waits_for_its_request_queue_interrupt_and_a_polling_run_takes_none() {
    if !ready("virtio_rng_self_test_waits_for_its_request_queue_interrupt_and_a_polling_run_takes_none") {
        return;
    }
    // The runner adds QEMU's virtio-rng for the roundtrip scenario; `device` makes the guest drive it instead of
    // the HCA, which is the transport's self-test (one entropy read). Cold: the saved guest has no virtio-rng.
    let toml = r#"
name = "rng-interrupts"

[[run]]
name = "rng-interrupt"
modes = ["off"]
guest = { scenario = "roundtrip", extra = { device = "1af4:1044", completion = "interrupt" } }
expect = "pass"

[[run]]
name = "rng-poll"
modes = ["off"]
guest = { scenario = "roundtrip", extra = { device = "1af4:1044", completion = "poll" } }
expect = "pass"
"#;
    let (_s, report) = run_suite("rng-interrupts", toml, &["-j", "2", "--cold"]);
    let names: Vec<&str> = report["runs"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["rng-interrupt/verifier-off", "rng-poll/verifier-off"]);
    let result = guest_result(&report, 0);
    assert_eq!(result["device"], "1af4:1044", "{result}");
    assert_eq!(result["rng"]["used_len"], 64, "the entropy arrived: {result}");
    let (vector, per_vector) = assert_interrupts_on_queue_0(names[0], &result);
    // QEMU's virtio-rng has a table entry for config and one for its queue: the message is the queue's, not config's.
    let config = result["interrupts"]["config_vector"].as_u64().unwrap();
    assert_ne!(vector, config, "queue and config on separate entries: {result}");
    assert_eq!(per_vector[config as usize], 0, "no config change, no config message: {result}");
    eprintln!("{}: {} message(s) on vector {vector}, {per_vector:?} in all", names[0], per_vector[vector as usize]);
    let polled = guest_result(&report, 1);
    assert_eq!(polled["rng"]["used_len"], 64, "{polled}");
    assert_polled(names[1], &polled);
}

#[test]
fn verbs_loopback_completes_through_the_drivers_isr_and_dpc_with_the_verifier_off_and_on() {
    if !ready("verbs_loopback_completes_through_the_drivers_isr_and_dpc_with_the_verifier_off_and_on") {
        return;
    }
    // The driver core connects the NT model's interrupt (the MSI-X message VFIO enabled), and every completion
    // the scenario waits for reaches it through its ISR, its DPC and a KEVENT its callback sets.
    let toml = r#"
name = "verbs-interrupts"

[[run]]
name = "verbs-loopback-interrupt"
guest = { scenario = "verbs-loopback", extra = { completion = "interrupt" } }
expect = "pass"
"#;
    let (_s, report) = run_suite("verbs-loopback-interrupts", toml, &["-j", "1"]);
    let names: Vec<&str> = report["runs"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["verbs-loopback-interrupt/verifier-off", "verbs-loopback-interrupt/verifier-on"]);
    for (index, run) in names.iter().enumerate() {
        let result = guest_result(&report, index);
        assert_interrupts_on_queue_0(run, &result);
        let path = &result["completion_path"];
        let count = |key: &str| path[key].as_u64().unwrap_or_else(|| panic!("{run}: no {key}: {result}"));
        assert!(count("isr_calls") > 0 && count("dpc_calls") > 0, "{run}: {path}");
        // Four completions the scenario waits for (write, read, send, receive) came through the DPC.
        assert!(count("cqes") >= 4, "{run}: {path}");
        // Its commands between the connect and the disconnect (create_qp, modify_qp, ...) slept on the KEVENT
        // the DPC sets; Hca::open's, before the interrupt was connected, polled.
        let waits = &result["details"]["command_waits"];
        assert!(waits["kevent"].as_u64().is_some_and(|n| n > 0), "{run}: no command waited by interrupt: {waits}");
        eprintln!("{run}: {path}");
    }
}
