//! The processor queries a driver binary imports (KeQueryActiveProcessorCountEx, KeQueryActiveProcessorCount),
//! answered from the NT model's processor count, as the model's own NtAsyncKernel answers the native build.
//! KeGetCurrentProcessorNumberEx stays with the time and processor routines of nt_thunks.rs.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use vhca_ntapi::{NtAsyncKernel, KAFFINITY};

use crate::kernel_context::kernel;

/// KeQueryActiveProcessorCountEx(GroupNumber): the model's processors for group 0 or ALL_PROCESSOR_GROUPS, 0 for
/// any other group (the model has one). Any IRQL.
unsafe extern "win64" fn KeQueryActiveProcessorCountEx(group: u16) -> u32 {
    kernel().model.KeQueryActiveProcessorCountEx(group)
}

/// KeQueryActiveProcessorCount(ActiveProcessors): group 0's processors; with ActiveProcessors, their KAFFINITY
/// (pointer-sized on x64, as the model's u64). Any IRQL.
unsafe extern "win64" fn KeQueryActiveProcessorCount(active: *mut KAFFINITY) -> u32 {
    let mut set: KAFFINITY = 0;
    let n = kernel().model.KeQueryActiveProcessorCount(Some(&mut set));
    if !active.is_null() {
        // SAFETY: the driver's out variable.
        unsafe { *active = set };
    }
    n
}

/// (routine, thunk) for the processor queries, both ntoskrnl.exe's.
pub fn processor_thunks() -> [(&'static str, usize); 2] {
    [
        ("KeQueryActiveProcessorCountEx", KeQueryActiveProcessorCountEx as *const () as usize),
        ("KeQueryActiveProcessorCount", KeQueryActiveProcessorCount as *const () as usize),
    ]
}
