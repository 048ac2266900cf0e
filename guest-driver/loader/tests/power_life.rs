//! The loader's power manager (`power_life`) against fake function drivers, through the bound thunks and the
//! Windows x64 convention: a policy owner that answers each system power IRP with its own device IRP passes a
//! sleep/resume cycle; one that passes the IRPs down untouched (what vhca.sys did before), one that never reports
//! D0, and one that loses the system IRP each fail the way docs/verifier.md ("Power IRPs") says; a D0 completion
//! routine runs at PASSIVE_LEVEL, or at DISPATCH_LEVEL when the bus is told to complete there. Each case runs in a
//! child process (the kernel is installed once per process, and 0x9F stops it).

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use common::{child_of_this_test, routine, StopAndExit, STOPPED};
use vhca_loader::io_manager::{BusDriver, IoManager};
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_loader::power_life::{outcome, plan_d0_at_dispatch, plan_sleep_resume, run_planned};
use vhca_ntapi::NtKernel;
use vhca_ntmodel::{HostDmaBackend, NtModel, NtModelConfig};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, DRIVER_OBJECT, IO_STACK_LOCATION, IRP, PIO_COMPLETION_ROUTINE};
use windows_sys::Wdk::System::SystemServices::{DevicePowerState, SystemPowerState, IRP_MJ_POWER, IRP_MN_SET_POWER};
use windows_sys::Win32::Foundation::{
    NTSTATUS, STATUS_MORE_PROCESSING_REQUIRED, STATUS_NOT_SUPPORTED, STATUS_PENDING, STATUS_SUCCESS,
};
use windows_sys::Win32::System::Power::{PowerDeviceD0, PowerDeviceD3, PowerSystemWorking};
use windows_sys::Win32::System::IO::IO_STATUS_BLOCK;

const CASE: &str = "VHCA_POWER_LIFE_CASE";

/// How the fake FDO behaves: which case this child runs.
static MODE: AtomicU8 = AtomicU8::new(0);
const POLICY_OWNER: u8 = 0;
const PASSES_DOWN: u8 = 1;
const NO_D0_REPORT: u8 = 2;
const LOSES_SYSTEM_IRP: u8 = 3;
/// A policy owner that handles D0 in a completion routine, as vhca.sys does, and notes the IRQL it ran at.
const D0_IN_COMPLETION: u8 = 4;
/// The IRQL the D0 completion routine ran at (0xFF: it did not run).
static D0_IRQL: AtomicU8 = AtomicU8::new(0xFF);

/// A bus driver that refuses every PnP IRP at its PDO: the power IRPs that reach it must be answered as power IRPs
/// (the I/O manager's bus answers by major function), so a cycle that passes shows they were not taken for PnP's
/// REMOVE_DEVICE and CANCEL_REMOVE_DEVICE, whose minor codes SET_POWER and QUERY_POWER share.
struct PoweredBus;

impl BusDriver for PoweredBus {
    fn pnp(&self, _stack: &IO_STACK_LOCATION) -> NTSTATUS {
        STATUS_NOT_SUPPORTED
    }
}

type Dispatch = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP) -> NTSTATUS;
type Completion = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP, *mut c_void) -> NTSTATUS;
type PowerComplete = unsafe extern "win64" fn(*mut DEVICE_OBJECT, u8, i32, *mut c_void, *mut IO_STATUS_BLOCK);
type RequestPowerIrp = unsafe extern "win64" fn(
    *mut DEVICE_OBJECT,
    u8,
    i32,
    Option<PowerComplete>,
    *mut c_void,
    *mut *mut IRP,
) -> NTSTATUS;
type SetPowerState = unsafe extern "win64" fn(*mut DEVICE_OBJECT, i32, i32) -> i32;
type CallDriver = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP) -> NTSTATUS;
type CompleteRequest = unsafe extern "win64" fn(*mut IRP, i8);
type Create =
    unsafe extern "win64" fn(*mut DRIVER_OBJECT, u32, *const c_void, u32, u32, u8, *mut *mut DEVICE_OBJECT) -> NTSTATUS;
type Attach = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut DEVICE_OBJECT) -> *mut DEVICE_OBJECT;

fn pdo() -> *mut DEVICE_OBJECT {
    kernel().io.device_pdo()
}

