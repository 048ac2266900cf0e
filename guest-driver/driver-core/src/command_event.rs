//! The command queue's completion signal on the interrupt path: a KEVENT the completion path's DPC sets, waited on
//! at PASSIVE_LEVEL with KeWaitForSingleObject, and a KTIMER whose DPC sets the same event at the wait's deadline.
//!
//! Why a timer: the NT interface has no clock to read and no KeWaitForMultipleObjects, and a wait woken by every
//! DPC run (the carrier's queues share one vector) cannot tell from a wake how long it has waited. The deadline's
//! DPC ends the one wait at the right time whatever woke it before.

use alloc::sync::Arc;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use core::time::Duration;

use vhca_ntapi::*;

use crate::command_transport::CompletionSignal;

/// `CompletionSignal` over an NtAsyncKernel. One wait at a time (the command queue's lock), so one timer serves.
pub struct CommandEvent<K: NtAsyncKernel> {
    kernel: Arc<K>,
    event: PKEVENT,
    deadline: PKTIMER,
    deadline_dpc: PKDPC,
    /// Set by the deadline's DPC: the wait begun last has run out.
    expired: Arc<AtomicBool>,
    /// The limit of the wait begun last, in 100 ns units: also each sleep's own timeout, a backstop for a deadline
    /// DPC that never runs (a clock nobody moves).
    limit: AtomicU64,
    sleeps: AtomicU64,
    wakes: AtomicU64,
}

/// A relative KeWaitForSingleObject/KeSetTimer time: negative, in 100 ns units, at least one unit.
pub(crate) fn relative(d: Duration) -> i64 {
    -((d.as_nanos() / 100).clamp(1, i64::MAX as u128) as i64)
}

impl<K: NtAsyncKernel + Send + Sync + 'static> CommandEvent<K> {
    /// Any IRQL <= DISPATCH_LEVEL. `event` is the one the DPC sets (`CompletionPath::command_event`).
    pub fn new(kernel: Arc<K>, event: PKEVENT) -> CommandEvent<K> {
        let expired = Arc::new(AtomicBool::new(false));
        // Weak: the kernel keeps the routine, and a strong hold would keep the kernel alive forever.
        let (for_dpc, weak) = (expired.clone(), Arc::downgrade(&kernel));
        let deadline_dpc = kernel.KeInitializeDpc(Arc::new(move |_, _, _| {
            for_dpc.store(true, Ordering::Release);
            if let Some(k) = weak.upgrade() {
                k.KeSetEvent(event, 0, false);
            }
        }));
        let deadline = kernel.KeInitializeTimerEx(TIMER_TYPE::NotificationTimer);
        CommandEvent {
            kernel,
            event,
            deadline,
            deadline_dpc,
            expired,
            limit: AtomicU64::new(0),
            sleeps: AtomicU64::new(0),
            wakes: AtomicU64::new(0),
        }
    }
}

impl<K: NtAsyncKernel> CommandEvent<K> {
    /// (sleeps, of which woken by a DPC before the deadline): how the commands waited, for the result.
    pub fn counts(&self) -> (u64, u64) {
        (self.sleeps.load(Ordering::Relaxed), self.wakes.load(Ordering::Relaxed))
    }
}

impl<K: NtAsyncKernel + Send + Sync + 'static> CompletionSignal for CommandEvent<K> {
    fn begin(&self, limit: Duration) {
        self.expired.store(false, Ordering::Release);
        let due = relative(limit);
        self.limit.store(due.unsigned_abs(), Ordering::Relaxed);
        // Cleared after the command was kicked, and that is safe: the device writes the used entry before its
        // message, so a set this clears belongs to a completion the first poll of the ring already sees.
        self.kernel.KeClearEvent(self.event);
        self.kernel.KeSetTimer(self.deadline, due, self.deadline_dpc);
    }

    fn sleep(&self) -> bool {
        if self.expired.load(Ordering::Acquire) {
            return false;
        }
        self.sleeps.fetch_add(1, Ordering::Relaxed);
        let backstop = -(self.limit.load(Ordering::Relaxed).min(i64::MAX as u64) as i64);
        let status = self.kernel.KeWaitForSingleObject(
            self.event.into(),
            KWAIT_REASON::Executive,
            KPROCESSOR_MODE::KernelMode,
            false,
            Some(backstop),
        );
        // Woken by the deadline's DPC: one more poll of the ring, and the next sleep gives up.
        if status == STATUS_SUCCESS && !self.expired.load(Ordering::Acquire) {
            self.wakes.fetch_add(1, Ordering::Relaxed);
        }
        status == STATUS_SUCCESS
    }

    fn end(&self) {
        if !self.kernel.KeCancelTimer(self.deadline) {
            // It expired: its DPC may still be queued, and run into the next command's wait as that one's deadline.
            self.kernel.KeRemoveQueueDpc(self.deadline_dpc);
        }
    }
}
