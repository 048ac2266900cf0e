//! The threads the engine knows: their stable names, their activity (what a paused thread waits for) and when
//! each last made progress (what "settled" means).
//!
//! A thread is known from its first hook call. It is active from then until `quiescent`, again after `active`;
//! a thread paused at a point, or whose OS thread is gone, is quiescent too.

use std::collections::HashMap;
use std::thread::ThreadId;
use std::time::Instant;

use super::vector_clock::ThreadIdx;

pub(crate) struct KnownThread {
    pub name: String,
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
        let id = std::thread::current().id();
        if let Some(i) = self.index.get(&id) {
            return (*i, false);
        }
        let name = match std::thread::current().name() {
            Some(name) => name.to_string(),
            None => {
                self.unnamed += 1;
                format!("thread-{}", self.unnamed)
            }
        };
        let i = self.known.len();
        self.known.push(KnownThread {
            name,
            points: 0,
            active: true,
            paused: false,
            gone: false,
            progressed: Instant::now(),
        });
        self.index.insert(id, i);
        (i, true)
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
