//! The DMA engine: moves bytes between the HCA and guest memory, or from guest memory to guest memory in one copy,
//! through map registers, one page translation per register, checking each (freed, stale) before handing the IOVA to
//! `Dma`, and logging every DMA and every refusal. A list whose registers were all found held and fresh at the pool's
//! current epoch is walked per contiguous run instead (see mapped_pages.rs); anything else takes the per-page walk.

use vhca_proto::{EventKind, FaultCause, PAGE_SIZE};

use crate::dma_access::{CopyEnd, Dma, DmaError};
use crate::event_records::{FaultEvent, HcaEvent};
use crate::fault_injection::{ContiguousPolicy, Injector};
use crate::map_registers::{MapRegisterPool, RegisterRef};
use crate::mapped_pages::MappedPages;
use crate::notify::Notifier;

/// Who a DMA is for, so a refusal names the work request or command behind it.
#[derive(Debug, Clone, Copy, Default)]
pub struct DmaContext {
    pub purpose: &'static str,
    pub qpn: Option<u32>,
    pub wr_id: Option<u64>,
    pub opcode: Option<&'static str>,
    pub tag: Option<u32>,
    /// The `handle` of the async DmaFault event: the QPN, or the CQ for a CQE write.
    pub async_handle: u32,
}

/// A refused DMA: why, at which IOVA (when translation got that far) and through which register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaFault {
    pub cause: FaultCause,
    pub iova: Option<u64>,
    pub register: Option<u32>,
}

enum Transfer<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl Transfer<'_> {
    fn len(&self) -> usize {
        match self {
            Transfer::Read(b) => b.len(),
            Transfer::Write(b) => b.len(),
        }
    }

    fn dir(&self) -> &'static str {
        match self {
            Transfer::Read(_) => "read",
            Transfer::Write(_) => "write",
        }
    }

    /// All of the buffer in one `Dma` call, at `iova`.
    fn move_at(&mut self, dma: &dyn Dma, iova: u64) -> Result<(), DmaError> {
        match self {
            Transfer::Read(buf) => dma.read(iova, buf),
            Transfer::Write(buf) => dma.write(iova, buf),
        }
    }
}

pub struct DmaEngine {
    pub pool: MapRegisterPool,
    pub injector: Injector,
    /// HcaConfig::revalidate_stale: a stale register is re-validated on use instead of refused.
    pub revalidate_stale: bool,
    /// Run lists of the transfer in progress (source, destination), kept so a DMA allocates nothing.
    src_runs: Vec<Run>,
    dst_runs: Vec<Run>,
}

impl DmaEngine {
    pub fn new(pool: MapRegisterPool, injector: Injector, revalidate_stale: bool) -> DmaEngine {
        DmaEngine { pool, injector, revalidate_stale, src_runs: Vec::new(), dst_runs: Vec::new() }
    }

    /// Reads `buf.len()` bytes starting `offset` bytes into the pages `registers` translate.
    pub fn read(
        &mut self,
        dma: &dyn Dma,
        registers: &MappedPages,
        offset: u64,
        buf: &mut [u8],
        ctx: &DmaContext,
        out: &mut Notifier,
    ) -> Result<(), DmaFault> {
        self.transfer(dma, registers, offset, Transfer::Read(buf), ctx, out)
    }

    pub fn write(
        &mut self,
        dma: &dyn Dma,
        registers: &MappedPages,
        offset: u64,
        buf: &[u8],
        ctx: &DmaContext,
        out: &mut Notifier,
    ) -> Result<(), DmaFault> {
        self.transfer(dma, registers, offset, Transfer::Write(buf), ctx, out)
    }

    fn transfer(
        &mut self,
        dma: &dyn Dma,
        registers: &MappedPages,
        offset: u64,
        mut data: Transfer<'_>,
        ctx: &DmaContext,
        out: &mut Notifier,
    ) -> Result<(), DmaFault> {
        let n = self.begin(registers, offset, out);
        let device_writes = matches!(data, Transfer::Write(_));
        self.confirm_stale(dma, registers, offset, data.len(), device_writes, out);
        let len = data.len() as u64;
        let (result, first_iova) = match self.single_run(registers, offset, data.len()) {
            Some(run) => (data.move_at(dma, run.iova).map_err(platform_fault), Some(run.iova)),
            None => {
                let result = self.move_bytes(dma, registers, offset, &mut data);
                (result, self.first_iova(&self.src_runs, registers, offset))
            }
        };
        Self::finish(n, data.dir(), first_iova, len, ctx, &result, out);
        result
    }

