//! One concrete run: private work dir, device first, then QEMU with QMP and a captured serial console, watched until
//! the guest's result, a crash, silence, a dead process or the timeout. Every child is stopped and reaped before
//! `execute` returns, and the work dir goes with it unless kept.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vhca_suite::{parse_bugcheck, parse_linux_panic, parse_result_line, ConcreteRun, GuestPanicked, ProcessExit};

use crate::device::{self, DeviceConfig, DeviceError};
use crate::evidence::{self, Evidence};
use crate::image::Image;
use crate::paths::Binaries;
use crate::qemu_cmd::{shell_line, Accel, Carrier, GdbStub, QemuConfig, VhostUserDevice};
use crate::qmp::Qmp;
use crate::serial::SerialLog;
use crate::supervise::{tick, SuperviseError, Supervised};

const DEVICE_START: Duration = Duration::from_secs(10);
/// QEMU creates its QMP socket at once; waiting longer only delays noticing a QEMU that died at start-up.
const QMP_CONNECT: Duration = Duration::from_secs(5);
/// After its result the guest powers off; QEMU then exits within milliseconds.
const AFTER_RESULT: Duration = Duration::from_secs(15);
/// After a bugcheck or panic the guest stops (panic=-1 with -no-reboot ends QEMU); a few more lines may follow.
const AFTER_CRASH: Duration = Duration::from_secs(3);
/// The device exits when QEMU hangs up; QEMU closes the socket while it is still tearing down.
const DEVICE_AFTER_QEMU: Duration = Duration::from_secs(5);
const QEMU_AFTER_DEVICE: Duration = Duration::from_secs(2);

/// Set to make the runner panic mid-run, once QEMU runs: the test of "a runner panic leaves nothing behind".
pub const TEST_PANIC_ENV: &str = "VHCA_RUN_TEST_PANIC";

/// Facts shared by every run of a session.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub bins: Binaries,
    pub image: Image,
    pub accel: Accel,
    pub carrier: Carrier,
    /// Keep the run's work dir instead of removing it.
    pub keep: bool,
    /// Interactive debugging: a gdb stub, and no timeout or silence limit.
    pub gdb: Option<GdbStub>,
}

