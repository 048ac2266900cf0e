//! I/O Verification's IRP rules (0xC9, and 0x44 in every mode) firing through the thunks a function driver calls:
//! a fake driver's dispatch routine, set in its DRIVER_OBJECT and called by IofCallDriver with the Windows x64
//! convention, breaks one rule on an IRP from IoBuildSynchronousFsdRequest. A bugcheck stops the machine and cannot
//! unwind through the driver's frames, so each case runs in a child process (this test binary again, its ignored
//! `child` test) with its verifier flags and disabled rules, as `async_thunk_rules.rs` does.

mod common;

use std::ffi::c_void;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{routine, NoBus, StopAndExit, STOPPED};
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_ntmodel::{HostDmaBackend, NtModel, NtModelConfig, RuleId, VerifierFlags};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, DRIVER_OBJECT, IO_STACK_LOCATION, IRP, KEVENT};
use windows_sys::Wdk::System::SystemServices::IRP_MJ_PNP;
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_PENDING, STATUS_SUCCESS};
use windows_sys::Win32::System::IO::IO_STATUS_BLOCK;

const CASE: &str = "VHCA_IO_VERIFICATION_CASE";
const FLAGS: &str = "VHCA_IO_VERIFICATION_FLAGS";
const DISABLE: &str = "VHCA_IO_VERIFICATION_DISABLE";
const SL_PENDING_RETURNED: u8 = 0x01;

type Dispatch = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP) -> NTSTATUS;
type CallDriver = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP) -> NTSTATUS;
type CompleteRequest = unsafe extern "win64" fn(*mut IRP, i8);
type RaiseIrql = unsafe extern "win64" fn(u8) -> u8;

fn call_driver() -> CallDriver {
    routine("IofCallDriver")
}

fn complete_request() -> CompleteRequest {
    routine("IofCompleteRequest")
}

/// The device below the fake FDO: the bus driver's PDO.
fn pdo() -> *mut DEVICE_OBJECT {
    kernel().io.device_pdo()
}

/// IoGetCurrentIrpStackLocation's Control, as wdm.h's IoMarkIrpPending sets it.
///
/// # Safety
/// A live IRP at the caller's location.
unsafe fn mark_pending(irp: *mut IRP) {
    // SAFETY: the caller's contract.
    unsafe { (*(*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation).Control |= SL_PENDING_RETURNED };
}

/// # Safety
/// A live IRP the caller holds.
unsafe fn complete(irp: *mut IRP, status: NTSTATUS) {
    // SAFETY: the caller's contract.
    unsafe {
        (*irp).IoStatus.Anonymous.Status = status;
        complete_request()(irp, 0);
    }
}

unsafe extern "win64" fn completes_twice(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the IRP the I/O manager gave this routine; completing it a second time is the case.
    unsafe {
        complete(irp, STATUS_SUCCESS);
        complete_request()(irp, 0);
    }
    STATUS_SUCCESS
}

unsafe extern "win64" fn completes_pending(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above; STATUS_PENDING is not a final status.
    unsafe { complete(irp, STATUS_PENDING) };
    STATUS_PENDING
}

unsafe extern "win64" fn completes_at_dirql(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    let raise: RaiseIrql = routine("KfRaiseIrql");
    // SAFETY: as above, at IRQL 5 (above DISPATCH_LEVEL).
    unsafe {
        raise(5);
        complete(irp, STATUS_SUCCESS);
    }
    STATUS_SUCCESS
}

unsafe extern "win64" fn calls_at_dirql(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    let raise: RaiseIrql = routine("KfRaiseIrql");
    // SAFETY: as above; the PDO below, at IRQL 5.
    unsafe {
        raise(5);
        call_driver()(pdo(), irp)
    }
}

unsafe extern "win64" fn returns_at_dispatch(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    let raise: RaiseIrql = routine("KfRaiseIrql");
    // SAFETY: as above; completed at PASSIVE_LEVEL, then left at DISPATCH_LEVEL.
    unsafe {
        complete(irp, STATUS_SUCCESS);
        raise(2);
    }
    STATUS_SUCCESS
}

unsafe extern "win64" fn pends_unmarked(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above; completed, then STATUS_PENDING returned without IoMarkIrpPending.
    unsafe { complete(irp, STATUS_SUCCESS) };
    STATUS_PENDING
}

unsafe extern "win64" fn marks_and_succeeds(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above; marked pending, completed, then STATUS_SUCCESS returned.
    unsafe {
        mark_pending(irp);
        complete(irp, STATUS_SUCCESS);
    }
    STATUS_SUCCESS
}

unsafe extern "win64" fn calls_after_completing(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above; the completed IRP sent down again.
    unsafe {
        complete(irp, STATUS_SUCCESS);
        call_driver()(pdo(), irp)
    }
}

unsafe extern "win64" fn calls_no_device(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // A device object the I/O manager never made, whose driver has no dispatch routines.
    let driver: *mut DRIVER_OBJECT = Box::into_raw(Box::new(DRIVER_OBJECT::default()));
    let mut stranger = Box::new(DEVICE_OBJECT { DriverObject: driver, ..Default::default() });
    // SAFETY: as above.
    unsafe { call_driver()(&mut *stranger, irp) }
}

/// A cancel routine, never called: the cases only leave it set.
unsafe extern "win64" fn cancel(_device: *mut DEVICE_OBJECT, _irp: *mut IRP) {}

/// # Safety
/// A live IRP the caller holds.
unsafe fn set_cancel_routine(irp: *mut IRP) {
    type Cancel = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP);
    // SAFETY: the caller's contract; IoSetCancelRoutine's store, the routine with the convention it is called with.
    unsafe {
        (*irp).CancelRoutine =
            Some(std::mem::transmute::<Cancel, unsafe extern "system" fn(*mut DEVICE_OBJECT, *mut IRP)>(cancel));
    }
}

