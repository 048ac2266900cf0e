//! Timers on the model's clock: KeInitializeTimer(Ex), KeSetTimer(Ex) (DueTime in 100 ns, negative = relative;
//! Period in ms), KeCancelTimer, and expiry, which signals the timer and queues its DPC.

use std::collections::HashMap;
use std::sync::Mutex;

use vhca_ntapi::*;

use crate::clock::UNITS_PER_MICROSECOND;
use crate::dispatcher::Reset;
use crate::interleaving::SyncObject;
use crate::{lock, NtModel};

struct Timer {
    /// When it expires next, in clock units; None when it is not set (not in the timer queue).
    due: Option<u64>,
    /// Clock units between expiries; 0 for a one-shot timer.
    period: u64,
    /// The DPC its expiry queues; NULL for none.
    dpc: PKDPC,
}

pub(crate) struct Timers {
    timers: Mutex<HashMap<u64, Timer>>,
}

impl Timers {
    pub fn new() -> Timers {
        Timers { timers: Mutex::new(HashMap::new()) }
    }
}

impl NtModel {
    pub(crate) fn timer_initialize(&self, timer_type: TIMER_TYPE) -> PKTIMER {
        self.irql_at_most(DISPATCH_LEVEL);
        let reset = match timer_type {
            TIMER_TYPE::NotificationTimer => Reset::Notification,
            TIMER_TYPE::SynchronizationTimer => Reset::Synchronization,
        };
        let timer = self.new_dispatcher_object(reset, false);
        lock(&self.timers.timers).insert(timer, Timer { due: None, period: 0, dpc: PKDPC::NULL });
        PKTIMER(timer)
    }

    /// KeSetTimerEx: a set timer is set anew (its earlier expiry and DPC call are gone); TRUE when it was set.
    /// A positive DueTime is absolute on the model's clock (0 = the model's start).
    pub(crate) fn timer_set(&self, timer: PKTIMER, due_time: i64, period_ms: u32, dpc: PKDPC) -> bool {
        self.irql_at_most(DISPATCH_LEVEL);
        if !dpc.is_null() && !self.dpc_known(dpc) {
            self.never_initialised(dpc.0)
        }
        let now = self.clock.now();
        let due = if due_time < 0 { now.saturating_add(due_time.unsigned_abs()) } else { due_time as u64 };
        let mut timers = lock(&self.timers.timers);
        let Some(t) = timers.get_mut(&timer.0) else {
            drop(timers);
            self.never_initialised(timer.0)
        };
        let was_set = t.due.replace(due).is_some();
        t.period = u64::from(period_ms) * 1000 * UNITS_PER_MICROSECOND;
        t.dpc = dpc;
        drop(timers);
        // What the setter did comes before the DPC the expiry queues (whichever thread's clock expires it).
        if !dpc.is_null() {
            self.hb_release(SyncObject::Dpc(dpc.0));
        }
        self.set_signal(timer.0, false);
        // A thread waiting on this timer sleeps until the earliest due time it knew of.
        self.wake_waiters();
        was_set
    }

    /// KeCancelTimer: TRUE when the timer was set. A DPC its expiry already queued stays queued.
    pub(crate) fn timer_cancel(&self, timer: PKTIMER) -> bool {
        self.irql_at_most(DISPATCH_LEVEL);
        let mut timers = lock(&self.timers.timers);
        let Some(t) = timers.get_mut(&timer.0) else {
            drop(timers);
            self.never_initialised(timer.0)
        };
        t.due.take().is_some()
    }

    pub(crate) fn next_timer_due(&self) -> Option<u64> {
        lock(&self.timers.timers).values().filter_map(|t| t.due).min()
    }

    /// Expires every timer whose time has come, earliest first: each is signaled and its DPC queued (not run: the
    /// caller is where the processor takes the DPC interrupt, or not); a periodic one is set again, its next due
    /// time the first period boundary after now.
    pub(crate) fn expire_timers(&self) {
        let now = self.clock.now();
        let mut fired: Vec<(u64, u64, PKDPC)> = Vec::new();
        {
            let mut timers = lock(&self.timers.timers);
            for (addr, t) in timers.iter_mut() {
                let Some(due) = t.due.filter(|due| *due <= now) else { continue };
                fired.push((due, *addr, t.dpc));
                t.due = (t.period > 0).then(|| due + t.period * ((now - due) / t.period + 1));
            }
        }
        fired.sort_unstable_by_key(|(due, addr, _)| (*due, *addr));
        for (_, timer, dpc) in fired {
            self.set_signal(timer, true);
            if !dpc.is_null() {
                self.dpc_insert(dpc, PVOID::NULL, PVOID::NULL);
            }
        }
    }

    /// The set timer with the lowest address (for the unload checks).
    pub(crate) fn set_timer(&self) -> Option<u64> {
        lock(&self.timers.timers).iter().filter(|(_, t)| t.due.is_some()).map(|(addr, _)| *addr).min()
    }
}
