//! The DMA path's translation cache: IOVA page → QEMU address of that page and how far the mapping runs on
//! contiguously from there, with the permissions already checked against the IOTLB, so a hit costs an array index
//! (one for a whole contiguous transfer) instead of vm-memory's three range-map walks. Every entry is
//! tagged with the IOTLB generation it was filled at (`DeviceIommu::iotlb_generation`), which every update and
//! invalidation bumps: after any change every entry is stale at once, and a stale entry is never used.
//!
//! Hand-written: vm-memory's `Iotlb` has no cache of its own, and its `IotlbIterator` cannot be built outside it.

use vhca_proto::PAGE_SIZE;
use vm_memory::Permissions;

/// Entries per cache, direct-mapped by IOVA page number: a 1 MiB transfer's source and destination pages (512)
/// fit without evicting each other when their pages are contiguous in IOVA space.
const ENTRIES: usize = 1024;

/// An entry never filled carries this generation, which the IOTLB's counter (starting at 0, +1 per change) never
/// reaches.
const NEVER: u64 = u64::MAX;

/// 32 bytes, aligned to 32, so an entry never straddles two cache lines (a lookup is one line).
#[derive(Debug, Clone, Copy)]
#[repr(align(32))]
struct Entry {
    iova_page: u64,
    /// QEMU's address of the page's first byte.
    uaddr: u64,
    /// The extent: pages from `iova_page` (at least one) that the IOTLB mapped contiguously to `uaddr..` and
    /// allowed `allowed` on, at `generation` (one past u32::MAX pages is cached as that many: shorter, never longer).
    pages: u32,
    /// The accesses the IOTLB allowed on all of the extent at `generation` (`Permissions` as bits).
    allowed: u8,
    generation: u64,
}

/// One queue's cache; the DMA path holds it (under its lock) for the length of one `Dma` call.
#[derive(Debug)]
pub struct TranslationCache {
    entries: Box<[Entry]>,
    hits: u64,
    fills: u64,
}

impl Default for TranslationCache {
    fn default() -> Self {
        let empty = Entry { iova_page: 0, uaddr: 0, pages: 0, allowed: 0, generation: NEVER };
        TranslationCache { entries: vec![empty; ENTRIES].into_boxed_slice(), hits: 0, fills: 0 }
    }
}

fn slot(iova_page: u64) -> usize {
    ((iova_page / PAGE_SIZE) as usize) % ENTRIES
}

impl TranslationCache {
    /// QEMU's address of `iova_page` (page-aligned) and the bytes mapped contiguously from there, if an entry
    /// filled at `generation` allowed `access` on them.
    #[inline]
    pub fn lookup(&mut self, iova_page: u64, access: Permissions, generation: u64) -> Option<(u64, u64)> {
        let e = &self.entries[slot(iova_page)];
        let want = access as u8;
        if e.generation == generation && e.iova_page == iova_page && e.allowed & want == want {
            self.hits += 1;
            return Some((e.uaddr, u64::from(e.pages) * PAGE_SIZE));
        }
        None
    }

    /// Records that the IOTLB, at `generation`, mapped `extent` bytes (whole pages, at least one) from `iova_page`
    /// contiguously to `uaddr..` and allowed `access` on all of them. Rights checked at the same generation for the
    /// same mapping add up, over the part both checks covered; a longer extent than the entry's replaces it with
    /// this access's rights alone (a transfer longer than the first one seen on its page is then one entry again).
    pub fn fill(&mut self, iova_page: u64, uaddr: u64, extent: u64, access: Permissions, generation: u64) {
        debug_assert!(extent >= PAGE_SIZE && extent.is_multiple_of(PAGE_SIZE));
        let e = &mut self.entries[slot(iova_page)];
        let same = e.generation == generation && e.iova_page == iova_page && e.uaddr == uaddr;
        let pages = u32::try_from(extent / PAGE_SIZE).unwrap_or(u32::MAX);
        let (allowed, pages) =
            if same && pages <= e.pages { (e.allowed | access as u8, pages) } else { (access as u8, pages) };
        *e = Entry { iova_page, uaddr, pages, allowed, generation };
        self.fills += 1;
    }

    /// Hits and fills so far (for tests and diagnostics).
    pub fn stats(&self) -> (u64, u64) {
        (self.hits, self.fills)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_one_half_cache_line() {
        assert_eq!((std::mem::size_of::<Entry>(), std::mem::align_of::<Entry>()), (32, 32));
    }

    #[test]
    fn a_hit_needs_the_same_page_generation_and_rights() {
        let mut cache = TranslationCache::default();
        assert_eq!(cache.lookup(0x1000, Permissions::Read, 0), None, "nothing filled yet");
        cache.fill(0x1000, 0x7000_0000, 4 * PAGE_SIZE, Permissions::Read, 3);
        assert_eq!(cache.lookup(0x1000, Permissions::Read, 3), Some((0x7000_0000, 4 * PAGE_SIZE)));
        assert_eq!(cache.lookup(0x1000, Permissions::Write, 3), None, "write was never checked");
        assert_eq!(cache.lookup(0x1000, Permissions::Read, 4), None, "the IOTLB changed since");
        assert_eq!(cache.lookup(0x2000, Permissions::Read, 3), None, "each page is looked up by its own entry");
        let aliased = 0x1000 + ENTRIES as u64 * PAGE_SIZE;
        assert_eq!(cache.lookup(aliased, Permissions::Read, 3), None, "same slot, other page");
        cache.fill(0x1000, 0x7000_0000, PAGE_SIZE, Permissions::Write, 3);
        assert_eq!(
            cache.lookup(0x1000, Permissions::ReadWrite, 3),
            Some((0x7000_0000, PAGE_SIZE)),
            "rights add up over the part both checks covered"
        );
        cache.fill(0x1000, 0x7000_0000, 8 * PAGE_SIZE, Permissions::Read, 3);
        assert_eq!(cache.lookup(0x1000, Permissions::Read, 3), Some((0x7000_0000, 8 * PAGE_SIZE)), "grown");
        assert_eq!(cache.lookup(0x1000, Permissions::Write, 3), None, "write was checked over one page only");
        cache.fill(0x1000, 0x9000_0000, PAGE_SIZE, Permissions::Write, 3);
        assert_eq!(cache.lookup(0x1000, Permissions::Read, 3), None, "a new mapping does not inherit rights");
        cache.fill(aliased, 0x8000_0000, PAGE_SIZE, Permissions::Read, 3);
        assert_eq!(cache.lookup(0x1000, Permissions::Write, 3), None, "evicted by the page sharing its slot");
        assert_eq!(cache.stats(), (3, 5));
    }
}
