//! The HCA's view of guest memory: `vhca_hca::Dma` over the IOMMU-translated memory. Each access is first
//! translated through the queue's translation cache (page-granular, dropped whole by any IOTLB change); whatever
//! that cannot translate takes vm-memory's path, where a miss is asked of QEMU and waited for (on the worker
//! thread, bounded) and what stays refused becomes a `DmaError` and a `dma_fault` line.

use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use std::time::Instant;

use vhca_hca::{CopyEnd, Dma, DmaError};
use vhca_proto::FaultCause;
use vm_memory::{
    Bytes, GuestAddress, GuestMemory, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap, MemoryRegionAddress,
    Permissions, VolatileSlice,
};

use crate::event_log::TransportEvent;
use crate::iommu::{FaultKind, HostRun, QueueTranslations};
use crate::memory::GuestMem;
use crate::shared::Shared;

/// DMA on behalf of one queue's request; `queue` picks the translation cache and labels the fault lines.
pub struct QueueDma<'a> {
    shared: &'a Shared,
    mem: &'a GuestMem,
    queue: u16,
    /// The queue's translation cache, taken at the first DMA and held until this request is done (one lock per
    /// request, not per DMA). `None` inside while another holder has it: then every DMA takes the uncached path.
    cache: RefCell<Option<MutexGuard<'a, QueueTranslations>>>,
    /// The region of `mem` the last host slice came from: the next run is looked for there first (most of a
    /// request's accesses land in one region). A region of this request's mem table, like every slice it gives.
    region: Cell<Option<&'a GuestRegionMmap<()>>>,
}

impl<'a> QueueDma<'a> {
    pub fn new(shared: &'a Shared, mem: &'a GuestMem, queue: u16) -> QueueDma<'a> {
        QueueDma { shared, mem, queue, cache: RefCell::new(None), region: Cell::new(None) }
    }

    /// Runs `f` on the queue's translation cache, or returns None if another `QueueDma` of the same queue holds it.
    fn with_cache<R>(&self, f: impl FnOnce(&mut QueueTranslations) -> R) -> Option<R> {
        let mut held = self.cache.try_borrow_mut().ok()?;
        if held.is_none() {
            *held = self.shared.iommu.try_cache(self.queue);
        }
        held.as_deref_mut().map(f)
    }

    fn access<T>(
        &self,
        iova: u64,
        access: Permissions,
        op: impl FnMut(&'a GuestMem) -> Result<T, vm_memory::GuestMemoryError>,
    ) -> Result<T, DmaError> {
        self.access_quietly(iova, access, op).map_err(|(at, cause)| fault_event(self.shared, self.queue, at, cause))
    }

    /// `access` without the fault line: Err names the IOVA and the cause the platform refused with.
    fn access_quietly<T>(
        &self,
        iova: u64,
        access: Permissions,
        mut op: impl FnMut(&'a GuestMem) -> Result<T, vm_memory::GuestMemoryError>,
    ) -> Result<T, (u64, FaultCause)> {
        // A hit needs no bookkeeping: the clock, the generation and the fault record are for misses, and an access
        // that failed is simply tried again below with them (reads and writes of the same bytes are idempotent).
        if let Ok(value) = op(self.mem) {
            return Ok(value);
        }
        let deadline = Instant::now() + self.shared.miss_timeout;
        let mut asked: Option<u64> = None;
        loop {
            let iommu = &self.shared.iommu;
            let generation = iommu.generation();
            iommu.clear_fault();
            let err = match op(self.mem) {
                Ok(value) => return Ok(value),
                Err(err) => err,
            };
            let Some(fault) = iommu.take_fault() else {
                // The IOTLB translated, but to a QEMU address outside the mem table.
                tracing::error!("DMA at iova {iova:#x}: translated outside guest memory: {err}");
                return Err((iova, FaultCause::IommuUnmapped));
            };
            if fault.kind == FaultKind::Permission {
                return Err((fault.iova, FaultCause::IommuPermission));
            }
            // QEMU replied to our miss that its vIOMMU has no mapping: no UPDATE is coming (crate::miss_replies).
            if asked == Some(fault.iova) && self.shared.miss_refused(fault.iova, access) {
                return Err((fault.iova, FaultCause::IommuUnmapped));
            }
            let may_wait = Instant::now() < deadline
                && !self.shared.stopping()
                && !self.shared.control_pending.load(Ordering::Acquire);
            if !may_wait {
                return Err((fault.iova, FaultCause::IommuUnmapped));
            }
            if asked != Some(fault.iova) {
                if !self.shared.send_miss(fault.iova, access) {
                    return Err((fault.iova, FaultCause::IommuUnmapped));
                }
                asked = Some(fault.iova);
            }
            // An unchanged generation after the deadline means QEMU had no mapping to give: loop once more to
            // report the fault with the address that is still missing.
            iommu.wait_for_change(generation, deadline);
        }
    }
}

/// Logs a refused DMA and returns the error the HCA sees.
pub fn fault_event(shared: &Shared, queue: u16, iova: u64, cause: FaultCause) -> DmaError {
    shared.events.record(&TransportEvent::DmaFault { iova, cause: cause.name(), queue });
    tracing::warn!("queue {queue}: DMA to iova {iova:#x} refused: {}", cause.name());
    DmaError { iova, cause }
}

/// The host slices [iova, iova + len) translates to, each end checked for `access`; a miss is waited for.
fn slices<'a>(
    mem: &'a GuestMem,
    iova: u64,
    len: usize,
    access: Permissions,
) -> Result<Vec<VolatileSlice<'a, ()>>, vm_memory::GuestMemoryError> {
    mem.get_slices(GuestAddress(iova), len, access)?.collect()
}

