//! MmGetPhysicalAddress for the binary: the model's frame behind a pointer vhca.sys holds. Only a bug hands that to
//! the device (a driver opted into DMA remapping must use the adapter's logical addresses), so it lives with DMA.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement.

use std::ffi::c_void;

use crate::kernel_context::kernel;

/// PHYSICAL_ADDRESS MmGetPhysicalAddress(PVOID BaseAddress), any IRQL: a LARGE_INTEGER, returned in RAX under the
/// x64 convention. The driver's pointer is a host address; the model knows the block by its model address.
pub(super) unsafe extern "win64" fn MmGetPhysicalAddress(base: *mut c_void) -> i64 {
    let k = kernel();
    let va = k.addresses.to_model(base as usize);
    k.model.mm_get_physical_address(va.0) as i64
}
