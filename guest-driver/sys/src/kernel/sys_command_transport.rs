//! The driver core's `CommandTransport` in vhca.sys: vhca-queues (the code the Linux guest program runs too) over
//! common buffers and mapped BARs. A command's wait polls with `KernelWait` until the interrupt path is connected,
//! then sleeps on the DPC's KEVENT (`SignalledWaits`, handed over by `wait_for_interrupts`); events and doorbells
//! are shared with that DPC.
//!
//! Why three locks and not one: the DPC (DISPATCH_LEVEL, any processor) reads events and rings CQ-arm doorbells
//! while the control path may be waiting up to 10 s for a command. A command's wait sleeps below DISPATCH_LEVEL,
//! so it cannot hold a spin lock, and a DPC cannot wait for a lock that sleeps; so the command queue has the
//! control path's own lock (a second caller is refused, as the RefCell did before), and the event and doorbell
//! queues each a KSPIN_LOCK the DPC and the control path both take. No path holds two of them.

use core::cell::UnsafeCell;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use core::time::Duration;

use alloc::sync::Arc;

use vhca_driver_core::{CommandTransport, CommandTransportError, CompletionSignal};
use vhca_ntapi::PDMA_ADAPTER;
use vhca_proto::{Event, EVENT_SIZE, MAX_REQUEST_SIZE, PAGE_SIZE};
use vhca_queues::{CommandQueue, DoorbellQueue, EventQueue, SignalledWaits, WaitSource};
use vhca_virtio::{QueueNotifier, SplitQueue};

use super::common_buffer::CommonBuffer;
use super::debug_print::print_line;
use super::mmio_registers::{KernelWait, MmioBar};
use super::spin_locked::SpinLocked;

/// Event buffers kept posted.
const EVENT_BUFFERS: usize = 16;
/// How long a command or a doorbell may take before the channel reports a timeout.
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(10);

/// One queue: its ring memory and its doorbell.
pub struct Queue {
    pub ring: SplitQueue<CommonBuffer>,
    pub notifier: QueueNotifier<MmioBar>,
}

/// Each completion may take `COMPLETION_TIMEOUT`.
pub struct CompletionWait;

impl WaitSource for CompletionWait {
    type Wait = KernelWait;
    fn wait(&self) -> KernelWait {
        KernelWait::after(COMPLETION_TIMEOUT)
    }
}

type Notifier = QueueNotifier<MmioBar>;

/// The channel.
pub struct SysCommandTransport {
    commands: Exclusive<CommandQueue<CommonBuffer, Notifier, SignalledWaits<CompletionWait>>>,
    doorbells: SpinLocked<DoorbellQueue<CommonBuffer, Notifier, CompletionWait>>,
    events: SpinLocked<EventQueue<CommonBuffer, Notifier>>,
    /// Commands that waited on the DPC's KEVENT, and commands that polled (before the connection, after it).
    waited: [AtomicU64; 2],
}

/// A value one caller at a time uses; a second is refused rather than made to wait. The core's control path is one
/// thread (its verbs take `&mut Hca`), so a refusal means re-entrance, which becomes an error instead of a race.
struct Exclusive<T> {
    busy: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: `value` is reached only by the one caller that turned `busy` from false to true (`try_with`).
unsafe impl<T: Send> Sync for Exclusive<T> {}

impl<T> Exclusive<T> {
    fn new(value: T) -> Exclusive<T> {
        Exclusive { busy: AtomicBool::new(false), value: UnsafeCell::new(value) }
    }

    fn try_with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        if self.busy.swap(true, Ordering::Acquire) {
            return None;
        }
        // SAFETY: this caller set `busy`; no other reference exists until it is cleared below (a panic stops the
        // machine, so it is never left set by an unwound caller).
        let r = f(unsafe { &mut *self.value.get() });
        self.busy.store(false, Ordering::Release);
        Some(r)
    }
}

/// The channel's notes go to the kernel debugger.
fn note(message: core::fmt::Arguments<'_>) {
    print_line(&alloc::format!("vhca: {message}"));
}

/// The channel's own common buffers (request, response, event slots, doorbell records), allocated while the
/// bring-up still owns every queue, so a failure resets the device before a ring it knows is freed. Found by the low
/// resources simulation through the PE loader: allocated inside `SysCommandTransport::new`, after DRIVER_OK, a failure
/// freed the three rings it had been handed while the device still used them (0xE6/0x26, the device's DMA to an
/// unmapped ring).
pub struct TransportBuffers {
    request: CommonBuffer,
    response: CommonBuffer,
    slots: CommonBuffer,
    doorbell: CommonBuffer,
}

