//! The IRP handling wdm.h does in inline functions and macros (IoGetCurrentIrpStackLocation,
//! IoSkipCurrentIrpStackLocation, IoCompleteRequest, IoCallDriver), done here on windows-sys's IRP.

use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IO_STACK_LOCATION, IRP};
use windows_sys::Wdk::System::SystemServices::{IofCallDriver, IofCompleteRequest};
use windows_sys::Win32::Foundation::NTSTATUS;

/// IoGetCurrentIrpStackLocation.
///
/// # Safety
/// `irp` is a live IRP this driver was given.
pub unsafe fn current_stack(irp: *mut IRP) -> *mut IO_STACK_LOCATION {
    // SAFETY: the caller's contract; the field is the I/O manager's pointer to this driver's location.
    unsafe { (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation }
}

/// IoSkipCurrentIrpStackLocation: the next driver sees this driver's location unchanged.
///
/// # Safety
/// As current_stack; the IRP is passed on right after.
pub unsafe fn skip_current_stack(irp: *mut IRP) {
    // SAFETY: the caller's contract; the stack location pointer moves back up by one, as the macro does.
    unsafe {
        (*irp).CurrentLocation += 1;
        let current = current_stack(irp);
        (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation = current.add(1);
    }
}

/// Passes the IRP to the next lower driver unchanged (skip + IoCallDriver).
///
/// # Safety
/// `lower` is the device this driver attached to; the IRP is not touched after.
pub unsafe fn pass_down(lower: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the caller's contract; IofCallDriver at IRQL <= DISPATCH_LEVEL, the caller's.
    unsafe {
        skip_current_stack(irp);
        IofCallDriver(lower, irp)
    }
}

/// Completes the IRP with `status` (IoCompleteRequest, IO_NO_INCREMENT).
///
/// # Safety
/// The IRP is this driver's to complete, and is not touched after.
pub unsafe fn complete(irp: *mut IRP, status: NTSTATUS) -> NTSTATUS {
    // SAFETY: the caller's contract; IofCompleteRequest at IRQL <= DISPATCH_LEVEL, the caller's.
    unsafe {
        (*irp).IoStatus.Anonymous.Status = status;
        IofCompleteRequest(irp, 0);
    }
    status
}

/// Sets the IRP's status (for PnP IRPs this driver succeeds before passing down).
///
/// # Safety
/// A live IRP this driver holds.
pub unsafe fn set_status(irp: *mut IRP, status: NTSTATUS) {
    // SAFETY: the caller's contract.
    unsafe { (*irp).IoStatus.Anonymous.Status = status };
}
