//! vhca-run as a user meets it: the binaries copied out of the build tree into an install dir (the device next to
//! the runner, the guest program only on PATH), run by a throwaway unprivileged user from a fresh directory of its
//! own, with a clean environment. It lists the seed suite, prints a run's command lines and boots one smoke run;
//! the artifacts land under that directory, the cache under the user's home, and nothing in the source tree
//! belongs to the user afterwards. Needs root (to create the user): without it, fails under CI=true and is skipped
//! with the reason elsewhere. The user is removed on every path, a failed assertion included.

mod common;

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use common::*;

/// A system user (and its group) made for this test and deleted when dropped.
struct ThrowawayUser {
    name: String,
    home: PathBuf,
}

impl ThrowawayUser {
    fn create(home: &Path) -> Result<ThrowawayUser, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("creating a throwaway user needs root".into());
        }
        let name = format!("vhca-t{}", std::process::id());
        let out = Command::new("useradd")
            .args(["--system", "--user-group", "--create-home", "--shell", "/bin/sh", "--home-dir"])
            .arg(home)
            .arg(&name)
            .output()
            .map_err(|e| format!("useradd: {e}"))?;
        if !out.status.success() {
            return Err(format!("useradd {name}: {}", show(&out)));
        }
        Ok(ThrowawayUser { name, home: home.to_path_buf() })
    }

    fn ids(&self) -> (u32, u32) {
        let id = |flag: &str| {
            let out = Command::new("id").args([flag, &self.name]).output().expect("id(1)");
            String::from_utf8_lossy(&out.stdout).trim().parse::<u32>().expect("a numeric id")
        };
        (id("-u"), id("-g"))
    }

    fn chown(&self, path: &Path) {
        let (uid, gid) = self.ids();
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
    }

    /// `program args` as this user, in `cwd`, with only `env` (plus what `setpriv --reset-env` sets: HOME, USER,
    /// LOGNAME, SHELL) in its environment: none of the variables that point a runner at the build tree.
    fn run(&self, cwd: &Path, env: &[(&str, OsString)], program: &Path, args: &[&str]) -> Output {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid", &self.name, "--regid", &self.name, "--init-groups", "--reset-env", "--", "env"]);
        for (key, value) in env {
            let mut pair = OsString::from(format!("{key}="));
            pair.push(value);
            cmd.arg(pair);
        }
        cmd.arg(program).args(args).current_dir(cwd).env_clear().output().expect("setpriv(1)")
    }
}

impl Drop for ThrowawayUser {
    fn drop(&mut self) {
        let removed = Command::new("userdel").arg(&self.name).status().is_ok_and(|s| s.success());
        if !removed {
            eprintln!("userdel {} failed; retrying with --force", self.name);
            let _ = Command::new("userdel").arg("--force").arg(&self.name).status();
        }
    }
}

/// A built binary: its variable (ci/build.sh exports them), else where a workspace build leaves it.
fn built(env: &str, under_target: &str) -> PathBuf {
    std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
        target.join(under_target)
    })
}

fn copy_executable(from: &Path, to_dir: &Path) -> PathBuf {
    let to = to_dir.join(from.file_name().unwrap());
    std::fs::copy(from, &to).unwrap_or_else(|e| panic!("copying {}: {e}", from.display()));
    std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
    to
}

/// The kernel .deb and its extraction from this process's vhca cache, copied into the user's, so the user's first
/// image build assembles an initramfs instead of downloading a kernel again (what is tested is where files go).
fn seed_kernel_cache(user: &ThrowawayUser, cache: &Path) {
    let ours = vhca_run::paths::cache_dir();
    std::fs::create_dir_all(cache).unwrap();
    for part in ["debs", "kernel"] {
        if ours.join(part).is_dir() {
            let status = Command::new("cp").arg("-a").arg(ours.join(part)).arg(cache).status().unwrap();
            assert!(status.success(), "copying {}", ours.join(part).display());
        }
    }
    let status = Command::new("chown").arg("-R").arg(format!("{0}:{0}", user.name)).arg(&user.home).status().unwrap();
    assert!(status.success());
}

