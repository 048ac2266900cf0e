//! Force IRQL checking for a driver binary's paged pool: Driver Verifier trims pageable memory whenever IRQL is raised
//! to DISPATCH_LEVEL or above (a spin lock taken, KeSynchronizeExecution, a raise), so a later touch at raised IRQL
//! faults deterministically (Microsoft, "Force IRQL Checking"). The driver reads its memory directly, not through the
//! model, so the trim is the MMU's: each paged pool block is made inaccessible (mprotect) at the trim, and the fault
//! handler pages it back in below DISPATCH_LEVEL, or stops the machine with 0xD1 at or above it.

use std::collections::BTreeMap;
use std::sync::Mutex;

const PAGE: usize = 4096;

/// One paged pool block the driver holds: its process address and length (whole pages), and whether it is trimmed.
struct Block {
    bytes: usize,
    trimmed: bool,
}

/// The driver's paged pool blocks, by process address.
#[derive(Default)]
pub struct PageablePool {
    blocks: Mutex<BTreeMap<usize, Block>>,
}

/// Sets the protection of `bytes` at `at`; a block the model gave out is whole pages of its own.
fn protect(at: usize, bytes: usize, accessible: bool) {
    let protection = if accessible { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_NONE };
    // SAFETY: a page-aligned block of whole pages that holds one paged pool allocation and nothing else (the
    // model gives each allocation pages of its own), which only the driver touches.
    unsafe { libc::mprotect(at as *mut libc::c_void, bytes, protection) };
}

impl PageablePool {
    /// A paged pool block the model gave out at process address `at`. A block not on a page boundary of its own
    /// cannot be trimmed without its neighbours, and is left resident.
    pub fn insert(&self, at: usize, bytes: usize) {
        if at == 0 || !at.is_multiple_of(PAGE) {
            return;
        }
        crate::lock(&self.blocks).insert(at, Block { bytes: bytes.div_ceil(PAGE).max(1) * PAGE, trimmed: false });
    }

    /// The block at `at` is being freed: resident again first, as the model reuses its pages.
    pub fn remove(&self, at: usize) {
        if let Some(block) = crate::lock(&self.blocks).remove(&at) {
            if block.trimmed {
                protect(at, block.bytes, true);
            }
        }
    }

    /// The verifier's trim: every resident block made inaccessible.
    pub fn trim(&self) {
        for (at, block) in crate::lock(&self.blocks).iter_mut().filter(|(_, b)| !b.trimmed) {
            protect(*at, block.bytes, false);
            block.trimmed = true;
        }
    }

    /// A fault at `address`: whether it lies in a trimmed block (else it is not the trim's).
    pub fn is_trimmed(&self, address: usize) -> bool {
        let blocks = crate::lock(&self.blocks);
        blocks.range(..=address).next_back().is_some_and(|(at, b)| b.trimmed && address - at < b.bytes)
    }

    /// Pages the trimmed block holding `address` back in (a touch below DISPATCH_LEVEL, which Windows' pager serves).
    pub fn page_in(&self, address: usize) {
        let mut blocks = crate::lock(&self.blocks);
        if let Some((at, block)) = blocks.range_mut(..=address).next_back() {
            if block.trimmed && address - at < block.bytes {
                protect(*at, block.bytes, true);
                block.trimmed = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trimmed_block_is_inaccessible_until_paged_in_and_an_unaligned_one_is_never_trimmed() {
        let layout = std::alloc::Layout::from_size_align(2 * PAGE, PAGE).unwrap();
        // SAFETY: a fresh page-aligned block, freed below.
        let block = unsafe { std::alloc::alloc_zeroed(layout) } as usize;
        let pool = PageablePool::default();
        pool.insert(block, 100);
        pool.insert(block + PAGE + 8, 8);
        assert!(!pool.is_trimmed(block));
        pool.trim();
        assert!(pool.is_trimmed(block) && pool.is_trimmed(block + PAGE - 1));
        assert!(!pool.is_trimmed(block + PAGE + 8), "the unaligned block stayed resident");
        pool.page_in(block + 50);
        assert!(!pool.is_trimmed(block));
        // SAFETY: resident again.
        unsafe { *(block as *mut u8) = 1 };
        pool.trim();
        pool.remove(block);
        // SAFETY: resident again after its removal; then freed.
        unsafe {
            *(block as *mut u8) = 2;
            std::alloc::dealloc(block as *mut u8, layout);
        }
    }
}
