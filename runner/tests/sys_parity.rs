//! Parity: the built-in seed suite, which runs every scenario in both personalities (native and sys) and both
//! verifier modes against the real device under QEMU: each sys run must end with its native twin's verdict (the
//! kind, the bugcheck code, every parameter that is not an address, and a failed scenario's error).
//! Under CI=true with the prerequisites missing it fails, like the other end-to-end tests.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const RUNNER: &str = env!("CARGO_BIN_EXE_vhca-run");

fn target() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// vhca.sys must be built (ci/build-windows.sh), besides what every end-to-end test needs.
fn prerequisites() -> Result<(), String> {
    let dir = std::env::var_os("VHCA_WINDOWS_DRIVER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| target().join("windows/vhca-driver"));
    if !dir.join("vhca.sys").is_file() {
        return Err(format!("no vhca.sys in {} (run ci/build-windows.sh)", dir.display()));
    }
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err("qemu-system-x86_64 is not installed (ci/setup-host.sh installs it)".into()),
    }
}

/// Each run's name → its verdict with address parameters (above 4 GiB: kernel objects, IOVAs) blanked.
fn verdicts(report: &Value) -> Vec<(String, Value)> {
    let blank = |p: &Value| match p.as_str().and_then(|t| u64::from_str_radix(t.trim_start_matches("0x"), 16).ok()) {
        Some(v) if v > u32::MAX as u64 => Value::String("address".into()),
        _ => p.clone(),
    };
    report["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .map(|r| {
            let mut actual = r["actual"].clone();
            if let Some(params) = actual.get_mut("params").and_then(Value::as_array_mut) {
                params.iter_mut().for_each(|p| *p = blank(p));
            }
            // Where a verdict was observed (serial or QMP) and its prose are not the verdict.
            if let Some(o) = actual.as_object_mut() {
                o.remove("source");
                // A scenario's failure is its error up to the parenthesis: what follows says what the host knows
                // of the verifier (the native host knows DMA checking is on; vhca.sys, as any Windows driver,
                // cannot know), not what failed.
                if let Some(Value::String(error)) = o.get_mut("error") {
                    if let Some(at) = error.find(" (") {
                        error.truncate(at);
                    }
                }
            }
            (r["name"].as_str().expect("name").to_string(), actual)
        })
        .collect()
}

fn run_seed_suite() -> Value {
    let (tmp, artifacts) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let out = Command::new(RUNNER)
        .env("TMPDIR", tmp.path())
        .args(["suite", "-j", "2"])
        .arg("--artifacts")
        .arg(artifacts.path())
        .output()
        .expect("run vhca-run");
    let report = artifacts.path().join("report.json");
    let text = std::fs::read_to_string(&report)
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", report.display(), String::from_utf8_lossy(&out.stderr)));
    serde_json::from_str(&text).expect("report.json")
}

#[test]
fn native_and_sys_give_identical_verdicts() {
    if let Err(why) = prerequisites() {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("prerequisite missing under CI: {why}");
        }
        eprintln!("SKIPPED: {why}");
        return;
    }
    // `<run>/sys/verifier-<mode>` is the vhca.sys twin of `<run>/verifier-<mode>`.
    let (sys, native): (Vec<_>, Vec<_>) =
        verdicts(&run_seed_suite()).into_iter().partition(|(name, _)| name.contains("/sys/"));
    let sys: Vec<_> = sys.into_iter().map(|(name, verdict)| (name.replace("/sys/", "/"), verdict)).collect();
    // Runs the suite keeps native only (the low-resources entries: the loader does not carry the simulation yet)
    // have no twin; every other native run must have one.
    let native: Vec<_> = native.into_iter().filter(|(name, _)| !name.starts_with("low-resources-")).collect();
    assert!(native.len() >= 22, "the seed suite has 11 runs in two modes: {native:?}");
    assert_eq!(native, sys, "native and vhca.sys disagree");
}
