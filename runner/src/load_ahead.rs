//! A restored guest loaded ahead of its run: while one run goes on, its worker starts the QEMU of its next run and
//! loads the snapshot into it, paused; the next run then only hot-plugs its HCA and continues. QEMU's start and the
//! load (about 0.3 s of a run) leave the runs' critical path. A loaded guest that no run takes is killed and reaped
//! when its worker ends.
//!
//! QEMU is spawned by the worker thread that will use it (PR_SET_PDEATHSIG follows the spawning thread); a helper
//! thread only talks to it (console, QMP, the load).

use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::qmp::Qmp;
use crate::restore::{self, RestoreError, Timings};
use crate::run_files::RunFiles;
use crate::run_plan::plan_restore;
use crate::serial_capture::ConsolePort;
use crate::snapshot::Snapshot;
use crate::supervise::Supervised;

/// QEMU creates its QMP and console sockets at once; waiting longer only delays noticing a QEMU that died at start.
const CONNECT: Duration = Duration::from_secs(5);

/// A guest that is loaded, or loading, in its own work dir (which becomes its run's).
pub struct WarmGuest {
    /// Declared first so it drops first: QEMU is gone before its work dir is removed.
    pub loading: Loading,
    pub home: GuestHome,
}

/// The load under way on its helper thread. Dropped unused, it kills QEMU's process group so the thread returns at
/// once, and the thread's guard reaps QEMU.
pub struct Loading {
    qemu_pid: u32,
    handle: Option<JoinHandle<Result<Loaded, RestoreError>>>,
}

/// A guest ready for its run: paused, the saved state loaded, console and QMP connected.
pub struct Loaded {
    pub qemu: Supervised,
    pub qmp: Qmp,
    pub port: ConsolePort,
    /// Connect and load, in seconds, from QEMU's spawn.
    pub timings: Timings,
}

/// The work dir of a guest's QEMU (its sockets and its log) and its claim, kept for as long as the guest lives,
/// which may be longer than one run.
pub struct GuestHome {
    pub work: tempfile::TempDir,
    /// The work dir's owner lock (leftovers.rs): a runner killed while this guest waits leaves a dir the next sweeps.
    pub claim: crate::leftovers::WorkDirClaim,
    key: String,
}

impl GuestHome {
    /// True if this guest's QEMU was loaded from `snapshot`.
    pub fn is_of(&self, snapshot: &Snapshot) -> bool {
        self.key == snapshot.key
    }
}

impl WarmGuest {
    /// Spawns QEMU for the snapshot's machine in a fresh work dir and loads the state on a helper thread.
    pub fn start(snapshot: &Snapshot) -> std::io::Result<WarmGuest> {
        let work = crate::leftovers::work_dir("vhca-run-")?;
        let claim = crate::leftovers::claim(work.path())?;
        let files = RunFiles { dir: work.path().to_path_buf() };
        let config = plan_restore(&snapshot.machine, &files.dir);
        let mut qemu =
            Supervised::spawn("qemu", config.command(), Some(&files.qemu_log())).map_err(std::io::Error::other)?;
        let qemu_pid = qemu.pid();
        let state: PathBuf = snapshot.state.clone();
        let spawned = Instant::now();
        let handle = std::thread::Builder::new().name("warm-guest".into()).spawn(move || {
            let setup =
                |step: &'static str| move |e: String| RestoreError::Failed { step, why: e, snapshot_bad: false };
            let port = ConsolePort::connect(&files.serial_socket(), &files.serial(), CONNECT)
                .map_err(|e| setup("console")(e.to_string()))?;
            let mut qmp = Qmp::connect(&files.qmp(), CONNECT).map_err(|e| setup("QMP")(e.to_string()))?;
            let connected = spawned.elapsed().as_secs_f64();
            let mut timings = restore::load(&mut qmp, &mut qemu, &state, &files.qemu_log())?;
            timings.steps.insert(0, ("QEMU up (QMP and console connected)", connected));
            Ok(Loaded { qemu, qmp, port, timings })
        })?;
        let home = GuestHome { work, claim, key: snapshot.key.clone() };
        Ok(WarmGuest { loading: Loading { qemu_pid, handle: Some(handle) }, home })
    }
}

impl Loading {
    /// Waits for the load (at once when it finished ahead); the guest, or why it cannot serve.
    pub fn ready(mut self) -> Result<Loaded, RestoreError> {
        let failed = |why: &str| RestoreError::Failed { step: "loading ahead", why: why.into(), snapshot_bad: false };
        match self.handle.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(failed("the loader thread panicked")),
            None => Err(failed("the guest was already taken")),
        }
    }
}

impl Drop for Loading {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            if let Ok(pgid) = i32::try_from(self.qemu_pid) {
                // SAFETY: kill(2) on the process group Supervised::spawn made for this QEMU (its pid is the group's
                // id); the leader is not reaped, so the id cannot be reused, until the thread joined below drops it.
                unsafe { libc::kill(-pgid, libc::SIGKILL) };
            }
            let _ = handle.join();
        }
    }
}
