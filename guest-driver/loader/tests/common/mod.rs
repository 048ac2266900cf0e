//! What the in-process thunk tests share: a bus driver with no device, a bound routine as the driver calls it, the
//! kernel the deferred and interrupt routines' tests take turns on, and the test binary rerun as a child.

/// Not every test file runs on the shared kernel (some install their own, once or per child process).
#[allow(dead_code)]
pub mod shared_kernel;
/// Only the tests of the built vhca.sys use it.
#[allow(dead_code)]
pub mod vhca_sys_package;

use vhca_loader::io_manager::BusDriver;
use vhca_loader::nt_thunks::NtThunks;
use vhca_loader::windows_sys::Wdk::Foundation::IO_STACK_LOCATION;
use vhca_loader::windows_sys::Win32::Foundation::{NTSTATUS, STATUS_NOT_SUPPORTED};
use vhca_loader::ImportResolver;
use vhca_ntmodel::{Bugcheck, BugcheckHandler};

/// A child process's exit status after a bugcheck.
#[allow(dead_code)]
pub const STOPPED: i32 = 0x33;

/// The machine stops: the STOP lines on stdout, then the (child) process ends with `STOPPED`.
#[allow(dead_code)]
pub struct StopAndExit;

impl BugcheckHandler for StopAndExit {
    fn bugcheck(&self, bugcheck: &Bugcheck) -> ! {
        println!("{bugcheck}");
        std::process::exit(STOPPED)
    }
}

/// No device behind the PDO: every PnP IRP is not supported.
pub struct NoBus;

impl BusDriver for NoBus {
    fn pnp(&self, _stack: &IO_STACK_LOCATION) -> NTSTATUS {
        STATUS_NOT_SUPPORTED
    }
}

/// The thunk bound to ntoskrnl.exe's `name`, as the driver's IAT would hold it, typed as its Windows signature F.
pub fn routine<F: Copy>(name: &str) -> F {
    let address = NtThunks.resolve("ntoskrnl.exe", name).unwrap_or_else(|| panic!("{name} is bound"));
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<usize>());
    // SAFETY: F is the routine's extern "win64" signature, as the driver declares it.
    unsafe { std::mem::transmute_copy::<usize, F>(&address) }
}

/// This test binary run again as a child that runs only its ignored `child` test, with `case` in `case_var`: how
/// a test whose case stops the process (a bugcheck exits) sees that stop from outside.
#[allow(dead_code)]
pub fn child_of_this_test(case_var: &str, case: &str) -> std::process::Command {
    let mut child = std::process::Command::new(std::env::current_exe().expect("the test binary"));
    child.args(["--exact", "child", "--ignored", "--nocapture", "--test-threads", "1"]).env(case_var, case);
    child
}