    /// Copies `len` bytes from one span of registers to another in one pass: both spans' registers are translated
    /// and checked (freed, stale, outside) before any byte moves, then each IOVA-contiguous piece common to both goes
    /// to `Dma::copy`, which checks the IOMMU for each end. Logged as the two DMAs it stands for, a read of the
    /// source then a write of the destination; a refused source ends the copy before the write is counted.
    pub fn copy(
        &mut self,
        dma: &dyn Dma,
        src: &DmaSpan<'_>,
        dst: &DmaSpan<'_>,
        len: usize,
        out: &mut Notifier,
    ) -> Result<(), (CopyEnd, DmaFault)> {
        let total = len as u64;
        let n_read = self.begin(src.registers, src.offset, out);
        self.confirm_stale(dma, src.registers, src.offset, len, false, out);
        let (mut src_runs, mut dst_runs) = (std::mem::take(&mut self.src_runs), std::mem::take(&mut self.dst_runs));
        let src_one = self.single_run(src.registers, src.offset, len);
        let src_ran = match src_one {
            Some(_) => Ok(()),
            None => self.runs(src.registers, src.offset, len, &mut src_runs),
        };
        let src_iova = src_one.map(|r| r.iova).or_else(|| self.first_iova(&src_runs, src.registers, src.offset));
        if let Err(fault) = src_ran {
            self.src_runs = src_runs;
            Self::finish(n_read, "read", src_iova, total, &src.ctx, &Err(fault), out);
            return Err((CopyEnd::Source, fault));
        }
        let n_write = self.begin(dst.registers, dst.offset, out);
        self.confirm_stale(dma, dst.registers, dst.offset, len, true, out);
        let dst_one = self.single_run(dst.registers, dst.offset, len);
        let dst_ran = match dst_one {
            Some(_) => Ok(()),
            None => self.runs(dst.registers, dst.offset, len, &mut dst_runs),
        };
        let dst_iova = dst_one.map(|r| r.iova).or_else(|| self.first_iova(&dst_runs, dst.registers, dst.offset));
        let moved = match (dst_ran, src_one, dst_one) {
            (Err(fault), _, _) => Err((CopyEnd::Destination, fault)),
            // One run each end (every contiguous transfer): one `Dma::copy`, no run lists.
            (Ok(()), Some(from), Some(to)) => {
                dma.copy(from.iova, to.iova, len).map_err(|(end, e)| (end, platform_fault(e)))
            }
            (Ok(()), from, to) => {
                let src_list = from.as_ref().map_or(src_runs.as_slice(), std::slice::from_ref);
                let dst_list = to.as_ref().map_or(dst_runs.as_slice(), std::slice::from_ref);
                copy_runs(dma, src_list, dst_list)
            }
        };
        (self.src_runs, self.dst_runs) = (src_runs, dst_runs);
        let read_result = match moved {
            Err((CopyEnd::Source, fault)) => Err(fault),
            _ => Ok(()),
        };
        Self::finish(n_read, "read", src_iova, total, &src.ctx, &read_result, out);
        if read_result.is_ok() {
            let write_result = match moved {
                Err((CopyEnd::Destination, fault)) => Err(fault),
                _ => Ok(()),
            };
            Self::finish(n_write, "write", dst_iova, total, &dst.ctx, &write_result, out);
        }
        moved
    }

