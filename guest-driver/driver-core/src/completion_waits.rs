//! Waiting for completions on the interrupt path: each watched CQ's callback (at DISPATCH_LEVEL, from the DPC)
//! queues its CQEs and sets the CQ's KEVENT; a control-path thread waits on that event at PASSIVE_LEVEL. Commands
//! wait the same way (`CommandEvent`, handed to the transport), and events that are not CQ completions go from the
//! DPC to a work item, which hands them to the control path at PASSIVE_LEVEL (`EventHandOff`).
//!
//! `CqCompletions` is object-safe so code written for any `NtKernel` (the scenarios, which also run on vhca.sys's
//! kernel without NtAsyncKernel) can hold the interrupt path its host built, without naming NtAsyncKernel itself.

use alloc::boxed::Box;
use alloc::collections::{BTreeMap, VecDeque};
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::cell::UnsafeCell;
use core::time::Duration;

use vhca_ntapi::*;
use vhca_proto::{Cqe, Event};

use crate::command_event::CommandEvent;
use crate::command_transport::{CommandTransport, CompletionSignal};
use crate::completion_path::{CompletionCounts, CompletionHooks, CompletionPath, RoutineObserver};
use crate::cq_reader::CqReader;
use crate::error::DriverError;
use crate::event_hand_off::{EventHandOff, HandOffCounts};

/// The interrupt path as the control path sees it.
pub trait CqCompletions {
    /// Hands `cq`'s completions to the waits from here on; the caller arms the CQ after (req_notify_cq).
    fn watch(&self, cq: u32, reader: CqReader);
    /// Before destroy_cq: no DPC reads the CQ once this returns.
    fn unwatch(&self, cq: u32);
    /// Before the close destroys every CQ left: no DPC reads any once this returns, and the interrupt stays
    /// connected for the close's commands. Through the path's hooks, so a wrapper that forwards those has it.
    fn unwatch_all(&self) {
        if let Some(hooks) = self.hooks() {
            hooks.unwatch_all();
        }
    }
    fn is_watched(&self, cq: u32) -> bool;
    /// Looks at the CQ once more from the DPC: CQEs written before the CQ was armed raise no event.
    fn kick(&self, cq: u32);
    /// Takes up to `max` CQEs that arrived for `cq`.
    fn take(&self, cq: u32, max: usize) -> Vec<Cqe>;
    /// PASSIVE_LEVEL. Waits on `cq`'s KEVENT (KeWaitForSingleObject) up to `timeout`: false when it passed first.
    fn wait(&self, cq: u32, timeout: Duration) -> bool;
    /// The next event that was not a CQ completion.
    fn take_event(&self) -> Option<Event>;
    /// PASSIVE_LEVEL. Waits up to `timeout` for the work item to hand over an event (`take_event` then has it):
    /// false when it passed first. A path without a work item returns false at once, and the caller polls.
    fn wait_event(&self, _timeout: Duration) -> bool {
        false
    }
    fn counts(&self) -> CompletionCounts;
    /// The path's seams for a driver variant's own consumers and ISR (the scenarios' interrupt-path bugs); None
    /// where the path has none.
    fn hooks(&self) -> Option<&dyn CompletionHooks> {
        None
    }
    /// PASSIVE_LEVEL. Disconnects the interrupt and flushes the DPC (before the CQs are destroyed).
    fn disconnect(self: Box<Self>) -> CompletionCounts;
}

struct Arrivals {
    event: PKEVENT,
    cqes: VecDeque<Cqe>,
}

/// What the callbacks and the waits share, under their own spin lock (the callbacks run at DISPATCH_LEVEL).
struct Mailboxes<K: NtAsyncKernel> {
    kernel: Arc<K>,
    lock: PKSPIN_LOCK,
    boxes: UnsafeCell<BTreeMap<u32, Arrivals>>,
}

// SAFETY: `boxes` is touched only with `lock` held (`Mailboxes::locked`), which excludes every other processor.
unsafe impl<K: NtAsyncKernel + Send + Sync> Sync for Mailboxes<K> {}
// SAFETY: as above; nothing in it is tied to a thread.
unsafe impl<K: NtAsyncKernel + Send + Sync> Send for Mailboxes<K> {}

