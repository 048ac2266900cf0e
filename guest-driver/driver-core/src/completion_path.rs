//! The interrupt-driven completion path: the device's MSI-X messages connected with IoConnectInterruptEx, an ISR
//! that only queues the DPC, and a DPC that turns completion events into CQEs handed to each CQ's consumer.
//!
//! Why this shape: an ISR runs at DIRQL, where almost nothing may be called, so it does the least (Windows HCA
//! drivers acknowledge and queue a DPC). The DPC runs at DISPATCH_LEVEL, so the CQs it reads are guarded by a spin
//! lock (the control path's FAST_MUTEX would raise 0xC4 there) and the consumers' callbacks must be DISPATCH-safe.
//! A DPC that runs too long trips the DPC watchdog (0x133), so it stops after `budget` CQEs and queues itself again.
//! The polling path needs none of this: `Hca` works on any `NtKernel`, this module only on an `NtAsyncKernel`.

use alloc::collections::{BTreeMap, BTreeSet, VecDeque};
use alloc::sync::{Arc, Weak};
use alloc::vec::Vec;
use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use vhca_ntapi::*;
use vhca_proto::{Cqe, Doorbell, DoorbellKind, Event, EventKind};
use zerocopy::IntoBytes;

use crate::command_transport::CommandTransport;
use crate::cq_reader::CqReader;
use crate::error::DriverError;

/// A CQ consumer's completion routine: called at DISPATCH_LEVEL from the DPC, with the CQ and one CQE, in ring
/// order. It may set an event or queue a work item, not wait.
pub type CompletionCallback = Arc<dyn Fn(u32, &Cqe) + Send + Sync>;

/// What the DPC does with an event that is not a CQ completion, once one is set (`on_event`): called at
/// DISPATCH_LEVEL, outside the spin lock, in arrival order. Without one the events wait for `take_event`.
pub type EventCallback = Arc<dyn Fn(&Event) + Send + Sync>;

/// CQEs one DPC run hands out before it queues itself again, when the caller does not say: the order of what HCA
/// drivers use (a few dozen completions per pass).
pub const DEFAULT_CQE_BUDGET: usize = 64;

/// Work a driver variant's ISR does at DIRQL, the interrupt spin lock held, before it queues the DPC (the
/// scenarios' ISR bugs and their fixes). The core's own ISR does none.
pub type IsrWork = Arc<dyn Fn() + Send + Sync>;

/// The path's routines, as a host's observer sees them run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathRoutine {
    Isr,
    Dpc,
}

/// Called at the start of every ISR run (at DIRQL, the interrupt spin lock held) and every DPC run (at
/// DISPATCH_LEVEL), on whatever thread or processor runs it: it must not wait or take a lock the control path
/// holds. The host reads its own clock there; the core has none (no_std, and the kernel's clock is the host's).
pub type RoutineObserver = Arc<dyn Fn(PathRoutine) + Send + Sync>;

/// The seams a driver variant's consumers and ISR plug into, object-safe so scenarios reach them through the
/// `CqCompletions` their host connected: the bugs of the interrupt path live in the variants, not in the core.
pub trait CompletionHooks {
    /// `cq`'s completions go to the consumer's own `callback` (DISPATCH_LEVEL, from the DPC); the caller arms the
    /// CQ after, and `CqCompletions::unwatch` lets go of it as of any watched CQ.
    fn watch_with(&self, cq: u32, reader: CqReader, callback: CompletionCallback);
    /// IRQL <= DIRQL. From here on every ISR call runs `work` first (None: none). Set through
    /// KeSynchronizeExecution, as anything the ISR reads is changed.
    fn set_isr_work(&self, work: Option<IsrWork>);
    /// The interrupt object KeSynchronizeExecution takes for state shared with the ISR; None when not connected.
    fn interrupt(&self) -> Option<PKINTERRUPT>;
    /// Stops reading every watched CQ: once this returns no DPC touches their rings, so the close may free them
    /// while the interrupt stays connected for its commands.
    fn unwatch_all(&self);
}

