//! How the HCA reaches guest memory: every access names a device address (IOVA) and may be refused.

use vhca_proto::FaultCause;

/// A refused DMA: the IOVA the device tried and why the platform said no.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("DMA to iova {iova:#x} refused: {}", cause.name())]
pub struct DmaError {
    pub iova: u64,
    pub cause: FaultCause,
}

/// Which end of a device-to-device copy the platform refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyEnd {
    Source,
    Destination,
}

/// Guest memory as the device sees it, through the platform IOMMU. Implementations translate and check every byte
/// range; the HCA never sees host addresses.
pub trait Dma {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError>;

    /// Where `iova`'s page leads now (the platform's address for it), asked of the IOMMU as a DMA would ask,
    /// missing to QEMU if need be, but quietly: a page it does not map is no fault line. None when it maps none, or
    /// when the implementation cannot tell; then a register an invalidation made stale stays refused (the strict
    /// use-after-unmap check). `write`: asked as the device's write (else its read), the direction the page is used in,
    /// since asking a write-only mapping about a read is a fault the vIOMMU records.
    fn translation(&self, _iova: u64, _write: bool) -> Option<u64> {
        None
    }
    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaError>;

    /// Moves `len` bytes from `src` to `dst`, both device addresses, the source checked for reading and the
    /// destination for writing. An implementation that reaches both ends at once copies translated range to
    /// translated range, once; this default bounces through a buffer (two copies) for those that cannot.
    fn copy(&self, src: u64, dst: u64, len: usize) -> Result<(), (CopyEnd, DmaError)> {
        let mut buf = vec![0u8; len];
        self.read(src, &mut buf).map_err(|e| (CopyEnd::Source, e))?;
        self.write(dst, &buf).map_err(|e| (CopyEnd::Destination, e))
    }
}
