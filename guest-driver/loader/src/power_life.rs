//! The power manager's side of a sleep and resume, as Windows sends it to a started device stack: the system power
//! IRPs (QUERY_POWER then SET_POWER S3, then SET_POWER S0), the device power IRPs the stack's power policy owner
//! asks for with PoRequestPowerIrp, and the states it reports with PoSetPowerState, each checked against the rules
//! Microsoft's pages state (which page, in docs/verifier.md "Power IRPs").
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use vhca_ntapi::{NtKernel, DISPATCH_LEVEL, DRIVER_POWER_STATE_FAILURE, PASSIVE_LEVEL};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IO_STACK_LOCATION, IRP, PIO_COMPLETION_ROUTINE};
use windows_sys::Wdk::System::SystemServices::{
    DevicePowerState, SystemPowerState, IRP_MJ_POWER, IRP_MN_QUERY_POWER, IRP_MN_SET_POWER,
};
use windows_sys::Win32::Foundation::{
    NTSTATUS, STATUS_INSUFFICIENT_RESOURCES, STATUS_INVALID_PARAMETER_2, STATUS_MORE_PROCESSING_REQUIRED,
    STATUS_NOT_SUPPORTED, STATUS_PENDING,
};
use windows_sys::Win32::System::Power::{
    PowerActionNone, PowerActionSleep, PowerDeviceD0, PowerDeviceD3, PowerSystemSleeping3, PowerSystemWorking,
};
use windows_sys::Win32::System::IO::IO_STATUS_BLOCK;

use crate::io_manager::{top_of, IoManager};
use crate::irp_dispatch;
use crate::kernel_context::{bugcheck, kernel};

/// IRP_MN_WAIT_WAKE and IRP_MN_POWER_SEQUENCE (wdm.h): the other minors PoRequestPowerIrp knows.
const IRP_MN_WAIT_WAKE: u8 = 0;
const IRP_MN_POWER_SEQUENCE: u8 = 1;
/// IO_STACK_LOCATION.Control: the power manager's completion routine runs however the IRP ends.
const SL_INVOKE_ALWAYS: u8 = 0x40 | 0x80 | 0x20;
/// How long a power IRP may stay uncompleted before it is 0x9F/0x3. Windows' power watchdog allows minutes; the
/// model's bus driver never pends, so anything left this long is a driver that lost the IRP.
const POWER_IRP_TIMEOUT: Duration = Duration::from_secs(5);

/// How many sleep/resume cycles the next life runs after START_DEVICE (`vhca.power=sleep-resume[:N]`).
static CYCLES: AtomicU32 = AtomicU32::new(0);
/// The bus driver completes each D0 IRP at DISPATCH_LEVEL (`vhca.power=sleep-resume-d0-dispatch[:N]`).
static D0_AT_DISPATCH: AtomicBool = AtomicBool::new(false);
/// What the cycles did, for the run's report.
static OUTCOME: Mutex<PowerOutcome> = Mutex::new(PowerOutcome::NONE);
/// The device power state each device object last reported with PoSetPowerState (absent: D0, as started).
static REPORTED: Mutex<Option<HashMap<usize, i32>>> = Mutex::new(None);

/// What the sleep/resume cycles did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PowerOutcome {
    /// Cycles that went S0→S3→S0 with every rule kept.
    pub cycles: u32,
    /// Device power IRPs the policy owner asked for (three per cycle: query D3, set D3, set D0).
    pub device_irps: u32,
    /// The first rule broken or IRP failed, which ends the cycles; the life goes on to REMOVE_DEVICE, as Windows
    /// goes on with a device that failed to power up.
    pub failure: Option<String>,
    /// The failure is the device not back in D0 after S0 while every rule held: the driver's failed power-up (its
    /// error path under the low-resources simulation), not a broken rule.
    pub power_up_failed: bool,
    /// D0 IRPs the bus driver completed at DISPATCH_LEVEL (`plan_d0_at_dispatch`).
    pub d0_at_dispatch: u32,
}

impl PowerOutcome {
    const NONE: PowerOutcome =
        PowerOutcome { cycles: 0, device_irps: 0, failure: None, power_up_failed: false, d0_at_dispatch: 0 };
}

/// Sets how many sleep/resume cycles the life runs once the device started (0: none).
pub fn plan_sleep_resume(cycles: u32) {
    CYCLES.store(cycles, Ordering::Relaxed);
}