/// How often each part of the path ran, for the run's result line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompletionCounts {
    pub isr_calls: u64,
    pub dpc_calls: u64,
    /// DPC runs that stopped at the budget and queued themselves again.
    pub dpc_requeues: u64,
    pub cqes: u64,
}

struct Watched {
    reader: CqReader,
    callback: CompletionCallback,
}

/// What the spin lock guards.
#[derive(Default)]
struct Guarded {
    watched: BTreeMap<u32, Watched>,
    /// CQs the device said have a completion, not yet drained (left over when the budget ran out).
    notified: BTreeSet<u32>,
    /// Events that are not CQ completions, kept for the control path (QP errors, DMA faults).
    other_events: VecDeque<Event>,
    on_event: Option<EventCallback>,
}

struct Shared<K: NtAsyncKernel, C: CommandTransport> {
    kernel: Arc<K>,
    transport: Arc<C>,
    lock: PKSPIN_LOCK,
    guarded: UnsafeCell<Guarded>,
    dpc: PKDPC,
    /// Set on every DPC run: the command queue's completion wait sleeps on it (`command_event`).
    command_event: PKEVENT,
    budget: usize,
    /// Set at teardown: a DPC that runs after it does not queue itself again, so KeFlushQueuedDpcs ends.
    stopping: AtomicBool,
    /// A variant's ISR work: written only inside KeSynchronizeExecution and read only by the ISR, both under the
    /// interrupt spin lock.
    isr_work: UnsafeCell<Option<IsrWork>>,
    /// Set once at connect, before any routine can run, and only read after.
    observer: Option<RoutineObserver>,
    isr_calls: AtomicU64,
    dpc_calls: AtomicU64,
    dpc_requeues: AtomicU64,
    cqes: AtomicU64,
}

// SAFETY: `guarded` is touched only between KeAcquireSpinLock(AtDpcLevel) and its release on `lock` (see
// `Shared::locked`), which excludes every other processor; `isr_work` only under the interrupt spin lock (see
// `Shared::isr`); the rest is atomics and kernel handles.
unsafe impl<K: NtAsyncKernel + Send + Sync, C: CommandTransport + Send + Sync> Sync for Shared<K, C> {}
// SAFETY: as above; nothing in Shared is tied to the thread that made it.
unsafe impl<K: NtAsyncKernel + Send + Sync, C: CommandTransport + Send + Sync> Send for Shared<K, C> {}

impl<K: NtAsyncKernel, C: CommandTransport> Shared<K, C> {
    /// Runs `f` with the spin lock held: from the DPC (already at DISPATCH_LEVEL) with the AtDpcLevel pair, from
    /// the control path with KeAcquireSpinLock, which raises to DISPATCH_LEVEL.
    fn locked<T>(&self, at_dpc_level: bool, f: impl FnOnce(&mut Guarded) -> T) -> T {
        let old = if at_dpc_level {
            self.kernel.KeAcquireSpinLockAtDpcLevel(self.lock);
            None
        } else {
            Some(self.kernel.KeAcquireSpinLock(self.lock))
        };
        // SAFETY: the spin lock is held until the release below, so this is the only reference (see `Sync`).
        let r = f(unsafe { &mut *self.guarded.get() });
        match old {
            None => self.kernel.KeReleaseSpinLockFromDpcLevel(self.lock),
            Some(old) => self.kernel.KeReleaseSpinLock(self.lock, old),
        }
        r
    }

    /// The ISR: MSI-X needs no acknowledgement read (unlike a line interrupt's ISR status), and the carrier gives
    /// one vector for config and every queue, so every message is ours. Queue the DPC and claim it.
    fn isr(&self) -> bool {
        if let Some(observer) = &self.observer {
            observer(PathRoutine::Isr);
        }
        self.isr_calls.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the kernel calls the ISR with the interrupt spin lock held, and `isr_work` is written only under
        // the same lock (`set_isr_work`), so nothing writes it meanwhile.
        if let Some(work) = unsafe { &*self.isr_work.get() } {
            work();
        }
        self.kernel.KeInsertQueueDpc(self.dpc, PVOID::NULL, PVOID::NULL);
        true
    }

