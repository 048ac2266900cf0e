//! From a finished run's files and what the wait saw to vhca-suite's `Observation`: the serial log, the device's event
//! log, QMP events and process exits, plus the rig's own checks (IOTLB coverage, the scenario the guest ran).

use std::fs;
use std::io;
use std::path::Path;

use vhca_suite::{iotlb_problems, parse_event_log, ConcreteRun, EventLog, Observation};

use crate::run_files::RunFiles;
use crate::watch::Watched;

/// Everything the verdict, the reports and the timeline need from one run.
#[derive(Debug)]
pub struct Evidence {
    pub observation: Observation,
    pub event_log: EventLog,
    /// The first bugcheck or panic on the event log's clock (µs) and its label, for the timeline.
    pub crash_mark: Option<(u64, String)>,
    /// When the result line showed, on the same clock.
    pub result_seen_us: Option<u64>,
}

/// A file a run may not have produced (QEMU never started, the device died first) reads as empty.
fn read_optional(path: &Path) -> io::Result<String> {
    match fs::read(path) {
        Ok(bytes) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(e),
    }
}

/// Builds the observation. `untimed` (an interactive gdb session) leaves the timeout out of it.
pub fn gather(run: &ConcreteRun, files: &RunFiles, watched: Watched, untimed: bool) -> io::Result<Evidence> {
    let mut o = Observation::default();
    o.add_serial(&read_optional(&files.serial())?);
    let event_log = parse_event_log(&read_optional(&files.events())?);
    o.add_event_log(&event_log);
    let mut qmp_lines = String::new();
    for event in &watched.qmp_events {
        o.add_qmp_event(event);
        qmp_lines.push_str(&event.to_string());
        qmp_lines.push('\n');
    }
    fs::write(files.qmp_events(), qmp_lines)?;
    o.qemu_exit = watched.qemu_exit;
    o.device_exit = watched.device_exit;
    o.silent_for_s = watched.silent_for_s;
    o.timed_out = watched.timed_out;
    o.timeout_s = (!untimed).then_some(run.guest.timeout_s);
    o.rig_problems = watched.rig_problems;
    o.rig_problems.extend(iotlb_problems(&event_log, o.guest_result.as_ref()));
    if let Some(ran) = o.guest_result.as_ref().and_then(|r| r.get("scenario")).and_then(|s| s.as_str()) {
        if ran != run.guest.scenario {
            o.rig_problems.push(format!("the guest ran scenario {ran:?}, not {:?}", run.guest.scenario));
        }
    }
    Ok(Evidence { observation: o, event_log, crash_mark: watched.crash_mark, result_seen_us: watched.result_seen_us })
}
