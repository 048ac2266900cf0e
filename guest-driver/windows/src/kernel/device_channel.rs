//! The driver core's `CommandChannel` in vhca.sys: commands on queue 0, doorbell records on queue 2, event
//! buffers kept posted on queue 1, over the shared split virtqueue and common buffers. Polled: the core waits
//! for each completion (KernelWait), as the Linux guest program does; no interrupt is connected.

use alloc::vec;
use alloc::vec::Vec;
use core::cell::RefCell;
use core::time::Duration;

use vhca_driver::{ChannelError, CommandChannel};
use vhca_ntapi::PDMA_ADAPTER;
use vhca_proto::{Event, EVENT_SIZE, MAX_REQUEST_SIZE, PAGE_SIZE, RESPONSE_HEADER_SIZE};
use vhca_virtio::{Buffer, DmaMemory, QueueError, QueueNotifier, SplitQueue};
use zerocopy::FromBytes;

use super::common_buffer::CommonBuffer;
use super::mmio_registers::{KernelWait, MmioBar};

/// Poison for the response buffer, so a completion without a write is never read as a response.
const POISON: u8 = 0xa5;
/// Event buffers kept posted.
const EVENT_BUFFERS: usize = 16;
/// How long a command or a doorbell may take before the channel reports a timeout.
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(10);

/// One queue: its ring memory and its doorbell.
pub struct Queue {
    pub ring: SplitQueue<CommonBuffer>,
    pub notifier: QueueNotifier<MmioBar>,
}

struct Queues {
    commands: Queue,
    request: CommonBuffer,
    response: CommonBuffer,
    doorbells: Queue,
    doorbell_buffer: CommonBuffer,
    events: Queue,
    event_slots: CommonBuffer,
    /// The event slot each posted head writes into.
    slot_of_head: Vec<Option<usize>>,
}

/// The channel. The core uses it from one thread at a time (its verbs take `&mut Hca`); the RefCell turns a
/// re-entrant use into an error instead of a data race.
pub struct DeviceChannel {
    queues: RefCell<Queues>,
}

fn transport_error(code: u32) -> ChannelError {
    ChannelError::Transport(code)
}

fn queue_error(e: QueueError) -> ChannelError {
    match e {
        QueueError::Timeout(_) => ChannelError::Timeout,
        _ => ChannelError::Transport(3),
    }
}

impl DeviceChannel {
    /// Takes the three queues (set up and enabled) and allocates the buffers from `adapter`. PASSIVE_LEVEL.
    pub fn new(adapter: PDMA_ADAPTER, commands: Queue, events: Queue, doorbells: Queue) -> Option<DeviceChannel> {
        let page = PAGE_SIZE as u32;
        let count = EVENT_BUFFERS.min(events.ring.size() as usize);
        let mut queues = Queues {
            request: CommonBuffer::allocate(adapter, MAX_REQUEST_SIZE as u32)?,
            response: CommonBuffer::allocate(adapter, page)?,
            doorbell_buffer: CommonBuffer::allocate(adapter, page)?,
            event_slots: CommonBuffer::allocate(adapter, (count * EVENT_SIZE) as u32)?,
            slot_of_head: vec![None; events.ring.size() as usize],
            commands,
            doorbells,
            events,
        };
        for slot in 0..count {
            queues.post_event(slot).ok()?;
        }
        queues.events.notifier.notify().ok()?;
        Some(DeviceChannel { queues: RefCell::new(queues) })
    }
}

impl Queues {
    fn post_event(&mut self, slot: usize) -> Result<(), ChannelError> {
        let offset = slot * EVENT_SIZE;
        self.event_slots.fill(offset, EVENT_SIZE, 0).map_err(|_| transport_error(5))?;
        let iova = self.event_slots.iova_at(offset).map_err(|_| transport_error(5))?;
        let head = self.events.ring.add_chain(&[Buffer { iova, len: EVENT_SIZE as u32, device_writes: true }]);
        let head = head.map_err(queue_error)?;
        if let Some(entry) = self.slot_of_head.get_mut(head as usize) {
            *entry = Some(slot);
        }
        Ok(())
    }
}

impl CommandChannel for &DeviceChannel {
    fn execute(&self, request: &[u8], response_capacity: usize) -> Result<Vec<u8>, ChannelError> {
        let mut q = self.queues.try_borrow_mut().map_err(|_| transport_error(6))?;
        let q = &mut *q;
        if request.is_empty() || request.len() > q.request.len() {
            return Err(transport_error(request.len() as u32));
        }
        let room = response_capacity.clamp(RESPONSE_HEADER_SIZE, q.response.len());
        q.request.write_bytes(0, request).map_err(|_| transport_error(1))?;
        q.response.fill(0, room, POISON).map_err(|_| transport_error(1))?;
        let head = q
            .commands
            .ring
            .add_chain(&[
                Buffer { iova: q.request.iova(), len: request.len() as u32, device_writes: false },
                Buffer { iova: q.response.iova(), len: room as u32, device_writes: true },
            ])
            .map_err(queue_error)?;
        q.commands.notifier.notify().map_err(|_| ChannelError::DeviceGone)?;
        let used = q.commands.ring.wait_used(&mut KernelWait::after(COMPLETION_TIMEOUT)).map_err(queue_error)?;
        if used.head != head || (used.len as usize) < RESPONSE_HEADER_SIZE {
            return Err(transport_error(2));
        }
        let mut out = vec![0u8; (used.len as usize).min(room)];
        q.response.read_bytes(0, &mut out).map_err(|_| transport_error(1))?;
        Ok(out)
    }

    fn ring_doorbell(&self, records: &[u8]) -> Result<(), ChannelError> {
        let mut q = self.queues.try_borrow_mut().map_err(|_| transport_error(6))?;
        let q = &mut *q;
        if records.is_empty() || records.len() > q.doorbell_buffer.len() {
            return Err(transport_error(records.len() as u32));
        }
        q.doorbell_buffer.write_bytes(0, records).map_err(|_| transport_error(1))?;
        let chain = [Buffer { iova: q.doorbell_buffer.iova(), len: records.len() as u32, device_writes: false }];
        let head = q.doorbells.ring.add_chain(&chain).map_err(queue_error)?;
        q.doorbells.notifier.notify().map_err(|_| ChannelError::DeviceGone)?;
        // Waits until the device took the records, so the work they start has run when this returns.
        let used = q.doorbells.ring.wait_used(&mut KernelWait::after(COMPLETION_TIMEOUT)).map_err(queue_error)?;
        if used.head != head {
            return Err(transport_error(2));
        }
        Ok(())
    }

    fn poll_event(&self) -> Option<Event> {
        let mut q = self.queues.try_borrow_mut().ok()?;
        loop {
            let used = q.events.ring.poll_used().ok()??;
            let slot = q.slot_of_head.get_mut(used.head as usize)?.take()?;
            let mut raw = [0u8; EVENT_SIZE];
            let read = q.event_slots.read_bytes(slot * EVENT_SIZE, &mut raw);
            // The buffer goes straight back to the device; a failed repost only shrinks the pool of buffers.
            if q.post_event(slot).is_ok() {
                let _ = q.events.notifier.notify();
            }
            if read.is_ok() && used.len as usize >= EVENT_SIZE {
                return Event::read_from_bytes(&raw).ok();
            }
        }
    }
}
