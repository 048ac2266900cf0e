//! The one modern virtio-pci transport and split virtqueue vhca has, shared by the Linux guest program (registers
//! through VFIO) and vhca.sys (registers through MmMapIoSpaceEx). Register and DMA access stand behind traits.
#![cfg_attr(not(test), no_std)]

extern crate alloc;

mod capabilities;
mod dma_memory;
mod msix_plan;
mod poll_wait;
mod split_queue;
mod transport;

/// Feature, status and descriptor-flag bits, generated from virtio-bindings by build.rs.
pub mod constants {
    include!(concat!(env!("OUT_DIR"), "/virtio_constants.rs"));
}

pub use capabilities::{
    command_with_decoding_and_mastering, parse_capabilities, CapWindow, CapabilityError, VirtioCaps, PCI_COMMAND,
    PCI_CONFIG_SPACE_SIZE,
};
pub use constants::*;
pub use dma_memory::{DmaMemory, DmaRangeError};
pub use msix_plan::MsixPlan;
pub use poll_wait::{PollWait, DEFAULT_SPIN_POLLS};
pub use split_queue::{Buffer, QueueError, RingLayout, SplitQueue, Used, MAX_QUEUE_SIZE};
pub use transport::{MsixSource, QueueNotifier, Registers, TransportError, VirtioPci, NO_VECTOR};

#[cfg(test)]
pub(crate) mod testing;
