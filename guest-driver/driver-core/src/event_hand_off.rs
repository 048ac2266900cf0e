//! Events that are not CQ completions, from the DPC to the control path through a work item: the DPC (DISPATCH_LEVEL)
//! queues them and the item (IoQueueWorkItem, DelayedWorkQueue); the routine, at PASSIVE_LEVEL on a system worker
//! thread, hands them over and sets the KEVENT the control path's event wait sleeps on.
//!
//! Why a work item: what a driver does about a QP error or a DMA fault (query the QP, move it to reset, tell the
//! consumer, who may destroy it) is commands, which wait, and a DPC must not wait. The driver core does none of that
//! yet, so the routine's PASSIVE_LEVEL part is the hand-over itself; recovery belongs in `at_passive` when it comes.

use alloc::boxed::Box;
use alloc::collections::VecDeque;
use alloc::sync::Arc;
use core::cell::UnsafeCell;
use core::time::Duration;

use vhca_ntapi::*;
use vhca_proto::Event;

use crate::command_event::relative;

/// How long teardown waits for a queued work item to run before it frees the item anyway (then 0xE4/0x2 says so).
const IDLE_WAIT: Duration = Duration::from_secs(10);

/// What the work item did, for tests and the result.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandOffCounts {
    /// Routine calls.
    pub runs: u64,
    /// Events handed to the control path.
    pub events: u64,
    /// The highest IRQL a routine ran at (PASSIVE_LEVEL, as IoQueueWorkItem promises).
    pub max_irql: KIRQL,
}

#[derive(Default)]
struct State {
    from_dpc: VecDeque<Event>,
    for_control: VecDeque<Event>,
    /// The item is queued (or its routine has not yet taken the events).
    queued: bool,
    /// Teardown began: the DPC no longer queues the item.
    stopping: bool,
    counts: HandOffCounts,
}

pub(crate) struct EventHandOff<K: NtAsyncKernel> {
    kernel: Arc<K>,
    lock: PKSPIN_LOCK,
    state: UnsafeCell<State>,
    item: PIO_WORKITEM,
    /// Synchronization event: set when the routine handed events over.
    arrived: PKEVENT,
    /// Notification event, signaled while the item is not queued: teardown waits on it before IoFreeWorkItem.
    idle: PKEVENT,
}

// SAFETY: `state` is touched only with `lock` held (`locked`), which excludes every other processor; the rest are
// kernel handles.
unsafe impl<K: NtAsyncKernel + Send + Sync> Sync for EventHandOff<K> {}
// SAFETY: as above; nothing in it is tied to a thread.
unsafe impl<K: NtAsyncKernel + Send + Sync> Send for EventHandOff<K> {}

impl<K: NtAsyncKernel + Send + Sync + 'static> EventHandOff<K> {
    /// IRQL <= DISPATCH_LEVEL. The work item is `device`'s (IoAllocateWorkItem).
    pub fn new(kernel: Arc<K>, device: PDEVICE_OBJECT) -> Arc<EventHandOff<K>> {
        Arc::new(EventHandOff {
            lock: kernel.KeInitializeSpinLock(),
            state: UnsafeCell::new(State::default()),
            item: kernel.IoAllocateWorkItem(device),
            arrived: kernel.KeInitializeEvent(EVENT_TYPE::SynchronizationEvent, false),
            idle: kernel.KeInitializeEvent(EVENT_TYPE::NotificationEvent, true),
            kernel,
        })
    }

    /// DISPATCH_LEVEL, from the DPC (`CompletionPath::on_event`). Queues the item unless it is queued already: one
    /// routine call takes every event that arrived until it runs.
    pub fn from_dpc(self: &Arc<Self>, event: &Event) {
        if self.item.is_null() {
            // IoAllocateWorkItem returned NULL (Windows may): the events still reach the control path, unhandled.
            self.locked(|s| s.for_control.push_back(*event));
            self.kernel.KeSetEvent(self.arrived, 0, false);
            return;
        }
        let queue = self.locked(|s| {
            s.from_dpc.push_back(*event);
            let queue = !s.queued && !s.stopping;
            if queue {
                s.queued = true;
                self.kernel.KeClearEvent(self.idle);
            }
            queue
        });
        if queue {
            let weak = Arc::downgrade(self);
            let routine = Box::new(move |_device: PDEVICE_OBJECT| {
                if let Some(h) = weak.upgrade() {
                    h.at_passive();
                }
            });
            self.kernel.IoQueueWorkItem(self.item, routine, WORK_QUEUE_TYPE::DelayedWorkQueue);
        }
    }
}

impl<K: NtAsyncKernel> EventHandOff<K> {
    /// KeAcquireSpinLock raises to DISPATCH_LEVEL where needed: the DPC, the routine and the control path share it.
    fn locked<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let old = self.kernel.KeAcquireSpinLock(self.lock);
        // SAFETY: the spin lock is held until the release below, so this is the only reference.
        let r = f(unsafe { &mut *self.state.get() });
        self.kernel.KeReleaseSpinLock(self.lock, old);
        r
    }

    /// PASSIVE_LEVEL, on a system worker thread: the events go to the control path, which is told.
    fn at_passive(&self) {
        let irql = self.kernel.KeGetCurrentIrql();
        self.locked(|s| {
            let n = s.from_dpc.len() as u64;
            let taken: VecDeque<Event> = core::mem::take(&mut s.from_dpc);
            s.for_control.extend(taken);
            s.queued = false;
            s.counts.runs += 1;
            s.counts.events += n;
            s.counts.max_irql = s.counts.max_irql.max(irql);
            // Both under the lock: a DPC that queues the item again right after clears `idle` after this sets it.
            self.kernel.KeSetEvent(self.arrived, 0, false);
            self.kernel.KeSetEvent(self.idle, 0, false);
        });
    }

    /// The next event the routine handed over.
    pub fn take(&self) -> Option<Event> {
        self.locked(|s| s.for_control.pop_front())
    }

    /// PASSIVE_LEVEL. Waits up to `timeout` for the routine to hand events over: false when it passed first.
    pub fn wait(&self, timeout: Duration) -> bool {
        if self.locked(|s| !s.for_control.is_empty()) {
            return true;
        }
        let status = self.kernel.KeWaitForSingleObject(
            self.arrived.into(),
            KWAIT_REASON::Executive,
            KPROCESSOR_MODE::KernelMode,
            false,
            Some(relative(timeout)),
        );
        status == STATUS_SUCCESS
    }

    pub fn counts(&self) -> HandOffCounts {
        self.locked(|s| s.counts)
    }

    /// PASSIVE_LEVEL, after the DPC was disconnected and flushed (so nothing queues the item again): waits for a
    /// queued item to run, then frees it (a queued item freed is 0xE4/0x2). Above APC_LEVEL (a teardown unwinding
    /// from a bugcheck at raised IRQL) it neither waits nor frees: a leaked item beats a second bugcheck.
    pub fn stop(&self) {
        self.locked(|s| s.stopping = true);
        if self.item.is_null() || self.kernel.KeGetCurrentIrql() > APC_LEVEL {
            return;
        }
        let _ = self.kernel.KeWaitForSingleObject(
            self.idle.into(),
            KWAIT_REASON::Executive,
            KPROCESSOR_MODE::KernelMode,
            false,
            Some(relative(IDLE_WAIT)),
        );
        self.kernel.IoFreeWorkItem(self.item);
    }
}
