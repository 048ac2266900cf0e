//! Vector clocks for the race detector: one logical clock per known thread, joined along happens-before edges,
//! and the epoch (thread, clock) an access is stamped with.
//!
//! Threads are dense indices (the order the engine first saw them), so a clock is a plain vector that grows as
//! threads appear: a missing component is 0, "never heard of".

/// A thread's dense index in the engine's registry.
pub(crate) type ThreadIdx = usize;

/// One access's timestamp: the accessing thread and its own clock component then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Epoch {
    pub thread: ThreadIdx,
    pub clock: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct VectorClock(Vec<u32>);

impl VectorClock {
    /// A new thread's clock: its own component at 1, so its first accesses are after "never" (0) in everyone's
    /// view and before anything it releases.
    pub fn for_thread(thread: ThreadIdx) -> VectorClock {
        let mut vc = VectorClock::default();
        vc.set(thread, 1);
        vc
    }

    pub fn get(&self, thread: ThreadIdx) -> u32 {
        self.0.get(thread).copied().unwrap_or(0)
    }

    fn set(&mut self, thread: ThreadIdx, clock: u32) {
        if self.0.len() <= thread {
            self.0.resize(thread + 1, 0);
        }
        self.0[thread] = clock;
    }

    /// Everything `other` saw, this clock now saw too.
    pub fn join(&mut self, other: &VectorClock) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (mine, theirs) in self.0.iter_mut().zip(&other.0) {
            *mine = (*mine).max(*theirs);
        }
    }

    /// The owner's next step: what it does from now on is after what it released before.
    pub fn tick(&mut self, thread: ThreadIdx) {
        let next = self.get(thread).saturating_add(1);
        self.set(thread, next);
    }

    /// The owner's epoch now.
    pub fn epoch(&self, thread: ThreadIdx) -> Epoch {
        Epoch { thread, clock: self.get(thread) }
    }

    /// Whether the access stamped `epoch` happened before everything this clock's owner does now.
    pub fn has_seen(&self, epoch: Epoch) -> bool {
        epoch.clock <= self.get(epoch.thread)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_then_acquire_orders_only_what_came_before_the_release() {
        let (a, b) = (0, 1);
        let mut va = VectorClock::for_thread(a);
        let mut vb = VectorClock::for_thread(b);
        let before = va.epoch(a);
        let mut lock = VectorClock::default();
        lock.join(&va);
        va.tick(a);
        let after = va.epoch(a);
        assert!(!vb.has_seen(before));
        vb.join(&lock);
        assert!(vb.has_seen(before));
        assert!(!vb.has_seen(after), "an access after the release stays unordered");
    }
}
