//! IRP_MJ_PNP for the FDO, as a WDM function driver handles it: START_DEVICE after the lower drivers (the PCI bus
//! driver) started the device (again after a STOP: a rebalance); STOP, SURPRISE_REMOVAL and REMOVE quiesce it and
//! free everything before the IRP goes down; queries succeed going down, cancels after the lower drivers; anything
//! else passes down untouched.

use alloc::format;

use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IRP};
use windows_sys::Wdk::System::SystemServices::{
    IoDeleteDevice, IoDetachDevice, IoForwardIrpSynchronously, IofCompleteRequest, IO_REMOVE_LOCK,
    IRP_MN_CANCEL_REMOVE_DEVICE, IRP_MN_CANCEL_STOP_DEVICE, IRP_MN_QUERY_REMOVE_DEVICE, IRP_MN_QUERY_STOP_DEVICE,
    IRP_MN_REMOVE_DEVICE, IRP_MN_START_DEVICE, IRP_MN_STOP_DEVICE, IRP_MN_SURPRISE_REMOVAL,
};
use windows_sys::Win32::Foundation::{
    NTSTATUS, STATUS_DELETE_PENDING, STATUS_DEVICE_CONFIGURATION_ERROR, STATUS_SUCCESS, STATUS_UNSUCCESSFUL,
};

use super::cq_waits::Matching;
use super::debug_print::print_line;
use super::fdo::fdo;
use super::irp::{complete, current_stack, pass_down, set_status};
use super::registry;
use super::remove_lock;
use super::started_device::StartedDevice;
use crate::result_line::RunResult;
use crate::scenario_choice::{choose, options};
use vhca_scenarios::Scenario;

