//! The engine's state behind one mutex: the known threads, the schedule and the race detector, built from the
//! configuration at the first hook call of a run whose mode is not Off, and the pause a preempting mode takes.
//!
//! Its mutex is a leaf: nothing else is locked while it is held, so a hook may run under any model lock without
//! an order to keep, and a pause waits on its condition variable holding nothing else.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Instant;

use super::race_detector::RaceDetector;
use super::schedule::Schedule;
use super::threads::Threads;
use super::vector_clock::ThreadIdx;
use super::{InterleavingConfig, Preemption, RaceReport, Resumed, SchedulePoint};
use crate::lock;

pub(crate) struct State {
    pub threads: Threads,
    pub schedule: Schedule,
    pub races: RaceDetector,
    pub reports: Vec<RaceReport>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<Option<State>>,
    /// A thread passed a point, went quiescent or active, or ended: a paused thread looks again.
    changed: Condvar,
    /// Threads in `pause` now. Only they wait on `changed`, and a notify is a futex syscall even with no waiter:
    /// a recording, which never pauses, passes every point without one.
    paused: AtomicUsize,
}

/// The interleaving engine of one model.
#[derive(Default)]
pub(crate) struct Engine {
    shared: Arc<Shared>,
}

/// Marks the thread's entries gone when its OS thread ends, in every engine it was known to.
struct GoneGuards(Vec<(Weak<Shared>, ThreadIdx)>);

impl Drop for GoneGuards {
    fn drop(&mut self) {
        for (shared, t) in self.0.drain(..) {
            let Some(shared) = shared.upgrade() else { continue };
            if let Some(st) = lock(&shared.state).as_mut() {
                st.threads.known[t].gone = true;
            }
            shared.changed.notify_all();
        }
    }
}

thread_local! {
    static GONE: RefCell<GoneGuards> = const { RefCell::new(GoneGuards(Vec::new())) };
}

/// The engine's state, with the calling thread's index in it.
pub(crate) struct Locked<'e> {
    pub st: MutexGuard<'e, Option<State>>,
    pub me: ThreadIdx,
}

impl Locked<'_> {
    pub fn state(&mut self) -> &mut State {
        self.st.as_mut().expect("built when locked")
    }
}

impl Engine {
    /// Locks the state (building it on first use) with the calling thread registered.
    pub fn lock(&self, config: &InterleavingConfig) -> Locked<'_> {
        let mut st = lock(&self.shared.state);
        let state = st.get_or_insert_with(|| State {
            threads: Threads::default(),
            schedule: Schedule::new(&config.mode, config.pct_horizon),
            races: RaceDetector::default(),
            reports: Vec::new(),
        });
        let (me, first) = state.threads.me();
        if first {
            // try_with: a thread already tearing its locals down has no later point to be gone after.
            let _ = GONE.try_with(|g| g.borrow_mut().0.push((Arc::downgrade(&self.shared), me)));
        }
        Locked { st, me }
    }

    /// The state as it is, or None when no hook ran (the mode is Off, or nothing happened yet).
    pub fn peek<T>(&self, f: impl FnOnce(&State) -> T) -> Option<T> {
        lock(&self.shared.state).as_ref().map(f)
    }

    /// Something a paused thread waits for may have changed. Called after the change was made under the state's
    /// lock: a thread that starts to pause after this load sees the change when it first looks.
    pub fn changed(&self) {
        if self.shared.paused.load(Ordering::SeqCst) > 0 {
            self.shared.changed.notify_all();
        }
    }

    /// Pauses the calling thread at `point` until every other known thread is quiescent, none progressed for
    /// `settle`, or `limit` passed; records the pause. Called holding no lock of the model (the hooks' callers
    /// hold none at a point), and the paused thread counts as quiescent for everyone else, so two paused threads
    /// release each other and a thread blocked on a lock the paused one holds lets it go on.
    pub fn pause(&self, config: &InterleavingConfig, point: &SchedulePoint) {
        self.shared.paused.fetch_add(1, Ordering::SeqCst);
        let mut locked = self.lock(config);
        let me = locked.me;
        let start = Instant::now();
        locked.state().threads.known[me].paused = true;
        let mut st = locked.st;
        let resumed = loop {
            let state = st.as_mut().expect("built when locked");
            if state.threads.others_quiescent(me) {
                break Resumed::Quiescent;
            }
            let now = Instant::now();
            let paused = now - start;
            if paused >= config.limit {
                break Resumed::Limit;
            }
            let last = state.threads.others_progressed(me).map_or(start, |p| p.max(start));
            let still = now - last;
            if still >= config.settle {
                break Resumed::Settled;
            }
            let wait = (config.limit - paused).min(config.settle - still);
            st = self.shared.changed.wait_timeout(st, wait).unwrap_or_else(|e| e.into_inner()).0;
        };
        let state = st.as_mut().expect("built when locked");
        let me_now = &mut state.threads.known[me];
        me_now.paused = false;
        me_now.progressed = Instant::now();
        state.schedule.preemptions.push(Preemption {
            id: point.id.clone(),
            kind: point.kind.clone(),
            site: point.site.clone(),
            paused: start.elapsed(),
            resumed,
        });
        drop(st);
        self.shared.paused.fetch_sub(1, Ordering::SeqCst);
        self.changed();
    }
}
