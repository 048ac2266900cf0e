//! The map registers of one ring or MR (one per page) with what the DMA engine needs to walk them per contiguous
//! run instead of per page: the IOVA-contiguous extents the registers were set up with, and the pool epoch at which
//! every register of the list was last found held and fresh (`MapRegisterPool::epoch`).
//!
//! A register's IOVA never changes while it is held (a freed and re-taken register has a new generation), and the
//! pool bumps its epoch on every change to any register (take, release, invalidate, re-validation). So while the
//! epoch a list was checked at is the pool's current one, every register of the list is still held and fresh and
//! translates to the IOVA its extent says: the per-page check would find exactly that. Any change sends the next
//! DMA back through the per-page walk, which reports a refused register exactly as before.

use std::cell::Cell;

use vhca_proto::PAGE_SIZE;

use crate::map_registers::{MapRegisterPool, RegisterRef};

/// An epoch the pool's counter (from 0, +1 per change) never reaches: the list was never checked whole.
const NEVER: u64 = u64::MAX;

/// Pages `first..` of the list translate to IOVAs `iova..` contiguously, up to the next extent's first page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Extent {
    first: u64,
    iova: u64,
}

#[derive(Debug)]
pub struct MappedPages {
    registers: Vec<RegisterRef>,
    /// The extent at page 0 and the page after it, kept inline: most rings and MRs are one extent, and a DMA then
    /// reads nothing of the list but this struct.
    head: Extent,
    head_end: u64,
    /// The extents after the head, in page order.
    rest: Vec<Extent>,
    /// The pool epoch of the last whole-list check and its outcome (a failed one is not repeated in that epoch).
    checked: Cell<(u64, bool)>,
}

impl Default for MappedPages {
    fn default() -> Self {
        MappedPages {
            registers: Vec::new(),
            head: Extent { first: 0, iova: 0 },
            head_end: 0,
            rest: Vec::new(),
            checked: Cell::new((NEVER, false)),
        }
    }
}

impl MappedPages {
    /// `registers` as just taken from `pool`: their extents are read from the pool (where the IOVAs live).
    pub fn new(pool: &MapRegisterPool, registers: Vec<RegisterRef>) -> MappedPages {
        let mut extents: Vec<Extent> = Vec::new();
        let mut next_iova: Option<u64> = None;
        for (page, r) in registers.iter().enumerate() {
            let iova = pool.peek(*r);
            if iova.is_none() || iova != next_iova {
                // A page the pool does not translate starts an extent of its own; the whole-list check refuses it.
                extents.push(Extent { first: page as u64, iova: iova.unwrap_or(0) });
            }
            // An IOVA at the top of the address space ends its extent (no wrapping into a "contiguous" 0).
            next_iova = iova.and_then(|i| i.checked_add(PAGE_SIZE));
        }
        let total = registers.len() as u64;
        let head = extents.first().copied().unwrap_or(Extent { first: 0, iova: 0 });
        let head_end = extents.get(1).map_or(total, |e| e.first);
        let rest = extents.get(1..).unwrap_or_default().to_vec();
        MappedPages { registers, head, head_end, rest, checked: Cell::new((NEVER, false)) }
    }

    pub fn registers(&self) -> &[RegisterRef] {
        &self.registers
    }

    pub fn len(&self) -> usize {
        self.registers.len()
    }

    /// Whether every register is held and fresh at the pool's current epoch: checks them all once per epoch.
    /// Pure: a stale register is not re-validated here.
    pub fn all_fresh(&self, pool: &MapRegisterPool) -> bool {
        let epoch = pool.epoch();
        let (at, fresh) = self.checked.get();
        if at == epoch {
            return fresh;
        }
        let fresh = self.registers.iter().all(|r| pool.is_fresh(*r));
        self.checked.set((epoch, fresh));
        fresh
    }

    /// The IOVA of byte `offset` of the list and how many bytes from there are IOVA-contiguous (to the end of its
    /// extent, at most `max_pages` pages counted from the page of `offset`), or None past the last page. Only
    /// meaningful while `all_fresh` holds.
    pub fn contiguous_at(&self, offset: u64, max_pages: u64) -> Option<(u64, u64)> {
        let page = offset / PAGE_SIZE;
        let total = self.registers.len() as u64;
        if page >= total {
            return None;
        }
        let (e, end) = if page < self.head_end {
            (self.head, self.head_end)
        } else {
            // The last extent starting at or before `page` (rest[0] starts at head_end).
            let i = self.rest.partition_point(|e| e.first <= page).checked_sub(1)?;
            (self.rest[i], self.rest.get(i + 1).map_or(total, |n| n.first))
        };
        let pages = (end - page).min(max_pages.max(1));
        let iova = e.iova + (page - e.first) * PAGE_SIZE + offset % PAGE_SIZE;
        Some((iova, pages * PAGE_SIZE - offset % PAGE_SIZE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_follow_iova_contiguity_and_the_check_lasts_only_one_epoch() {
        let mut pool = MapRegisterPool::new(8);
        let top = !(PAGE_SIZE - 1); // the highest page
        let regs = pool.take(&[0x1000, 0x2000, 0x9000, top, 0x3000]).unwrap();
        let pages = MappedPages::new(&pool, regs.clone());
        assert_eq!(pages.contiguous_at(0x10, u64::MAX), Some((0x1010, 2 * PAGE_SIZE - 0x10)));
        assert_eq!(pages.contiguous_at(0x1000, 1), Some((0x2000, PAGE_SIZE)));
        assert_eq!(pages.contiguous_at(0x2ff0, u64::MAX), Some((0x9ff0, 0x10)), "0x9000 then the top page");
        assert_eq!(pages.contiguous_at(0x3000, u64::MAX), Some((top, PAGE_SIZE)), "no wrap into page 0");
        assert_eq!(pages.contiguous_at(0x4000, u64::MAX), Some((0x3000, PAGE_SIZE)));
        assert_eq!(pages.contiguous_at(0x5000, u64::MAX), None);

        assert!(pages.all_fresh(&pool));
        pool.invalidate(0x9000, 1);
        assert!(!pages.all_fresh(&pool), "a stale register fails the check at the new epoch");
        assert_eq!(pool.translate(regs[2], true), Ok(0x9000), "re-validated");
        assert!(pages.all_fresh(&pool));
        let other = pool.take(&[0x5000]).unwrap();
        assert!(pages.all_fresh(&pool), "taking other registers leaves these held");
        pool.release(&other);
        pool.release(&regs[4..]);
        assert!(!pages.all_fresh(&pool), "a released register fails the check");
        let again = pool.take(&[0x3000]).unwrap();
        assert_eq!(again[0].index, regs[4].index, "the same register, taken by someone else");
        assert!(!pages.all_fresh(&pool), "a register re-taken under a new generation still fails it");
    }
}