    /// Before a transfer over a list that is not all fresh: each register of the pages it covers that a QEMU
    /// invalidation made stale is asked about again (`Dma::translation`), and confirmed fresh when the vIOMMU still
    /// maps its page where it led when the register was taken. VT-d invalidates an aligned power-of-two range, so an
    /// unmap of one buffer also invalidates live pages beside it; a page really unmapped (or remapped elsewhere) stays
    /// stale and is refused as before. Nothing is asked while every register is fresh (the common case).
    fn confirm_stale(
        &mut self,
        dma: &dyn Dma,
        registers: &MappedPages,
        offset: u64,
        len: usize,
        device_writes: bool,
        out: &mut Notifier,
    ) {
        if registers.all_fresh(&self.pool) {
            return;
        }
        let first = usize::try_from(offset / PAGE_SIZE).unwrap_or(usize::MAX);
        let last = usize::try_from(offset.saturating_add(len.max(1) as u64 - 1) / PAGE_SIZE).unwrap_or(usize::MAX);
        let mut confirmed = 0u32;
        for r in registers.registers().iter().skip(first).take(last.saturating_sub(first).saturating_add(1)) {
            if let Some((iova, target)) = self.pool.confirmable(*r) {
                if dma.translation(iova, device_writes) == Some(target) {
                    self.pool.confirm(*r);
                    confirmed += 1;
                }
            }
        }
        if confirmed > 0 {
            out.emit(HcaEvent::TranslationsConfirmed { registers: confirmed });
        }
    }

    /// Counts the DMA (and injects the invalidation set for it); returns its ordinal.
    fn begin(&mut self, registers: &MappedPages, offset: u64, out: &mut Notifier) -> u64 {
        let (n, invalidate) = self.injector.dma();
        if invalidate {
            self.inject_invalidation(n, self.peek_iova(registers, offset), out);
        }
        n
    }

    /// The IOVA a transfer starts at, for its log line: where its first run starts (that register was just
    /// translated), or, when no run was made (nothing to move, or the first register refused), what the register
    /// holds. The same either way as before an injected invalidation, which marks registers stale and never moves
    /// them.
    fn first_iova(&self, runs: &[Run], registers: &MappedPages, offset: u64) -> Option<u64> {
        match runs.first() {
            Some(run) => Some(run.iova),
            None => self.peek_iova(registers, offset),
        }
    }

    /// Logs one DMA, and its refusal as a fault event and an async event for the driver.
    fn finish(
        n: u64,
        dir: &'static str,
        first_iova: Option<u64>,
        len: u64,
        ctx: &DmaContext,
        result: &Result<(), DmaFault>,
        out: &mut Notifier,
    ) {
        out.emit_with(|| HcaEvent::Dma {
            n,
            dir,
            iova: first_iova.unwrap_or(0),
            len,
            purpose: ctx.purpose,
            qpn: ctx.qpn,
            wr_id: ctx.wr_id,
            ok: result.is_ok(),
        });
        if let Err(fault) = result {
            out.emit(HcaEvent::Fault(Box::new(FaultEvent {
                cause: fault.cause.name(),
                dir,
                purpose: ctx.purpose,
                iova: fault.iova,
                addr: None,
                key: None,
                register: fault.register,
                qpn: ctx.qpn,
                wr_id: ctx.wr_id,
                opcode: ctx.opcode.map(str::to_string),
                tag: ctx.tag,
            })));
            let detail = fault.register.unwrap_or(u32::MAX);
            out.push_async(EventKind::DmaFault, ctx.async_handle, fault.cause, detail, fault.iova.unwrap_or(0));
        }
    }

    /// The IOVA the transfer starts at, without side effects, for logs and for the injected invalidation.
    fn peek_iova(&self, registers: &MappedPages, offset: u64) -> Option<u64> {
        if registers.all_fresh(&self.pool) {
            return registers.contiguous_at(offset, 1).map(|(iova, _)| iova);
        }
        let page = usize::try_from(offset / PAGE_SIZE).ok()?;
        let r = registers.registers().get(page)?;
        self.pool.peek(*r).map(|p| p + offset % PAGE_SIZE)
    }

    fn inject_invalidation(&mut self, n: u64, first_iova: Option<u64>, out: &mut Notifier) {
        let config = &self.injector.config;
        let iova = config.invalidate_iova.or(first_iova.map(|i| i & !(PAGE_SIZE - 1))).unwrap_or(0);
        let size = config.invalidate_size.unwrap_or(PAGE_SIZE);
        let registers = self.pool.invalidate_injected(iova, size);
        out.emit(HcaEvent::Injected { what: "invalidate_at_dma", n, detail: format!("iova {iova:#x} size {size:#x}") });
        out.emit(HcaEvent::TranslationsStale { iova, size, registers, injected: true });
    }

