//! What wdm.h does inline to keep an IRP coming back to this driver after it passed it down
//! (IoCopyCurrentIrpStackLocationToNext, IoSetCompletionRoutine, IoMarkIrpPending), on windows-sys's IRP.

use core::ffi::c_void;

use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IO_STACK_LOCATION, IRP, PIO_COMPLETION_ROUTINE};
use windows_sys::Win32::Foundation::NTSTATUS;

use super::irp::current_stack;

/// IO_STACK_LOCATION.Control bits (wdm.h).
const SL_PENDING_RETURNED: u8 = 0x01;
const SL_INVOKE_ON_CANCEL: u8 = 0x20;
const SL_INVOKE_ON_SUCCESS: u8 = 0x40;
const SL_INVOKE_ON_ERROR: u8 = 0x80;

/// A completion routine as the I/O manager calls it.
pub type CompletionRoutine = unsafe extern "system" fn(*const DEVICE_OBJECT, *const IRP, *const c_void) -> NTSTATUS;

/// IoCopyCurrentIrpStackLocationToNext, then IoSetCompletionRoutine(routine, context, TRUE, TRUE, TRUE): the next
/// driver sees this driver's parameters, and `routine` runs however the IRP ends.
///
/// # Safety
/// A live IRP this driver holds, with a location left below its own; it is passed down right after.
pub unsafe fn copy_to_next_with(irp: *mut IRP, routine: CompletionRoutine, context: *mut c_void) {
    // SAFETY: the caller's contract; the next location lies just below the current one, as wdm.h's macros have it.
    unsafe {
        let current = current_stack(irp);
        let next: *mut IO_STACK_LOCATION = current.sub(1);
        // The macro copies everything up to the completion routine and clears Control.
        let bytes = core::mem::offset_of!(IO_STACK_LOCATION, CompletionRoutine);
        core::ptr::copy_nonoverlapping(current.cast::<u8>(), next.cast::<u8>(), bytes);
        (*next).Control = SL_INVOKE_ON_SUCCESS | SL_INVOKE_ON_ERROR | SL_INVOKE_ON_CANCEL;
        // windows-sys declares the routine without its parameters; the pointer is the same.
        (*next).CompletionRoutine =
            core::mem::transmute::<Option<CompletionRoutine>, PIO_COMPLETION_ROUTINE>(Some(routine));
        (*next).Context = context;
    }
}

/// IoMarkIrpPending: this driver returns STATUS_PENDING for the IRP and completes it (or lets it complete) later.
///
/// # Safety
/// A live IRP this driver holds, at its own location.
pub unsafe fn mark_pending(irp: *mut IRP) {
    // SAFETY: the caller's contract.
    unsafe { (*current_stack(irp)).Control |= SL_PENDING_RETURNED };
}
