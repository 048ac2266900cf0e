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
    // The build's QEMU names the snapshot dir, not the run's temp dir.
    let builds = snapshots.path().to_string_lossy().into_owned();
    wait_for("the snapshot build's QEMU dying with the runner", Duration::from_secs(3), || {
        processes_mentioning(&builds).is_empty()
    });
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

/// How a paused suite ended.
struct Finished {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Finished {
    fn show(&self) -> String {
        format!("exit {:?}\n--- stdout\n{}\n--- stderr\n{}", self.code, self.stdout, self.stderr)
    }
}

/// Runs the runner suite's two smoke runs one after the other (`-j 1`: the first run's guest serves the second when it is left clean)
/// from the snapshot cache `snapshots`, with the runner pausing at `phases` (the test-only `phase_hook` pause). At
/// each pause `act` gets the phase, its number (from 1) and the pids the runner wrote; it returns whether the runner
/// may go on now (false: asked again at the next look).
fn smoke_suite_pausing_at(
    s: &Scratch,
    snapshots: &Path,
    phases: &str,
    act: impl FnMut(&str, usize, &serde_json::Value) -> bool,
) -> Finished {
    smoke_suite_with(s, snapshots, phases, &[], act)
}

/// `smoke_suite_pausing_at` with `flags` before the suite command (`--restore-per-run`: each run restores its own
/// guest, the second one loaded ahead while the first runs, instead of the first run's guest serving the second).
fn smoke_suite_with(
    s: &Scratch,
    snapshots: &Path,
    phases: &str,
    flags: &[&str],
    mut act: impl FnMut(&str, usize, &serde_json::Value) -> bool,
) -> Finished {
    use vhca_run::phase_hook::{PAUSE_AT_ENV, PAUSE_DIR_ENV};
    let pauses = tempfile::tempdir().unwrap();
    let (out, err) = (pauses.path().join("stdout"), pauses.path().join("stderr"));
    let suite = suite_file("runner.toml");
    let mut args = flags.to_vec();
    args.extend(["suite", suite.to_str().unwrap(), "--filter", "^smoke/", "-j", "1"]);
    let mut cmd = s.command(&args);
    cmd.env("VHCA_SNAPSHOT_DIR", snapshots)
        .env(PAUSE_AT_ENV, phases)
        .env(PAUSE_DIR_ENV, pauses.path())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap());
    let mut runner = cmd.spawn().expect("run vhca-run");
    let mut released = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    let status = loop {
        let mut markers: Vec<String> = std::fs::read_dir(pauses.path())
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.strip_suffix(".pids").map(String::from))
            .filter(|stem| !stem.starts_with('.') && !released.contains(stem))
            .collect();
        markers.sort();
        for stem in markers {
            let (phase, n) = stem.rsplit_once('-').unwrap();
            let pids: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(pauses.path().join(format!("{stem}.pids"))).unwrap())
                    .unwrap();
            if act(phase, n.parse().unwrap(), &pids) {
                std::fs::write(pauses.path().join(format!("{stem}.go")), b"").unwrap();
                released.insert(stem);
            }
        }
        if let Some(status) = runner.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = runner.kill();
            panic!("the paused suite did not end within 600 s; paused at {released:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Finished {
        code: status.code(),
        stdout: std::fs::read_to_string(out).unwrap(),
        stderr: std::fs::read_to_string(err).unwrap(),
    }
}

/// A cache dir the fault tests that leave the snapshot intact share, so the snapshot is built once for them. A
/// static's TempDir is never dropped, so the directory (a 500 MiB snapshot in it) would outlive the test process:
/// it is removed at the process's exit instead, which the test harness reaches through exit(3) after the last test.
static SHARED_SNAPSHOTS: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

fn shared_snapshots() -> &'static Path {
    SHARED_SNAPSHOTS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        // SAFETY: registers a plain extern "C" function with no arguments; it runs once, at exit.
        assert_eq!(unsafe { libc::atexit(remove_shared_snapshots) }, 0, "atexit");
        dir
    })
}

