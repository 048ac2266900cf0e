//! One run's guest from the snapshot, in two halves: the fresh QEMU loads the saved state (`load`, which needs no
//! device and may happen ahead of the run), then the HCA is hot-plugged into the empty root port, the guest continues,
//! and its resident agent gets the run's request on the console (`plug_and_continue`).

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::phase_hook::{self, Phase, Pids};
use crate::qemu_cmd::VhostUserDevice;
use crate::qmp::{Qmp, QmpError};
use crate::serial_capture::ConsolePort;
use crate::snapshot::capabilities;
use crate::supervise::{interrupted, SuperviseError, Supervised};

const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// Loading takes about 0.2 s; a busy machine, or a slow disk on the first read of the file, takes longer.
const LOAD_TIMEOUT: Duration = Duration::from_secs(60);
/// `query-migrate` is cheap: poll it often, the load is short.
const LOAD_POLL: Duration = Duration::from_millis(5);

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The runner's own trouble (an interrupt): the run stops.
    #[error(transparent)]
    Process(#[from] SuperviseError),
    /// The restore did not work; the run can still boot cold. `snapshot_bad`: the state file itself would not load.
    #[error("{step}: {why}")]
    Failed { step: &'static str, why: String, snapshot_bad: bool },
}

impl RestoreError {
    /// True when the state file itself would not load: no later run should try it.
    pub fn snapshot_bad(&self) -> bool {
        matches!(self, RestoreError::Failed { snapshot_bad: true, .. })
    }
}

fn failed(step: &'static str, snapshot_bad: bool) -> impl Fn(QmpError) -> RestoreError {
    move |e| RestoreError::Failed { step, why: e.to_string(), snapshot_bad }
}

/// How long each step took, for the run's files.
#[derive(Debug, Default, Clone)]
pub struct Timings {
    pub steps: Vec<(&'static str, f64)>,
}

impl Timings {
    pub fn render(&self) -> String {
        self.steps.iter().map(|(step, s)| format!("{step} {:.3} s\n", s)).collect()
    }
}

/// The first half of a restore, which needs no device: the saved state loaded into the paused QEMU. A guest loaded
/// ahead of its run waits here (see `load_ahead`).
pub fn load(qmp: &mut Qmp, qemu: &mut Supervised, state: &Path, qemu_log: &Path) -> Result<Timings, RestoreError> {
    let started = Instant::now();
    qmp.execute("migrate-set-capabilities", Some(capabilities()), QMP_TIMEOUT)
        .map_err(failed("migrate-set-capabilities", false))?;
    let uri = format!("file:{}", state.display());
    qmp.execute("migrate-incoming", Some(json!({ "uri": uri })), QMP_TIMEOUT)
        .map_err(failed("migrate-incoming", true))?;
    phase_hook::at(Phase::Load, Pids { qemu: Some(qemu.pid()), device: None });
    wait_loaded(qmp, qemu, qemu_log)?;
    Ok(Timings { steps: vec![("load", started.elapsed().as_secs_f64())] })
}

/// The second half: the run's HCA hot-plugged into the empty root port, the guest continued (`paused`: a guest just
/// loaded; one that served a run already runs, its agent waiting), its request sent.
/// `pids`: the run's QEMU and device, for the hot-plug's `phase_hook` point.
pub fn plug_and_continue(
    qmp: &mut Qmp,
    port: &mut ConsolePort,
    hca: &VhostUserDevice,
    request: &str,
    pids: Pids,
    paused: bool,
) -> Result<Timings, RestoreError> {
    let mut timings = Timings::default();
    let mut at = Instant::now();
    let mut mark = |timings: &mut Timings, step| {
        timings.steps.push((step, at.elapsed().as_secs_f64()));
        at = Instant::now();
    };
    qmp.execute("chardev-add", Some(hca.qmp_chardev_add()), QMP_TIMEOUT).map_err(failed("chardev-add", false))?;
    phase_hook::at(Phase::HotPlug, pids);
    qmp.execute("device_add", Some(hca.qmp_device_add()), QMP_TIMEOUT).map_err(failed("device_add", false))?;
    mark(&mut timings, "hot-plug");
    if paused {
        qmp.execute("cont", None, QMP_TIMEOUT).map_err(failed("cont", false))?;
    }
    // The agent may still be on its way into read(): the console buffers the line until it gets there.
    port.send_line(request).map_err(|e| RestoreError::Failed {
        step: "run request",
        why: e.to_string(),
        snapshot_bad: false,
    })?;
    mark(&mut timings, "cont+request");
    Ok(timings)
}

/// Waits for the incoming migration to complete. A failure, or QEMU ending, means the file would not load.
fn wait_loaded(qmp: &mut Qmp, qemu: &mut Supervised, qemu_log: &Path) -> Result<(), RestoreError> {
    let end = Instant::now() + LOAD_TIMEOUT;
    let bad = |why: String| RestoreError::Failed { step: "loading the snapshot", why, snapshot_bad: true };
    // QEMU gives up on a file it cannot load by exiting: its last words say why. Killed by a signal (the OOM killer,
    // a person, a test), it says nothing about the file, which stays in use.
    let ended = |status: std::process::ExitStatus| {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            let why = format!("QEMU killed by signal {signal} while loading");
            return RestoreError::Failed { step: "loading the snapshot", why, snapshot_bad: false };
        }
        let log = std::fs::read_to_string(qemu_log).unwrap_or_default();
        let last = log.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("(no message)").trim().to_string();
        bad(format!("QEMU ended ({status}) while loading: {last}"))
    };
    loop {
        if let Some(status) = qemu.try_status()? {
            return Err(ended(status));
        }
        let status = match qmp.execute("query-migrate", None, QMP_TIMEOUT) {
            Ok(status) => status,
            Err(e) => {
                return Err(match qemu.wait_timeout(Duration::from_secs(2))? {
                    Some(status) => ended(status),
                    None => bad(format!("query-migrate: {e}")),
                })
            }
        };
        match status.get("status").and_then(|s| s.as_str()) {
            Some("completed") => return Ok(()),
            Some("failed") | Some("cancelled") => {
                let why = status.get("error-desc").and_then(|s| s.as_str()).unwrap_or("no reason given");
                return Err(bad(format!("migration failed: {why}")));
            }
            _ => {}
        }
        if Instant::now() >= end {
            return Err(bad(format!("not loaded within {} s", LOAD_TIMEOUT.as_secs())));
        }
        if interrupted() {
            return Err(SuperviseError::Interrupted.into());
        }
        std::thread::sleep(LOAD_POLL);
    }
}

/// The request line the agent reads: the run's guest parameters, as a cold boot puts them on the kernel command line.
pub fn request_line(params: &[(String, String)]) -> String {
    let words: Vec<String> = params.iter().map(|(k, v)| format!("{k}={v}")).collect();
    json!({ "params": words }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_line_is_one_json_line_of_words() {
        let line = request_line(&[("vhca.scenario".into(), "smoke".into()), ("vhca.verifier".into(), "0xaa".into())]);
        assert!(!line.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v, json!({ "params": ["vhca.scenario=smoke", "vhca.verifier=0xaa"] }));
    }
}