/// The IRP_MJ_PNP dispatch routine. PASSIVE_LEVEL, in a system thread.
///
/// # Safety
/// Called by the I/O manager with one of this driver's FDOs and a PnP IRP.
pub unsafe extern "system" fn dispatch_pnp(device: *const DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the I/O manager's contract: a live FDO of ours and an IRP with our stack location.
    let (fdo, minor, stack) = unsafe {
        let stack = current_stack(irp);
        (fdo(device), (*stack).MinorFunction as u32, stack)
    };
    let lock: *mut IO_REMOVE_LOCK = &mut fdo.remove_lock;
    // SAFETY: the FDO's initialised remove lock.
    if let Err(status) = unsafe { remove_lock::acquire(lock, irp) } {
        // SAFETY: PASSIVE_LEVEL; ours to complete: REMOVE_DEVICE has begun.
        return unsafe { complete(irp, status) };
    }
    if minor == IRP_MN_REMOVE_DEVICE {
        // Every other IRP lets go of the device first; then it is quiesced and freed, the IRP goes down, and the
        // FDO is detached and deleted: nothing can reach it afterwards.
        // Requests kept pending hold the lock too: they end first, and the poller stops.
        fdo.waits.shutdown(STATUS_DELETE_PENDING);
        // SAFETY: this IRP holds the lock; PASSIVE_LEVEL.
        unsafe { remove_lock::release_and_wait(lock, irp) };
        fdo.control.stopping();
        fdo.control.removed();
        fdo.started = None;
        let lower = fdo.lower;
        // SAFETY: PASSIVE_LEVEL, no lock held (the remove lock was given back); the extension is dropped once, just
        // before its device object goes.
        return unsafe {
            set_status(irp, STATUS_SUCCESS);
            let status = pass_down(lower, irp);
            IoDetachDevice(lower);
            core::ptr::drop_in_place(fdo);
            IoDeleteDevice(device);
            status
        };
    }
    let status = match minor {
        IRP_MN_START_DEVICE => {
            // The lower drivers first: only then are the resources assigned and the device decoding.
            // SAFETY: PASSIVE_LEVEL; the IRP is ours again when this returns.
            let forwarded = unsafe { IoForwardIrpSynchronously(fdo.lower, irp) };
            // SAFETY: completed by the lower drivers into IoStatus.
            let mut status = unsafe { (*irp).IoStatus.Anonymous.Status };
            if forwarded && status >= 0 {
                // SAFETY: START_DEVICE's parameters, valid for this IRP.
                let (raw, translated) = unsafe {
                    let p = (*stack).Parameters.StartDevice;
                    (p.AllocatedResources, p.AllocatedResourcesTranslated)
                };
                status = start(fdo, device as *mut DEVICE_OBJECT, raw, translated);
                fdo.control.started(fdo.started.as_ref());
            } else if !forwarded {
                status = STATUS_DEVICE_CONFIGURATION_ERROR;
            }
            let twice = completes_start_twice();
            // SAFETY: PASSIVE_LEVEL, holding the remove lock; ours to complete.
            let status = unsafe { complete(irp, status) };
            if twice {
                // The seed's irp-completed-twice: the result path completes START_DEVICE and the common exit
                // completes it again, two places that each believe they own the IRP.
                // SAFETY: none: the IRP is the I/O manager's since the completion above; that is the bug.
                unsafe { IofCompleteRequest(irp, 0) };
            }
            status
        }
        IRP_MN_SURPRISE_REMOVAL if !drops_requests_unreleased() => {
            // The device is gone ("Handling an IRP_MN_SURPRISE_REMOVAL Request": fail new I/O, release the hardware,
            // free at REMOVE what open handles still need): no request reaches the HCA again, the device is reset
            // (a function really gone reads all ones and ends it at once) so nothing DMAs into what goes next, then
            // a user process's MRs, QPs and CQs are given back on the host without a command to the device, which
            // would answer none (each destroy would wait out its deadline). Its handles are refused from here, and
            // its CLEANUP at exit finds nothing left to release.
            // A wait on a device that is gone is never answered: it ends now.
            fdo.waits.drain(Matching::ALL, STATUS_DELETE_PENDING);
            let hca = fdo.control.surprise_removed();
            // The reset and the channel's release as at D3; the channel's buffers go with the HCA's last hold.
            if let Some(device) = fdo.started.as_mut() {
                device.power_down();
            }
            if let Some(hca) = hca {
                hca.abandon();
            }
            fdo.started = None;
            // SAFETY: PASSIVE_LEVEL, holding the remove lock; succeeded here, then passed down.
            unsafe {
                set_status(irp, STATUS_SUCCESS);
                pass_down(fdo.lower, irp)
            }
        }
        IRP_MN_STOP_DEVICE | IRP_MN_SURPRISE_REMOVAL => {
            // STOP releases every hardware resource (Handling an IRP_MN_STOP_DEVICE Request): dropping the started
            // device resets it, frees its rings and common buffers, puts its DMA adapter and unmaps its BARs (no
            // interrupt is connected outside a scenario). What the next START needs is the PDO and the lower
            // device, which the FDO keeps: START rebuilds everything from the resources it brings.
            fdo.waits.drain(Matching::ALL, STATUS_DELETE_PENDING);
            fdo.control.stopping();
            fdo.started = None;
            // SAFETY: PASSIVE_LEVEL, holding the remove lock; succeeded here, then passed down as the PnP rules
            // require.
            unsafe {
                set_status(irp, STATUS_SUCCESS);
                pass_down(fdo.lower, irp)
            }
        }
        IRP_MN_QUERY_STOP_DEVICE if fdo.control.holds_hca() && !drops_requests_unreleased() => {
            // The query's rule (Handling an IRP_MN_QUERY_STOP_DEVICE Request): refuse with STATUS_UNSUCCESSFUL
            // while requests are live that cannot be held or drained. A user process's QPs, CQs and MRs live in the
            // control path's HCA, and its work requests on the device: they cannot be held across a STOP, which
            // drops the HCA and resets the device, so the query is refused (the seed's rebalance-drains). A driver
            // that fails a PnP IRP completes it without passing it down.
            // SAFETY: PASSIVE_LEVEL, holding the remove lock; ours to complete.
            unsafe { complete(irp, STATUS_UNSUCCESSFUL) }
        }
        IRP_MN_QUERY_STOP_DEVICE | IRP_MN_QUERY_REMOVE_DEVICE => {
            // With no request's HCA (START's scenario destroyed its QPs, CQs and MRs and disconnected its
            // interrupt before START returned) the device is idle, and what it has (the channel, the rings) is
            // rebuilt by the next START: nothing to hold or drain. A query-remove with files open is followed by
            // REMOVE only once they closed.
            // SAFETY: as above.
            unsafe {
                set_status(irp, STATUS_SUCCESS);
                pass_down(fdo.lower, irp)
            }
        }
        IRP_MN_CANCEL_STOP_DEVICE | IRP_MN_CANCEL_REMOVE_DEVICE => {
            // The bus driver first, then up the stack; a function driver must not fail it, and one that arrives
            // while the device is started (another stack refused the query) is simply succeeded (Handling an
            // IRP_MN_CANCEL_STOP_DEVICE Request). Nothing was held at the query, so nothing is released here.
            // SAFETY: PASSIVE_LEVEL, holding the remove lock; the IRP is ours again when this returns.
            unsafe { IoForwardIrpSynchronously(fdo.lower, irp) };
            // SAFETY: PASSIVE_LEVEL, holding the remove lock; ours to complete.
            unsafe { complete(irp, STATUS_SUCCESS) }
        }
        // SAFETY: PASSIVE_LEVEL, holding the remove lock; not ours: down unchanged, status untouched.
        _ => unsafe { pass_down(fdo.lower, irp) },
    };
    // SAFETY: PASSIVE_LEVEL; this IRP took the lock above; released by tag, the IRP itself is not touched.
    unsafe { remove_lock::release(lock, irp) };
    status
}

