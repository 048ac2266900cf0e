//! The global allocator: non-paged pool from ExAllocatePool2 with vhca's tag, so alloc (Vec, Box, Arc) works at
//! IRQL <= DISPATCH_LEVEL. Pool blocks are 16-byte aligned on x64; larger alignments over-allocate and keep the
//! pool pointer just before the aligned block.

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;

use vhca_ntapi::pool_tag;

use crate::pool_layout::{aligned_start, pool_request, POOL_ALIGN};
use windows_sys::Wdk::System::SystemServices::{ExAllocatePool2, ExFreePoolWithTag};

/// ExAllocatePool2's flags (POOL_FLAGS in wdm.h, documented on ExAllocatePool2's page); windows-sys's metadata
/// lacks these #defines.
pub const POOL_FLAG_NON_PAGED: u64 = 0x40;
pub const POOL_FLAG_PAGED: u64 = 0x100;
/// 'vhca' in a pool dump (!poolused, !pool).
pub const POOL_TAG: u32 = pool_tag(b"vhca");

pub struct PoolAllocator;

// SAFETY: every block comes from ExAllocatePool2 and goes back to ExFreePoolWithTag with the same tag; the
// alignment rule above holds for each, and sizes never overflow (checked_add).
unsafe impl GlobalAlloc for PoolAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= POOL_ALIGN {
            // SAFETY: IRQL <= DISPATCH_LEVEL for non-paged pool (Rust code in this driver never runs above it).
            return unsafe { ExAllocatePool2(POOL_FLAG_NON_PAGED, layout.size(), POOL_TAG) }.cast();
        }
        let Some(total) = pool_request(layout.size(), layout.align()) else { return core::ptr::null_mut() };
        // SAFETY: as above.
        let raw = unsafe { ExAllocatePool2(POOL_FLAG_NON_PAGED, total, POOL_TAG) }.cast::<u8>();
        if raw.is_null() {
            return raw;
        }
        // raw is 16-aligned and align a larger power of two, so the block starts 16..=align bytes in: room for the
        // pool pointer before it, and aligned + size <= raw + total (pool_layout's test).
        let aligned = raw.wrapping_add(aligned_start(raw as usize, layout.align()) - raw as usize);
        // SAFETY: aligned - 8 >= raw, and aligned + size <= raw + total; the slot is 8-aligned.
        unsafe { aligned.cast::<*mut u8>().sub(1).write(raw) };
        aligned
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let raw = if layout.align() <= POOL_ALIGN {
            ptr
        } else {
            // SAFETY: `alloc` stored the pool pointer just before this block.
            unsafe { ptr.cast::<*mut u8>().sub(1).read() }
        };
        // SAFETY: IRQL <= DISPATCH_LEVEL (non-paged pool); `raw` came from ExAllocatePool2 with this tag and is
        // freed once.
        unsafe { ExFreePoolWithTag(raw.cast::<c_void>(), POOL_TAG) };
    }
}

#[global_allocator]
static ALLOCATOR: PoolAllocator = PoolAllocator;
