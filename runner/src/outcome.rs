//! What one finished run left behind, as plain data: how it ended, the exits of QEMU and the device, the guest's result
//! and the device's events. The run produces it, the verdict judges it, the report shows it.

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitStatus;

use serde::Serialize;

use crate::events::{Event, EventLogError};
use crate::qemu_cmd::Accel;
use crate::qmp::QmpEvent;
use crate::serial::GuestResult;

/// A process's end, in a form that serialises and prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ExitInfo {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl ExitInfo {
    pub fn success(self) -> bool {
        self.code == Some(0)
    }
}

impl From<ExitStatus> for ExitInfo {
    fn from(s: ExitStatus) -> ExitInfo {
        ExitInfo { code: s.code(), signal: s.signal() }
    }
}

impl std::fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.code, self.signal) {
            (Some(c), _) => write!(f, "exit code {c}"),
            (None, Some(libc::SIGABRT)) => write!(f, "aborted (SIGABRT)"),
            (None, Some(s)) => write!(f, "killed by signal {s}"),
            (None, None) => write!(f, "unknown exit"),
        }
    }
}

/// Why the run's wait loop stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunEnd {
    /// The guest printed its result (QEMU then exited or was stopped).
    GuestResult,
    /// QEMU exited before any result.
    QemuExited,
    /// The device exited with a failure before any result.
    DeviceExited,
    /// The run's hard timeout passed.
    Timeout,
}

#[derive(Debug, Clone, Serialize)]
pub struct RunOutcome {
    pub name: String,
    pub scenario: String,
    pub accel: Accel,
    pub end: RunEnd,
    pub seconds: f64,
    pub timeout_secs: f64,
    pub qemu_exit: Option<ExitInfo>,
    pub device_exit: Option<ExitInfo>,
    pub guest_result: Option<GuestResult>,
    /// A VHCA-RESULT line that did not parse.
    pub result_error: Option<String>,
    #[serde(skip)]
    pub events: Result<Vec<Event>, EventLogError>,
    /// Where this run's logs are kept (artifacts dir or a kept work dir), if anywhere.
    pub artifacts: Option<PathBuf>,
    /// Last serial lines, so a failure report shows what the guest said.
    pub serial_tail: Vec<String>,
    pub device_log_tail: Vec<String>,
    pub qemu_log_tail: Vec<String>,
    /// QMP events seen during the run (SHUTDOWN, GUEST_PANICKED, ...).
    pub qmp_events: Vec<QmpEvent>,
    /// A command that repeats this run.
    pub reproducer: String,
}
