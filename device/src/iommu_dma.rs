//! The HCA's view of guest memory: `vhca_hca::Dma` over the IOMMU-translated memory. A miss is asked of QEMU and
//! waited for (on the worker thread, bounded); what stays refused becomes a `DmaError` and a `dma_fault` line.

use std::sync::atomic::Ordering;
use std::time::Instant;

use vhca_hca::{CopyEnd, Dma, DmaError};
use vhca_proto::FaultCause;
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions, VolatileSlice};

use crate::event_log::TransportEvent;
use crate::iommu::FaultKind;
use crate::memory::GuestMem;
use crate::shared::Shared;

/// DMA on behalf of one queue's request; `queue` only labels the fault lines.
pub struct QueueDma<'a> {
    shared: &'a Shared,
    mem: &'a GuestMem,
    queue: u16,
}

impl<'a> QueueDma<'a> {
    pub fn new(shared: &'a Shared, mem: &'a GuestMem, queue: u16) -> QueueDma<'a> {
        QueueDma { shared, mem, queue }
    }

    fn access<T>(
        &self,
        iova: u64,
        access: Permissions,
        mut op: impl FnMut(&'a GuestMem) -> Result<T, vm_memory::GuestMemoryError>,
    ) -> Result<T, DmaError> {
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
                return Err(fault_event(self.shared, self.queue, iova, FaultCause::IommuUnmapped));
            };
            if fault.kind == FaultKind::Permission {
                return Err(fault_event(self.shared, self.queue, fault.iova, FaultCause::IommuPermission));
            }
            // QEMU replied to our miss that its vIOMMU has no mapping: no UPDATE is coming (crate::miss_replies).
            if asked == Some(fault.iova) && self.shared.miss_refused(fault.iova, access) {
                return Err(fault_event(self.shared, self.queue, fault.iova, FaultCause::IommuUnmapped));
            }
            let may_wait = Instant::now() < deadline
                && !self.shared.stopping()
                && !self.shared.control_pending.load(Ordering::Acquire);
            if !may_wait {
                return Err(fault_event(self.shared, self.queue, fault.iova, FaultCause::IommuUnmapped));
            }
            if asked != Some(fault.iova) {
                if !self.shared.send_miss(fault.iova, access) {
                    return Err(fault_event(self.shared, self.queue, fault.iova, FaultCause::IommuUnmapped));
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

impl Dma for QueueDma<'_> {
    /// One copy, host slice to host slice: both ends are translated (and checked) before any byte moves, so a
    /// refused end leaves the destination untouched unless the IOTLB changes in between.
    fn copy(&self, src: u64, dst: u64, len: usize) -> Result<(), (CopyEnd, DmaError)> {
        if len == 0 {
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

    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        if buf.is_empty() {
            return Ok(());
        }
        self.access(iova, Permissions::Read, |mem| mem.read_slice(buf, GuestAddress(iova)))
    }

    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaError> {
        if buf.is_empty() {
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
}
