//! The kernel's locks as a driver binary uses them: the lock lives in the driver's memory (a FAST_MUTEX, KMUTEX,
//! KSPIN_LOCK, ERESOURCE or KGUARDED_MUTEX the driver embeds and initializes, often inline as wdm.h's macros do),
//! and each one is bound on first use to a lock of the NT model, which keeps the IRQL, ownership and the
//! verifier's checks (the same rules the native build runs under); `lock_table` keeps the bindings.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use vhca_ntapi::{NtAsyncKernel, NtKernel};

use crate::kernel_context::kernel;

// ---- FAST_MUTEX (ExInitializeFastMutex is inline in wdm.h: the first acquire binds it) ----

unsafe extern "win64" fn ExAcquireFastMutex(mutex: usize) {
    let k = kernel();
    let m = k.locks.fast_mutexes.bound(mutex, || k.model.ExInitializeFastMutex());
    k.model.ExAcquireFastMutex(m)
}

unsafe extern "win64" fn ExReleaseFastMutex(mutex: usize) {
    let k = kernel();
    let m = k.locks.fast_mutexes.bound(mutex, || k.model.ExInitializeFastMutex());
    k.model.ExReleaseFastMutex(m)
}

// ---- KMUTEX ----

unsafe extern "win64" fn KeInitializeMutex(mutex: usize, level: u32) {
    let k = kernel();
    let m = k.model.KeInitializeMutex(level);
    k.locks.kmutexes.bind(mutex, m);
}

unsafe extern "win64" fn KeReleaseMutex(mutex: usize, wait: u8) -> i32 {
    let k = kernel();
    let m = k.locks.kmutexes.bound(mutex, || k.model.KeInitializeMutex(0));
    k.model.KeReleaseMutex(m, wait != 0)
}

// ---- Spin locks (KeInitializeSpinLock is inline: a zeroed KSPIN_LOCK) ----

unsafe extern "win64" fn KeAcquireSpinLockRaiseToDpc(lock: usize) -> u8 {
    let k = kernel();
    let l = k.locks.spin_locks.bound(lock, || k.model.KeInitializeSpinLock());
    let old = k.model.KeAcquireSpinLock(l);
    k.raised();
    old
}

unsafe extern "win64" fn KeReleaseSpinLock(lock: usize, new_irql: u8) {
    let k = kernel();
    let l = k.locks.spin_locks.bound(lock, || k.model.KeInitializeSpinLock());
    k.model.KeReleaseSpinLock(l, new_irql)
}

/// KeAcquireSpinLockAtDpcLevel: a DPC's (or an ISR's) spin lock, taken without touching the IRQL; below
/// DISPATCH_LEVEL the model's verifier says 0xC4/0x40, as Windows'.
unsafe extern "win64" fn KeAcquireSpinLockAtDpcLevel(lock: usize) {
    let k = kernel();
    let l = k.locks.spin_locks.bound(lock, || k.model.KeInitializeSpinLock());
    k.model.KeAcquireSpinLockAtDpcLevel(l);
    k.raised();
}

unsafe extern "win64" fn KeReleaseSpinLockFromDpcLevel(lock: usize) {
    let k = kernel();
    let l = k.locks.spin_locks.bound(lock, || k.model.KeInitializeSpinLock());
    k.model.KeReleaseSpinLockFromDpcLevel(l)
}

// ---- ERESOURCE and critical regions ----

unsafe extern "win64" fn ExInitializeResourceLite(resource: usize) -> i32 {
    let k = kernel();
    let r = k.model.ExInitializeResourceLite();
    k.locks.resources.bind(resource, r);
    0
}

unsafe extern "win64" fn ExAcquireResourceExclusiveLite(resource: usize, wait: u8) -> u8 {
    let k = kernel();
    let r = k.locks.resources.bound(resource, || k.model.ExInitializeResourceLite());
    k.model.ExAcquireResourceExclusiveLite(r, wait != 0) as u8
}

unsafe extern "win64" fn ExAcquireResourceSharedLite(resource: usize, wait: u8) -> u8 {
    let k = kernel();
    let r = k.locks.resources.bound(resource, || k.model.ExInitializeResourceLite());
    k.model.ExAcquireResourceSharedLite(r, wait != 0) as u8
}

unsafe extern "win64" fn ExReleaseResourceLite(resource: usize) {
    let k = kernel();
    let r = k.locks.resources.bound(resource, || k.model.ExInitializeResourceLite());
    k.model.ExReleaseResourceLite(r)
}

unsafe extern "win64" fn ExDeleteResourceLite(resource: usize) -> i32 {
    let k = kernel();
    let Some(r) = k.locks.resources.unbind(resource) else {
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
    k.locks.guarded.bind(mutex, m);
}

unsafe extern "win64" fn KeAcquireGuardedMutex(mutex: usize) {
    let k = kernel();
    let m = k.locks.guarded.bound(mutex, || k.model.KeInitializeGuardedMutex());
    k.model.KeAcquireGuardedMutex(m)
}

unsafe extern "win64" fn KeReleaseGuardedMutex(mutex: usize) {
    let k = kernel();
    let m = k.locks.guarded.bound(mutex, || k.model.KeInitializeGuardedMutex());
    k.model.KeReleaseGuardedMutex(m)
}

/// (routine, thunk) for the lock routines, all ntoskrnl.exe's.
pub fn lock_thunks() -> [(&'static str, usize); 18] {
    [
        ("ExAcquireFastMutex", ExAcquireFastMutex as *const () as usize),
        ("ExReleaseFastMutex", ExReleaseFastMutex as *const () as usize),
        ("KeInitializeMutex", KeInitializeMutex as *const () as usize),
        ("KeReleaseMutex", KeReleaseMutex as *const () as usize),
        ("KeAcquireSpinLockRaiseToDpc", KeAcquireSpinLockRaiseToDpc as *const () as usize),
        ("KeReleaseSpinLock", KeReleaseSpinLock as *const () as usize),
        ("KeAcquireSpinLockAtDpcLevel", KeAcquireSpinLockAtDpcLevel as *const () as usize),
        ("KeReleaseSpinLockFromDpcLevel", KeReleaseSpinLockFromDpcLevel as *const () as usize),
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
