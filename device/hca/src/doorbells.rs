//! The doorbell queue (queue 2): 16-byte records that move an SQ or RQ producer index or arm a CQ. Each record is
//! checked (known kind, live handle, index not behind the device nor more than a ring ahead) before it acts.

use std::borrow::Cow;

use vhca_proto::{Doorbell, DoorbellKind, QpState, DOORBELL_SIZE};
use zerocopy::FromBytes;

use crate::event_records::HcaEvent;
use crate::{Dma, Hca};

impl Hca {
    pub(crate) fn ring_doorbells(&mut self, dma: &dyn Dma, records: &[u8]) {
        for chunk in records.chunks(DOORBELL_SIZE) {
            self.out.request_started();
            self.in_doorbell = true;
            self.one_doorbell(dma, chunk);
            self.in_doorbell = false;
            self.doorbells_done += 1;
            self.release_delayed(dma);
        }
    }

    fn one_doorbell(&mut self, dma: &dyn Dma, chunk: &[u8]) {
        let Ok(db) = Doorbell::read_from_bytes(chunk) else {
            let detail = format!("record of {} bytes, {DOORBELL_SIZE} expected", chunk.len());
            self.out.emit(HcaEvent::Doorbell {
                db: "short".into(),
                handle: 0,
                index: 0,
                ok: false,
                detail: Some(detail),
            });
            return;
        };
        let (handle, index) = (db.handle.get(), db.index.get());
        let refused = match DoorbellKind::from_u32(db.kind.get()) {
            None => Err(format!("unknown doorbell kind {}", db.kind)),
            Some(DoorbellKind::SendQueue) => self.send_queue_doorbell(handle, index),
            Some(DoorbellKind::RecvQueue) => self.recv_queue_doorbell(handle, index),
            Some(DoorbellKind::CqArm) => match self.cqs.get_mut(&handle) {
                Some(cq) => {
                    cq.armed = Some(db.flags.get() & 1 != 0);
                    Ok(())
                }
                None => Err(format!("no CQ {handle}")),
            },
        };
        let ok = refused.is_ok();
        self.out.emit_with(|| {
            let name = DoorbellKind::from_u32(db.kind.get())
                .map_or_else(|| Cow::Owned(db.kind.to_string()), |k| Cow::Borrowed(kind_name(k)));
            HcaEvent::Doorbell { db: name, handle, index, ok, detail: refused.err() }
        });
        if ok {
            match DoorbellKind::from_u32(db.kind.get()) {
                Some(DoorbellKind::SendQueue) => self.process_send_queue(dma, handle),
                Some(DoorbellKind::RecvQueue) if self.qp_state(handle) == Some(QpState::Err) => {
                    self.flush_qp(dma, handle)
                }
                _ => {}
            }
        }
    }

    fn send_queue_doorbell(&mut self, qpn: u32, index: u32) -> Result<(), String> {
        let qp = self.qps.get_mut(&qpn).ok_or_else(|| format!("no QP {qpn}"))?;
        if qp.state == QpState::Reset {
            return Err(format!("QP {qpn} is in RESET"));
        }
        if !qp.sq.accepts_producer(index) {
            return Err(format!(
                "SQ index {index}: consumer {}, producer {}, {} entries",
                qp.sq.consumer, qp.sq.producer, qp.sq.entries
            ));
        }
        qp.sq.producer = index;
        Ok(())
    }

    fn recv_queue_doorbell(&mut self, qpn: u32, index: u32) -> Result<(), String> {
        let qp = self.qps.get_mut(&qpn).ok_or_else(|| format!("no QP {qpn}"))?;
        if qp.state == QpState::Reset {
            return Err(format!("QP {qpn} is in RESET"));
        }
        if !qp.rq.accepts_producer(index) {
            return Err(format!(
                "RQ index {index}: consumer {}, producer {}, {} entries",
                qp.rq.consumer, qp.rq.producer, qp.rq.entries
            ));
        }
        qp.rq.producer = index;
        Ok(())
    }
}

fn kind_name(kind: DoorbellKind) -> &'static str {
    match kind {
        DoorbellKind::SendQueue => "sq",
        DoorbellKind::RecvQueue => "rq",
        DoorbellKind::CqArm => "cq_arm",
    }
}
