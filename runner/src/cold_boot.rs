//! The cold-boot step of one run: QEMU spawned to boot the Linux guest, whose run options are on its kernel command
//! line, or a Windows run's image, whose resident agent then gets the request typed on COM1.

use std::time::Duration;

use vhca_suite::ConcreteRun;

use crate::qemu_cmd::QemuConfig;
use crate::qmp::Qmp;
use crate::run_files::RunFiles;
use crate::run_progress::Progress;
use crate::serial_capture::ConsolePort;
use crate::supervise::{SuperviseError, Supervised};
use crate::windows_guest::machine::WindowsMachine;
use crate::windows_guest::run_boot;

/// How the boot came out.
pub enum Booted {
    /// QEMU runs the guest; QMP and the console when the boot already connected them (a Windows guest's).
    Started(Supervised, Option<Qmp>, Option<ConsolePort>),
    /// The guest never got its request (a Windows agent that never came up): nothing to watch. `timed_out`: it was
    /// waited for until the run's timeout.
    NoRequest { qemu: Supervised, why: String, timed_out: bool },
}

/// Spawns QEMU to boot the run's guest: `qemu` for Linux, or `windows`' own machine (always cold: no snapshot path
/// for Windows yet), which then gets `request` on COM1. Err only for the runner's own trouble.
pub fn boot(
    qemu: &QemuConfig,
    windows: Option<&WindowsMachine>,
    files: &RunFiles,
    run: &ConcreteRun,
    request: &str,
    on: &mut dyn FnMut(Progress),
) -> Result<Booted, SuperviseError> {
    let command = windows.map_or_else(|| qemu.command(), |m| m.command());
    let mut qemu = Supervised::spawn("qemu", command, Some(&files.qemu_log()))?;
    let Some(m) = windows else { return Ok(Booted::Started(qemu, None, None)) };
    on(Progress::Stage { run: run.name.clone(), what: "waiting for the Windows agent on COM1".into() });
    let boot = Duration::from_secs(u64::from(run.guest.timeout_s));
    let (why, timed_out) = match run_boot::deliver_request(m, &files.serial(), &mut qemu, request, boot) {
        Ok((qmp, port)) => return Ok(Booted::Started(qemu, Some(qmp), Some(port))),
        Err(run_boot::RequestError::Process(e)) => return Err(e),
        Err(run_boot::RequestError::NoAgent(s)) => {
            (format!("the Windows agent never said it was ready in {s} s"), true)
        }
        Err(why) => (why.to_string(), false),
    };
    Ok(Booted::NoRequest { qemu, why, timed_out })
}
