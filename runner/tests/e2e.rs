//! End to end: the vhca-run binary boots the real guest against the real device under QEMU. Suites pass and fail as
//! they must, with reports and artifacts, from the snapshot and cold alike; stale and corrupt snapshots are never
//! restored; killed, hung and interrupted runs get their verdicts and leave no process, socket or work dir behind.
//! Prerequisites missing: the test fails under CI=true, and is skipped with the reason elsewhere.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::*;

/// Starts `vhca-run boot` on a guest that hangs in /init and returns once QEMU and the device both run.
fn boot_hung_guest(s: &Scratch) -> (Child, BufReader<ChildStderr>, String) {
    let cmd = s.command(&["boot", "--param", "init=hang", "--expect", "hang", "--timeout", "300", "--silence", "300"]);
    spawn_until(cmd, "vhca.init=hang: hanging without a result", "the guest never reached /init")
}

/// Starts `cmd` and reads its stderr until a line contains `needle`; panics with `otherwise` if it never does.
fn spawn_until(
    mut cmd: std::process::Command,
    needle: &str,
    otherwise: &str,
) -> (Child, BufReader<ChildStderr>, String) {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("run vhca-run");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    let mut line = String::new();
    while stderr.read_line(&mut line).unwrap() > 0 {
        seen.push_str(&line);
        if line.contains(needle) {
            return (child, stderr, seen);
        }
        line.clear();
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("{otherwise}:\n{seen}");
}

fn finish(
    mut child: Child,
    mut stderr: BufReader<ChildStderr>,
    mut seen: String,
) -> (std::process::ExitStatus, String) {
    stderr.read_to_string(&mut seen).unwrap();
    let mut stdout = String::new();
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    let status = child.wait().unwrap();
    (status, format!("--- stdout\n{stdout}\n--- stderr\n{seen}"))
}

/// Kills the one child process of the run whose command line contains `which`, then checks the verdict.
fn kill_mid_run(which: &str, test: &str) -> (Value, String) {
    let s = Scratch::new();
    let (child, stderr, seen) = boot_hung_guest(&s);
    let needle = s.tmp.path().to_string_lossy().into_owned();
    let victims: Vec<(u32, String)> =
        processes_mentioning(&needle).into_iter().filter(|(_, cmd)| cmd.contains(which)).collect();
    assert_eq!(victims.len(), 1, "{test}: expected one {which} process, found {victims:?}");
    signal(victims[0].0, libc::SIGKILL);
    let (status, output) = finish(child, stderr, seen);
    assert_eq!(status.code(), Some(1), "{test}: a killed process must fail the run\n{output}");
    s.assert_nothing_left(test);
    let run = s.report()["runs"][0].clone();
    (run, output)
}

#[test]
fn runner_suite_in_parallel_passes_with_reports_and_artifacts() {
    if !ready("runner_suite_in_parallel_passes_with_reports_and_artifacts") {
        return;
    }
    let s = Scratch::new();
    let junit = s.artifacts.path().join("extra/junit.xml");
    let file = suite_file("runner.toml");
    let out = s
        .command(&["suite", file.to_str().unwrap(), "-j", "2", "--junit", junit.to_str().unwrap()])
        .output()
        .expect("run vhca-run");
    assert!(out.status.success(), "suite failed:\n{}", show(&out));
    s.assert_nothing_left("runner suite");
    let report = s.report();
    let kinds: Vec<(String, String)> = report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap().to_string(), r["actual"]["kind"].as_str().unwrap().to_string()))
        .collect();
    let want = [
        ("smoke/verifier-off", "pass"),
        ("smoke/verifier-on", "pass"),
        ("hang/verifier-off", "hang"),
        ("panic/verifier-off", "guest-panic"),
    ];
    assert_eq!(kinds, want.map(|(a, b)| (a.to_string(), b.to_string())), "{}", show(&out));
    assert_eq!(report["totals"]["passed"], 4);
    // Two at a time: the wall time is less than the sum of the runs.
    let (wall, sum) =
        (report["totals"]["wall_seconds"].as_f64().unwrap(), report["totals"]["run_seconds"].as_f64().unwrap());
    assert!(wall < sum, "wall {wall} s is not below the runs' {sum} s: the runs did not overlap");
    for run in report["runs"].as_array().unwrap() {
        let dir = PathBuf::from(run["artifact_dir"].as_str().unwrap());
        for file in [
            "serial.log",
            "events.jsonl",
            "device.log",
            "qemu.log",
            "device.cmdline",
            "qemu.cmdline",
            "qmp-events.jsonl",
            "observation.json",
        ] {
            assert!(dir.join(file).is_file(), "{} lacks {file}", dir.display());
        }
        let svg = std::fs::read_to_string(run["timeline_svg"].as_str().unwrap()).unwrap();
        assert!(svg.starts_with("<svg") || svg.contains("<svg"), "timeline is not SVG");
        assert_eq!(run["accelerator"], "tcg", "this host has no usable KVM");
    }
    // The smoke run proves the device used the guest's IOVAs through the vIOMMU: descriptors in its log, and no
    // rig problem (the IOTLB coverage check) in the observation.
    let smoke = PathBuf::from(report["runs"][0]["artifact_dir"].as_str().unwrap());
    let events = std::fs::read_to_string(smoke.join("events.jsonl")).unwrap();
    assert!(events.contains("\"iotlb_update\"") && events.contains("\"desc\""), "event log lacks IOTLB/desc events");
    let observation: Value =
        serde_json::from_str(&std::fs::read_to_string(smoke.join("observation.json")).unwrap()).unwrap();
    assert_eq!(observation["rig_problems"], serde_json::json!([]));
    assert!(observation["guest_result"]["iovas"]["cmd"].is_u64());
    // The panic reached QMP through pvpanic, and the timeline marks it.
    let panic = PathBuf::from(report["runs"][3]["artifact_dir"].as_str().unwrap());
    let qmp = std::fs::read_to_string(panic.join("qmp-events.jsonl")).unwrap();
    assert!(qmp.contains("GUEST_PANICKED"), "no GUEST_PANICKED from pvpanic: {qmp}");
    let svg = std::fs::read_to_string(panic.join("timeline.svg")).unwrap();
    assert!(svg.contains("kernel panic") || svg.contains("GUEST_PANICKED"), "the crash is not marked on the timeline");
    // JUnit, read back: four test cases, no failure.
    for path in [s.artifacts.path().join("junit.xml"), junit] {
        let xml = std::fs::read_to_string(&path).unwrap();
        assert_eq!(xml.matches("<testcase ").count(), 4, "{xml}");
        assert!(!xml.contains("<failure"), "{xml}");
        assert!(xml.contains("name=\"hang/verifier-off\""), "{xml}");
    }
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("4 runs: 4 passed, 0 failed"), "{}", show(&out));
}

