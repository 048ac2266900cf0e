//! A restored guest loaded ahead of its run: while one run goes on, its worker starts the QEMU of its next run and
//! loads the snapshot into it, paused; the next run then only hot-plugs its HCA and continues. QEMU's start and the
//! load (about 0.3 s of a run) leave the runs' critical path. A loaded guest that no run takes is killed and reaped
//! when its worker ends.
//!
//! QEMU is spawned by the worker thread that will use it (PR_SET_PDEATHSIG follows the spawning thread); a helper
//! thread only talks to it (console, QMP, the load).

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::qmp::Qmp;
use crate::restore::{self, RestoreError, Timings};
use crate::run::{plan_restore, RunFiles};
use crate::serial_capture::ConsolePort;
use crate::snapshot::Snapshot;
use crate::supervise::Supervised;

/// QEMU creates its QMP and console sockets at once; waiting longer only delays noticing a QEMU that died at start.
const CONNECT: Duration = Duration::from_secs(5);

/// A guest that is loaded, or loading, in its own work dir (which becomes its run's).
pub struct WarmGuest {
    /// Declared first so it drops first: QEMU is gone before its work dir is removed.
    pub loading: Loading,
    pub work: tempfile::TempDir,
    /// The work dir's owner lock (leftovers.rs): a runner killed while this guest waits leaves a dir the next sweeps.
    pub claim: crate::leftovers::WorkDirClaim,
    key: String,
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

impl WarmGuest {
    /// Spawns QEMU for the snapshot's machine in a fresh work dir and loads the state on a helper thread.
    pub fn start(snapshot: &Snapshot) -> std::io::Result<WarmGuest> {
        let work = tempfile::Builder::new().prefix("vhca-run-").tempdir()?;
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
        Ok(WarmGuest { loading: Loading { qemu_pid, handle: Some(handle) }, work, claim, key: snapshot.key.clone() })
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

/// A restored guest that served a run and said it can serve another (its agent's readiness line came after the
/// run's result, its HCA ejected and the device gone): running, its agent waiting for the next request on the
/// console. Its QEMU has translated the paths a run takes, which a fresh QEMU translates afresh.
pub struct ReadyGuest {
    /// Declared first so it drops first: QEMU is gone before its work dir is removed.
    pub loaded: Loaded,
    pub work: tempfile::TempDir,
    pub claim: crate::leftovers::WorkDirClaim,
    key: String,
    /// Runs this guest served so far.
    pub served: u32,
}

impl ReadyGuest {
    pub fn new(loaded: Loaded, home: GuestHome, served: u32) -> ReadyGuest {
        ReadyGuest { loaded, work: home.work, claim: home.claim, key: home.key, served }
    }

    /// The guest, its home, and how many runs it served.
    pub fn into_parts(self) -> (Loaded, GuestHome, u32) {
        let ReadyGuest { loaded, work, claim, key, served } = self;
        (loaded, GuestHome { work, claim, key }, served)
    }
}

/// The work dir of a guest's QEMU (its sockets and its log) and its claim, kept for as long as the guest lives,
/// which may be longer than one run.
pub struct GuestHome {
    pub work: tempfile::TempDir,
    pub claim: crate::leftovers::WorkDirClaim,
    key: String,
}

/// A worker's guest for its next run: one loading, or one that served a run already.
enum Ahead {
    Loading(WarmGuest),
    Ready(ReadyGuest),
}

/// What a run gets: a guest still loading (or loaded, paused), or one that served a run and waits for the next.
pub enum Taken {
    Loading(Loading, GuestHome),
    Ready(ReadyGuest),
}

thread_local! {
    /// This worker's guest for its next run.
    static NEXT: RefCell<Option<Ahead>> = const { RefCell::new(None) };
    /// Whether this worker may have another run after the current one (set by the suite loop; off elsewhere, so a
    /// lone `execute` never leaves a loaded guest behind).
    static MORE: Cell<bool> = const { Cell::new(false) };
}

/// Tells this worker's next `load_next` whether a run may follow the one it is about to start. A guest already
/// loaded ahead is for that run and stays; the worker's end (`discard`) drops one no run took.
pub fn expect_more_runs(more: bool) {
    MORE.with(|m| m.set(more));
}

/// True if this worker may have another run after its current one.
pub fn more_runs_expected() -> bool {
    MORE.with(Cell::get)
}

/// The guest for this worker's run: the one that served its last run, the one loaded ahead for `snapshot`, or one
/// started now.
pub fn take(snapshot: &Snapshot) -> std::io::Result<Taken> {
    let taken = |warm: WarmGuest| {
        let home = GuestHome { work: warm.work, claim: warm.claim, key: warm.key };
        Taken::Loading(warm.loading, home)
    };
    match NEXT.with(|n| n.borrow_mut().take()) {
        Some(Ahead::Ready(ready)) if ready.key == snapshot.key => Ok(Taken::Ready(ready)),
        Some(Ahead::Loading(warm)) if warm.key == snapshot.key => Ok(taken(warm)),
        _ => WarmGuest::start(snapshot).map(taken),
    }
}

/// The guest this worker keeps for its next run, if it keeps one: its QEMU's pid and its work dir (for the soak,
/// which must tell it from a leftover).
pub fn kept_guest() -> Option<(u32, PathBuf)> {
    NEXT.with(|n| match &*n.borrow() {
        Some(Ahead::Ready(ready)) => Some((ready.loaded.qemu.pid(), ready.work.path().to_path_buf())),
        _ => None,
    })
}

/// Keeps a guest that served a run for this worker's next one (dropped, QEMU killed and reaped, if none comes).
pub fn keep(ready: ReadyGuest) {
    NEXT.with(|n| *n.borrow_mut() = Some(Ahead::Ready(ready)));
}

/// Starts loading this worker's next guest while its current run goes on. A failure only means the next run
/// starts its QEMU itself.
pub fn load_next(snapshot: &Snapshot) {
    if !MORE.with(Cell::get) || !snapshot.usable() {
        return;
    }
    if let Ok(warm) = WarmGuest::start(snapshot) {
        NEXT.with(|n| *n.borrow_mut() = Some(Ahead::Loading(warm)));
    }
}

/// Drops this worker's guest loaded ahead, if any (the worker has no run left for it).
pub fn discard() {
    NEXT.with(|n| n.borrow_mut().take());
}
