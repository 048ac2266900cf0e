//! How the device presents itself: PCI/virtio identity, queue roles and the device config space.

use zerocopy::little_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// virtio device id reserved for RDMA; used where the VMM can create a generic vhost-user device (QEMU >= 10.2).
pub const VIRTIO_ID_RDMA: u32 = 42;
/// virtio device id of the sound device, whose QEMU vhost-user front-end carries vhca on QEMU 10.0 (QEMU 10.0 cannot
/// create the generic vhost-user device from the command line; docs/architecture.md, "The carrier device").
pub const VIRTIO_ID_SND_CARRIER: u32 = 25;
pub const PCI_VENDOR_VIRTIO: u16 = 0x1af4;
/// Modern virtio PCI device ids are 0x1040 + virtio id.
pub const PCI_DEVICE_SND_CARRIER: u16 = 0x1040 + VIRTIO_ID_SND_CARRIER as u16;
pub const PCI_DEVICE_RDMA: u16 = 0x1040 + VIRTIO_ID_RDMA as u16;

/// Queue roles. The snd carrier always has four queues, so vhca uses exactly four.
pub const QUEUE_COMMAND: u16 = 0;
pub const QUEUE_EVENT: u16 = 1;
pub const QUEUE_DOORBELL: u16 = 2;
pub const QUEUE_RESERVED: u16 = 3;
pub const NUM_QUEUES: u16 = 4;
/// Queue size the carrier front-end uses; the driver may use less.
pub const QUEUE_SIZE: u16 = 64;

/// "VHCA" read as a little-endian u32.
pub const CONFIG_MAGIC: u32 = u32::from_le_bytes(*b"VHCA");
/// Bumped on every incompatible change to anything in this crate.
pub const ABI_VERSION: u16 = 1;

/// Device config space. 12 bytes: the size of the snd carrier's config, which QEMU reads through GET_CONFIG.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct DeviceConfig {
    pub magic: U32,
    pub abi_version: U16,
    pub num_queues: U16,
    pub map_registers: U32,
}

pub const DEVICE_CONFIG_SIZE: usize = core::mem::size_of::<DeviceConfig>();
const _: () = assert!(DEVICE_CONFIG_SIZE == 12);