impl<'a> QueueDma<'a> {
    /// The host slice of one run, if it lies wholly inside one region of this request's mem table.
    fn host_slice(&self, run: HostRun) -> Option<VolatileSlice<'a, ()>> {
        let region = match self.region.get() {
            Some(r) if run.uaddr.checked_sub(r.start_addr().0).is_some_and(|off| off < r.len()) => r,
            _ => {
                let r = self.mem.get_backend().find_region(GuestAddress(run.uaddr))?;
                self.region.set(Some(r));
                r
            }
        };
        // The region checks the end: a run that leaves it is refused, as the mem table's own lookup refuses it.
        region.get_slice(MemoryRegionAddress(run.uaddr - region.start_addr().0), run.len).ok()
    }

    /// Every run as a host slice of guest RAM, or false if one is not (wholly) inside one region of the mem table.
    fn all_in_memory(&self, runs: &[HostRun]) -> bool {
        runs.iter().all(|run| self.host_slice(*run).is_some())
    }

    /// `copy` through the queue's translation cache: both ends translated (and every run checked against the mem
    /// table) before any byte moves. False, having moved nothing, when anything needs the uncached path.
    fn copy_cached(&self, src: u64, dst: u64, len: usize) -> bool {
        let iommu = &self.shared.iommu;
        self.with_cache(|caches| {
            let single = |caches: &mut QueueTranslations, iova, access| {
                iommu.translate_cached_single(&mut caches.pages, iova, len, access).map(|uaddr| HostRun { uaddr, len })
            };
            if let Some(from) = single(caches, src, Permissions::Read) {
                if let Some(to) = single(caches, dst, Permissions::Write) {
                    // One cached entry each (every contiguous transfer): both slices in hand is both ends checked.
                    let (Some(from), Some(to)) = (self.host_slice(from), self.host_slice(to)) else { return false };
                    from.copy_to_volatile_slice(to);
                    return true;
                }
            }
            if !iommu.translate_cached(&mut caches.pages, src, len, Permissions::Read, &mut caches.from)
                || !iommu.translate_cached(&mut caches.pages, dst, len, Permissions::Write, &mut caches.to)
            {
                return false;
            }
            if let ([from], [to]) = (caches.from.as_slice(), caches.to.as_slice()) {
                // One run each (every contiguous transfer): both slices in hand is both ends checked.
                let (Some(from), Some(to)) = (self.host_slice(*from), self.host_slice(*to)) else { return false };
                from.copy_to_volatile_slice(to);
                return true;
            }
            if !self.all_in_memory(&caches.from) || !self.all_in_memory(&caches.to) {
                return false;
            }
            let (mut a, mut b) = (caches.from.iter().copied(), caches.to.iter().copied());
            let (mut x, mut y) = (a.next(), b.next());
            while let (Some(s), Some(d)) = (x, y) {
                let n = s.len.min(d.len);
                let (s_n, d_n) = (HostRun { len: n, ..s }, HostRun { len: n, ..d });
                // Both runs lie inside one region (checked above), so neither slice can fail.
                let (Some(from), Some(to)) = (self.host_slice(s_n), self.host_slice(d_n)) else { break };
                from.copy_to_volatile_slice(to);
                x = if n == s.len { a.next() } else { Some(HostRun { uaddr: s.uaddr + n as u64, len: s.len - n }) };
                y = if n == d.len { b.next() } else { Some(HostRun { uaddr: d.uaddr + n as u64, len: d.len - n }) };
            }
            true
        })
        .unwrap_or(false)
    }

    /// Runs `op` on each host slice [iova, iova + len) translates to through the cache, with the offset of the
    /// slice in the access. False, having run nothing, when anything needs the uncached path.
    fn each_cached(
        &self,
        iova: u64,
        len: usize,
        access: Permissions,
        mut op: impl FnMut(usize, VolatileSlice<'a, ()>),
    ) -> bool {
        let iommu = &self.shared.iommu;
        self.with_cache(|caches| {
            if let Some(uaddr) = iommu.translate_cached_single(&mut caches.pages, iova, len, access) {
                let Some(slice) = self.host_slice(HostRun { uaddr, len }) else { return false };
                op(0, slice);
                return true;
            }
            if !iommu.translate_cached(&mut caches.pages, iova, len, access, &mut caches.from) {
                return false;
            }
            if let [run] = caches.from.as_slice() {
                let Some(slice) = self.host_slice(*run) else { return false };
                op(0, slice);
                return true;
            }
            if !self.all_in_memory(&caches.from) {
                return false;
            }
            let mut done = 0;
            for run in &caches.from {
                let Some(slice) = self.host_slice(*run) else { break };
                op(done, slice);
                done += run.len;
            }
            true
        })
        .unwrap_or(false)
    }
}

