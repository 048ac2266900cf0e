//! IRP_MJ_POWER: the FDO owns its device's power policy. A system power IRP goes down with a completion routine that
//! asks for the matching device power IRP (PoRequestPowerIrp) and completes the system IRP once that one is done; a
//! device IRP for D3 quiesces the device's DMA before it goes down, one for D0 re-initialises the device after the
//! bus driver powered it (started_device.rs). Microsoft's steps are cited where each is taken (docs/windows.md).

use core::ffi::c_void;

use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IRP};
use windows_sys::Wdk::System::SystemServices::{
    DelayedWorkQueue, DevicePowerState, IoAllocateWorkItem, IoFreeWorkItem, IoQueueWorkItem, IofCompleteRequest,
    PoCallDriver, PoRequestPowerIrp, PoSetPowerState, PoStartNextPowerIrp, SystemPowerState, IRP_MN_QUERY_POWER,
    IRP_MN_SET_POWER, PIO_WORKITEM_ROUTINE, POWER_STATE, PREQUEST_POWER_COMPLETE,
};
use windows_sys::Win32::Foundation::{
    NTSTATUS, STATUS_CANCELLED, STATUS_MORE_PROCESSING_REQUIRED, STATUS_PENDING, STATUS_SUCCESS,
};
use windows_sys::Win32::System::Power::{PowerDeviceD0, PowerDeviceD3, PowerSystemWorking};
use windows_sys::Win32::System::IO::IO_STATUS_BLOCK;

use super::completion_routine::{copy_to_next_with, mark_pending};
use super::cq_waits::Matching;
use super::debug_print::print_line;
use super::fdo::fdo;
use super::irp::{complete, current_stack, skip_current_stack};
use super::irql;
use super::registry;
use super::remove_lock;
use crate::scenario_choice::options;

/// A completion routine's answer that lets the IRP go on up (STATUS_CONTINUE_COMPLETION).
const CONTINUE_COMPLETION: NTSTATUS = STATUS_SUCCESS;
const PASSIVE_LEVEL: u8 = 0;

/// The IRP_MJ_POWER dispatch routine. PASSIVE_LEVEL: the PDO is DO_POWER_PAGABLE, and so is the FDO (IRP_MN_SET_POWER's
/// page: the power manager then sends at PASSIVE_LEVEL).
///
/// PoStartNextPowerIrp and PoCallDriver are what Windows Server 2003 and earlier required; since Windows Vista the
/// first does nothing and the second is IoCallDriver (their reference pages), so on Windows 10 and later neither is a
/// rule: they are kept as the pattern that works on every version.
///
/// # Safety
/// Called by the I/O manager with one of this driver's FDOs and a power IRP.
pub unsafe extern "system" fn dispatch_power(device: *const DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: PASSIVE_LEVEL, holding only the remove lock; the I/O manager's contract. The IRP is not touched after it
    // goes down, except through the completion routines this driver set (the lock is released by tag).
    unsafe {
        let fdo = fdo(device);
        let stack = current_stack(irp);
        let minor = (*stack).MinorFunction as u32;
        let kind = (*stack).Parameters.Power.Type;
        // "Sending a Device Set-Power IRP in Response to a System Set-Power IRP", step 1: the remove lock, tagged by
        // the IRP; on failure completed with that status (no PoStartNextPowerIrp needed since Vista).
        if let Err(status) = remove_lock::acquire(&mut fdo.remove_lock, irp) {
            return complete(irp, status);
        }
        let system = kind == SystemPowerState;
        let device_set = minor == IRP_MN_SET_POWER && kind == DevicePowerState;
        match minor {
            IRP_MN_SET_POWER | IRP_MN_QUERY_POWER if system => {
                // Steps 2-6: down with a completion routine, pending; the device IRP is asked for on the way up.
                down_then(fdo.lower, irp, system_irp_back, device)
            }
            _ if device_set && (*stack).Parameters.Power.State.DeviceState == PowerDeviceD0 => {
                // "Drivers handle power-up IRPs ... in the IoCompletion routines as the IRPs travel back up": the
                // device is only powered once the bus driver is done.
                down_then(fdo.lower, irp, powered_up, device)
            }
            _ if device_set => {
                // Power-down on the way down: DMA quiesced (reset, rings and channel freed) while the device still
                // decodes, then PoSetPowerState "before the device powers down", then down to the bus driver, which
                // must see every set-power IRP.
                // A wait's CQ goes with the HCA the sleep closes: it ends first.
                fdo.waits.drain(Matching::ALL, STATUS_CANCELLED);
                fdo.control.sleeping(!d3_leaves_hca_open());
                if let Some(started) = fdo.started.as_mut() {
                    started.power_down();
                }
                let state = (*stack).Parameters.Power.State;
                PoSetPowerState(device, DevicePowerState, state);
                pass_down(fdo, irp)
            }
            // A device query (nothing stops a D3: vhca.sys keeps no request across power states) and any other
            // minor go down unchanged.
            _ => pass_down(fdo, irp),
        }
    }
}

