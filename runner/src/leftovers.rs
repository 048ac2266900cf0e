//! What a runner killed with SIGKILL leaves behind, and how the next one clears it. Its children die with it
//! (PDEATHSIG) and the kernel drops its flock()ed cache locks with its fds, but its work dirs stay in the temp dir
//! with their sockets and logs. So a work dir says who owns it for its whole life: its name carries its creator
//! (pid, start time, pid namespace) from the mkdir that makes it to the rmdir that ends it, and while a runner uses
//! it, it also holds an owner file that runner keeps flock()ed. At start, a work dir is removed when its owner file
//! is there and nobody holds its lock, or when it has none and its creator is gone; one kept on purpose
//! (`boot --keep`) holds a kept marker and is never removed.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::phase_hook::{self, Phase, Pids};

/// In every claimed work dir; locked by its runner while it runs.
pub const OWNER_FILE: &str = ".vhca-run-owner";
/// In a work dir kept on purpose: no sweep removes it.
pub const KEPT_FILE: &str = ".vhca-run-kept";
/// The prefixes of the runner's own temp dirs (runs, and the accelerator probe).
const WORK_DIR_PREFIXES: &[&str] = &["vhca-run-", "vhca-accel-probe-"];

/// Makes a work dir in the temp dir, named `<prefix><creator>-<random>`: the name is its owner record from the
/// moment it exists, before any owner file can be in it, and until the last rmdir of its removal.
pub fn work_dir(prefix: &str) -> io::Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new().prefix(&format!("{prefix}{}-", Creator::this().tag())).tempdir()?;
    phase_hook::at(Phase::WorkDirMade, Pids::default());
    Ok(dir)
}

/// Keeps `dir` for good: marked first, so a sweep never takes it even if this process dies a moment later.
pub fn keep(dir: tempfile::TempDir) -> io::Result<PathBuf> {
    File::create(dir.path().join(KEPT_FILE))?;
    Ok(dir.keep())
}

/// A work dir's owner file, locked until this drops; dropping removes the file. From then on the dir's name alone
/// says whose it is, for the rest of its life (artifacts copied out, then removed).
#[derive(Debug)]
pub struct WorkDirClaim {
    file: File,
    path: PathBuf,
}

impl Drop for WorkDirClaim {
    fn drop(&mut self) {
        phase_hook::at(Phase::ClaimReleasing, Pids::default());
        let _ = fs::remove_file(&self.path);
        let _ = self.file.flush();
        phase_hook::at(Phase::ClaimReleased, Pids::default());
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

/// Removes the work dirs in `temp` whose runner is gone; returns them. Left alone: a dir kept on purpose, one whose
/// owner file is locked, and one without an owner file whose creator is alive or cannot be told from its name (a
/// dir of a runner in another pid namespace, or of a runner older than creator names).
pub fn sweep_dead_work_dirs(temp: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(temp) else { return Vec::new() };
    let mut swept = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = WORK_DIR_PREFIXES.iter().find_map(|p| name.strip_prefix(p)) else { continue };
        let dir = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_dir()) || dir.join(KEPT_FILE).exists() {
            continue;
        }
        // Holding the dead owner's lock while removing keeps two sweepers from racing over one dir.
        let _held = match File::open(dir.join(OWNER_FILE)) {
            Ok(owner) if matches!(try_lock(&owner), Ok(true)) => owner,
            Ok(_) => continue,
            Err(_) if Creator::parse(rest).is_some_and(|c| c.is_gone()) => {
                // Ownerless, its creator dead: a claim never taken, or dropped before the dir was removed.
                if fs::remove_dir_all(&dir).is_ok() {
                    swept.push(dir);
                }
                continue;
            }
            Err(_) => continue,
        };
        if fs::remove_dir_all(&dir).is_ok() {
            swept.push(dir);
        }
    }
    swept
}

/// The process that made a work dir: a pid alone would be reused, so its start time (clock ticks after boot, from
/// /proc/PID/stat) goes with it; and a pid means something only in its own pid namespace, which is named too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Creator {
    pid: u32,
    start: u64,
    pid_ns: u64,
}

impl Creator {
    fn this() -> Creator {
        let pid = std::process::id();
        let start = process_state(pid).map_or(0, |(_, start)| start);
        Creator { pid, start, pid_ns: pid_namespace().unwrap_or(0) }
    }

    /// `<pid>.<start>.<namespace>`: digits and dots, so it cannot be confused with the random part after it.
    fn tag(self) -> String {
        format!("{}.{}.{}", self.pid, self.start, self.pid_ns)
    }

