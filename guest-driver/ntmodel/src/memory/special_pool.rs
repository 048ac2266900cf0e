//! Special Pool (Driver Verifier flag 0x1): where an allocation goes on pages of its own, which page is its
//! no-access guard, the pattern the rest of its pages hold and what a corrupted pattern means at free.
//!
//! Microsoft, "Special Pool" (https://learn.microsoft.com/windows-hardware/drivers/devtest/special-pool): with
//! Verify End, the default, "each memory allocation requested by the driver is placed on a separate page. The
//! highest possible address that allows the allocation to fit on the page is returned", the rest of the page is
//! "written with special patterns" and the next page is inaccessible; with Verify Start the buffer is "aligned with
//! the beginning of the page", underruns fault at once and overruns are found at free. Windows chooses by the
//! system-wide setting (GFlags' Verify Start / Verify End, "Detecting Overruns and Underruns"), Verify End unless
//! set, and a single ExAllocatePoolWithTagPriority call may override it; here `SpecialPoolAlignment` is that
//! setting (the guest's `vhca.special_pool=verify_start|verify_end`).

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::verifier::SpecialPoolAlignment;
use crate::{HostMemId, PAGE};

/// x64's MEMORY_ALLOCATION_ALIGNMENT: a pool block's start is 16-byte aligned, so a Verify End allocation whose
/// size is not a multiple of 16 leaves up to 15 pattern bytes between its end and the guard page (checked at free).
pub(crate) const POOL_ALIGNMENT: u64 = 16;

/// What fills the bytes of a special pool allocation's pages that are not the allocation. Windows documents that
/// a pattern is written, not its value; this byte is the model's.
pub(crate) const PATTERN: u8 = 0xA5;

/// SPECIAL_POOL_DETECTED_MEMORY_CORRUPTION's parameter 4 (Microsoft, "Bug Check 0xC1"): "a driver freed an address,
/// but nearby bytes within the same page have been corrupted" (the pattern before the allocation)...
pub const C1_NEARBY_BYTES_CORRUPTED: u64 = 0x23;
/// ... and "bytes occurring after the end of the allocation have been overwritten".
pub const C1_BYTES_AFTER_END_OVERWRITTEN: u64 = 0x24;

/// Where one special pool allocation of `bytes` sits in its region of `pages` pages (the guard page included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    pub pages: usize,
    /// The allocation's offset from the region's base.
    pub start: u64,
    /// The guard page's index in the region.
    pub guard: usize,
}

impl Placement {
    pub fn new(bytes: u64, alignment: SpecialPoolAlignment) -> Option<Placement> {
        // A zero-byte request still gets a byte's room: it is a real block the driver may free.
        let rounded = bytes.max(1).checked_next_multiple_of(POOL_ALIGNMENT)?;
        let data_pages = usize::try_from(rounded.div_ceil(PAGE)).ok()?;
        let pages = data_pages.checked_add(1)?;
        Some(match alignment {
            SpecialPoolAlignment::VerifyEnd => {
                Placement { pages, start: data_pages as u64 * PAGE - rounded, guard: data_pages }
            }
            SpecialPoolAlignment::VerifyStart => Placement { pages, start: PAGE, guard: 0 },
        })
    }

    /// The data pages' byte range in the region (every page but the guard).
    pub fn data(&self) -> std::ops::Range<u64> {
        if self.guard == 0 {
            PAGE..self.pages as u64 * PAGE
        } else {
            0..self.guard as u64 * PAGE
        }
    }
}

/// A live special pool block, by its region base.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LiveBlock {
    pub placement: Placement,
    pub bytes: u64,
}

/// Freed special pool a later access is named by: (region base, end, the memory the quarantine may still hold).
#[derive(Debug, Clone, Copy)]
struct FreedBlock {
    end: u64,
    mem: HostMemId,
}

/// Freed blocks remembered, newest last: model addresses are never reused, so an access to a forgotten one is
/// still a fault (0x50), only no longer named as freed special pool.
const FREED_REMEMBERED: usize = 8192;

/// The model's special pool books.
#[derive(Default)]
pub(crate) struct SpecialPool {
    pub alignment: SpecialPoolAlignment,
    /// Region base -> block.
    live: HashMap<u64, LiveBlock>,
    /// Allocation address -> region base, for the free.
    by_start: HashMap<u64, u64>,
    freed: BTreeMap<u64, FreedBlock>,
    freed_order: VecDeque<u64>,
}

impl SpecialPool {
    pub fn insert(&mut self, base: u64, bytes: u64, placement: Placement) {
        self.live.insert(base, LiveBlock { placement, bytes });
        self.by_start.insert(base + placement.start, base);
    }

