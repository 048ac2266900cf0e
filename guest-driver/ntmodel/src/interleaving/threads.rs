//! The threads the engine knows: their stable names, their activity (what a paused thread waits for) and when
//! each last made progress (what "settled" means).
//!
//! A thread is known from its first hook call, or from its start when the model starts it (`starting`). It is
//! active from then until it blocks or goes quiescent, again after `active` or once a waker woke its wait channel;
//! a thread paused at a point, or whose OS thread is gone, is quiescent too.
//!
//! A woken thread counts as active from the moment it is woken, not from when it runs again: otherwise a thread
//! paused at a point sees every other one quiescent in the gap between a signal and the woken thread's first step,
//! resumes, and the woken thread's work lands after the pause instead of inside it (a schedule that reaches its
//! race only when the host happens to run the woken thread first).

use std::collections::HashMap;
use std::thread::ThreadId;
use std::time::Instant;

use super::vector_clock::ThreadIdx;

/// What a blocked thread sleeps on in the model: whatever wakes it wakes that channel. A wake may mark a thread
/// whose condition still does not hold (another waiter took the signal, a shared lock is still held): it looks
/// again, finds so, and blocks again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitChannel {
    /// A dispatcher wait on the object at this address (KeWaitForSingleObject; 0 for KeDelayExecutionThread, which
    /// waits on none). Its wakes are signals: the clock's "look again" is none, so a wait that ends by its timeout
    /// counts as running only once its thread runs.
    Dispatcher(u64),
    /// The lock at this address (fast mutex, guarded mutex, ERESOURCE, spin lock).
    Lock(u64),
    /// A processor held at DISPATCH_LEVEL or above by another context, or masking an interrupt.
    Processors,
    /// The model's DPC thread of this processor, idle until a DPC is queued for it.
    DpcThread(u32),
    /// The system worker pool: an idle worker, or a thread waiting for the running routines to end.
    Workers,
}

pub(crate) struct KnownThread {
    pub name: String,
    /// The thread itself made a hook call (a thread the model started is known before it runs).
    sighted: bool,
    /// The channel the thread sleeps on, until a waker wakes it or it runs on.
    pub blocked_on: Option<WaitChannel>,
    /// Points this thread passed (the last PointId's index).
    pub points: u32,
    pub active: bool,
    pub paused: bool,
    pub gone: bool,
    /// The last point passed or wake-up (`active`).
    pub progressed: Instant,
}

impl KnownThread {
    fn quiescent(&self) -> bool {
        self.gone || self.paused || !self.active
    }
}

#[derive(Default)]
pub(crate) struct Threads {
    index: HashMap<ThreadId, ThreadIdx>,
    pub known: Vec<KnownThread>,
    /// Unnamed threads seen so far: the next one is `thread-<this + 1>`.
    unnamed: u32,
}

impl Threads {
    /// The calling thread's index, and whether this is its first sighting.
    pub fn me(&mut self) -> (ThreadIdx, bool) {
        let current = std::thread::current();
        let i = self.known_as(&current);
        let first = !std::mem::replace(&mut self.known[i].sighted, true);
        (i, first)
    }

    /// `thread` is starting (the model spawned it): it is active from now, as a woken thread is, though it has not
    /// run yet.
    pub fn starting(&mut self, thread: &std::thread::Thread) {
        self.known_as(thread);
    }

    /// `thread`'s index, known from now on (active) if it was not.
    fn known_as(&mut self, thread: &std::thread::Thread) -> ThreadIdx {
        if let Some(i) = self.index.get(&thread.id()) {
            return *i;
        }
        let name = match thread.name() {
            Some(name) => name.to_string(),
            None => {
                self.unnamed += 1;
                format!("thread-{}", self.unnamed)
            }
        };
        let i = self.known.len();
        self.known.push(KnownThread {
            name,
            sighted: false,
            blocked_on: None,
            points: 0,
            active: true,
            paused: false,
            gone: false,
            progressed: Instant::now(),
        });
        self.index.insert(thread.id(), i);
        i
    }

    /// Every thread blocked on `channel` is active again; true when there was one.
    pub fn wake(&mut self, channel: WaitChannel) -> bool {
        let mut woke = false;
        for t in self.known.iter_mut().filter(|t| t.blocked_on == Some(channel)) {
            t.blocked_on = None;
            t.active = true;
            t.progressed = Instant::now();
            woke = true;
        }
        woke
    }

    /// Another thread is active: a preemption of `me` now can change what it sees.
    pub fn other_active(&self, me: ThreadIdx) -> bool {
        self.known.iter().enumerate().any(|(i, t)| i != me && !t.quiescent())
    }

    pub fn others_quiescent(&self, me: ThreadIdx) -> bool {
        !self.other_active(me)
    }

    /// The latest progress any other thread made.
    pub fn others_progressed(&self, me: ThreadIdx) -> Option<Instant> {
        self.known.iter().enumerate().filter(|(i, _)| *i != me).map(|(_, t)| t.progressed).max()
    }
}