impl TransportBuffers {
    /// PASSIVE_LEVEL. None when the adapter refused one (each allocated one is freed as it drops).
    pub fn allocate(adapter: PDMA_ADAPTER) -> Option<TransportBuffers> {
        let page = PAGE_SIZE as u32;
        Some(TransportBuffers {
            request: CommonBuffer::allocate(adapter, MAX_REQUEST_SIZE as u32)?,
            response: CommonBuffer::allocate(adapter, page)?,
            slots: CommonBuffer::allocate(adapter, (EVENT_BUFFERS * EVENT_SIZE) as u32)?,
            doorbell: CommonBuffer::allocate(adapter, page)?,
        })
    }
}

impl SysCommandTransport {
    /// Takes the three queues (set up and enabled) and the buffers. PASSIVE_LEVEL.
    pub fn new(
        buffers: TransportBuffers,
        commands: Queue,
        events: Queue,
        doorbells: Queue,
    ) -> Option<SysCommandTransport> {
        let TransportBuffers { request, response, slots, doorbell } = buffers;
        let waits = SignalledWaits::new(CompletionWait);
        let commands = CommandQueue::new(commands.ring, commands.notifier, request, response, waits);
        let count = EVENT_BUFFERS.min(events.ring.size() as usize);
        let events = EventQueue::new(events.ring, events.notifier, slots, count).ok()?;
        let doorbells = DoorbellQueue::new(doorbells.ring, doorbells.notifier, doorbell, CompletionWait);
        Some(SysCommandTransport {
            commands: Exclusive::new(commands),
            doorbells: SpinLocked::new(doorbells),
            events: SpinLocked::new(events),
            waited: Default::default(),
        })
    }

    /// (commands that waited on the DPC's KEVENT, commands that polled) so far.
    pub fn command_waits(&self) -> (u64, u64) {
        let [kevent, poll] = &self.waited;
        (kevent.load(Ordering::Relaxed), poll.load(Ordering::Relaxed))
    }
}

/// A re-entrant use of the command queue (its lock already held).
const REENTERED: CommandTransportError = CommandTransportError::Refused(6);

impl CommandTransport for SysCommandTransport {
    /// PASSIVE_LEVEL (the control path): the wait may sleep.
    fn execute(&self, request: &[u8], response_capacity: usize) -> Result<alloc::vec::Vec<u8>, CommandTransportError> {
        let done = self.commands.try_with(|q| {
            let way = if q.waits_mut().is_signalled() { 0 } else { 1 };
            self.waited[way].fetch_add(1, Ordering::Relaxed);
            q.execute_for_core(request, response_capacity, &note)
        });
        done.unwrap_or(Err(REENTERED))
    }

    /// IRQL <= DISPATCH_LEVEL (the control path or the DPC): under the doorbell queue's spin lock, where the wait
    /// for the device to take the records stalls instead of sleeping (KernelWait at DISPATCH_LEVEL).
    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError> {
        self.doorbells.with(|q| q.ring(records, &note))
    }

    /// IRQL <= DISPATCH_LEVEL, under the event queue's spin lock.
    fn poll_event(&self) -> Option<Event> {
        self.events.with(|q| q.poll(&note))
    }

    /// PASSIVE_LEVEL, no command in flight (the interrupt path's connect and disconnect): from the next command on,
    /// its wait sleeps on `signal` (Some) or polls again (None). The command queue asks the device for
    /// notifications from the start when START_DEVICE gave messages (started_device.rs), so the DPC runs for each.
    fn wait_for_interrupts(&self, signal: Option<Arc<dyn CompletionSignal>>) {
        let waiting = signal.is_some();
        if self.commands.try_with(|q| q.waits_mut().attach(signal)).is_none() {
            note(format_args!("command queue busy: its waits were not switched (waiting on the KEVENT: {waiting})"));
        }
    }
}

/// The core's control path holds the channel by reference (`Hca::open`); the interrupt path by `Arc`.
impl CommandTransport for &SysCommandTransport {
    fn execute(&self, request: &[u8], response_capacity: usize) -> Result<alloc::vec::Vec<u8>, CommandTransportError> {
        (**self).execute(request, response_capacity)
    }

    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError> {
        (**self).ring_doorbell(records)
    }

    fn poll_event(&self) -> Option<Event> {
        (**self).poll_event()
    }

    fn wait_for_interrupts(&self, signal: Option<Arc<dyn CompletionSignal>>) {
        (**self).wait_for_interrupts(signal)
    }
}
