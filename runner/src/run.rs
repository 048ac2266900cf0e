//! One concrete run: private work dir, device first, then QEMU (restored from the snapshot with the HCA hot-plugged,
//! or booted cold) with QMP and a captured serial console, watched until the guest's result, a crash, silence, a dead
//! process or the timeout. Every child is stopped and reaped before `execute` returns, and the work dir goes with it
//! unless kept.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vhca_suite::{
    parse_bugcheck, parse_linux_panic, parse_result_line, BootPath, ConcreteRun, GuestPanicked, ProcessExit,
};

use crate::device::{self, DeviceConfig, DeviceError};
use crate::evidence::{self, Evidence};
use crate::image::Image;
use crate::paths::Binaries;
use crate::phase_hook::{self, Phase, Pids};
use crate::proc_usage::{self, Point};
use crate::qemu_cmd::{shell_line, Accel, Carrier, GdbStub, QemuConfig, VhostUserDevice, HCA_CHARDEV, HCA_DEVICE_ID};
use crate::qmp::Qmp;
use crate::restore::{self, RestoreError, Timings};
use crate::serial_capture::{ConsolePort, SerialLog};
use crate::snapshot::{MachineFiles, SavedMachine, Snapshot, AGENT_WORD};
use crate::supervise::{SuperviseError, Supervised};
use crate::warm_guest::{self, GuestHome, Loaded, ReadyGuest, Taken};
use crate::windows_guest::image_dir::WindowsImage;
use crate::windows_guest::run_boot;

const DEVICE_START: Duration = Duration::from_secs(10);
/// QEMU creates its QMP socket at once; waiting longer only delays noticing a QEMU that died at start-up.
const QMP_CONNECT: Duration = Duration::from_secs(5);
/// After its result QEMU is sent SIGTERM (and the guest powers off anyway); QEMU then exits within milliseconds.
const AFTER_RESULT: Duration = Duration::from_secs(15);
/// After a bugcheck or panic the guest stops (panic=-1 with -no-reboot ends QEMU); a few more lines may follow.
const AFTER_CRASH: Duration = Duration::from_secs(3);
/// The device exits when QEMU hangs up; QEMU closes the socket while it is still tearing down.
const DEVICE_AFTER_QEMU: Duration = Duration::from_secs(5);
const QEMU_AFTER_DEVICE: Duration = Duration::from_secs(2);
/// How long the console copy may take to reach the end of a dead QEMU's socket.
const CONSOLE_TAIL: Duration = Duration::from_millis(500);
/// How often the wait of a run looks at the console, QMP and both processes: each look is a few reads and two
/// waitpid calls, and every stage of a run's end waits for the next look.
const WATCH_POLL: Duration = Duration::from_millis(2);

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
    /// The saved guest runs are restored from; None: every run boots cold.
    pub snapshot: Option<Arc<Snapshot>>,
    /// A Windows suite's image: every run boots it cold instead of the Linux guest (never run here: no image).
    pub windows: Option<Arc<WindowsImage>>,
    /// Start each QEMU paused (`vhca-run debug`): the debugger, or the person, continues it.
    pub paused: bool,
    /// A restored guest whose run left it clean serves its worker's next run (`run_process` in the guest says what
    /// clean is); off: one restore per run.
    pub reuse_guests: bool,
}

/// Guest options every run gets on either path: `reset_method=none`, then the words of $VHCA_GUEST_APPEND.
/// vfio-pci resets a device at every open and close with the first method it has; the HCA is hot-plugged (or
/// booted) fresh for each run with a new vhca-device behind it, and the guest resets it through virtio before using
/// it, so a reset at open checks nothing. The cheapest one, a D3hot cycle (`pm`), sleeps the kernel's 10 ms
/// d3hot delay twice: vfio open took 42-44 ms with it and 15-16 ms without (22 runs each, AMD EPYC, TCG). The
/// close is skipped at power-off anyway (bring_up.rs).
pub fn baked_guest_options() -> Vec<String> {
    let mut words = vec!["vhca.reset_method=none".to_string()];
    words.extend(std::env::var("VHCA_GUEST_APPEND").unwrap_or_default().split_whitespace().map(String::from));
    words
}

