//! The kernel's locks as a driver binary uses them: the lock lives in the driver's memory (a FAST_MUTEX, KMUTEX,
//! KSPIN_LOCK, ERESOURCE or KGUARDED_MUTEX the driver embeds and initializes, often inline as wdm.h's macros do),
//! and each one is bound on first use to a lock of the NT model, which keeps the IRQL, ownership and the
//! verifier's checks (the same rules the native build runs under).
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::collections::HashMap;
use std::sync::Mutex;

use vhca_ntapi::{NtKernel, PERESOURCE, PFAST_MUTEX, PKGUARDED_MUTEX, PKMUTEX, PKSPIN_LOCK};

use crate::kernel_context::kernel;

/// The model's lock behind each driver lock address.
#[derive(Default)]
pub struct LockObjects {
    fast_mutexes: Mutex<HashMap<usize, PFAST_MUTEX>>,
    kmutexes: Mutex<HashMap<usize, PKMUTEX>>,
    spin_locks: Mutex<HashMap<usize, PKSPIN_LOCK>>,
    resources: Mutex<HashMap<usize, PERESOURCE>>,
    guarded: Mutex<HashMap<usize, PKGUARDED_MUTEX>>,
}

/// The model lock bound to `address`, made by `make` on first use. The table lock is released before the caller
/// acquires the model lock (which may block).
fn bound<T: Copy>(table: &Mutex<HashMap<usize, T>>, address: usize, make: impl FnOnce() -> T) -> T {
    *crate::lock(table).entry(address).or_insert_with(make)
}

impl LockObjects {
    /// Whether a dispatcher object at `address` is a KMUTEX (KeWaitForSingleObject waits on events and mutexes).
    pub fn kmutex(&self, address: usize) -> Option<PKMUTEX> {
        crate::lock(&self.kmutexes).get(&address).copied()
    }
}

// ---- FAST_MUTEX (ExInitializeFastMutex is inline in wdm.h: the first acquire binds it) ----

unsafe extern "win64" fn ExAcquireFastMutex(mutex: usize) {
    let k = kernel();
    let m = bound(&k.locks.fast_mutexes, mutex, || k.model.ExInitializeFastMutex());
    k.model.ExAcquireFastMutex(m)
}

unsafe extern "win64" fn ExReleaseFastMutex(mutex: usize) {
    let k = kernel();
    let m = bound(&k.locks.fast_mutexes, mutex, || k.model.ExInitializeFastMutex());
    k.model.ExReleaseFastMutex(m)
}

// ---- KMUTEX ----

unsafe extern "win64" fn KeInitializeMutex(mutex: usize, level: u32) {
    let k = kernel();
    let m = k.model.KeInitializeMutex(level);
    crate::lock(&k.locks.kmutexes).insert(mutex, m);
}

unsafe extern "win64" fn KeReleaseMutex(mutex: usize, wait: u8) -> i32 {
    let k = kernel();
    let m = bound(&k.locks.kmutexes, mutex, || k.model.KeInitializeMutex(0));
    k.model.KeReleaseMutex(m, wait != 0)
}

// ---- Spin locks (KeInitializeSpinLock is inline: a zeroed KSPIN_LOCK) ----

unsafe extern "win64" fn KeAcquireSpinLockRaiseToDpc(lock: usize) -> u8 {
    let k = kernel();
    let l = bound(&k.locks.spin_locks, lock, || k.model.KeInitializeSpinLock());
    k.model.KeAcquireSpinLock(l)
}

unsafe extern "win64" fn KeReleaseSpinLock(lock: usize, new_irql: u8) {
    let k = kernel();
    let l = bound(&k.locks.spin_locks, lock, || k.model.KeInitializeSpinLock());
    k.model.KeReleaseSpinLock(l, new_irql)
}

// ---- ERESOURCE and critical regions ----

unsafe extern "win64" fn ExInitializeResourceLite(resource: usize) -> i32 {
    let k = kernel();
    let r = k.model.ExInitializeResourceLite();
    crate::lock(&k.locks.resources).insert(resource, r);
    0
}