#[test]
fn the_suite_can_fail_with_a_mismatch_and_a_reproducer() {
    if !ready("the_suite_can_fail_with_a_mismatch_and_a_reproducer") {
        return;
    }
    let s = Scratch::new();
    let file = suite_file("suite-can-fail.toml");
    let out = s.command(&["suite", file.to_str().unwrap(), "-j", "2"]).output().expect("run vhca-run");
    assert_eq!(out.status.code(), Some(1), "a failed run must make vhca-run exit 1:\n{}", show(&out));
    s.assert_nothing_left("suite-can-fail");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("FAIL expected bugcheck 0xE6 0x13 0x1 0x0 0x1, got "), "{}", show(&out));
    assert!(stdout.contains("1 runs: 0 passed, 1 failed"), "{}", show(&out));
    let run = &s.report()["runs"][0];
    assert_eq!(run["name"], "fast-mutex-rule-disabled/verifier-on");
    assert_eq!(run["outcome"]["result"], "fail");
    let reproducer = run["reproducer"].as_str().expect("a failed run has a reproducer");
    assert!(reproducer.contains(" suite ") && reproducer.contains("suite-can-fail.toml"), "{reproducer}");
    assert!(reproducer.ends_with("--filter '^fast-mutex-rule-disabled/verifier-on$'"), "{reproducer}");
    assert!(stdout.contains(&format!("reproduce fast-mutex-rule-disabled/verifier-on: {reproducer}")), "{stdout}");
    let junit = std::fs::read_to_string(s.artifacts.path().join("junit.xml")).unwrap();
    assert!(junit.contains("<failure message=\"expected bugcheck 0xE6 0x13 0x1 0x0 0x1, got"), "{junit}");
}

