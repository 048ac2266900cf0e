//! IRP_MJ_POWER: the FDO owns no power policy (the device keeps no state across D-states that the driver core
//! does not rebuild at START_DEVICE), so every power IRP goes down unchanged, as Microsoft's rules for passing
//! power IRPs have it: PoStartNextPowerIrp (required before Windows Vista, harmless since), skip, PoCallDriver.

use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IRP};
use windows_sys::Wdk::System::SystemServices::{PoCallDriver, PoStartNextPowerIrp};
use windows_sys::Win32::Foundation::NTSTATUS;

use super::fdo::fdo;
use super::irp::{complete, skip_current_stack};
use super::remove_lock;

/// The IRP_MJ_POWER dispatch routine. PASSIVE_LEVEL (the FDO is DO_POWER_PAGABLE).
///
/// # Safety
/// Called by the I/O manager with one of this driver's FDOs and a power IRP.
pub unsafe extern "system" fn dispatch_power(device: *const DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: PASSIVE_LEVEL (DO_POWER_PAGABLE), holding only the remove lock; the I/O manager's contract; the IRP
    // is not touched after PoCallDriver (the lock is released by tag).
    unsafe {
        let fdo = fdo(device);
        PoStartNextPowerIrp(irp);
        if let Err(status) = remove_lock::acquire(&mut fdo.remove_lock, irp) {
            return complete(irp, status);
        }
        skip_current_stack(irp);
        let status = PoCallDriver(fdo.lower, irp);
        remove_lock::release(&mut fdo.remove_lock, irp);
        status
    }
}