/// Files anywhere under `tree` that belong to the user (anything it wrote there).
fn owned_by(user: &ThrowawayUser, tree: &Path) -> String {
    let out = Command::new("find").arg(tree).args(["-user", &user.name, "-print", "-quit"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn an_installed_runner_works_for_an_unprivileged_user_from_its_own_directory() {
    let name = "an_installed_runner_works_for_an_unprivileged_user_from_its_own_directory";
    if !ready(name) {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    // Parents the user can walk through; what is inside is the user's or read-only.
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let user = match ThrowawayUser::create(&root.path().join("home")) {
        Ok(user) => user,
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => panic!("{name}: under CI: {why}"),
        Err(why) => return eprintln!("SKIPPED {name}: {why}"),
    };
    let (install, on_path, cwd, tmp) =
        (root.path().join("install"), root.path().join("bin"), root.path().join("work"), root.path().join("tmp"));
    for dir in [&install, &on_path, &cwd, &tmp] {
        std::fs::create_dir(dir).unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    user.chown(&cwd);
    user.chown(&tmp);
    let runner = copy_executable(Path::new(RUNNER), &install);
    let device = copy_executable(&built("VHCA_DEVICE_BIN", "release/vhca-device"), &install);
    copy_executable(&built("VHCA_GUEST_BIN", "x86_64-unknown-linux-gnu/release/vhca-guest"), &on_path);
    let cache = user.home.join(".cache/vhca");
    seed_kernel_cache(&user, &cache);
    let mut path = OsString::from(&on_path);
    path.push(":/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin");
    let env = [("PATH", path), ("TMPDIR", tmp.clone().into_os_string())];
    let as_user = |args: &[&str]| user.run(&cwd, &env, &runner, args);

    let listed = as_user(&["suite", "--list"]);
    assert!(listed.status.success(), "suite --list:\n{}", show(&listed));
    assert!(String::from_utf8_lossy(&listed.stdout).contains("smoke/verifier-off  expect pass"), "{}", show(&listed));

    let printed = as_user(&["qemu-args", "--scenario", "smoke", "--dir", "qemu-args-dir"]);
    assert!(printed.status.success(), "qemu-args:\n{}", show(&printed));
    let lines = String::from_utf8_lossy(&printed.stdout).into_owned();
    assert!(lines.contains(&device.display().to_string()), "the device next to the runner is the one used:\n{lines}");
    assert!(cache.join("images").is_dir(), "the image is built in the user's cache {}", cache.display());
    let kvm = Path::new("/dev/kvm");
    let opens = user.run(&cwd, &env, Path::new("/bin/sh"), &["-c", "test -r /dev/kvm && test -w /dev/kvm"]);
    let accel = lines.lines().find(|l| l.contains("accelerator")).unwrap_or_default();
    eprintln!("{name}: as {}: {accel}", user.name);
    if kvm.exists() && !opens.status.success() {
        assert!(
            accel.contains("accelerator tcg (/dev/kvm") && accel.contains("running TCG") && accel.contains("group"),
            "a /dev/kvm the user cannot open is named, with its group:\n{lines}"
        );
    }

    let started = Instant::now();
    let booted = as_user(&["boot", "--scenario", "smoke", "--cold"]);
    eprintln!("{name}: smoke run as {} in {:.1} s", user.name, started.elapsed().as_secs_f64());
    assert!(booted.status.success(), "boot --scenario smoke:\n{}", show(&booted));
    let artifacts = cwd.join("vhca-artifacts/boot");
    assert!(artifacts.join("report.json").is_file(), "no report under the current directory:\n{}", show(&booted));
    assert!(artifacts.join("smoke/verifier-off/serial.log").is_file(), "no run folder in {}", artifacts.display());

    let source_tree = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    assert_eq!(owned_by(&user, &source_tree), "", "the user wrote into the source tree");
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().flatten().map(|e| e.path()).collect();
    assert!(left.is_empty(), "work dirs left in the user's TMPDIR: {left:?}");
}