impl<K: NtAsyncKernel> Mailboxes<K> {
    /// KeAcquireSpinLock raises to DISPATCH_LEVEL where needed, so this serves the DPC and PASSIVE callers alike.
    fn locked<T>(&self, f: impl FnOnce(&mut BTreeMap<u32, Arrivals>) -> T) -> T {
        let old = self.kernel.KeAcquireSpinLock(self.lock);
        // SAFETY: the spin lock is held until the release below, so this is the only reference.
        let r = f(unsafe { &mut *self.boxes.get() });
        self.kernel.KeReleaseSpinLock(self.lock, old);
        r
    }
}

/// The transport's command waits on the path's `CommandEvent` while this lives. Dropped before the path: once
/// the interrupt is disconnected nothing sets the event, and a command waiting on it would only time out.
struct CommandWaitsAttached<K: NtAsyncKernel, C: CommandTransport> {
    transport: Arc<C>,
    event: Arc<CommandEvent<K>>,
}

impl<K: NtAsyncKernel, C: CommandTransport> Drop for CommandWaitsAttached<K, C> {
    fn drop(&mut self) {
        self.transport.wait_for_interrupts(None);
    }
}

/// The device objects the interrupt path is set up for. IoConnectInterruptEx wants the PDO; IoAllocateWorkItem
/// wants "the caller's driver object or one of the caller's device objects", because the item's reference is what
/// keeps the driver that owns the routine loaded until it has run: the bus driver's PDO would keep the wrong driver.
/// vhca.sys gives its FDO; the native driver core, which the NT model runs as the PDO's own driver and which has no
/// device object of its own, gives the PDO for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PathDevices {
    pub pdo: PDEVICE_OBJECT,
    pub own: PDEVICE_OBJECT,
}

impl PathDevices {
    /// A driver whose own device object is the PDO (the native driver core).
    pub fn pdo_only(pdo: PDEVICE_OBJECT) -> PathDevices {
        PathDevices { pdo, own: pdo }
    }
}

/// `CqCompletions` over a connected `CompletionPath`. Field order is drop order, the teardown's: the command waits
/// poll again, the interrupt is disconnected and the DPCs flushed, then the work item is waited for and freed.
pub struct CompletionWaits<K: NtAsyncKernel, C: CommandTransport> {
    commands: CommandWaitsAttached<K, C>,
    path: CompletionPath<K, C>,
    events: StopOnDrop<K>,
    mailboxes: Arc<Mailboxes<K>>,
}

/// The event hand-off, stopped (its work item waited for and freed) when dropped.
struct StopOnDrop<K: NtAsyncKernel>(Arc<EventHandOff<K>>);

impl<K: NtAsyncKernel> Drop for StopOnDrop<K> {
    fn drop(&mut self) {
        self.0.stop();
    }
}

impl<K, C> CompletionWaits<K, C>
where
    K: NtAsyncKernel + Send + Sync + 'static,
    C: CommandTransport + Send + Sync + 'static,
{
    /// IRQL = PASSIVE_LEVEL, no command in flight. Connects the PDO's interrupt (`CompletionPath::connect`, with
    /// `observer` told of every ISR and DPC run: the Linux guest's times for the timeline), hands the DPC's non-CQ
    /// events to a work item of the driver's own device object, and from then on the transport's commands wait on
    /// the DPC's KEVENT (`CommandTransport::wait_for_interrupts`). vhca.sys connects without an observer: its
    /// routines would need a clock read at DIRQL (KeQueryPerformanceCounter) and a bounded buffer for the result
    /// line, and its result has no `completion_times`, so the runner draws no ISR or DPC lanes for a sys run (its
    /// counts are still reported).
    pub fn connect(
        kernel: Arc<K>,
        transport: Arc<C>,
        devices: PathDevices,
        budget: usize,
        observer: Option<RoutineObserver>,
    ) -> Result<CompletionWaits<K, C>, DriverError> {
        let lock = kernel.KeInitializeSpinLock();
        let mailboxes = Arc::new(Mailboxes { kernel: kernel.clone(), lock, boxes: UnsafeCell::new(BTreeMap::new()) });
        let path = CompletionPath::connect(kernel.clone(), transport.clone(), devices.pdo, budget, observer)?;
        let hand_off = EventHandOff::new(kernel.clone(), devices.own);
        let for_dpc = hand_off.clone();
        path.on_event(Arc::new(move |event: &Event| for_dpc.from_dpc(event)));
        let event = Arc::new(CommandEvent::new(kernel, path.command_event()));
        transport.wait_for_interrupts(Some(event.clone() as Arc<dyn CompletionSignal>));
        let commands = CommandWaitsAttached { transport, event };
        Ok(CompletionWaits { commands, path, events: StopOnDrop(hand_off), mailboxes })
    }

    /// How the commands waited on the DPC's KEVENT so far: (sleeps, of which woken before the deadline).
    pub fn command_waits(&self) -> (u64, u64) {
        self.commands.event.counts()
    }

    /// What the work item did with the events that were not CQ completions.
    pub fn event_hand_offs(&self) -> HandOffCounts {
        self.events.0.counts()
    }

    /// What IoConnectInterruptEx connected.
    pub fn connection(&self) -> Option<&INTERRUPT_CONNECTION> {
        self.path.connection()
    }
}

