//! End to end: the vhca-run binary boots the real guest against the real device under QEMU. One run must pass the
//! smoke verdict; a guest that never answers must fail it, by timeout, leaving no process or work dir behind.
//! Prerequisites missing: the test fails under CI=true, and is skipped with the reason elsewhere.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

const RUNNER: &str = env!("CARGO_BIN_EXE_vhca-run");

/// The binaries vhca-run will use, or why the test cannot run.
fn prerequisites() -> Result<(), String> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let device = std::env::var_os("VHCA_DEVICE_BIN").map(PathBuf::from).unwrap_or(target.join("release/vhca-device"));
    let guest = std::env::var_os("VHCA_GUEST_BIN")
        .map(PathBuf::from)
        .unwrap_or(target.join("x86_64-unknown-linux-gnu/release/vhca-guest"));
    for (what, path) in [("vhca-device", &device), ("vhca-guest", &guest)] {
        if !path.is_file() {
            return Err(format!(
                "{what} not built at {} (set VHCA_DEVICE_BIN/VHCA_GUEST_BIN or run ci/test.sh)",
                path.display()
            ));
        }
    }
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err("qemu-system-x86_64 is not installed (ci/setup-host.sh installs it)".into()),
    }
}

/// True if the test should go on; panics under CI when it cannot.
fn ready(test: &str) -> bool {
    match prerequisites() {
        Ok(()) => true,
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{test}: prerequisite missing under CI: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            false
        }
    }
}

fn show(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn smoke_suite_passes_with_iovas_through_the_iommu() {
    if !ready("smoke_suite_passes_with_iovas_through_the_iommu") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let artifacts = dir.path().join("artifacts");
    let out = Command::new(RUNNER)
        .args(["suite", "--json"])
        .arg(&json)
        .arg("--artifacts")
        .arg(&artifacts)
        .output()
        .expect("run vhca-run");
    assert!(out.status.success(), "suite failed:\n{}", show(&out));
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let run = &report["runs"][0];
    assert_eq!(run["verdict"]["kind"], "pass", "{}", show(&out));
    assert_eq!(run["outcome"]["guest_result"]["ok"], true);
    assert_eq!(run["outcome"]["end"], "guest_result");
    // The guest's IOVAs are in the report, and the device's log that proved them is kept as an artifact.
    assert!(run["outcome"]["guest_result"]["iovas"]["cmd"].is_u64());
    let events = std::fs::read_to_string(artifacts.join("smoke/events.jsonl")).unwrap();
    assert!(events.contains("iotlb_update") && events.contains("\"desc\""), "event log lacks IOTLB/desc events");
    assert!(String::from_utf8_lossy(&out.stdout).contains("smoke  PASS"), "{}", show(&out));
}

/// Pids of processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z'));
        if !zombie && String::from_utf8_lossy(&cmdline).contains(needle) {
            pids.push(pid);
        }
    }
    pids
}

#[test]
fn guest_that_never_answers_fails_by_timeout_and_leaves_nothing() {
    if !ready("guest_that_never_answers_fails_by_timeout_and_leaves_nothing") {
        return;
    }
    // The runner's work dirs go under TMPDIR: a private one shows whether anything is left behind.
    let tmp = tempfile::tempdir().unwrap();
    let timeout = 20;
    let start = Instant::now();
    let out = Command::new(RUNNER)
        .env("TMPDIR", tmp.path())
        .args(["boot", "--scenario", "smoke", "--append", "vhca.init=hang", "--timeout", &timeout.to_string()])
        .output()
        .expect("run vhca-run");
    let took = start.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a hung guest must fail the run:\n{}", show(&out));
    assert!(stdout.contains("smoke  TIMEOUT"), "{}", show(&out));
    assert!(stdout.contains("no VHCA-RESULT within 20 s"), "{}", show(&out));
    // The guest really booted and hung in /init: this is the timeout path, not a start-up failure.
    assert!(stderr.contains("vhca.init=hang: not starting vhca-guest"), "{}", show(&out));
    assert!(took < Duration::from_secs(timeout + 60), "took {took:?}");
    let needle = tmp.path().to_string_lossy().into_owned();
    assert_eq!(processes_mentioning(&needle), Vec::<u32>::new(), "QEMU or the device outlived the run");
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().map(|e| e.path()).collect();
    assert!(left.is_empty(), "work dirs left behind: {left:?}");
}

#[test]
fn ctrl_c_stops_the_run_and_leaves_nothing() {
    if !ready("ctrl_c_stops_the_run_and_leaves_nothing") {
        return;
    }
    use std::io::{BufRead, BufReader};
    let tmp = tempfile::tempdir().unwrap();
    let mut child = Command::new(RUNNER)
        .env("TMPDIR", tmp.path())
        .args(["boot", "--append", "vhca.init=hang", "--timeout", "120"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run vhca-run");
    // Interrupt once the guest is up and hanging, with QEMU and the device both running.
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    let mut line = String::new();
    while stderr.read_line(&mut line).unwrap() > 0 {
        seen.push_str(&line);
        if line.contains("not starting vhca-guest") {
            break;
        }
        line.clear();
    }
    assert!(line.contains("not starting vhca-guest"), "the guest never reached /init:\n{seen}");
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) on the pid of the child this test spawned and has not yet reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "stderr:\n{seen}{rest}");
    let needle = tmp.path().to_string_lossy().into_owned();
    assert_eq!(processes_mentioning(&needle), Vec::<u32>::new(), "QEMU or the device outlived the interrupt");
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().map(|e| e.path()).collect();
    assert!(left.is_empty(), "work dirs left behind: {left:?}");
}
