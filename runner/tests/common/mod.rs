//! What the runner's end-to-end tests share: the prerequisites (and failing, not skipping, under CI), a private
//! TMPDIR and artifact root per test, and the checks that nothing outlived a run.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

pub const RUNNER: &str = env!("CARGO_BIN_EXE_vhca-run");

pub fn suite_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/suites").join(name)
}

/// Where cargo put the builds.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// vhca.sys as ci/build-windows.sh leaves it, and QEMU: what a vhca.sys run needs besides `prerequisites`.
pub fn vhca_sys_built() -> Result<(), String> {
    let dir =
        std::env::var_os("VHCA_WINDOWS_DRIVER_DIR").map(PathBuf::from).unwrap_or_else(|| target_dir().join("vhca-sys"));
    if !dir.join("vhca.sys").is_file() {
        return Err(format!("no vhca.sys in {} (run ci/build-windows.sh)", dir.display()));
    }
    qemu_installed()
}

fn qemu_installed() -> Result<(), String> {
    match Command::new("qemu-system-x86_64").arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err("qemu-system-x86_64 is not installed (ci/setup-host.sh installs it)".into()),
    }
}

/// The binaries vhca-run will use, or why the test cannot run.
pub fn prerequisites() -> Result<(), String> {
    let target = target_dir();
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
    qemu_installed()
}

/// True if the test should go on; panics under CI when it cannot.
pub fn ready(test: &str) -> bool {
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

pub fn show(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A private TMPDIR (where the runner's work dirs and sockets go) and a separate artifact root.
pub struct Scratch {
    pub tmp: tempfile::TempDir,
    pub artifacts: tempfile::TempDir,
}

impl Scratch {
    pub fn new() -> Scratch {
        Scratch { tmp: tempfile::tempdir().unwrap(), artifacts: tempfile::tempdir().unwrap() }
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(RUNNER);
        cmd.env("TMPDIR", self.tmp.path()).args(args).arg("--artifacts").arg(self.artifacts.path());
        cmd
    }

    pub fn report(&self) -> Value {
        let path = self.artifacts.path().join("report.json");
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
            .unwrap()
    }

    /// No process mentions our TMPDIR (QEMU and the device both name their sockets there) and no work dir or
    /// socket is left in it.
    pub fn assert_nothing_left(&self, context: &str) {
        let needle = self.tmp.path().to_string_lossy().into_owned();
        assert_eq!(processes_mentioning(&needle), Vec::<(u32, String)>::new(), "{context}: processes outlived the run");
        let left: Vec<_> = std::fs::read_dir(self.tmp.path()).unwrap().flatten().map(|e| e.path()).collect();
        assert!(left.is_empty(), "{context}: work dirs or sockets left behind: {left:?}");
    }
}

/// Pids and command lines of live processes whose command line mentions `needle`.
pub fn processes_mentioning(needle: &str) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z'));
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if !zombie && cmdline.contains(needle) {
            found.push((pid, cmdline));
        }
    }
    found
}

pub fn signal(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).unwrap();
    // SAFETY: kill(2) on a pid this test found running and means to signal; it touches no memory.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}
