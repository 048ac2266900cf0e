//! The arithmetic of the pool allocator (kernel/pool_allocator.rs), kept portable so it is tested here: pool
//! blocks are 16-byte aligned on x64; a larger alignment asks for `align` extra bytes and starts the block at the
//! first aligned address at least 16 bytes in, where the pool pointer is kept just before it.

/// What ExAllocatePool2 guarantees on x64 (MEMORY_ALLOCATION_ALIGNMENT).
pub const POOL_ALIGN: usize = 16;

/// Bytes to ask the pool for, for `size` bytes aligned to `align` (a power of two); None on overflow.
pub fn pool_request(size: usize, align: usize) -> Option<usize> {
    if align <= POOL_ALIGN {
        Some(size)
    } else {
        size.checked_add(align)
    }
}

/// Where an over-aligned block starts inside the pool block at `raw` (16-aligned), for `align` > POOL_ALIGN.
pub fn aligned_start(raw: usize, align: usize) -> usize {
    (raw + POOL_ALIGN + align - 1) & !(align - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// For every 16-aligned pool address in a window and several alignments and sizes: the block is aligned, has
    /// room for the pool pointer before it, and ends inside what was asked of the pool.
    #[test]
    fn over_aligned_blocks_fit_inside_the_pool_block() {
        for align in [32usize, 64, 128, 4096, 8192] {
            for size in [1usize, 15, 16, 100, 4096, 5000] {
                let total = pool_request(size, align).unwrap();
                for raw in (0x1000usize..0x1000 + 2 * 8192).step_by(POOL_ALIGN) {
                    let start = aligned_start(raw, align);
                    assert_eq!(start % align, 0);
                    assert!(start - raw >= core::mem::size_of::<usize>(), "room for the pool pointer");
                    assert!(start + size <= raw + total, "align {align} size {size} raw {raw:#x}");
                }
            }
        }
        assert_eq!(pool_request(10, 8), Some(10));
        assert_eq!(pool_request(usize::MAX, 32), None);
    }
}
