//! One run: private work dir, device first, then QEMU with QMP and a captured serial console, a wait bounded by a hard
//! timeout, then the evidence gathered into a `RunOutcome`. Every child and the work dir go when the run returns.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::device::{self, DeviceConfig, DeviceError};
use crate::events::read_log;
use crate::image::Image;
use crate::outcome::{ExitInfo, RunEnd, RunOutcome};
use crate::paths::Binaries;
use crate::qemu_cmd::{shell_line, Accel, Carrier, QemuConfig, VhostUserDevice};
use crate::qmp::Qmp;
use crate::serial::{parse_result_line, SerialLog};
use crate::supervise::{tick, SuperviseError, Supervised};
use crate::verdict::Expectation;

const DEVICE_START: Duration = Duration::from_secs(10);
const QMP_CONNECT: Duration = Duration::from_secs(10);
/// After its result the guest powers off; QEMU then exits within milliseconds, and the device when QEMU hangs up.
const QEMU_AFTER_RESULT: Duration = Duration::from_secs(15);
const DEVICE_AFTER_QEMU: Duration = Duration::from_secs(5);
const TAIL_LINES: usize = 40;

/// Facts shared by every run of a session.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub bins: Binaries,
    pub image: Image,
    pub accel: Accel,
    pub carrier: Carrier,
    /// Copy each run's logs to <artifacts>/<run name>/.
    pub artifacts: Option<PathBuf>,
    /// Keep the run's work dir instead of removing it.
    pub keep: bool,
    pub gdb: bool,
}

/// One entry of a suite: what to boot and what to expect.
#[derive(Debug, Clone, Serialize)]
pub struct RunSpec {
    pub name: String,
    pub scenario: String,
    /// Extra kernel command-line words (`vhca.verifier=0x80`, `vhca.init=hang`, ...).
    pub append: Vec<String>,
    pub map_registers: Option<u32>,
    pub device_args: Vec<String>,
    pub timeout: Duration,
    pub expect: Expectation,
}