/// Sets whether the bus driver completes D0 IRPs at DISPATCH_LEVEL. Windows' pci.sys may: it completes a power-up
/// once the device's D3hot→D0 delay passed, and "a driver's IoCompletion routine executes in an arbitrary thread or
/// DPC context, and at an IRQL that is less than or equal to DISPATCH_LEVEL" (IO_COMPLETION_ROUTINE's page), so a
/// function driver's power-up routine must not count on PASSIVE_LEVEL ("Handling IRP_MN_SET_POWER for Device Power
/// States", "Passing Power IRPs"). Off, the model's bus completes at its caller's PASSIVE_LEVEL.
pub fn plan_d0_at_dispatch(on: bool) {
    D0_AT_DISPATCH.store(on, Ordering::Relaxed);
}

/// The bus driver's completion of the IRP at `stack` (its PDO's location), run by `complete`: for a device
/// set-power to D0 under `plan_d0_at_dispatch`, at DISPATCH_LEVEL, as from the DPC that ends the power-up's delay,
/// so every completion routine above runs there; any other IRP at the caller's IRQL.
///
/// # Safety
/// `stack` is the live IRP's current location; it is read before `complete` runs, never after.
pub(crate) unsafe fn bus_completes(stack: *const IO_STACK_LOCATION, complete: impl FnOnce()) {
    // SAFETY: the caller's contract; a power IRP's parameters are its Power member.
    let power_up = unsafe {
        u32::from((*stack).MajorFunction) == IRP_MJ_POWER
            && u32::from((*stack).MinorFunction) == IRP_MN_SET_POWER
            && (*stack).Parameters.Power.Type == DevicePowerState
            && (*stack).Parameters.Power.State.DeviceState == PowerDeviceD0
    };
    if !(power_up && D0_AT_DISPATCH.load(Ordering::Relaxed)) {
        return complete();
    }
    let model = &kernel().model;
    let old = model.KeRaiseIrql(DISPATCH_LEVEL);
    complete();
    model.KeLowerIrql(old);
    crate::lock(&OUTCOME).d0_at_dispatch += 1;
}

/// What the last life's cycles did.
pub fn outcome() -> PowerOutcome {
    crate::lock(&OUTCOME).clone()
}

/// The planned cycles on a started stack, in the PnP manager's thread at PASSIVE_LEVEL. Stops at the first failure.
pub fn run_planned(io: &IoManager, pdo: *mut DEVICE_OBJECT) {
    let cycles = CYCLES.load(Ordering::Relaxed);
    *crate::lock(&OUTCOME) = PowerOutcome::NONE;
    *crate::lock(&REPORTED) = None;
    if cycles == 0 {
        return;
    }
    for _ in 0..cycles {
        let result = sleep_and_resume(io, pdo);
        let mut outcome = crate::lock(&OUTCOME);
        match result {
            // A routine called at the wrong IRQL was recorded as it happened; the cycle does not count.
            Ok(()) if outcome.failure.is_none() => outcome.cycles += 1,
            Ok(()) => return,
            Err(why) => {
                println!("VHCA-LOADER: power: {why}");
                if outcome.failure.is_some() {
                    // An IRQL rule broke first: that is the failure, whatever came of the IRP.
                    outcome.power_up_failed = false;
                }
                outcome.failure.get_or_insert(why);
                return;
            }
        }
    }
}

/// One S0→S3→S0 cycle now, on the device's started stack, from whatever the caller is doing: a user process whose
/// requests are in flight (the seed's sleep-during-traffic), as a machine sleeps whatever its programs are doing.
/// PASSIVE_LEVEL. Counted in `outcome` like a planned cycle; Err with the first rule broken or IRP failed.
pub fn sleep_and_resume_now() -> Result<(), String> {
    let k = kernel();
    let result = sleep_and_resume(&k.io, k.io.device_pdo());
    let mut outcome = crate::lock(&OUTCOME);
    match result {
        Ok(()) if outcome.failure.is_none() => {
            outcome.cycles += 1;
            Ok(())
        }
        Ok(()) => Err(outcome.failure.clone().unwrap_or_default()),
        Err(why) => Err(outcome.failure.get_or_insert(why).clone()),
    }
}

