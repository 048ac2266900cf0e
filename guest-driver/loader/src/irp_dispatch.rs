//! Moving IRPs (IofCallDriver, IofCompleteRequest, IoForwardIrpSynchronously): down to each driver's dispatch routine
//! or the bus driver, back up through the completion routines, each move checked by `io_verification`'s rules;
//! apart from `io_manager`'s objects, as it can bugcheck.

use std::ffi::c_void;

use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IO_STACK_LOCATION, IRP, PIO_COMPLETION_ROUTINE};
use windows_sys::Wdk::System::SystemServices::{
    IRP_MJ_PNP, IRP_MJ_POWER, IRP_MN_QUERY_POWER, IRP_MN_SET_POWER, IRP_MN_WAIT_WAKE,
};
use windows_sys::Win32::Foundation::{
    NTSTATUS, STATUS_INVALID_PARAMETER, STATUS_MORE_PROCESSING_REQUIRED, STATUS_NOT_IMPLEMENTED, STATUS_NOT_SUPPORTED,
    STATUS_PENDING, STATUS_SUCCESS,
};

use crate::io_manager::{DispatchFn, IoManager};
use crate::io_verification::IoRules;
use crate::kernel_context::kernel;

/// An IRP completion routine as the image calls it.
type CompletionFn = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP, *mut c_void) -> NTSTATUS;

/// IO_STACK_LOCATION.Control bits (wdm.h): when a completion routine runs.
const SL_INVOKE_ON_SUCCESS: u8 = 0x40;
const SL_INVOKE_ON_ERROR: u8 = 0x80;
const SL_INVOKE_ON_CANCEL: u8 = 0x20;
const SL_PENDING_RETURNED: u8 = 0x01;