unsafe extern "win64" fn ExAcquireResourceExclusiveLite(resource: usize, wait: u8) -> u8 {
    let k = kernel();
    let r = bound(&k.locks.resources, resource, || k.model.ExInitializeResourceLite());
    k.model.ExAcquireResourceExclusiveLite(r, wait != 0) as u8
}

unsafe extern "win64" fn ExAcquireResourceSharedLite(resource: usize, wait: u8) -> u8 {
    let k = kernel();
    let r = bound(&k.locks.resources, resource, || k.model.ExInitializeResourceLite());
    k.model.ExAcquireResourceSharedLite(r, wait != 0) as u8
}

unsafe extern "win64" fn ExReleaseResourceLite(resource: usize) {
    let k = kernel();
    let r = bound(&k.locks.resources, resource, || k.model.ExInitializeResourceLite());
    k.model.ExReleaseResourceLite(r)
}

unsafe extern "win64" fn ExDeleteResourceLite(resource: usize) -> i32 {
    let k = kernel();
    let Some(r) = crate::lock(&k.locks.resources).remove(&resource) else {
        // Never initialized through the kernel: nothing to delete (the driver's ERESOURCE was never used).
        return 0;
    };
    k.model.ExDeleteResourceLite(r).0
}

unsafe extern "win64" fn KeEnterCriticalRegion() {
    kernel().model.KeEnterCriticalRegion()
}

unsafe extern "win64" fn KeLeaveCriticalRegion() {
    kernel().model.KeLeaveCriticalRegion()
}

// ---- Guarded mutex ----

unsafe extern "win64" fn KeInitializeGuardedMutex(mutex: usize) {
    let k = kernel();
    let m = k.model.KeInitializeGuardedMutex();
    crate::lock(&k.locks.guarded).insert(mutex, m);
}

unsafe extern "win64" fn KeAcquireGuardedMutex(mutex: usize) {
    let k = kernel();
    let m = bound(&k.locks.guarded, mutex, || k.model.KeInitializeGuardedMutex());
    k.model.KeAcquireGuardedMutex(m)
}

unsafe extern "win64" fn KeReleaseGuardedMutex(mutex: usize) {
    let k = kernel();
    let m = bound(&k.locks.guarded, mutex, || k.model.KeInitializeGuardedMutex());
    k.model.KeReleaseGuardedMutex(m)
}

/// (routine, thunk) for the lock routines, all ntoskrnl.exe's.
pub fn lock_thunks() -> [(&'static str, usize); 16] {
    [
        ("ExAcquireFastMutex", ExAcquireFastMutex as *const () as usize),
        ("ExReleaseFastMutex", ExReleaseFastMutex as *const () as usize),
        ("KeInitializeMutex", KeInitializeMutex as *const () as usize),
        ("KeReleaseMutex", KeReleaseMutex as *const () as usize),
        ("KeAcquireSpinLockRaiseToDpc", KeAcquireSpinLockRaiseToDpc as *const () as usize),
        ("KeReleaseSpinLock", KeReleaseSpinLock as *const () as usize),
        ("ExInitializeResourceLite", ExInitializeResourceLite as *const () as usize),
        ("ExAcquireResourceExclusiveLite", ExAcquireResourceExclusiveLite as *const () as usize),
        ("ExAcquireResourceSharedLite", ExAcquireResourceSharedLite as *const () as usize),
        ("ExReleaseResourceLite", ExReleaseResourceLite as *const () as usize),
        ("ExDeleteResourceLite", ExDeleteResourceLite as *const () as usize),
        ("KeEnterCriticalRegion", KeEnterCriticalRegion as *const () as usize),
        ("KeLeaveCriticalRegion", KeLeaveCriticalRegion as *const () as usize),
        ("KeInitializeGuardedMutex", KeInitializeGuardedMutex as *const () as usize),
        ("KeAcquireGuardedMutex", KeAcquireGuardedMutex as *const () as usize),
        ("KeReleaseGuardedMutex", KeReleaseGuardedMutex as *const () as usize),
    ]
}