/// # Safety
/// A live IRP at the caller's location.
unsafe fn current(irp: *mut IRP) -> *mut IO_STACK_LOCATION {
    // SAFETY: the caller's contract.
    unsafe { (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation }
}

/// IoSkipCurrentIrpStackLocation, then IoCallDriver to the PDO.
///
/// # Safety
/// A live IRP the caller holds.
unsafe fn pass_down(irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the caller's contract.
    unsafe {
        (*irp).CurrentLocation += 1;
        (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation = current(irp).add(1);
        routine::<CallDriver>("IofCallDriver")(pdo(), irp)
    }
}

/// The fake FDO's IRP_MJ_POWER, as `MODE` has it behave.
unsafe extern "win64" fn dispatch_power(device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    let mode = MODE.load(Ordering::Relaxed);
    // SAFETY: the IRP the I/O manager gave this routine, at this driver's location.
    unsafe {
        let stack = current(irp);
        let kind = (*stack).Parameters.Power.Type;
        if mode == PASSES_DOWN {
            return pass_down(irp);
        }
        if kind == SystemPowerState {
            if mode == LOSES_SYSTEM_IRP {
                (*stack).Control |= 0x01;
                return STATUS_PENDING;
            }
            // IoCopyCurrentIrpStackLocationToNext, IoSetCompletionRoutine, IoMarkIrpPending, IoCallDriver.
            let next = stack.sub(1);
            std::ptr::copy_nonoverlapping(stack, next, 1);
            (*next).CompletionRoutine =
                std::mem::transmute::<Option<Completion>, PIO_COMPLETION_ROUTINE>(Some(system_irp_back));
            (*next).Context = device.cast();
            (*next).Control = 0x40 | 0x80 | 0x20;
            (*stack).Control |= 0x01;
            routine::<CallDriver>("IofCallDriver")(pdo(), irp);
            return STATUS_PENDING;
        }
        let state = (*stack).Parameters.Power.State.DeviceState;
        let set = (*stack).MinorFunction as u32 == IRP_MN_SET_POWER && kind == DevicePowerState;
        let report: SetPowerState = routine("PoSetPowerState");
        if set && state == PowerDeviceD3 {
            report(device, DevicePowerState, PowerDeviceD3);
        }
        if set && state == PowerDeviceD0 && mode == D0_IN_COMPLETION {
            let next = stack.sub(1);
            std::ptr::copy_nonoverlapping(stack, next, 1);
            (*next).CompletionRoutine =
                std::mem::transmute::<Option<Completion>, PIO_COMPLETION_ROUTINE>(Some(powered_up));
            (*next).Context = device.cast();
            (*next).Control = 0x40 | 0x80 | 0x20;
            (*stack).Control |= 0x01;
            routine::<CallDriver>("IofCallDriver")(pdo(), irp);
            return STATUS_PENDING;
        }
        let status = pass_down(irp);
        // The bus driver completes at once here, so "after the device powers up" is after the call.
        if set && state == PowerDeviceD0 && mode != NO_D0_REPORT {
            report(device, DevicePowerState, PowerDeviceD0);
        }
        status
    }
}

/// The D0 IRP back from the bus: the IRQL noted, D0 reported "after the device powers up".
unsafe extern "win64" fn powered_up(_device: *mut DEVICE_OBJECT, _irp: *mut IRP, fdo: *mut c_void) -> NTSTATUS {
    D0_IRQL.store(kernel().model.KeGetCurrentIrql(), Ordering::Relaxed);
    let report: SetPowerState = routine("PoSetPowerState");
    // SAFETY: the thunk's Windows x64 signature; the FDO this routine was set for.
    unsafe { report(fdo.cast(), DevicePowerState, PowerDeviceD0) };
    STATUS_SUCCESS
}

/// The system IRP back from the bus: the device IRP it maps to, the system IRP kept until that is done.
unsafe extern "win64" fn system_irp_back(_device: *mut DEVICE_OBJECT, irp: *mut IRP, _fdo: *mut c_void) -> NTSTATUS {
    let request: RequestPowerIrp = routine("PoRequestPowerIrp");
    // SAFETY: the system IRP, at this driver's location again.
    unsafe {
        let stack = current(irp);
        let target = if (*stack).Parameters.Power.State.SystemState == PowerSystemWorking {
            PowerDeviceD0
        } else {
            PowerDeviceD3
        };
        let status =
            request(pdo(), (*stack).MinorFunction, target, Some(device_irp_done), irp.cast(), std::ptr::null_mut());
        assert_eq!(status, STATUS_PENDING, "PoRequestPowerIrp sends the IRP");
    }
    STATUS_MORE_PROCESSING_REQUIRED
}

/// The device IRP's PowerCompletion callback: the system IRP takes its status and completes.
unsafe extern "win64" fn device_irp_done(
    _pdo: *mut DEVICE_OBJECT,
    _minor: u8,
    _state: i32,
    system_irp: *mut c_void,
    status: *mut IO_STATUS_BLOCK,
) {
    let irp: *mut IRP = system_irp.cast();
    // SAFETY: the system IRP system_irp_back kept; the power manager's status block.
    unsafe {
        (*irp).IoStatus.Anonymous.Status = (*status).Anonymous.Status;
        routine::<CompleteRequest>("IofCompleteRequest")(irp, 0);
    }
}

/// One case in this (child) process: the fake FDO on the PDO, one sleep/resume cycle, the outcome printed.
fn run_case(case: &str) {
    let mode = match case {
        "policy-owner" => POLICY_OWNER,
        "passes-down" => PASSES_DOWN,
        "no-d0-report" => NO_D0_REPORT,
        "loses-system-irp" => LOSES_SYSTEM_IRP,
        "d0-completion" | "d0-completion-at-dispatch" => D0_IN_COMPLETION,
        other => panic!("no case {other}"),
    };
    MODE.store(mode, Ordering::Relaxed);
    let model =
        Arc::new(NtModel::new(NtModelConfig::default(), Arc::new(HostDmaBackend::default()), Arc::new(StopAndExit)));
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(PoweredBus)))));
    let driver: *mut DRIVER_OBJECT = Box::into_raw(Box::new(DRIVER_OBJECT::default()));
    // SAFETY: a fresh driver object and the thunks' Windows x64 signatures; the objects outlive the case.
    unsafe {
        (*driver).MajorFunction[IRP_MJ_POWER as usize] = Some(std::mem::transmute::<
            Dispatch,
            unsafe extern "system" fn(*const DEVICE_OBJECT, *mut IRP) -> NTSTATUS,
        >(dispatch_power));
        let mut fdo = std::ptr::null_mut();
        assert_eq!(routine::<Create>("IoCreateDevice")(driver, 0, std::ptr::null(), 0x22, 0, 0, &mut fdo), 0);
        assert!(!routine::<Attach>("IoAttachDeviceToDeviceStack")(fdo, pdo()).is_null());
    }
    plan_sleep_resume(1);
    plan_d0_at_dispatch(case == "d0-completion-at-dispatch");
    run_planned(&kernel().io, pdo());
    let o = outcome();
    println!(
        "OUTCOME cycles={} irps={} power_up_failed={} failure={:?}",
        o.cycles, o.device_irps, o.power_up_failed, o.failure
    );
    println!(
        "D0 completion at IRQL {}, {} completed at DISPATCH_LEVEL",
        D0_IRQL.load(Ordering::Relaxed),
        o.d0_at_dispatch
    );
}

