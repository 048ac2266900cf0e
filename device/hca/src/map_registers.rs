//! The map-register pool: the HCA's page-translation table, N entries per boot, one per ring or MR page.
//! Registers are taken all-or-nothing per object and checked on every use (freed, reused, stale after invalidate).

use vhca_proto::{FaultCause, PAGE_SIZE};

/// What a register translates for; logged with every map and unmap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    Cq(u32),
    SendQueue(u32),
    RecvQueue(u32),
    Mr(u32),
}

impl Owner {
    pub fn kind(self) -> &'static str {
        match self {
            Owner::Cq(_) => "cq",
            Owner::SendQueue(_) => "sq",
            Owner::RecvQueue(_) => "rq",
            Owner::Mr(_) => "mr",
        }
    }

    pub fn handle(self) -> u32 {
        match self {
            Owner::Cq(h) | Owner::SendQueue(h) | Owner::RecvQueue(h) | Owner::Mr(h) => h,
        }
    }
}

/// A held register: its index and the generation it had when taken. A register freed and taken again gets a new
/// generation, so a stale holder is told apart from the new owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterRef {
    pub index: u32,
    pub generation: u32,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    iova_page: u64,
    /// An IOTLB invalidation covered this page after the register was set up.
    stale: bool,
    /// The invalidation was QEMU's, so asking the vIOMMU again can tell whether the mapping really changed; an
    /// injected one (`invalidate_at_dma`) changed no mapping and stays a refusal.
    confirmable: bool,
    /// Where the page's IOVA led when the register was taken (the host address `Dma::translation` gave), if known.
    first: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    generation: u32,
    entry: Option<Entry>,
}

/// Why `take` refused: not enough free registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exhausted {
    pub wanted: u32,
    pub free: u32,
}

pub struct MapRegisterPool {
    slots: Vec<Slot>,
    /// Free indices, lowest last, so registers are handed out in ascending order (readable logs).
    free: Vec<u32>,
    /// Bumped by every change to any register (take, release, invalidate, re-validation): a check of held
    /// registers made at one epoch holds for as long as the epoch does (`MappedPages::all_fresh`).
    epoch: u64,
}

impl MapRegisterPool {
    pub fn new(total: u32) -> MapRegisterPool {
        MapRegisterPool {
            slots: vec![Slot { generation: 0, entry: None }; total as usize],
            free: (0..total).rev().collect(),
            epoch: 0,
        }
    }

    pub fn total(&self) -> u32 {
        self.slots.len() as u32
    }

    pub fn free_count(&self) -> u32 {
        self.free.len() as u32
    }

    pub fn in_use(&self) -> u32 {
        self.total() - self.free_count()
    }

    /// Takes one register per page (IOVAs page-aligned), or none at all.
    pub fn take(&mut self, iova_pages: &[u64]) -> Result<Vec<RegisterRef>, Exhausted> {
        let wanted = u32::try_from(iova_pages.len()).unwrap_or(u32::MAX);
        if iova_pages.len() > self.free.len() {
            return Err(Exhausted { wanted, free: self.free_count() });
        }
        self.epoch += 1;
        let mut taken = Vec::with_capacity(iova_pages.len());
        for &iova in iova_pages {
            let Some(index) = self.free.pop() else { break };
            let slot = &mut self.slots[index as usize];
            slot.generation = slot.generation.wrapping_add(1);
            slot.entry =
                Some(Entry { iova_page: iova & !(PAGE_SIZE - 1), stale: false, confirmable: false, first: None });
            taken.push(RegisterRef { index, generation: slot.generation });
        }
        Ok(taken)
    }

    /// Returns registers to the pool. Refs that no longer hold their register are skipped (never a double free).
    pub fn release(&mut self, refs: &[RegisterRef]) -> u32 {
        self.epoch += 1;
        let mut released = 0;
        for r in refs.iter().rev() {
            let Some(slot) = self.slots.get_mut(r.index as usize) else { continue };
            if slot.generation == r.generation && slot.entry.is_some() {
                slot.entry = None;
                self.free.push(r.index);
                released += 1;
            }
        }
        released
    }