impl Dma for QueueDma<'_> {
    /// One copy, host slice to host slice: both ends are translated (and checked) before any byte moves, so a
    /// refused end leaves the destination untouched unless the IOTLB changes in between.
    fn copy(&self, src: u64, dst: u64, len: usize) -> Result<(), (CopyEnd, DmaError)> {
        if len == 0 || self.copy_cached(src, dst, len) {
            return Ok(());
        }
        let from = self.access(src, Permissions::Read, |mem| slices(mem, src, len, Permissions::Read));
        let from = from.map_err(|e| (CopyEnd::Source, e))?;
        let to = self.access(dst, Permissions::Write, |mem| slices(mem, dst, len, Permissions::Write));
        let to = to.map_err(|e| (CopyEnd::Destination, e))?;
        let (mut a, mut b) = (from.into_iter(), to.into_iter());
        let (mut x, mut y) = (a.next(), b.next());
        while let (Some(s), Some(d)) = (x, y) {
            let n = s.len().min(d.len());
            // Both pieces are at least n long, so neither sub-slice can fail.
            let (Ok(s_n), Ok(d_n)) = (s.subslice(0, n), d.subslice(0, n)) else { break };
            s_n.copy_to_volatile_slice(d_n);
            x = if n == s.len() { a.next() } else { s.offset(n).ok() };
            y = if n == d.len() { b.next() } else { d.offset(n).ok() };
        }
        Ok(())
    }

    /// The page's QEMU address: from the translation cache, else the IOTLB, missing to QEMU as a DMA in that
    /// direction would, with no fault line for a page the vIOMMU does not map (a register's re-check is no DMA).
    fn translation(&self, iova: u64, write: bool) -> Option<u64> {
        let iommu = &self.shared.iommu;
        let access = if write { Permissions::Write } else { Permissions::Read };
        let cached = self.with_cache(|caches| iommu.translate_cached_single(&mut caches.pages, iova, 1, access));
        if let Some(Some(uaddr)) = cached {
            return Some(uaddr);
        }
        let target = |_: &GuestMem| {
            iommu
                .first_target(iova, 1, access)
                .ok_or(vm_memory::GuestMemoryError::InvalidGuestAddress(GuestAddress(iova)))
        };
        self.access_quietly(iova, access, target).ok()
    }

    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        if buf.is_empty() {
            return Ok(());
        }
        let len = buf.len();
        let cached = self.each_cached(iova, len, Permissions::Read, |at, slice| {
            slice.copy_to(&mut buf[at..at + slice.len()]);
        });
        if cached {
            return Ok(());
        }
        self.access(iova, Permissions::Read, |mem| mem.read_slice(buf, GuestAddress(iova)))
    }

    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaError> {
        if buf.is_empty() {
            return Ok(());
        }
        let cached = self.each_cached(iova, buf.len(), Permissions::Write, |at, slice| {
            slice.copy_from(&buf[at..at + slice.len()]);
        });
        if cached {
            return Ok(());
        }
        self.access(iova, Permissions::Write, |mem| mem.write_slice(buf, GuestAddress(iova)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_log::EventLog;
    use crate::memory::{map_regions, RegionDesc};
    use std::io::Write;
    use std::sync::Arc;
    use std::time::Duration;

    const UADDR: u64 = 0x7f00_0000_0000;
    const PAGE: u64 = 0x1000;

    /// 8 pages of guest RAM; IOVA page i maps RAM page `map[i]` with `perm[i]` (unmapped where `map[i]` is None).
    fn shared_with(map: &[(u64, Option<u64>, Permissions)]) -> Arc<Shared> {
        let events = Arc::new(EventLog::to_writer(Box::new(std::io::sink())));
        let shared = Arc::new(Shared::new(events, 4, Duration::from_millis(1)).unwrap());
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&[0u8; 8 * PAGE as usize]).unwrap();
        let region = RegionDesc { guest_phys_addr: 0, memory_size: 8 * PAGE, userspace_addr: UADDR, mmap_offset: 0 };
        shared.replace_memory(map_regions(&[region], vec![file]).unwrap());
        for &(iova, ram_page, perm) in map {
            if let Some(p) = ram_page {
                shared.iommu.update(iova, PAGE, UADDR + p * PAGE, perm).unwrap();
            }
        }
        shared
    }

    fn ram(mem: &GuestMem, page: u64, off: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        mem.get_backend().read_slice(&mut out, GuestAddress(UADDR + page * PAGE + off)).unwrap();
        out
    }

    #[test]
    fn copy_moves_across_scattered_pages_once_and_refuses_each_end_by_name() {
        use Permissions::{Read, ReadWrite, Write as W};
        // Source IOVAs 0x10000.. on RAM pages 3, 1 (scattered); destination 0x20000.. on pages 6, 5; 0x30000 is
        // read-only, 0x40000 is not mapped.
        let shared = shared_with(&[
            (0x10000, Some(3), Read),
            (0x11000, Some(1), Read),
            (0x20000, Some(6), W),
            (0x21000, Some(5), ReadWrite),
            (0x30000, Some(7), Read),
        ]);
        let mem = shared.mem();
        let data: Vec<u8> = (0..0x1800u32).map(|i| (i * 7 + 3) as u8).collect();
        mem.get_backend().write_slice(&data[..0x800], GuestAddress(UADDR + 3 * PAGE + 0x800)).unwrap();
        mem.get_backend().write_slice(&data[0x800..], GuestAddress(UADDR + PAGE)).unwrap();
        let dma = QueueDma::new(&shared, &mem, 2);
        // 0x1800 bytes from 0x10800 (two source pieces) to 0x20400 (two destination pieces, cut elsewhere).
        dma.copy(0x10800, 0x20400, 0x1800).unwrap();
        assert_eq!(ram(&mem, 6, 0x400, 0xc00), data[..0xc00]);
        assert_eq!(ram(&mem, 5, 0, 0xc00), data[0xc00..]);
        assert_eq!(ram(&mem, 5, 0xc00, 0x10), vec![0u8; 0x10], "not a byte past the end");

        let before = ram(&mem, 6, 0, PAGE as usize);
        let src_refused = dma.copy(0x40000, 0x20000, 16).unwrap_err();
        assert_eq!((src_refused.0, src_refused.1.cause), (CopyEnd::Source, FaultCause::IommuUnmapped));
        let dst_read_only = dma.copy(0x10000, 0x30000, 16).unwrap_err();
        assert_eq!((dst_read_only.0, dst_read_only.1.cause), (CopyEnd::Destination, FaultCause::IommuPermission));
        let src_write_only = dma.copy(0x20000, 0x21000, 16).unwrap_err();
        assert_eq!(src_write_only.0, CopyEnd::Source, "the source needs read permission");
        assert_eq!(ram(&mem, 6, 0, PAGE as usize), before, "a refused copy wrote nothing");
        assert_eq!(ram(&mem, 7, 0, 16), vec![0u8; 16]);
    }

    #[test]
    fn the_translation_cache_never_outlives_an_iotlb_change_or_the_mem_table() {
        use Permissions::{Read, ReadWrite};
        let shared = shared_with(&[(0x10000, Some(1), ReadWrite), (0x20000, Some(2), ReadWrite)]);
        let mem = shared.mem();
        // One request each (a request holds its queue's cache until it is done).
        let dma = || QueueDma::new(&shared, &mem, 2);
        dma().write(0x10000, b"abcd").unwrap();
        dma().copy(0x10000, 0x20000, 4).unwrap();
        let hits = || shared.iommu.cache(2).pages.stats().0;
        let before = hits();
        dma().copy(0x10000, 0x20010, 4).unwrap();
        assert_eq!(hits(), before + 2, "both ends served from the cache");
        assert_eq!(ram(&mem, 2, 0x10, 4), b"abcd");

        shared.iommu.invalidate(0x20000, PAGE);
        let unmapped = dma().copy(0x10000, 0x20000, 4).unwrap_err();
        assert_eq!((unmapped.0, unmapped.1.cause), (CopyEnd::Destination, FaultCause::IommuUnmapped));
        shared.iommu.update(0x20000, PAGE, UADDR + 2 * PAGE, Read).unwrap();
        assert_eq!(dma().write(0x20000, b"x").unwrap_err().cause, FaultCause::IommuPermission, "now read-only");
        let mut byte = [0u8; 1];
        dma().read(0x20010, &mut byte).unwrap();
        assert_eq!(&byte, b"a");
        shared.iommu.update(0x20000, PAGE, UADDR + 4 * PAGE, ReadWrite).unwrap();
        dma().copy(0x10000, 0x20000, 4).unwrap();
        assert_eq!(ram(&mem, 4, 0, 4), b"abcd", "lands where the new entry points");

        // A new mem table without the old QEMU addresses: the cached translation is not a way back into them.
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&[0u8; PAGE as usize]).unwrap();
        let elsewhere = RegionDesc { guest_phys_addr: 0, memory_size: PAGE, userspace_addr: 0x10_0000, mmap_offset: 0 };
        shared.replace_memory(map_regions(&[elsewhere], vec![file]).unwrap());
        let new_mem = shared.mem();
        let dma = || QueueDma::new(&shared, &new_mem, 2);
        let outside = dma().copy(0x10000, 0x20000, 4).unwrap_err();
        assert_eq!((outside.0, outside.1.cause), (CopyEnd::Source, FaultCause::IommuUnmapped));
        assert_eq!(dma().read(0x10000, &mut byte).unwrap_err().cause, FaultCause::IommuUnmapped);
    }
}
