//! Work requests: reading WQEs from the SQ/RQ rings, executing SEND/RECV, RDMA_WRITE and RDMA_READ between QPs of
//! this device (loopback through dest_qpn), and the ibverbs error rules: a failed WR moves its QP to ERR, later WRs
//! are flushed with WR_FLUSH_ERR.

use vhca_proto::status::WcStatus;
use vhca_proto::{
    EventKind, FaultCause, QpState, Sge, Wqe, WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_READ, ACCESS_REMOTE_WRITE,
    MAX_SGE, WQE_SIZE, WR_SIGNALED, WR_SOLICITED,
};
use zerocopy::FromBytes;

use crate::completions::WorkCompletion;
use crate::dma_access::CopyEnd;
use crate::dma_engine::{DmaContext, DmaFault, DmaSpan};
use crate::event_records::{FaultEvent, HcaEvent};
use crate::held_work::HoldEnd;
use crate::mr::{check_access, MrAccess};
use crate::qp::Qp;
use crate::{Dma, Hca};

/// A failed work request: the completion status and the check that failed.
type WrError = (WcStatus, FaultCause);

/// Status of a failed access on the requester's own MRs (ibverbs: bad key or range is a protection error).
fn local_status(cause: FaultCause) -> WcStatus {
    match cause {
        FaultCause::OutsideMr | FaultCause::FreedMapRegister => WcStatus::LocProtErr,
        _ => WcStatus::LocAccessErr,
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Queue {
    Send,
    Recv,
}

/// Who a data movement is for, for contexts and fault events.
#[derive(Clone, Copy)]
struct Wr {
    qpn: u32,
    wr_id: u64,
}

impl Wr {
    fn ctx(self, purpose: &'static str) -> DmaContext {
        DmaContext {
            purpose,
            qpn: Some(self.qpn),
            wr_id: Some(self.wr_id),
            async_handle: self.qpn,
            ..Default::default()
        }
    }
}

/// What a send WQE's execution needs of its QP, read once from the QP table (nothing a WQE does changes them).
#[derive(Clone, Copy)]
struct Sender {
    qpn: u32,
    pd: u32,
    send_cq: u32,
    dest_qpn: Option<u32>,
}

impl Hca {
    pub(crate) fn set_qp_state(&mut self, qpn: u32, to: QpState, reason: String) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let from = qp.state;
        qp.state = to;
        self.out.emit(HcaEvent::QpState { qpn, from: from.name(), to: to.name(), reason });
    }

    /// A work request failed: the QP goes to ERR (once) and the driver hears of it on the event queue.
    fn fail_qp(&mut self, qpn: u32, cause: FaultCause, reason: String) {
        if self.qp_state(qpn).is_none_or(|s| s == QpState::Err) {
            return;
        }
        self.set_qp_state(qpn, QpState::Err, reason);
        self.out.push_async(EventKind::QpFatal, qpn, cause, 0, 0);
    }

    /// Runs the SQ up to the producer index: executes WQEs in RTS, flushes them in ERR, leaves them otherwise.
    pub(crate) fn process_send_queue(&mut self, dma: &dyn Dma, qpn: u32) {
        loop {
            let Some(qp) = self.qps.get(&qpn) else { return };
            if qp.sq.pending() == 0 {
                return;
            }
            match qp.state {
                QpState::Rts => {
                    let sender = Sender { qpn, pd: qp.pd, send_cq: qp.send_cq, dest_qpn: qp.dest_qpn };
                    // Executing a WQE consumes exactly it from this SQ (only a doorbell moves the producer, only a
                    // command resets the ring): after the last one posted, the next look would find none pending.
                    let last = qp.sq.pending() == 1;
                    if self.send_queue_held(qpn) || self.hold_if_chosen(qpn) {
                        return;
                    }
                    self.execute_send_wqe(dma, sender);
                    if last {
                        return;
                    }
                }
                QpState::Err => return self.flush_qp(dma, qpn),
                _ => return,
            }
        }
    }

    /// Completes every outstanding WR of both queues with WR_FLUSH_ERR, signaled or not (a held one too: it is
    /// still at its SQ's consumer index).
    pub(crate) fn flush_qp(&mut self, dma: &dyn Dma, qpn: u32) {
        self.end_hold(qpn, HoldEnd::Flushed);
        for queue in [Queue::Send, Queue::Recv] {
            loop {
                let Some(qp) = self.qps.get(&qpn) else { return };
                let (wq, cq) = match queue {
                    Queue::Send => (&qp.sq, qp.send_cq),
                    Queue::Recv => (&qp.rq, qp.recv_cq),
                };
                if wq.pending() == 0 {
                    break;
                }
                let wqe = self.read_wqe(dma, qpn, queue, "flush_wqe").unwrap_or_default();
                let opcode = if queue == Queue::Recv { WrOpcode::Recv as u32 } else { wqe.opcode.get() };
                let completion = WorkCompletion {
                    cq,
                    qpn,
                    wr_id: wqe.wr_id.get(),
                    opcode,
                    status: WcStatus::WrFlushErr,
                    cause: FaultCause::None,
                    byte_len: 0,
                    solicited: false,
                };
                self.complete(dma, completion);
            }
        }
    }

    /// Reads the WQE at the consumer index of a queue and advances the consumer past it, readable or not.
    fn read_wqe(&mut self, dma: &dyn Dma, qpn: u32, queue: Queue, purpose: &'static str) -> Result<Wqe, DmaFault> {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return Err(DmaFault { cause: FaultCause::None, iova: None, register: None });
        };
        let wq = if queue == Queue::Send { &mut qp.sq } else { &mut qp.rq };
        let offset = wq.offset_of(wq.consumer);
        let mut raw = [0u8; WQE_SIZE];
        let ctx = DmaContext { purpose, qpn: Some(qpn), async_handle: qpn, ..Default::default() };
        let result = self.engine.read(dma, &wq.registers, offset, &mut raw, &ctx, &mut self.out);
        wq.consumer = wq.consumer.wrapping_add(1);
        result?;
        Wqe::read_from_bytes(&raw).map_err(|_| DmaFault { cause: FaultCause::None, iova: None, register: None })
    }

    fn execute_send_wqe(&mut self, dma: &dyn Dma, sender: Sender) {
        let Sender { qpn, send_cq, .. } = sender;
        self.engine.injector.send_wr_started();
        let wqe = match self.read_wqe(dma, qpn, Queue::Send, "wqe") {
            Ok(wqe) => wqe,
            Err(fault) => {
                let completion = WorkCompletion {
                    cq: send_cq,
                    qpn,
                    wr_id: 0,
                    opcode: 0,
                    status: WcStatus::LocQpOpErr,
                    cause: fault.cause,
                    byte_len: 0,
                    solicited: false,
                };
                self.complete(dma, completion);
                self.fail_qp(qpn, fault.cause, format!("send WQE unreadable: {}", fault.cause.name()));
                return;
            }
        };
        let wr = Wr { qpn, wr_id: wqe.wr_id.get() };
        let opcode = wqe.opcode.get();
        let result = match (WrOpcode::from_u32(opcode), usize::try_from(wqe.num_sge.get())) {
            (_, Ok(n)) if n <= MAX_SGE => match WrOpcode::from_u32(opcode) {
                Some(WrOpcode::Send) => self.do_send(dma, sender, wr, &wqe, &wqe.sge[..n]),
                Some(WrOpcode::RdmaWrite) => self.do_rdma_write(dma, sender, wr, &wqe, &wqe.sge[..n]),
                Some(WrOpcode::RdmaRead) => self.do_rdma_read(dma, sender, wr, &wqe, &wqe.sge[..n]),
                _ => Err((WcStatus::LocQpOpErr, FaultCause::None)),
            },
            _ => Err((WcStatus::LocQpOpErr, FaultCause::None)),
        };
        let signaled = wqe.flags.get() & WR_SIGNALED != 0;
        let (status, cause, byte_len) = match result {
            Ok(len) => (WcStatus::Success, FaultCause::None, len),
            Err((status, cause)) => (status, cause, 0),
        };
        if signaled || status != WcStatus::Success {
            let completion =
                WorkCompletion { cq: send_cq, qpn, wr_id: wr.wr_id, opcode, status, cause, byte_len, solicited: false };
            self.complete(dma, completion);
        }
        if status != WcStatus::Success {
            let reason = format!(
                "wr_id {:#x} {}: {} ({}), num_sge {}",
                wr.wr_id,
                crate::completions::opcode_name(opcode),
                status.name(),
                cause.name(),
                wqe.num_sge
            );
            self.fail_qp(qpn, cause, reason);
        }
    }

    /// The sender's loopback peer, if it exists and accepts requests (RTR or later).
    fn peer_of(&self, sender: Sender) -> Option<&Qp> {
        self.qps.get(&sender.dest_qpn?).filter(|p| p.can_receive())
    }

    fn fault_event(&self, wr: Wr, cause: FaultCause, dir: &'static str, purpose: &'static str, sge: (u32, u64)) {
        self.out.emit(HcaEvent::Fault(Box::new(FaultEvent {
            cause: cause.name(),
            dir,
            purpose,
            iova: None,
            addr: Some(sge.1),
            key: Some(sge.0),
            register: None,
            qpn: Some(wr.qpn),
            wr_id: Some(wr.wr_id),
            opcode: None,
            tag: None,
        })));
    }

    /// Checks every SGE against its MR (key, PD, range, rights) before any byte moves; returns the bytes they name,
    /// in order, as spans of their MRs' registers (at most `MAX_SGE`, so no allocation per work request).
    fn check_sges(
        &self,
        wr: Wr,
        pd: u32,
        sges: &[Sge],
        need: u32,
        dir: &'static str,
        purpose: &'static str,
    ) -> Result<SgePieces, FaultCause> {
        let mut out = SgePieces::default();
        for (slot, sge) in out.items.iter_mut().zip(sges) {
            let (key, addr, len) = (sge.lkey.get(), sge.addr.get(), sge.length.get());
            match check_access(&self.mrs, key, pd, addr, u64::from(len), need) {
                Ok(MrAccess { key, offset }) => {
                    *slot = Piece { key, offset, len: len as usize, ctx: wr.ctx(purpose) };
                    out.count += 1;
                }
                Err(cause) => {
                    self.fault_event(wr, cause, dir, purpose, (key, addr));
                    return Err(cause);
                }
            }
        }
        Ok(out)
    }

    /// Copies `src` pieces onto `dst` pieces in order, once, until the shorter list ends; returns the bytes moved.
    /// A refusal says which end it was on.
    fn copy_pieces(&mut self, dma: &dyn Dma, src: &[Piece], dst: &[Piece]) -> Result<usize, (CopyEnd, FaultCause)> {
        let (mut si, mut di, mut s_off, mut d_off, mut moved) = (0, 0, 0usize, 0usize, 0usize);
        while let (Some(a), Some(b)) = (src.get(si), dst.get(di)) {
            let n = (a.len - s_off).min(b.len - d_off);
            if n > 0 {
                let (Some(sm), Some(dm)) = (self.mrs.get(a.key), self.mrs.get(b.key)) else {
                    let end = if self.mrs.get(a.key).is_none() { CopyEnd::Source } else { CopyEnd::Destination };
                    return Err((end, FaultCause::FreedMapRegister));
                };
                let from = DmaSpan { registers: &sm.registers, offset: a.offset + s_off as u64, ctx: a.ctx };
                let to = DmaSpan { registers: &dm.registers, offset: b.offset + d_off as u64, ctx: b.ctx };
                self.engine.copy(dma, &from, &to, n, &mut self.out).map_err(|(end, f)| (end, f.cause))?;
            }
            s_off += n;
            d_off += n;
            moved += n;
            if s_off == a.len {
                (si, s_off) = (si + 1, 0);
            }
            if d_off == b.len {
                (di, d_off) = (di + 1, 0);
            }
        }
        Ok(moved)
    }

    /// The peer and the place in its MR an RDMA operation targets, after the QP's and the MR's remote rights.
    fn remote_target(
        &self,
        sender: Sender,
        wr: Wr,
        wqe: &Wqe,
        len: u64,
        need: u32,
        purpose: &'static str,
    ) -> Result<(u32, MrAccess), WrError> {
        let peer_qp = self.peer_of(sender).ok_or((WcStatus::RnrRetryExcErr, FaultCause::None))?;
        let peer = peer_qp.qpn;
        let (rkey, addr) = (wqe.rkey.get(), wqe.remote_addr.get());
        let dir = if need == ACCESS_REMOTE_READ { "read" } else { "write" };
        if peer_qp.access & need != need {
            self.fault_event(wr, FaultCause::AccessRight, dir, purpose, (rkey, addr));
            return Err((WcStatus::RemAccessErr, FaultCause::AccessRight));
        }
        match check_access(&self.mrs, rkey, peer_qp.pd, addr, len, need) {
            Ok(access) => Ok((peer, access)),
            Err(cause) => {
                self.fault_event(wr, cause, dir, purpose, (rkey, addr));
                Err((WcStatus::RemAccessErr, cause))
            }
        }
    }

    /// RDMA_WRITE: the local SGEs' bytes land in the peer's MR, copied once, source MR to destination MR.
    fn do_rdma_write(
        &mut self,
        dma: &dyn Dma,
        sender: Sender,
        wr: Wr,
        wqe: &Wqe,
        sges: &[Sge],
    ) -> Result<u32, WrError> {
        let pd = sender.pd;
        let local = |c| (local_status(c), c);
        let src = self.check_sges(wr, pd, sges, 0, "read", "rdma_write_local").map_err(local)?;
        let len = src.total_len();
        let (_, target) = self.remote_target(sender, wr, wqe, len as u64, ACCESS_REMOTE_WRITE, "rdma_write_remote")?;
        let dst = [Piece { key: target.key, offset: target.offset, len, ctx: wr.ctx("rdma_write_remote") }];
        self.copy_pieces(dma, src.as_slice(), &dst).map_err(|(end, cause)| match end {
            CopyEnd::Source => local(cause),
            CopyEnd::Destination => (WcStatus::RemAccessErr, cause),
        })?;
        Ok(u32::try_from(len).unwrap_or(u32::MAX))
    }

    /// RDMA_READ: the peer's MR bytes land in the local SGEs, copied once.
    fn do_rdma_read(&mut self, dma: &dyn Dma, sender: Sender, wr: Wr, wqe: &Wqe, sges: &[Sge]) -> Result<u32, WrError> {
        let pd = sender.pd;
        let local = |c| (local_status(c), c);
        // The local side is checked first so no remote byte is read for a request that cannot land.
        let dst = self.check_sges(wr, pd, sges, ACCESS_LOCAL_WRITE, "write", "rdma_read_local").map_err(local)?;
        let len = dst.total_len();
        let (_, source) = self.remote_target(sender, wr, wqe, len as u64, ACCESS_REMOTE_READ, "rdma_read_remote")?;
        let src = [Piece { key: source.key, offset: source.offset, len, ctx: wr.ctx("rdma_read_remote") }];
        self.copy_pieces(dma, &src, dst.as_slice()).map_err(|(end, cause)| match end {
            CopyEnd::Source => (WcStatus::RemAccessErr, cause),
            CopyEnd::Destination => local(cause),
        })?;
        Ok(u32::try_from(len).unwrap_or(u32::MAX))
    }

    /// SEND: the payload lands in the buffer of the peer's next RECV, copied once from the sender's SGEs. A
    /// receiver-side failure completes that RECV with its error and moves the peer to ERR; the sender sees
    /// REM_ACCESS_ERR. A sender-side refusal (its own buffer, found while copying) leaves the RECV posted.
    fn do_send(&mut self, dma: &dyn Dma, sender: Sender, wr: Wr, wqe: &Wqe, sges: &[Sge]) -> Result<u32, WrError> {
        let pd = sender.pd;
        let local = |c| (local_status(c), c);
        let src = self.check_sges(wr, pd, sges, 0, "read", "send_payload").map_err(local)?;
        let len = src.total_len();
        let Some((peer, peer_pd, recv_cq, posted)) =
            self.peer_of(sender).map(|p| (p.qpn, p.pd, p.recv_cq, p.rq.pending()))
        else {
            return Err((WcStatus::RnrRetryExcErr, FaultCause::None));
        };
        if posted == 0 {
            return Err((WcStatus::RnrRetryExcErr, FaultCause::None));
        }
        let recv = self.read_wqe(dma, peer, Queue::Recv, "recv_wqe");
        let recv_wr = Wr { qpn: peer, wr_id: recv.as_ref().map_or(0, |w| w.wr_id.get()) };
        let outcome = match &recv {
            Err(fault) => Err((WcStatus::LocQpOpErr, fault.cause)),
            Ok(r) if r.opcode.get() != WrOpcode::Recv as u32 => Err((WcStatus::LocQpOpErr, FaultCause::None)),
            Ok(r) => match usize::try_from(r.num_sge.get()) {
                Ok(n) if n <= MAX_SGE => {
                    let recv_sges = r.sge;
                    match self.receive(dma, recv_wr, peer_pd, &recv_sges[..n], src.as_slice(), len) {
                        Err(Refused::Sender(cause)) => {
                            // The message never arrived: the RECV stays posted for the next SEND.
                            if let Some(qp) = self.qps.get_mut(&peer) {
                                qp.rq.consumer = qp.rq.consumer.wrapping_sub(1);
                            }
                            return Err(local(cause));
                        }
                        Err(Refused::Receiver(e)) => Err(e),
                        Ok(()) => Ok(()),
                    }
                }
                _ => Err((WcStatus::LocQpOpErr, FaultCause::None)),
            },
        };
        let byte_len = u32::try_from(len).unwrap_or(u32::MAX);
        let (status, cause) = match outcome {
            Ok(()) => (WcStatus::Success, FaultCause::None),
            Err(e) => e,
        };
        let completion = WorkCompletion {
            cq: recv_cq,
            qpn: peer,
            wr_id: recv_wr.wr_id,
            opcode: WrOpcode::Recv as u32,
            status,
            cause,
            byte_len: if status == WcStatus::Success { byte_len } else { 0 },
            solicited: wqe.flags.get() & WR_SOLICITED != 0,
        };
        self.complete(dma, completion);
        if status != WcStatus::Success {
            self.fail_qp(peer, cause, format!("recv wr_id {:#x}: {} ({})", recv_wr.wr_id, status.name(), cause.name()));
            if peer != wr.qpn {
                self.flush_qp(dma, peer);
            }
            return Err((WcStatus::RemAccessErr, cause));
        }
        Ok(byte_len)
    }

    /// Copies a SEND's `len` bytes into the RECV's SGEs (which need LOCAL_WRITE and must hold all of it).
    fn receive(
        &mut self,
        dma: &dyn Dma,
        recv_wr: Wr,
        pd: u32,
        sges: &[Sge],
        src: &[Piece],
        len: usize,
    ) -> Result<(), Refused> {
        let receiver = |c| Refused::Receiver((local_status(c), c));
        let dst = self.check_sges(recv_wr, pd, sges, ACCESS_LOCAL_WRITE, "write", "recv_payload").map_err(receiver)?;
        if len > dst.total_len() {
            return Err(Refused::Receiver((WcStatus::LocLenErr, FaultCause::None)));
        }
        self.copy_pieces(dma, src, dst.as_slice()).map(|_| ()).map_err(|(end, cause)| match end {
            CopyEnd::Source => Refused::Sender(cause),
            CopyEnd::Destination => receiver(cause),
        })
    }
}

/// One SGE's bytes as a span of its MR.
#[derive(Clone, Copy, Default)]
struct Piece {
    key: u32,
    offset: u64,
    len: usize,
    ctx: DmaContext,
}

/// The checked SGEs of one work request, in order.
#[derive(Default)]
struct SgePieces {
    items: [Piece; MAX_SGE],
    count: usize,
}

impl SgePieces {
    fn as_slice(&self) -> &[Piece] {
        &self.items[..self.count]
    }

    fn total_len(&self) -> usize {
        self.as_slice().iter().map(|p| p.len).sum()
    }
}

/// Which side of a SEND refused its bytes.
enum Refused {
    Sender(FaultCause),
    Receiver(WrError),
}
