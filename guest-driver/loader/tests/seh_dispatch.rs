//! Structured exceptions through a driver image's .pdata/.xdata: a raise inside __try reaches its __except and the
//! function returns the code; a __finally in a callee runs on the unwind to its caller's __except; an access
//! violation in driver code is handed to the same dispatch; a filter that declines, or no handler, is still 0x7E
//! with the code and the raise point, and a filter that continues a raised (noncontinuable) status is 0x7E 0xC0000025. The image is a hand-assembled PE laid out as clang builds one
//! (tests/support/seh_fixture.rs). A bugcheck ends the process, and the fault handler is one per process, so each
//! case runs in a child process (this test binary again, its ignored `child` test).

mod common;

use std::sync::Arc;

use common::{child_of_this_test, NoBus};
use vhca_loader::driver_symbols::DriverSymbols;
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, LoaderKernel};
use vhca_loader::nt_thunks::NtThunks;
use vhca_ntmodel::{Bugcheck, BugcheckHandler, HostDmaBackend, NtModel, NtModelConfig};

#[path = "support/seh_fixture.rs"]
mod seh_fixture;

use seh_fixture::{fixture, CONTINUED, COUNTER, FAULTING, FILTERED, GUARDED, OUTER, UNGUARDED, UNGUARDED_RETURN};

const CASE: &str = "VHCA_LOADER_SEH_CASE";
const STOPPED: i32 = 0x33;
const STATUS_INSUFFICIENT_RESOURCES: u32 = 0xC000_009A;

struct StopAndExit;

impl BugcheckHandler for StopAndExit {
    fn bugcheck(&self, bugcheck: &Bugcheck) -> ! {
        println!("STOP {:#x} {:#x} {:#x}", bugcheck.code, bugcheck.params[0], bugcheck.params[1]);
        std::process::exit(STOPPED)
    }
}

fn run_case(case: &str) {
    let model =
        Arc::new(NtModel::new(NtModelConfig::default(), Arc::new(HostDmaBackend::default()), Arc::new(StopAndExit)));
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    let image = vhca_loader::load(&fixture(), &NtThunks).expect("the fixture loads");
    vhca_loader::driver_stack::register(&image, "seh.sys");
    vhca_loader::driver_fault::install(image.base(), image.size(), "seh.sys", DriverSymbols::entry_only(0));
    println!("BASE {:#x}", image.base());
    type Routine = unsafe extern "win64" fn(u32) -> u32;
    // SAFETY: the fixture's functions take one integer and return one, Windows x64 convention.
    let call = |rva: u32, status: u32| unsafe { std::mem::transmute::<usize, Routine>(image.at(rva))(status) };
    let returned = match case {
        "guarded" => call(GUARDED, STATUS_INSUFFICIENT_RESOURCES),
        "finally" => call(OUTER, STATUS_INSUFFICIENT_RESOURCES),
        "fault" => call(FAULTING, 0),
        "filtered" => call(FILTERED, STATUS_INSUFFICIENT_RESOURCES),
        "unguarded" => call(UNGUARDED, STATUS_INSUFFICIENT_RESOURCES),
        "continued" => call(CONTINUED, STATUS_INSUFFICIENT_RESOURCES),
        other => panic!("no case {other}"),
    };
    // SAFETY: the image's .data, mapped read-write.
    let counter = unsafe { (image.at(COUNTER) as *const u32).read_volatile() };
    println!("RETURNED {returned:#x} FINALLY {counter}");
}

#[test]
#[ignore = "run by the tests below as a child process"]
fn child() {
    run_case(&std::env::var(CASE).expect("the case to run"));
}

/// The child's output and exit code.
fn case(name: &str) -> (String, Option<i32>) {
    let out = child_of_this_test(CASE, name).output().expect("the child runs");
    (String::from_utf8_lossy(&out.stdout).into_owned(), out.status.code())
}

fn base(out: &str) -> u64 {
    // The harness's "test child ... " may precede it on the line.
    let line = out.lines().find_map(|l| l.split_once("BASE 0x").map(|(_, b)| b)).expect("the child printed its base");
    u64::from_str_radix(line.trim(), 16).expect("hex")
}

#[test]
fn a_raise_inside_try_resumes_at_its_except_with_the_code() {
    let (out, code) = case("guarded");
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("RETURNED 0xc000009a FINALLY 0"), "{out}");
}

#[test]
fn a_finally_in_a_callee_runs_on_the_unwind_to_the_callers_except() {
    let (out, code) = case("finally");
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("RETURNED 0xc000009a FINALLY 1"), "{out}");
}

#[test]
fn an_access_violation_in_driver_code_reaches_its_except() {
    let (out, code) = case("fault");
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("RETURNED 0xc0000005"), "{out}");
}

#[test]
fn a_declining_filter_or_no_handler_is_still_0x7e_at_the_raise_point() {
    for name in ["filtered", "unguarded"] {
        let (out, code) = case(name);
        assert_eq!(code, Some(STOPPED), "{name}: {out}");
        assert!(out.contains("STOP 0x7e 0xc000009a"), "{name}: {out}");
        assert!(!out.contains("RETURNED"), "{name}: {out}");
    }
    let (out, _) = case("unguarded");
    let raise_point = base(&out) + u64::from(UNGUARDED_RETURN);
    assert!(out.contains(&format!("STOP 0x7e 0xc000009a {raise_point:#x}")), "{out}");
}

#[test]
fn continuing_a_raised_status_is_0x7e_noncontinuable() {
    let (out, code) = case("continued");
    assert_eq!(code, Some(STOPPED), "{out}");
    // STATUS_NONCONTINUABLE_EXCEPTION: a filter may not continue what RtlRaiseStatus raised.
    assert!(out.contains("STOP 0x7e 0xc0000025"), "{out}");
}
