//! Making a snapshot: boot the machine to its resident agent, stop it and save it with QEMU's mapped-ram migration.

use std::fs;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use super::{MachineFiles, SavedMachine, READY_LINE, STATE_FILE};
use crate::qmp::{Qmp, QmpError};
use crate::serial_capture::{ConsolePort, SerialLog};
use crate::supervise::{tick, SuperviseError, Supervised};

/// A cold boot takes about 5 s under TCG; a loaded machine takes longer.
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
const SAVE_TIMEOUT: Duration = Duration::from_secs(120);
const QMP_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub(super) enum BuildError {
    #[error(transparent)]
    Process(#[from] SuperviseError),
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error("{0}")]
    Failed(String),
}

/// Boots the machine, waits for the agent, stops the guest and saves it to `work/state.img`.
pub(super) fn build(machine: &SavedMachine, work: &Path) -> Result<(), BuildError> {
    let files = MachineFiles::in_dir(work);
    let config = machine.config(&files, false);
    fs::write(work.join("qemu.cmdline"), crate::qemu_cmd::shell_line(&config.qemu, &config.args()) + "\n")?;
    let mut qemu = Supervised::spawn("qemu (snapshot build)", config.command(), Some(&work.join("qemu.log")))?;
    let _port = ConsolePort::connect(&files.serial_socket, &files.serial_log, QMP_TIMEOUT)?;
    let mut qmp = Qmp::connect(&files.qmp_socket, QMP_TIMEOUT)?;
    let mut serial = SerialLog::new(&files.serial_log);
    let booted = Instant::now();
    loop {
        if serial.poll()?.iter().any(|l| l.contains(READY_LINE)) {
            break;
        }
        if let Some(status) = qemu.try_status()? {
            return Err(BuildError::Failed(format!("QEMU ended ({status}) before the guest agent was ready")));
        }
        if booted.elapsed() >= BOOT_TIMEOUT {
            return Err(BuildError::Failed(format!("no {READY_LINE} within {} s", BOOT_TIMEOUT.as_secs())));
        }
        tick()?;
    }
    qmp.execute("stop", None, QMP_TIMEOUT)?;
    qmp.execute("migrate-set-capabilities", Some(capabilities()), QMP_TIMEOUT)?;
    let uri = format!("file:{}", work.join(STATE_FILE).display());
    qmp.execute("migrate", Some(json!({ "uri": uri })), QMP_TIMEOUT)?;
    wait_migration(&mut qmp, &mut qemu, SAVE_TIMEOUT)?;
    qmp.execute("quit", None, QMP_TIMEOUT)?;
    if qemu.wait_timeout(QMP_TIMEOUT)?.is_none() {
        qemu.kill();
    }
    Ok(())
}

/// The migration capabilities of both the save and every restore: mapped-ram puts each RAM page at a fixed offset of
/// the file (zero pages stay holes), so a restore reads only what the guest used.
pub fn capabilities() -> serde_json::Value {
    json!({ "capabilities": [
        { "capability": "events", "state": true },
        { "capability": "mapped-ram", "state": true },
    ] })
}

/// Polls `query-migrate` until the migration completes. Errors name QEMU's reason.
fn wait_migration(qmp: &mut Qmp, qemu: &mut Supervised, timeout: Duration) -> Result<(), BuildError> {
    let end = Instant::now() + timeout;
    loop {
        let status = qmp.execute("query-migrate", None, QMP_TIMEOUT)?;
        match status.get("status").and_then(|s| s.as_str()) {
            Some("completed") => return Ok(()),
            Some("failed") | Some("cancelled") => {
                let why = status.get("error-desc").and_then(|s| s.as_str()).unwrap_or("no reason given");
                return Err(BuildError::Failed(format!("migration failed: {why}")));
            }
            _ => {}
        }
        if let Some(status) = qemu.try_status()? {
            return Err(BuildError::Failed(format!("QEMU ended ({status}) during the save")));
        }
        if Instant::now() >= end {
            return Err(BuildError::Failed(format!("the save took more than {} s", timeout.as_secs())));
        }
        tick()?;
    }
}

/// The last lines of the build's console and QEMU log, for a failed build's message.
pub(super) fn logs_tail(work: &Path) -> String {
    let mut out = String::new();
    for (name, file) in [("console", "serial.log"), ("QEMU", "qemu.log")] {
        let text = fs::read_to_string(work.join(file)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if !lines.is_empty() {
            out.push_str(&format!("\n  {name}:\n    {}", lines[lines.len().saturating_sub(8)..].join("\n    ")));
        }
    }
    out
}
