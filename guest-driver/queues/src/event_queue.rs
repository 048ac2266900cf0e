//! Queue 1: event slots of `EVENT_SIZE` bytes in one buffer, each posted as its own device-writable chain and
//! reposted as soon as it has been read.

use alloc::vec;
use alloc::vec::Vec;

use vhca_proto::{Event, EVENT_SIZE};
use vhca_virtio::{Buffer, DmaMemory, SplitQueue};
use zerocopy::FromBytes;

use crate::{Note, Notify, RingError};

pub struct EventQueue<M: DmaMemory, N: Notify> {
    queue: SplitQueue<M>,
    notifier: N,
    slots: M,
    /// The slot each posted chain (by head) writes into.
    slot_of_head: Vec<Option<usize>>,
}

impl<M: DmaMemory, N: Notify> EventQueue<M, N> {
    /// Posts `wanted` slots of `slots` (fewer where the buffer or the ring has no room for them) and notifies.
    pub fn new(queue: SplitQueue<M>, notifier: N, slots: M, wanted: usize) -> Result<Self, RingError<N::Error>> {
        let size = queue.size() as usize;
        let count = wanted.min(slots.len() / EVENT_SIZE).min(size);
        let mut events = EventQueue { queue, notifier, slots, slot_of_head: vec![None; size] };
        for slot in 0..count {
            events.post(slot)?;
        }
        events.queue.kick(|| events.notifier.notify()).map_err(RingError::Notify)?;
        Ok(events)
    }

    fn post(&mut self, slot: usize) -> Result<(), RingError<N::Error>> {
        let offset = slot * EVENT_SIZE;
        self.slots.fill(offset, EVENT_SIZE, 0)?;
        let chain = [Buffer { iova: self.slots.iova_at(offset)?, len: EVENT_SIZE as u32, device_writes: true }];
        let head = self.queue.add_chain(&chain)?;
        if let Some(entry) = self.slot_of_head.get_mut(head as usize) {
            *entry = Some(slot);
        }
        Ok(())
    }

    /// The next event the device wrote, if any; its buffer goes straight back to the device.
    pub fn poll(&mut self, note: Note<'_>) -> Option<Event> {
        loop {
            let used = match self.queue.poll_used() {
                Ok(Some(used)) => used,
                Ok(None) => return None,
                Err(e) => {
                    note(format_args!("event queue: {e}"));
                    return None;
                }
            };
            let slot = self.slot_of_head.get_mut(used.head as usize)?.take()?;
            let mut raw = [0u8; EVENT_SIZE];
            let read = self.slots.read_bytes(slot * EVENT_SIZE, &mut raw);
            let reposted = self
                .post(slot)
                .and_then(|()| self.queue.kick(|| self.notifier.notify()).map(drop).map_err(RingError::Notify));
            if let Err(e) = reposted {
                note(format_args!("event queue: cannot repost buffer {slot}: {e}"));
            }
            if read.is_ok() && used.len as usize >= EVENT_SIZE {
                // Cannot fail: the array has exactly an event's size.
                return Event::read_from_bytes(&raw).ok();
            }
            note(format_args!("event queue: short event of {} bytes ignored", used.len));
        }
    }
}