    /// Moves the bytes run by run (see `runs`), one `Dma` call each. Every register is translated before the first
    /// byte moves, so a refused register leaves guest memory untouched.
    fn move_bytes(
        &mut self,
        dma: &dyn Dma,
        registers: &MappedPages,
        offset: u64,
        data: &mut Transfer<'_>,
    ) -> Result<(), DmaFault> {
        let mut runs = std::mem::take(&mut self.src_runs);
        let result = self.runs(registers, offset, data.len(), &mut runs).and_then(|()| {
            let mut done = 0usize;
            for run in &runs {
                let range = done..done + run.len;
                let moved = match data {
                    Transfer::Read(buf) => dma.read(run.iova, &mut buf[range]),
                    Transfer::Write(buf) => dma.write(run.iova, &buf[range]),
                };
                moved.map_err(platform_fault)?;
                done += run.len;
            }
            Ok(())
        });
        self.src_runs = runs;
        result
    }

    /// The IOVA runs `len` bytes from `offset` cover: bytes up to the end of the first page, then whole pages while
    /// their IOVAs stay contiguous (capped under the split policy), into `runs`. Every register on the way is
    /// checked: all at once, per contiguous run, while the list's whole-list check holds at the pool's epoch; else
    /// one by one (`walk_pages`), which is also where a refusal is found and reported.
    fn runs(&mut self, registers: &MappedPages, offset: u64, len: usize, runs: &mut Vec<Run>) -> Result<(), DmaFault> {
        let burst_cap = self.burst_cap();
        if registers.all_fresh(&self.pool) && Self::fresh_runs(registers, offset, len, burst_cap, runs) {
            return Ok(());
        }
        self.walk_pages(registers.registers(), offset, len, burst_cap, runs)
    }

    /// The most pages one run may span: unlimited, or the cap under the split policy.
    fn burst_cap(&self) -> u64 {
        match (self.injector.config.contiguous_policy, self.injector.config.max_contiguous_pages) {
            (ContiguousPolicy::Split, Some(cap)) => u64::from(cap.max(1)),
            _ => u64::MAX,
        }
    }

    /// The one run of a transfer whose list is known fresh when a single extent (within the burst cap) holds all
    /// of it: a WQE, a CQE, any contiguous payload. What `runs` would find, without building a run list.
    fn single_run(&self, registers: &MappedPages, offset: u64, len: usize) -> Option<Run> {
        if len == 0 || !registers.all_fresh(&self.pool) {
            return None;
        }
        let (iova, contiguous) = registers.contiguous_at(offset, self.burst_cap())?;
        (contiguous >= len as u64).then_some(Run { iova, len })
    }

    /// `runs` for a list whose registers are all held and fresh: one extent lookup per run. False (runs
    /// unfinished) when the transfer leaves the list, for `walk_pages` to refuse exactly as it always has.
    fn fresh_runs(registers: &MappedPages, offset: u64, len: usize, burst_cap: u64, runs: &mut Vec<Run>) -> bool {
        let total = len as u64;
        runs.clear();
        let mut done = 0u64;
        while done < total {
            let Some(pos) = offset.checked_add(done) else { return false };
            let Some((iova, contiguous)) = registers.contiguous_at(pos, burst_cap) else { return false };
            let burst = contiguous.min(total - done);
            runs.push(Run { iova, len: burst as usize });
            done += burst;
        }
        true
    }

