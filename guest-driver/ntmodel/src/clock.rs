//! The model's clock: interrupt time in 100 ns units since the model started, from the host's monotonic clock or
//! moved by hand, and the clock interrupt that acts on it (timers expire, the DPC watchdog looks, stalls pass).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use vhca_ntapi::DISPATCH_LEVEL;

use crate::timing::ClockSource;
use crate::NtModel;

/// 100 ns units: Windows' system time unit (DueTime, Timeout).
pub(crate) const UNITS_PER_MICROSECOND: u64 = 10;

pub(crate) struct ModelClock {
    source: ClockSource,
    origin: Instant,
    /// Time moved by hand, in 100 ns units: all of it for a manual clock, on top of the host's otherwise.
    advanced: AtomicU64,
}

impl ModelClock {
    pub fn new(source: ClockSource) -> ModelClock {
        ModelClock { source, origin: Instant::now(), advanced: AtomicU64::new(0) }
    }

    pub fn source(&self) -> ClockSource {
        self.source
    }

    /// Now, in 100 ns units since the model started.
    pub fn now(&self) -> u64 {
        let moved = self.advanced.load(Ordering::Acquire);
        match self.source {
            ClockSource::Manual => moved,
            ClockSource::Host => moved.saturating_add(to_units(self.origin.elapsed())),
        }
    }

    pub fn advance(&self, units: u64) {
        self.advanced.fetch_add(units, Ordering::AcqRel);
    }

    /// How long the host must wait for the clock to reach `at`: None when only a hand can move it there.
    pub fn host_wait_until(&self, at: u64) -> Option<Duration> {
        match self.source {
            ClockSource::Manual => None,
            ClockSource::Host => Some(Duration::from_nanos(at.saturating_sub(self.now()).saturating_mul(100))),
        }
    }
}

pub(crate) fn to_units(d: Duration) -> u64 {
    u64::try_from(d.as_nanos() / 100).unwrap_or(u64::MAX)
}

impl NtModel {
    /// Now on the model's clock, in 100 ns units since the model started (KeQueryInterruptTime's unit).
    pub fn interrupt_time(&self) -> u64 {
        self.clock.now()
    }

    /// The clock interrupt, which comes from outside as device interrupts do (the guest program's timer thread,
    /// a test): timers that fell due expire (signaled, their DPCs queued), the DPC watchdog looks at every
    /// processor, and when the caller is below DISPATCH_LEVEL the DPCs queued run.
    pub fn clock_interrupt(&self) {
        self.expire_timers();
        let r = self.watchdog_check_all();
        self.ok(r);
        self.wake_waiters();
        if self.irql() < DISPATCH_LEVEL {
            self.run_queued_dpcs();
        }
    }

    /// Time passes: `by` on a manual clock (on a host clock, on top of the host's), then a clock interrupt.
    pub fn advance_clock(&self, by: Duration) {
        self.clock.advance(to_units(by));
        self.clock_interrupt();
    }

    /// KeStallExecutionProcessor: the processor busy-waits (a manual clock moves by the stall instead); the time
    /// counts against the DPC watchdog like any other a DPC or ISR spends, and the clock interrupts meanwhile.
    pub(crate) fn stall(&self, microseconds: u32) {
        let d = Duration::from_micros(u64::from(microseconds));
        match self.clock.source() {
            ClockSource::Manual => self.clock.advance(to_units(d)),
            ClockSource::Host => {
                let until = Instant::now() + d;
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
        }
        let r = self.watchdog_check_current();
        self.ok(r);
        self.clock_interrupt();
    }
}
