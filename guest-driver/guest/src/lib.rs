//! vhca's Linux guest driver: drives the vhca device from user space through VFIO and virtio-pci.
//! The binary (main.rs) runs as the initramfs' init; these modules are also the base the NT model maps DMA with.

pub mod agent;
pub mod bugcheck_handler;
pub mod virtio_channel;
pub mod cmdline;
pub mod command_queue;
pub mod vfio_dma;
pub mod kmsg;
pub mod nt_backend;
pub mod pci;
pub mod report;
pub mod rng;
pub mod scenarios;
pub mod shutdown;
pub mod vfio;
pub mod virtio_pci;
pub mod virtqueue;
