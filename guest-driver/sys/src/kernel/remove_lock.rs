//! The FDO's remove lock (IoInitializeRemoveLockEx and friends, the exports behind wdm.h's IoAcquireRemoveLock
//! macros): every IRP holds it while this driver works on it, and REMOVE_DEVICE waits until all have let go before
//! the device's resources are freed and the FDO deleted (Microsoft, "Using Remove Locks").

use core::ffi::c_void;

use windows_sys::Wdk::Foundation::IRP;
use windows_sys::Wdk::System::SystemServices::{
    IoAcquireRemoveLockEx, IoInitializeRemoveLockEx, IoReleaseRemoveLockAndWaitEx, IoReleaseRemoveLockEx,
    IO_REMOVE_LOCK,
};
use windows_sys::Win32::Foundation::NTSTATUS;

use super::pool_allocator::POOL_TAG;

const SIZE: u32 = core::mem::size_of::<IO_REMOVE_LOCK>() as u32;

/// # Safety
/// `lock` is in the FDO's (non-paged) extension and initialised once, in AddDevice.
pub unsafe fn initialize(lock: *mut IO_REMOVE_LOCK) {
    // SAFETY: PASSIVE_LEVEL; no time or count limits (those only apply to checked builds).
    unsafe { IoInitializeRemoveLockEx(lock, POOL_TAG, 0, 0, SIZE) }
}

/// Takes the lock for `irp`; STATUS_DELETE_PENDING once REMOVE_DEVICE has begun.
///
/// # Safety
/// An initialised lock; any IRQL <= DISPATCH_LEVEL.
pub unsafe fn acquire(lock: *mut IO_REMOVE_LOCK, irp: *mut IRP) -> Result<(), NTSTATUS> {
    // SAFETY: the caller's contract; the IRP is the tag that release gives back.
    let status = unsafe { IoAcquireRemoveLockEx(lock, irp as *const c_void, c"vhca".as_ptr().cast(), line!(), SIZE) };
    if status < 0 {
        Err(status)
    } else {
        Ok(())
    }
}

/// # Safety
/// `irp` holds the lock.
pub unsafe fn release(lock: *mut IO_REMOVE_LOCK, irp: *mut IRP) {
    // SAFETY: the caller's contract; IRQL <= DISPATCH_LEVEL.
    unsafe { IoReleaseRemoveLockEx(lock, irp as *const c_void, SIZE) }
}

/// REMOVE_DEVICE: gives back `irp`'s hold and waits until no other IRP holds the lock. PASSIVE_LEVEL.
///
/// # Safety
/// `irp` is the REMOVE_DEVICE IRP and holds the lock.
pub unsafe fn release_and_wait(lock: *mut IO_REMOVE_LOCK, irp: *mut IRP) {
    // SAFETY: the caller's contract; PASSIVE_LEVEL, no other lock held (it waits).
    unsafe { IoReleaseRemoveLockAndWaitEx(lock, irp as *const c_void, SIZE) }
}