/// One S0→S3→S0 cycle as Windows' power manager sends it: the system query, the system set to S3, the system set
/// to S0. The policy owner answers each with a device IRP of its own asking (D3, D3, D0).
fn sleep_and_resume(io: &IoManager, pdo: *mut DEVICE_OBJECT) -> Result<(), String> {
    let query = system_irp(io, pdo, IRP_MN_QUERY_POWER as u8, PowerSystemSleeping3)?;
    if query < 0 {
        // A veto: Windows does not sleep. The driver has no reason to veto (nothing it holds cannot be rebuilt).
        return Err(format!("IRP_MN_QUERY_POWER S3 failed with {:#010x}: the stack vetoed the sleep", query as u32));
    }
    let asked = device_irps();
    let sleep = system_irp(io, pdo, IRP_MN_SET_POWER as u8, PowerSystemSleeping3)?;
    // "A driver cannot fail a set-power IRP for a system state" (IRP_MN_SET_POWER's page).
    if sleep < 0 {
        return Err(format!("IRP_MN_SET_POWER S3 failed with {:#010x}", sleep as u32));
    }
    expect_device_state(pdo, asked, PowerDeviceD3, "S3")?;
    let asked = device_irps();
    let resume = system_irp(io, pdo, IRP_MN_SET_POWER as u8, PowerSystemWorking)?;
    if resume < 0 {
        return Err(format!("IRP_MN_SET_POWER S0 failed with {:#010x}: the device did not power up", resume as u32));
    }
    let back = expect_device_state(pdo, asked, PowerDeviceD0, "S0");
    if back.is_err() && device_irps() > asked {
        crate::lock(&OUTCOME).power_up_failed = true;
    }
    back
}

fn device_irps() -> u32 {
    crate::lock(&OUTCOME).device_irps
}

/// After a system set-power IRP, the policy owner asked for the matching device IRP ("Handling a System Set-Power
/// IRP in a Device Power Policy Owner") and the stack reported the new state with PoSetPowerState (IRP_MN_SET_POWER
/// for device states).
fn expect_device_state(pdo: *mut DEVICE_OBJECT, asked_before: u32, state: i32, system: &str) -> Result<(), String> {
    if device_irps() == asked_before {
        return Err(format!("IRP_MN_SET_POWER {system}: the power policy owner asked for no device power IRP"));
    }
    let reported = reported_state(pdo);
    if reported != state {
        return Err(format!(
            "IRP_MN_SET_POWER {system}: the stack reported D{} with PoSetPowerState, not D{}",
            reported - 1,
            state - 1
        ));
    }
    Ok(())
}

/// The device state reported for any device object of `pdo`'s stack (the policy owner reports for its FDO).
fn reported_state(pdo: *mut DEVICE_OBJECT) -> i32 {
    let table = crate::lock(&REPORTED);
    let mut device = pdo;
    let mut state = PowerDeviceD0;
    while !device.is_null() {
        if let Some(s) = table.as_ref().and_then(|t| t.get(&(device as usize))) {
            state = *s;
        }
        // SAFETY: a live device of the stack.
        device = unsafe { (*device).AttachedDevice };
    }
    state
}

/// A system power IRP from the power manager to the top of the stack, at PASSIVE_LEVEL (the PDO is
/// DO_POWER_PAGABLE); its final status.
fn system_irp(io: &IoManager, pdo: *mut DEVICE_OBJECT, minor: u8, state: i32) -> Result<NTSTATUS, String> {
    let action = if state == PowerSystemWorking { PowerActionNone } else { PowerActionSleep };
    let done = Box::new(Done { status: Mutex::new(None) });
    let done_ptr = &*done as *const Done as *mut c_void;
    let Some(irp) = power_irp(io, pdo, minor, SystemPowerState, state, action, system_irp_done, done_ptr) else {
        return Err("out of memory for a system power IRP".into());
    };
    let name = if minor == IRP_MN_QUERY_POWER as u8 { "IRP_MN_QUERY_POWER" } else { "IRP_MN_SET_POWER" };
    send(io, pdo, irp, name)?;
    wait_completed(&done, pdo, irp)
}

/// Sends a power IRP to the top of the stack and checks the dispatch routine came back at PASSIVE_LEVEL.
fn send(io: &IoManager, pdo: *mut DEVICE_OBJECT, irp: *mut IRP, name: &str) -> Result<(), String> {
    // SAFETY: the live stack above the PDO; a power IRP with a location for its top driver.
    unsafe { irp_dispatch::call_driver(io, top_of(pdo), irp) };
    let irql = kernel().model.KeGetCurrentIrql();
    if irql != PASSIVE_LEVEL {
        return Err(format!("{name}'s dispatch returned at IRQL {irql}, called at PASSIVE_LEVEL"));
    }
    Ok(())
}

