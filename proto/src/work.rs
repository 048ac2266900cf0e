//! Work queues and completion queues: rings in guest memory, written by the driver (WQEs) or the device (CQEs) and
//! reached only by DMA through the device's map registers.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

wire_enum! {
    pub enum WrOpcode {
        Send = 0 => "SEND",
        RdmaWrite = 1 => "RDMA_WRITE",
        RdmaRead = 2 => "RDMA_READ",
        Recv = 128 => "RECV",
    }
}

/// WQE flag: produce a CQE for this work request (RECVs always complete).
pub const WR_SIGNALED: u32 = 1;
pub const WR_SOLICITED: u32 = 2;
pub const MAX_SGE: usize = 2;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Sge {
    /// MR address (as registered), not an IOVA.
    pub addr: U64,
    pub length: U32,
    pub lkey: U32,
}

/// One work request, 64 bytes, in an SQ or RQ ring slot `index % entries`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Wqe {
    pub wr_id: U64,
    /// A `WrOpcode` value.
    pub opcode: U32,
    pub flags: U32,
    pub remote_addr: U64,
    pub rkey: U32,
    pub num_sge: U32,
    pub sge: [Sge; MAX_SGE],
}

pub const WQE_SIZE: usize = core::mem::size_of::<Wqe>();
const _: () = assert!(WQE_SIZE == 64);

/// One completion, 32 bytes, in CQ ring slot `index % entries`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Cqe {
    pub wr_id: U64,
    /// A `WcStatus` value.
    pub status: U32,
    /// The `WrOpcode` of the work request.
    pub opcode: U32,
    pub qpn: U32,
    pub byte_len: U32,
    /// Device detail for errors (an `async_event::FaultCause`), 0 on success.
    pub vendor_err: U32,
    /// Written last; see `cqe_owner`.
    pub owner: U32,
}

pub const CQE_SIZE: usize = core::mem::size_of::<Cqe>();
const _: () = assert!(CQE_SIZE == 32);

/// The owner value a valid CQE carries at monotonic ring index `index`: 1 on even laps, 2 on odd ones, so zeroed
/// memory (0) is never a completion and the driver tells a new CQE from last lap's without a separate doorbell.
pub fn cqe_owner(index: u32, entries: u32) -> u32 {
    1 + ((index / entries.max(1)) & 1)
}

/// Bytes a ring of `entries` entries of `entry_size` bytes spans, and the pages that takes.
pub fn ring_pages(entries: u32, entry_size: usize) -> u64 {
    let bytes = entries as u64 * entry_size as u64;
    bytes.div_ceil(crate::PAGE_SIZE)
}
