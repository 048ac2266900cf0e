//! Asynchronous events (queue 1): the driver posts device-writable 32-byte buffers; the device fills one per event.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

wire_enum! {
    pub enum EventKind {
        /// An armed CQ got a completion. `handle`: the CQ.
        CqCompletion = 1 => "cq_completion",
        /// A QP went to ERR. `handle`: the QPN, `cause`: a `FaultCause`.
        QpFatal = 2 => "qp_fatal",
        /// The device's DMA was refused. `addr`: the IOVA, `cause`: a `FaultCause`.
        DmaFault = 3 => "dma_fault",
        /// A command could not get map registers. `detail`: registers asked for.
        MapRegistersExhausted = 4 => "map_registers_exhausted",
    }
}

wire_enum! {
    /// Why the device refused a DMA. Also the CQE's `vendor_err`.
    pub enum FaultCause {
        None = 0 => "none",
        /// The range is not inside the MR (or a bad key).
        OutsideMr = 1 => "outside_mr",
        /// The MR (or QP) lacks the access right the operation needs.
        AccessRight = 2 => "access_right",
        /// The map register behind the address was freed.
        FreedMapRegister = 3 => "freed_map_register",
        /// The vIOMMU has no mapping for the IOVA.
        IommuUnmapped = 4 => "iommu_unmapped",
        /// The vIOMMU mapping lacks the needed permission.
        IommuPermission = 5 => "iommu_permission",
        /// The translation was invalidated after the mapping was made.
        StaleTranslation = 6 => "stale_translation",
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