    /// `runs` by translating every page's register in turn (the reference the per-run path must agree with).
    fn walk_pages(
        &mut self,
        registers: &[RegisterRef],
        offset: u64,
        len: usize,
        burst_cap: u64,
        runs: &mut Vec<Run>,
    ) -> Result<(), DmaFault> {
        let total = len as u64;
        runs.clear();
        let mut done = 0u64;
        while done < total {
            let pos = offset.checked_add(done).ok_or(outside(None))?;
            let mut page = pos / PAGE_SIZE;
            let iova = self.translate(registers, page)?.checked_add(pos % PAGE_SIZE).ok_or(outside(None))?;
            let mut burst = (PAGE_SIZE - pos % PAGE_SIZE).min(total - done);
            let mut pages = 1u64;
            while done + burst < total && pages < burst_cap {
                // Guest-chosen page IOVAs may sit at the top of the address space: no wrapping into a "contiguous" 0.
                let Some(next_page_iova) = (iova - pos % PAGE_SIZE).checked_add(pages * PAGE_SIZE) else { break };
                page += 1;
                match self.translate(registers, page) {
                    Ok(next) if next == next_page_iova => {}
                    // A refused register is reported when the loop gets there (the next run starts with it).
                    _ => break,
                }
                burst = (burst + PAGE_SIZE).min(total - done);
                pages += 1;
            }
            runs.push(Run { iova, len: burst as usize });
            done += burst;
        }
        Ok(())
    }

    fn translate(&mut self, registers: &[RegisterRef], page: u64) -> Result<u64, DmaFault> {
        let r = usize::try_from(page).ok().and_then(|p| registers.get(p)).ok_or(outside(None))?;
        self.pool.translate(*r, self.revalidate_stale).map_err(|cause| DmaFault {
            cause,
            iova: self.pool.peek(*r),
            register: Some(r.index),
        })
    }
}

/// One IOVA-contiguous piece of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    iova: u64,
    len: usize,
}

/// One end of a copy: the registers of its MR or ring, the byte offset into them, and who the DMA is for.
pub struct DmaSpan<'a> {
    pub registers: &'a MappedPages,
    pub offset: u64,
    pub ctx: DmaContext,
}

/// Copies along two run lists of the same total length, one `Dma::copy` per piece common to both.
fn copy_runs(dma: &dyn Dma, src: &[Run], dst: &[Run]) -> Result<(), (CopyEnd, DmaFault)> {
    let (mut s, mut d) = (src.iter().copied(), dst.iter().copied());
    let (mut a, mut b) = (s.next(), d.next());
    while let (Some(x), Some(y)) = (a, b) {
        let n = x.len.min(y.len);
        dma.copy(x.iova, y.iova, n).map_err(|(end, e)| (end, platform_fault(e)))?;
        a = if n == x.len { s.next() } else { Some(Run { iova: x.iova + n as u64, len: x.len - n }) };
        b = if n == y.len { d.next() } else { Some(Run { iova: y.iova + n as u64, len: y.len - n }) };
    }
    Ok(())
}

fn platform_fault(e: DmaError) -> DmaFault {
    DmaFault { cause: e.cause, iova: Some(e.iova), register: None }
}