    /// The DPC: collect the device's events, drain each notified CQ up to the budget and re-arm the drained ones,
    /// then call the consumers outside the lock (a callback may take locks of its own).
    fn dpc(&self) {
        if let Some(observer) = &self.observer {
            observer(PathRoutine::Dpc);
        }
        self.dpc_calls.fetch_add(1, Ordering::Relaxed);
        // The carrier's one vector serves every queue, and which one completed is known only behind the command
        // queue's own lock: every run wakes the command wait, which polls its used ring and sleeps again if empty.
        self.kernel.KeSetEvent(self.command_event, 0, false);
        let mut left = self.budget;
        // The events are read before the lock is taken: the transport may wait for its own lock (a command in
        // flight on another processor), and nothing else should wait behind this spin lock meanwhile.
        let events: Vec<Event> = core::iter::from_fn(|| self.transport.poll_event()).collect();
        let mut others = Vec::new();
        let (handed, more, on_event) = self.locked(true, |g| {
            for event in events {
                match EventKind::from_u32(event.kind.get()) {
                    Some(EventKind::CqCompletion) => {
                        g.notified.insert(event.handle.get());
                    }
                    _ if g.on_event.is_some() => others.push(event),
                    _ => g.other_events.push_back(event),
                }
            }
            let mut handed = Vec::new();
            for cq in g.notified.clone() {
                let Some(w) = g.watched.get(&cq) else {
                    g.notified.remove(&cq);
                    continue;
                };
                let mut cqes = w.reader.poll(&*self.kernel, left);
                if cqes.len() < left {
                    // Drained: arm for the next completion, then look once more, since one written between the
                    // last poll and the arm raises no event.
                    self.arm(cq, w.reader.consumer());
                    cqes.extend(w.reader.poll(&*self.kernel, left - cqes.len()));
                    if cqes.len() < left {
                        g.notified.remove(&cq);
                    }
                }
                left -= cqes.len();
                handed.push((w.callback.clone(), cq, cqes));
                if left == 0 {
                    break;
                }
            }
            (handed, !g.notified.is_empty(), g.on_event.clone())
        });
        if let Some(on_event) = on_event {
            others.iter().for_each(|event| on_event(event));
        }
        for (callback, cq, cqes) in handed {
            self.cqes.fetch_add(cqes.len() as u64, Ordering::Relaxed);
            for cqe in &cqes {
                callback(cq, cqe);
            }
        }
        if more && !self.stopping.load(Ordering::Acquire) {
            self.dpc_requeues.fetch_add(1, Ordering::Relaxed);
            self.kernel.KeInsertQueueDpc(self.dpc, PVOID::NULL, PVOID::NULL);
        }
    }

    /// The CQ-arm doorbell: non-blocking, so the DPC may ring it (REQ_NOTIFY_CQ is a command, which waits).
    fn arm(&self, cq: u32, consumer: u32) {
        let db = Doorbell {
            kind: (DoorbellKind::CqArm as u32).into(),
            handle: cq.into(),
            index: consumer.into(),
            flags: 0.into(),
        };
        // A doorbell that cannot be sent means the transport is down; the run's teardown reports that.
        let _ = self.transport.ring_doorbell(db.as_bytes());
    }
}

/// The connected interrupt and its DPC. `disconnect` before the CQs it watches, or the transport, go away.
pub struct CompletionPath<K: NtAsyncKernel, C: CommandTransport> {
    shared: Arc<Shared<K, C>>,
    connection: Option<INTERRUPT_CONNECTION>,
}

