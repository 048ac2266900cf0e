//! vhost-user message layouts (header and payloads), native-endian as the protocol defines them.
//! Request codes and feature bits come from the `vhost` crate; the byte layouts live here.

use vhost::vhost_user::message::VhostUserHeaderFlag;
use vhost::VhostIotlbType;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

pub const HEADER_SIZE: usize = 12;
/// Largest payload accepted; vhost-user's own limit.
pub const MAX_PAYLOAD: usize = vhost::vhost_user::message::MAX_MSG_SIZE;
/// Most fds one message may carry (vhost-user's limit).
pub const MAX_FDS: usize = vhost::vhost_user::message::MAX_ATTACHED_FD_ENTRIES;

pub const FLAG_VERSION_MASK: u32 = VhostUserHeaderFlag::VERSION.bits();
pub const VERSION: u32 = 0x1;
pub const FLAG_REPLY: u32 = VhostUserHeaderFlag::REPLY.bits();
pub const FLAG_NEED_REPLY: u32 = VhostUserHeaderFlag::NEED_REPLY.bits();

/// In SET_VRING_KICK/CALL/ERR payloads: low byte is the queue index, this bit says "no fd attached". (The `vhost`
/// crate keeps these two private to its frontend/backend code.)
pub const VRING_INDEX_MASK: u64 = 0xff;
pub const VRING_NOFD_MASK: u64 = 0x100;

pub const IOTLB_MISS: u8 = VhostIotlbType::Miss as u8;
pub const IOTLB_UPDATE: u8 = VhostIotlbType::Update as u8;
pub const IOTLB_INVALIDATE: u8 = VhostIotlbType::Invalidate as u8;
pub const IOTLB_ACCESS_FAIL: u8 = VhostIotlbType::AccessFail as u8;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Header {
    pub request: u32,
    pub flags: u32,
    pub size: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct VringState {
    pub index: u32,
    pub num: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct VringAddr {
    pub index: u32,
    pub flags: u32,
    pub descriptor: u64,
    pub used: u64,
    pub available: u64,
    pub log: u64,
}

/// SET_MEM_TABLE starts with this, followed by `num_regions` `MemoryRegion`s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct MemoryHeader {
    pub num_regions: u32,
    pub padding: u32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct MemoryRegion {
    pub guest_phys_addr: u64,
    pub memory_size: u64,
    pub userspace_addr: u64,
    pub mmap_offset: u64,
}

/// GET_CONFIG/SET_CONFIG start with this, followed by `size` bytes of config space.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ConfigHeader {
    pub offset: u32,
    pub size: u32,
    pub flags: u32,
}

/// `struct vhost_iotlb_msg`: 26 bytes of fields, padded to 32 as C lays it out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct IotlbMsg {
    pub iova: u64,
    pub size: u64,
    pub uaddr: u64,
    pub perm: u8,
    pub msg_type: u8,
    pub padding: [u8; 6],
}

pub const IOTLB_MSG_SIZE: usize = core::mem::size_of::<IotlbMsg>();
const _: () = assert!(IOTLB_MSG_SIZE == 32);
const _: () = assert!(core::mem::size_of::<VringAddr>() == 40);
const _: () = assert!(core::mem::size_of::<MemoryRegion>() == 32);
