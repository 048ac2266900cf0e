//! DMA memory for the virtqueues and the command buffers: common buffers from the channel's own DMA adapter
//! (AllocateCommonBuffer at PASSIVE_LEVEL), which the shared transport takes through `vhca_virtio::DmaMemory`.
//! A common buffer is device-visible for its whole life and is never double-buffered, even by Driver Verifier.

use core::ptr::NonNull;

use vhca_ntapi::{PDMA_ADAPTER, PHYSICAL_ADDRESS, PVOID};
use vhca_virtio::DmaMemory;

use super::dma_operations as dma;

pub struct CommonBuffer {
    adapter: PDMA_ADAPTER,
    va: NonNull<u8>,
    logical: u64,
    len: u32,
}

impl CommonBuffer {
    /// PASSIVE_LEVEL. None when the adapter cannot give `len` bytes. Zeroed (AllocateCommonBuffer's memory is not).
    pub fn allocate(adapter: PDMA_ADAPTER, len: u32) -> Option<CommonBuffer> {
        let mut logical = PHYSICAL_ADDRESS(0);
        // SAFETY: PASSIVE_LEVEL, a live adapter (the caller's); cached (x64 DMA is cache coherent).
        let va = unsafe { dma::allocate_common_buffer(adapter, len, &mut logical, true) };
        let va = NonNull::new(va.0 as *mut u8)?;
        let buffer = CommonBuffer { adapter, va, logical: logical.0, len };
        // Cannot fail: the whole buffer.
        let _ = buffer.fill(0, len as usize, 0);
        Some(buffer)
    }
}

// SAFETY: a common buffer is non-paged kernel memory, reachable from any processor at any IRQL <= DISPATCH_LEVEL;
// the value owns it alone (freed once, in drop), so moving it to another thread moves that ownership.
unsafe impl Send for CommonBuffer {}

// SAFETY: AllocateCommonBuffer returns page-aligned memory of `len` bytes that the device reaches at `logical`,
// valid until FreeCommonBuffer in drop.
unsafe impl DmaMemory for CommonBuffer {
    fn host_ptr(&self) -> NonNull<u8> {
        self.va
    }
    fn iova(&self) -> u64 {
        self.logical
    }
    fn len(&self) -> usize {
        self.len as usize
    }
}

impl Drop for CommonBuffer {
    /// PASSIVE_LEVEL, after the device was reset (the owner's order), so nothing DMAs here any more.
    fn drop(&mut self) {
        let (logical, va) = (PHYSICAL_ADDRESS(self.logical), PVOID(self.va.as_ptr() as u64));
        // SAFETY: PASSIVE_LEVEL (FreeCommonBuffer's), no lock held; allocated above on this adapter with these
        // values, freed once.
        unsafe { dma::free_common_buffer(self.adapter, self.len, logical, va, true) };
    }
}
