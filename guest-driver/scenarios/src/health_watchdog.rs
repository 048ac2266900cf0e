//! The driver's health watchdog: a periodic timer (KeSetTimerEx) whose DPC checks in on the device every period at
//! DISPATCH_LEVEL, as HCA drivers run a health check; and its stop, which a remove path must call before unload.
//!
//! Why a stop of two steps: KeCancelTimer takes the timer out of the timer queue but "does not wait for a running
//! DPC" (nor remove one its expiry already queued), so the DPC can still run after it; KeFlushQueuedDpcs returns
//! when every queued DPC has run. Only then is nothing of the watchdog's left for the kernel to call
//! (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-kesettimerex: "Drivers must cancel any
//! active timers in their Unload routines"; nf-wdm-kecanceltimer; nf-wdm-keflushqueueddpcs).

use alloc::sync::Arc;
use core::sync::atomic::{AtomicU64, Ordering};
use core::time::Duration;

use vhca_ntapi::*;

/// One relative 100 ns unit count per millisecond (KeSetTimerEx's DueTime; negative = relative).
const UNITS_PER_MS: i64 = 10_000;

pub struct HealthWatchdog<K: NtAsyncKernel> {
    kernel: Arc<K>,
    /// A synchronization timer: each expiry signals it and a wait it satisfies resets it, so PASSIVE_LEVEL code can
    /// wait for the next check without the DPC touching the kernel.
    timer: PKTIMER,
    checks: Arc<AtomicU64>,
}

impl<K: NtAsyncKernel> HealthWatchdog<K> {
    /// IRQL <= DISPATCH_LEVEL (START_DEVICE). Sets the timer to fire every `period` from one period on.
    pub fn start(kernel: Arc<K>, period: Duration) -> HealthWatchdog<K> {
        let checks = Arc::new(AtomicU64::new(0));
        let counted = checks.clone();
        // The CustomTimerDpc, at DISPATCH_LEVEL: a health check must not wait; this one counts.
        let dpc = kernel.KeInitializeDpc(Arc::new(move |_, _, _| {
            counted.fetch_add(1, Ordering::Relaxed);
        }));
        let timer = kernel.KeInitializeTimerEx(TIMER_TYPE::SynchronizationTimer);
        let ms = period.as_millis().clamp(1, u32::MAX as u128) as u32;
        kernel.KeSetTimerEx(timer, -(i64::from(ms) * UNITS_PER_MS), ms, dpc);
        HealthWatchdog { kernel, timer, checks }
    }

    /// Health checks run so far.
    pub fn checks(&self) -> u64 {
        self.checks.load(Ordering::Relaxed)
    }

    /// PASSIVE_LEVEL. Waits until `n` checks have run, or until `within` passes without one: the checks run so far.
    pub fn wait_for_checks(&self, n: u64, within: Duration) -> u64 {
        let units = (within.as_nanos() / 100).min(i64::MAX as u128) as i64;
        while self.checks() < n {
            let status = self.kernel.KeWaitForSingleObject(
                self.timer.into(),
                KWAIT_REASON::Executive,
                KPROCESSOR_MODE::KernelMode,
                false,
                Some(-units),
            );
            if status != STATUS_SUCCESS {
                break;
            }
        }
        self.checks()
    }

    /// PASSIVE_LEVEL, in the remove path before unload: KeCancelTimer, then KeFlushQueuedDpcs for a check its
    /// expiry already queued. Returns whether the timer was still set.
    pub fn stop(self) -> bool {
        let was_set = self.kernel.KeCancelTimer(self.timer);
        self.kernel.KeFlushQueuedDpcs();
        was_set
    }
}
