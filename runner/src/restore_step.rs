//! The restore step of one run: it takes its worker's guest (loaded ahead, or reused), hot-plugs the run's HCA and
//! continues it with the request, and sorts a failure into "boot cold instead" or "the device died: the verdict".

use std::fs;
use std::time::{Duration, Instant};

use crate::child_wait::{exit_of, pause};
use crate::load_ahead::{GuestHome, Loaded};
use crate::next_guest::Taken;
use crate::phase_hook::Pids;
use crate::qemu_cmd::VhostUserDevice;
use crate::restore::{self, RestoreError, Timings};
use crate::run_files::RunFiles;
use crate::snapshot::Snapshot;
use crate::supervise::{SuperviseError, Supervised};

/// How a restore ended.
pub enum Restored {
    /// The guest runs the request: with its home, the runs it served before, and its QEMU log's length before it.
    Continued(Box<Loaded>, GuestHome, u32, u64),
    /// It failed before the guest ran anything, the device still up or gone with QEMU: the run can boot cold.
    Fallback(RestoreError),
    /// The device died while QEMU lived: the run's own verdict.
    DeviceDied(std::process::ExitStatus, RestoreError),
}

/// How long a failed hot-plug waits to see whether QEMU or the device died under it (a socket closes a moment before
/// the kernel has its process reaped); spent only on a restore that failed.
const DIED_UNDER_RESTORE: Duration = Duration::from_millis(500);
/// Once the device is seen gone: QEMU dying first (the device then leaves because QEMU hung up) shows within this.
const QEMU_BEFORE_DEVICE: Duration = Duration::from_millis(200);

/// Takes the loaded guest, hot-plugs the HCA and continues it with the run's request; the step timings go to the
/// run's files. Err only for the runner's own trouble (an interrupt).
pub fn continue_restored(
    files: &RunFiles,
    guest: Taken,
    snapshot: &Snapshot,
    hca: &VhostUserDevice,
    request: &str,
    device_started: Instant,
    device: &mut Supervised,
) -> Result<Restored, SuperviseError> {
    let (mut loaded, home, served, mut timings) = match guest {
        Taken::Loading(loading, home) => {
            let waiting = Instant::now();
            let loaded = match loading.ready() {
                Ok(loaded) => loaded,
                Err(RestoreError::Process(e)) => return Err(e),
                // A QEMU that died while it loaded (its own restore's, or the one loaded ahead) never reached the
                // device.
                Err(why) => return Ok(Restored::Fallback(why)),
            };
            let mut timings = loaded.timings.clone();
            timings.steps.push(("waited for the load (0 when loaded ahead)", waiting.elapsed().as_secs_f64()));
            (loaded, home, 0, timings)
        }
        Taken::Ready(ready) => {
            let (loaded, home, served) = ready.into_parts();
            (loaded, home, served, Timings::default())
        }
    };
    let qemu_log = home.work.path().join("qemu.log");
    let log_from = fs::metadata(&qemu_log).map(|m| m.len()).unwrap_or(0);
    if let Err(e) = loaded.port.log_to(&files.serial()) {
        let why = format!("console log {}: {e}", files.serial().display());
        return Ok(Restored::Fallback(RestoreError::Failed { step: "console", why, snapshot_bad: false }));
    }
    let pids = Pids { qemu: Some(loaded.qemu.pid()), device: Some(device.pid()) };
    match restore::plug_and_continue(&mut loaded.qmp, &mut loaded.port, hca, request, pids, served == 0) {
        Ok(plugged) => timings.steps.extend(plugged.steps),
        Err(RestoreError::Process(e)) => return Err(e),
        Err(RestoreError::Failed { step, why, snapshot_bad }) => {
            let failed = |why: String| RestoreError::Failed { step, why, snapshot_bad };
            let end = Instant::now() + DIED_UNDER_RESTORE;
            while Instant::now() < end {
                if let Some(status) = loaded.qemu.try_status()? {
                    return Ok(Restored::Fallback(failed(format!("{why}; QEMU {}", exit_of(status).describe()))));
                }
                if let Some(status) = device.try_status()? {
                    return Ok(match loaded.qemu.wait_timeout(QEMU_BEFORE_DEVICE)? {
                        Some(q) => Restored::Fallback(failed(format!("{why}; QEMU {}", exit_of(q).describe()))),
                        None => Restored::DeviceDied(status, failed(why)),
                    });
                }
                pause()?;
            }
            return Ok(Restored::Fallback(failed(why)));
        }
    }
    let reused = match served {
        0 => String::new(),
        n => format!("guest reused: it served {n} run(s) before this one\n"),
    };
    let _ = fs::write(
        files.restore_log(),
        format!(
            "snapshot {}\n{reused}{}guest continued {:.3} s after the device started\n",
            snapshot.key,
            timings.render(),
            device_started.elapsed().as_secs_f64()
        ),
    );
    Ok(Restored::Continued(Box::new(loaded), home, served, log_from))
}
