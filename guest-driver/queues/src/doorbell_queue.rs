//! Queue 2: doorbell records in one device-readable buffer per chain. `ring` waits until the device has taken them,
//! so the work they start has run (and its CQEs are written) when it returns.

use vhca_driver_core::CommandTransportError;
use vhca_virtio::{Buffer, DmaMemory, SplitQueue};

use crate::hca_queues::queue_error;
use crate::{Note, Notify, WaitSource};

pub struct DoorbellQueue<M: DmaMemory, N: Notify, W: WaitSource> {
    queue: SplitQueue<M>,
    notifier: N,
    /// One page: more records than any post sends at once.
    buffer: M,
    waits: W,
}

impl<M: DmaMemory, N: Notify, W: WaitSource> DoorbellQueue<M, N, W> {
    pub fn new(queue: SplitQueue<M>, notifier: N, buffer: M, waits: W) -> Self {
        DoorbellQueue { queue, notifier, buffer, waits }
    }

    pub fn ring(&mut self, records: &[u8], note: Note<'_>) -> Result<(), CommandTransportError> {
        if records.is_empty() || records.len() > self.buffer.len() {
            return Err(CommandTransportError::Refused(records.len() as u32));
        }
        self.buffer.write_bytes(0, records).map_err(|_| CommandTransportError::Refused(1))?;
        let chain = [Buffer { iova: self.buffer.iova(), len: records.len() as u32, device_writes: false }];
        let head = self.queue.add_chain(&chain).map_err(|e| queue_error(e, note))?;
        self.queue.kick(|| self.notifier.notify()).map_err(|_| CommandTransportError::DeviceGone)?;
        let used = self.queue.wait_used(&mut self.waits.wait()).map_err(|e| queue_error(e, note))?;
        if used.head != head {
            note(format_args!("doorbell queue: completion for head {}, expected {head}", used.head));
            return Err(CommandTransportError::Refused(2));
        }
        Ok(())
    }
}