/// The D3 bug variant, BreakFix 1 (`vhca.break_fix=1`; the seed's sleep-during-traffic-unquiesced, whose scenario
/// reads no BreakFix of its own): the control path's HCA is dropped without being closed, as vhca.sys did before,
/// so a user's MRs, QPs and rings outlive the sleep (control_path.rs). Its fixed twin is BreakFix 0. PASSIVE_LEVEL.
fn d3_leaves_hca_open() -> bool {
    let break_fix = registry::read_text(&registry::BREAK_FIX);
    options(None, break_fix.as_deref()).is_ok_and(|o| o.break_fix)
}

/// Down unchanged; the lock released by tag.
///
/// # Safety
/// As dispatch_power's body, holding the remove lock for `irp`.
unsafe fn pass_down(fdo: &mut super::fdo::Fdo, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the caller's contract.
    unsafe {
        PoStartNextPowerIrp(irp);
        skip_current_stack(irp);
        let status = PoCallDriver(fdo.lower, irp);
        remove_lock::release(&mut fdo.remove_lock, irp);
        status
    }
}

/// IoCopyCurrentIrpStackLocationToNext, IoSetCompletionRoutine, IoMarkIrpPending, PoCallDriver, STATUS_PENDING: the
/// IRP comes back to `routine` (its context the FDO), which releases the remove lock.
///
/// # Safety
/// As dispatch_power's body, holding the remove lock for `irp`.
unsafe fn down_then(
    lower: *mut DEVICE_OBJECT,
    irp: *mut IRP,
    routine: super::completion_routine::CompletionRoutine,
    device: *const DEVICE_OBJECT,
) -> NTSTATUS {
    // SAFETY: the caller's contract; the IRP is marked before it goes, as the pending rule needs.
    unsafe {
        copy_to_next_with(irp, routine, device as *mut c_void);
        mark_pending(irp);
        PoCallDriver(lower, irp);
    }
    STATUS_PENDING
}

/// The system power IRP back from the bus driver: asks for the device state it maps to (S0 → D0, every sleep state →
/// D3, which every PCI device supports in S1-S4; a driver that can wake would read DEVICE_CAPABILITIES' DeviceState
/// table instead), with the same minor, and keeps the system IRP until that one is done. A failed system IRP (a
/// vetoed query) goes on up as it is.
unsafe extern "system" fn system_irp_back(
    _device: *const DEVICE_OBJECT,
    irp: *const IRP,
    fdo_device: *const c_void,
) -> NTSTATUS {
    let irp = irp as *mut IRP;
    // SAFETY: the completion routine set in dispatch_power, with the FDO as context; the IRP is this driver's again
    // (its current location is the FDO's), held under the remove lock taken there.
    unsafe {
        let fdo = fdo(fdo_device.cast());
        if (*irp).IoStatus.Anonymous.Status < 0 {
            PoStartNextPowerIrp(irp);
            remove_lock::release(&mut fdo.remove_lock, irp);
            return CONTINUE_COMPLETION;
        }
        let stack = current_stack(irp);
        let minor = (*stack).MinorFunction;
        let target = if (*stack).Parameters.Power.State.SystemState == PowerSystemWorking {
            PowerDeviceD0
        } else {
            PowerDeviceD3
        };
        let callback = core::mem::transmute::<Option<PowerComplete>, PREQUEST_POWER_COMPLETE>(Some(device_irp_done));
        let status = PoRequestPowerIrp(
            fdo.pdo,
            minor,
            POWER_STATE { DeviceState: target },
            callback,
            irp as *const c_void,
            core::ptr::null_mut(),
        );
        if status != STATUS_PENDING {
            // No device IRP will come to complete this one: it ends with the reason.
            (*irp).IoStatus.Anonymous.Status = status;
            PoStartNextPowerIrp(irp);
            remove_lock::release(&mut fdo.remove_lock, irp);
            return CONTINUE_COMPLETION;
        }
        STATUS_MORE_PROCESSING_REQUIRED
    }
}