unsafe extern "win64" fn completes_cancelable(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above; completed with its cancel routine still set.
    unsafe {
        set_cancel_routine(irp);
        complete(irp, STATUS_SUCCESS);
    }
    STATUS_SUCCESS
}

unsafe extern "win64" fn forwards_cancelable(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above; sent down with its cancel routine still set.
    unsafe {
        set_cancel_routine(irp);
        copy_to_next(irp);
        call_driver()(pdo(), irp)
    }
}

/// By the rules: marked pending, completed, STATUS_PENDING returned.
unsafe extern "win64" fn pends_by_the_rules(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above.
    unsafe {
        mark_pending(irp);
        complete(irp, STATUS_SUCCESS);
    }
    STATUS_PENDING
}

/// By the rules: down unchanged (IoSkipCurrentIrpStackLocation), the lower driver's status returned.
unsafe extern "win64" fn passes_down(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above; the skip moves the location back up by one, as the macro does.
    unsafe {
        (*irp).CurrentLocation += 1;
        let current = (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation;
        (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation = current.add(1);
        call_driver()(pdo(), irp)
    }
}

/// The middle device of `send_through_middle`'s stack, and the IRP its driver holds pending.
static MIDDLE: AtomicUsize = AtomicUsize::new(0);
static HELD: AtomicUsize = AtomicUsize::new(0);

/// IoCopyCurrentIrpStackLocationToNext: the next location as this one, without the completion routine.
///
/// # Safety
/// A live IRP at the caller's location, with one left below it.
unsafe fn copy_to_next(irp: *mut IRP) {
    // SAFETY: the caller's contract; both locations lie in the IRP's block.
    unsafe {
        let current = (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation;
        let next = current.sub(1);
        let bytes = std::mem::offset_of!(IO_STACK_LOCATION, CompletionRoutine);
        std::ptr::copy_nonoverlapping(current.cast::<u8>(), next.cast::<u8>(), bytes);
        (*next).Control = 0;
    }
}

/// The middle driver: marks the IRP pending, keeps it and returns STATUS_PENDING, as a driver that queues it does.
unsafe extern "win64" fn holds_pending(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the IRP the I/O manager gave this routine.
    unsafe { mark_pending(irp) };
    HELD.store(irp as usize, Ordering::SeqCst);
    STATUS_PENDING
}

unsafe extern "win64" fn completes_held_below(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above; the middle driver holds the IRP pending when this completes it.
    unsafe {
        copy_to_next(irp);
        let status = call_driver()(MIDDLE.load(Ordering::SeqCst) as *mut DEVICE_OBJECT, irp);
        complete(irp, STATUS_SUCCESS);
        status
    }
}

unsafe extern "win64" fn forwards_held_below(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above; the middle driver holds the IRP pending when this sends it down again.
    unsafe {
        copy_to_next(irp);
        let middle = MIDDLE.load(Ordering::SeqCst) as *mut DEVICE_OBJECT;
        call_driver()(middle, irp);
        call_driver()(middle, irp)
    }
}

/// By the rules: down with the location copied, the lower driver's STATUS_PENDING returned.
unsafe extern "win64" fn forwards_and_pends(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as above.
    unsafe {
        copy_to_next(irp);
        call_driver()(MIDDLE.load(Ordering::SeqCst) as *mut DEVICE_OBJECT, irp)
    }
}

/// `send`, with a middle driver between the FDO and the PDO that holds every IRP pending; the middle driver
/// completes the held IRP afterwards, outside any dispatch routine.
fn send_through_middle(dispatch: Dispatch) -> NTSTATUS {
    let create: Create = routine("IoCreateDevice");
    let attach: Attach = routine("IoAttachDeviceToDeviceStack");
    let driver = driver_with(holds_pending);
    let mut middle = std::ptr::null_mut();
    // SAFETY: the thunks with objects that outlive the process's one case.
    unsafe {
        assert_eq!(create(driver, 0, std::ptr::null(), 0x22, 0, 0, &mut middle), STATUS_SUCCESS);
        assert!(!attach(middle, pdo()).is_null());
    }
    MIDDLE.store(middle as usize, Ordering::SeqCst);
    let status = send(dispatch, true);
    let held = HELD.load(Ordering::SeqCst) as *mut IRP;
    assert!(!held.is_null(), "the middle driver got the IRP");
    // SAFETY: the middle driver's IRP, completed once by it.
    unsafe { complete(held, STATUS_SUCCESS) };
    status
}

type Create =
    unsafe extern "win64" fn(*mut DRIVER_OBJECT, u32, *const c_void, u32, u32, u8, *mut *mut DEVICE_OBJECT) -> NTSTATUS;
type Attach = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut DEVICE_OBJECT) -> *mut DEVICE_OBJECT;

/// A driver object whose IRP_MJ_PNP is `dispatch`, never freed.
fn driver_with(dispatch: Dispatch) -> *mut DRIVER_OBJECT {
    let driver: *mut DRIVER_OBJECT = Box::into_raw(Box::new(DRIVER_OBJECT::default()));
    // SAFETY: a fresh driver object; the routine has the Windows x64 convention the table's pointer is called with.
    unsafe {
        (*driver).MajorFunction[IRP_MJ_PNP as usize] = Some(std::mem::transmute::<
            Dispatch,
            unsafe extern "system" fn(*const DEVICE_OBJECT, *mut IRP) -> NTSTATUS,
        >(dispatch));
    }
    driver
}

/// The FDO of a driver whose IRP_MJ_PNP is `dispatch`, attached to the top of the PDO's stack, gets a PnP IRP built by
/// IoBuildSynchronousFsdRequest (with an event: the I/O manager frees it at completion; without one it stays).
fn send(dispatch: Dispatch, with_event: bool) -> NTSTATUS {
    let create: Create = routine("IoCreateDevice");
    let attach: Attach = routine("IoAttachDeviceToDeviceStack");
    let build: unsafe extern "win64" fn(
        u32,
        *mut DEVICE_OBJECT,
        *mut c_void,
        u32,
        *const i64,
        *mut KEVENT,
        *mut IO_STATUS_BLOCK,
    ) -> *mut IRP = routine("IoBuildSynchronousFsdRequest");
    let driver = driver_with(dispatch);
    let event: *mut KEVENT = Box::into_raw(Box::new(KEVENT::default()));
    let iosb: *mut IO_STATUS_BLOCK = Box::into_raw(Box::new(IO_STATUS_BLOCK::default()));
    // SAFETY: the thunks with objects that outlive the process's one case.
    unsafe {
        let mut fdo = std::ptr::null_mut();
        assert_eq!(create(driver, 0, std::ptr::null(), 0x22, 0, 0, &mut fdo), STATUS_SUCCESS);
        assert!(!attach(fdo, pdo()).is_null());
        let event = if with_event { event } else { std::ptr::null_mut() };
        let irp = build(IRP_MJ_PNP, fdo, std::ptr::null_mut(), 0, std::ptr::null(), event, iosb);
        assert!(!irp.is_null());
        call_driver()(fdo, irp)
    }
}

/// One case, in this (child) process.
fn run_case(case: &str) {
    let flags = std::env::var(FLAGS).ok().and_then(|f| VerifierFlags::parse(&f)).unwrap_or(VerifierFlags(0x10));
    let disabled_rules = std::env::var(DISABLE).ok().and_then(|r| RuleId::parse(&r)).into_iter().collect();
    let config = NtModelConfig { verifier: flags, disabled_rules, ..Default::default() };
    let model = Arc::new(NtModel::new(config, Arc::new(HostDmaBackend::default()), Arc::new(StopAndExit)));
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    let status = match case {
        "completes-twice" => send(completes_twice, true),
        "completes-twice-kept" => send(completes_twice, false),
        "completes-pending" => send(completes_pending, true),
        "completes-at-dirql" => send(completes_at_dirql, true),
        "calls-at-dirql" => send(calls_at_dirql, true),
        "returns-at-dispatch" => send(returns_at_dispatch, true),
        "pends-unmarked" => send(pends_unmarked, true),
        "marks-and-succeeds" => send(marks_and_succeeds, true),
        "calls-after-completing" => send(calls_after_completing, false),
        "calls-no-device" => send(calls_no_device, true),
        "pends-by-the-rules" => send(pends_by_the_rules, true),
        "passes-down" => send(passes_down, true),
        "completes-held-below" => send_through_middle(completes_held_below),
        "forwards-held-below" => send_through_middle(forwards_held_below),
        "forwards-and-pends" => send_through_middle(forwards_and_pends),
        "completes-cancelable" => send(completes_cancelable, true),
        "forwards-cancelable" => send(forwards_cancelable, true),
        other => panic!("no case {other}"),
    };
    println!("no bugcheck, status {:#x}", status as u32);
}

/// Not a test of its own: the parent runs it in a child process with the case in the environment.
#[test]
#[ignore]
fn child() {
    run_case(&std::env::var(CASE).expect("run by the tests below, with the case named"));
}

/// The STOP line of `case` run in a child with `flags` and `disabled` (a rule): (exit status, STOP line or stdout).
fn stop_of(case: &str, flags: &str, disabled: Option<&str>) -> (i32, String) {
    let mut child = Command::new(std::env::current_exe().unwrap());
    child
        .args(["--exact", "child", "--ignored", "--nocapture", "--test-threads", "1"])
        .env(CASE, case)
        .env(FLAGS, flags);
    if let Some(rule) = disabled {
        child.env(DISABLE, rule);
    }
    let out = child.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stop = stdout.lines().find_map(|l| l.find("*** STOP:").map(|at| l[at..].to_string())).unwrap_or_default();
    (out.status.code().unwrap_or(-1), if stop.is_empty() { stdout } else { stop })
}

/// The STOP's four parameters.
fn params(stop: &str) -> Vec<u64> {
    let inside = stop.split_once('(').and_then(|(_, p)| p.split_once(')')).map(|(p, _)| p).unwrap_or("");
    inside.split(',').filter_map(|p| u64::from_str_radix(p.trim().trim_start_matches("0x"), 16).ok()).collect()
}

/// `case` under 0x10 stops with 0xC9 and subcode `p1`; with that rule disabled it does not.
fn rule_fires(case: &str, p1: u64) -> Vec<u64> {
    let (status, stop) = stop_of(case, "0x10", None);
    assert_eq!(status, STOPPED, "{stop}");
    let expected = format!("*** STOP: 0x000000C9 (0x{p1:016X},");
    assert!(stop.starts_with(&expected), "{stop}");
    let rule = format!("0xC9/{p1:#X}");
    let (status, out) = stop_of(case, "0x10", Some(&rule));
    assert!(!out.contains(&expected), "{rule} disabled: {out}");
    assert_ne!(status, -1, "{rule} disabled: the child ended by a signal: {out}");
    params(&stop)
}

#[test]
fn an_irp_completed_twice_is_0x44_with_the_irp_freed_or_kept() {
    // Freed at its first completion (it has an event), or still the I/O manager's (no event): P1 the IRP.
    for case in ["completes-twice", "completes-twice-kept"] {
        let (status, stop) = stop_of(case, "0x10", None);
        assert_eq!(status, STOPPED, "{case}: {stop}");
        let p = params(&stop);
        assert!(stop.starts_with("*** STOP: 0x00000044 (") && p[0] != 0 && p[1..] == [0, 0, 0], "{case}: {stop}");
        let (status, out) = stop_of(case, "0x10", Some("0x44"));
        assert_eq!(status, 0, "0x44 disabled, {case}: {out}");
        assert!(out.contains("no bugcheck"), "0x44 disabled, {case}: {out}");
    }
}

#[test]
fn an_irp_completed_twice_is_0x44_without_the_verifier_too() {
    let (status, stop) = stop_of("completes-twice-kept", "0x0", None);
    assert_eq!(status, STOPPED, "{stop}");
    assert!(stop.starts_with("*** STOP: 0x00000044 ("), "{stop}");
}

#[test]
fn completing_with_status_pending_is_c9_06_with_the_status_and_the_irp() {
    let p = rule_fires("completes-pending", 0x06);
    assert_eq!(p[1], STATUS_PENDING as u32 as u64);
    assert_ne!(p[2], 0, "P3 the IRP");
    assert_eq!(p[3], 0);
}

#[test]
fn completing_above_dispatch_is_c9_0e_with_the_irql_and_the_irp() {
    let p = rule_fires("completes-at-dirql", 0x0E);
    assert_eq!(p[1], 5);
    assert_ne!(p[2], 0, "P3 the IRP");
}

#[test]
fn calling_a_driver_above_dispatch_is_c9_10_with_the_irql() {
    let p = rule_fires("calls-at-dirql", 0x10);
    assert_eq!(p[1..], [5, 0, 0]);
}

#[test]
fn a_dispatch_routine_returning_at_another_irql_is_c9_05_with_the_device_and_both_irqls() {
    let p = rule_fires("returns-at-dispatch", 0x05);
    assert_ne!(p[1], 0, "P2 the device");
    assert_eq!(p[2..], [0, 2]);
}

#[test]
fn status_pending_without_iomarkirppending_is_c9_23d() {
    let p = rule_fires("pends-unmarked", 0x23D);
    assert!(p[1] != 0 && p[2] != 0 && p[3] != 0, "the routine, the IRP, the device: {p:x?}");
}

#[test]
fn iomarkirppending_without_status_pending_is_c9_23e() {
    let p = rule_fires("marks-and-succeeds", 0x23E);
    assert!(p[1] != 0 && p[2] != 0 && p[3] != 0, "the routine, the IRP, the device: {p:x?}");
}

#[test]
fn sending_a_completed_irp_down_again_is_c9_03_with_the_irp() {
    let p = rule_fires("calls-after-completing", 0x03);
    assert!(p[1] != 0 && p[2..] == [0, 0], "{p:x?}");
}

#[test]
fn calling_a_device_the_io_manager_never_made_is_c9_04_with_the_device() {
    let p = rule_fires("calls-no-device", 0x04);
    assert!(p[1] != 0 && p[2..] == [0, 0], "{p:x?}");
}

#[test]
fn completing_an_irp_a_lower_driver_holds_pending_is_c9_209() {
    let p = rule_fires("completes-held-below", 0x209);
    assert!(p[1] != 0 && p[2] != 0 && p[3] != 0, "the routine, the IRP, the device: {p:x?}");
}

#[test]
fn sending_down_an_irp_a_lower_driver_holds_pending_is_c9_205() {
    let p = rule_fires("forwards-held-below", 0x205);
    assert!(p[1] != 0 && p[2] != 0 && p[3] != 0, "the routine, the IRP, the device: {p:x?}");
}

#[test]
fn completing_with_the_cancel_routine_set_is_c9_07_with_the_routine_and_the_irp() {
    let p = rule_fires("completes-cancelable", 0x07);
    assert!(p[1] != 0 && p[2] != 0 && p[3] == 0, "the cancel routine, the IRP, 0: {p:x?}");
}

#[test]
fn sending_down_with_the_cancel_routine_set_is_c9_203() {
    let p = rule_fires("forwards-cancelable", 0x203);
    assert!(p[1] != 0 && p[2] != 0 && p[3] != 0, "the routine, the IRP, the device: {p:x?}");
}

#[test]
fn enhanced_io_verification_alone_turns_the_checks_on() {
    let (status, stop) = stop_of("pends-unmarked", "0x40", None);
    assert_eq!(status, STOPPED, "{stop}");
    assert!(stop.starts_with("*** STOP: 0x000000C9 (0x000000000000023D,"), "{stop}");
}

#[test]
fn without_io_verification_the_c9_rules_are_silent() {
    for case in ["completes-pending", "calls-at-dirql", "returns-at-dispatch", "pends-unmarked", "marks-and-succeeds"] {
        let (status, out) = stop_of(case, "0x0", None);
        assert_eq!(status, 0, "{case}: {out}");
        assert!(out.contains("no bugcheck"), "{case}: {out}");
    }
}

#[test]
fn a_driver_that_keeps_the_rules_passes_under_io_verification() {
    let (status, out) = stop_of("pends-by-the-rules", "0x10", None);
    assert_eq!(status, 0, "{out}");
    assert!(out.contains(&format!("no bugcheck, status {:#x}", STATUS_PENDING as u32)), "{out}");
    let (status, out) = stop_of("passes-down", "0x10", None);
    assert_eq!(status, 0, "{out}");
    assert!(out.contains("no bugcheck, status 0xc00000bb"), "the bus driver's STATUS_NOT_SUPPORTED: {out}");
    // The lower driver's STATUS_PENDING passed up, the IRP completed by it later: no 0x23D, no 0x209.
    let (status, out) = stop_of("forwards-and-pends", "0x10", None);
    assert_eq!(status, 0, "{out}");
    assert!(out.contains(&format!("no bugcheck, status {:#x}", STATUS_PENDING as u32)), "{out}");
}
