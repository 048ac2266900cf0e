//! The vhca command transport over the shared virtio transport, written once for the Linux guest program (VFIO
//! memory, sleeps on the monotonic clock) and vhca.sys (common buffers, KeDelayExecutionThread): commands on queue
//! 0, event buffers kept posted on queue 1, doorbell records on queue 2. DMA memory stands behind
//! `vhca_virtio::DmaMemory`, the doorbell behind `Notify`, waiting behind `WaitSource` (`SignalledWaits`: on the
//! driver's KEVENT once its interrupt is connected); the locks around the queues are each program's own.
#![cfg_attr(not(test), no_std)]

extern crate alloc;

mod command_queue;
mod doorbell_queue;
mod event_queue;
mod hca_queues;
mod ring_error;
mod signalled_waits;

pub use command_queue::{CommandError, CommandQueue, Response};
pub use doorbell_queue::DoorbellQueue;
pub use event_queue::EventQueue;
pub use hca_queues::HcaQueues;
pub use ring_error::RingError;
pub use signalled_waits::{SignalWait, SignalledWait, SignalledWaits};

use vhca_virtio::{PollWait, QueueNotifier, Registers, TransportError};

/// How a queue tells the device it has new buffers: the transport's `QueueNotifier`, or a test's device model.
pub trait Notify {
    type Error: core::fmt::Display + core::fmt::Debug;
    fn notify(&self) -> Result<(), Self::Error>;
}

impl<R: Registers> Notify for QueueNotifier<R> {
    type Error = TransportError<R::Error>;
    fn notify(&self) -> Result<(), Self::Error> {
        QueueNotifier::notify(self)
    }
}

/// Where a queue gets the wait for one completion: each wait starts its own time limit.
pub trait WaitSource {
    type Wait: PollWait;
    fn wait(&self) -> Self::Wait;
}

/// Where a queue reports what it cannot return (a short event, a buffer it could not repost).
pub type Note<'a> = &'a dyn Fn(core::fmt::Arguments<'_>);