    /// The IOVA page a held register translates to, or why it cannot be used. `revalidate` clears a stale mark
    /// instead of refusing (HcaConfig::revalidate_stale).
    pub fn translate(&mut self, r: RegisterRef, revalidate: bool) -> Result<u64, FaultCause> {
        let slot = self.slots.get_mut(r.index as usize).ok_or(FaultCause::FreedMapRegister)?;
        if slot.generation != r.generation {
            return Err(FaultCause::FreedMapRegister);
        }
        let entry = slot.entry.as_mut().ok_or(FaultCause::FreedMapRegister)?;
        if entry.stale {
            if !revalidate {
                return Err(FaultCause::StaleTranslation);
            }
            entry.stale = false;
            self.epoch += 1;
        }
        Ok(entry.iova_page)
    }

    /// The IOVA page a held register translates to, stale or not, without re-validating (for logs).
    pub fn peek(&self, r: RegisterRef) -> Option<u64> {
        let slot = self.slots.get(r.index as usize)?;
        if slot.generation != r.generation {
            return None;
        }
        slot.entry.map(|e| e.iova_page)
    }

    /// Whether `r` holds its register and the register is not stale: what `translate` accepts without
    /// re-validating. No side effects.
    #[inline]
    pub fn is_fresh(&self, r: RegisterRef) -> bool {
        self.slots
            .get(r.index as usize)
            .is_some_and(|slot| slot.generation == r.generation && slot.entry.is_some_and(|e| !e.stale))
    }

    /// The count of changes so far (see `epoch` above).
    #[inline]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Where a register's page led when it was taken (what `confirm` compares with later).
    pub fn record_first(&mut self, r: RegisterRef, target: Option<u64>) {
        if let Some(entry) = self.slots.get_mut(r.index as usize).filter(|s| s.generation == r.generation) {
            if let Some(e) = entry.entry.as_mut() {
                e.first = target;
            }
        }
    }

    /// A held register a QEMU invalidation made stale, with the IOVA page to ask about and where it led when taken:
    /// what `confirm` may clear. None for a fresh, freed or injected-stale register, or one whose first translation
    /// is unknown.
    pub fn confirmable(&self, r: RegisterRef) -> Option<(u64, u64)> {
        let slot = self.slots.get(r.index as usize).filter(|s| s.generation == r.generation)?;
        let e = slot.entry?;
        (e.stale && e.confirmable).then_some(()).and(e.first.map(|first| (e.iova_page, first)))
    }

    /// The vIOMMU still maps the register's page where it led when taken: the invalidation that covered it was wider
    /// than the unmap behind it (VT-d invalidates aligned power-of-two ranges), so the register is fresh again.
    pub fn confirm(&mut self, r: RegisterRef) {
        if let Some(slot) = self.slots.get_mut(r.index as usize).filter(|s| s.generation == r.generation) {
            if let Some(e) = slot.entry.as_mut().filter(|e| e.stale) {
                e.stale = false;
                self.epoch += 1;
            }
        }
    }

    /// Marks every register whose page meets [iova, iova + size) stale, as QEMU's IOTLB invalidation does.
    /// Returns how many were marked.
    pub fn invalidate(&mut self, iova: u64, size: u64) -> u32 {
        self.mark_stale(iova, size, true)
    }

    /// The same for an injected invalidation (`invalidate_at_dma`), which changed no mapping: never confirmed.
    pub fn invalidate_injected(&mut self, iova: u64, size: u64) -> u32 {
        self.mark_stale(iova, size, false)
    }

