//! The vhca command channel over the shared virtio transport, written once for the Linux guest program (VFIO
//! memory, sleeps on the monotonic clock) and vhca.sys (common buffers, KeDelayExecutionThread): commands on queue
//! 0, event buffers kept posted on queue 1, doorbell records on queue 2. DMA memory stands behind
//! `vhca_virtio::DmaMemory`, registers behind `vhca_virtio::Registers`, waiting behind `WaitSource`; the lock around
//! the queues is each program's own.
#![cfg_attr(not(test), no_std)]

extern crate alloc;

mod channel_queues;
mod command_queue;
mod doorbell_queue;
mod event_queue;

pub use channel_queues::ChannelQueues;
pub use command_queue::{CommandError, CommandQueue, Response};
pub use doorbell_queue::DoorbellQueue;
pub use event_queue::{EventQueue, EventSetupError};

use vhca_virtio::PollWait;

/// Where a queue gets the wait for one completion: each wait starts its own time limit.
pub trait WaitSource {
    type Wait: PollWait;
    fn wait(&self) -> Self::Wait;
}

/// Where a queue reports what it cannot return (a short event, a buffer it could not repost).
pub type Note<'a> = &'a dyn Fn(core::fmt::Arguments<'_>);
