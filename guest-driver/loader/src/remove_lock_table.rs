//! The state of each IO_REMOVE_LOCK a driver binary uses, by the lock's address: acquisitions outstanding and
//! whether removal began (IoReleaseRemoveLockAndWait). The remove-lock family's table; `remove_lock_thunks` keeps it.

use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Default, Clone, Copy)]
struct RemoveLock {
    acquisitions: u32,
    removing: bool,
}

#[derive(Default)]
pub struct RemoveLocks {
    locks: Mutex<HashMap<usize, RemoveLock>>,
}

impl RemoveLocks {
    /// IoInitializeRemoveLock: no acquisitions, not being removed.
    pub fn initialize(&self, lock: usize) {
        crate::lock(&self.locks).insert(lock, RemoveLock::default());
    }

    /// Counts one acquisition; false once removal began (the caller answers STATUS_DELETE_PENDING). A lock never
    /// initialized counts from zero.
    pub fn acquire(&self, lock: usize) -> bool {
        let mut locks = crate::lock(&self.locks);
        let entry = locks.entry(lock).or_default();
        if entry.removing {
            return false;
        }
        entry.acquisitions += 1;
        true
    }

    pub fn release(&self, lock: usize) {
        if let Some(entry) = crate::lock(&self.locks).get_mut(&lock) {
            entry.acquisitions = entry.acquisitions.saturating_sub(1);
        }
    }

    /// The release IoReleaseRemoveLockAndWait starts with: removal begins, and the caller's acquisition ends.
    pub fn release_for_removal(&self, lock: usize) {
        let mut locks = crate::lock(&self.locks);
        let entry = locks.entry(lock).or_default();
        entry.removing = true;
        entry.acquisitions = entry.acquisitions.saturating_sub(1);
    }

    /// Whether acquisitions are still outstanding.
    pub fn held(&self, lock: usize) -> bool {
        crate::lock(&self.locks).get(&lock).is_some_and(|e| e.acquisitions > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_refuses_new_acquisitions_and_still_counts_the_outstanding_ones() {
        let locks = RemoveLocks::default();
        locks.initialize(0x1000);
        assert!(locks.acquire(0x1000) && locks.acquire(0x1000));
        // The remover's own acquisition ends; the other IRP's is still out.
        locks.release_for_removal(0x1000);
        assert!(locks.held(0x1000));
        assert!(!locks.acquire(0x1000), "no acquisition once removal began");
        locks.release(0x1000);
        assert!(!locks.held(0x1000));
        // Another lock is untouched by the first one's removal.
        assert!(locks.acquire(0x2000));
    }
}