impl<K, C> CompletionPath<K, C>
where
    K: NtAsyncKernel + Send + Sync + 'static,
    C: CommandTransport + Send + Sync + 'static,
{
    /// IRQL = PASSIVE_LEVEL. Connects to `device`'s messages (or its line interrupt, when that is what the kernel
    /// gave it), with `observer`, if any, told of every ISR and DPC run from the first on (`RoutineObserver`). The
    /// routines hold the path weakly: the kernel keeps them, and a strong hold would keep the path (and the kernel
    /// it holds) alive forever.
    pub fn connect(
        kernel: Arc<K>,
        transport: Arc<C>,
        device: PDEVICE_OBJECT,
        budget: usize,
        observer: Option<RoutineObserver>,
    ) -> Result<CompletionPath<K, C>, DriverError> {
        let shared = Arc::new_cyclic(|weak: &Weak<Shared<K, C>>| {
            let for_dpc = weak.clone();
            let dpc = kernel.KeInitializeDpc(Arc::new(move |_, _, _| {
                if let Some(s) = for_dpc.upgrade() {
                    s.dpc();
                }
            }));
            Shared {
                lock: kernel.KeInitializeSpinLock(),
                kernel: kernel.clone(),
                transport,
                guarded: UnsafeCell::new(Guarded::default()),
                dpc,
                command_event: kernel.KeInitializeEvent(EVENT_TYPE::SynchronizationEvent, false),
                budget: budget.max(1),
                stopping: AtomicBool::new(false),
                isr_work: UnsafeCell::new(None),
                observer,
                isr_calls: AtomicU64::new(0),
                dpc_calls: AtomicU64::new(0),
                dpc_requeues: AtomicU64::new(0),
                cqes: AtomicU64::new(0),
            }
        });
        let (for_message, for_line) = (Arc::downgrade(&shared), Arc::downgrade(&shared));
        let parameters = IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS {
            PhysicalDeviceObject: device,
            MessageServiceRoutine: Arc::new(move |_, _| for_message.upgrade().is_some_and(|s| s.isr())),
            SpinLock: PKSPIN_LOCK::NULL,
            SynchronizeIrql: PASSIVE_LEVEL,
            FloatingSave: false,
            FallBackServiceRoutine: Some(Arc::new(move |_| for_line.upgrade().is_some_and(|s| s.isr()))),
        };
        let connection = kernel
            .IoConnectInterruptEx(parameters)
            .map_err(|status| DriverError::Kernel { routine: "IoConnectInterruptEx", status })?;
        Ok(CompletionPath { shared, connection: Some(connection) })
    }

    /// What IoConnectInterruptEx connected (message-based, or the line fallback).
    pub fn connection(&self) -> Option<&INTERRUPT_CONNECTION> {
        self.connection.as_ref()
    }

    /// Hands `cq`'s completions to `callback` from here on. The caller arms the CQ afterwards (req_notify_cq),
    /// so no completion event comes before the CQ is watched.
    pub fn watch(&self, cq: u32, reader: CqReader, callback: CompletionCallback) {
        self.shared.locked(false, |g| g.watched.insert(cq, Watched { reader, callback }));
    }

    /// Stops reading `cq`: once this returns no DPC touches its ring, so destroy_cq may free it.
    pub fn unwatch(&self, cq: u32) {
        self.shared.locked(false, |g| {
            g.watched.remove(&cq);
            g.notified.remove(&cq);
        });
    }

    /// Stops reading every CQ (`CompletionHooks::unwatch_all`).
    pub fn unwatch_all(&self) {
        self.shared.locked(false, |g| {
            g.watched.clear();
            g.notified.clear();
        });
    }

    /// Makes the DPC look at `cq` as if the device had said it has a completion: a CQE written before the CQ was
    /// watched and armed raises no event, so a consumer that starts watching late asks for one look.
    pub fn kick(&self, cq: u32) {
        self.shared.locked(false, |g| g.notified.insert(cq));
        self.shared.kernel.KeInsertQueueDpc(self.shared.dpc, PVOID::NULL, PVOID::NULL);
    }

    /// The KEVENT every DPC run sets (a synchronization event: it releases one wait and resets itself).
    pub fn command_event(&self) -> PKEVENT {
        self.shared.command_event
    }

    /// From here on the DPC hands each event that is not a CQ completion to `callback` instead of keeping it.
    pub fn on_event(&self, callback: EventCallback) {
        self.shared.locked(false, |g| g.on_event = Some(callback));
    }

    /// The next event that was not a CQ completion (the DPC took every event off the device).
    pub fn take_event(&self) -> Option<Event> {
        self.shared.locked(false, |g| g.other_events.pop_front())
    }

    pub fn counts(&self) -> CompletionCounts {
        let s = &self.shared;
        CompletionCounts {
            isr_calls: s.isr_calls.load(Ordering::Relaxed),
            dpc_calls: s.dpc_calls.load(Ordering::Relaxed),
            dpc_requeues: s.dpc_requeues.load(Ordering::Relaxed),
            cqes: s.cqes.load(Ordering::Relaxed),
        }
    }

    /// IRQL = PASSIVE_LEVEL. IoDisconnectInterruptEx (no ISR runs after it, so none queues the DPC), then
    /// KeFlushQueuedDpcs (a DPC already queued has run, and does not queue itself again). Only then may the
    /// caller free the CQs and the transport. Returns the final counts.
    pub fn disconnect(mut self) -> CompletionCounts {
        self.teardown();
        self.counts()
    }
}

