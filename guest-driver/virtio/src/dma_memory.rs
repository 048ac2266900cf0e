//! Memory the device reaches by DMA, as the driver sees it: a CPU pointer and the device address (IOVA or logical
//! address) for the same bytes. VFIO mappings and common buffers from a DMA adapter both stand behind this trait.

use core::ptr::NonNull;

/// A byte access that would leave the DMA region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{op} of {len} bytes at offset {offset:#x} leaves the {size:#x}-byte DMA region")]
pub struct DmaRangeError {
    pub op: &'static str,
    pub offset: usize,
    pub len: usize,
    pub size: usize,
}

/// Memory the device can reach, as the driver sees it: a host pointer and the address the device uses for it.
///
/// # Safety
/// Implementors guarantee that `host_ptr()` is valid for reads and writes of `len()` bytes, aligned to at least
/// 16 bytes, for as long as the value lives, and that the device reaches the same bytes at `iova()`.
pub unsafe trait DmaMemory {
    fn host_ptr(&self) -> NonNull<u8>;
    fn iova(&self) -> u64;
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies bytes in with volatile stores: the device may read this memory at any time.
    fn write_bytes(&self, offset: usize, bytes: &[u8]) -> Result<(), DmaRangeError> {
        let base = self.range_ptr("write", offset, bytes.len())?;
        for (i, byte) in bytes.iter().enumerate() {
            // SAFETY: range_ptr proved offset..offset+len lies inside the region, valid per the trait contract.
            unsafe { core::ptr::write_volatile(base.add(i), *byte) };
        }
        Ok(())
    }

    /// Copies bytes out with volatile loads: the device may have written them behind the compiler's back.
    fn read_bytes(&self, offset: usize, out: &mut [u8]) -> Result<(), DmaRangeError> {
        let base = self.range_ptr("read", offset, out.len())?;
        for (i, byte) in out.iter_mut().enumerate() {
            // SAFETY: range_ptr proved offset..offset+len lies inside the region, valid per the trait contract.
            *byte = unsafe { core::ptr::read_volatile(base.add(i)) };
        }
        Ok(())
    }

    /// Sets every byte of a range, e.g. to poison a response buffer so an unwritten one is recognisable.
    fn fill(&self, offset: usize, len: usize, value: u8) -> Result<(), DmaRangeError> {
        let base = self.range_ptr("fill", offset, len)?;
        for i in 0..len {
            // SAFETY: range_ptr proved offset..offset+len lies inside the region, valid per the trait contract.
            unsafe { core::ptr::write_volatile(base.add(i), value) };
        }
        Ok(())
    }

    /// Device address of a byte inside the region, for descriptors that point into part of it.
    fn iova_at(&self, offset: usize) -> Result<u64, DmaRangeError> {
        self.range_ptr("address", offset, 0)?;
        Ok(self.iova() + offset as u64)
    }

    fn range_ptr(&self, op: &'static str, offset: usize, len: usize) -> Result<*mut u8, DmaRangeError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(self.host_ptr().as_ptr().wrapping_add(offset)),
            _ => Err(DmaRangeError { op, offset, len, size: self.len() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::HeapDma;

    #[test]
    fn byte_copies_are_bounds_checked() {
        let mem = HeapDma::new(4096, 0x10_0000_0000);
        mem.write_bytes(10, b"vhca").unwrap();
        let mut out = [0u8; 4];
        mem.read_bytes(10, &mut out).unwrap();
        assert_eq!(&out, b"vhca");
        assert_eq!(mem.write_bytes(4094, b"abc"), Err(DmaRangeError { op: "write", offset: 4094, len: 3, size: 4096 }));
        assert!(mem.read_bytes(usize::MAX, &mut out).is_err());
        assert_eq!(mem.iova_at(16).unwrap(), 0x10_0000_0010);
    }
}
