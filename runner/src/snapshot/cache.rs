//! The snapshot cache: one snapshot per key under the cache root, built once under a lock, checked against its
//! record before a session uses it, the least recently used pruned.

use std::fs::{self, File};
use std::io;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use super::save::{build, logs_tail, BuildError};
use super::state_digest::state_digest;
use super::{key_of, qemu_version, SavedMachine, Snapshot, STATE_FILE};
use crate::cache_in_use::{self, use_file, InUse, InUseError};
use crate::image::{CacheLock, ImageError};
use crate::phase_hook::{self, Phase, Pids};
use crate::supervise::SuperviseError;

const META_FILE: &str = "snapshot.json";
/// Snapshots kept (about 85 MB on disk each; the file is sparse); the least recently used go first.
const KEEP: usize = 3;
/// Leftover build dirs of a runner that was SIGKILLed are removed after this long.
const STALE_BUILD: Duration = Duration::from_secs(3600);

/// What is recorded next to the state file: how to check it, and what it was made from (for people).
#[derive(Debug, Serialize, Deserialize)]
struct Meta {
    key: String,
    size: u64,
    digest: String,
    build_seconds: f64,
    inputs: Vec<(String, String)>,
}

/// The snapshot for `machine`, verified, or built now; None (with the reason logged) when this session must boot
/// cold. Err only for an interrupt.
pub fn prepare(
    root: &Path,
    machine: &SavedMachine,
    log: &mut dyn FnMut(&str),
) -> Result<Option<Snapshot>, SuperviseError> {
    let version = match qemu_version(&machine.qemu) {
        Ok(v) => v,
        Err(e) => {
            log(&format!("cold boot: cannot ask QEMU its version for the snapshot key ({e})"));
            return Ok(None);
        }
    };
    let inputs = machine.key_inputs(&version);
    let key = key_of(&inputs);
    if let Err(e) = fs::create_dir_all(root) {
        log(&format!("cold boot: snapshot dir {}: {e}", root.display()));
        return Ok(None);
    }
    // One builder per key; others wait here, then find it built.
    let _lock = match CacheLock::acquire_file(&root.join(format!("{key}.lock"))) {
        Ok(lock) => lock,
        Err(ImageError::Process(e)) => return Err(e),
        Err(e) => {
            log(&format!("cold boot: cannot lock the snapshot {key}: {e}"));
            return Ok(None);
        }
    };
    let dir = root.join(&key);
    let state = dir.join(STATE_FILE);
    // Marked in use while the build lock is still held: a pruner, which takes that lock too, cannot slip in between
    // the check and the mark.
    let snapshot = |built, checked, log: &mut dyn FnMut(&str)| {
        let in_use = match InUse::acquire(&use_file(root, &key)) {
            Ok(in_use) => Some(in_use),
            Err(InUseError::Process(e)) => return Err(e),
            Err(e) => {
                log(&format!("{e}: another runner sharing the cache may prune snapshot {key} while this one uses it"));
                None
            }
        };
        Ok(Snapshot {
            key: key.clone(),
            state: state.clone(),
            machine: machine.clone(),
            built,
            checked,
            broken: AtomicBool::new(false),
            _in_use: in_use,
        })
    };
    if dir.exists() {
        let started = Instant::now();
        return Ok(match verify(&dir) {
            Ok(()) => {
                touch(&dir);
                let snapshot = snapshot(None, Some(started.elapsed().as_secs_f64()), log)?;
                phase_hook::at(Phase::SnapshotChecked, Pids::default());
                Some(snapshot)
            }
            Err(why) => {
                let _ = fs::remove_dir_all(&dir);
                log(&format!(
                    "snapshot {key} is corrupt ({why}): removed; this session boots cold, the next one rebuilds it"
                ));
                None
            }
        });
    }
    let others = other_snapshots(root, &key);
    let stale = if others.is_empty() {
        String::new()
    } else {
        format!("; stale for this QEMU, kernel, image and command line, not used: {}", others.join(", "))
    };
    log(&format!("no snapshot {key} yet: booting the guest to its agent to save it{stale}"));
    let started = Instant::now();
    let work = match tempfile::Builder::new().prefix(".build-").tempdir_in(root) {
        Ok(w) => w,
        Err(e) => {
            log(&format!("cold boot: snapshot build dir in {}: {e}", root.display()));
            return Ok(None);
        }
    };
    match build(machine, work.path()) {
        Ok(()) => {}
        Err(BuildError::Process(SuperviseError::Interrupted)) => return Err(SuperviseError::Interrupted),
        Err(e) => {
            log(&format!("cold boot: the snapshot build failed: {e}{}", logs_tail(work.path())));
            return Ok(None);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let saved = work.path().join(STATE_FILE);
    let finished = (|| -> io::Result<u64> {
        let size = fs::metadata(&saved)?.len();
        let meta = Meta { key: key.clone(), size, digest: state_digest(&saved)?, build_seconds: seconds, inputs };
        fs::write(work.path().join(META_FILE), serde_json::to_string_pretty(&meta).map_err(io::Error::other)?)?;
        // Kept for people: how the guest came up before it was saved.
        for name in ["serial.sock", "qmp.sock"] {
            let _ = fs::remove_file(work.path().join(name));
        }
        let _ = fs::remove_dir_all(&dir);
        fs::rename(work.path(), &dir)?;
        Ok(on_disk(&dir.join(STATE_FILE)))
    })();
    match finished {
        Ok(bytes) => {
            // The rename moved the temp dir away: nothing is left for its guard to remove.
            let _ = work.keep();
            log(&format!("snapshot {key} saved in {seconds:.1} s ({} MB on disk)", bytes >> 20));
            let snapshot = snapshot(Some(seconds), None, log)?;
            prune(root, &key);
            phase_hook::at(Phase::SnapshotChecked, Pids::default());
            Ok(Some(snapshot))
        }
        Err(e) => {
            log(&format!("cold boot: storing the snapshot in {}: {e}", dir.display()));
            Ok(None)
        }
    }
}

/// Checks a stored snapshot against its record: size and content digest.
fn verify(dir: &Path) -> Result<(), String> {
    let meta: Meta = fs::read_to_string(dir.join(META_FILE))
        .map_err(|e| format!("{META_FILE}: {e}"))
        .and_then(|t| serde_json::from_str(&t).map_err(|e| format!("{META_FILE}: {e}")))?;
    let state = dir.join(STATE_FILE);
    let size = fs::metadata(&state).map_err(|e| format!("{STATE_FILE}: {e}"))?.len();
    if size != meta.size {
        return Err(format!("{STATE_FILE} is {size} bytes, {} were saved", meta.size));
    }
    let digest = state_digest(&state).map_err(|e| format!("{STATE_FILE}: {e}"))?;
    if digest != meta.digest {
        return Err(format!("{STATE_FILE} content digest {digest} differs from the saved {}", meta.digest));
    }
    Ok(())
}

fn on_disk(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

fn touch(dir: &Path) {
    // The record's mtime orders snapshots for pruning: a used snapshot is a recent one.
    let _ = File::open(dir.join(META_FILE)).and_then(|f| f.set_modified(SystemTime::now()));
}

fn other_snapshots(root: &Path, key: &str) -> Vec<String> {
    let Ok(entries) = fs::read_dir(root) else { return Vec::new() };
    let mut keys: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().join(META_FILE).is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name != key && !name.starts_with('.'))
        .collect();
    keys.sort();
    keys
}

/// Keeps the `KEEP` most recently used snapshots and removes build dirs a killed runner left behind. A snapshot
/// another runner uses (its use file shared-locked, `cache_in_use`) or is checking or building (its build lock held)
/// is skipped, and the next older one goes in its place.
fn prune(root: &Path, keep_key: &str) {
    let Ok(entries) = fs::read_dir(root) else { return };
    let mut snapshots = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with(".build-") {
            let old = fs::metadata(&path).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
            if old.is_some_and(|age| age > STALE_BUILD) {
                let _ = fs::remove_dir_all(&path);
            }
        } else if name != keep_key && path.is_dir() {
            let mtime = fs::metadata(path.join(META_FILE)).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
            snapshots.push((mtime, path));
        }
    }
    snapshots.sort();
    let mut excess = (snapshots.len() + 1).saturating_sub(KEEP);
    for (_, path) in snapshots {
        if excess == 0 {
            break;
        }
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        // Both held while removing: no runner can start checking or using it meanwhile.
        let free = cache_in_use::unused(&root.join(format!("{name}.lock")))
            .and_then(|build| Some((build, cache_in_use::unused(&use_file(root, &name))?)));
        if free.is_some() && fs::remove_dir_all(&path).is_ok() {
            excess -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    const PAGE: u64 = 4096;

    #[test]
    fn verify_rejects_a_truncated_or_altered_file_and_a_missing_record() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join(STATE_FILE);
        fs::write(&state, vec![5u8; 3 * PAGE as usize]).unwrap();
        assert!(verify(dir.path()).unwrap_err().contains(META_FILE));
        let meta = Meta {
            key: "k".into(),
            size: 3 * PAGE,
            digest: state_digest(&state).unwrap(),
            build_seconds: 1.0,
            inputs: vec![],
        };
        fs::write(dir.path().join(META_FILE), serde_json::to_string(&meta).unwrap()).unwrap();
        assert_eq!(verify(dir.path()), Ok(()));
        File::options().write(true).open(&state).unwrap().write_at(&[6u8], PAGE).unwrap();
        assert!(verify(dir.path()).unwrap_err().contains("digest"));
        File::options().write(true).open(&state).unwrap().set_len(PAGE).unwrap();
        assert!(verify(dir.path()).unwrap_err().contains("bytes"));
    }

    #[test]
    fn prune_keeps_the_newest_and_the_current_one() {
        let root = tempfile::tempdir().unwrap();
        for (i, key) in ["a", "b", "c", "d"].iter().enumerate() {
            let dir = root.path().join(key);
            fs::create_dir(&dir).unwrap();
            let f = File::create(dir.join(META_FILE)).unwrap();
            f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(1000 + i as u64)).unwrap();
        }
        fs::write(root.path().join("a.lock"), b"").unwrap();
        prune(root.path(), "a");
        let mut left: Vec<String> =
            fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        // The pruner leaves the lock files it took (removing a lock file others may open races with them).
        assert_eq!(left, ["a", "a.lock", "b.lock", "b.use", "c", "d"]);
        assert_eq!(other_snapshots(root.path(), "a"), ["c", "d"]);
    }

    #[test]
    fn prune_skips_what_another_runner_uses_or_checks_and_takes_the_next_oldest() {
        let root = tempfile::tempdir().unwrap();
        for (i, key) in ["new", "b", "c", "d", "e"].iter().enumerate() {
            let dir = root.path().join(key);
            fs::create_dir(&dir).unwrap();
            let f = File::create(dir.join(META_FILE)).unwrap();
            f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(1000 + i as u64)).unwrap();
        }
        // Another runner restores from b (its use file shared-locked) and checks c (its build lock held).
        let _using_b = InUse::acquire(&use_file(root.path(), "b")).unwrap();
        let _checking_c = CacheLock::acquire_file(&root.path().join("c.lock")).unwrap();
        prune(root.path(), "new");
        let left: Vec<bool> = ["new", "b", "c", "d", "e"].iter().map(|k| root.path().join(k).exists()).collect();
        // Two must go (4 others + the new one, 3 kept): b and c are skipped, d and e go in their place.
        assert_eq!(left, [true, true, true, false, false]);
    }
}
