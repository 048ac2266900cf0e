//! The DMA engine: moves bytes between the HCA and guest memory through map registers, one page translation per
//! register, checking each (freed, stale) before handing the IOVA to `Dma`, and logging every DMA and every refusal.

use vhca_proto::{EventKind, FaultCause, PAGE_SIZE};

use crate::dma_access::Dma;
use crate::event_records::HcaEvent;
use crate::fault_injection::{ContiguousPolicy, Injector};
use crate::map_registers::{MapRegisterPool, RegisterRef};
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
}

pub struct DmaEngine {
    pub pool: MapRegisterPool,
    pub injector: Injector,
    /// HcaConfig::revalidate_stale: a stale register is re-validated on use instead of refused.
    pub revalidate_stale: bool,
}

impl DmaEngine {
    /// Reads `buf.len()` bytes starting `offset` bytes into the pages `registers` translate.
    pub fn read(
        &mut self,
        dma: &dyn Dma,
        registers: &[RegisterRef],
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
        registers: &[RegisterRef],
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
        registers: &[RegisterRef],
        offset: u64,
        mut data: Transfer<'_>,
        ctx: &DmaContext,
        out: &mut Notifier,
    ) -> Result<(), DmaFault> {
        let (n, invalidate) = self.injector.dma();
        let first_iova = self.peek_iova(registers, offset);
        if invalidate {
            self.inject_invalidation(n, first_iova, out);
        }
        let len = data.len() as u64;
        let result = self.move_bytes(dma, registers, offset, &mut data);
        let iova = first_iova.unwrap_or(0);
        out.emit(HcaEvent::Dma {
            n,
            dir: data.dir(),
            iova,
            len,
            purpose: ctx.purpose,
            qpn: ctx.qpn,
            wr_id: ctx.wr_id,
            ok: result.is_ok(),
        });
        if let Err(fault) = result {
            out.emit(HcaEvent::Fault {
                cause: fault.cause.name(),
                dir: data.dir(),
                purpose: ctx.purpose,
                iova: fault.iova,
                addr: None,
                key: None,
                register: fault.register,
                qpn: ctx.qpn,
                wr_id: ctx.wr_id,
                opcode: ctx.opcode.map(str::to_string),
                tag: ctx.tag,
            });
            let detail = fault.register.unwrap_or(u32::MAX);
            out.push_async(EventKind::DmaFault, ctx.async_handle, fault.cause, detail, fault.iova.unwrap_or(0));
        }
        result
    }

    /// The IOVA the transfer starts at, without side effects, for logs and for the injected invalidation.
    fn peek_iova(&self, registers: &[RegisterRef], offset: u64) -> Option<u64> {
        let page = usize::try_from(offset / PAGE_SIZE).ok()?;
        let r = registers.get(page)?;
        self.pool.peek(*r).map(|p| p + offset % PAGE_SIZE)
    }

    fn inject_invalidation(&mut self, n: u64, first_iova: Option<u64>, out: &mut Notifier) {
        let config = &self.injector.config;
        let iova = config.invalidate_iova.or(first_iova.map(|i| i & !(PAGE_SIZE - 1))).unwrap_or(0);
        let size = config.invalidate_size.unwrap_or(PAGE_SIZE);
        let registers = self.pool.invalidate(iova, size);
        out.emit(HcaEvent::Injected { what: "invalidate_at_dma", n, detail: format!("iova {iova:#x} size {size:#x}") });
        out.emit(HcaEvent::TranslationsStale { iova, size, registers, injected: true });
    }

    /// Moves the bytes in bursts of IOVA-contiguous pages (capped under the split policy), one `Dma` call each.
    fn move_bytes(
        &mut self,
        dma: &dyn Dma,
        registers: &[RegisterRef],
        offset: u64,
        data: &mut Transfer<'_>,
    ) -> Result<(), DmaFault> {
        let total = data.len();
        let burst_cap = match (self.injector.config.contiguous_policy, self.injector.config.max_contiguous_pages) {
            (ContiguousPolicy::Split, Some(cap)) => u64::from(cap.max(1)),
            _ => u64::MAX,
        };
        let mut done = 0usize;
        while done < total {
            let pos = offset.checked_add(done as u64).ok_or(outside(None))?;
            let mut page = pos / PAGE_SIZE;
            let iova = self.translate(registers, page)?.checked_add(pos % PAGE_SIZE).ok_or(outside(None))?;
            // Bytes up to the end of this page, then whole pages while the IOVAs stay contiguous.
            let mut burst = (PAGE_SIZE - pos % PAGE_SIZE).min((total - done) as u64);
            let mut pages = 1u64;
            while (done as u64) + burst < total as u64 && pages < burst_cap {
                // Guest-chosen page IOVAs may sit at the top of the address space: no wrapping into a "contiguous" 0.
                let Some(next_page_iova) = (iova - pos % PAGE_SIZE).checked_add(pages * PAGE_SIZE) else { break };
                page += 1;
                match self.translate(registers, page) {
                    Ok(next) if next == next_page_iova => {}
                    // A refused register is reported when the loop gets there with the bytes before it moved.
                    _ => break,
                }
                burst = (burst + PAGE_SIZE).min((total - done) as u64);
                pages += 1;
            }
            let burst = burst as usize;
            let range = done..done + burst;
            let moved = match data {
                Transfer::Read(buf) => dma.read(iova, &mut buf[range]),
                Transfer::Write(buf) => dma.write(iova, &buf[range]),
            };
            moved.map_err(|e| DmaFault { cause: e.cause, iova: Some(e.iova), register: None })?;
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

fn outside(iova: Option<u64>) -> DmaFault {
    DmaFault { cause: FaultCause::OutsideMr, iova, register: None }
}
