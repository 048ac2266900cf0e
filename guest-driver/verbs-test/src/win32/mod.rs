//! The Win32 half: the entry point, and what the program needs of Windows with no C runtime linked.

mod console;
mod heap;
mod process;
mod runtime;

use windows_sys::Win32::System::Threading::ExitProcess;

use vhca_verbs_test::{result_line, EXIT_NO_DEVICE};

/// The image's entry (/ENTRY:mainCRTStartup): no C runtime runs before it, so nothing here assumes one did.
#[no_mangle]
pub extern "system" fn mainCRTStartup() -> ! {
    let mut process = process::Win32Process::new();
    let code = match vhca_user_verbs::rdma_write_loopback(&mut process) {
        Err(why) if process.no_device() => {
            console::line(&alloc::format!("{} failed: {why}", vhca_verbs_test::RESULT_PREFIX));
            EXIT_NO_DEVICE
        }
        outcome => {
            let (line, code) = result_line(&outcome);
            console::line(&line);
            code
        }
    };
    // The handle closed before the exit: CLEANUP and CLOSE reach vhca.sys while the process still exists.
    drop(process);
    // SAFETY: ends the process; nothing runs after it.
    unsafe { ExitProcess(code) }
}