#[test]
fn verbs_suite_passes() {
    if !ready("verbs_suite_passes") {
        return;
    }
    let s = Scratch::new();
    let file = suite_file("verbs.toml");
    let out = s.command(&["suite", file.to_str().unwrap(), "-j", "2"]).output().expect("run vhca-run");
    assert!(out.status.success(), "verbs suite failed:\n{}", show(&out));
    s.assert_nothing_left("verbs suite");
    let report = s.report();
    assert_eq!(report["totals"]["passed"], 6);
    let control = report["runs"].as_array().unwrap().iter().find(|r| r["run"] == "iommu-refuses-unmapped-response");
    let control = control.expect("the negative control ran");
    assert_eq!(control["actual"]["kind"], "device-fault", "{control}");
    // The seed suite's shared-buffer-sg/verifier-on is guest-failed (stale read); without double buffering it passes.
    let fresh =
        report["runs"].as_array().unwrap().iter().find(|r| r["run"] == "shared-buffer-sg-without-double-buffering");
    let fresh = fresh.expect("the run without double buffering ran");
    assert_eq!(fresh["actual"]["kind"], "pass", "{fresh}");
}

/// The exhaustive low-resources mode end to end: a recording run, one run per failure point, and the one whose
/// failed allocation the (deliberately broken) path ignores stops the machine at the NULL and fails, named by its
/// point, with a `boot --fail-point` reproducer that boots exactly it.
#[test]
fn a_path_that_ignores_a_failed_allocation_fails_its_own_fail_point_run() {
    if !ready("a_path_that_ignores_a_failed_allocation_fails_its_own_fail_point_run") {
        return;
    }
    let s = Scratch::new();
    let file = suite_file("low-resources-broken.toml");
    let out = s.command(&["suite", file.to_str().unwrap(), "-j", "2"]).output().expect("run vhca-run");
    assert_eq!(out.status.code(), Some(1), "the broken path must fail the suite:\n{}", show(&out));
    s.assert_nothing_left("low-resources-broken");
    let report = s.report();
    let runs = report["runs"].as_array().unwrap();
    let recording = &runs[0];
    assert_eq!(recording["name"], "ignored-allocation-failure/verifier-on");
    assert_eq!(recording["actual"]["kind"], "pass", "{recording}");
    let points = recording["fault_points"].as_array().expect("the recording lists its points");
    let shadow = points
        .iter()
        .find(|p| p["site"].as_str().unwrap_or("").contains("guest-driver/scenarios/src/smoke.rs"))
        .unwrap_or_else(|| panic!("no failure point in smoke.rs among {points:?}"));
    let k = shadow["point"].as_u64().unwrap();
    assert_eq!(runs.len(), 1 + points.len(), "one run per point: {}", show(&out));
    let failed: Vec<&Value> = runs.iter().filter(|r| r["outcome"]["result"] == "fail").collect();
    assert_eq!(failed.len(), 1, "only the ignored allocation's run fails: {}", show(&out));
    let run = failed[0];
    assert_eq!(run["name"], format!("ignored-allocation-failure/verifier-on/fail-point-{k}"));
    assert_eq!(run["actual"]["kind"], "bugcheck", "{run}");
    assert_eq!(run["actual"]["code"], "0x50", "PAGE_FAULT_IN_NONPAGED_AREA at the NULL: {run}");
    assert_eq!(run["injected_faults"][0]["routine"], "ExAllocatePoolWithTag");
    assert_eq!(run["injected_faults"][0]["site"], shadow["site"]);
    let reproducer = run["reproducer"].as_str().expect("a failed run has a reproducer");
    assert!(reproducer.contains(" boot --run ignored-allocation-failure/verifier-on --suite "), "{reproducer}");
    assert!(reproducer.ends_with(&format!("low-resources-broken.toml --fail-point {k}")), "{reproducer}");
}