/// What a run reports while it goes; the UI decides what to show.
#[derive(Debug)]
pub enum Progress<'a> {
    Stage { run: &'a str, what: String },
    Serial { run: &'a str, line: &'a str },
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("run work dir: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Process(#[from] SuperviseError),
    #[error("starting vhca-device: {0}")]
    Device(SuperviseError),
}

/// The files of a run inside its work dir.
pub struct RunFiles {
    pub dir: PathBuf,
}

impl RunFiles {
    pub fn socket(&self) -> PathBuf {
        self.dir.join("device.sock")
    }
    pub fn events(&self) -> PathBuf {
        self.dir.join("events.jsonl")
    }
    pub fn device_log(&self) -> PathBuf {
        self.dir.join("device.log")
    }
    pub fn qemu_log(&self) -> PathBuf {
        self.dir.join("qemu.log")
    }
    pub fn serial(&self) -> PathBuf {
        self.dir.join("serial.log")
    }
    pub fn qmp(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }
}

/// The device and QEMU configurations of a run whose files live in `dir`.
pub fn plan(ctx: &RunContext, spec: &RunSpec, dir: &Path) -> (DeviceConfig, QemuConfig) {
    let files = RunFiles { dir: dir.to_path_buf() };
    let device = DeviceConfig {
        bin: ctx.bins.device.clone(),
        socket: files.socket(),
        event_log: files.events(),
        map_registers: spec.map_registers,
        extra_args: spec.device_args.clone(),
    };
    let mut append = vec![format!("vhca.scenario={}", spec.scenario)];
    append.extend(spec.append.iter().cloned());
    let qemu = QemuConfig {
        qemu: ctx.bins.qemu.clone(),
        accel: ctx.accel,
        kernel: ctx.image.kernel.clone(),
        initrd: ctx.image.initrd.clone(),
        append,
        device: Some(VhostUserDevice { socket: files.socket(), carrier: ctx.carrier }),
        serial_log: files.serial(),
        qmp_socket: files.qmp(),
        gdb: ctx.gdb,
    };
    (device, qemu)
}

/// A command line that repeats this run interactively.
pub fn reproducer(ctx: &RunContext, spec: &RunSpec) -> String {
    let mut line = format!(
        "VHCA_DEVICE_BIN={} VHCA_GUEST_BIN={} VHCA_ACCEL={} vhca-run boot --scenario {} --timeout {}",
        ctx.bins.device.display(),
        ctx.bins.guest.display(),
        ctx.accel.name(),
        spec.scenario,
        spec.timeout.as_secs()
    );
    for word in &spec.append {
        line.push_str(&format!(" --append {word}"));
    }
    if let Some(n) = spec.map_registers {
        line.push_str(&format!(" --map-registers {n}"));
    }
    for arg in &spec.device_args {
        line.push_str(&format!(" --device-arg={arg}"));
    }
    line
}

pub fn execute(ctx: &RunContext, spec: &RunSpec, on: &mut dyn FnMut(Progress)) -> Result<RunOutcome, RunError> {
    let work = tempfile::Builder::new().prefix("vhca-run-").tempdir()?;
    let files = RunFiles { dir: work.path().to_path_buf() };
    let (device_cfg, qemu_cfg) = plan(ctx, spec, &files.dir);
    let device_line = shell_line(&device_cfg.bin, &device_cfg.args().iter().map(Into::into).collect::<Vec<_>>());
    let qemu_line = shell_line(&qemu_cfg.qemu, &qemu_cfg.args());
    fs::write(files.dir.join("cmdline.txt"), format!("{device_line}\n{qemu_line}\n"))?;
    let stage = |on: &mut dyn FnMut(Progress), what: String| on(Progress::Stage { run: &spec.name, what });

    let start = Instant::now();
    let mut outcome = RunOutcome {
        name: spec.name.clone(),
        scenario: spec.scenario.clone(),
        accel: ctx.accel,
        end: RunEnd::DeviceExited,
        seconds: 0.0,
        timeout_secs: spec.timeout.as_secs_f64(),
        qemu_exit: None,
        device_exit: None,
        guest_result: None,
        result_error: None,
        events: Ok(Vec::new()),
        artifacts: None,
        serial_tail: Vec::new(),
        device_log_tail: Vec::new(),
        qemu_log_tail: Vec::new(),
        qmp_events: Vec::new(),
        reproducer: reproducer(ctx, spec),
    };

    stage(on, "starting vhca-device".into());
    let device = match device::launch(&device_cfg, &files.device_log(), DEVICE_START) {
        Ok(d) => Some(d),
        Err(DeviceError::ExitedEarly { status }) => {
            outcome.device_exit = Some(status.into());
            None
        }
        Err(DeviceError::NoSocket { .. }) => None,
        Err(DeviceError::Process(e)) => return Err(RunError::Device(e)),
    };
    if let Some(device) = device {
        stage(on, format!("starting QEMU ({})", ctx.accel.name()));
        let qemu = Supervised::spawn("qemu", qemu_cfg.command(), Some(&files.qemu_log()))?;
        // `watch` takes both guards and drops them: both processes are killed and reaped when it returns.
        watch(spec, &files, device, qemu, &mut outcome, on)?;
    }
    outcome.seconds = start.elapsed().as_secs_f64();
    outcome.events = read_log(&files.events());
    outcome.device_log_tail = tail(&files.device_log());
    outcome.qemu_log_tail = tail(&files.qemu_log());
    outcome.artifacts = keep_artifacts(ctx, spec, work)?;
    Ok(outcome)
}

/// Waits for the result, QEMU's end, the device's failure or the timeout, then lets both processes finish.
fn watch(
    spec: &RunSpec,
    files: &RunFiles,
    mut device: Supervised,
    mut qemu: Supervised,
    outcome: &mut RunOutcome,
    on: &mut dyn FnMut(Progress),
) -> Result<(), RunError> {
    let start = Instant::now();
    let mut serial = SerialLog::new(&files.serial());
    let mut qmp: Option<Qmp> = None;
    let mut qmp_tried = false;
    let read_serial = |serial: &mut SerialLog, outcome: &mut RunOutcome, on: &mut dyn FnMut(Progress)| {
        for line in serial.poll().unwrap_or_default() {
            absorb_line(&line, outcome);
            on(Progress::Serial { run: &spec.name, line: &line });
        }
    };
    let end = loop {
        read_serial(&mut serial, outcome, on);
        if outcome.guest_result.is_some() || outcome.result_error.is_some() {
            break RunEnd::GuestResult;
        }
        if !qmp_tried {
            // QEMU creates the QMP socket during start-up; a failure here is not fatal to the run.
            qmp_tried = true;
            qmp = Qmp::connect(&files.qmp(), QMP_CONNECT).ok();
        }
        if let Some(q) = qmp.as_mut() {
            let _ = q.poll_events();
            outcome.qmp_events.extend(q.take_events());
        }
        if let Some(status) = qemu.try_status()? {
            outcome.qemu_exit = Some(status.into());
            read_serial(&mut serial, outcome, on);
            break if outcome.guest_result.is_some() { RunEnd::GuestResult } else { RunEnd::QemuExited };
        }
        if let Some(status) = device.try_status()? {
            if !status.success() {
                outcome.device_exit = Some(status.into());
                break RunEnd::DeviceExited;
            }
        }
        if !spec_untimed(spec) && start.elapsed() >= spec.timeout {
            break RunEnd::Timeout;
        }
        tick()?;
    };
    outcome.end = end;
    if end == RunEnd::GuestResult && outcome.qemu_exit.is_none() {
        outcome.qemu_exit = qemu.wait_timeout(QEMU_AFTER_RESULT)?.map(ExitInfo::from);
    }
    if outcome.qemu_exit.is_some() && outcome.device_exit.is_none() {
        outcome.device_exit = device.wait_timeout(DEVICE_AFTER_QEMU)?.map(ExitInfo::from);
    }
    if let Some(q) = qmp.as_mut() {
        let _ = q.poll_events();
        outcome.qmp_events.extend(q.take_events());
    }
    drop(qmp);
    // Whatever is still running now is killed; its status stays None, which the verdict reports as "did not exit".
    drop(qemu);
    drop(device);
    read_serial(&mut serial, outcome, on);
    if let Some(line) = serial.take_partial() {
        absorb_line(&line, outcome);
        on(Progress::Serial { run: &spec.name, line: &line });
    }
    Ok(())
}

/// A zero timeout means none (interactive `boot --gdb`).
fn spec_untimed(spec: &RunSpec) -> bool {
    spec.timeout.is_zero()
}

fn absorb_line(line: &str, outcome: &mut RunOutcome) {
    outcome.serial_tail.push(line.to_string());
    if outcome.serial_tail.len() > TAIL_LINES {
        outcome.serial_tail.remove(0);
    }
    // The first result counts; a guest that prints two has a bug the verdict should not hide behind the second.
    if outcome.guest_result.is_some() || outcome.result_error.is_some() {
        return;
    }
    match parse_result_line(line) {
        Some(Ok(r)) => outcome.guest_result = Some(r),
        Some(Err(e)) => outcome.result_error = Some(e.to_string()),
        None => {}
    }
}

fn tail(path: &Path) -> Vec<String> {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(TAIL_LINES)..].iter().map(|l| l.to_string()).collect()
}

/// Copies the run's files (not its sockets) to the artifacts dir; keeps the work dir if asked; else removes it.
fn keep_artifacts(ctx: &RunContext, spec: &RunSpec, work: tempfile::TempDir) -> Result<Option<PathBuf>, RunError> {
    let mut kept = None;
    if let Some(root) = &ctx.artifacts {
        let dest = root.join(&spec.name);
        let _ = fs::remove_dir_all(&dest);
        fs::create_dir_all(&dest)?;
        for entry in fs::read_dir(work.path())? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                fs::copy(entry.path(), dest.join(entry.file_name()))?;
            }
        }
        kept = Some(dest);
    }
    if ctx.keep {
        kept = Some(work.keep());
    }
    Ok(kept)
}
