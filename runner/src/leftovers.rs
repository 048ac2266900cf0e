//! What a runner killed with SIGKILL leaves behind, and how the next one clears it. Its children die with it
//! (PDEATHSIG) and the kernel drops its flock()ed cache locks with its fds, but its work dirs stay in the temp dir
//! with their sockets and logs. Each work dir therefore holds an owner file its runner keeps flock()ed for as long
//! as it uses the dir: at start, a work dir whose owner file nobody holds belongs to a dead runner and is removed.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// In every claimed work dir; locked by its runner while it runs.
pub const OWNER_FILE: &str = ".vhca-run-owner";
/// The prefixes of the runner's own temp dirs (runs, and the accelerator probe).
const WORK_DIR_PREFIXES: &[&str] = &["vhca-run-", "vhca-accel-probe-"];

/// A work dir's owner file, locked until this drops; dropping removes the file, so a dir kept on purpose
/// (`boot --keep`) is never swept. Only a runner that dies without dropping it leaves the file unlocked.
#[derive(Debug)]
pub struct WorkDirClaim {
    file: File,
    path: PathBuf,
}

impl Drop for WorkDirClaim {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
        let _ = self.file.flush();
    }
}

/// Exclusive, non-blocking flock: true if taken, false if someone holds it.
fn try_lock(file: &File) -> io::Result<bool> {
    crate::cache_in_use::try_flock(file, libc::LOCK_EX)
}

/// Claims `dir` for this process. The file is locked under another name and renamed into place, so a sweeper never
/// sees an owner file that is not yet locked. The fd is close-on-exec: QEMU and the device do not hold the lock.
pub fn claim(dir: &Path) -> io::Result<WorkDirClaim> {
    let staging = dir.join(format!("{OWNER_FILE}.{}", std::process::id()));
    let mut file = File::create(&staging)?;
    if !try_lock(&file)? {
        return Err(io::Error::other(format!("{} is locked by another process", staging.display())));
    }
    writeln!(file, "{}", std::process::id())?;
    let path = dir.join(OWNER_FILE);
    fs::rename(&staging, &path)?;
    Ok(WorkDirClaim { file, path })
}

/// Removes the work dirs in `temp` whose runner is gone; returns them. A dir without an owner file is left alone: it
/// is being created, or was kept on purpose, or predates owner files.
pub fn sweep_dead_work_dirs(temp: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(temp) else { return Vec::new() };
    let mut swept = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !WORK_DIR_PREFIXES.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let dir = entry.path();
        let Ok(owner) = File::open(dir.join(OWNER_FILE)) else { continue };
        // Holding the dead owner's lock while removing keeps two sweepers from racing over one dir.
        if matches!(try_lock(&owner), Ok(true)) && fs::remove_dir_all(&dir).is_ok() {
            swept.push(dir);
        }
    }
    swept
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    #[test]
    fn a_claimed_dir_survives_the_sweep_and_an_abandoned_one_does_not() {
        let temp = tempfile::tempdir().unwrap();
        let live = temp.path().join("vhca-run-live");
        let dead = temp.path().join("vhca-run-dead");
        let kept = temp.path().join("vhca-run-kept");
        let other = temp.path().join("someone-else");
        for dir in [&live, &dead, &kept, &other] {
            fs::create_dir(dir).unwrap();
        }
        let _live_claim = claim(&live).unwrap();
        // A dead runner: its owner file is there, and nobody holds its lock.
        fs::write(dead.join(OWNER_FILE), b"4242\n").unwrap();
        fs::write(dead.join("device.sock"), b"").unwrap();
        fs::write(other.join(OWNER_FILE), b"").unwrap();
        drop(claim(&kept).unwrap());
        assert!(!kept.join(OWNER_FILE).exists(), "a dropped claim removes its owner file");

        assert_eq!(sweep_dead_work_dirs(temp.path()), vec![dead.clone()]);
        assert!(live.exists() && kept.exists() && other.exists() && !dead.exists());
    }

    #[test]
    fn the_lock_goes_with_the_process_that_held_it() {
        let temp = tempfile::tempdir().unwrap();
        let dir = temp.path().join("vhca-run-child");
        fs::create_dir(&dir).unwrap();
        // A child process claims the dir the way a runner does (flock on the owner file), then is SIGKILLed.
        let owner = dir.join(OWNER_FILE);
        let mut child = std::process::Command::new("flock")
            .arg(&owner)
            .args(["sleep", "30"])
            .process_group(0)
            .spawn()
            .expect("flock(1) from util-linux");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !owner.exists() || try_lock(&File::open(&owner).unwrap()).unwrap() {
            assert!(std::time::Instant::now() < deadline, "the child never took the lock");
            // A lock we took by mistake would be released when the file closes at the end of this iteration.
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(sweep_dead_work_dirs(temp.path()).is_empty(), "a live owner's dir was swept");
        // flock(1) forks sleep, which inherits the lock: SIGKILL the whole group, as a CI system kills a job.
        // SAFETY: kill(2) on the process group of a child this test started.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        child.wait().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if !sweep_dead_work_dirs(temp.path()).is_empty() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the dead owner's lock was never released");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert!(!dir.exists());
    }
}