/// The bug variant of the seed's irp-completed-twice: smoke with BreakFix 1 (`vhca.break_fix=1`, the runner's
/// guest script writes it under Parameters as for the fixed scenarios), read before the IRP is completed. Its fixed
/// twin, irp-completed-once, is smoke with BreakFix 0. PASSIVE_LEVEL.
fn completes_start_twice() -> bool {
    let smoke = matches!(choose(registry::read_text(&registry::SCENARIO).as_deref()), Ok(Scenario::Smoke));
    let break_fix = registry::read_text(&registry::BREAK_FIX);
    smoke && options(None, break_fix.as_deref()).is_ok_and(|o| o.break_fix)
}

/// vhca.sys as it was (BreakFix 1), with a user process's objects live: QUERY_STOP succeeds and STOP drops them
/// under it (the seed's rebalance-with-qps-live), SURPRISE_REMOVAL drops them unreleased
/// (surprise-removal-during-traffic). PASSIVE_LEVEL.
fn drops_requests_unreleased() -> bool {
    let break_fix = registry::read_text(&registry::BREAK_FIX);
    options(None, break_fix.as_deref()).is_ok_and(|o| o.break_fix)
}

/// Brings the device up and runs the run's scenario; the result goes to the debugger and the registry.
fn start(
    fdo: &mut super::fdo::Fdo,
    fdo_device: *mut DEVICE_OBJECT,
    raw: *const windows_sys::Wdk::System::SystemServices::CM_RESOURCE_LIST,
    translated: *const windows_sys::Wdk::System::SystemServices::CM_RESOURCE_LIST,
) -> NTSTATUS {
    let chosen = choose(registry::read_text(&registry::SCENARIO).as_deref()).and_then(|scenario| {
        let lock = registry::read_text(&registry::LOCK);
        let break_fix = registry::read_text(&registry::BREAK_FIX);
        Ok((scenario, options(lock.as_deref(), break_fix.as_deref())?))
    });
    // SAFETY: the PDO of this FDO and START_DEVICE's lists.
    let started = unsafe { StartedDevice::start(fdo.pdo, raw, translated) };
    let (status, result) = match (started, chosen) {
        (Ok(device), Ok((scenario, options))) => {
            let result = device.run_scenario(fdo_device, scenario, &options);
            fdo.started = Some(device);
            (STATUS_SUCCESS, result)
        }
        (Ok(device), Err(why)) => {
            fdo.started = Some(device);
            let mut result = RunResult::new(Scenario::Smoke.name());
            result.fail(format!("Parameters: {why}"));
            (STATUS_SUCCESS, result)
        }
        (Err(why), chosen) => {
            let mut result = RunResult::new(chosen.map_or("smoke", |(s, _)| s.name()));
            result.fail(format!("START_DEVICE: {why}"));
            (STATUS_DEVICE_CONFIGURATION_ERROR, result)
        }
    };
    let line = result.line();
    print_line(&line);
    if let Err(status) = registry::write_result(&line) {
        print_line(&format!("vhca: cannot store the result in the registry (status {:#010x})", status as u32));
    }
    status
}
