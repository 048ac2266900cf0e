//! The device IOTLB: IOVA → QEMU virtual address entries that QEMU sends, behind vm-memory's `Iommu` trait.
//! Every refused translation is recorded, because virtio-queue's descriptor walk swallows the error.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use vhca_proto::{NUM_QUEUES, PAGE_SIZE};
use vhost::VhostAccess;
use vm_memory::iommu::{IotlbIterator, IovaRange};
use vm_memory::{GuestAddress, Iommu, Iotlb, Permissions};

use crate::translation_cache::TranslationCache;

/// Why a translation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// No IOTLB entry covers the address: ask QEMU (a miss), and if it has none either, an IOMMU fault.
    Unmapped,
    /// An entry exists but forbids this access.
    Permission,
}

/// The first refused byte range of one translation attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TranslationFault {
    pub iova: u64,
    pub len: u64,
    pub access: Permissions,
    pub kind: FaultKind,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IotlbError {
    #[error("IOTLB entry of size 0 at iova {0:#x}")]
    EmptyRange(u64),
    #[error("IOTLB entry [{iova:#x} + {size:#x}) wraps around the address space")]
    Overflow { iova: u64, size: u64 },
    #[error("IOTLB entry at iova {iova:#x} has size {size:#x}, more than this host can address")]
    TooLarge { iova: u64, size: u64 },
    #[error("IOTLB permission {0} is not read, write or read-write")]
    BadPermission(u8),
}

/// vhost's `VHOST_ACCESS_*` encoding of a permission.
pub fn perm_from_vhost(raw: u8) -> Result<Permissions, IotlbError> {
    match raw {
        r if r == VhostAccess::ReadOnly as u8 => Ok(Permissions::Read),
        w if w == VhostAccess::WriteOnly as u8 => Ok(Permissions::Write),
        rw if rw == VhostAccess::ReadWrite as u8 => Ok(Permissions::ReadWrite),
        other => Err(IotlbError::BadPermission(other)),
    }
}

pub fn perm_to_vhost(perm: Permissions) -> u8 {
    match perm {
        Permissions::No => VhostAccess::No as u8,
        Permissions::Read => VhostAccess::ReadOnly as u8,
        Permissions::Write => VhostAccess::WriteOnly as u8,
        Permissions::ReadWrite => VhostAccess::ReadWrite as u8,
    }
}

/// The IOTLB plus the bookkeeping the transport needs around it: the last refusal, a generation counter the
/// worker can wait on while QEMU answers a miss, and one translation cache per queue for the DMA path. The IOTLB
/// has its own lock so the front-end thread can apply an UPDATE while the worker is busy.
#[derive(Debug)]
pub struct DeviceIommu {
    iotlb: RwLock<Iotlb>,
    /// Bumped by every change of the IOTLB, while its write lock is held: the tag of every cached translation.
    iotlb_generation: AtomicU64,
    caches: Box<[Mutex<QueueTranslations>]>,
    fault: Mutex<Option<TranslationFault>>,
    generation: Mutex<u64>,
    changed: Condvar,
}

impl Default for DeviceIommu {
    fn default() -> Self {
        DeviceIommu {
            iotlb: RwLock::default(),
            iotlb_generation: AtomicU64::new(0),
            caches: (0..NUM_QUEUES).map(|_| Mutex::default()).collect(),
            fault: Mutex::default(),
            generation: Mutex::default(),
            changed: Condvar::new(),
        }
    }
}

/// A piece of a translated range that is contiguous in QEMU's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRun {
    pub uaddr: u64,
    pub len: usize,
}

