//! Platform faults lose nothing: the runner itself killed with SIGKILL (what a CI system does to a cancelled job),
//! once while it builds the snapshot and once mid-suite. Its QEMU and device die with it (PDEATHSIG), the cache
//! locks it held are free at once, the reports of the runs that finished are on disk, and the next start sweeps the
//! work dirs it left. Prerequisites missing: fails under CI=true, skipped with the reason elsewhere.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn entries(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(read) = std::fs::read_dir(dir) else { return Vec::new() };
    read.flatten().filter(|e| e.file_name().to_string_lossy().starts_with(prefix)).map(|e| e.path()).collect()
}

/// Whether someone holds an flock on `path` (flock(1) -n fails then).
fn locked(path: &Path) -> bool {
    !Command::new("flock").arg("-n").arg(path).arg("true").status().expect("flock(1) from util-linux").success()
}

fn sigkill(child: &mut Child) {
    signal(child.id(), libc::SIGKILL);
    child.wait().unwrap();
}

/// After the runner died: its children follow within about 1.5 s (PDEATHSIG), and the work dirs stay.
fn children_die_and_work_dirs_stay(s: &Scratch, context: &str) -> Vec<PathBuf> {
    let needle = s.tmp.path().to_string_lossy().into_owned();
    let killed = Instant::now();
    wait_for(&format!("{context}: QEMU and the device dying with the runner"), Duration::from_secs(3), || {
        processes_mentioning(&needle).is_empty()
    });
    eprintln!("{context}: children gone {:.2} s after the SIGKILL", killed.elapsed().as_secs_f64());
    entries(s.tmp.path(), "vhca-run-")
}

#[test]
fn runner_killed_with_sigkill_loses_nothing_and_the_next_start_sweeps() {
    if !ready("runner_killed_with_sigkill_loses_nothing_and_the_next_start_sweeps") {
        return;
    }
    let s = Scratch::new();
    let snapshots = tempfile::tempdir().unwrap();
    let suite = suite_file("runner.toml");
    let start = |s: &Scratch| {
        let mut cmd = s.command(&["suite", suite.to_str().unwrap(), "--filter", "^(smoke|hang)/", "-j", "1"]);
        cmd.env("VHCA_SNAPSHOT_DIR", snapshots.path()).stdout(Stdio::null()).stderr(Stdio::null());
        cmd.spawn().expect("run vhca-run")
    };

    // 1. Killed while it builds the snapshot, holding that snapshot's lock.
    let mut runner = start(&s);
    wait_for("the snapshot build starting", Duration::from_secs(120), || {
        !entries(snapshots.path(), ".build-").is_empty()
    });
    let locks = entries(snapshots.path(), "");
    let locks: Vec<PathBuf> = locks.into_iter().filter(|p| p.extension().is_some_and(|e| e == "lock")).collect();
    assert!(!locks.is_empty() && locks.iter().all(|l| locked(l)), "the builder holds its snapshot lock: {locks:?}");
    sigkill(&mut runner);
    children_die_and_work_dirs_stay(&s, "killed mid-build");
    for lock in &locks {
        assert!(!locked(lock), "{} is still locked after its holder was killed", lock.display());
    }

    // 2. Killed mid-suite, after the first run finished: that run's report is on disk, the second run's work dir
    // stays behind.
    let mut runner = start(&s);
    let finished = s.artifacts.path().join(vhca_run::finished_runs::FINISHED_RUNS);
    wait_for("the first run finishing", Duration::from_secs(600), || {
        std::fs::read_to_string(&finished).is_ok_and(|t| t.lines().count() >= 1)
    });
    wait_for("the next run's work dir", Duration::from_secs(60), || !entries(s.tmp.path(), "vhca-run-").is_empty());
    // Let the next run's QEMU and device start, so there is something to die with the runner.
    let needle = s.tmp.path().to_string_lossy().into_owned();
    wait_for("the next run's QEMU", Duration::from_secs(60), || {
        processes_mentioning(&needle).iter().any(|(_, cmd)| cmd.contains("qemu-system"))
    });
    sigkill(&mut runner);
    let left = children_die_and_work_dirs_stay(&s, "killed mid-suite");
    assert!(!left.is_empty(), "the killed run's work dir should still be there for the sweep to find");
    let owner = vhca_run::leftovers::OWNER_FILE;
    assert!(left.iter().all(|d| d.join(owner).exists()), "{left:?} lack their owner file");

    let text = std::fs::read_to_string(&finished).unwrap();
    let reports: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(!reports.is_empty());
    for report in &reports {
        assert_eq!(report["outcome"]["result"], "pass", "{report}");
        let dir = PathBuf::from(report["artifact_dir"].as_str().expect("an artifact dir"));
        assert!(dir.join(vhca_run::finished_runs::RUN_REPORT).is_file(), "{} has no run report", dir.display());
    }

    // 3. The next start (here just listing the suite) sweeps what the dead runner left.
    let out = s.command(&["suite", suite.to_str().unwrap(), "--list"]).output().unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for dir in &left {
        assert!(stderr.contains(&format!("removed {}", dir.display())), "sweep not reported: {stderr}");
    }
    s.assert_nothing_left("after the sweep");
}

