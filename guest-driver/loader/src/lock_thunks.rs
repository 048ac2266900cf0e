//! The kernel's locks as a driver binary uses them: the lock lives in the driver's memory (a FAST_MUTEX, KMUTEX,
//! KSPIN_LOCK, ERESOURCE or KGUARDED_MUTEX the driver embeds and initializes, often inline as wdm.h's macros do),
//! and each one is bound on first use to a lock of the NT model, which keeps the IRQL, ownership and the
//! verifier's checks (the same rules the native build runs under); `lock_table` keeps the bindings.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use vhca_ntapi::{NtAsyncKernel, NtKernel};

use crate::driver_stack::{at_driver_site, site_entry};
use crate::kernel_context::kernel;

// Every routine here is a scheduling point of the interleaving modes (a kernel call, a lock's acquire or release, a
// wait): each enters through a stub that finds the driver's call site first, so its points, pauses and races name
// the binary's RVA and symbol, not this file's line (the stub walks the stack only while a mode or the
// low-resources simulation is on).
site_entry!(ExAcquireFastMutex_entry => ExAcquireFastMutex);
site_entry!(ExReleaseFastMutex_entry => ExReleaseFastMutex);
site_entry!(KeInitializeMutex_entry => KeInitializeMutex);
site_entry!(KeReleaseMutex_entry => KeReleaseMutex);
site_entry!(KeAcquireSpinLockRaiseToDpc_entry => KeAcquireSpinLockRaiseToDpc);
site_entry!(KeReleaseSpinLock_entry => KeReleaseSpinLock);
site_entry!(KeAcquireSpinLockAtDpcLevel_entry => KeAcquireSpinLockAtDpcLevel);
site_entry!(KeReleaseSpinLockFromDpcLevel_entry => KeReleaseSpinLockFromDpcLevel);
site_entry!(ExInitializeResourceLite_entry => ExInitializeResourceLite);
site_entry!(ExAcquireResourceExclusiveLite_entry => ExAcquireResourceExclusiveLite);
site_entry!(ExAcquireResourceSharedLite_entry => ExAcquireResourceSharedLite);
site_entry!(ExReleaseResourceLite_entry => ExReleaseResourceLite);
site_entry!(ExDeleteResourceLite_entry => ExDeleteResourceLite);
site_entry!(KeEnterCriticalRegion_entry => KeEnterCriticalRegion);
site_entry!(KeLeaveCriticalRegion_entry => KeLeaveCriticalRegion);
site_entry!(KeInitializeGuardedMutex_entry => KeInitializeGuardedMutex);
site_entry!(KeAcquireGuardedMutex_entry => KeAcquireGuardedMutex);
site_entry!(KeReleaseGuardedMutex_entry => KeReleaseGuardedMutex);

// ---- FAST_MUTEX (ExInitializeFastMutex is inline in wdm.h: the first acquire binds it) ----

unsafe extern "win64" fn ExAcquireFastMutex(mutex: usize) {
    at_driver_site(|| {
        let k = kernel();
        let m = k.locks.fast_mutexes.bound(mutex, || k.model.ExInitializeFastMutex());
        k.model.ExAcquireFastMutex(m)
    })
}

unsafe extern "win64" fn ExReleaseFastMutex(mutex: usize) {
    at_driver_site(|| {
        let k = kernel();
        let m = k.locks.fast_mutexes.bound(mutex, || k.model.ExInitializeFastMutex());
        k.model.ExReleaseFastMutex(m)
    })
}

// ---- KMUTEX ----

unsafe extern "win64" fn KeInitializeMutex(mutex: usize, level: u32) {
    at_driver_site(|| {
        let k = kernel();
        let m = k.model.KeInitializeMutex(level);
        k.locks.kmutexes.bind(mutex, m);
    })
}

unsafe extern "win64" fn KeReleaseMutex(mutex: usize, wait: u8) -> i32 {
    at_driver_site(|| {
        let k = kernel();
        let m = k.locks.kmutexes.bound(mutex, || k.model.KeInitializeMutex(0));
        k.model.KeReleaseMutex(m, wait != 0)
    })
}

// ---- Spin locks (KeInitializeSpinLock is inline: a zeroed KSPIN_LOCK) ----

unsafe extern "win64" fn KeAcquireSpinLockRaiseToDpc(lock: usize) -> u8 {
    at_driver_site(|| {
        let k = kernel();
        let l = k.locks.spin_locks.bound(lock, || k.model.KeInitializeSpinLock());
        let old = k.model.KeAcquireSpinLock(l);
        k.raised();
        old
    })
}

unsafe extern "win64" fn KeReleaseSpinLock(lock: usize, new_irql: u8) {
    at_driver_site(|| {
        let k = kernel();
        let l = k.locks.spin_locks.bound(lock, || k.model.KeInitializeSpinLock());
        k.model.KeReleaseSpinLock(l, new_irql)
    })
}

/// KeAcquireSpinLockAtDpcLevel: a DPC's (or an ISR's) spin lock, taken without touching the IRQL; below
/// DISPATCH_LEVEL the model's verifier says 0xC4/0x40, as Windows'.
unsafe extern "win64" fn KeAcquireSpinLockAtDpcLevel(lock: usize) {
    at_driver_site(|| {
        let k = kernel();
        let l = k.locks.spin_locks.bound(lock, || k.model.KeInitializeSpinLock());
        k.model.KeAcquireSpinLockAtDpcLevel(l);
        k.raised();
    })
}

