//! One concrete run, in sequence: its plan (run_plan.rs) in a private work dir, the device first, then the guest
//! restored from the snapshot with the HCA hot-plugged (restore_step.rs) or booted cold (cold_boot.rs), watched until
//! the guest's result, a crash, silence, a dead process or the timeout (watch.rs), its processes ended
//! (teardown.rs), the evidence gathered. Every child is stopped and reaped before `execute` returns, and the work dir
//! goes with it unless kept.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vhca_suite::{BootPath, ConcreteRun, ProcessExit};

use crate::child_wait::exit_of;
use crate::cold_boot::{self, Booted};
use crate::device::{self, DeviceError};
use crate::evidence::{self, Evidence};
use crate::guest_reuse::ReadyGuest;
use crate::load_ahead::{GuestHome, Loaded};
use crate::next_guest;
use crate::qemu_cmd::VhostUserDevice;
use crate::restore::{self, RestoreError};
use crate::restore_step::{continue_restored, Restored};
use crate::run_context::RunContext;
use crate::run_files::RunFiles;
use crate::run_plan::{plan, plan_restore, record_command_lines};
use crate::run_progress::Progress;
use crate::snapshot::Snapshot;
use crate::supervise::SuperviseError;
use crate::teardown;
use crate::watch::{Watch, WatchEnd, Watched, AFTER_CRASH};
use crate::windows_guest::run_boot;

const DEVICE_START: Duration = Duration::from_secs(10);

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
    // A saved machine restores only with the vCPUs it was saved with: a run asking for others boots cold.
    let same_cpus = |s: &&Arc<Snapshot>| s.machine.vcpus == crate::run_plan::vcpus(run);
    if let Some(snapshot) = ctx.snapshot.as_ref().filter(|s| s.usable()).filter(same_cpus) {
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
        Some(s) => Some(next_guest::take(s)?),
        None => None,
    };
    let temp = crate::leftovers::work_dir("vhca-run-")?;
    let _claim = crate::leftovers::claim(temp.path())?;
    let files = RunFiles { dir: temp.path().to_path_buf() };
    let (device_cfg, cold_cfg) = plan(ctx, run, &files.dir);
    let qemu_cfg = match snapshot {
        Some(s) => plan_restore(&s.machine, &files.dir),
        None => cold_cfg,
    };
    let access_platform = !run.device.without_access_platform;
    let hca = VhostUserDevice { socket: files.socket(), carrier: ctx.carrier, access_platform };
    let request = restore::request_line(&run.guest_params());
    let windows = match &ctx.windows {
        Some(image) => Some(
            run_boot::prepare(
                image,
                &ctx.bins.qemu,
                ctx.accel,
                run.verifier_flags,
                hca.clone(),
                &files.dir,
                (ctx.gdb, ctx.paused),
            )
            .map_err(std::io::Error::other)?,
        ),
        None => None,
    };
    record_command_lines(&files, &device_cfg, &qemu_cfg, windows.as_ref(), snapshot.map(Arc::as_ref), &hca, &request)?;
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
            let started = match (snapshot, guest) {
                (Some(s), Some(guest)) => {
                    stage(on, format!("continuing the restored guest ({})", ctx.accel.name()));
                    // Any failure here drops both guards (device and QEMU killed and reaped) with the work dir.
                    match continue_restored(&files, guest, s, &hca, &request, device_started, &mut device)? {
                        Restored::Continued(loaded, guest_home, served, log_from) => {
                            let Loaded { qemu, qmp, port, .. } = *loaded;
                            // The next run's guest loads while this one runs, unless this one may serve it.
                            if !ctx.reuse_guests || !crate::guest_reuse::may_serve_again(run) {
                                next_guest::load_next(s);
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
                    match cold_boot::boot(&qemu_cfg, windows.as_ref(), &files, run, &request, on)? {
                        Booted::Started(qemu, qmp, port) => Some((qemu, qmp, port)),
                        Booted::NoRequest { mut qemu, why, timed_out } => {
                            watched.timed_out |= timed_out;
                            teardown::stop_unstarted(&mut qemu, &mut device, &mut watched, why)?;
                            None
                        }
                    }
                }
            };
            // The watch and then the teardown own both guards: both processes are stopped and reaped when they
            // return, however they return.
            let crash_grace = if windows.is_some() { run_boot::DUMP_GRACE } else { AFTER_CRASH };
            if let Some((qemu, qmp, port)) = started {
                // A restored Linux guest may serve this worker's next run, if the run leaves it clean.
                let reuse = ctx.reuse_guests
                    && home.is_some()
                    && windows.is_none()
                    && crate::guest_reuse::may_serve_again(run)
                    && next_guest::more_runs_expected();
                let mut w = Watch { ctx, run, files: &files, device_started, watched: &mut watched, on, crash_grace };
                match w.run(device, qemu, qmp, port, reuse)? {
                    WatchEnd::Recycled(loaded) => recycled = Some(loaded),
                    WatchEnd::Over(remains) => teardown::stop_and_reap(&mut w, remains)?,
                }
            }
        }
        Err(DeviceError::ExitedEarly { status }) => {
            watched.device_exit = exit_of(status);
            watched.rig_problems.push(format!("vhca-device exited during start-up ({status})"));
        }
        Err(DeviceError::NoSocket { socket, secs }) => {
            watched.device_exit = ProcessExit::KilledByRunner;
            watched.rig_problems.push(format!("vhca-device did not create {socket} within {secs} s"));
        }
        Err(DeviceError::Process(e)) => return Err(e.into()),
    }
    if let Some((guest_home, served, log_from)) = home {
        teardown::copy_log_tail(&guest_home.work.path().join("qemu.log"), log_from, &files.qemu_log());
        if let Some(loaded) = recycled {
            next_guest::keep(ReadyGuest::new(loaded, guest_home, served + 1));
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    if windows.is_some() {
        run_boot::keep_disk_if_crashed(&files.dir, watched.crash_mark.is_some());
    }
    let evidence = evidence::gather(run, &files, watched, ctx.gdb.is_some() || ctx.paused)?;
    let work = if ctx.keep { WorkDir::Kept(crate::leftovers::keep(temp)?) } else { WorkDir::Temp(temp) };
    let path = if snapshot.is_some() { BootPath::Snapshot } else { BootPath::Cold };
    Ok(Attempt::Done(Box::new(RunRecord { evidence, seconds, path, notes: Vec::new(), work })))
}