/// REQUEST_POWER_COMPLETE, as windows-sys leaves its parameters out.
type PowerComplete =
    unsafe extern "system" fn(*const DEVICE_OBJECT, u8, POWER_STATE, *const c_void, *const IO_STATUS_BLOCK);

/// The device IRP asked for in system_irp_back is done: the system IRP takes its status and completes (the steps'
/// PowerCompletion callback).
unsafe extern "system" fn device_irp_done(
    _pdo: *const DEVICE_OBJECT,
    _minor: u8,
    _state: POWER_STATE,
    system_irp: *const c_void,
    status: *const IO_STATUS_BLOCK,
) {
    let irp = system_irp as *mut IRP;
    // SAFETY: the system IRP system_irp_back kept (MORE_PROCESSING_REQUIRED), its current location the FDO's; the
    // power manager's status block of the finished device IRP.
    unsafe {
        let device = (*current_stack(irp)).DeviceObject;
        let fdo = fdo(device);
        (*irp).IoStatus.Anonymous.Status = (*status).Anonymous.Status;
        PoStartNextPowerIrp(irp);
        IofCompleteRequest(irp, 0);
        remove_lock::release(&mut fdo.remove_lock, irp);
    }
}

/// The D0 IRP back from the bus driver: the device powered, so it is initialised again (`enter_d0`). A completion
/// routine "executes in an arbitrary thread or DPC context, and at an IRQL that is less than or equal to
/// DISPATCH_LEVEL" (IO_COMPLETION_ROUTINE's page), and pci.sys may complete a power-up from the DPC that ends the
/// device's D3hot→D0 delay; the re-initialisation maps, allocates and waits, so at DISPATCH_LEVEL it goes to a work
/// item, which finishes the IRP at PASSIVE_LEVEL ("Handling IRP_MN_SET_POWER for Device Power States": the
/// function driver's power-up work is done as the IRP travels back up; docs/verifier.md, "Power IRPs").
unsafe extern "system" fn powered_up(
    _device: *const DEVICE_OBJECT,
    irp: *const IRP,
    fdo_device: *const c_void,
) -> NTSTATUS {
    let irp = irp as *mut IRP;
    // SAFETY: the completion routine set in dispatch_power, with the FDO as context, at IRQL <= DISPATCH_LEVEL; the
    // remove lock taken there is held until here, or until the work item ran.
    unsafe {
        let device: *const DEVICE_OBJECT = fdo_device.cast();
        let fdo = fdo(device);
        let powered = (*irp).IoStatus.Anonymous.Status >= 0;
        if powered && fdo.started.is_some() && irql::current() != PASSIVE_LEVEL {
            if defer_to_work_item(device, irp) {
                return STATUS_MORE_PROCESSING_REQUIRED;
            }
            // No work item (the low-resources simulation refused one): as a failed re-initialisation.
            print_line("VHCA: D0 completed at DISPATCH_LEVEL and no work item: the device is not re-initialised");
        } else {
            enter_d0(device, powered);
        }
        PoStartNextPowerIrp(irp);
        remove_lock::release(&mut fdo.remove_lock, irp);
    }
    CONTINUE_COMPLETION
}

