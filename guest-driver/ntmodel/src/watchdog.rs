//! The DPC watchdog (0x133 DPC_WATCHDOG_VIOLATION): one DPC or ISR running past its allotment (P1 = 0), or a
//! processor kept at DISPATCH_LEVEL or above past the watchdog period (P1 = 1), both in ticks of the model's clock.

use vhca_ntapi::{DISPATCH_LEVEL, DPC_WATCHDOG_VIOLATION, KIRQL};

use crate::bugcheck::Bugcheck;
use crate::{lock, NtModel};

/// Parameter 1 of 0x133.
pub mod p1 {
    /// A single DPC or ISR exceeded its time allotment: P2 the ticks it ran, P3 the allotment.
    pub const SINGLE_ROUTINE: u64 = 0;
    /// Too long at DISPATCH_LEVEL or above in one stretch: P2 the watchdog period.
    pub const CUMULATIVE: u64 = 1;
}

/// What the watchdog counts for one thread's current context, in clock units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ThreadWatch {
    /// When the context reached DISPATCH_LEVEL or above; None below it.
    pub dispatch_since: Option<u64>,
    /// When the DPC or ISR the context runs was called; None outside one.
    pub routine_since: Option<u64>,
}

impl ThreadWatch {
    /// Follows an IRQL change at `now`; when the context drops below DISPATCH_LEVEL, returns when its stretch began.
    pub fn irql_changed(&mut self, old: KIRQL, new: KIRQL, now: u64) -> Option<u64> {
        match (old >= DISPATCH_LEVEL, new >= DISPATCH_LEVEL) {
            (false, true) => {
                self.dispatch_since = Some(now);
                None
            }
            (true, false) => self.dispatch_since.take(),
            _ => None,
        }
    }
}

impl NtModel {
    fn ticks_since(&self, since: u64) -> u64 {
        self.clock.now().saturating_sub(since) / self.timing.tick_100ns()
    }

    /// P1 = 0 when the DPC or ISR called at `started` has run more ticks than its allotment. Windows counts while
    /// the routine runs and stops it at the first tick over; the model counts where it looks (the routine's return,
    /// a stall inside it, a clock interrupt), so P2 is the count there.
    pub(crate) fn routine_overran(&self, started: u64) -> Result<(), Bugcheck> {
        let limit = self.timing.dpc_time_limit;
        let ticks = self.ticks_since(started);
        if limit > 0 && ticks > limit {
            self.found(Bugcheck::new(DPC_WATCHDOG_VIOLATION, p1::SINGLE_ROUTINE, ticks, limit, 0))?;
        }
        Ok(())
    }

    /// P1 = 1 when the stretch at DISPATCH_LEVEL or above that began at `since` is longer than the watchdog period.
    /// P3 (Windows: its triage block) is 0.
    pub(crate) fn dispatch_overran(&self, since: u64) -> Result<(), Bugcheck> {
        let limit = self.timing.dpc_watchdog_limit;
        if limit > 0 && self.ticks_since(since) > limit {
            self.found(Bugcheck::new(DPC_WATCHDOG_VIOLATION, p1::CUMULATIVE, limit, 0, 0))?;
        }
        Ok(())
    }

    fn watch_overran(&self, watch: ThreadWatch) -> Result<(), Bugcheck> {
        if let Some(started) = watch.routine_since {
            self.routine_overran(started)?;
        }
        if let Some(since) = watch.dispatch_since {
            self.dispatch_overran(since)?;
        }
        Ok(())
    }

    /// Both counts of the calling thread, where it stands now (KeStallExecutionProcessor).
    pub(crate) fn watchdog_check_current(&self) -> Result<(), Bugcheck> {
        let watch = self.with_thread(|t| t.watch);
        self.watch_overran(watch)
    }

    /// The clock interrupt's look at every processor: each thread at DISPATCH_LEVEL or above is a context its
    /// processor runs (the raised one, or an ISR interrupting it), and one below counts nothing.
    pub(crate) fn watchdog_check_all(&self) -> Result<(), Bugcheck> {
        let watches: Vec<ThreadWatch> = lock(&self.threads).values().map(|t| t.watch).collect();
        watches.into_iter().try_for_each(|w| self.watch_overran(w))
    }
}
