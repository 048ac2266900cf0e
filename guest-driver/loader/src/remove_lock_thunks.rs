//! IO_REMOVE_LOCK, as the exports behind wdm.h's IoAcquireRemoveLock macros keep it (Microsoft, "Using Remove
//! Locks"): acquisitions are counted per lock address; after IoReleaseRemoveLockAndWait an acquisition fails with
//! STATUS_DELETE_PENDING, and that call returns only once every other acquisition is released. The lock's own
//! bytes in the driver are left alone: only these routines read them on Windows too. The counts are
//! `remove_lock_table`'s.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::ffi::c_void;
use std::time::Duration;

use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_DELETE_PENDING, STATUS_SUCCESS};

use crate::kernel_context::kernel;

unsafe extern "win64" fn IoInitializeRemoveLockEx(lock: *mut c_void, _tag: u32, _max_min: u32, _high: u32, _size: u32) {
    kernel().remove_locks.initialize(lock as usize);
}

unsafe extern "win64" fn IoAcquireRemoveLockEx(
    lock: *mut c_void,
    _tag: *const c_void,
    _file: *const u8,
    _line: u32,
    _size: u32,
) -> NTSTATUS {
    if kernel().remove_locks.acquire(lock as usize) {
        STATUS_SUCCESS
    } else {
        STATUS_DELETE_PENDING
    }
}

unsafe extern "win64" fn IoReleaseRemoveLockEx(lock: *mut c_void, _tag: *const c_void, _size: u32) {
    kernel().remove_locks.release(lock as usize);
}

unsafe extern "win64" fn IoReleaseRemoveLockAndWaitEx(lock: *mut c_void, _tag: *const c_void, _size: u32) {
    let locks = &kernel().remove_locks;
    locks.release_for_removal(lock as usize);
    // Other acquisitions belong to IRPs still in the driver, on other threads: wait for them, as Windows does.
    while locks.held(lock as usize) {
        std::thread::sleep(Duration::from_micros(100));
    }
}

pub fn remove_lock_thunks() -> [(&'static str, usize); 4] {
    [
        ("IoInitializeRemoveLockEx", IoInitializeRemoveLockEx as *const () as usize),
        ("IoAcquireRemoveLockEx", IoAcquireRemoveLockEx as *const () as usize),
        ("IoReleaseRemoveLockEx", IoReleaseRemoveLockEx as *const () as usize),
        ("IoReleaseRemoveLockAndWaitEx", IoReleaseRemoveLockAndWaitEx as *const () as usize),
    ]
}
