//! The driver core's `CommandChannel` in vhca.sys: vhca-channel (the code the Linux guest program runs too) over
//! common buffers and mapped BARs, waiting with `KernelWait`. Polled: the core waits for each completion; no
//! interrupt is connected.

use core::cell::RefCell;
use core::time::Duration;

use vhca_channel::{ChannelQueues, CommandQueue, DoorbellQueue, EventQueue, WaitSource};
use vhca_driver::{ChannelError, CommandChannel};
use vhca_ntapi::PDMA_ADAPTER;
use vhca_proto::{Event, EVENT_SIZE, MAX_REQUEST_SIZE, PAGE_SIZE};
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

type Queues = ChannelQueues<CommonBuffer, QueueNotifier<MmioBar>, CompletionWait>;

/// The channel. The core uses it from one thread at a time (its verbs take `&mut Hca`); the RefCell turns a
/// re-entrant use into an error instead of a data race.
pub struct DeviceChannel {
    queues: RefCell<Queues>,
}

/// The channel's notes go to the kernel debugger.
fn note(message: core::fmt::Arguments<'_>) {
    print_line(&alloc::format!("vhca: {message}"));
}

impl DeviceChannel {
    /// Takes the three queues (set up and enabled) and allocates the buffers from `adapter`. PASSIVE_LEVEL.
    pub fn new(adapter: PDMA_ADAPTER, commands: Queue, events: Queue, doorbells: Queue) -> Option<DeviceChannel> {
        let page = PAGE_SIZE as u32;
        let request = CommonBuffer::allocate(adapter, MAX_REQUEST_SIZE as u32)?;
        let response = CommonBuffer::allocate(adapter, page)?;
        let commands = CommandQueue::new(commands.ring, commands.notifier, request, response, CompletionWait);
        let count = EVENT_BUFFERS.min(events.ring.size() as usize);
        let slots = CommonBuffer::allocate(adapter, (count * EVENT_SIZE) as u32)?;
        let events = EventQueue::new(events.ring, events.notifier, slots, count).ok()?;
        let buffer = CommonBuffer::allocate(adapter, page)?;
        let doorbells = DoorbellQueue::new(doorbells.ring, doorbells.notifier, buffer, CompletionWait);
        Some(DeviceChannel { queues: RefCell::new(ChannelQueues { commands, doorbells, events }) })
    }
}

/// A re-entrant use of the channel (the RefCell already borrowed).
const REENTERED: ChannelError = ChannelError::Transport(6);

impl CommandChannel for &DeviceChannel {
    fn execute(&self, request: &[u8], response_capacity: usize) -> Result<alloc::vec::Vec<u8>, ChannelError> {
        self.queues.try_borrow_mut().map_err(|_| REENTERED)?.execute(request, response_capacity, &note)
    }

    fn ring_doorbell(&self, records: &[u8]) -> Result<(), ChannelError> {
        self.queues.try_borrow_mut().map_err(|_| REENTERED)?.ring_doorbell(records, &note)
    }

    fn poll_event(&self) -> Option<Event> {
        self.queues.try_borrow_mut().ok()?.poll_event(&note)
    }
}