/// A tmpfs of `kib` KiB at a fresh directory, unmounted when dropped.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn new(kib: u32) -> SmallDisk {
        let dir = tempfile::tempdir().unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("mount(8)");
        assert!(status.success(), "mounting a {kib} KiB tmpfs needs root, as CI runs");
        SmallDisk { dir }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

#[test]
fn a_full_artifacts_disk_is_a_clear_error_and_costs_no_verdict() {
    if !ready("a_full_artifacts_disk_is_a_clear_error_and_costs_no_verdict") {
        return;
    }
    let s = Scratch::new();
    let disk = SmallDisk::new(64);
    let suite = suite_file("runner.toml");
    let out = Command::new(RUNNER)
        .env("TMPDIR", s.tmp.path())
        .args(["suite", suite.to_str().unwrap(), "--filter", "^smoke/", "-j", "1", "--artifacts"])
        .arg(disk.dir.path())
        .output()
        .expect("run vhca-run");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(2), "a report that cannot be written is the runner's error:\n{}", show(&out));
    assert!(stderr.contains("No space left on device"), "the error names the cause:\n{stderr}");
    // Every run was judged and its verdict shown, on the progress lines and in the table.
    for name in ["smoke/verifier-off", "smoke/verifier-on"] {
        assert!(stderr.contains(&format!("ok   {name}: pass")), "{name}'s verdict lost:\n{stderr}");
    }
    assert!(stdout.contains("2 runs: 2 passed, 0 failed"), "the table is missing:\n{stdout}");
    s.assert_nothing_left("artifacts disk full");
}

#[test]
fn two_runners_sharing_one_cache_build_the_snapshot_once_and_both_pass() {
    if !ready("two_runners_sharing_one_cache_build_the_snapshot_once_and_both_pass") {
        return;
    }
    let snapshots = tempfile::tempdir().unwrap();
    let (a, b) = (Scratch::new(), Scratch::new());
    let suite = suite_file("runner.toml");
    let start = |s: &Scratch| {
        let mut cmd = s.command(&["suite", suite.to_str().unwrap(), "--filter", "^smoke/", "-j", "1"]);
        cmd.env("VHCA_SNAPSHOT_DIR", snapshots.path()).stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd.spawn().expect("run vhca-run")
    };
    let (first, second) = (start(&a), start(&b));
    let (out_a, out_b) = (first.wait_with_output().unwrap(), second.wait_with_output().unwrap());
    assert!(out_a.status.success(), "first runner:\n{}", show(&out_a));
    assert!(out_b.status.success(), "second runner:\n{}", show(&out_b));
    let saved = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).contains(" saved in ");
    assert_eq!(
        [saved(&out_a), saved(&out_b)].iter().filter(|s| **s).count(),
        1,
        "exactly one runner builds the snapshot:\n{}\n{}",
        show(&out_a),
        show(&out_b)
    );
    for (s, out) in [(&a, &out_a), (&b, &out_b)] {
        let report = s.report();
        let paths: Vec<&str> = report["runs"].as_array().unwrap().iter().map(|r| r["path"].as_str().unwrap()).collect();
        assert_eq!(paths, ["snapshot", "snapshot"], "{}", show(out));
        s.assert_nothing_left("shared cache");
    }
    let snapshot_dirs = entries(snapshots.path(), "").into_iter().filter(|p| p.is_dir()).count();
    assert_eq!(snapshot_dirs, 1, "one snapshot, no build dir left");
}