/// What a run reports while it goes; the UI decides what to show.
#[derive(Debug, Clone)]
pub enum Progress {
    Stage { run: String, what: String },
    Serial { run: String, line: String },
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("run work dir: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Process(#[from] SuperviseError),
}

impl RunError {
    pub fn is_interrupt(&self) -> bool {
        matches!(self, RunError::Process(SuperviseError::Interrupted))
    }
}

/// The files of a run inside its work dir.
#[derive(Debug, Clone)]
pub struct RunFiles {
    pub dir: PathBuf,
}

impl RunFiles {
    pub fn socket(&self) -> PathBuf {
        self.dir.join("device.sock")
    }
    pub fn qmp(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }
    pub fn events(&self) -> PathBuf {
        self.dir.join("events.jsonl")
    }
    /// The device's stdout and stderr.
    pub fn device_log(&self) -> PathBuf {
        self.dir.join("device.log")
    }
    /// QEMU's stdout and stderr.
    pub fn qemu_log(&self) -> PathBuf {
        self.dir.join("qemu.log")
    }
    pub fn serial(&self) -> PathBuf {
        self.dir.join("serial.log")
    }
    pub fn qmp_events(&self) -> PathBuf {
        self.dir.join("qmp-events.jsonl")
    }
    pub fn device_cmdline(&self) -> PathBuf {
        self.dir.join("device.cmdline")
    }
    pub fn qemu_cmdline(&self) -> PathBuf {
        self.dir.join("qemu.cmdline")
    }
}

/// The device and QEMU configurations of a run whose files live in `dir`: the run's device arguments and its guest
/// parameters on the kernel command line.
pub fn plan(ctx: &RunContext, run: &ConcreteRun, dir: &Path) -> (DeviceConfig, QemuConfig) {
    let files = RunFiles { dir: dir.to_path_buf() };
    let device = DeviceConfig {
        bin: ctx.bins.device.clone(),
        socket: files.socket(),
        event_log: files.events(),
        run_args: run.device_args(),
    };
    let qemu = QemuConfig {
        qemu: ctx.bins.qemu.clone(),
        accel: ctx.accel,
        kernel: ctx.image.kernel.clone(),
        initrd: ctx.image.initrd.clone(),
        append: run.guest_params().into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
        device: Some(VhostUserDevice { socket: files.socket(), carrier: ctx.carrier }),
        serial_log: files.serial(),
        qmp_socket: files.qmp(),
        gdb: ctx.gdb,
    };
    (device, qemu)
}

/// The two command lines of a run, shell-pastable: device first, then QEMU.
pub fn command_lines(device: &DeviceConfig, qemu: &QemuConfig) -> (String, String) {
    let device_args: Vec<std::ffi::OsString> = device.args().into_iter().map(Into::into).collect();
    (shell_line(&device.bin, &device_args), shell_line(&qemu.qemu, &qemu.args()))
}

/// How a run's wait ended, and what the runner saw on the way; the evidence module reads the rest from the files.
#[derive(Debug, Default)]
pub struct Watched {
    pub qemu_exit: ProcessExit,
    pub device_exit: ProcessExit,
    pub timed_out: bool,
    pub silent_for_s: Option<f64>,
    pub qmp_events: Vec<serde_json::Value>,
    pub rig_problems: Vec<String>,
    /// When the first bugcheck or panic showed, in µs on the device's event-log clock, and its label.
    pub crash_mark: Option<(u64, String)>,
}

/// A finished run: what was observed, where its files are while they last, and how long it took.
pub struct RunRecord {
    pub evidence: Evidence,
    pub seconds: f64,
    /// The work dir; dropped (removed) after the artifacts are copied, unless kept.
    pub work: WorkDir,
}

pub enum WorkDir {
    Temp(tempfile::TempDir),
    Kept(PathBuf),
}

impl WorkDir {
    pub fn path(&self) -> &Path {
        match self {
            WorkDir::Temp(t) => t.path(),
            WorkDir::Kept(p) => p,
        }
    }
}

/// Runs one concrete run to its end. Errors are the runner's own (work dir, spawning, interrupt); everything the
/// rig or the guest did wrong is in the record's evidence.
pub fn execute(ctx: &RunContext, run: &ConcreteRun, on: &mut dyn FnMut(Progress)) -> Result<RunRecord, RunError> {
    let temp = tempfile::Builder::new().prefix("vhca-run-").tempdir()?;
    let files = RunFiles { dir: temp.path().to_path_buf() };
    let (device_cfg, qemu_cfg) = plan(ctx, run, &files.dir);
    let (device_line, qemu_line) = command_lines(&device_cfg, &qemu_cfg);
    fs::write(files.device_cmdline(), format!("{device_line}\n"))?;
    fs::write(files.qemu_cmdline(), format!("{qemu_line}\n"))?;
    let stage = |on: &mut dyn FnMut(Progress), what: String| on(Progress::Stage { run: run.name.clone(), what });

    let start = Instant::now();
    let mut watched = Watched::default();
    stage(on, "starting vhca-device".into());
    let device_started = Instant::now();
    match device::launch(&device_cfg, &files.device_log(), DEVICE_START) {
        Ok(device) => {
            stage(on, format!("starting QEMU ({})", ctx.accel.name()));
            let qemu = Supervised::spawn("qemu", qemu_cfg.command(), Some(&files.qemu_log()))?;
            // `watch` owns both guards: both processes are stopped and reaped when it returns, however it returns.
            let mut w = Watch { ctx, run, files: &files, device_started, watched: &mut watched, on };
            w.run(device, qemu)?;
        }
        Err(DeviceError::ExitedEarly { status }) => {
            watched.device_exit = ProcessExit::from_status(status.code(), exit_signal(&status));
            watched.rig_problems.push(format!("vhca-device exited during start-up ({status})"));
        }
        Err(DeviceError::NoSocket { socket, secs }) => {
            watched.device_exit = ProcessExit::KilledByRunner;
            watched.rig_problems.push(format!("vhca-device did not create {socket} within {secs} s"));
        }
        Err(DeviceError::Process(e)) => return Err(e.into()),
    }
    let seconds = start.elapsed().as_secs_f64();
    let evidence = evidence::gather(run, &files, watched, ctx.gdb.is_some())?;
    let work = if ctx.keep { WorkDir::Kept(temp.keep()) } else { WorkDir::Temp(temp) };
    Ok(RunRecord { evidence, seconds, work })
}

fn exit_signal(status: &std::process::ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.signal()
}

fn exit_of(status: std::process::ExitStatus) -> ProcessExit {
    ProcessExit::from_status(status.code(), exit_signal(&status))
}

/// The wait of one run: polls serial, QMP and both processes every tick.
struct Watch<'a> {
    ctx: &'a RunContext,
    run: &'a ConcreteRun,
    files: &'a RunFiles,
    device_started: Instant,
    watched: &'a mut Watched,
    on: &'a mut dyn FnMut(Progress),
}

/// Why the wait loop stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    QemuExited,
    DeviceExited,
    /// A result or crash was in and QEMU did not end by itself within the grace period.
    GraceOver,
    Silence,
    Timeout,
}

