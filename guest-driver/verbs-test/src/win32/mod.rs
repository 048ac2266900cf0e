//! The Win32 half: the entry point, and what the program needs of Windows with no C runtime linked.

mod agent_events;
mod console;
mod heap;
mod process;
mod runtime;

use core::fmt::Display;

use alloc::string::String;
use windows_sys::Win32::System::Environment::GetCommandLineW;
use windows_sys::Win32::System::Threading::ExitProcess;

use vhca_verbs_test::{mode_of, result_line, Mode, EXIT_FAILED, EXIT_NO_DEVICE, RESULT_PREFIX};

/// The command line GetCommandLineW gives, up to its NUL.
fn command_line() -> &'static [u16] {
    // SAFETY: the process's own command line, NUL-terminated and alive as long as the process.
    unsafe {
        let line = GetCommandLineW();
        if line.is_null() {
            return &[];
        }
        let mut len = 0;
        while *line.add(len) != 0 {
            len += 1;
        }
        core::slice::from_raw_parts(line, len)
    }
}

/// The outcome's line on the console, and its exit code (no vhca interface: EXIT_NO_DEVICE).
fn report(process: &process::Win32Process, outcome: Result<impl Display, String>) -> u32 {
    match outcome {
        Err(why) if process.no_device() => {
            console::line(&alloc::format!("{RESULT_PREFIX} failed: {why}"));
            EXIT_NO_DEVICE
        }
        outcome => {
            let (line, code) = result_line(&outcome);
            console::line(&line);
            code
        }
    }
}

/// The image's entry (/ENTRY:mainCRTStartup): no C runtime runs before it, so nothing here assumes one did.
#[no_mangle]
pub extern "system" fn mainCRTStartup() -> ! {
    let mode = mode_of(command_line());
    let mut process = process::Win32Process::new(mode.as_ref().is_ok_and(|m| m.overlapped()));
    let code = match mode {
        Ok(Mode::Loopback) => {
            let outcome = vhca_user_verbs::rdma_write_loopback(&mut process);
            report(&process, outcome)
        }
        Ok(Mode::WaitCancel) => {
            let outcome = vhca_user_verbs::wait_cancel(&mut process);
            report(&process, outcome)
        }
        Ok(Mode::HeldWrite) => {
            // The agent sleeps the machine while the write is in flight; the resume is a reset of the device.
            let outcome = vhca_user_verbs::write_in_flight_then(&mut process, "the machine sleeps", |_| {
                agent_events::in_flight_until_resumed().map(|()| true)
            });
            report(&process, outcome)
        }
        Ok(Mode::WaitDestroy) => {
            let outcome = vhca_user_verbs::wait_on_destroyed_cq(&mut process)
                .map(|()| "a pending WAIT_CQ ended STATUS_CANCELLED by DESTROY_CQ of its CQ");
            report(&process, outcome)
        }
        Err(why) => {
            console::line(&alloc::format!("{RESULT_PREFIX} failed: {why}"));
            EXIT_FAILED
        }
    };
    // The handle closed before the exit: CLEANUP and CLOSE reach vhca.sys while the process still exists.
    drop(process);
    // SAFETY: ends the process; nothing runs after it.
    unsafe { ExitProcess(code) }
}