    /// The region base of the live block handed out at `va`.
    pub fn base_of(&self, va: u64) -> Option<u64> {
        self.by_start.get(&va).copied()
    }

    pub fn live(&self, base: u64) -> Option<&LiveBlock> {
        self.live.get(&base)
    }

    /// The block at `base` was freed; its pages (`mem`) may stay held for the CPU, inaccessible.
    pub fn retire(&mut self, base: u64, end: u64, mem: HostMemId) {
        if let Some(block) = self.live.remove(&base) {
            self.by_start.remove(&(base + block.placement.start));
        }
        if self.freed_order.len() >= FREED_REMEMBERED {
            if let Some(old) = self.freed_order.pop_front() {
                self.freed.remove(&old);
            }
        }
        self.freed.insert(base, FreedBlock { end, mem });
        self.freed_order.push_back(base);
    }

    /// Whether `va` lies in freed special pool.
    pub fn is_freed(&self, va: u64) -> bool {
        self.freed.range(..=va).next_back().is_some_and(|(_, f)| va < f.end)
    }

    /// The freed block holding `va`: its region base and end.
    pub fn freed_range(&self, va: u64) -> Option<(u64, u64)> {
        self.freed.range(..=va).next_back().filter(|(_, f)| va < f.end).map(|(base, f)| (*base, f.end))
    }

    /// The memory behind the freed block handed out at `va` (its region base found by range).
    pub fn freed_memory(&self, va: u64) -> Option<HostMemId> {
        self.freed.range(..=va).next_back().filter(|(_, f)| va < f.end).map(|(_, f)| f.mem)
    }
}

/// The first corrupted pattern byte of a block whose region holds `page_bytes` (its data pages' contents, from the
/// first data page on), as 0xC1's (P2 offset into the data, P4 subcode); None when the pattern is whole.
pub(crate) fn corrupted_pattern(page_bytes: &[u8], allocation: std::ops::Range<usize>) -> Option<(usize, u64)> {
    if let Some(at) = page_bytes[..allocation.start].iter().position(|b| *b != PATTERN) {
        return Some((at, C1_NEARBY_BYTES_CORRUPTED));
    }
    let after = &page_bytes[allocation.end..];
    after.iter().position(|b| *b != PATTERN).map(|at| (allocation.end + at, C1_BYTES_AFTER_END_OVERWRITTEN))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_end_puts_the_end_on_the_guard_page_and_verify_start_the_start_after_it() {
        let end = Placement::new(64, SpecialPoolAlignment::VerifyEnd).unwrap();
        assert_eq!(end, Placement { pages: 2, start: PAGE - 64, guard: 1 });
        assert_eq!(end.data(), 0..PAGE);
        // 13 bytes round up to 16: three pattern bytes between the end and the guard page.
        assert_eq!(Placement::new(13, SpecialPoolAlignment::VerifyEnd).unwrap().start, PAGE - 16);
        let big = Placement::new(PAGE + 1, SpecialPoolAlignment::VerifyEnd).unwrap();
        assert_eq!((big.pages, big.guard), (3, 2));
        let start = Placement::new(64, SpecialPoolAlignment::VerifyStart).unwrap();
        assert_eq!(start, Placement { pages: 2, start: PAGE, guard: 0 });
        assert_eq!(start.data(), PAGE..2 * PAGE);
    }

    #[test]
    fn a_pattern_byte_changed_before_the_allocation_is_0x23_and_after_it_0x24() {
        let mut page = vec![PATTERN; 64];
        assert_eq!(corrupted_pattern(&page, 16..48), None);
        page[20] = 0;
        assert_eq!(corrupted_pattern(&page, 16..48), None, "inside the allocation is the driver's");
        page[50] = 0;
        assert_eq!(corrupted_pattern(&page, 16..48), Some((50, C1_BYTES_AFTER_END_OVERWRITTEN)));
        page[3] = 0;
        assert_eq!(corrupted_pattern(&page, 16..48), Some((3, C1_NEARBY_BYTES_CORRUPTED)));
    }

    #[test]
    fn the_alignment_parses_gflags_names() {
        assert_eq!(SpecialPoolAlignment::parse("verify_start"), Some(SpecialPoolAlignment::VerifyStart));
        assert_eq!(SpecialPoolAlignment::parse("Verify-End"), Some(SpecialPoolAlignment::VerifyEnd));
        assert_eq!(SpecialPoolAlignment::parse("middle"), None);
    }
}