impl RunContext {
    /// The machine a snapshot of this session is taken of: no HCA, the baked-in options and the agent.
    pub fn saved_machine(&self) -> SavedMachine {
        let mut append = baked_guest_options();
        append.push(AGENT_WORD.to_string());
        SavedMachine {
            qemu: self.bins.qemu.clone(),
            accel: self.accel,
            kernel: self.image.kernel.clone(),
            initrd: self.image.initrd.clone(),
            append,
        }
    }
}

/// What a run reports while it goes; the UI decides what to show.
#[derive(Debug, Clone)]
pub enum Progress {
    Stage {
        run: String,
        what: String,
    },
    Serial {
        run: String,
        line: String,
    },
    /// Something a person should see even in a quiet suite (a snapshot that could not serve).
    Notice {
        run: String,
        what: String,
    },
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
    /// The console socket of a restored guest (its output is still logged to `serial`).
    pub fn serial_socket(&self) -> PathBuf {
        self.dir.join("serial.sock")
    }
    /// When the run's end came, counted from the device's start: the result line, QEMU's and the device's exits.
    pub fn ending_log(&self) -> PathBuf {
        self.dir.join("ending.log")
    }
    /// How long each restore step took.
    pub fn restore_log(&self) -> PathBuf {
        self.dir.join("restore.log")
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
        append: baked_guest_options()
            .into_iter()
            .chain(run.guest_params().into_iter().map(|(k, v)| format!("{k}={v}")))
            .collect(),
        device: Some(VhostUserDevice { socket: files.socket(), carrier: ctx.carrier }),
        serial_log: files.serial(),
        serial_socket: None,
        qmp_socket: files.qmp(),
        gdb: ctx.gdb,
        incoming_defer: false,
        rng: run.guest.scenario == crate::bench::ROUNDTRIP_SCENARIO,
    };
    (device, qemu)
}

