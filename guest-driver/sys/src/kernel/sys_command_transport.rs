//! The driver core's `CommandTransport` in vhca.sys: vhca-queues (the code the Linux guest program runs too) over
//! common buffers and mapped BARs, waiting with `KernelWait`. Polled: the core waits for each completion; no
//! interrupt is connected.

use core::cell::RefCell;
use core::time::Duration;

use vhca_driver_core::{CommandTransport, CommandTransportError};
use vhca_ntapi::PDMA_ADAPTER;
use vhca_proto::{Event, EVENT_SIZE, MAX_REQUEST_SIZE, PAGE_SIZE};
use vhca_queues::{CommandQueue, DoorbellQueue, EventQueue, HcaQueues, WaitSource};
use vhca_virtio::{QueueNotifier, SplitQueue};

use super::common_buffer::CommonBuffer;
use super::debug_print::print_line;
use super::mmio_registers::{KernelWait, MmioBar};

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

type Queues = HcaQueues<CommonBuffer, QueueNotifier<MmioBar>, CompletionWait>;

/// The channel. The core uses it from one thread at a time (its verbs take `&mut Hca`); the RefCell turns a
/// re-entrant use into an error instead of a data race.
pub struct SysCommandTransport {
    queues: RefCell<Queues>,
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
        let commands = CommandQueue::new(commands.ring, commands.notifier, request, response, CompletionWait);
        let count = EVENT_BUFFERS.min(events.ring.size() as usize);
        let events = EventQueue::new(events.ring, events.notifier, slots, count).ok()?;
        let doorbells = DoorbellQueue::new(doorbells.ring, doorbells.notifier, doorbell, CompletionWait);
        Some(SysCommandTransport { queues: RefCell::new(HcaQueues { commands, doorbells, events }) })
    }
}

/// A re-entrant use of the channel (the RefCell already borrowed).
const REENTERED: CommandTransportError = CommandTransportError::Refused(6);

impl CommandTransport for &SysCommandTransport {
    fn execute(&self, request: &[u8], response_capacity: usize) -> Result<alloc::vec::Vec<u8>, CommandTransportError> {
        self.queues.try_borrow_mut().map_err(|_| REENTERED)?.execute(request, response_capacity, &note)
    }

    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError> {
        self.queues.try_borrow_mut().map_err(|_| REENTERED)?.ring_doorbell(records, &note)
    }

    fn poll_event(&self) -> Option<Event> {
        self.queues.try_borrow_mut().ok()?.poll_event(&note)
    }
}
