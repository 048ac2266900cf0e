//! 0xB8 ATTEMPTED_SWITCH_FROM_DPC as a driver binary meets it through the Windows ABI thunks: its DPC, registered
//! with KeInitializeDpc, waits (KeWaitForSingleObject) or delays (KeDelayExecutionThread) and the kernel stops.
//!
//! A bugcheck in a thunk cannot unwind through the driver's frames, so each stop runs in a child process (this
//! binary again, its ignored `child` test) whose handler is the model's PrintAndExit: the STOP line on stderr, exit.

mod common;

use std::ffi::c_void;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::shared_kernel::resident;
use common::{routine, NoBus};
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_ntmodel::{
    BugcheckHandler, CaptureBugchecks, ClockSource, HostDmaBackend, NtModel, NtModelConfig, PrintAndExit, TimingConfig,
    VerifierFlags,
};
use windows_sys::Wdk::Foundation::{KDPC, KEVENT};
use windows_sys::Win32::Foundation::NTSTATUS;

type Deferred = unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void, *mut c_void);
type InitDpc = unsafe extern "win64" fn(*mut KDPC, Deferred, *mut c_void);
type InsertDpc = unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void) -> u8;
type Wait = unsafe extern "win64" fn(*mut c_void, u32, i8, u8, *const i64) -> NTSTATUS;
type Delay = unsafe extern "win64" fn(i8, u8, *const i64) -> NTSTATUS;

const CASE: &str = "VHCA_LOADER_SWITCH_CASE";
/// PrintAndExit's exit status.
const STOPPED: i32 = 0xE6;
/// What a child prints before its DPC calls the kernel: an address on the DPC's stack (0xB8's P3 lies near it).
const DPC_STACK: &str = "dpc stack ";
/// 10 ms, relative, in 100 ns units.
const TEN_MS: i64 = -100_000;

/// The kernel for this process on a manual clock (nothing in a case waits for time to pass).
fn install_kernel(verifier: VerifierFlags, handler: Arc<dyn BugcheckHandler>) {
    let config = NtModelConfig { verifier, ..Default::default() };
    let model = NtModel::new(config, Arc::new(HostDmaBackend::default()), handler)
        .with_timing(TimingConfig { clock: ClockSource::Manual, ..Default::default() });
    assert!(install(LoaderKernel::new(Arc::new(model), IoManager::new(Box::new(NoBus)))));
}

fn note_dpc_stack() {
    let here = 0u8;
    println!("{DPC_STACK}{:#x}", std::ptr::addr_of!(here) as usize);
}

/// The driver's DPC waits 10 ms for the event in its DeferredContext, which nothing sets.
unsafe extern "win64" fn waiting_dpc(_dpc: *mut KDPC, context: *mut c_void, _a1: *mut c_void, _a2: *mut c_void) {
    note_dpc_stack();
    let wait: Wait = routine("KeWaitForSingleObject");
    // SAFETY: the thunk, at the DPC's DISPATCH_LEVEL, on the caller's KEVENT: the bug under test.
    unsafe { wait(context, 0, 0, 0, &TEN_MS) };
}

/// The driver's DPC delays 10 ms, as a register poll that sleeps between reads would.
unsafe extern "win64" fn delaying_dpc(_dpc: *mut KDPC, _context: *mut c_void, _a1: *mut c_void, _a2: *mut c_void) {
    note_dpc_stack();
    let delay: Delay = routine("KeDelayExecutionThread");
    // SAFETY: the thunk, at the DPC's DISPATCH_LEVEL, kernel mode, not alertable: the bug under test.
    unsafe { delay(0, 0, &TEN_MS) };
}

/// Registers `routine` with context through KeInitializeDpc and queues it at PASSIVE_LEVEL: it runs at once.
fn run_dpc(routine_of_driver: Deferred, context: *mut c_void) {
    let (init, insert): (InitDpc, InsertDpc) = (routine("KeInitializeDpc"), routine("KeInsertQueueDpc"));
    let dpc = resident::<KDPC>();
    // SAFETY: the thunks with the caller's resident KDPC and its routine.
    unsafe {
        init(dpc, routine_of_driver, context);
        insert(dpc, std::ptr::null_mut(), std::ptr::null_mut());
    }
}

/// One case, in this (child) process.
fn run_case(case: &str) {
    let irql_checked = case.ends_with("-irql-checked");
    let flags = if irql_checked { VerifierFlags::IRQL_CHECKING } else { VerifierFlags::NONE };
    install_kernel(flags, Arc::new(PrintAndExit));
    match case.trim_end_matches("-irql-checked") {
        "wait-in-dpc" => {
            let event = resident::<KEVENT>();
            let init: unsafe extern "win64" fn(*mut KEVENT, u32, u8) = routine("KeInitializeEvent");
            // SAFETY: the thunk with the caller's KEVENT: a notification event, not signaled.
            unsafe { init(event, 0, 0) };
            run_dpc(waiting_dpc, event.cast());
        }
        "delay-in-dpc" => run_dpc(delaying_dpc, std::ptr::null_mut()),
        other => panic!("no case {other}"),
    }
    println!("no bugcheck");
}

