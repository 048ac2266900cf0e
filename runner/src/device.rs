//! The device launcher: starts vhca-device on a fresh socket and waits until it listens, so QEMU, started after it,
//! always finds the socket. A device that dies during start-up is reported with its log.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use crate::supervise::{interrupted, SuperviseError, Supervised};

#[derive(Debug, Clone)]
pub struct DeviceConfig {
    pub bin: PathBuf,
    pub socket: PathBuf,
    pub event_log: PathBuf,
    /// The run's own flags (`--map-registers N`, `--inject KEY=VALUE`: vhca-suite's `ConcreteRun::device_args`).
    pub run_args: Vec<String>,
}

/// Extra vhca-device flags for every run, from `$VHCA_DEVICE_APPEND` (words split on whitespace), e.g.
/// `--poll-window-us 0` to measure the device without busy-polling (docs/bench.md section 5).
pub const DEVICE_APPEND_ENV: &str = "VHCA_DEVICE_APPEND";

impl DeviceConfig {
    /// The command line: socket, event log, the run's flags, then `$VHCA_DEVICE_APPEND`'s words.
    pub fn args(&self) -> Vec<String> {
        let appended = std::env::var(DEVICE_APPEND_ENV).unwrap_or_default();
        self.args_with(appended.split_whitespace())
    }

    fn args_with<'a>(&self, appended: impl Iterator<Item = &'a str>) -> Vec<String> {
        let mut a = vec![
            "--socket-path".to_string(),
            self.socket.display().to_string(),
            "--event-log".to_string(),
            self.event_log.display().to_string(),
        ];
        a.extend(self.run_args.iter().cloned());
        a.extend(appended.map(String::from));
        a
    }

    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.args(self.args());
        if std::env::var_os("RUST_LOG").is_none() {
            // The device log is an artifact of every run: make it say something by default.
            cmd.env("RUST_LOG", "info");
        }
        // The log is a file read by people and reports, not a terminal: no colour escapes.
        cmd.env("NO_COLOR", "1");
        cmd
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(transparent)]
    Process(#[from] SuperviseError),
    #[error("vhca-device exited during start-up ({status})")]
    ExitedEarly { status: ExitStatus },
    #[error("vhca-device did not create {socket} within {secs} s")]
    NoSocket { socket: String, secs: u64 },
}

/// Starts the device and returns once its socket exists. The device's stdout and stderr go to `log`.
pub fn launch(config: &DeviceConfig, log: &Path, timeout: Duration) -> Result<Supervised, DeviceError> {
    let mut child = Supervised::spawn("vhca-device", config.command(), Some(log))?;
    let end = Instant::now() + timeout;
    loop {
        if std::fs::metadata(&config.socket).is_ok_and(|m| m.file_type().is_socket()) {
            return Ok(child);
        }
        if let Some(status) = child.try_status()? {
            return Err(DeviceError::ExitedEarly { status });
        }
        if Instant::now() >= end {
            return Err(DeviceError::NoSocket { socket: config.socket.display().to_string(), secs: timeout.as_secs() });
        }
        if interrupted() {
            return Err(SuperviseError::Interrupted.into());
        }
        std::thread::sleep(SOCKET_POLL);
    }
}

/// How often `launch` looks for the socket. The device has it within a few milliseconds of its start, and every run
/// waits for it: looking every 20 ms (the runner's general poll) made each run's device start take 20 ms.
const SOCKET_POLL: Duration = Duration::from_millis(1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_command_line_follows_the_contract() {
        let c = DeviceConfig {
            bin: "/t/vhca-device".into(),
            socket: "/r/dev.sock".into(),
            event_log: "/r/events.jsonl".into(),
            run_args: vec!["--map-registers".into(), "64".into(), "--inject".into(), "fail_reg_mr=3".into()],
        };
        let expected = [
            "--socket-path",
            "/r/dev.sock",
            "--event-log",
            "/r/events.jsonl",
            "--map-registers",
            "64",
            "--inject",
            "fail_reg_mr=3",
        ];
        assert_eq!(c.args_with(std::iter::empty()), expected);
        // $VHCA_DEVICE_APPEND's words come last, after the run's own flags.
        let appended = c.args_with(" --poll-window-us\t0 ".split_whitespace());
        assert_eq!(appended[..expected.len()], expected);
        assert_eq!(appended[expected.len()..], ["--poll-window-us", "0"]);
    }

    #[test]
    fn waits_for_the_socket_and_reports_an_early_exit() {
        let dir = tempfile::tempdir().unwrap();
        // A stand-in device: a shell that binds nothing and exits 4.
        let script = dir.path().join("dev.sh");
        std::fs::write(&script, "#!/bin/sh\necho broken >&2\nexit 4\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let c = DeviceConfig {
            bin: script,
            socket: dir.path().join("dev.sock"),
            event_log: dir.path().join("e.jsonl"),
            run_args: vec![],
        };
        let err = launch(&c, &dir.path().join("dev.log"), Duration::from_secs(10)).unwrap_err();
        assert!(matches!(err, DeviceError::ExitedEarly { status } if status.code() == Some(4)), "{err}");
        assert_eq!(std::fs::read_to_string(dir.path().join("dev.log")).unwrap(), "broken\n");
    }
}
