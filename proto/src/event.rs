//! Asynchronous events (queue 1): the driver posts device-writable 32-byte buffers; the device fills one per event.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum EventKind {
    /// An armed CQ got a completion. `handle`: the CQ.
    CqCompletion = 1,
    /// A QP went to ERR. `handle`: the QPN, `cause`: a `FaultCause`.
    QpFatal = 2,
    /// The device's DMA was refused. `addr`: the IOVA, `cause`: a `FaultCause`.
    DmaFault = 3,
    /// A command could not get map registers. `detail`: registers asked for.
    MapRegistersExhausted = 4,
}

impl EventKind {
    pub fn from_u32(v: u32) -> Option<EventKind> {
        [EventKind::CqCompletion, EventKind::QpFatal, EventKind::DmaFault, EventKind::MapRegistersExhausted]
            .into_iter()
            .find(|k| *k as u32 == v)
    }
}

/// Why the device refused a DMA. Also the CQE's `vendor_err`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum FaultCause {
    None = 0,
    /// The range is not inside the MR (or a bad key).
    OutsideMr = 1,
    /// The MR (or QP) lacks the access right the operation needs.
    AccessRight = 2,
    /// The map register behind the address was freed.
    FreedMapRegister = 3,
    /// The vIOMMU has no mapping for the IOVA.
    IommuUnmapped = 4,
    /// The vIOMMU mapping lacks the needed permission.
    IommuPermission = 5,
    /// The translation was invalidated after the mapping was made.
    StaleTranslation = 6,
}

impl FaultCause {
    pub fn from_u32(v: u32) -> Option<FaultCause> {
        [
            FaultCause::None,
            FaultCause::OutsideMr,
            FaultCause::AccessRight,
            FaultCause::FreedMapRegister,
            FaultCause::IommuUnmapped,
            FaultCause::IommuPermission,
            FaultCause::StaleTranslation,
        ]
        .into_iter()
        .find(|c| *c as u32 == v)
    }

    pub fn name(self) -> &'static str {
        match self {
            FaultCause::None => "none",
            FaultCause::OutsideMr => "outside_mr",
            FaultCause::AccessRight => "access_right",
            FaultCause::FreedMapRegister => "freed_map_register",
            FaultCause::IommuUnmapped => "iommu_unmapped",
            FaultCause::IommuPermission => "iommu_permission",
            FaultCause::StaleTranslation => "stale_translation",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Event {
    /// An `EventKind` value.
    pub kind: U32,
    pub handle: U32,
    /// A `FaultCause` value, 0 where none.
    pub cause: U32,
    pub detail: U32,
    pub addr: U64,
    pub reserved: U64,
}

pub const EVENT_SIZE: usize = core::mem::size_of::<Event>();
const _: () = assert!(EVENT_SIZE == 32);