/// The atexit handler of `shared_snapshots`: the directory, if it was made.
extern "C" fn remove_shared_snapshots() {
    if let Some(dir) = SHARED_SNAPSHOTS.get() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn kill_pid(pids: &serde_json::Value, which: &str) {
    let pid = pids[which].as_u64().unwrap_or_else(|| panic!("no {which} pid in {pids}"));
    signal(u32::try_from(pid).unwrap(), libc::SIGKILL);
}

/// The run's vhca-device once it listens: the load pause does not know it (the device starts while QEMU loads).
fn listening_device(s: &Scratch) -> u32 {
    let needle = s.tmp.path().to_string_lossy().into_owned();
    let mut found = None;
    wait_for("the run's vhca-device listening", Duration::from_secs(30), || {
        found = processes_mentioning(&needle).into_iter().find_map(|(pid, cmd)| {
            let words: Vec<&str> = cmd.split(' ').collect();
            let socket = words.iter().position(|w| *w == "--socket-path").and_then(|i| words.get(i + 1))?;
            (cmd.contains("vhca-device") && Path::new(socket).exists()).then_some(pid)
        });
        found.is_some()
    });
    found.unwrap()
}

/// Both runs have a report on disk (`finished-runs.jsonl` and each run's `run-report.json`), in run order.
fn finished_reports(s: &Scratch) -> Vec<serde_json::Value> {
    let finished = s.artifacts.path().join(vhca_run::finished_runs::FINISHED_RUNS);
    let text = std::fs::read_to_string(&finished).unwrap_or_default();
    let reports: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    for report in &reports {
        let dir = PathBuf::from(report["artifact_dir"].as_str().expect("an artifact dir"));
        assert!(dir.join(vhca_run::finished_runs::RUN_REPORT).is_file(), "{} has no run report", dir.display());
    }
    let runs = s.report()["runs"].as_array().unwrap().clone();
    assert_eq!(reports.len(), runs.len(), "every run that finished has its report on disk");
    runs
}

/// The smoke suite with `which` ("qemu" or "device", from the pause's pids) SIGKILLed at the first pause at `phase`.
fn kill_at_first(s: &Scratch, phase: &str, which: &str) -> Finished {
    smoke_suite_pausing_at(s, shared_snapshots(), phase, |_, n, pids| {
        if n == 1 {
            kill_pid(pids, which);
        }
        true
    })
}

/// The first run's restore failed and it booted cold, its note containing `words`; the second run restored.
fn first_run_booted_cold(s: &Scratch, end: &Finished, words: &[&str]) {
    assert_eq!(end.code, Some(0), "{}", end.show());
    let runs = finished_reports(s);
    assert_eq!(runs[0]["path"], "cold", "{}", end.show());
    let first = notes(&runs[0]);
    assert!(words.iter().all(|w| first.contains(w)), "{words:?} not in the note:\n{}", end.show());
    assert!(!first.contains("removed"), "a killed QEMU says nothing about the file:\n{}", end.show());
    assert_eq!(runs[1]["path"], "snapshot", "the snapshot stays in use:\n{}", end.show());
    no_build_dir_left(shared_snapshots());
    s.assert_nothing_left(words[0]);
}

fn notes(run: &serde_json::Value) -> String {
    run["notes"]
        .as_array()
        .map(|n| n.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join("\n"))
        .unwrap_or_default()
}

fn no_build_dir_left(snapshots: &Path) {
    assert!(entries(snapshots, ".build-").is_empty(), "a snapshot build dir was left");
}

/// For a cache only this test's runners used (the shared one's locks are other tests' runners' too).
fn no_build_dir_or_lock_held(snapshots: &Path) {
    no_build_dir_left(snapshots);
    for entry in entries(snapshots, "") {
        if entry.extension().is_some_and(|e| e == "lock" || e == "use") {
            assert!(!locked(&entry), "{} is still locked after the runner ended", entry.display());
        }
    }
}

#[test]
fn snapshot_truncated_between_its_check_and_the_restore_boots_cold_and_goes() {
    if !ready("snapshot_truncated_between_its_check_and_the_restore_boots_cold_and_goes") {
        return;
    }
    let s = Scratch::new();
    let snapshots = tempfile::tempdir().unwrap();
    let mut truncated = None;
    let end = smoke_suite_pausing_at(&s, snapshots.path(), "snapshot-checked", |_, _, _| {
        let dir =
            entries(snapshots.path(), "").into_iter().find(|p| p.join("state.img").is_file()).expect("a snapshot");
        let state = dir.join("state.img");
        let size = std::fs::metadata(&state).unwrap().len();
        std::fs::File::options().write(true).open(&state).unwrap().set_len(size / 2).unwrap();
        truncated = Some(dir);
        true
    });
    assert_eq!(end.code, Some(0), "both runs pass, cold:\n{}", end.show());
    let runs = finished_reports(&s);
    let first = notes(&runs[0]);
    assert!(first.contains("snapshot restore failed") && first.contains("removed, later runs boot cold"), "{first}");
    for run in &runs {
        assert_eq!((run["outcome"]["result"].as_str(), run["path"].as_str()), (Some("pass"), Some("cold")), "{run}");
    }
    assert!(
        !truncated.expect("the pause came").exists(),
        "the truncated snapshot must go, so the next session rebuilds it"
    );
    no_build_dir_or_lock_held(snapshots.path());
    s.assert_nothing_left("snapshot truncated");
}

#[test]
fn qemu_killed_while_it_loads_the_snapshot_its_own_or_ahead_boots_that_run_cold() {
    if !ready("qemu_killed_while_it_loads_the_snapshot_its_own_or_ahead_boots_that_run_cold") {
        return;
    }
    // The first run's own restore.
    let s = Scratch::new();
    let end = kill_at_first(&s, "load", "qemu");
    first_run_booted_cold(&s, &end, &["QEMU killed by signal 9 while loading"]);

    // The second run's guest, loaded ahead while the first run is held at its first output (with a guest per run:
    // by default the first run's guest serves the second, and none is loaded ahead).
    let s = Scratch::new();
    let mut ahead_killed = false;
    let flags = ["--restore-per-run"];
    let end = smoke_suite_with(&s, shared_snapshots(), "load,mid-run", &flags, |phase, n, pids| match (phase, n) {
        ("load", 2) => {
            kill_pid(pids, "qemu");
            ahead_killed = true;
            true
        }
        // Run 1 stays mid-run until the load ahead was hit: that load is the second run's, loaded ahead.
        ("mid-run", 1) => ahead_killed,
        _ => true,
    });
    assert_eq!(end.code, Some(0), "{}", end.show());
    let runs = finished_reports(&s);
    assert_eq!(runs[0]["path"], "snapshot", "{}", end.show());
    assert_eq!(runs[1]["path"], "cold", "{}", end.show());
    assert!(notes(&runs[1]).contains("QEMU killed by signal 9 while loading"), "{}", end.show());
    no_build_dir_left(shared_snapshots());
    s.assert_nothing_left("QEMU killed in the load ahead");
}

/// The first run's restore lost its device: a device failure naming the kill; the second run passes from the snapshot.
fn first_run_lost_its_device(s: &Scratch, end: &Finished) {
    assert_eq!(end.code, Some(1), "a run with a dead device fails the suite:\n{}", end.show());
    let runs = finished_reports(s);
    assert_eq!(runs[0]["actual"]["kind"], "device-failure", "{}", end.show());
    let text = runs[0]["actual_text"].as_str().unwrap();
    assert!(text.contains("vhca-device killed by signal 9 (SIGKILL)") && text.contains("during the restore"), "{text}");
    assert_eq!((runs[1]["outcome"]["result"].as_str(), runs[1]["path"].as_str()), (Some("pass"), Some("snapshot")));
    no_build_dir_left(shared_snapshots());
    s.assert_nothing_left("device killed in the restore");
}

#[test]
fn device_killed_while_qemu_loads_the_snapshot_is_a_device_failure() {
    if !ready("device_killed_while_qemu_loads_the_snapshot_is_a_device_failure") {
        return;
    }
    let s = Scratch::new();
    let end = smoke_suite_pausing_at(&s, shared_snapshots(), "load", |_, n, _| {
        if n == 1 {
            signal(listening_device(&s), libc::SIGKILL);
        }
        true
    });
    first_run_lost_its_device(&s, &end);
}

#[test]
fn qemu_killed_during_the_hot_plug_boots_that_run_cold() {
    if !ready("qemu_killed_during_the_hot_plug_boots_that_run_cold") {
        return;
    }
    let s = Scratch::new();
    let end = kill_at_first(&s, "hot-plug", "qemu");
    first_run_booted_cold(&s, &end, &["QEMU killed by signal 9 (SIGKILL)", "device_add"]);
}

#[test]
fn device_killed_during_the_hot_plug_is_a_device_failure() {
    if !ready("device_killed_during_the_hot_plug_is_a_device_failure") {
        return;
    }
    let s = Scratch::new();
    let end = kill_at_first(&s, "hot-plug", "device");
    first_run_lost_its_device(&s, &end);
}

#[test]
fn a_runner_pruning_a_shared_cache_skips_the_snapshot_another_runner_uses() {
    if !ready("a_runner_pruning_a_shared_cache_skips_the_snapshot_another_runner_uses") {
        return;
    }
    let snapshots = tempfile::tempdir().unwrap();
    let (a, b) = (Scratch::new(), Scratch::new());
    let mut pruner = None;
    let mut in_use = None;
    // Runner A restores from its snapshot and is held at its first run's first output while B, whose guest options
    // differ (another snapshot key), builds its own snapshot and prunes the cache.
    let end = smoke_suite_pausing_at(&a, snapshots.path(), "mid-run", |_, n, _| {
        if n != 1 {
            return true;
        }
        let used = entries(snapshots.path(), "").into_iter().find(|p| p.join("state.img").is_file()).unwrap();
        // Two newer snapshots of other machines: A's is now the oldest, the one a plain LRU prune removes.
        let later = std::time::SystemTime::now() + Duration::from_secs(3600);
        for (i, name) in ["other-1", "other-2"].iter().enumerate() {
            let dir = snapshots.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            let meta = std::fs::File::create(dir.join("snapshot.json")).unwrap();
            meta.set_modified(later + Duration::from_secs(i as u64)).unwrap();
        }
        let suite = suite_file("runner.toml");
        let mut cmd = b.command(&["suite", suite.to_str().unwrap(), "--filter", "^smoke/verifier-off$"]);
        cmd.env("VHCA_SNAPSHOT_DIR", snapshots.path()).env("VHCA_GUEST_APPEND", "no_timer_check");
        pruner = Some(cmd.output().expect("run the second vhca-run"));
        in_use = Some(used);
        true
    });
    let pruner = pruner.expect("A reached its first run");
    assert!(pruner.status.success(), "the pruning runner:\n{}", show(&pruner));
    assert!(String::from_utf8_lossy(&pruner.stderr).contains(" saved in "), "B built (and pruned):\n{}", show(&pruner));
    let in_use = in_use.unwrap();
    assert!(in_use.join("state.img").is_file(), "the snapshot A uses was pruned");
    assert!(!snapshots.path().join("other-1").exists(), "the next oldest goes in its place");
    assert!(snapshots.path().join("other-2").exists());
    assert_eq!(end.code, Some(0), "{}", end.show());
    let runs = finished_reports(&a);
    let paths: Vec<&str> = runs.iter().map(|r| r["path"].as_str().unwrap()).collect();
    assert_eq!(paths, ["snapshot", "snapshot"], "A's second run restores the same snapshot:\n{}", end.show());
    no_build_dir_or_lock_held(snapshots.path());
    a.assert_nothing_left("runner A");
    b.assert_nothing_left("runner B");
}