/// Every run's name → (boot path, actual verdict) from a report. A vhca.sys run's bugcheck parameters above 4 GiB
/// are blanked: there the device object is the loader's heap object, whose address the guest's ASLR picks anew at
/// every boot (natively it is the model's fixed PDO, compared as it is). The runs an `interleavings` entry expands to
/// are left out: each boot's recording lists its own contended points, so their number and names differ from one
/// boot to the next by design (their verdicts are the suite's to judge, and the suite passed).
fn verdicts(report: &Value) -> Vec<(String, String, Value)> {
    report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["interleaving"]["of"].is_null())
        .map(|r| {
            let name = r["name"].as_str().unwrap().to_string();
            let mut actual = r["actual"].clone();
            // A parameter the suite expects as `*` is one that differs from run to run by design (seed.toml: the
            // addresses), in either personality: dpc-waits-for-device's 0xB8 P3 is an address on the waiting
            // thread's stack, which the guest's ASLR places anew at every boot.
            let expected = r["expected"].as_str().unwrap_or_default();
            if expected.starts_with("bugcheck") {
                let any: Vec<bool> = expected.split_whitespace().skip(2).map(|t| t == "*").collect();
                for (i, p) in actual.get_mut("params").and_then(Value::as_array_mut).into_iter().flatten().enumerate() {
                    if any.get(i).copied().unwrap_or(false) {
                        *p = Value::String("any".into());
                    }
                }
            }
            if name.contains("/sys/") {
                for p in actual.get_mut("params").and_then(Value::as_array_mut).into_iter().flatten() {
                    let value = p.as_str().and_then(|t| u64::from_str_radix(t.trim_start_matches("0x"), 16).ok());
                    if value.is_some_and(|v| v > u32::MAX as u64) {
                        *p = Value::String("address".into());
                    }
                }
            }
            (name, r["path"].as_str().unwrap().to_string(), actual)
        })
        .collect()
}

#[test]
fn seed_suite_passes_from_the_snapshot_and_cold_with_identical_verdicts() {
    if !ready("seed_suite_passes_from_the_snapshot_and_cold_with_identical_verdicts") {
        return;
    }
    let (snap, cold) = (Scratch::new(), Scratch::new());
    let out = snap.command(&["suite", "-j", "2"]).output().expect("run vhca-run");
    assert!(out.status.success(), "the seed suite failed from the snapshot:\n{}", show(&out));
    snap.assert_nothing_left("seed suite, snapshot");
    let out_cold = cold.command(&["--cold", "suite", "-j", "2"]).output().expect("run vhca-run");
    assert!(out_cold.status.success(), "the seed suite failed cold:\n{}", show(&out_cold));
    cold.assert_nothing_left("seed suite, cold");
    let (a, b) = (snap.report(), cold.report());
    assert!(a["totals"]["runs"].as_u64().unwrap() >= 22, "the seed suite has 11 runs in two modes");
    let (va, vb) = (verdicts(&a), verdicts(&b));
    assert_eq!(va.len(), vb.len());
    for ((name, path, actual), (cold_name, cold_path, cold_actual)) in va.iter().zip(&vb) {
        assert_eq!(name, cold_name);
        assert_eq!((path.as_str(), cold_path.as_str()), ("snapshot", "cold"), "{name}: {}", show(&out));
        assert_eq!(actual, cold_actual, "{name}: the snapshot and the cold boot disagree");
    }
    let wall = |r: &Value| r["totals"]["wall_seconds"].as_f64().unwrap();
    assert!(wall(&a) < wall(&b), "snapshot suite {} s is not faster than cold {} s", wall(&a), wall(&b));
}