/// What the power manager's completion routine learned of an IRP it sent.
struct Done {
    status: Mutex<Option<NTSTATUS>>,
}

/// Waits for the IRP's completion (a driver may pend it and complete it from another thread); one never completed
/// is DRIVER_POWER_STATE_FAILURE 0x9F/0x3, "A device object has been blocking an IRP for too long a time"
/// (P2 the PDO, P4 the blocked IRP).
fn wait_completed(done: &Done, pdo: *mut DEVICE_OBJECT, irp: *mut IRP) -> Result<NTSTATUS, String> {
    let until = Instant::now() + POWER_IRP_TIMEOUT;
    loop {
        if let Some(status) = *crate::lock(&done.status) {
            return Ok(status);
        }
        if Instant::now() > until {
            bugcheck(DRIVER_POWER_STATE_FAILURE, 0x3, pdo as u64, 0, irp as u64);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A power IRP as the power manager allocates it: one stack location more than the stack has, the extra one its
/// own, whose completion routine sees the IRP back (and frees it) however the drivers end it.
#[allow(clippy::too_many_arguments)]
fn power_irp(
    io: &IoManager,
    pdo: *mut DEVICE_OBJECT,
    minor: u8,
    kind: i32,
    state: i32,
    action: i32,
    routine: CompletionFn,
    context: *mut c_void,
) -> Option<*mut IRP> {
    // SAFETY: the live stack above the PDO.
    let top = unsafe { top_of(pdo) };
    // SAFETY: a live device.
    let irp = io.allocate_irp(unsafe { (*top).StackSize } + 1);
    if irp.is_null() {
        return None;
    }
    // SAFETY: a fresh IRP of StackSize + 1 locations: the last becomes the power manager's (IoSetNextIrpStack-
    // Location), the one below it the top driver's, which carries the power manager's completion routine.
    unsafe {
        (*irp).CurrentLocation -= 1;
        let own = IoManager::next_stack(irp);
        (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation = own;
        (*own).MajorFunction = IRP_MJ_POWER as u8;
        (*own).MinorFunction = minor;
        let stack = IoManager::next_stack(irp);
        (*stack).MajorFunction = IRP_MJ_POWER as u8;
        (*stack).MinorFunction = minor;
        (*stack).Parameters.Power.Type = kind;
        if kind == SystemPowerState {
            (*stack).Parameters.Power.State.SystemState = state;
        } else {
            (*stack).Parameters.Power.State.DeviceState = state;
        }
        (*stack).Parameters.Power.ShutdownType = action;
        (*stack).CompletionRoutine = std::mem::transmute::<usize, PIO_COMPLETION_ROUTINE>(routine as usize);
        (*stack).Context = context;
        (*stack).Control = SL_INVOKE_ALWAYS;
        // Drivers must not rely on the preset status of a power IRP; Windows presets STATUS_NOT_SUPPORTED.
        (*irp).IoStatus.Anonymous.Status = STATUS_NOT_SUPPORTED;
    }
    Some(irp)
}

type CompletionFn = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP, *mut c_void) -> NTSTATUS;

/// The power manager's completion routine of a system power IRP: the status for `system_irp`, the IRP freed.
unsafe extern "win64" fn system_irp_done(_device: *mut DEVICE_OBJECT, irp: *mut IRP, context: *mut c_void) -> NTSTATUS {
    // SAFETY: the Done `system_irp` keeps alive until it saw the status; the IRP is the power manager's again.
    unsafe {
        *crate::lock(&(*(context as *const Done)).status) = Some((*irp).IoStatus.Anonymous.Status);
    }
    kernel().io.free_irp(irp);
    STATUS_MORE_PROCESSING_REQUIRED
}

// ---- PoRequestPowerIrp, PoSetPowerState ----

/// The driver's PowerCompletion callback (PREQUEST_POWER_COMPLETE): DeviceObject, MinorFunction, PowerState,
/// Context, IoStatus.
type PowerCompleteFn = unsafe extern "win64" fn(*mut DEVICE_OBJECT, u8, i32, *mut c_void, *mut IO_STATUS_BLOCK);

/// A device power IRP the driver asked for, until its callback ran.
struct Request {
    device: *mut DEVICE_OBJECT,
    minor: u8,
    state: i32,
    callback: Option<PowerCompleteFn>,
    context: *mut c_void,
}

/// PoRequestPowerIrp(DeviceObject, MinorFunction, PowerState, CompletionFunction, Context, Irp): a device power IRP
/// allocated and sent to the top of DeviceObject's stack; when it completes, CompletionFunction is called with its
/// status block and the IRP freed. STATUS_PENDING once sent (the page: "the IRP was sent"); a minor the page does
/// not list is STATUS_INVALID_PARAMETER_2. IRQL <= DISPATCH_LEVEL.
unsafe extern "win64" fn PoRequestPowerIrp(
    device: *mut DEVICE_OBJECT,
    minor: u8,
    state: i32,
    callback: Option<PowerCompleteFn>,
    context: *mut c_void,
    out: *mut *mut IRP,
) -> NTSTATUS {
    let k = kernel();
    above_dispatch("PoRequestPowerIrp");
    match minor {
        m if m == IRP_MN_SET_POWER as u8 || m == IRP_MN_QUERY_POWER as u8 => {}
        // Wake and power sequences are not modelled: the model's bus driver has neither.
        IRP_MN_WAIT_WAKE | IRP_MN_POWER_SEQUENCE => return STATUS_NOT_SUPPORTED,
        _ => return STATUS_INVALID_PARAMETER_2,
    }
    if !k.io.is_device(device) {
        return STATUS_INVALID_PARAMETER_2;
    }
    let request = Box::into_raw(Box::new(Request { device, minor, state, callback, context }));
    let Some(irp) =
        power_irp(&k.io, device, minor, DevicePowerState, state, PowerActionNone, device_irp_done, request.cast())
    else {
        // SAFETY: just made, never handed out.
        drop(unsafe { Box::from_raw(request) });
        return STATUS_INSUFFICIENT_RESOURCES;
    };
    crate::lock(&OUTCOME).device_irps += 1;
    if !out.is_null() {
        // SAFETY: the driver's out pointer.
        unsafe { *out = irp };
    }
    // SAFETY: the live stack `device` is in (checked above); the IRP is the stack's from here.
    unsafe { irp_dispatch::call_driver(&k.io, top_of(device), irp) };
    STATUS_PENDING
}

/// The power manager's completion routine of a device power IRP: the driver's callback with the final status, then
/// the IRP freed.
unsafe extern "win64" fn device_irp_done(_device: *mut DEVICE_OBJECT, irp: *mut IRP, context: *mut c_void) -> NTSTATUS {
    // SAFETY: the Request PoRequestPowerIrp leaked for this IRP, taken back once; the IRP is the power manager's.
    unsafe {
        let request = Box::from_raw(context as *mut Request);
        let mut status = (*irp).IoStatus;
        if let Some(callback) = request.callback {
            callback(request.device, request.minor, request.state, request.context, &mut status);
        }
    }
    kernel().io.free_irp(irp);
    STATUS_MORE_PROCESSING_REQUIRED
}

/// PoSetPowerState(DeviceObject, Type, State): records the device's new state; returns the previous one. A system
/// state is only recorded by Windows for the system's sake, so it is returned as given. IRQL <= DISPATCH_LEVEL.
unsafe extern "win64" fn PoSetPowerState(device: *mut DEVICE_OBJECT, kind: i32, state: i32) -> i32 {
    above_dispatch("PoSetPowerState");
    if kind != DevicePowerState {
        return state;
    }
    let mut table = crate::lock(&REPORTED);
    table.get_or_insert_with(HashMap::new).insert(device as usize, state).unwrap_or(PowerDeviceD0)
}

/// Both routines' pages: "IRQL <= DISPATCH_LEVEL". Windows has no bugcheck of its own for this; the model stops
/// the cycles with the broken rule named, as it ends a cycle for any other.
fn above_dispatch(routine: &str) {
    let irql = kernel().model.KeGetCurrentIrql();
    if irql > DISPATCH_LEVEL {
        let why = format!("{routine} called at IRQL {irql}, above DISPATCH_LEVEL");
        println!("VHCA-LOADER: power: {why}");
        crate::lock(&OUTCOME).failure.get_or_insert(why);
    }
}

/// The power manager's routines a driver imports (ntoskrnl.exe's).
pub fn power_thunks() -> [(&'static str, usize); 2] {
    [
        ("PoRequestPowerIrp", PoRequestPowerIrp as *const () as usize),
        ("PoSetPowerState", PoSetPowerState as *const () as usize),
    ]
}
