//! How the HCA reaches guest memory: every access names a device address (IOVA) and may be refused.

use vhca_proto::FaultCause;

/// A refused DMA: the IOVA the device tried and why the platform said no.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("DMA to iova {iova:#x} refused: {}", cause.name())]
pub struct DmaError {
    pub iova: u64,
    pub cause: FaultCause,
}

/// Guest memory as the device sees it, through the platform IOMMU. Implementations translate and check every byte
/// range; the HCA never sees host addresses.
pub trait Dma {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError>;
    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaError>;
}
