//! The split virtqueue as this program uses it: vhca-virtio's queue (shared with vhca.sys), with completions
//! waited for on the monotonic clock or on the queue's MSI-X message (`completion_wait`). No ring logic lives here.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use vhca_virtio::DmaMemory;
pub use vhca_virtio::{Buffer, QueueError, RingLayout, Used};

use crate::completion_wait::{CompletionWaits, MessageSignals};

pub struct SplitQueue<M: DmaMemory> {
    queue: vhca_virtio::SplitQueue<M>,
    /// The message this queue's completions are signalled by, when it waits by interrupt.
    interrupt: Option<(Arc<MessageSignals>, u32)>,
}

impl<M: DmaMemory> SplitQueue<M> {
    /// A queue that declines interrupts and polls (vhca-virtio's default).
    pub fn new(size: u16, mem: M) -> Result<SplitQueue<M>, QueueError> {
        vhca_virtio::SplitQueue::new(size, mem).map(|queue| SplitQueue { queue, interrupt: None })
    }

    /// From here on the queue asks the device for used-buffer notifications, and its waits sleep until `vector`'s
    /// message fires. Before its first chain, so no completion comes without its message.
    pub fn wait_by_interrupt(&mut self, signals: Arc<MessageSignals>, vector: u32) {
        self.queue.set_interrupts_wanted(true);
        self.interrupt = Some((signals, vector));
    }

    /// From here on the queue asks the device for used-buffer notifications, and its waits still poll: for a queue
    /// whose message another waiter takes (the event queue, whose completions the driver's ISR hears of).
    pub fn ask_for_interrupts(&mut self) {
        self.queue.set_interrupts_wanted(true);
    }

    /// Each completion wait of this queue, allowing `limit`: for code that takes the queue apart (`into_inner`).
    pub fn completion_waits(&self, limit: Duration) -> CompletionWaits {
        CompletionWaits { limit, interrupt: self.interrupt.clone() }
    }

    /// The shared queue itself, for code written against vhca-virtio (the command transport).
    pub fn into_inner(self) -> vhca_virtio::SplitQueue<M> {
        self.queue
    }

    /// Waits until a completion arrives or `timeout` passes: polling with sleeps between polls (`Deadline`), or, for
    /// a queue that waits by interrupt, polling after each of its messages.
    pub fn wait_used(&mut self, timeout: Duration) -> Result<Used, QueueError> {
        let mut wait = self.completion_waits(timeout).start();
        self.queue.wait_used(&mut wait)
    }
}

impl<M: DmaMemory> Deref for SplitQueue<M> {
    type Target = vhca_virtio::SplitQueue<M>;
    fn deref(&self) -> &Self::Target {
        &self.queue
    }
}

impl<M: DmaMemory> DerefMut for SplitQueue<M> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.queue
    }
}