/// One queue's translation cache and the run lists its DMA translates into (kept, so a DMA allocates nothing).
#[derive(Debug, Default)]
pub struct QueueTranslations {
    pub pages: TranslationCache,
    pub from: Vec<HostRun>,
    pub to: Vec<HostRun>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl DeviceIommu {
    pub fn new() -> DeviceIommu {
        DeviceIommu::default()
    }

    fn read_iotlb(&self) -> RwLockReadGuard<'_, Iotlb> {
        self.iotlb.read().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The IOTLB for a change; the caller bumps `iotlb_generation` before letting go of it, so no translation
    /// cached before the change can be taken for one made after it.
    fn write_iotlb(&self) -> RwLockWriteGuard<'_, Iotlb> {
        self.iotlb.write().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn changed_under(&self, _iotlb: &RwLockWriteGuard<'_, Iotlb>) {
        self.iotlb_generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The translation cache of `queue`.
    pub fn cache(&self, queue: u16) -> MutexGuard<'_, QueueTranslations> {
        lock(&self.caches[usize::from(queue) % self.caches.len()])
    }

    /// The translation cache of `queue`, unless someone holds it now (the DMA path then goes uncached rather than
    /// wait, so two holders on one thread cannot deadlock).
    pub fn try_cache(&self, queue: u16) -> Option<MutexGuard<'_, QueueTranslations>> {
        match self.caches[usize::from(queue) % self.caches.len()].try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Translates [iova, iova + len) for `access` through `cache` into `out`, as runs contiguous in QEMU's address
    /// space: one cache entry per contiguous mapping met. A page the cache does not hold is looked up in the
    /// IOTLB and cached if the IOTLB maps all of it (and how far on contiguously) with `access`. False if any page
    /// is not so translated (unmapped, refused, a partial entry, a range that wraps): the caller then takes the
    /// uncached path, which records the fault or asks QEMU. Records nothing itself.
    pub fn translate_cached(
        &self,
        cache: &mut TranslationCache,
        iova: u64,
        len: usize,
        access: Permissions,
        out: &mut Vec<HostRun>,
    ) -> bool {
        out.clear();
        let Some(end) = u64::try_from(len).ok().and_then(|len| iova.checked_add(len)) else { return false };
        // Read before any lookup below: an entry filled from an IOTLB that changed meanwhile carries the old tag.
        let generation = self.iotlb_generation.load(Ordering::Acquire);
        let mut pos = iova;
        while pos < end {
            let page = pos & !(PAGE_SIZE - 1);
            let hit = match cache.lookup(page, access, generation) {
                // An entry shorter than what is left of the access (filled by a shorter one first) is looked up
                // again for all of it, so the next such transfer is one entry (`translate_cached_single`).
                Some((uaddr, extent)) if extent < end - page => self
                    .fill(cache, page, end - page, access, generation)
                    .filter(|f| f.1 > extent)
                    .or(Some((uaddr, extent))),
                Some(hit) => Some(hit),
                None => self.fill(cache, page, end - page, access, generation),
            };
            let Some((page_uaddr, extent)) = hit else { return false };
            let within = pos - page;
            let n = (extent - within).min(end - pos);
            // The fill saw the IOTLB map the whole extent from page_uaddr, and entries never wrap (`update`).
            let uaddr = page_uaddr + within;
            match out.last_mut() {
                Some(last) if last.uaddr.checked_add(last.len as u64) == Some(uaddr) => last.len += n as usize,
                _ => out.push(HostRun { uaddr, len: n as usize }),
            }
            pos += n;
        }
        true
    }

    /// QEMU's address of `iova` if one cached entry maps all of [iova, iova + len) contiguously with `access` (a
    /// WQE, a CQE, any transfer the cache has seen whole): no run list to build. None otherwise, having filled
    /// nothing: `translate_cached` then does the general walk (and the fills).
    #[inline]
    pub fn translate_cached_single(
        &self,
        cache: &mut TranslationCache,
        iova: u64,
        len: usize,
        access: Permissions,
    ) -> Option<u64> {
        let end = u64::try_from(len).ok().and_then(|len| iova.checked_add(len))?;
        let page = iova & !(PAGE_SIZE - 1);
        let (uaddr, extent) = cache.lookup(page, access, self.iotlb_generation.load(Ordering::Acquire))?;
        // The fill saw the IOTLB map the whole extent from uaddr, and entries never wrap (`update`).
        (end - page <= extent).then(|| uaddr + (iova - page))
    }

    /// Looks `page` up in the IOTLB, for the `wanted` bytes from there the access needs (the whole page at least),
    /// and caches the page with the whole pages mapped contiguously from it if `access` is allowed on them.
    fn fill(
        &self,
        cache: &mut TranslationCache,
        page: u64,
        wanted: u64,
        access: Permissions,
        generation: u64,
    ) -> Option<(u64, u64)> {
        let span = wanted.checked_next_multiple_of(PAGE_SIZE)?.max(PAGE_SIZE);
        page.checked_add(span)?;
        // All of `span` first (one entry for a whole transfer); if some later page refuses, the page alone.
        let first = [span, PAGE_SIZE].into_iter().find_map(|len| {
            let mut ranges = Iotlb::lookup(self.read_iotlb(), GuestAddress(page), usize::try_from(len).ok()?, access);
            ranges.as_mut().ok()?.next()
        })?;
        let extent = first.length as u64 / PAGE_SIZE * PAGE_SIZE;
        if extent == 0 {
            return None;
        }
        cache.fill(page, first.base.0, extent, access, generation);
        Some((first.base.0, extent))
    }

    /// Maps [iova, iova + size) to QEMU address `uaddr` with `perm`, replacing what was there.
    pub fn update(&self, iova: u64, size: u64, uaddr: u64, perm: Permissions) -> Result<(), IotlbError> {
        if size == 0 {
            return Err(IotlbError::EmptyRange(iova));
        }
        if iova.checked_add(size).is_none() || uaddr.checked_add(size).is_none() {
            return Err(IotlbError::Overflow { iova, size });
        }
        let len = usize::try_from(size).map_err(|_| IotlbError::TooLarge { iova, size })?;
        let mut iotlb = self.write_iotlb();
        // set_mapping only fails for ranges we already refused above.
        if iotlb.set_mapping(GuestAddress(iova), GuestAddress(uaddr), len, perm).is_err() {
            return Err(IotlbError::Overflow { iova, size });
        }
        self.changed_under(&iotlb);
        drop(iotlb);
        self.bump();
        Ok(())
    }

    /// Drops entries in [iova, iova + size). A size that runs past the end of the address space (QEMU's
    /// whole-domain flushes) drops everything from `iova` up.
    pub fn invalidate(&self, iova: u64, size: u64) {
        let mut iotlb = self.write_iotlb();
        let end = iova.checked_add(size).filter(|_| size != 0).unwrap_or(u64::MAX);
        if end > iova {
            // usize is 64 bits on every host this device runs on; clamp anyway rather than truncate silently.
            let len = usize::try_from(end - iova).unwrap_or(usize::MAX);
            iotlb.invalidate_mapping(GuestAddress(iova), len);
        }
        self.changed_under(&iotlb);
        drop(iotlb);
        self.bump();
    }

    pub fn invalidate_all(&self) {
        let mut iotlb = self.write_iotlb();
        iotlb.invalidate_all();
        self.changed_under(&iotlb);
        drop(iotlb);
        self.bump();
    }

    /// Where the first byte of [iova, iova + len) lands, if the whole range allows `access`. Records the fault
    /// otherwise, like every translation.
    pub fn first_target(&self, iova: u64, len: usize, access: Permissions) -> Option<u64> {
        let mut ranges = self.translate(GuestAddress(iova), len.max(1), access).ok()?;
        ranges.next().map(|range| range.base.0)
    }

    /// Forgets any recorded fault; call before an operation whose faults you want to see.
    pub fn clear_fault(&self) {
        *lock(&self.fault) = None;
    }

    /// The first fault recorded since the last `clear_fault`/`take_fault`.
    pub fn take_fault(&self) -> Option<TranslationFault> {
        lock(&self.fault).take()
    }

    /// Changes every time the IOTLB changes or `wake_waiters` is called.
    pub fn generation(&self) -> u64 {
        *lock(&self.generation)
    }

    /// Wakes anyone in `wait_for_change` without changing the IOTLB (used to interrupt a miss wait).
    pub fn wake_waiters(&self) {
        self.bump();
    }

    /// Blocks until the generation moves past `seen` or `deadline` passes. Returns whether it moved.
    pub fn wait_for_change(&self, seen: u64, deadline: Instant) -> bool {
        let mut generation = lock(&self.generation);
        while *generation == seen {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            generation = match self.changed.wait_timeout(generation, deadline - now) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        true
    }

    fn bump(&self) {
        let mut generation = lock(&self.generation);
        *generation = generation.wrapping_add(1);
        self.changed.notify_all();
    }

    fn record(&self, fault: TranslationFault) {
        let mut slot = lock(&self.fault);
        if slot.is_none() {
            *slot = Some(fault);
        }
    }
}

impl Iommu for DeviceIommu {
    type IotlbGuard<'a> = RwLockReadGuard<'a, Iotlb>;

    fn translate(
        &self,
        iova: GuestAddress,
        length: usize,
        access: Permissions,
    ) -> Result<IotlbIterator<Self::IotlbGuard<'_>>, vm_memory::iommu::Error> {
        let refuse = |reason: &str| vm_memory::iommu::Error::CannotResolve {
            iova_range: IovaRange { base: iova, length },
            reason: reason.to_string(),
        };
        // Iotlb::lookup adds length to iova unchecked; guest-supplied ranges that wrap must stop here.
        if u64::try_from(length).ok().and_then(|len| iova.0.checked_add(len)).is_none() {
            self.record(TranslationFault { iova: iova.0, len: length as u64, access, kind: FaultKind::Unmapped });
            return Err(refuse("range wraps around the address space"));
        }
        match Iotlb::lookup(self.read_iotlb(), iova, length, access) {
            Ok(ranges) => Ok(ranges),
            Err(fails) => {
                let (range, kind) = match (fails.misses.first(), fails.access_fails.first()) {
                    // Report whichever refused range comes first in the access.
                    (Some(miss), Some(deny)) if deny.base < miss.base => (deny.clone(), FaultKind::Permission),
                    (Some(miss), _) => (miss.clone(), FaultKind::Unmapped),
                    (None, Some(deny)) => (deny.clone(), FaultKind::Permission),
                    (None, None) => (IovaRange { base: iova, length }, FaultKind::Unmapped),
                };
                self.record(TranslationFault { iova: range.base.0, len: range.length as u64, access, kind });
                Err(refuse(match kind {
                    FaultKind::Unmapped => "not in the IOTLB",
                    FaultKind::Permission => "IOTLB entry forbids this access",
                }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn update_then_translate_lands_at_uaddr() {
        let iommu = DeviceIommu::new();
        iommu.update(0x1_0000_0000, 0x2000, 0x7f00_0000_0000, Permissions::ReadWrite).unwrap();
        assert_eq!(iommu.first_target(0x1_0000_0010, 16, Permissions::Read), Some(0x7f00_0000_0010));
        let ranges: Vec<_> = iommu.translate(GuestAddress(0x1_0000_1ff0), 0x10, Permissions::Write).unwrap().collect();
        assert_eq!(ranges.len(), 1);
        assert_eq!(ranges[0].base, GuestAddress(0x7f00_0000_1ff0));
        assert_eq!(iommu.take_fault(), None);
    }

    #[test]
    fn range_crossing_two_entries_translates_piecewise() {
        let iommu = DeviceIommu::new();
        iommu.update(0x1000, 0x1000, 0x9000, Permissions::Read).unwrap();
        iommu.update(0x2000, 0x1000, 0x5000, Permissions::Read).unwrap();
        let ranges: Vec<_> = iommu.translate(GuestAddress(0x1800), 0x1000, Permissions::Read).unwrap().collect();
        assert_eq!(
            ranges.iter().map(|r| (r.base.0, r.length)).collect::<Vec<_>>(),
            vec![(0x9800, 0x800), (0x5000, 0x800)]
        );
    }

    #[test]
    fn invalidate_turns_hits_into_recorded_misses() {
        let iommu = DeviceIommu::new();
        iommu.update(0x4000, 0x2000, 0x10000, Permissions::ReadWrite).unwrap();
        iommu.invalidate(0x5000, 0x1000);
        assert!(iommu.first_target(0x4000, 8, Permissions::Read).is_some());
        assert_eq!(iommu.first_target(0x4ff8, 16, Permissions::Read), None);
        assert_eq!(
            iommu.take_fault(),
            Some(TranslationFault { iova: 0x5000, len: 8, access: Permissions::Read, kind: FaultKind::Unmapped })
        );
        assert_eq!(iommu.take_fault(), None, "take_fault consumes the record");
    }

    #[test]
    fn write_to_read_only_entry_is_a_permission_fault() {
        let iommu = DeviceIommu::new();
        iommu.update(0x4000, 0x1000, 0x10000, Permissions::Read).unwrap();
        assert_eq!(iommu.first_target(0x4100, 4, Permissions::Write), None);
        let fault = iommu.take_fault().unwrap();
        assert_eq!((fault.iova, fault.kind), (0x4100, FaultKind::Permission));
    }

    #[test]
    fn wrapping_and_empty_ranges_never_panic() {
        let iommu = DeviceIommu::new();
        iommu.update(0x0, 0x1000, 0x10000, Permissions::ReadWrite).unwrap();
        assert_eq!(iommu.first_target(u64::MAX - 4, 64, Permissions::Read), None);
        assert_eq!(iommu.take_fault().map(|f| f.kind), Some(FaultKind::Unmapped));
        assert!(iommu.translate(GuestAddress(0x10), 0, Permissions::Read).is_ok());
        assert_eq!(
            iommu.update(u64::MAX - 10, 0x100, 0, Permissions::Read),
            Err(IotlbError::Overflow { iova: u64::MAX - 10, size: 0x100 })
        );
        assert_eq!(iommu.update(0x1000, 0, 0, Permissions::Read), Err(IotlbError::EmptyRange(0x1000)));
        // A whole-space flush (size wraps to 0 or past the end) drops everything above iova.
        iommu.invalidate(0, 0);
        assert_eq!(iommu.first_target(0x0, 8, Permissions::Read), None);
    }

    #[test]
    fn waiters_see_updates_and_time_out_without_them() {
        let iommu = std::sync::Arc::new(DeviceIommu::new());
        let seen = iommu.generation();
        assert!(!iommu.wait_for_change(seen, Instant::now() + Duration::from_millis(20)));
        let other = iommu.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            other.update(0, 0x1000, 0x1000, Permissions::Read).unwrap();
        });
        assert!(iommu.wait_for_change(seen, Instant::now() + Duration::from_secs(5)));
        t.join().unwrap();
    }

    #[test]
    fn cached_translation_takes_whole_contiguous_extents_and_drops_them_on_any_change() {
        let iommu = DeviceIommu::new();
        // Four IOVA pages onto four contiguous QEMU pages, then one elsewhere.
        iommu.update(0x10000, 0x4000, 0x7f00_0000_0000, Permissions::ReadWrite).unwrap();
        iommu.update(0x14000, 0x1000, 0x7f00_0009_0000, Permissions::Read).unwrap();
        let mut cache = iommu.cache(0);
        let QueueTranslations { pages, from, .. } = &mut *cache;
        assert!(iommu.translate_cached(pages, 0x10010, 0x4ff0, Permissions::Read, from));
        assert_eq!(
            from.as_slice(),
            [HostRun { uaddr: 0x7f00_0000_0010, len: 0x3ff0 }, HostRun { uaddr: 0x7f00_0009_0000, len: 0x1000 }]
        );
        let (hits, fills) = pages.stats();
        assert!(iommu.translate_cached(pages, 0x10000, 0x4000, Permissions::Read, from));
        assert_eq!(pages.stats(), (hits + 1, fills), "one entry served the whole contiguous extent");
        assert!(!iommu.translate_cached(pages, 0x14000, 8, Permissions::Write, from), "read-only page");
        assert!(!iommu.translate_cached(pages, 0x15000, 8, Permissions::Read, from), "unmapped page");
        assert!(!iommu.translate_cached(pages, u64::MAX - 4, 8, Permissions::Read, from), "wraps");
        assert_eq!(iommu.take_fault(), None, "the cached path records nothing; the uncached path reports");

        iommu.invalidate(0x12000, 0x1000);
        assert!(!iommu.translate_cached(pages, 0x10000, 0x4000, Permissions::Read, from), "a hole now");
        assert!(iommu.translate_cached(pages, 0x10000, 0x2000, Permissions::Read, from));
        assert!(iommu.translate_cached(pages, 0x13000, 0x1000, Permissions::Read, from));
        iommu.update(0x13000, 0x1000, 0x7f00_0005_0000, Permissions::Read).unwrap();
        assert!(iommu.translate_cached(pages, 0x13000, 0x10, Permissions::Read, from));
        assert_eq!(from.as_slice(), [HostRun { uaddr: 0x7f00_0005_0000, len: 0x10 }], "the new mapping");
        iommu.invalidate_all();
        assert!(!iommu.translate_cached(pages, 0x10000, 0x10, Permissions::Read, from));
        // A short access first, then a long one from the same page: the entry grows to the long one's extent, so
        // the next long access is one entry (`translate_cached_single`), and still only where the IOTLB maps.
        iommu.update(0x30000, 0x4000, 0x7f00_0010_0000, Permissions::ReadWrite).unwrap();
        assert!(iommu.translate_cached(pages, 0x30000, 0x10, Permissions::Write, from));
        assert_eq!(iommu.translate_cached_single(pages, 0x30000, 0x4000, Permissions::Write), None, "one page so far");
        assert!(iommu.translate_cached(pages, 0x30000, 0x4000, Permissions::Write, from));
        assert_eq!(from.as_slice(), [HostRun { uaddr: 0x7f00_0010_0000, len: 0x4000 }]);
        assert_eq!(iommu.translate_cached_single(pages, 0x30008, 0x3ff8, Permissions::Write), Some(0x7f00_0010_0008));
        assert_eq!(iommu.translate_cached_single(pages, 0x30008, 0x3ff9, Permissions::Write), None, "past the map");
        assert_eq!(iommu.translate_cached_single(pages, 0x30008, 8, Permissions::Read), None, "read never checked");
        // A mapping smaller than a page is never cached (the uncached path serves it).
        iommu.update(0x20000, 0x800, 0x7f00_0001_0000, Permissions::Read).unwrap();
        assert!(!iommu.translate_cached(pages, 0x20000, 0x10, Permissions::Read, from));
    }

    #[test]
    fn vhost_permission_encoding_round_trips() {
        for raw in 1..=3u8 {
            assert_eq!(perm_to_vhost(perm_from_vhost(raw).unwrap()), raw);
        }
        assert_eq!(perm_from_vhost(0), Err(IotlbError::BadPermission(0)));
        assert_eq!(perm_from_vhost(7), Err(IotlbError::BadPermission(7)));
    }
}