/// The file `name` in the artifact folder of the report's run `index`.
fn artifact(report: &Value, index: usize, name: &str) -> String {
    let dir = report["runs"][index]["artifact_dir"].as_str().unwrap();
    std::fs::read_to_string(Path::new(dir).join(name)).unwrap_or_default()
}

#[test]
fn a_guest_left_clean_serves_the_next_run_and_one_with_iommu_faults_does_not() {
    if !ready("a_guest_left_clean_serves_the_next_run_and_one_with_iommu_faults_does_not") {
        return;
    }
    // In suite order: a pass, a bugcheck (the NT model's, in the run's process), a run whose device DMA is refused
    // by the vIOMMU (the kernel logs the fault), then a pass.
    let filter = "^(smoke/verifier-off|fast-mutex-create-cq/verifier-on|use-after-unmap/verifier-off|io-map-common-buffer/verifier-off)$";
    let s = Scratch::new();
    let out = s.command(&["suite", "-j", "1", "--filter", filter]).output().expect("run vhca-run");
    assert!(out.status.success(), "{}", show(&out));
    s.assert_nothing_left("reused guests");
    let report = s.report();
    let names: Vec<&str> = report["runs"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "smoke/verifier-off",
            "fast-mutex-create-cq/verifier-on",
            "use-after-unmap/verifier-off",
            "io-map-common-buffer/verifier-off"
        ]
    );
    let reused: Vec<bool> = (0..4).map(|i| artifact(&report, i, "restore.log").contains("guest reused")).collect();
    // The bugcheck left the guest clean; the IOMMU fault did not: the last run restored a fresh guest.
    assert_eq!(reused, [false, true, true, false], "{}", show(&out));
    assert!(artifact(&report, 1, "restore.log").contains("it served 1 run(s) before this one"));
    assert!(artifact(&report, 2, "restore.log").contains("it served 2 run(s) before this one"));
    let faulted = artifact(&report, 2, "serial.log");
    assert!(faulted.contains("the guest ends here:") && faulted.contains("IOMMU fault line(s)"), "{faulted}");
    for i in 0..4 {
        // Each run's console is its own: one request, one result.
        let serial = artifact(&report, i, "serial.log");
        assert_eq!(serial.matches("run request:").count(), 1, "run {i}:\n{serial}");
        assert_eq!(serial.matches("VHCA-RESULT ").count(), 1, "run {i}:\n{serial}");
    }
    // The kept guest ejected the HCA, QEMU said so, and the run's device ended by itself.
    assert!(artifact(&report, 0, "qmp-events.jsonl").contains("DEVICE_DELETED"));
    assert!(artifact(&report, 0, "ending.log").contains("agent ready again"));

    // --restore-per-run: every run restores its own guest.
    let fresh = Scratch::new();
    let out = fresh
        .command(&["--restore-per-run", "suite", "-j", "1", "--filter", "^(smoke|fast-mutex-create-cq)/verifier-off$"])
        .output()
        .expect("run vhca-run");
    assert!(out.status.success(), "{}", show(&out));
    fresh.assert_nothing_left("--restore-per-run");
    let report = fresh.report();
    assert!((0..2).all(|i| !artifact(&report, i, "restore.log").contains("guest reused")), "{}", show(&out));
    assert!((0..2).all(|i| artifact(&report, i, "restore.log").contains("guest continued")), "{}", show(&out));
}

