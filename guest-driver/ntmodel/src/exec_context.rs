//! Contexts a thread lends the kernel. A DPC or an ISR runs on whatever thread its processor was running, at its
//! own IRQL and holding none of that thread's locks; the thread gets its own state back when the routine returns.

use vhca_ntapi::KIRQL;

use crate::watchdog::ThreadWatch;
use crate::NtModel;

/// The lending thread's own state, put back when the borrowed context ends (also when a bugcheck unwinds it).
struct Lent<'m> {
    model: &'m NtModel,
    irql: KIRQL,
    held: Vec<u64>,
    watch: ThreadWatch,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let held = std::mem::take(&mut self.held);
        let (irql, watch) = (self.irql, self.watch);
        self.model.with_thread(|t| {
            t.irql = irql;
            t.held = held;
            t.watch = watch;
        });
    }
}

impl NtModel {
    /// Runs `f` in a fresh context of the calling thread at `irql` (DISPATCH_LEVEL or above). Its locks start
    /// empty, so the deadlock detector sees a DPC's or ISR's lock order apart from the thread it interrupted, as
    /// it would on another processor; the watchdog's stretch at DISPATCH_LEVEL goes on from the interrupted
    /// context if that one was already there.
    pub(crate) fn in_borrowed_context<T>(&self, irql: KIRQL, f: impl FnOnce() -> T) -> T {
        let now = self.clock.now();
        let lent = self.with_thread(|t| {
            let lent = Lent { model: self, irql: t.irql, held: std::mem::take(&mut t.held), watch: t.watch };
            t.irql = irql;
            t.watch = ThreadWatch { dispatch_since: Some(t.watch.dispatch_since.unwrap_or(now)), routine_since: None };
            lent
        });
        let r = f();
        drop(lent);
        r
    }

    /// Calls a DPC or ISR body in the current (borrowed) context, marking it for the watchdog's single-routine
    /// count; returns what it returned and when it was called.
    pub(crate) fn timed_routine<T>(&self, f: impl FnOnce() -> T) -> (T, u64) {
        let started = self.clock.now();
        self.with_thread(|t| t.watch.routine_since = Some(started));
        let r = f();
        self.with_thread(|t| t.watch.routine_since = None);
        (r, started)
    }
}
