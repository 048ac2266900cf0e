//! Named points of a run where something outside the normal path can step in. The platform-fault tests pause the
//! runner at one (test-only, through `PAUSE_AT_ENV`/`PAUSE_DIR_ENV`) to kill QEMU or the device in a window they could
//! not hit from outside, e.g. while QEMU loads the snapshot or between a work dir's claim and its removal; the soak kills
//! a child mid-run through `set`. With neither, a point costs one initialised `OnceLock` read and one atomic load.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::Serialize;

/// TEST ONLY: comma-separated phase names (`Phase::name`) at which the runner pauses.
pub const PAUSE_AT_ENV: &str = "VHCA_RUN_TEST_PAUSE_AT";
/// TEST ONLY: where the paused runner writes `<phase>-<n>.pids` (JSON `Pids`, n counting from 1 per phase) and then
/// waits for the test to create `<phase>-<n>.go`.
pub const PAUSE_DIR_ENV: &str = "VHCA_RUN_TEST_PAUSE_DIR";
/// A test that never says go does not hold the runner forever.
const PAUSE_LIMIT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The session's snapshot was checked against its record; no run has restored from it yet.
    SnapshotChecked,
    /// QEMU was told to load the snapshot (`migrate-incoming`) and has not finished: a run's own restore, or the
    /// guest loaded ahead for the worker's next run (`load_ahead`).
    Load,
    /// The HCA's chardev was added (QEMU is connected to the device) and its `device_add` is next.
    HotPlug,
    /// The guest of a run wrote its first console output: QEMU and the device both run.
    MidRun,
    /// A work dir was made and has no owner file yet (`leftovers`): only its name says whose it is.
    WorkDirMade,
    /// A work dir's claim is about to be released: its owner file is there and locked (e.g. a run's children are
    /// reaped and its evidence gathered).
    ClaimReleasing,
    /// A work dir's owner file is gone and the dir is still there (e.g. its files are being stored as artifacts).
    ClaimReleased,
    /// A run's artifacts are stored and its work dir is removed next.
    WorkDirRemoval,
}

const PHASES: [Phase; 8] = [
    Phase::SnapshotChecked,
    Phase::Load,
    Phase::HotPlug,
    Phase::MidRun,
    Phase::WorkDirMade,
    Phase::ClaimReleasing,
    Phase::ClaimReleased,
    Phase::WorkDirRemoval,
];

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::SnapshotChecked => "snapshot-checked",
            Phase::Load => "load",
            Phase::HotPlug => "hot-plug",
            Phase::MidRun => "mid-run",
            Phase::WorkDirMade => "work-dir-made",
            Phase::ClaimReleasing => "claim-releasing",
            Phase::ClaimReleased => "claim-released",
            Phase::WorkDirRemoval => "work-dir-removal",
        }
    }

    fn index(self) -> usize {
        PHASES.iter().position(|p| *p == self).unwrap_or(0)
    }
}

/// The processes of the run at that point, where the point knows them.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct Pids {
    pub qemu: Option<u32>,
    pub device: Option<u32>,
}

pub type Hook = Arc<dyn Fn(Phase, Pids) + Send + Sync>;

static ARMED: AtomicBool = AtomicBool::new(false);
static HOOK: Mutex<Option<Hook>> = Mutex::new(None);

/// Installs (or with None removes) the in-process hook, called at every point on the thread that reaches it.
pub fn set(hook: Option<Hook>) {
    let armed = hook.is_some();
    if let Ok(mut h) = HOOK.lock() {
        *h = hook;
    }
    ARMED.store(armed, Ordering::SeqCst);
}

/// Whether an in-process hook is installed (the soak's kill): the run samples its children before calling it.
pub fn armed() -> bool {
    ARMED.load(Ordering::SeqCst)
}

/// The test-only pause, from the environment.
struct Pause {
    phases: Vec<Phase>,
    dir: PathBuf,
    seen: [AtomicUsize; PHASES.len()],
}

fn pause_config() -> Option<&'static Pause> {
    static PAUSE: OnceLock<Option<Pause>> = OnceLock::new();
    PAUSE
        .get_or_init(|| {
            let names = std::env::var(PAUSE_AT_ENV).ok()?;
            let dir = PathBuf::from(std::env::var_os(PAUSE_DIR_ENV)?);
            let phases = PHASES.into_iter().filter(|p| names.split(',').any(|n| n.trim() == p.name())).collect();
            Some(Pause { phases, dir, seen: Default::default() })
        })
        .as_ref()
}

/// The runner reached `phase`.
pub fn at(phase: Phase, pids: Pids) {
    if let Some(pause) = pause_config() {
        if pause.phases.contains(&phase) {
            pause.wait(phase, pids);
        }
    }
    if ARMED.load(Ordering::SeqCst) {
        let hook = HOOK.lock().ok().and_then(|h| h.clone());
        if let Some(hook) = hook {
            hook(phase, pids);
        }
    }
}

impl Pause {
    fn wait(&self, phase: Phase, pids: Pids) {
        let n = self.seen[phase.index()].fetch_add(1, Ordering::SeqCst) + 1;
        let stem = format!("{}-{n}", phase.name());
        let marker = self.dir.join(format!("{stem}.pids"));
        let staging = self.dir.join(format!(".{stem}.pids"));
        // Renamed into place, so the test never reads a half-written marker.
        let json = serde_json::to_string(&pids).unwrap_or_default();
        if std::fs::write(&staging, json).and_then(|()| std::fs::rename(&staging, &marker)).is_err() {
            return;
        }
        let go = self.dir.join(format!("{stem}.go"));
        let end = Instant::now() + PAUSE_LIMIT;
        while !go.exists() && Instant::now() < end && !crate::supervise::interrupted() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_index_back() {
        for (i, p) in PHASES.iter().enumerate() {
            assert_eq!(p.index(), i);
            assert_eq!(PHASES.iter().filter(|q| q.name() == p.name()).count(), 1);
        }
    }

    #[test]
    fn the_hook_sees_each_point_until_removed() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        set(Some(Arc::new(move |phase, pids| sink.lock().unwrap().push((phase, pids.qemu)))));
        at(Phase::MidRun, Pids { qemu: Some(7), device: None });
        set(None);
        at(Phase::MidRun, Pids::default());
        assert_eq!(*seen.lock().unwrap(), vec![(Phase::MidRun, Some(7))]);
    }
}