impl Watch<'_> {
    fn run(&mut self, mut device: Supervised, mut qemu: Supervised) -> Result<(), RunError> {
        let qemu_started = Instant::now();
        let mut serial = SerialLog::new(&self.files.serial());
        let mut last_output = qemu_started;
        let mut last_offset = 0;
        let mut qmp: Option<Qmp> = None;
        let mut qmp_tried = false;
        // When a result or crash arrived, and how long QEMU then gets to end by itself.
        let mut settled: Option<(Instant, Duration)> = None;
        let untimed = self.ctx.gdb.is_some();
        let silence = Duration::from_secs(u64::from(self.run.guest.silence_s));
        let timeout = Duration::from_secs(u64::from(self.run.guest.timeout_s));
        let test_panic = std::env::var_os(TEST_PANIC_ENV).is_some();

        let end = loop {
            for line in serial.poll().unwrap_or_default() {
                if let Some(grace) = self.absorb(&line) {
                    settled.get_or_insert((Instant::now(), grace));
                }
                (self.on)(Progress::Serial { run: self.run.name.clone(), line });
            }
            if serial.offset() != last_offset {
                last_offset = serial.offset();
                last_output = Instant::now();
            }
            if !qmp_tried {
                qmp_tried = true;
                qmp = Qmp::connect(&self.files.qmp(), QMP_CONNECT).ok();
            }
            if self.drain_qmp(qmp.as_mut()) {
                settled.get_or_insert((Instant::now(), AFTER_CRASH));
            }
            if test_panic && last_offset > 0 {
                panic!("{TEST_PANIC_ENV} is set: the runner panics mid-run, with QEMU and the device running");
            }
            if let Some(status) = qemu.try_status()? {
                self.watched.qemu_exit = exit_of(status);
                break End::QemuExited;
            }
            if let Some(status) = device.try_status()? {
                self.watched.device_exit = exit_of(status);
                break End::DeviceExited;
            }
            if let Some((at, grace)) = settled {
                if at.elapsed() >= grace {
                    break End::GraceOver;
                }
            } else if !untimed {
                if last_output.elapsed() >= silence {
                    break End::Silence;
                }
                if qemu_started.elapsed() >= timeout {
                    break End::Timeout;
                }
            }
            tick()?;
        };
        self.watched.silent_for_s = Some(last_output.elapsed().as_secs_f64());
        match end {
            End::Silence | End::Timeout => {
                self.watched.timed_out = true;
                let why = if end == End::Silence {
                    format!("no serial output for {} s", silence.as_secs())
                } else {
                    format!("timeout {} s", timeout.as_secs())
                };
                (self.on)(Progress::Stage { run: self.run.name.clone(), what: format!("stopping: {why}") });
            }
            End::DeviceExited => {
                // The device leaves when QEMU hangs up; QEMU may still be tearing down. Give it a moment.
                if let Some(status) = qemu.wait_timeout(QEMU_AFTER_DEVICE)? {
                    self.watched.qemu_exit = exit_of(status);
                } else if self.watched.device_exit == (ProcessExit::Exited { code: 0 }) {
                    self.watched.rig_problems.push("vhca-device exited (status 0) while QEMU still ran".into());
                }
            }
            End::QemuExited | End::GraceOver => {}
        }
        if self.watched.qemu_exit == ProcessExit::Running {
            qemu.kill();
            self.watched.qemu_exit = ProcessExit::KilledByRunner;
        }
        if self.watched.device_exit == ProcessExit::Running {
            self.watched.device_exit = match device.wait_timeout(DEVICE_AFTER_QEMU)? {
                Some(status) => exit_of(status),
                None => {
                    device.kill();
                    ProcessExit::KilledByRunner
                }
            };
        }
        // A closed QMP socket still holds what QEMU wrote before it exited (GUEST_PANICKED comes just before).
        self.drain_qmp(qmp.as_mut());
        drop(qmp);
        drop(qemu);
        drop(device);
        for line in serial.poll().unwrap_or_default().into_iter().chain(serial.take_partial()) {
            self.absorb(&line);
            (self.on)(Progress::Serial { run: self.run.name.clone(), line });
        }
        Ok(())
    }

    /// Notes what a serial line means for the wait: the grace period it starts, if any; a crash also marks the
    /// timeline. The verdict itself reads the whole serial log afterwards, through the same parsers.
    fn absorb(&mut self, line: &str) -> Option<Duration> {
        if parse_result_line(line).is_some() {
            return Some(AFTER_RESULT);
        }
        let label = match (parse_bugcheck(line), parse_linux_panic(line)) {
            (Some(b), _) => format!("STOP {:#X}", b.code),
            (None, Some(_)) => "kernel panic".to_string(),
            (None, None) => return None,
        };
        self.mark_crash(label);
        Some(AFTER_CRASH)
    }

    fn mark_crash(&mut self, label: String) {
        if self.watched.crash_mark.is_none() {
            let t_us = u64::try_from(self.device_started.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.watched.crash_mark = Some((t_us, label));
        }
    }

    /// Collects QMP events; true if one was GUEST_PANICKED.
    fn drain_qmp(&mut self, qmp: Option<&mut Qmp>) -> bool {
        let Some(q) = qmp else { return false };
        let _ = q.poll_events();
        let mut panicked = false;
        for e in q.take_events() {
            let value = serde_json::json!({ "event": e.event, "data": e.data });
            if let Some(p) = GuestPanicked::from_qmp(&value) {
                panicked = true;
                let label = match p.hyperv.and_then(|h| h.bugcheck()) {
                    Some(b) => format!("STOP {:#X} (QMP)", b.code),
                    None => "GUEST_PANICKED".to_string(),
                };
                self.mark_crash(label);
            }
            self.watched.qmp_events.push(value);
        }
        panicked
    }
}
