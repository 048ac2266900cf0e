//! The three queues as the driver core's `CommandTransport` sees them, for a program that keeps them behind one lock
//! (the tests). One with an interrupt path gives each queue its own lock instead (the DPC reads events and rings
//! doorbells while a command waits), and calls the queues' methods directly.

use alloc::vec::Vec;

use vhca_driver_core::CommandTransportError;
use vhca_proto::Event;
use vhca_virtio::{DmaMemory, QueueError};

use crate::{CommandQueue, DoorbellQueue, EventQueue, Note, Notify, WaitSource};

pub struct HcaQueues<M: DmaMemory, N: Notify, W: WaitSource> {
    pub commands: CommandQueue<M, N, W>,
    pub doorbells: DoorbellQueue<M, N, W>,
    pub events: EventQueue<M, N>,
}

impl<M: DmaMemory, N: Notify, W: WaitSource> HcaQueues<M, N, W> {
    /// `CommandTransport::execute`: the transport's failures are noted and become the core's `CommandTransportError`.
    pub fn execute(
        &mut self,
        request: &[u8],
        response_capacity: usize,
        note: Note<'_>,
    ) -> Result<Vec<u8>, CommandTransportError> {
        self.commands.execute_for_core(request, response_capacity, note)
    }

    pub fn ring_doorbell(&mut self, records: &[u8], note: Note<'_>) -> Result<(), CommandTransportError> {
        self.doorbells.ring(records, note)
    }

    pub fn poll_event(&mut self, note: Note<'_>) -> Option<Event> {
        self.events.poll(note)
    }
}

pub(crate) fn queue_error(e: QueueError, note: Note<'_>) -> CommandTransportError {
    match e {
        QueueError::Timeout(_) => CommandTransportError::Timeout,
        other => {
            note(format_args!("virtqueue: {other}"));
            CommandTransportError::Refused(3)
        }
    }
}