/// IofCallDriver: the next location becomes current and the device's driver gets the IRP. The PDO's driver is
/// the bus driver, answered here. Under I/O Verification the call and the dispatch routine's return are checked
/// (`io_verification`).
///
/// # Safety
/// A live device and an IRP with a stack location left for it.
pub(crate) unsafe fn call_driver(io: &IoManager, device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    let rules = IoRules::new(&kernel().model);
    let freed = io.ledger().is_freed(irp as usize);
    rules.calling(device as usize, io.is_device(device), irp as usize, io.ledger().is_done(irp as usize));
    if freed {
        // Windows would send the freed IRP's memory down; the loader has nothing left to send.
        return STATUS_INVALID_PARAMETER;
    }
    // SAFETY: the caller's contract.
    unsafe {
        let held = io.ledger().held_below(irp as usize, (*irp).CurrentLocation, rules.irql());
        rules.touched_while_held_below(irp as usize, held, true);
        let caller = io.ledger().caller(irp as usize).unwrap_or((0, device as usize));
        rules.cancel_routine_left(irp as usize, (*irp).CancelRoutine.map_or(0, |f| f as usize), Some(caller));
        if (*irp).CurrentLocation <= 1 {
            // Windows stops with NO_MORE_IRP_STACK_LOCATIONS (0x35).
            crate::kernel_context::bugcheck(0x35, irp as u64, 0, 0, 0);
        }
        (*irp).CurrentLocation -= 1;
        let stack = IoManager::next_stack(irp);
        (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation = stack;
        (*stack).DeviceObject = device;
        let driver = (*device).DriverObject;
        if io.is_bus_driver(driver) {
            let status = bus_answer(io, irp, &*stack);
            crate::power_life::bus_completes(stack, || complete_request(io, irp, status));
            return status;
        }
        let routine = (*driver).MajorFunction[(*stack).MajorFunction as usize];
        match routine {
            Some(f) => {
                let call =
                    io.ledger().enter(irp as usize, (*irp).CurrentLocation, rules.irql(), f as usize, device as usize);
                // SAFETY: the driver's dispatch routine, called with the Windows x64 convention it was built for.
                let status = std::mem::transmute::<usize, DispatchFn>(f as usize)(device, irp);
                // The IRP may be completed and freed by now: its mark was kept when completion passed the location.
                let (marked, pending_below) = match io.ledger().leave(&call) {
                    Some(marked) => (marked, false),
                    None if io.ledger().is_freed(irp as usize) => (false, false),
                    None => ((*stack).Control & SL_PENDING_RETURNED != 0, (*irp).CurrentLocation < call.location()),
                };
                rules.returned(&call, f as usize, device as usize, status, marked, pending_below);
                status
            }
            None => {
                complete_request(io, irp, STATUS_NOT_SUPPORTED);
                STATUS_NOT_SUPPORTED
            }
        }
    }
}

/// What the bus driver completes an IRP at its PDO with, by major function: PnP IRPs are the bus's own answer;
/// power IRPs are answered as the PCI bus driver does for a device it powers (a set or query of a system or device
/// state succeeds, WAIT_WAKE is refused: the model's device cannot wake the system, POWER_SEQUENCE is optional and
/// not implemented); any other IRP is completed with the status it came with, as a bus driver does with an IRP it
/// does not handle. Power's minor codes 2 and 3 are PnP's REMOVE_DEVICE and CANCEL_REMOVE_DEVICE: without the split
/// a power IRP got the bus's answer for a removal.
///
/// # Safety
/// A live IRP whose current location is `stack`.
unsafe fn bus_answer(io: &IoManager, irp: *mut IRP, stack: &IO_STACK_LOCATION) -> NTSTATUS {
    match u32::from(stack.MajorFunction) {
        IRP_MJ_PNP => io.bus().pnp(stack),
        IRP_MJ_POWER => match u32::from(stack.MinorFunction) {
            IRP_MN_SET_POWER | IRP_MN_QUERY_POWER => STATUS_SUCCESS,
            IRP_MN_WAIT_WAKE => STATUS_NOT_SUPPORTED,
            _ => STATUS_NOT_IMPLEMENTED,
        },
        // SAFETY: the caller's contract.
        _ => unsafe { (*irp).IoStatus.Anonymous.Status },
    }
}

/// Completes the IRP with `status` on the I/O manager's behalf (the bus driver's answer, a missing dispatch
/// routine): the completion walk without the checks on a driver's IoCompleteRequest.
///
/// # Safety
/// As `complete_irp`.
pub(crate) unsafe fn complete_request(io: &IoManager, irp: *mut IRP, status: NTSTATUS) {
    // SAFETY: the caller's contract.
    unsafe {
        (*irp).IoStatus.Anonymous.Status = status;
        complete_walk(io, irp)
    }
}

/// IofCompleteRequest from a driver: an IRP already completed is 0x44 in every mode (its memory is not read when
/// the I/O manager freed it); under I/O Verification the caller's IRQL and the status are checked; then the walk.
///
/// # Safety
/// An IRP the caller holds; it is not touched after.
pub(crate) unsafe fn complete_irp(io: &IoManager, irp: *mut IRP) {
    let rules = IoRules::new(&kernel().model);
    if io.ledger().is_done(irp as usize) {
        // With the rule disabled nothing is left to complete: the walk would find no location above.
        rules.completed_twice(irp as usize);
        return;
    }
    // SAFETY: the caller's contract.
    unsafe {
        let held = io.ledger().held_below(irp as usize, (*irp).CurrentLocation, rules.irql());
        rules.touched_while_held_below(irp as usize, held, false);
        rules.cancel_routine_left(irp as usize, (*irp).CancelRoutine.map_or(0, |f| f as usize), None);
        rules.completing(irp as usize, (*irp).IoStatus.Anonymous.Status);
        complete_walk(io, irp)
    }
}

/// The completion routines from the current location upwards, each under its SL_INVOKE_ON_* bits;
/// STATUS_MORE_PROCESSING_REQUIRED stops the walk (the routine's owner keeps the IRP). A location whose routine
/// does not run passes SL_PENDING_RETURNED up, as IoMarkIrpPending in that routine would. Then the IRP's event and
/// status block, for IRPs the I/O manager built.
///
/// # Safety
/// A live IRP that is its holder's to complete; it is not touched after.
unsafe fn complete_walk(io: &IoManager, irp: *mut IRP) {
    // SAFETY: the caller's contract; the stack locations lie behind the IRP.
    unsafe {
        let count = (*irp).StackCount;
        while (*irp).CurrentLocation <= count {
            let stack = (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation;
            (*irp).PendingReturned = (*stack).Control & SL_PENDING_RETURNED != 0;
            io.ledger().completed_past(irp as usize, (*irp).CurrentLocation, (*irp).PendingReturned);
            let routine = (*stack).CompletionRoutine;
            let control = (*stack).Control;
            let context = (*stack).Context;
            (*irp).CurrentLocation += 1;
            (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation = stack.add(1);
            let status = (*irp).IoStatus.Anonymous.Status;
            let wanted = if (*irp).Cancel {
                control & SL_INVOKE_ON_CANCEL != 0
            } else if status >= 0 {
                control & SL_INVOKE_ON_SUCCESS != 0
            } else {
                control & SL_INVOKE_ON_ERROR != 0
            };
            if let (Some(f), true) = (routine, wanted) {
                // The routine's device is the one of the location it was set in: the next one up.
                let device =
                    if (*irp).CurrentLocation <= count { (*stack.add(1)).DeviceObject } else { std::ptr::null_mut() };
                // SAFETY: the driver's completion routine, called with its own convention.
                let r = std::mem::transmute::<usize, CompletionFn>(f as usize)(device, irp, context);
                if r == STATUS_MORE_PROCESSING_REQUIRED {
                    return;
                }
            } else if (*irp).PendingReturned && (*irp).CurrentLocation <= count {
                (*stack.add(1)).Control |= SL_PENDING_RETURNED;
            }
        }
        io.ledger().completed_to_top(irp as usize);
        let iosb = (*irp).Anonymous.UserIosb;
        if !iosb.is_null() {
            *iosb = (*irp).IoStatus;
        }
        let event = (*irp).UserEvent;
        if !event.is_null() {
            // Through the model, so a thread waiting on it in KeWaitForSingleObject wakes.
            crate::kernel_context::kernel().signal_event(event as usize);
        }
        // An IRP built for a caller's event (IoBuildSynchronousFsdRequest) belongs to the I/O manager again.
        if !event.is_null() {
            io.free_irp(irp);
        }
    }
}

/// IoForwardIrpSynchronously: the current location copied to the next, sent down, and waited for.
///
/// # Safety
/// A live IRP this driver holds and the device below it.
pub(crate) unsafe fn forward_synchronously(io: &IoManager, device: *mut DEVICE_OBJECT, irp: *mut IRP) -> bool {
    // SAFETY: the caller's contract. The copy leaves out the completion routine, as IoCopyCurrentIrpStack-
    // LocationToNext does; a completion routine that answers MORE_PROCESSING_REQUIRED gives the IRP back here.
    unsafe {
        if (*irp).CurrentLocation <= 1 {
            return false;
        }
        let current = (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation;
        let next = IoManager::next_stack(irp);
        std::ptr::copy_nonoverlapping(current, next, 1);
        (*next).CompletionRoutine =
            std::mem::transmute::<usize, PIO_COMPLETION_ROUTINE>(forward_done as CompletionFn as usize);
        (*next).Context = std::ptr::null_mut();
        (*next).Control = SL_INVOKE_ON_SUCCESS | SL_INVOKE_ON_ERROR | SL_INVOKE_ON_CANCEL;
        let status = call_driver(io, device, irp);
        // Every IRP completes before IoCallDriver returns here (the bus driver is synchronous), so there is
        // nothing to wait for; a lower driver answering STATUS_PENDING would need the event Windows waits on.
        status != STATUS_PENDING || (*irp).IoStatus.Anonymous.Status != STATUS_PENDING
    }
}

/// The completion routine IoForwardIrpSynchronously sets: the IRP stays with the forwarding driver.
unsafe extern "win64" fn forward_done(_device: *mut DEVICE_OBJECT, _irp: *mut IRP, _context: *mut c_void) -> NTSTATUS {
    STATUS_MORE_PROCESSING_REQUIRED
}
