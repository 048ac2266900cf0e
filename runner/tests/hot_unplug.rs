//! A real hot-unplug end to end (`vhca.pnp=hot-unplug`), under QEMU with the real device, in both personalities:
//! the guest asks on its console, the runner sends QMP `device_del`, QEMU announces the HCA's removal (and the
//! device process ends when its chardev goes), vfio-pci's request reaches the guest program (natively its surprise path; under vhca.sys
//! IRP_MN_SURPRISE_REMOVAL then REMOVE), every child is reaped, and the guest serves no further run.
//! Prerequisites missing (QEMU, vhca.sys): the test fails under CI=true, and is skipped with the reason elsewhere.

use std::path::{Path, PathBuf};

use serde_json::Value;

mod common;
use common::*;

fn read(dir: &Path, file: &str) -> String {
    std::fs::read_to_string(dir.join(file)).unwrap_or_else(|e| panic!("{}: {e}", dir.join(file).display()))
}

#[test]
fn a_hot_unplug_mid_run_reaches_the_driver_and_its_guest_serves_no_other_run() {
    let test = "a_hot_unplug_mid_run_reaches_the_driver_and_its_guest_serves_no_other_run";
    if !ready(test) {
        return;
    }
    if let Err(why) = vhca_sys_built() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{test}: prerequisite missing under CI: {why}");
        eprintln!("SKIPPED {test}: {why}");
        return;
    }
    // -j 1 on the snapshot path: each hot-unplug's worker has a run after it, which a reused guest would serve.
    let toml = r#"
name = "hot-unplug"

[defaults]
drivers = ["native", "sys"]

[[run]]
name = "hot-unplug"
modes = ["off"]
guest = { scenario = "verbs-loopback", extra = { pnp = "hot-unplug" } }
expect = "pass"

[[run]]
name = "smoke"
modes = ["off"]
expect = "pass"
"#;
    let s = Scratch::new();
    let file = s.artifacts.path().join("hot-unplug.toml");
    std::fs::write(&file, toml).unwrap();
    let out = s.command(&["suite", file.to_str().unwrap(), "-j", "1"]).output().expect("run vhca-run");
    assert!(out.status.success(), "{test}: a run failed:\n{}", show(&out));
    s.assert_nothing_left(test);
    let report = s.report();
    let runs = report["runs"].as_array().expect("runs");
    let dir_of = |name: &str| -> PathBuf {
        let run = runs.iter().find(|r| r["name"] == name).unwrap_or_else(|| panic!("no run {name}: {report}"));
        PathBuf::from(run["artifact_dir"].as_str().unwrap())
    };
    let names: Vec<&str> = runs.iter().filter_map(|r| r["name"].as_str()).collect();
    for name in ["hot-unplug/verifier-off", "hot-unplug/sys/verifier-off"] {
        let dir = dir_of(name);
        // QEMU ejected the HCA: the platform's side of the unplug happened.
        let events = read(&dir, "qmp-events.jsonl");
        assert!(
            events.lines().any(|l| l.contains("DEVICE_DELETED") && l.contains("\"device\":\"hca0\"")),
            "{name}: no DEVICE_DELETED of the HCA:\n{events}"
        );
        let ending = read(&dir, "ending.log");
        assert!(ending.contains("hot-unplug: device_del sent"), "{name}: {ending}");
        // The guest's side: vfio-pci's request came, and the kernel removed the device once the program let go.
        let observation: Value = serde_json::from_str(&read(&dir, "observation.json")).unwrap();
        let details = &observation["guest_result"]["details"];
        let seen = &details["hot_unplug"];
        assert!(seen["notice_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{name}: {seen}");
        assert!(seen["removed_ms"].as_f64().is_some(), "{name}: {seen}");
        assert!(seen["ejected_ms"].as_f64().is_some(), "{name}: {seen}");
        if name.contains("/sys/") {
            let steps = &details["pnp"]["steps"];
            assert_eq!(
                *steps,
                serde_json::json!(["IRP_MN_SURPRISE_REMOVAL 0x0", "IRP_MN_REMOVE_DEVICE 0x0"]),
                "{name}: the PnP manager's IRPs after the unplug"
            );
        }
        // The run after it on the one worker (the report keeps their order) got a guest of its own.
        let at = names.iter().position(|n| *n == name).unwrap();
        if let Some(after) = names.get(at + 1) {
            let restore = read(&dir_of(after), "restore.log");
            assert!(!restore.contains("guest reused"), "{after} ran on the guest that lost its HCA:\n{restore}");
        }
    }
    assert!(!names.last().unwrap().starts_with("hot-unplug"), "no run followed a hot-unplug: {names:?}");
}
