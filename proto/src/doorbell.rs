//! Doorbells (queue 2): device-readable 16-byte records telling the device a ring index moved.

use zerocopy::little_endian::U32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

wire_enum! {
    pub enum DoorbellKind {
        /// `index`: the SQ producer index (count of WQEs ever posted).
        SendQueue = 1 => "SQ",
        /// `index`: the RQ producer index.
        RecvQueue = 2 => "RQ",
        /// Arm the CQ: `index` is the driver's consumer index; flags 1 = solicited only.
        CqArm = 3 => "CQ_ARM",
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Doorbell {
    pub kind: U32,
    /// QP number for SQ/RQ, CQ handle for arm.
    pub handle: U32,
    pub index: U32,
    pub flags: U32,
}

pub const DOORBELL_SIZE: usize = core::mem::size_of::<Doorbell>();