/// D0's work at PASSIVE_LEVEL: the device initialised again (started_device.rs) and D0 reported with PoSetPowerState
/// "after the device powers up". A failed re-initialisation does not fail the IRP ("function and filter drivers
/// above the bus driver must not fail a device set-power IRP"): the device stays without a channel, D0 is not
/// reported, and the failure is printed.
///
/// # Safety
/// PASSIVE_LEVEL, holding the remove lock for the D0 IRP; `device` is this driver's FDO.
unsafe fn enter_d0(device: *const DEVICE_OBJECT, powered: bool) {
    // SAFETY: the caller's contract.
    unsafe {
        let fdo = fdo(device);
        let ready = match fdo.started.as_mut() {
            _ if !powered => false,
            None => true,
            Some(started) => match started.power_up() {
                Ok(()) => true,
                Err(why) => {
                    print_line(&alloc::format!("VHCA: D0 re-initialisation failed: {why}"));
                    false
                }
            },
        };
        if ready {
            // Requests reach the HCA again, on the channel the power-up built.
            fdo.control.started(fdo.started.as_ref());
            PoSetPowerState(device, DevicePowerState, POWER_STATE { DeviceState: PowerDeviceD0 });
        }
    }
}

/// Which slot of the IRP's DriverContext holds the work item while the D0 IRP waits for it: a driver may use the four
/// words while it owns the IRP, and it owns it from MORE_PROCESSING_REQUIRED until it completes it again.
const WORK_ITEM_SLOT: usize = 0;

/// Queues `enter_d0` for the D0 IRP (IoAllocateWorkItem and IoQueueWorkItem, both IRQL <= DISPATCH_LEVEL); false
/// when no work item could be had.
///
/// # Safety
/// The D0 IRP in this driver's completion routine, under the remove lock taken for it; `device` is the FDO.
unsafe fn defer_to_work_item(device: *const DEVICE_OBJECT, irp: *mut IRP) -> bool {
    // SAFETY: the caller's contract; the item's routine has IO_WORKITEM_ROUTINE's parameters, which windows-sys
    // leaves out of PIO_WORKITEM_ROUTINE; the queued item references the FDO, so the image stays loaded until it ran.
    unsafe {
        let item = IoAllocateWorkItem(device);
        if item == 0 {
            return false;
        }
        (*irp).Tail.Overlay.Anonymous1.Anonymous.DriverContext[WORK_ITEM_SLOT] = item as *mut c_void;
        let routine = core::mem::transmute::<Option<WorkItemRoutine>, PIO_WORKITEM_ROUTINE>(Some(d0_work_item));
        IoQueueWorkItem(item, routine, DelayedWorkQueue, irp as *const c_void);
        true
    }
}

/// IO_WORKITEM_ROUTINE, as windows-sys leaves its parameters out.
type WorkItemRoutine = unsafe extern "system" fn(*const DEVICE_OBJECT, *const c_void);

/// The D0 IRP's work item, at PASSIVE_LEVEL in a system worker thread: `enter_d0`, then the IRP completed again, on
/// up to the power manager's location (the driver kept it with MORE_PROCESSING_REQUIRED), the remove lock released
/// and the item freed, the last thing the routine does with it.
unsafe extern "system" fn d0_work_item(device: *const DEVICE_OBJECT, context: *const c_void) {
    let irp = context as *mut IRP;
    // SAFETY: PASSIVE_LEVEL, no lock held but the remove lock for this IRP, which `defer_to_work_item` queued this
    // routine for with the FDO; the IRP is this driver's until IofCompleteRequest.
    unsafe {
        let slot = &mut (*irp).Tail.Overlay.Anonymous1.Anonymous.DriverContext[WORK_ITEM_SLOT];
        let item = core::mem::replace(slot, core::ptr::null_mut()) as isize;
        enter_d0(device, true);
        PoStartNextPowerIrp(irp);
        IofCompleteRequest(irp, 0);
        remove_lock::release(&mut fdo(device).remove_lock, irp);
        IoFreeWorkItem(item);
    }
}
