//! The split virtqueue as this program uses it: vhca-virtio's queue (shared with vhca.sys), with completions
//! waited for on the monotonic clock. No ring logic lives here.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use vhca_virtio::DmaMemory;
pub use vhca_virtio::{Buffer, QueueError, RingLayout, Used};

use crate::virtio_pci::Deadline;

pub struct SplitQueue<M: DmaMemory>(vhca_virtio::SplitQueue<M>);

impl<M: DmaMemory> SplitQueue<M> {
    pub fn new(size: u16, mem: M) -> Result<SplitQueue<M>, QueueError> {
        vhca_virtio::SplitQueue::new(size, mem).map(SplitQueue)
    }

    /// The shared queue itself, for code written against vhca-virtio (the command transport).
    pub fn into_inner(self) -> vhca_virtio::SplitQueue<M> {
        self.0
    }

    /// Polls until a completion arrives or `timeout` passes, sleeping between polls (`Deadline`).
    pub fn wait_used(&mut self, timeout: Duration) -> Result<Used, QueueError> {
        self.0.wait_used(&mut Deadline::after(timeout))
    }
}

impl<M: DmaMemory> Deref for SplitQueue<M> {
    type Target = vhca_virtio::SplitQueue<M>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<M: DmaMemory> DerefMut for SplitQueue<M> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}