    /// The creator at the start of what follows a work dir's prefix, if the name has one.
    fn parse(rest: &str) -> Option<Creator> {
        let (tag, _random) = rest.split_once('-')?;
        let mut parts = tag.split('.').map(str::parse::<u64>);
        let (Some(Ok(pid)), Some(Ok(start)), Some(Ok(pid_ns)), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        Some(Creator { pid: u32::try_from(pid).ok()?, start, pid_ns })
    }

    /// True only when it is certain the creator is no longer running: its pid is free, taken by a later process,
    /// or a zombie. Never for another pid namespace's creator, or when its namespace or start is unknown.
    fn is_gone(self) -> bool {
        if self.pid_ns == 0 || self.start == 0 || pid_namespace() != Some(self.pid_ns) {
            return false;
        }
        match process_state(self.pid) {
            Ok((state, start)) => start != self.start || matches!(state, 'Z' | 'X'),
            Err(e) => e.kind() == io::ErrorKind::NotFound,
        }
    }
}

/// A process's state letter and start time, from /proc/PID/stat (fields 3 and 22; the name in field 2 may hold
/// spaces and parentheses, so the fields are counted from its last ')').
fn process_state(pid: u32) -> io::Result<(char, u64)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let bad = || io::Error::other(format!("/proc/{pid}/stat: unexpected format"));
    let (_, fields) = stat.rsplit_once(')').ok_or_else(bad)?;
    let mut fields = fields.split_whitespace();
    let state = fields.next().and_then(|s| s.chars().next()).ok_or_else(bad)?;
    let start = fields.nth(18).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    Ok((state, start))
}

/// This process's pid namespace, as the inode number /proc/self/ns/pid links to (`pid:[4026531836]`).
fn pid_namespace() -> Option<u64> {
    let link = fs::read_link("/proc/self/ns/pid").ok()?;
    link.to_str()?.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
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

    /// A dir named for `creator`, with a socket and a log in it as a run's has, and no owner file.
    fn ownerless(temp: &Path, creator: Creator) -> PathBuf {
        let dir = temp.join(format!("vhca-run-{}-AbC123", creator.tag()));
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join("device.sock"), b"").unwrap();
        fs::write(dir.join("serial.log"), b"VHCA-RESULT {}\n").unwrap();
        dir
    }

    #[test]
    fn a_work_dir_names_its_creator_from_the_start() {
        let dir = work_dir("vhca-run-").unwrap();
        let name = dir.path().file_name().unwrap().to_str().unwrap().to_string();
        let creator = Creator::parse(name.strip_prefix("vhca-run-").unwrap()).expect("a creator in the name");
        assert_eq!(creator, Creator::this());
        assert!(creator.start > 0 && creator.pid_ns > 0, "{creator:?}");
        assert!(!creator.is_gone());
        // Nothing but a creator tag parses as one: old names and others' dirs are never judged by name.
        for rest in ["AbC123", "12.34-x", "1.2.3.4-x", "a.b.c-x", "1.2.3"] {
            assert_eq!(Creator::parse(rest), None, "{rest}");
        }
    }

    #[test]
    fn an_ownerless_dir_is_swept_only_when_its_creator_is_gone() {
        let temp = tempfile::tempdir().unwrap();
        let me = Creator::this();
        let live = ownerless(temp.path(), me);
        // The same pid with another start time: the pid was reused, the creator is gone.
        let reused = ownerless(temp.path(), Creator { start: me.start + 1, ..me });
        // A pid no process has (above any pid_max).
        let vanished = ownerless(temp.path(), Creator { pid: u32::MAX - 1, ..me });
        // Another pid namespace's pid says nothing here.
        let elsewhere = ownerless(temp.path(), Creator { pid: u32::MAX - 1, pid_ns: me.pid_ns + 1, ..me });
        // Kept on purpose (`boot --keep`), its creator gone and its owner file unlocked: stays.
        let kept = ownerless(temp.path(), Creator { pid: u32::MAX - 2, ..me });
        fs::write(kept.join(OWNER_FILE), b"1\n").unwrap();
        File::create(kept.join(KEPT_FILE)).unwrap();

        let mut swept = sweep_dead_work_dirs(temp.path());
        swept.sort();
        let mut expected = vec![reused.clone(), vanished.clone()];
        expected.sort();
        assert_eq!(swept, expected);
        assert!(live.exists() && elsewhere.exists() && kept.exists());
    }

    #[test]
    fn a_kept_dir_is_marked_before_it_is_let_go() {
        let temp = work_dir("vhca-run-").unwrap();
        let claim = claim(temp.path()).unwrap();
        drop(claim);
        let kept = keep(temp).unwrap();
        assert!(kept.join(KEPT_FILE).is_file() && !kept.join(OWNER_FILE).exists());
        fs::remove_dir_all(&kept).unwrap();
    }

    #[test]
    fn a_dead_child_is_gone_and_a_live_one_is_not() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let (_, start) = process_state(child.id()).unwrap();
        let creator = Creator { pid: child.id(), start, pid_ns: pid_namespace().unwrap() };
        assert!(!creator.is_gone(), "a running child");
        child.kill().unwrap();
        // Killed but not yet reaped: a zombie, which runs nothing and so counts as gone.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !creator.is_gone() {
            assert!(std::time::Instant::now() < deadline, "a killed child never counted as gone");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        child.wait().unwrap();
        assert!(creator.is_gone(), "a reaped child");
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
