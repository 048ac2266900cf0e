//! Page-aligned heap memory posing as DMA memory, for tests that play the device in-process.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::dma_memory::DmaMemory;

pub struct HeapDma {
    ptr: NonNull<u8>,
    layout: Layout,
    iova: u64,
}

impl HeapDma {
    pub fn new(len: usize, iova: u64) -> HeapDma {
        let layout = Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: layout has non-zero size (tests pass len > 0).
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).unwrap();
        HeapDma { ptr, layout, iova }
    }

    /// Host pointer for an IOVA inside this memory, as the IOMMU would translate it.
    pub fn translate(&self, iova: u64, len: usize) -> *mut u8 {
        let offset = usize::try_from(iova - self.iova).unwrap();
        assert!(offset + len <= self.layout.size(), "device access outside test memory");
        self.ptr.as_ptr().wrapping_add(offset)
    }
}

impl Drop for HeapDma {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: the allocation is page aligned, `layout.size()` bytes long, and lives as long as the value.
unsafe impl DmaMemory for HeapDma {
    fn host_ptr(&self) -> NonNull<u8> {
        self.ptr
    }
    fn iova(&self) -> u64 {
        self.iova
    }
    fn len(&self) -> usize {
        self.layout.size()
    }
}

/// A wait that allows `polls` pauses, without sleeping.
pub struct CountedWait(pub u32);

impl crate::PollWait for CountedWait {
    fn pause(&mut self) -> bool {
        self.0 = self.0.saturating_sub(1);
        self.0 > 0
    }
    fn limit(&self) -> core::time::Duration {
        core::time::Duration::from_millis(1)
    }
}