/// Not a test of its own: the tests below run it in a child process with the case in the environment.
#[test]
#[ignore]
fn child() {
    run_case(&std::env::var(CASE).expect("run by the tests below, with the case named"));
}

/// (exit status, stdout) of `case` in a child.
fn run(case: &str) -> (i32, String) {
    let out = child_of_this_test(CASE, case).output().expect("the child runs");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn a_policy_owner_that_asks_for_each_device_irp_passes_the_cycle() {
    let (status, out) = run("policy-owner");
    assert_eq!(status, 0, "{out}");
    assert!(out.contains("OUTCOME cycles=1 irps=3 power_up_failed=false failure=None"), "{out}");
}

#[test]
fn passing_power_irps_down_untouched_asks_for_no_device_irp() {
    let (status, out) = run("passes-down");
    assert_eq!(status, 0, "{out}");
    assert!(out.contains("OUTCOME cycles=0 irps=0 power_up_failed=false"), "{out}");
    assert!(out.contains("IRP_MN_SET_POWER S3: the power policy owner asked for no device power IRP"), "{out}");
}

#[test]
fn a_device_never_reported_in_d0_is_a_failed_power_up() {
    let (status, out) = run("no-d0-report");
    assert_eq!(status, 0, "{out}");
    assert!(out.contains("OUTCOME cycles=0 irps=3 power_up_failed=true"), "{out}");
    assert!(out.contains("the stack reported D3 with PoSetPowerState, not D0"), "{out}");
}

#[test]
fn a_system_irp_never_completed_is_0x9f_3() {
    let (status, out) = run("loses-system-irp");
    assert_eq!(status, STOPPED, "{out}");
    assert!(out.contains("*** STOP: 0x0000009F (0x0000000000000003,"), "{out}");
}

#[test]
fn the_bus_completes_d0_at_passive_level_unless_told_otherwise() {
    let (status, out) = run("d0-completion");
    assert_eq!(status, 0, "{out}");
    assert!(out.contains("OUTCOME cycles=1 irps=3 power_up_failed=false failure=None"), "{out}");
    assert!(out.contains("D0 completion at IRQL 0, 0 completed at DISPATCH_LEVEL"), "{out}");
}

#[test]
fn in_the_mode_the_d0_completion_routine_runs_at_dispatch_level() {
    let (status, out) = run("d0-completion-at-dispatch");
    assert_eq!(status, 0, "{out}");
    assert!(out.contains("OUTCOME cycles=1 irps=3 power_up_failed=false failure=None"), "{out}");
    assert!(out.contains("D0 completion at IRQL 2, 1 completed at DISPATCH_LEVEL"), "{out}");
}