    fn mark_stale(&mut self, iova: u64, size: u64, confirmable: bool) -> u32 {
        let end = iova.saturating_add(size);
        let mut marked = 0;
        for slot in &mut self.slots {
            if let Some(entry) = slot.entry.as_mut() {
                let page_end = entry.iova_page.saturating_add(PAGE_SIZE);
                if entry.iova_page < end && iova < page_end {
                    if !entry.stale {
                        entry.stale = true;
                        entry.confirmable = confirmable;
                        marked += 1;
                    } else {
                        // A later hard mark wins over an earlier confirmable one.
                        entry.confirmable &= confirmable;
                    }
                }
            }
        }
        // An invalidation that met no held register changed none (QEMU sends many): checks made before still hold.
        if marked > 0 {
            self.epoch += 1;
        }
        marked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_is_all_or_nothing_and_release_returns() {
        let mut pool = MapRegisterPool::new(4);
        let a = pool.take(&[0x1000, 0x2000, 0x3000]).unwrap();
        assert_eq!(pool.free_count(), 1);
        assert_eq!(pool.take(&[0x4000, 0x5000]), Err(Exhausted { wanted: 2, free: 1 }));
        assert_eq!(pool.free_count(), 1);
        assert_eq!(pool.release(&a), 3);
        assert_eq!(pool.release(&a), 0, "second release of the same refs frees nothing");
        assert_eq!(pool.free_count(), 4);
    }

    #[test]
    fn reused_register_refuses_old_holder() {
        let mut pool = MapRegisterPool::new(1);
        let old = pool.take(&[0x1000]).unwrap();
        pool.release(&old);
        let new = pool.take(&[0x7000]).unwrap();
        assert_eq!(pool.translate(old[0], false), Err(FaultCause::FreedMapRegister));
        assert_eq!(pool.translate(new[0], false), Ok(0x7000));
    }

    #[test]
    fn invalidate_marks_only_overlapping_pages() {
        let mut pool = MapRegisterPool::new(3);
        let r = pool.take(&[0x1000, 0x2000, 0x3000]).unwrap();
        let epoch = pool.epoch();
        assert_eq!(pool.invalidate(0x8000, 0x1000), 0);
        assert_eq!(pool.epoch(), epoch, "nothing marked, nothing changed");
        assert_eq!(pool.invalidate(0x2fff, 1), 1);
        assert_ne!(pool.epoch(), epoch, "a register went stale");
        assert_eq!(pool.translate(r[0], false), Ok(0x1000));
        assert_eq!(pool.translate(r[1], false), Err(FaultCause::StaleTranslation));
        assert_eq!(pool.translate(r[1], true), Ok(0x2000));
        assert_eq!(pool.translate(r[1], false), Ok(0x2000), "revalidated");
    }

    #[test]
    fn a_stale_register_is_confirmable_only_after_a_qemu_invalidation_with_its_first_target_known() {
        let mut pool = MapRegisterPool::new(3);
        let r = pool.take(&[0x1000, 0x2000, 0x3000]).unwrap();
        pool.record_first(r[0], Some(0x7f00_0000));
        pool.record_first(r[1], Some(0x7f00_1000));
        assert_eq!(pool.confirmable(r[0]), None, "fresh");
        assert_eq!(pool.invalidate(0x0, 0x4000), 3);
        assert_eq!(pool.confirmable(r[0]), Some((0x1000, 0x7f00_0000)));
        assert_eq!(pool.confirmable(r[2]), None, "no first target recorded");
        let epoch = pool.epoch();
        pool.confirm(r[0]);
        assert_ne!(pool.epoch(), epoch);
        assert_eq!(pool.translate(r[0], false), Ok(0x1000), "confirmed: fresh again");
        assert_eq!(pool.translate(r[1], false), Err(FaultCause::StaleTranslation), "not confirmed: still refused");
        // An injected invalidation changed no mapping: it is never confirmable, even over a confirmable mark.
        assert_eq!(pool.invalidate_injected(0x1000, 0x1000), 1);
        assert_eq!(pool.confirmable(r[0]), None);
        assert_eq!(pool.invalidate_injected(0x2000, 0x1000), 0, "already stale");
        assert_eq!(pool.confirmable(r[1]), None, "the hard mark wins");
        // A register freed and taken again is another holder's: its old ref confirms nothing.
        pool.release(&r[2..]);
        let again = pool.take(&[0x3000]).unwrap();
        pool.confirm(r[2]);
        assert_eq!(pool.translate(again[0], false), Ok(0x3000));
    }
}
