//! Completions: writing CQEs into a CQ ring by DMA (body first, owner word last), CQ notifications, and the
//! drop/delay fault-injection knobs that sit between a finished work request and its CQE.

use vhca_proto::status::WcStatus;
use vhca_proto::{Cqe, EventKind, FaultCause, WrOpcode, CQE_SIZE};
use zerocopy::IntoBytes;

use crate::dma_engine::DmaContext;
use crate::event_records::HcaEvent;
use crate::fault_injection::CompletionFate;
use crate::{Dma, Hca};

/// A finished work request on its way to a CQ.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkCompletion {
    pub cq: u32,
    pub qpn: u32,
    pub wr_id: u64,
    /// The WQE's opcode as the driver wrote it (it may be one the device does not know).
    pub opcode: u32,
    pub status: WcStatus,
    pub cause: FaultCause,
    pub byte_len: u32,
    pub solicited: bool,
}

/// A completion held back by the delay_completion knob.
pub(crate) struct DelayedCompletion {
    release_after: u64,
    completion: WorkCompletion,
}

pub(crate) fn opcode_name(opcode: u32) -> &'static str {
    WrOpcode::from_u32(opcode).map_or("UNKNOWN", WrOpcode::name)
}

/// Bytes of a CQE before the owner word, which goes last so the driver never sees a half-written CQE as valid.
const CQE_BODY: usize = CQE_SIZE - 4;

impl Hca {
    pub(crate) fn complete(&mut self, dma: &dyn Dma, completion: WorkCompletion) {
        let (n, fate) = self.engine.injector.completion();
        let detail = || format!("cq {} qpn {} wr_id {:#x}", completion.cq, completion.qpn, completion.wr_id);
        match fate {
            CompletionFate::Deliver => self.write_cqe(dma, completion),
            CompletionFate::Drop => self.out.emit(HcaEvent::Injected { what: "drop_completion", n, detail: detail() }),
            CompletionFate::Delay(0) => self.write_cqe(dma, completion),
            CompletionFate::Delay(k) => {
                // Counted from the doorbell record after the one being processed.
                let release_after = self.doorbells_done + u64::from(k) + u64::from(self.in_doorbell);
                self.out.emit(HcaEvent::Injected {
                    what: "delay_completion",
                    n,
                    detail: format!("{} held for {k} doorbell records", detail()),
                });
                self.delayed.push(DelayedCompletion { release_after, completion });
            }
        }
    }

    /// Writes completions whose delay has run out, in the order they were held.
    pub(crate) fn release_delayed(&mut self, dma: &dyn Dma) {
        if self.delayed.is_empty() {
            return;
        }
        let now = self.doorbells_done;
        let (due, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.delayed).into_iter().partition(|d| d.release_after <= now);
        self.delayed = waiting;
        for d in due {
            self.write_cqe(dma, d.completion);
        }
    }

    /// A destroyed CQ takes its held completions with it.
    pub(crate) fn discard_delayed(&mut self, cq: u32) {
        self.delayed.retain(|d| d.completion.cq != cq);
    }

    fn write_cqe(&mut self, dma: &dyn Dma, c: WorkCompletion) {
        // One lookup: the CQ (its own table) is borrowed alongside the engine and the notifier.
        let Some(cq) = self.cqs.get_mut(&c.cq) else { return };
        let (offset, owner) = cq.next_slot();
        let index = cq.producer;
        let cqe = Cqe {
            wr_id: c.wr_id.into(),
            status: (c.status as u32).into(),
            opcode: c.opcode.into(),
            qpn: c.qpn.into(),
            byte_len: c.byte_len.into(),
            vendor_err: (c.cause as u32).into(),
            owner: owner.into(),
        };
        let ctx = DmaContext {
            purpose: "cqe",
            qpn: Some(c.qpn),
            wr_id: Some(c.wr_id),
            async_handle: c.cq,
            ..Default::default()
        };
        let bytes = cqe.as_bytes();
        let mut written =
            self.engine.write(dma, &cq.registers, offset, &bytes[..CQE_BODY], &ctx, &mut self.out).is_ok();
        if written {
            let owner_ctx = DmaContext { purpose: "cqe_owner", ..ctx };
            let owner_offset = offset + CQE_BODY as u64;
            written = self
                .engine
                .write(dma, &cq.registers, owner_offset, &bytes[CQE_BODY..], &owner_ctx, &mut self.out)
                .is_ok();
        }
        self.out.emit_with(|| HcaEvent::Completion {
            cq: c.cq,
            index,
            qpn: c.qpn,
            wr_id: c.wr_id,
            opcode: opcode_name(c.opcode),
            status: c.status.name(),
            vendor_err: c.cause.name(),
            byte_len: c.byte_len,
            written,
        });
        if !written {
            return;
        }
        cq.producer = cq.producer.wrapping_add(1);
        if cq.take_notification(c.solicited, c.status != WcStatus::Success) {
            self.out.push_async(EventKind::CqCompletion, c.cq, FaultCause::None, index, 0);
        }
    }
}