fn outside(iova: Option<u64>) -> DmaFault {
    DmaFault { cause: FaultCause::OutsideMr, iova, register: None }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::event_records::NullSink;
    use crate::fault_injection::FaultInjection;

    /// A flat device address space of `PAGES` pages at IOVA 0 with no IOMMU of its own: what reaches it is what
    /// the map registers let through. Records every access as (iova, len).
    struct Flat {
        bytes: RefCell<Vec<u8>>,
        accesses: RefCell<Vec<(u64, usize)>>,
    }

    const PAGES: u64 = 16;

    impl Flat {
        fn new() -> Flat {
            let bytes = (0..PAGES * PAGE_SIZE).map(|i| (i * 7 % 251) as u8).collect();
            Flat { bytes: RefCell::new(bytes), accesses: RefCell::new(Vec::new()) }
        }

        fn range(&self, iova: u64, len: usize) -> Result<std::ops::Range<usize>, DmaError> {
            let start = usize::try_from(iova).ok().filter(|s| s + len <= self.bytes.borrow().len());
            self.accesses.borrow_mut().push((iova, len));
            start.map(|s| s..s + len).ok_or(DmaError { iova, cause: FaultCause::IommuUnmapped })
        }
    }

    impl Dma for Flat {
        fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
            let range = self.range(iova, buf.len())?;
            buf.copy_from_slice(&self.bytes.borrow()[range]);
            Ok(())
        }

        fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaError> {
            let range = self.range(iova, buf.len())?;
            self.bytes.borrow_mut()[range].copy_from_slice(buf);
            Ok(())
        }
    }

    fn engine() -> DmaEngine {
        DmaEngine::new(MapRegisterPool::new(64), Injector::new(FaultInjection::default()), false)
    }

    /// Pages in three IOVA-contiguous pieces (3, 2 and 3 pages) plus one page at the top of the address space.
    fn scattered(engine: &mut DmaEngine) -> MappedPages {
        let top = !(PAGE_SIZE - 1); // the highest page
        let iovas = [0x1000, 0x2000, 0x3000, 0x8000, 0x9000, top, 0x5000, 0x6000, 0x7000];
        let registers = engine.pool.take(&iovas).unwrap();
        MappedPages::new(&engine.pool, registers)
    }

    #[test]
    fn the_per_run_walk_finds_what_the_per_page_walk_finds() {
        let mut engine = engine();
        let pages = scattered(&mut engine);
        assert!(pages.all_fresh(&engine.pool));
        let end = pages.len() as u64 * PAGE_SIZE;
        let (mut fast, mut slow) = (Vec::new(), Vec::new());
        let mut compared = 0;
        for cap in [u64::MAX, 1, 2, 3] {
            for offset in (0..end + PAGE_SIZE).step_by(0x7f0).chain([end - 1, u64::MAX - 3]) {
                for len in [0usize, 1, 0x10, 0xff0, 0x1000, 0x1001, 0x2800, 0x5000, 0x9000] {
                    let walked = engine.walk_pages(pages.registers(), offset, len, cap, &mut slow);
                    let ran = DmaEngine::fresh_runs(&pages, offset, len, cap, &mut fast);
                    assert_eq!(ran, walked.is_ok(), "cap {cap} offset {offset:#x} len {len:#x}: {walked:?}");
                    if ran {
                        assert_eq!(fast, slow, "cap {cap} offset {offset:#x} len {len:#x}");
                        compared += 1;
                    }
                    let single = (cap == u64::MAX).then(|| engine.single_run(&pages, offset, len)).flatten();
                    if cap == u64::MAX && walked.is_ok() && slow.len() == 1 {
                        assert_eq!(single, Some(slow[0]), "offset {offset:#x} len {len:#x}: one run, no list");
                    } else {
                        assert_eq!(single, None, "offset {offset:#x} len {len:#x}: {slow:?}");
                    }
                }
            }
        }
        assert!(compared > 500, "only {compared} transfers compared");
    }

    #[test]
    fn every_change_to_the_pool_sends_the_next_dma_back_through_every_register() {
        let mut engine = engine();
        let flat = Flat::new();
        let mut out = Notifier::new(std::sync::Arc::new(NullSink));
        let ctx = DmaContext::default();
        let registers = engine.pool.take(&[0x1000, 0x2000, 0x3000, 0x4000]).unwrap();
        let pages = MappedPages::new(&engine.pool, registers.clone());
        let mut buf = [0u8; 0x3000];
        engine.read(&flat, &pages, 0x800, &mut buf, &ctx, &mut out).unwrap();
        assert_eq!(flat.accesses.borrow().as_slice(), [(0x1800, 0x3000)], "one run for one contiguous transfer");
        assert_eq!(buf[..], flat.bytes.borrow()[0x1800..0x4800]);

        // Invalidated: the next DMA over that page is refused, naming the register; one that misses it still runs.
        engine.pool.invalidate(0x3000, 1);
        let stale = engine.read(&flat, &pages, 0x800, &mut buf, &ctx, &mut out).unwrap_err();
        let expected = DmaFault { cause: FaultCause::StaleTranslation, iova: Some(0x3000), register: Some(2) };
        assert_eq!(stale, expected);
        engine.read(&flat, &pages, 0, &mut buf[..0x2000], &ctx, &mut out).unwrap();
        assert!(engine.pool.translate(registers[2], true).is_ok(), "re-validated");
        engine.read(&flat, &pages, 0x800, &mut buf, &ctx, &mut out).unwrap();

        // Released (and the register taken again by someone else): refused as freed, whatever the cached check said.
        engine.pool.release(&registers[3..]);
        let freed = engine.write(&flat, &pages, 0x3ff0, &buf[..0x10], &ctx, &mut out).unwrap_err();
        assert_eq!(freed, DmaFault { cause: FaultCause::FreedMapRegister, iova: None, register: Some(3) });
        let other = engine.pool.take(&[0x4000]).unwrap();
        assert_eq!(other[0].index, registers[3].index);
        let reused = engine.write(&flat, &pages, 0x3ff0, &buf[..0x10], &ctx, &mut out).unwrap_err();
        assert_eq!(reused.cause, FaultCause::FreedMapRegister);
        let before = flat.accesses.borrow().len();
        assert!(engine.write(&flat, &pages, 0, &buf[..0x10], &ctx, &mut out).is_ok(), "page 0 is still held");
        assert_eq!(flat.accesses.borrow().len(), before + 1);
    }

    /// Flat memory behind an IOMMU whose mapping of each page the test sets: what `translation` answers.
    struct Remapped {
        flat: Flat,
        targets: RefCell<std::collections::BTreeMap<u64, u64>>,
        asked: RefCell<Vec<u64>>,
    }

    impl Dma for Remapped {
        fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
            self.flat.read(iova, buf)
        }
        fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaError> {
            self.flat.write(iova, buf)
        }
        fn translation(&self, iova: u64, _write: bool) -> Option<u64> {
            self.asked.borrow_mut().push(iova);
            self.targets.borrow().get(&iova).copied()
        }
    }

    #[test]
    fn a_stale_register_the_viommu_still_maps_where_it_led_is_confirmed_and_one_remapped_or_unmapped_is_refused() {
        let mut engine = engine();
        let targets = [(0x1000, 0x7f00_1000), (0x2000, 0x7f00_5000), (0x3000, 0x7f00_9000)].into_iter().collect();
        let dma = Remapped { flat: Flat::new(), targets: RefCell::new(targets), asked: RefCell::new(Vec::new()) };
        let mut out = Notifier::new(std::sync::Arc::new(NullSink));
        let ctx = DmaContext::default();
        let registers = engine.pool.take(&[0x1000, 0x2000, 0x3000]).unwrap();
        for r in &registers {
            let iova = engine.pool.peek(*r).unwrap();
            engine.pool.record_first(*r, dma.translation(iova, false));
        }
        let pages = MappedPages::new(&engine.pool, registers.clone());
        let mut buf = [0u8; 0x3000];
        dma.asked.borrow_mut().clear();
        engine.read(&dma, &pages, 0, &mut buf, &ctx, &mut out).unwrap();
        assert!(dma.asked.borrow().is_empty(), "nothing is asked while every register is fresh");

        // A 64 KiB invalidation over all three; page 2 is really unmapped, page 3 remapped elsewhere.
        assert_eq!(engine.pool.invalidate(0, 0x10000), 3);
        dma.targets.borrow_mut().remove(&0x2000);
        dma.targets.borrow_mut().insert(0x3000, 0x7f00_f000);
        engine.read(&dma, &pages, 0, &mut buf[..0x1000], &ctx, &mut out).unwrap();
        assert_eq!(dma.asked.borrow().as_slice(), [0x1000], "only the pages the transfer covers are asked about");
        let unmapped = engine.read(&dma, &pages, 0x1000, &mut buf[..0x10], &ctx, &mut out).unwrap_err();
        assert_eq!(unmapped.cause, FaultCause::StaleTranslation);
        let remapped = engine.read(&dma, &pages, 0x2ff0, &mut buf[..0x10], &ctx, &mut out).unwrap_err();
        assert_eq!(remapped, DmaFault { cause: FaultCause::StaleTranslation, iova: Some(0x3000), register: Some(2) });
        engine.read(&dma, &pages, 0x10, &mut buf[..0x10], &ctx, &mut out).expect("page 1 stays confirmed");

        // An injected invalidation changed no mapping, and the check must keep refusing it.
        engine.pool.invalidate_injected(0x1000, 1);
        let injected = engine.read(&dma, &pages, 0, &mut buf[..0x10], &ctx, &mut out).unwrap_err();
        assert_eq!(injected.cause, FaultCause::StaleTranslation);
    }
}