/// Not a test of its own: the tests below run it in a child process with the case in the environment.
#[test]
#[ignore]
fn child() {
    run_case(&std::env::var(CASE).expect("run by the tests below, with the case named"));
}

/// What `case` run in a child stopped with: its exit status, the STOP line's four parameters (empty if none), the
/// DPC's stack address it noted, and everything it printed (for the failure message).
struct Stopped {
    status: i32,
    code: u32,
    params: Vec<u64>,
    dpc_stack: u64,
    output: String,
}

/// A child whose DPC blocks (the rule gone, on a manual clock) would never end: killed after 10 s, the test fails.
fn stop_of(case: &str) -> Stopped {
    let mut child =
        common::child_of_this_test(CASE, case).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{case}: no stop in 10 s, the DPC blocked");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let hex = |s: &str| u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).unwrap_or(u64::MAX);
    // `*** STOP: 0x000000B8 (0x…,0x…,0x…,0x…)`
    let stop = output.lines().find_map(|l| l.split_once("*** STOP: ").map(|(_, s)| s.to_string()));
    let (code, params) = stop
        .and_then(|s| {
            let (code, rest) = s.split_once(" (")?;
            Some((hex(code) as u32, rest.trim_end_matches(')').split(',').map(hex).collect()))
        })
        .unwrap_or((0, Vec::new()));
    // The harness prints "test child ... " before the child's first line.
    let dpc_stack = output.lines().find_map(|l| l.split_once(DPC_STACK).map(|(_, a)| hex(a))).unwrap_or(0);
    Stopped { status: out.status.code().unwrap_or(-1), code, params, dpc_stack, output }
}

/// The model's thread stand-ins (ETHREAD addresses): 0xFFFFB000'00000000 up.
fn is_thread(p: u64) -> bool {
    (0xFFFF_B000_0000_0000..0xFFFF_C000_0000_0000).contains(&p)
}

/// 0xB8 with P1 and P2 two thread stand-ins (the thread the DPC borrowed, the idle thread), P3 on the DPC's stack
/// (the wait runs on it), P4 0.
fn assert_switch_from_dpc(s: &Stopped) {
    assert_eq!((s.status, s.code, s.params.len()), (STOPPED, 0xB8, 4), "{}", s.output);
    let [original, new, stack, reserved] = s.params[..] else { unreachable!() };
    assert!(is_thread(original) && is_thread(new) && original != new, "P1, P2: {}", s.output);
    assert!(s.dpc_stack != 0 && stack.abs_diff(s.dpc_stack) < 64 * 1024, "P3 off the DPC's stack: {}", s.output);
    assert_eq!(reserved, 0, "{}", s.output);
}

#[test]
fn the_drivers_dpc_whose_wait_would_block_is_b8_without_the_verifier() {
    assert_switch_from_dpc(&stop_of("wait-in-dpc"));
}

#[test]
fn the_drivers_dpc_that_delays_is_b8_without_the_verifier() {
    assert_switch_from_dpc(&stop_of("delay-in-dpc"));
}

#[test]
fn irql_checking_stops_the_drivers_dpc_first_c4_122_for_the_wait_and_c4_e5_for_the_delay() {
    for (case, subcode, p4) in
        [("wait-in-dpc-irql-checked", 0x122, TEN_MS as u64), ("delay-in-dpc-irql-checked", 0xE5, 0)]
    {
        let s = stop_of(case);
        assert_eq!((s.status, s.code), (STOPPED, 0xC4), "{case}: {}", s.output);
        assert_eq!((s.params[0], s.params[1], s.params[3]), (subcode, 2, p4), "{case}: {}", s.output);
    }
}

/// In this (parent) process: the delay thunk waits on the model's clock, which only the test moves, so a host
/// sleep would have returned long before.
#[test]
fn the_delay_thunk_at_passive_waits_on_the_models_clock() {
    install_kernel(VerifierFlags::IRQL_CHECKING, Arc::new(CaptureBugchecks));
    let sleeper = std::thread::spawn(|| {
        let delay: Delay = routine("KeDelayExecutionThread");
        // SAFETY: the thunk at PASSIVE_LEVEL, kernel mode, not alertable.
        unsafe { delay(0, 0, &TEN_MS) }
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(!sleeper.is_finished(), "the model's clock has not moved");
    kernel().model.advance_clock(Duration::from_millis(10));
    assert_eq!(sleeper.join().unwrap(), 0, "STATUS_SUCCESS");
    assert!(kernel().model.bugchecks().is_empty());
}