/// The snapshot path's QEMU: the saved machine's exact command line with this run's files and `-incoming defer`.
pub fn plan_restore(machine: &SavedMachine, dir: &Path) -> QemuConfig {
    let files = RunFiles { dir: dir.to_path_buf() };
    let machine_files =
        MachineFiles { serial_log: files.serial(), serial_socket: files.serial_socket(), qmp_socket: files.qmp() };
    machine.config(&machine_files, true)
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
    /// How the guest came up; a snapshot run that fell back to a cold boot says Cold.
    pub path: BootPath,
    /// For the report: why the run did not take the snapshot path it was meant to.
    pub notes: Vec<String>,
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

/// Runs one concrete run to its end: from the snapshot when the session has a usable one, else (or when the restore
/// fails before the guest continues) by a cold boot. Errors are the runner's own (work dir, spawning, interrupt);
/// everything the rig or the guest did wrong is in the record's evidence.
pub fn execute(ctx: &RunContext, run: &ConcreteRun, on: &mut dyn FnMut(Progress)) -> Result<RunRecord, RunError> {
    let mut notes = Vec::new();
    if let Some(snapshot) = ctx.snapshot.as_ref().filter(|s| s.usable()) {
        match attempt(ctx, run, Some(snapshot), on)? {
            Attempt::Done(record) => return Ok(*record),
            Attempt::Fallback(why) => {
                let mut note = format!("snapshot restore failed ({why}): booting cold");
                if why.snapshot_bad() && snapshot.mark_broken() {
                    note.push_str(&format!("; snapshot {} removed, later runs boot cold", snapshot.key));
                }
                on(Progress::Notice { run: run.name.clone(), what: note.clone() });
                notes.push(note);
            }
        }
    }
    match attempt(ctx, run, None, on)? {
        Attempt::Done(mut record) => {
            record.notes.extend(notes);
            Ok(*record)
        }
        // A cold boot has no restore to fail.
        Attempt::Fallback(why) => Err(RunError::Io(std::io::Error::other(why.to_string()))),
    }
}

/// What one try at a run came to.
enum Attempt {
    Done(Box<RunRecord>),
    /// The restore failed before the guest ran anything: the run can be tried again cold.
    Fallback(RestoreError),
}

fn attempt(
    ctx: &RunContext,
    run: &ConcreteRun,
    snapshot: Option<&Arc<Snapshot>>,
    on: &mut dyn FnMut(Progress),
) -> Result<Attempt, RunError> {
    // From the snapshot, the run takes its worker's guest: the one its last run left clean, one loaded ahead, or
    // one started now. The guest lives in a work dir of its own (it may serve more runs than this one); the run's
    // files go in the run's work dir, claimed (leftovers.rs) for as long as the run uses it.
    let guest = match snapshot {
        Some(s) => Some(warm_guest::take(s)?),
        None => None,
    };
    let temp = tempfile::Builder::new().prefix("vhca-run-").tempdir()?;
    let _claim = crate::leftovers::claim(temp.path())?;
    let files = RunFiles { dir: temp.path().to_path_buf() };
    let (device_cfg, cold_cfg) = plan(ctx, run, &files.dir);
    let qemu_cfg = match snapshot {
        Some(s) => plan_restore(&s.machine, &files.dir),
        None => cold_cfg,
    };
    let hca = VhostUserDevice { socket: files.socket(), carrier: ctx.carrier };
    let request = restore::request_line(&run.guest_params());
    let (device_line, mut qemu_line) = command_lines(&device_cfg, &qemu_cfg);
    let windows = match &ctx.windows {
        Some(image) => {
            let m = run_boot::prepare(
                image,
                &ctx.bins.qemu,
                ctx.accel,
                run.verifier_flags,
                hca.clone(),
                &files.dir,
                (ctx.gdb, ctx.paused),
            )
            .map_err(std::io::Error::other)?;
            qemu_line = format!(
                "{}\n# then on COM1, after {}: {request}",
                shell_line(&m.qemu, &m.args()),
                crate::snapshot::READY_LINE
            );
            Some(m)
        }
        None => None,
    };
    if let Some(s) = snapshot {
        qemu_line.push_str(&format!(
            "\n# then over QMP: migrate-set-capabilities {}; migrate-incoming file:{}; chardev-add {}; device_add {}; cont\n\
             # then on the console: {request}",
            crate::snapshot::capabilities(),
            s.state.display(),
            hca.qmp_chardev_add(),
            hca.qmp_device_add(),
        ));
    }
    fs::write(files.device_cmdline(), format!("{device_line}\n"))?;
    fs::write(files.qemu_cmdline(), format!("{qemu_line}\n"))?;
    let stage = |on: &mut dyn FnMut(Progress), what: String| on(Progress::Stage { run: run.name.clone(), what });

    let start = Instant::now();
    let mut watched = Watched::default();
    // A restored guest's home (declared before the processes so it is removed after them), how many runs it served
    // before this one, and where this run's part of its QEMU log begins.
    let mut home: Option<(GuestHome, u32, u64)> = None;
    let mut recycled: Option<Loaded> = None;
    stage(on, "starting vhca-device".into());
    let device_started = Instant::now();
    match device::launch(&device_cfg, &files.device_log(), DEVICE_START) {
        Ok(mut device) => {
            let mut never_started = false;
            let started = match (snapshot, guest) {
                (Some(s), Some(guest)) => {
                    stage(on, format!("continuing the restored guest ({})", ctx.accel.name()));
                    // Any failure here drops both guards (device and QEMU killed and reaped) with the work dir.
                    match continue_restored(&files, guest, s, &hca, &request, device_started, &mut device)? {
                        Restored::Continued(loaded, guest_home, served, log_from) => {
                            let Loaded { qemu, qmp, port, .. } = *loaded;
                            // The next run's guest loads while this one runs, unless this one may serve it.
                            if !ctx.reuse_guests {
                                warm_guest::load_next(s);
                            }
                            home = Some((guest_home, served, log_from));
                            Some((qemu, Some(qmp), Some(port)))
                        }
                        Restored::Fallback(why) => return Ok(Attempt::Fallback(why)),
                        // The device died under the restore (killed, or it crashed on the hot-plug's vhost-user
                        // messages): that is the run's verdict, not a reason to boot cold and hide it.
                        Restored::DeviceDied(status, why) => {
                            watched.device_exit = exit_of(status);
                            watched.qemu_exit = ProcessExit::KilledByRunner;
                            watched.rig_problems.push(format!("vhca-device ended during the restore ({why})"));
                            None
                        }
                    }
                }
                _ => {
                    stage(on, format!("starting QEMU ({}, booting)", ctx.accel.name()));
                    // A Windows guest boots its own image (always cold: no snapshot path for Windows yet).
                    let command = windows.as_ref().map_or_else(|| qemu_cfg.command(), |m| m.command());
                    let mut qemu = Supervised::spawn("qemu", command, Some(&files.qemu_log()))?;
                    let (mut qmp, mut port) = (None, None);
                    if let Some(m) = &windows {
                        stage(on, "waiting for the Windows agent on COM1".into());
                        let boot = Duration::from_secs(u64::from(run.guest.timeout_s));
                        let why = match run_boot::deliver_request(m, &files.serial(), &mut qemu, &request, boot) {
                            Ok((q, p)) => {
                                (qmp, port) = (Some(q), Some(p));
                                None
                            }
                            Err(run_boot::RequestError::Process(e)) => return Err(e.into()),
                            Err(run_boot::RequestError::NoAgent(s)) => {
                                watched.timed_out = true;
                                Some(format!("the Windows agent never said it was ready in {s} s"))
                            }
                            Err(why) => Some(why.to_string()),
                        };
                        if let Some(why) = why {
                            // The guest never got its request: nothing to watch. Both stopped and reaped here.
                            watched.rig_problems.push(why);
                            watched.qemu_exit = match qemu.try_status()? {
                                Some(status) => exit_of(status),
                                None => {
                                    qemu.kill();
                                    ProcessExit::KilledByRunner
                                }
                            };
                            device.kill();
                            watched.device_exit = ProcessExit::KilledByRunner;
                            never_started = true;
                        }
                    }
                    (!never_started).then_some((qemu, qmp, port))
                }
            };
            // `watch` owns both guards: both processes are stopped and reaped when it returns, however it returns.
            let crash_grace = if windows.is_some() { run_boot::DUMP_GRACE } else { AFTER_CRASH };
            if let Some((qemu, qmp, port)) = started {
                // A restored Linux guest may serve this worker's next run, if the run leaves it clean.
                let reuse = ctx.reuse_guests && home.is_some() && windows.is_none() && warm_guest::more_runs_expected();
                let mut w = Watch { ctx, run, files: &files, device_started, watched: &mut watched, on, crash_grace };
                recycled = w.run(device, qemu, qmp, port, reuse)?;
            }
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
    if let Some((guest_home, served, log_from)) = home {
        copy_log_tail(&guest_home.work.path().join("qemu.log"), log_from, &files.qemu_log());
        if let Some(loaded) = recycled {
            warm_guest::keep(ReadyGuest::new(loaded, guest_home, served + 1));
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    if windows.is_some() {
        run_boot::keep_disk_if_crashed(&files.dir, watched.crash_mark.is_some());
    }
    let evidence = evidence::gather(run, &files, watched, ctx.gdb.is_some() || ctx.paused)?;
    let work = if ctx.keep { WorkDir::Kept(temp.keep()) } else { WorkDir::Temp(temp) };
    let path = if snapshot.is_some() { BootPath::Snapshot } else { BootPath::Cold };
    Ok(Attempt::Done(Box::new(RunRecord { evidence, seconds, path, notes: Vec::new(), work })))
}

/// This run's part of a log a guest's QEMU writes for its whole life: from `from` on, into the run's own file.
fn copy_log_tail(log: &Path, from: u64, to: &Path) {
    use std::io::{Read, Seek, SeekFrom};
    let mut tail = Vec::new();
    if let Ok(mut file) = fs::File::open(log) {
        if file.seek(SeekFrom::Start(from)).is_ok() {
            let _ = file.read_to_end(&mut tail);
        }
    }
    let _ = fs::write(to, tail);
}

/// How a restore ended.
enum Restored {
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
fn continue_restored(
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

/// One `WATCH_POLL`, failing if an interrupt arrived.
fn pause() -> Result<(), SuperviseError> {
    if crate::supervise::interrupted() {
        return Err(SuperviseError::Interrupted);
    }
    std::thread::sleep(WATCH_POLL);
    Ok(())
}

/// Waits for a child's exit, looking every `WATCH_POLL`, up to `timeout` (then `Ok(None)`, still running).
fn wait_exit(child: &mut Supervised, timeout: Duration) -> Result<Option<std::process::ExitStatus>, SuperviseError> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_status()? {
            return Ok(Some(status));
        }
        if Instant::now() >= end {
            return Ok(None);
        }
        pause()?;
    }
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
    /// How long QEMU may go on after a bugcheck or panic: a Linux guest stops at once, Windows writes its dump.
    crash_grace: Duration,
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
    /// The run left its guest clean and the guest said it can serve again (`reuse`).
    Recycled,
}

impl Watch<'_> {
    /// `qmp` and `port`: already connected (a restore needed them first); a cold boot's QMP is connected here.
    /// `reuse`: the guest may serve another run if this one leaves it clean; then it is returned, running, its agent
    /// waiting, its HCA ejected and the HCA's chardev removed.
    fn run(
        &mut self,
        mut device: Supervised,
        mut qemu: Supervised,
        mut qmp: Option<Qmp>,
        mut port: Option<ConsolePort>,
        reuse: bool,
    ) -> Result<Option<Loaded>, RunError> {
        let qemu_started = Instant::now();
        let mut serial = SerialLog::new(&self.files.serial());
        let mut last_output = qemu_started;
        let mut last_offset = 0;
        let mut qmp_tried = qmp.is_some();
        // When a result or crash arrived, and how long QEMU then gets to end by itself.
        let mut settled: Option<(Instant, Duration)> = None;
        let untimed = self.ctx.gdb.is_some() || self.ctx.paused;
        let silence = Duration::from_secs(u64::from(self.run.guest.silence_s));
        let timeout = Duration::from_secs(u64::from(self.run.guest.timeout_s));
        let test_panic = std::env::var_os(TEST_PANIC_ENV).is_some();
        let mut quit_sent = false;
        // The guest's word that the run is over (its result line), and, on a guest that may serve again, the
        // agent's readiness after it, the HCA's DEVICE_DELETED and the device's own exit: all three make it clean.
        let mut result_seen = false;
        let mut agent_ready = false;
        let mut hca_deleted = false;
        let mut device_gone = false;
        let mut chardev_removed: Option<bool> = None;
        let pids = Pids { qemu: Some(qemu.pid()), device: Some(device.pid()) };
        let mut mid_run = false;
        // For the soak only (`proc_usage::collect`): both children's memory and fds while the run is live.
        let collect = proc_usage::collecting();
        let mut sampled = false;
        let (device_pid, qemu_pid) = (device.pid(), qemu.pid());
        let sample = |point, sampled: &mut bool| {
            if collect && !std::mem::replace(sampled, true) {
                proc_usage::record(point, device_pid, qemu_pid);
            }
        };

        // For `ending.log`: seconds after the device started.
        let mut ending: Vec<(&str, f64)> = Vec::new();
        let since_device = |device_started: Instant| device_started.elapsed().as_secs_f64();
        let end = loop {
            for line in serial.poll().unwrap_or_default() {
                if let Some(grace) = self.absorb(&line) {
                    if settled.is_none() {
                        ending.push(("result or crash line seen", since_device(self.device_started)));
                    }
                    settled.get_or_insert((Instant::now(), grace));
                }
                if parse_result_line(&line).is_some() {
                    result_seen = true;
                } else if result_seen && line.trim() == crate::snapshot::READY_LINE && !agent_ready {
                    agent_ready = true;
                    ending.push(("agent ready again", since_device(self.device_started)));
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
                settled.get_or_insert((Instant::now(), self.crash_grace));
            }
            if reuse && !hca_deleted && self.hca_deleted() {
                hca_deleted = true;
                ending.push(("HCA deleted", since_device(self.device_started)));
            }
            // The vhost-user connection belongs to the chardev, not the device: removing it hangs up on the device,
            // which then ends, and frees the id for the next run's chardev. Only after the result line: QEMU can
            // announce the removal before the runner has read the guest's last lines.
            if reuse && hca_deleted && result_seen && chardev_removed.is_none() {
                let removed = match qmp.as_mut() {
                    Some(q) => q.execute("chardev-remove", Some(serde_json::json!({ "id": HCA_CHARDEV })), QMP_CONNECT),
                    None => Err(crate::qmp::QmpError::Closed),
                };
                chardev_removed = Some(removed.is_ok());
                ending.push((
                    if removed.is_ok() { "chardev removed" } else { "chardev-remove failed" },
                    since_device(self.device_started),
                ));
                if let Err(e) = removed {
                    let what = format!("the guest will not serve again: chardev-remove: {e}");
                    (self.on)(Progress::Stage { run: self.run.name.clone(), what });
                }
            }
            if test_panic && last_offset > 0 {
                panic!("{TEST_PANIC_ENV} is set: the runner panics mid-run, with QEMU and the device running");
            }
            if !mid_run && last_offset > 0 {
                mid_run = true;
                // Both children surely live, and just before the soak's hook may kill one.
                sample(Point::FirstOutput, &mut false);
                phase_hook::at(Phase::MidRun, pids);
            }
            if let Some(status) = qemu.try_status()? {
                self.watched.qemu_exit = exit_of(status);
                break End::QemuExited;
            }
            if !device_gone {
                if let Some(status) = device.try_status()? {
                    self.watched.device_exit = exit_of(status);
                    // On a guest that may serve again, the device leaves once the agent ejected its HCA (after
                    // the result, whichever of the two the runner notices first): expected, if it ends well.
                    let ejected = result_seen || hca_deleted;
                    if !(reuse && ejected && self.watched.device_exit == (ProcessExit::Exited { code: 0 })) {
                        break End::DeviceExited;
                    }
                    device_gone = true;
                    ending.push(("device exited", since_device(self.device_started)));
                }
            }
            if reuse && agent_ready && chardev_removed == Some(true) && device_gone {
                break End::Recycled;
            }
            if let Some((at, grace)) = settled {
                sample(Point::End, &mut sampled);
                if result_seen && !reuse && !quit_sent {
                    // The result line is the guest's last word (its teardown is done and checked by then): QEMU is
                    // told to end instead of waiting for the guest's power-off. With SIGTERM, not QMP's `quit`:
                    // QEMU's monitor reads a command one byte per main-loop turn, and with the vCPU busy (the
                    // guest powering off) the 19 bytes of `quit` took 10-14 ms to be answered. QEMU ends on SIGTERM
                    // as on `quit` (a clean shutdown, exit status 0, a SHUTDOWN event on QMP).
                    quit_sent = true;
                    qemu.terminate();
                    ending.push(("SIGTERM sent to QEMU", since_device(self.device_started)));
                }
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
            pause()?;
        };
        sample(Point::End, &mut sampled);
        ending.push(("wait over", since_device(self.device_started)));
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
                if let Some(status) = wait_exit(&mut qemu, QEMU_AFTER_DEVICE)? {
                    self.watched.qemu_exit = exit_of(status);
                } else if self.watched.device_exit == (ProcessExit::Exited { code: 0 }) {
                    self.watched.rig_problems.push("vhca-device exited (status 0) while QEMU still ran".into());
                }
            }
            End::QemuExited | End::GraceOver | End::Recycled => {}
        }
        if end == End::Recycled {
            // Reuse is only asked for a restored guest, which has QMP and a console port.
            if let (Some(qmp), Some(port)) = (qmp.take(), port.take()) {
                self.write_ending(&ending);
                self.drain_reused_console(&mut serial);
                return Ok(Some(Loaded { qemu, qmp, port, timings: Default::default() }));
            }
        }
        if self.watched.qemu_exit == ProcessExit::Running {
            qemu.kill();
            self.watched.qemu_exit = ProcessExit::KilledByRunner;
        }
        if self.watched.device_exit == ProcessExit::Running {
            self.watched.device_exit = match wait_exit(&mut device, DEVICE_AFTER_QEMU)? {
                Some(status) => exit_of(status),
                None => {
                    device.kill();
                    ProcessExit::KilledByRunner
                }
            };
        }
        ending.push(("both exited", since_device(self.device_started)));
        self.write_ending(&ending);
        // A closed QMP socket still holds what QEMU wrote before it exited (GUEST_PANICKED comes just before).
        self.drain_qmp(qmp.as_mut());
        drop(qmp);
        drop(qemu);
        if let Some(port) = port {
            // QEMU is gone (exited, or killed and reaped): its last console bytes are still in the socket.
            port.close(CONSOLE_TAIL);
        }
        drop(device);
        for line in serial.poll().unwrap_or_default().into_iter().chain(serial.take_partial()) {
            self.absorb(&line);
            (self.on)(Progress::Serial { run: self.run.name.clone(), line });
        }
        Ok(None)
    }

    /// `ending.log`: when each stage of the run's end came.
    fn write_ending(&self, ending: &[(&str, f64)]) {
        let ending: String = ending.iter().map(|(what, s)| format!("{what} {s:.3} s\n")).collect();
        let _ = fs::write(self.files.ending_log(), format!("seconds after the device started\n{ending}"));
    }

    /// The last lines of a run whose guest serves again: everything up to the agent's readiness is in the log.
    fn drain_reused_console(&mut self, serial: &mut SerialLog) {
        for line in serial.poll().unwrap_or_default().into_iter().chain(serial.take_partial()) {
            self.absorb(&line);
            (self.on)(Progress::Serial { run: self.run.name.clone(), line });
        }
    }

    /// True once QEMU announced the HCA's removal (the agent ejected it).
    fn hca_deleted(&self) -> bool {
        self.watched.qmp_events.iter().any(|e| {
            e.get("event").and_then(|v| v.as_str()) == Some("DEVICE_DELETED")
                && e.get("data").and_then(|d| d.get("device")).and_then(|v| v.as_str()) == Some(HCA_DEVICE_ID)
        })
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
                    Some(b) => {
                        // A Windows guest prints no STOP line: show the Hyper-V crash MSRs in the NT model's form.
                        let what = format!("QMP GUEST_PANICKED (hyper-v): {}", b.stop_line());
                        (self.on)(Progress::Stage { run: self.run.name.clone(), what });
                        format!("STOP {:#X} (QMP)", b.code)
                    }
                    None => "GUEST_PANICKED".to_string(),
                };
                self.mark_crash(label);
            }
            self.watched.qmp_events.push(value);
        }
        panicked
    }
}
