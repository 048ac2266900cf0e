//! One run's Windows guest: a throwaway overlay on the boot state for the run's verifier flags, its own firmware
//! variables, the HCA on the command line (cold boot: Windows supports PCI hot-plug, but a snapshot of a running
//! Windows guest restored with the HCA hot-plugged has never been tried, so it is not offered), then the run's request
//! typed on COM1 once the resident agent says it is ready. Never run against Windows here (no image on these machines).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::image_dir::{WindowsImage, OVMF_VARS};
use super::machine::{KdnetNic, WindowsMachine, KDNET_MAC};
use super::recipe::qemu_img_overlay;
use crate::qemu_cmd::{Accel, GdbStub, VhostUserDevice};
use crate::qmp::Qmp;
use crate::serial_capture::{ConsolePort, SerialLog};
use crate::snapshot::READY_LINE;
use crate::supervise::{tick, SuperviseError, Supervised};

/// After GUEST_PANICKED Windows writes its dump and reboots (which ends QEMU); a small dump takes seconds, a loaded
/// host more.
pub const DUMP_GRACE: Duration = Duration::from_secs(180);
/// The run's disk in its work dir; kept in the artifacts only after a bugcheck (the dump is on it).
pub const RUN_DISK: &str = "disk.qcow2";
pub const CRASH_DISK: &str = "disk-after-bugcheck.qcow2";

/// Creates the run's overlay and firmware variables in `dir` and describes the machine; `(gdb, paused)` for debugging.
pub fn prepare(
    image: &WindowsImage,
    qemu: &Path,
    accel: Accel,
    verifier_flags: u32,
    hca: VhostUserDevice,
    dir: &Path,
    (gdb, paused): (Option<GdbStub>, bool),
) -> Result<WindowsMachine, String> {
    let state = image.state(verifier_flags).map_err(|e| e.to_string())?;
    // The backing file by absolute path: the overlay lives in a temp dir, and maybe later in the artifacts.
    let state = std::fs::canonicalize(&state).unwrap_or(state);
    let disk = dir.join(RUN_DISK);
    let out = Command::new("qemu-img")
        .args(qemu_img_overlay(&state.display().to_string(), &disk))
        .output()
        .map_err(|e| format!("qemu-img: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "qemu-img overlay on {}: {}",
            state.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let vars = match image.ovmf_vars() {
        Some(template) => {
            let copy = dir.join(OVMF_VARS);
            std::fs::copy(&template, &copy).map_err(|e| format!("{}: {e}", template.display()))?;
            Some(copy)
        }
        None => None,
    };
    Ok(WindowsMachine {
        qemu: qemu.to_path_buf(),
        accel,
        firmware: image.meta.firmware,
        ovmf_vars: vars,
        disk,
        cdroms: Vec::new(),
        device: Some(hca),
        nic: Some(KdnetNic { mac: KDNET_MAC.into() }),
        serial_socket: dir.join("serial.sock"),
        qmp_socket: dir.join("qmp.sock"),
        gdb,
        paused,
        end_at_reboot: true,
        vnc: None,
    })
}

/// Why the guest never got its request.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Process(#[from] SuperviseError),
    #[error("{0}")]
    Failed(String),
    #[error("the Windows agent did not say {READY_LINE} within {0} s")]
    NoAgent(u64),
}

/// Connects to COM1 and QMP, continues a paused machine once the person presses Enter, waits for the agent and types
/// the request. `timeout` bounds the boot from there.
pub fn deliver_request(
    machine: &WindowsMachine,
    serial_log: &Path,
    qemu: &mut Supervised,
    request: &str,
    timeout: Duration,
) -> Result<(Qmp, ConsolePort), RequestError> {
    let failed = |what: &str, e: &dyn std::fmt::Display| RequestError::Failed(format!("{what}: {e}"));
    let mut port = ConsolePort::connect(&machine.serial_socket, serial_log, Duration::from_secs(10))
        .map_err(|e| failed("console", &e))?;
    let mut qmp = Qmp::connect(&machine.qmp_socket, Duration::from_secs(10)).map_err(|e| failed("QMP", &e))?;
    if machine.paused {
        // `vhca-run debug` printed what to type; the person attaches WinDbg (or the EXDI client), then says go.
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        qmp.execute("cont", None, Duration::from_secs(10)).map_err(|e| failed("QMP cont", &e))?;
    }
    let mut serial = SerialLog::new(serial_log);
    let start = Instant::now();
    loop {
        if serial.poll().unwrap_or_default().iter().any(|l| l.contains(READY_LINE)) {
            port.send_line(request).map_err(|e| failed("typing the request on COM1", &e))?;
            return Ok((qmp, port));
        }
        if let Some(status) = qemu.try_status()? {
            return Err(RequestError::Failed(format!("QEMU ended ({status}) before the Windows agent was ready")));
        }
        if start.elapsed() >= timeout {
            return Err(RequestError::NoAgent(timeout.as_secs()));
        }
        tick()?;
    }
}

/// After the run: the overlay goes unless the guest bugchecked, when it is what holds the dump (renamed so the
/// artifacts say why it is there).
pub fn keep_disk_if_crashed(dir: &Path, crashed: bool) -> Option<PathBuf> {
    let disk = dir.join(RUN_DISK);
    if crashed {
        let kept = dir.join(CRASH_DISK);
        std::fs::rename(&disk, &kept).ok().map(|_| kept)
    } else {
        let _ = std::fs::remove_file(&disk);
        None
    }
}
