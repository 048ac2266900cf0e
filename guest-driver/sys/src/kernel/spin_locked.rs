//! A value behind a KSPIN_LOCK, for the shim's own bookkeeping. IRQL moves only through the exported routines
//! (KeAcquireSpinLockRaiseToDpc, KeReleaseSpinLock), never inline CR8, so a model can stand behind them.

use core::cell::UnsafeCell;

use super::kernel_imports::{KeAcquireSpinLockRaiseToDpc, KeReleaseSpinLock};

/// A value behind a KSPIN_LOCK: the closure runs at DISPATCH_LEVEL with the lock held, so it must not wait or
/// touch paged memory (the shim's tables are in non-paged pool).
pub struct SpinLocked<T> {
    lock: UnsafeCell<usize>,
    value: UnsafeCell<T>,
}

// SAFETY: every access to `value` happens with the spin lock held, which serialises all processors.
unsafe impl<T: Send> Sync for SpinLocked<T> {}
// SAFETY: moving the cell moves the value; the lock word is plain data (0 = free) while no one holds it.
unsafe impl<T: Send> Send for SpinLocked<T> {}

impl<T> SpinLocked<T> {
    pub const fn new(value: T) -> SpinLocked<T> {
        // KeInitializeSpinLock sets the word to 0 (wdm.h inline on x64).
        SpinLocked { lock: UnsafeCell::new(0), value: UnsafeCell::new(value) }
    }

    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        // SAFETY: callers are at IRQL <= DISPATCH_LEVEL (the shim is never called above it); the lock word lives
        // as long as `self`, in non-paged pool or the image's data section.
        let old = unsafe { KeAcquireSpinLockRaiseToDpc(self.lock.get()) };
        // SAFETY: the spin lock is held: no other processor is inside `with`.
        let out = f(unsafe { &mut *self.value.get() });
        // SAFETY: releases the lock taken above and returns to the IRQL it saved.
        unsafe { KeReleaseSpinLock(self.lock.get(), old) };
        out
    }
}