/// Runs `vhca-run` with a private snapshot dir; returns the report and stderr.
fn run_with_snapshots(s: &Scratch, snapshots: &Path, args: &[&str], env: &[(&str, &str)]) -> (Value, String) {
    let mut cmd = s.command(args);
    cmd.env("VHCA_SNAPSHOT_DIR", snapshots);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run vhca-run");
    assert!(out.status.success(), "{args:?} failed:\n{}", show(&out));
    s.assert_nothing_left(&format!("{args:?}"));
    (s.report(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The snapshot key a session said it restores from.
fn restored_key(stderr: &str) -> Option<String> {
    let rest = stderr.split("runs restore snapshot ").nth(1)?;
    Some(rest.split_whitespace().next()?.to_string())
}

fn single_path(report: &Value) -> String {
    let paths: Vec<&str> = report["runs"].as_array().unwrap().iter().map(|r| r["path"].as_str().unwrap()).collect();
    assert!(paths.windows(2).all(|w| w[0] == w[1]), "mixed paths {paths:?}");
    paths[0].to_string()
}

#[test]
fn stale_snapshot_is_rebuilt_and_never_restored() {
    if !ready("stale_snapshot_is_rebuilt_and_never_restored") {
        return;
    }
    let (s, snapshots) = (Scratch::new(), tempfile::tempdir().unwrap());
    let boot = ["boot"];
    let (report, err) = run_with_snapshots(&s, snapshots.path(), &boot, &[]);
    let first = restored_key(&err).unwrap_or_else(|| panic!("no snapshot used:\n{err}"));
    assert!(err.contains(&format!("no snapshot {first} yet")), "{err}");
    assert_eq!(single_path(&report), "snapshot");

    // A baked-in guest option changes the command line: a new snapshot, the old one named stale.
    let (report, err) =
        run_with_snapshots(&s, snapshots.path(), &boot, &[("VHCA_GUEST_APPEND", "vhca.timeout_ms=6000")]);
    let second = restored_key(&err).unwrap();
    assert_ne!(second, first, "{err}");
    assert!(err.contains(&format!("no snapshot {second} yet")) && err.contains(&format!("not used: {first}")), "{err}");
    assert_eq!(single_path(&report), "snapshot");
    assert_eq!(report["runs"][0]["outcome"]["result"], "pass");

    // A changed guest binary makes a new image: again a new snapshot.
    let guest = std::env::var_os("VHCA_GUEST_BIN").map(PathBuf::from).unwrap_or_else(|| {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
        target.join("x86_64-unknown-linux-gnu/release/vhca-guest")
    });
    let changed = s.artifacts.path().join("vhca-guest-changed");
    let mut bytes = std::fs::read(&guest).unwrap();
    // Bytes after the ELF's last section: the program runs the same, the image's key changes.
    bytes.extend_from_slice(b"stale-snapshot-test");
    std::fs::write(&changed, bytes).unwrap();
    std::fs::set_permissions(&changed, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let (report, err) =
        run_with_snapshots(&s, snapshots.path(), &boot, &[("VHCA_GUEST_BIN", changed.to_str().unwrap())]);
    let third = restored_key(&err).unwrap();
    assert!(third != first && third != second, "{err}");
    assert!(err.contains(&format!("no snapshot {third} yet")), "{err}");
    assert_eq!(report["runs"][0]["outcome"]["result"], "pass");

    // Back to the first configuration: its snapshot is restored as it is, not rebuilt.
    let (report, err) = run_with_snapshots(&s, snapshots.path(), &boot, &[]);
    assert_eq!(restored_key(&err).as_deref(), Some(first.as_str()), "{err}");
    assert!(!err.contains("yet: booting the guest"), "rebuilt a valid snapshot:\n{err}");
    assert_eq!(single_path(&report), "snapshot");
}

#[test]
fn corrupt_snapshot_gives_a_log_line_and_cold_boots_not_a_failed_suite() {
    if !ready("corrupt_snapshot_gives_a_log_line_and_cold_boots_not_a_failed_suite") {
        return;
    }
    let (s, snapshots) = (Scratch::new(), tempfile::tempdir().unwrap());
    let smoke = ["suite", "--filter", "^smoke/", "-j", "1"];
    let (report, err) = run_with_snapshots(&s, snapshots.path(), &smoke, &[]);
    let key = restored_key(&err).unwrap_or_else(|| panic!("no snapshot used:\n{err}"));
    assert_eq!(single_path(&report), "snapshot");
    let dir = snapshots.path().join(&key);
    let state = dir.join(vhca_run::snapshot::STATE_FILE);

    // Garbage in the middle of the file: the digest check refuses it before any restore.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&state).unwrap();
        f.write_at(&[0xAB; 4096], 64 << 20).unwrap();
    }
    let (report, err) = run_with_snapshots(&s, snapshots.path(), &smoke, &[]);
    assert!(err.contains(&format!("snapshot {key} is corrupt (state.img content digest")), "{err}");
    assert!(err.contains("this session boots cold"), "{err}");
    assert_eq!(single_path(&report), "cold");
    assert_eq!(report["totals"]["failed"], 0);
    assert!(!dir.exists(), "the corrupt snapshot was kept");

    // The next session rebuilds it.
    let (report, err) = run_with_snapshots(&s, snapshots.path(), &smoke, &[]);
    assert_eq!(restored_key(&err).as_deref(), Some(key.as_str()));
    assert!(err.contains(&format!("no snapshot {key} yet")), "{err}");
    assert_eq!(single_path(&report), "snapshot");

    // A file that passes the check but will not load (cut short, its record made to match): the first run's restore
    // fails, the run boots cold and says why, and the second run goes cold at once.
    let f = std::fs::OpenOptions::new().write(true).open(&state).unwrap();
    f.set_len(1 << 20).unwrap();
    let meta_path = dir.join("snapshot.json");
    let mut meta: Value = serde_json::from_str(&std::fs::read_to_string(&meta_path).unwrap()).unwrap();
    meta["size"] = (1u64 << 20).into();
    meta["digest"] = vhca_run::snapshot::state_digest(&state).unwrap().into();
    std::fs::write(&meta_path, meta.to_string()).unwrap();
    let (report, err) = run_with_snapshots(&s, snapshots.path(), &smoke, &[]);
    assert_eq!(restored_key(&err).as_deref(), Some(key.as_str()), "{err}");
    assert_eq!(single_path(&report), "cold");
    assert_eq!(report["totals"]["failed"], 0);
    let notes = report["runs"][0]["notes"].to_string();
    assert!(notes.contains("snapshot restore failed (loading the snapshot: "), "{notes}\n{err}");
    assert!(notes.contains(&format!("snapshot {key} removed")), "{notes}");
    assert!(!report["runs"][1]["notes"].to_string().contains("restore failed"), "the second run tried it again");
    assert!(!dir.exists());
}

#[test]
fn hung_guest_is_a_hang_and_leaves_nothing() {
    if !ready("hung_guest_is_a_hang_and_leaves_nothing") {
        return;
    }
    let s = Scratch::new();
    let start = Instant::now();
    let out = s
        .command(&["boot", "--param", "init=hang", "--silence", "5", "--timeout", "120"])
        .output()
        .expect("run vhca-run");
    let took = start.elapsed();
    assert_eq!(out.status.code(), Some(1), "a hung guest must fail a run expecting pass:\n{}", show(&out));
    s.assert_nothing_left("hung guest");
    let run = &s.report()["runs"][0];
    assert_eq!(run["actual"]["kind"], "hang", "{}", show(&out));
    assert!(run["outcome"]["reason"].as_str().unwrap().starts_with("expected pass, got hang (no output for"));
    // The guest really booted and hung in /init: this is the silence path, not a start-up failure.
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("vhca.init=hang: hanging without a result"),
        "{}",
        show(&out)
    );
    // Declared hung on silence (5 s), long before the 120 s timeout.
    assert!(took < Duration::from_secs(60), "took {took:?}");
    let observation: Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(run["artifact_dir"].as_str().unwrap()).join("observation.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(observation["qemu_exit"]["state"], "killed-by-runner");
    assert_eq!(observation["timed_out"], true);
}

#[test]
fn qemu_killed_mid_run_is_a_device_failure_and_leaves_nothing() {
    if !ready("qemu_killed_mid_run_is_a_device_failure_and_leaves_nothing") {
        return;
    }
    let (run, output) = kill_mid_run("qemu-system", "kill QEMU");
    assert_eq!(run["actual"]["kind"], "device-failure", "{output}");
    let text = run["actual_text"].as_str().unwrap();
    assert!(text.contains("QEMU killed by signal 9 (SIGKILL)"), "{text}\n{output}");
}

#[test]
fn device_killed_mid_run_is_a_device_failure_and_leaves_nothing() {
    if !ready("device_killed_mid_run_is_a_device_failure_and_leaves_nothing") {
        return;
    }
    let (run, output) = kill_mid_run("vhca-device", "kill the device");
    assert_eq!(run["actual"]["kind"], "device-failure", "{output}");
    let text = run["actual_text"].as_str().unwrap();
    assert!(text.contains("vhca-device killed by signal 9 (SIGKILL)"), "{text}\n{output}");
}

#[test]
fn ctrl_c_stops_the_run_and_leaves_nothing() {
    if !ready("ctrl_c_stops_the_run_and_leaves_nothing") {
        return;
    }
    let s = Scratch::new();
    let (child, stderr, seen) = boot_hung_guest(&s);
    signal(child.id(), libc::SIGINT);
    let (status, output) = finish(child, stderr, seen);
    assert_eq!(status.code(), Some(130), "{output}");
    s.assert_nothing_left("Ctrl-C");
}

#[test]
fn ctrl_c_during_a_run_on_a_reused_guest_leaves_nothing() {
    if !ready("ctrl_c_during_a_run_on_a_reused_guest_leaves_nothing") {
        return;
    }
    // -j 1: both smoke runs leave their guest clean, so the hanging run is the guest's third.
    let s = Scratch::new();
    let suite = suite_file("runner.toml");
    let cmd = s.command(&["suite", suite.to_str().unwrap(), "--filter", "^(smoke|hang)/", "-j", "1"]);
    let (child, stderr, seen) = spawn_until(cmd, "start hang/verifier-off", "the hang run never started");
    // A suite does not echo the console: the hanging guest is seen in its run's serial.log in the work dir.
    let hanging = || {
        std::fs::read_dir(s.tmp.path()).unwrap().flatten().any(|dir| {
            let serial = std::fs::read_to_string(dir.path().join("serial.log")).unwrap_or_default();
            serial.contains("vhca.init=hang: hanging without a result")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !hanging() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(hanging(), "the hang run's guest never got to its hang:\n{seen}");
    // The two smoke runs' folders say the second one ran on the first one's guest.
    let restore = std::fs::read_to_string(s.artifacts.path().join("smoke/verifier-on/restore.log")).unwrap_or_default();
    assert!(restore.contains("guest reused"), "smoke/verifier-on did not reuse the guest:\n{restore}\n{seen}");
    signal(child.id(), libc::SIGINT);
    let (status, output) = finish(child, stderr, seen);
    assert_eq!(status.code(), Some(130), "{output}");
    s.assert_nothing_left("Ctrl-C on a reused guest");
}

#[test]
fn runner_panic_mid_run_leaves_nothing() {
    if !ready("runner_panic_mid_run_leaves_nothing") {
        return;
    }
    let s = Scratch::new();
    let out = s
        .command(&["boot", "--param", "init=hang", "--silence", "60"])
        .env("VHCA_RUN_TEST_PANIC", "1")
        .output()
        .expect("run vhca-run");
    assert_eq!(out.status.code(), Some(101), "a panicking runner exits 101:\n{}", show(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("VHCA_RUN_TEST_PANIC is set"), "{}", show(&out));
    s.assert_nothing_left("runner panic");
}
