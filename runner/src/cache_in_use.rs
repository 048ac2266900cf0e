//! Entries of a cache several runners share (guest images, snapshots): a runner holds a shared flock on an entry's
//! `<key>.use` file for as long as its session uses the entry, and pruning removes only entries whose use file it
//! locks exclusively without waiting. So no runner prunes what another live runner uses, and since the kernel drops
//! a process's flocks with its fds, a runner that was SIGKILLed pins nothing. The fds are close-on-exec (Rust's
//! default): QEMU and the device never hold these locks.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::supervise::{tick, SuperviseError};

/// The use file of the entry `key` in the cache directory `entries`.
pub fn use_file(entries: &Path, key: &str) -> PathBuf {
    entries.join(format!("{key}.use"))
}

fn open(path: &Path) -> io::Result<File> {
    // Never truncated: another runner's lock may be on it.
    OpenOptions::new().create(true).truncate(false).write(true).open(path)
}

/// Non-blocking flock (`how`: LOCK_SH or LOCK_EX): true if taken, false if someone holds a conflicting lock.
pub(crate) fn try_flock(file: &File, how: libc::c_int) -> io::Result<bool> {
    // SAFETY: flock on a descriptor the caller owns for the duration of the call; it touches no memory.
    if unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    if err.kind() == io::ErrorKind::WouldBlock {
        Ok(false)
    } else {
        Err(err)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InUseError {
    #[error("marking {path} in use: {source}")]
    Io { path: String, source: io::Error },
    #[error(transparent)]
    Process(#[from] SuperviseError),
}

/// An entry marked in use: the shared lock lasts as long as this value.
#[derive(Debug)]
pub struct InUse {
    _file: File,
}

impl InUse {
    /// Takes the shared lock on `path`, waiting (interruptibly) only while a pruner holds it to look at the entry.
    pub fn acquire(path: &Path) -> Result<InUse, InUseError> {
        let io_err = |source| InUseError::Io { path: path.display().to_string(), source };
        let file = open(path).map_err(io_err)?;
        while !try_flock(&file, libc::LOCK_SH).map_err(io_err)? {
            tick()?;
        }
        Ok(InUse { _file: file })
    }
}

/// For a pruner: the exclusive lock on `path` if nobody uses the entry, held until the returned file drops.
pub fn unused(path: &Path) -> Option<File> {
    let file = open(path).ok()?;
    matches!(try_flock(&file, libc::LOCK_EX), Ok(true)).then_some(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_in_use_is_not_unused_until_its_last_user_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let path = use_file(dir.path(), "k");
        let (a, b) = (InUse::acquire(&path).unwrap(), InUse::acquire(&path).unwrap());
        assert!(unused(&path).is_none(), "two users share the lock; a pruner must not get it");
        drop(a);
        assert!(unused(&path).is_none(), "one user is left");
        drop(b);
        let pruning = unused(&path).expect("nobody uses it now");
        // While a pruner looks at the entry, a new user is not let in (flock wait is what `acquire` does).
        let file = open(&path).unwrap();
        assert!(!try_flock(&file, libc::LOCK_SH).unwrap());
        drop(pruning);
        assert!(try_flock(&file, libc::LOCK_SH).unwrap());
    }
}
