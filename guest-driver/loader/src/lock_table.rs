//! Which NT model lock stands behind each lock a driver binary embeds (FAST_MUTEX, KMUTEX, KSPIN_LOCK, ERESOURCE,
//! KGUARDED_MUTEX), by the lock's address in driver memory: the lock family's table, which `lock_thunks` fills.

use std::collections::HashMap;
use std::sync::Mutex;

use vhca_ntapi::{PERESOURCE, PFAST_MUTEX, PKGUARDED_MUTEX, PKMUTEX, PKSPIN_LOCK};

/// The model's locks of one kind, by driver lock address.
pub struct BoundLocks<H> {
    by_address: Mutex<HashMap<usize, H>>,
}

impl<H> Default for BoundLocks<H> {
    fn default() -> Self {
        BoundLocks { by_address: Mutex::new(HashMap::new()) }
    }
}

impl<H: Copy> BoundLocks<H> {
    /// The model lock bound to `address`, made by `make` on first use (wdm.h initializes FAST_MUTEX and KSPIN_LOCK
    /// inline, so the kernel first sees such a lock when it is used). The table lock is released before the caller
    /// acquires the model lock (which may block).
    pub fn bound(&self, address: usize, make: impl FnOnce() -> H) -> H {
        *crate::lock(&self.by_address).entry(address).or_insert_with(make)
    }

    /// Binds `address` to `lock` (the driver initialized it through the kernel), replacing an earlier binding.
    pub fn bind(&self, address: usize, lock: H) {
        crate::lock(&self.by_address).insert(address, lock);
    }

    pub fn get(&self, address: usize) -> Option<H> {
        crate::lock(&self.by_address).get(&address).copied()
    }

    /// Ends the binding (the lock was deleted), giving the model lock it had.
    pub fn unbind(&self, address: usize) -> Option<H> {
        crate::lock(&self.by_address).remove(&address)
    }
}

/// The model's lock behind each driver lock address, per kind.
#[derive(Default)]
pub struct LockObjects {
    pub fast_mutexes: BoundLocks<PFAST_MUTEX>,
    pub kmutexes: BoundLocks<PKMUTEX>,
    pub spin_locks: BoundLocks<PKSPIN_LOCK>,
    pub resources: BoundLocks<PERESOURCE>,
    pub guarded: BoundLocks<PKGUARDED_MUTEX>,
}

impl LockObjects {
    /// Whether a dispatcher object at `address` is a KMUTEX (KeWaitForSingleObject waits on events and mutexes).
    pub fn kmutex(&self, address: usize) -> Option<PKMUTEX> {
        self.kmutexes.get(address)
    }
}