impl<K, C> CompletionHooks for CompletionPath<K, C>
where
    K: NtAsyncKernel + Send + Sync + 'static,
    C: CommandTransport + Send + Sync + 'static,
{
    fn watch_with(&self, cq: u32, reader: CqReader, callback: CompletionCallback) {
        self.watch(cq, reader, callback);
    }

    fn set_isr_work(&self, work: Option<IsrWork>) {
        let Some(interrupt) = self.interrupt() else {
            // Not connected: no ISR runs that could read it.
            // SAFETY: without a connection the kernel calls no ISR of this path, so nothing reads it meanwhile.
            unsafe { *self.shared.isr_work.get() = work };
            return;
        };
        // The old work is swapped out under the interrupt spin lock and dropped only after KeSynchronizeExecution
        // returned: dropping it inside would free pool at DIRQL (an assignment drops the old value in place), which
        // vhca.sys's heap, guarded by a spin lock, stops as 0xC4/0x42 where the native build's allocator hid it.
        let mut slot = work;
        self.shared.kernel.KeSynchronizeExecution(interrupt, &mut || {
            // SAFETY: the cell's pointer is valid and aligned for the path's life, and KeSynchronizeExecution holds
            // the interrupt spin lock, which the ISR runs under, so nothing else reads or writes it meanwhile.
            unsafe { core::ptr::swap(self.shared.isr_work.get(), &mut slot) };
            true
        });
        drop(slot);
    }

    fn interrupt(&self) -> Option<PKINTERRUPT> {
        self.connection.as_ref().map(INTERRUPT_CONNECTION::InterruptObject)
    }

    fn unwatch_all(&self) {
        CompletionPath::unwatch_all(self);
    }
}

impl<K: NtAsyncKernel, C: CommandTransport> Drop for CompletionPath<K, C> {
    /// A path dropped without `disconnect` (an error path) still disconnects: an interrupt connected at unload is
    /// the verifier's 0xC7, and a DPC left queued would run into freed CQs.
    fn drop(&mut self) {
        self.teardown();
    }
}

impl<K: NtAsyncKernel, C: CommandTransport> CompletionPath<K, C> {
    fn teardown(&mut self) {
        let Some(connection) = self.connection.take() else { return };
        self.shared.stopping.store(true, Ordering::Release);
        self.shared.kernel.IoDisconnectInterruptEx(&connection);
        self.shared.kernel.KeFlushQueuedDpcs();
    }
}
