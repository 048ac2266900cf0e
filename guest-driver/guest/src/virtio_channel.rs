//! The driver core's `CommandChannel` over the virtqueues: commands on queue 0, doorbell records on queue 2, and
//! queue 1 kept stocked with device-writable event buffers that `poll_event` turns into `vhca_proto::Event`s.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use vhca_driver::{ChannelError, CommandChannel};
use vhca_proto::{Event, EVENT_SIZE};
use zerocopy::FromBytes;

use crate::command_queue::{CommandError, CommandQueue};
use crate::report::progress;
use crate::vfio::DmaAccess;
use crate::vfio_dma::{DmaError, DmaMapper, DmaMemory, DmaRegion, PAGE_SIZE};
use crate::virtio_pci::{QueueNotifier, TransportError};
use crate::virtqueue::{Buffer, QueueError, SplitQueue};
use vhca_virtio::DmaRangeError;

/// Event buffers kept posted: more than the device ever queues between two polls in these scenarios.
const EVENT_BUFFERS: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ChannelSetupError {
    #[error(transparent)]
    Dma(#[from] DmaError),
    #[error(transparent)]
    Range(#[from] DmaRangeError),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("notify: {0}")]
    Notify(#[from] TransportError),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Queue 2: doorbell records in one device-readable buffer per chain; waits until the device has taken them, so
/// the work they start has run (and its CQEs are written) when `ring` returns.
pub struct DoorbellQueue {
    queue: SplitQueue<DmaRegion>,
    notifier: QueueNotifier,
    buffer: DmaRegion,
    timeout: Duration,
}

impl DoorbellQueue {
    pub fn new(
        queue: SplitQueue<DmaRegion>,
        notifier: QueueNotifier,
        mapper: &DmaMapper,
        timeout: Duration,
    ) -> Result<DoorbellQueue, ChannelSetupError> {
        let buffer = mapper.alloc(PAGE_SIZE, DmaAccess::READ_WRITE)?;
        Ok(DoorbellQueue { queue, notifier, buffer, timeout })
    }

    fn ring(&mut self, records: &[u8]) -> Result<(), ChannelError> {
        if records.is_empty() || records.len() > self.buffer.len() {
            return Err(ChannelError::Transport(records.len() as u32));
        }
        self.buffer.write_bytes(0, records).map_err(|_| ChannelError::Transport(1))?;
        let chain = [Buffer { iova: self.buffer.iova(), len: records.len() as u32, device_writes: false }];
        let head = self.queue.add_chain(&chain).map_err(queue_error)?;
        self.notifier.notify().map_err(|_| ChannelError::DeviceGone)?;
        let used = self.queue.wait_used(self.timeout).map_err(queue_error)?;
        if used.head != head {
            progress(format_args!("doorbell queue: completion for head {}, expected {head}", used.head));
            return Err(ChannelError::Transport(2));
        }
        Ok(())
    }
}

/// Queue 1: `EVENT_BUFFERS` slots of 32 bytes, each posted as its own chain and reposted once read.
pub struct EventQueue {
    queue: SplitQueue<DmaRegion>,
    notifier: QueueNotifier,
    slots: DmaRegion,
    slot_of_head: HashMap<u16, usize>,
}

impl EventQueue {
    pub fn new(
        queue: SplitQueue<DmaRegion>,
        notifier: QueueNotifier,
        mapper: &DmaMapper,
    ) -> Result<EventQueue, ChannelSetupError> {
        let count = EVENT_BUFFERS.min(queue.size() as usize);
        let slots = mapper.alloc(count * EVENT_SIZE, DmaAccess::READ_WRITE)?;
        let mut events = EventQueue { queue, notifier, slots, slot_of_head: HashMap::new() };
        for slot in 0..count {
            events.post(slot)?;
        }
        events.notifier.notify()?;
        Ok(events)
    }

    fn post(&mut self, slot: usize) -> Result<(), ChannelSetupError> {
        let offset = slot * EVENT_SIZE;
        self.slots.fill(offset, EVENT_SIZE, 0)?;
        let chain = [Buffer { iova: self.slots.iova_at(offset)?, len: EVENT_SIZE as u32, device_writes: true }];
        let head = self.queue.add_chain(&chain)?;
        self.slot_of_head.insert(head, slot);
        Ok(())
    }

    /// The next event the device wrote, if any; its buffer goes straight back to the device.
    fn poll(&mut self) -> Option<Event> {
        loop {
            let used = match self.queue.poll_used() {
                Ok(Some(used)) => used,
                Ok(None) => return None,
                Err(e) => {
                    progress(format_args!("event queue: {e}"));
                    return None;
                }
            };
            let slot = self.slot_of_head.remove(&used.head)?;
            let mut raw = [0u8; EVENT_SIZE];
            let read = self.slots.read_bytes(slot * EVENT_SIZE, &mut raw);
            let reposted = self.post(slot).and_then(|()| Ok(self.notifier.notify()?));
            if let Err(e) = reposted {
                progress(format_args!("event queue: cannot repost buffer {slot}: {e}"));
            }
            if read.is_ok() && used.len as usize >= EVENT_SIZE {
                // Cannot fail: the array has exactly an event's size.
                return Event::read_from_bytes(&raw).ok();
            }
            progress(format_args!("event queue: short event of {} bytes ignored", used.len));
        }
    }
}

fn queue_error(e: QueueError) -> ChannelError {
    match e {
        QueueError::Timeout(_) => ChannelError::Timeout,
        other => {
            progress(format_args!("virtqueue: {other}"));
            ChannelError::Transport(3)
        }
    }
}

fn command_error(e: CommandError) -> ChannelError {
    match e {
        CommandError::Queue(QueueError::Timeout(_)) => ChannelError::Timeout,
        other => {
            progress(format_args!("command queue: {other}"));
            ChannelError::Transport(4)
        }
    }
}

struct Queues {
    commands: Mutex<CommandQueue>,
    doorbells: Mutex<DoorbellQueue>,
    events: Mutex<EventQueue>,
}

/// The three queues the driver core talks through, each behind its own lock (`CommandChannel` takes `&self`).
/// Clones share the queues: the program keeps one so their memory outlives the driver until the device is reset.
#[derive(Clone)]
pub struct VirtioChannel {
    queues: Arc<Queues>,
}

impl VirtioChannel {
    pub fn new(commands: CommandQueue, doorbells: DoorbellQueue, events: EventQueue) -> VirtioChannel {
        let queues =
            Queues { commands: Mutex::new(commands), doorbells: Mutex::new(doorbells), events: Mutex::new(events) };
        VirtioChannel { queues: Arc::new(queues) }
    }
}

impl CommandChannel for VirtioChannel {
    fn execute(&self, request: &[u8], response_capacity: usize) -> Result<Vec<u8>, ChannelError> {
        lock(&self.queues.commands).execute_raw(request, response_capacity).map_err(command_error)
    }

    fn ring_doorbell(&self, records: &[u8]) -> Result<(), ChannelError> {
        lock(&self.queues.doorbells).ring(records)
    }

    fn poll_event(&self) -> Option<Event> {
        lock(&self.queues.events).poll()
    }
}
