//! IO_REMOVE_LOCK, as the exports behind wdm.h's IoAcquireRemoveLock macros keep it (Microsoft, "Using Remove
//! Locks"): acquisitions are counted per lock address; after IoReleaseRemoveLockAndWait an acquisition fails with
//! STATUS_DELETE_PENDING, and that call returns only once every other acquisition is released. The lock's own
//! bytes in the driver are left alone: only these routines read them on Windows too.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;
use std::time::Duration;

use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_DELETE_PENDING, STATUS_SUCCESS};

use crate::kernel_context::kernel;

/// Per lock: acquisitions outstanding, and whether removal began.
#[derive(Default)]
pub struct RemoveLocks {
    locks: Mutex<HashMap<usize, (u32, bool)>>,
}

unsafe extern "win64" fn IoInitializeRemoveLockEx(lock: *mut c_void, _tag: u32, _max_min: u32, _high: u32, _size: u32) {
    crate::lock(&kernel().remove_locks.locks).insert(lock as usize, (0, false));
}

unsafe extern "win64" fn IoAcquireRemoveLockEx(
    lock: *mut c_void,
    _tag: *const c_void,
    _file: *const u8,
    _line: u32,
    _size: u32,
) -> NTSTATUS {
    let mut locks = crate::lock(&kernel().remove_locks.locks);
    let entry = locks.entry(lock as usize).or_default();
    if entry.1 {
        return STATUS_DELETE_PENDING;
    }
    entry.0 += 1;
    STATUS_SUCCESS
}

unsafe extern "win64" fn IoReleaseRemoveLockEx(lock: *mut c_void, _tag: *const c_void, _size: u32) {
    let mut locks = crate::lock(&kernel().remove_locks.locks);
    if let Some(entry) = locks.get_mut(&(lock as usize)) {
        entry.0 = entry.0.saturating_sub(1);
    }
}

unsafe extern "win64" fn IoReleaseRemoveLockAndWaitEx(lock: *mut c_void, _tag: *const c_void, _size: u32) {
    {
        let mut locks = crate::lock(&kernel().remove_locks.locks);
        let entry = locks.entry(lock as usize).or_default();
        entry.1 = true;
        entry.0 = entry.0.saturating_sub(1);
    }
    // Other acquisitions belong to IRPs still in the driver, on other threads: wait for them, as Windows does.
    while crate::lock(&kernel().remove_locks.locks).get(&(lock as usize)).is_some_and(|e| e.0 > 0) {
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