unsafe extern "win64" fn KeReleaseSpinLockFromDpcLevel(lock: usize) {
    at_driver_site(|| {
        let k = kernel();
        let l = k.locks.spin_locks.bound(lock, || k.model.KeInitializeSpinLock());
        k.model.KeReleaseSpinLockFromDpcLevel(l)
    })
}

// ---- ERESOURCE and critical regions ----

unsafe extern "win64" fn ExInitializeResourceLite(resource: usize) -> i32 {
    at_driver_site(|| {
        let k = kernel();
        let r = k.model.ExInitializeResourceLite();
        k.locks.resources.bind(resource, r);
        0
    })
}

unsafe extern "win64" fn ExAcquireResourceExclusiveLite(resource: usize, wait: u8) -> u8 {
    at_driver_site(|| {
        let k = kernel();
        let r = k.locks.resources.bound(resource, || k.model.ExInitializeResourceLite());
        k.model.ExAcquireResourceExclusiveLite(r, wait != 0) as u8
    })
}

unsafe extern "win64" fn ExAcquireResourceSharedLite(resource: usize, wait: u8) -> u8 {
    at_driver_site(|| {
        let k = kernel();
        let r = k.locks.resources.bound(resource, || k.model.ExInitializeResourceLite());
        k.model.ExAcquireResourceSharedLite(r, wait != 0) as u8
    })
}

unsafe extern "win64" fn ExReleaseResourceLite(resource: usize) {
    at_driver_site(|| {
        let k = kernel();
        let r = k.locks.resources.bound(resource, || k.model.ExInitializeResourceLite());
        k.model.ExReleaseResourceLite(r)
    })
}

unsafe extern "win64" fn ExDeleteResourceLite(resource: usize) -> i32 {
    at_driver_site(|| {
        let k = kernel();
        let Some(r) = k.locks.resources.unbind(resource) else {
            // Never initialized through the kernel: nothing to delete (the driver's ERESOURCE was never used).
            return 0;
        };
        k.model.ExDeleteResourceLite(r).0
    })
}

unsafe extern "win64" fn KeEnterCriticalRegion() {
    at_driver_site(|| kernel().model.KeEnterCriticalRegion())
}

unsafe extern "win64" fn KeLeaveCriticalRegion() {
    at_driver_site(|| kernel().model.KeLeaveCriticalRegion())
}

// ---- Guarded mutex ----

unsafe extern "win64" fn KeInitializeGuardedMutex(mutex: usize) {
    at_driver_site(|| {
        let k = kernel();
        let m = k.model.KeInitializeGuardedMutex();
        k.locks.guarded.bind(mutex, m);
    })
}

unsafe extern "win64" fn KeAcquireGuardedMutex(mutex: usize) {
    at_driver_site(|| {
        let k = kernel();
        let m = k.locks.guarded.bound(mutex, || k.model.KeInitializeGuardedMutex());
        k.model.KeAcquireGuardedMutex(m)
    })
}

unsafe extern "win64" fn KeReleaseGuardedMutex(mutex: usize) {
    at_driver_site(|| {
        let k = kernel();
        let m = k.locks.guarded.bound(mutex, || k.model.KeInitializeGuardedMutex());
        k.model.KeReleaseGuardedMutex(m)
    })
}

/// (routine, thunk) for the lock routines, all ntoskrnl.exe's.
pub fn lock_thunks() -> [(&'static str, usize); 18] {
    [
        ("ExAcquireFastMutex", ExAcquireFastMutex_entry as *const () as usize),
        ("ExReleaseFastMutex", ExReleaseFastMutex_entry as *const () as usize),
        ("KeInitializeMutex", KeInitializeMutex_entry as *const () as usize),
        ("KeReleaseMutex", KeReleaseMutex_entry as *const () as usize),
        ("KeAcquireSpinLockRaiseToDpc", KeAcquireSpinLockRaiseToDpc_entry as *const () as usize),
        ("KeReleaseSpinLock", KeReleaseSpinLock_entry as *const () as usize),
        ("KeAcquireSpinLockAtDpcLevel", KeAcquireSpinLockAtDpcLevel_entry as *const () as usize),
        ("KeReleaseSpinLockFromDpcLevel", KeReleaseSpinLockFromDpcLevel_entry as *const () as usize),
        ("ExInitializeResourceLite", ExInitializeResourceLite_entry as *const () as usize),
        ("ExAcquireResourceExclusiveLite", ExAcquireResourceExclusiveLite_entry as *const () as usize),
        ("ExAcquireResourceSharedLite", ExAcquireResourceSharedLite_entry as *const () as usize),
        ("ExReleaseResourceLite", ExReleaseResourceLite_entry as *const () as usize),
        ("ExDeleteResourceLite", ExDeleteResourceLite_entry as *const () as usize),
        ("KeEnterCriticalRegion", KeEnterCriticalRegion_entry as *const () as usize),
        ("KeLeaveCriticalRegion", KeLeaveCriticalRegion_entry as *const () as usize),
        ("KeInitializeGuardedMutex", KeInitializeGuardedMutex_entry as *const () as usize),
        ("KeAcquireGuardedMutex", KeAcquireGuardedMutex_entry as *const () as usize),
        ("KeReleaseGuardedMutex", KeReleaseGuardedMutex_entry as *const () as usize),
    ]
}
