//! What can go wrong between a queue and its memory, ring or doorbell, whatever the queue carries.

use vhca_virtio::{DmaRangeError, QueueError};

#[derive(Debug, thiserror::Error)]
pub enum RingError<E: core::fmt::Display + core::fmt::Debug> {
    #[error(transparent)]
    Range(#[from] DmaRangeError),
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("notify: {0}")]
    Notify(E),
}
