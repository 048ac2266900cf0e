//! Force IRQL checking for a driver binary's pageable memory: Driver Verifier trims "all of the system pageable pool,
//! code, and data (which includes the driver's pageable code and data)" whenever IRQL is raised to DISPATCH_LEVEL or
//! above (a spin lock taken, KeSynchronizeExecution, a raise), so a later touch at raised IRQL faults
//! deterministically (Microsoft, "Force IRQL Checking"). The driver reads its memory and runs its code directly, not
//! through the model, so the trim is the MMU's: each paged pool block and each of the image's pageable sections
//! (PAGE*) is made inaccessible (mprotect) at the trim, and the fault handler pages it back in below DISPATCH_LEVEL,
//! or stops the machine with 0xD1 at or above it (an instruction fetched from a trimmed PAGE section is its execute
//! case).

use std::collections::BTreeMap;
use std::sync::Mutex;

const PAGE: usize = 4096;

/// One pageable range of the driver's (a paged pool block, a PAGE* section): its length (whole pages), whether it
/// is trimmed, and the protection it has while resident.
struct Block {
    bytes: usize,
    trimmed: bool,
    resident: libc::c_int,
}

/// The driver's paged pool blocks, by process address.
#[derive(Default)]
pub struct PageablePool {
    blocks: Mutex<BTreeMap<usize, Block>>,
}

/// Sets the protection of `bytes` at `at`: whole pages of one paged pool allocation (the model gives each its own
/// pages) or of one of the image's sections.
fn protect(at: usize, bytes: usize, protection: libc::c_int) {
    // SAFETY: a page-aligned range of whole pages that holds one paged pool allocation or one image section and
    // nothing else, which only the driver touches.
    unsafe { libc::mprotect(at as *mut libc::c_void, bytes, protection) };
}

impl PageablePool {
    /// A paged pool block the model gave out at process address `at`. A block not on a page boundary of its own
    /// cannot be trimmed without its neighbours, and is left resident.
    pub fn insert(&self, at: usize, bytes: usize) {
        self.insert_section(at, bytes, libc::PROT_READ | libc::PROT_WRITE);
    }

    /// A pageable range of the image (a PAGE* section) at `at`, `resident` its protection while paged in (read and
    /// execute for code).
    pub fn insert_section(&self, at: usize, bytes: usize, resident: libc::c_int) {
        if at == 0 || !at.is_multiple_of(PAGE) {
            return;
        }
        let bytes = bytes.div_ceil(PAGE).max(1) * PAGE;
        crate::lock(&self.blocks).insert(at, Block { bytes, trimmed: false, resident });
    }

    /// The block at `at` is being freed: resident again first, as the model reuses its pages.
    pub fn remove(&self, at: usize) {
        if let Some(block) = crate::lock(&self.blocks).remove(&at) {
            if block.trimmed {
                protect(at, block.bytes, block.resident);
            }
        }
    }

    /// The verifier's trim: every resident block made inaccessible.
    pub fn trim(&self) {
        for (at, block) in crate::lock(&self.blocks).iter_mut().filter(|(_, b)| !b.trimmed) {
            protect(*at, block.bytes, libc::PROT_NONE);
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
                protect(*at, block.bytes, block.resident);
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
