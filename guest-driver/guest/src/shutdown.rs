//! How the guest program ends: as PID 1 it must never exit (the kernel would panic), so it powers the machine off,
//! or hands over to a shell when asked to stay up; off PID 1 (a host test) it exits with the outcome.

use std::os::unix::process::CommandExt;
use std::time::Duration;

use crate::report::progress;

pub fn finish(poweroff: bool, ok: bool) -> ! {
    // A run's process under the resident agent, which then decides what the machine does.
    if crate::run_process::in_run_process() {
        crate::run_process::end_run(if ok { 0 } else { 1 })
    }
    // A host test.
    if std::process::id() != 1 {
        std::process::exit(if ok { 0 } else { 1 });
    }
    end_machine(poweroff)
}

/// Powers the machine off (or starts the shell `vhca.poweroff=0` asks for), from PID 1 or a run's process.
pub fn end_machine(poweroff: bool) -> ! {
    // SAFETY: sync has no preconditions; it flushes filesystem buffers before the power goes.
    unsafe { libc::sync() };
    drain_console();
    if !poweroff {
        let err = std::process::Command::new("/bin/busybox").arg("sh").exec();
        progress(format_args!("cannot start a shell: {err}"));
    }
    // SAFETY: the guest has nothing left to do (PID 1, or a run's process ending the machine); RB_POWER_OFF stops the machine and does not return on success.
    unsafe { libc::reboot(libc::RB_POWER_OFF) };
    progress(format_args!("power-off failed: {}", std::io::Error::last_os_error()));
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// Waits until the console has sent everything written to it. Power-off does not wait for the serial line: without
/// this, the end of the result line can be lost, or cut by the kernel's own "reboot: Power down".
fn drain_console() {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // SAFETY: tcdrain only waits on fd 1; on a non-terminal it fails with ENOTTY at once and changes nothing.
    unsafe { libc::tcdrain(1) };
}