impl<K, C> CqCompletions for CompletionWaits<K, C>
where
    K: NtAsyncKernel + Send + Sync + 'static,
    C: CommandTransport + Send + Sync + 'static,
{
    fn watch(&self, cq: u32, reader: CqReader) {
        let m = &self.mailboxes;
        // A synchronization event: one waiter released per set, and it resets itself, as a per-CQ doorbell.
        let event = m.kernel.KeInitializeEvent(EVENT_TYPE::SynchronizationEvent, false);
        m.locked(|b| b.insert(cq, Arrivals { event, cqes: VecDeque::new() }));
        let mailboxes = Arc::downgrade(m);
        self.path.watch(
            cq,
            reader,
            Arc::new(move |cq, cqe: &Cqe| {
                let Some(m) = mailboxes.upgrade() else { return };
                let event = m.locked(|b| {
                    b.get_mut(&cq).map(|a| {
                        a.cqes.push_back(*cqe);
                        a.event
                    })
                });
                if let Some(event) = event {
                    m.kernel.KeSetEvent(event, 0, false);
                }
            }),
        );
    }

    fn unwatch(&self, cq: u32) {
        self.path.unwatch(cq);
        self.mailboxes.locked(|b| b.remove(&cq));
    }

    fn unwatch_all(&self) {
        self.path.unwatch_all();
        self.mailboxes.locked(|b| b.clear());
    }

    fn is_watched(&self, cq: u32) -> bool {
        self.mailboxes.locked(|b| b.contains_key(&cq))
    }

    fn kick(&self, cq: u32) {
        self.path.kick(cq);
    }

    fn take(&self, cq: u32, max: usize) -> Vec<Cqe> {
        self.mailboxes.locked(|b| match b.get_mut(&cq) {
            Some(a) => {
                let n = max.min(a.cqes.len());
                a.cqes.drain(..n).collect()
            }
            None => Vec::new(),
        })
    }

    fn wait(&self, cq: u32, timeout: Duration) -> bool {
        let Some(event) = self.mailboxes.locked(|b| b.get(&cq).map(|a| a.event)) else { return false };
        // Negative: relative, in 100 ns units.
        let relative = -((timeout.as_nanos() / 100).min(i64::MAX as u128) as i64);
        let status = self.mailboxes.kernel.KeWaitForSingleObject(
            event.into(),
            KWAIT_REASON::Executive,
            KPROCESSOR_MODE::KernelMode,
            false,
            Some(relative),
        );
        status == STATUS_SUCCESS
    }

    /// What the work item handed over; events the DPC kept before the hand-off was set up come after.
    fn take_event(&self) -> Option<Event> {
        self.events.0.take().or_else(|| self.path.take_event())
    }

    fn wait_event(&self, timeout: Duration) -> bool {
        self.events.0.wait(timeout)
    }

    fn counts(&self) -> CompletionCounts {
        self.path.counts()
    }

    fn hooks(&self) -> Option<&dyn CompletionHooks> {
        Some(&self.path)
    }

    fn disconnect(self: Box<Self>) -> CompletionCounts {
        let CompletionWaits { commands, path, events, mailboxes } = *self;
        drop(commands);
        let counts = path.disconnect();
        drop(events);
        drop(mailboxes);
        counts
    }
}
