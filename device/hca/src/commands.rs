//! The command queue (queue 0): parses a request with checked lengths, runs the verb, and answers with a status.
//! Every refusal names its cause in a `refused` event; every command ends in one `command` event.

use vhca_proto::{
    CommandHeader, CreateCqReq, CreateQpReq, EventKind, FaultCause, HandleReq, HandleResp, ModifyQpReq, Opcode,
    QpState, QueryDeviceResp, QueryPortReq, QueryPortResp, RegMrReq, RegMrResp, ReqNotifyCqReq, ResponseHeader, Status,
    ABI_VERSION, ACCESS_ALL, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, COMMAND_HEADER_SIZE, CQE_SIZE,
    MAX_PAGES_PER_COMMAND, MAX_REQUEST_SIZE, MAX_SGE, MTU_4096, PAGE_SIZE, PORT_STATE_ACTIVE, QP_ATTR_ACCESS_FLAGS,
    QP_ATTR_DEST_QPN, QP_ATTR_STATE, QP_TYPE_RC, WQE_SIZE,
};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::cq::Cq;
use crate::dma_engine::DmaContext;
use crate::event_records::HcaEvent;
use crate::fault_injection::ContiguousPolicy;
use crate::held_work::HoldEnd;
use crate::map_registers::{Owner, RegisterRef};
use crate::mapped_pages::MappedPages;
use crate::mr::Mr;
use crate::qp::{check_transition, Qp, TransitionError, WorkQueue};
use crate::{Dma, Hca};

/// A command refused: the status for the driver and the reason for the log.
struct Refusal {
    status: Status,
    reason: String,
}

fn refuse(status: Status, reason: impl Into<String>) -> Refusal {
    Refusal { status, reason: reason.into() }
}

/// A successful command: its response body and the object it created or destroyed.
struct Done {
    body: Vec<u8>,
    object: Option<(&'static str, &'static str, u32)>,
}

impl Done {
    fn empty() -> Done {
        Done { body: Vec::new(), object: None }
    }
}

type CommandResult = Result<Done, Refusal>;

/// The command being executed, for DMA contexts and events.
#[derive(Clone, Copy)]
struct Cmd<'a> {
    opcode: Opcode,
    tag: u32,
    fixed: &'a [u8],
    pages: &'a [u8],
}

fn read_body<T: FromBytes + KnownLayout + Immutable>(fixed: &[u8]) -> Result<T, Refusal> {
    T::read_from_bytes(fixed).map_err(|_| refuse(Status::BadLength, "request body has the wrong size"))
}

/// Parses `count` page IOVAs; the page list must fill the rest of the body exactly.
fn page_list(bytes: &[u8], count: u32) -> Result<Vec<u64>, Refusal> {
    let count = usize::try_from(count).unwrap_or(usize::MAX);
    if count > MAX_PAGES_PER_COMMAND {
        return Err(refuse(Status::InvalidParam, format!("{count} pages, at most {MAX_PAGES_PER_COMMAND}")));
    }
    let expected = count.checked_mul(8).ok_or_else(|| refuse(Status::InvalidParam, "page count overflows"))?;
    if bytes.len() != expected {
        return Err(refuse(
            Status::BadLength,
            format!("page list is {} bytes, {count} pages need {expected}", bytes.len()),
        ));
    }
    let mut pages = Vec::with_capacity(count);
    for (i, chunk) in bytes.chunks_exact(8).enumerate() {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(chunk);
        let iova = u64::from_le_bytes(raw);
        if iova % PAGE_SIZE != 0 {
            return Err(refuse(Status::InvalidParam, format!("page {i} iova {iova:#x} is not page-aligned")));
        }
        pages.push(iova);
    }
    Ok(pages)
}

/// The pages a ring of `entries` entries of `entry_size` bytes needs; the entry count must be a power of two.
fn ring_geometry(what: &str, entries: u32, max: u32, entry_size: usize, page_count: u32) -> Result<(), Refusal> {
    if entries == 0 || !entries.is_power_of_two() || entries > max {
        return Err(refuse(Status::InvalidParam, format!("{what} entries {entries}: a power of two up to {max}")));
    }
    let needed = vhca_proto::ring_pages(entries, entry_size);
    if u64::from(page_count) != needed {
        return Err(refuse(Status::InvalidParam, format!("{what}: {page_count} pages listed, {needed} needed")));
    }
    Ok(())
}

impl Hca {
    pub(crate) fn execute_command(&mut self, dma: &dyn Dma, request: &[u8]) -> Vec<u8> {
        let Ok((header, rest)) = CommandHeader::read_from_prefix(request) else {
            return self.respond(0, 0, Err(refuse(Status::BadLength, "request shorter than the command header")));
        };
        let (opcode_raw, tag) = (header.opcode.get(), header.tag.get());
        let Some(opcode) = Opcode::from_u32(opcode_raw) else {
            return self.respond(opcode_raw, tag, Err(refuse(Status::UnknownOpcode, "unknown opcode")));
        };
        let result = self.split_body(opcode, header.body_len.get(), rest).and_then(|(fixed, pages)| {
            let cmd = Cmd { opcode, tag, fixed, pages };
            self.dispatch(dma, cmd)
        });
        self.respond(opcode_raw, tag, result)
    }

    fn split_body<'a>(&self, opcode: Opcode, body_len: u32, rest: &'a [u8]) -> Result<(&'a [u8], &'a [u8]), Refusal> {
        let body_len = usize::try_from(body_len).unwrap_or(usize::MAX);
        if body_len > MAX_REQUEST_SIZE - COMMAND_HEADER_SIZE {
            return Err(refuse(
                Status::BadLength,
                format!("body_len {body_len} over the {MAX_REQUEST_SIZE}-byte limit"),
            ));
        }
        let body = rest
            .get(..body_len)
            .ok_or_else(|| refuse(Status::BadLength, format!("body_len {body_len}, only {} bytes sent", rest.len())))?;
        let fixed_len = opcode.request_size();
        if body.len() < fixed_len {
            return Err(refuse(
                Status::BadLength,
                format!("body {} bytes, {} needs {fixed_len}", body.len(), opcode.name()),
            ));
        }
        Ok(body.split_at(fixed_len))
    }

    fn dispatch(&mut self, dma: &dyn Dma, cmd: Cmd<'_>) -> CommandResult {
        let takes_pages = matches!(cmd.opcode, Opcode::CreateCq | Opcode::RegMr | Opcode::CreateQp);
        if !takes_pages && !cmd.pages.is_empty() {
            return Err(refuse(Status::BadLength, "trailing bytes after the request body"));
        }
        match cmd.opcode {
            Opcode::QueryDevice => Ok(self.query_device()),
            Opcode::QueryPort => self.query_port(cmd),
            Opcode::AllocPd => self.alloc_pd(),
            Opcode::DeallocPd => self.dealloc_pd(cmd),
            Opcode::CreateCq => self.create_cq(dma, cmd),
            Opcode::DestroyCq => self.destroy_cq(cmd),
            Opcode::ReqNotifyCq => self.req_notify_cq(cmd),
            Opcode::RegMr => self.reg_mr(dma, cmd),
            Opcode::DeregMr => self.dereg_mr(cmd),
            Opcode::CreateQp => self.create_qp(dma, cmd),
            Opcode::ModifyQp => self.modify_qp(dma, cmd),
            Opcode::DestroyQp => self.destroy_qp(cmd),
        }
    }

    fn respond(&mut self, opcode: u32, tag: u32, result: CommandResult) -> Vec<u8> {
        let name = Opcode::from_u32(opcode).map_or_else(|| format!("0x{opcode:x}"), |o| o.name().to_string());
        let (status, body) = match result {
            Ok(done) => {
                if let Some((action, object, handle)) = done.object {
                    self.out.emit(HcaEvent::Object { action, object, handle, tag });
                }
                (Status::Ok, done.body)
            }
            Err(refusal) => {
                self.out.emit(HcaEvent::Refused { opcode: name.clone(), tag, reason: refusal.reason });
                (refusal.status, Vec::new())
            }
        };
        self.out.emit(HcaEvent::Command { opcode: name, tag, status: status.name().to_string() });
        let header = ResponseHeader {
            status: (status as u32).into(),
            opcode: opcode.into(),
            tag: tag.into(),
            body_len: u32::try_from(body.len()).unwrap_or(0).into(),
        };
        let mut out = header.as_bytes().to_vec();
        out.extend_from_slice(&body);
        out
    }

    fn query_device(&self) -> Done {
        let (total, free) = self.map_registers();
        let resp = QueryDeviceResp {
            abi_version: u32::from(ABI_VERSION).into(),
            vendor_id: 0x1af4.into(),
            max_pd: self.config.max_pd.into(),
            max_cq: self.config.max_cq.into(),
            max_cqe: self.config.max_cqe.into(),
            max_qp: self.config.max_qp.into(),
            max_qp_wr: self.config.max_qp_wr.into(),
            max_sge: (MAX_SGE as u32).into(),
            max_mr: self.config.max_mr.into(),
            map_registers_total: total.into(),
            map_registers_free: free.into(),
            page_size: (PAGE_SIZE as u32).into(),
            fw_version: 1.into(),
            node_guid: self.config.node_guid.into(),
        };
        Done { body: resp.as_bytes().to_vec(), object: None }
    }

    fn query_port(&self, cmd: Cmd<'_>) -> CommandResult {
        let req: QueryPortReq = read_body(cmd.fixed)?;
        if req.port.get() != 1 {
            return Err(refuse(Status::InvalidParam, format!("port {}: the device has port 1 only", req.port.get())));
        }
        let mut gid = [0u8; 16];
        gid[..8].copy_from_slice(&0xfe80_0000_0000_0000u64.to_be_bytes());
        gid[8..].copy_from_slice(&self.config.node_guid.to_be_bytes());
        let resp = QueryPortResp {
            state: PORT_STATE_ACTIVE.into(),
            max_mtu: MTU_4096.into(),
            active_mtu: MTU_4096.into(),
            lid: 1.into(),
            gid,
        };
        Ok(Done { body: resp.as_bytes().to_vec(), object: None })
    }

    fn alloc_pd(&mut self) -> CommandResult {
        let pd = self.pds.alloc().ok_or_else(|| refuse(Status::NoResources, "PD table full"))?;
        Ok(handle_done(pd, "pd"))
    }

    fn dealloc_pd(&mut self, cmd: Cmd<'_>) -> CommandResult {
        let pd = read_body::<HandleReq>(cmd.fixed)?.handle.get();
        if !self.pds.contains(pd) {
            return Err(refuse(Status::InvalidHandle, format!("no PD {pd}")));
        }
        if self.mrs.any_in_pd(pd) || self.qps.values().any(|q| q.pd == pd) {
            return Err(refuse(Status::InvalidState, format!("PD {pd} still has MRs or QPs")));
        }
        self.pds.remove(pd);
        Ok(Done { body: Vec::new(), object: Some(("destroy", "pd", pd)) })
    }

    fn create_cq(&mut self, dma: &dyn Dma, cmd: Cmd<'_>) -> CommandResult {
        let req: CreateCqReq = read_body(cmd.fixed)?;
        let (entries, page_count) = (req.entries.get(), req.page_count.get());
        ring_geometry("CQ", entries, self.config.max_cqe, CQE_SIZE, page_count)?;
        let pages = page_list(cmd.pages, page_count)?;
        let handle = self.cq_handles.allocate().ok_or_else(|| refuse(Status::NoResources, "CQ table full"))?;
        match self.map_ring(dma, cmd, Owner::Cq(handle), &pages, true) {
            Ok(registers) => {
                self.cqs.insert(handle, Cq { entries, registers, producer: 0, armed: None });
                Ok(handle_done(handle, "cq"))
            }
            Err(refusal) => {
                self.cq_handles.release();
                Err(refusal)
            }
        }
    }

    fn destroy_cq(&mut self, cmd: Cmd<'_>) -> CommandResult {
        let cq = read_body::<HandleReq>(cmd.fixed)?.handle.get();
        if !self.cqs.contains_key(&cq) {
            return Err(refuse(Status::InvalidHandle, format!("no CQ {cq}")));
        }
        if self.qps.values().any(|q| q.send_cq == cq || q.recv_cq == cq) {
            return Err(refuse(Status::InvalidState, format!("CQ {cq} is still used by a QP")));
        }
        if let Some(removed) = self.cqs.remove(&cq) {
            self.cq_handles.release();
            self.unmap(Owner::Cq(cq), removed.registers.registers());
        }
        self.discard_delayed(cq);
        Ok(Done { body: Vec::new(), object: Some(("destroy", "cq", cq)) })
    }

    fn req_notify_cq(&mut self, cmd: Cmd<'_>) -> CommandResult {
        let req: ReqNotifyCqReq = read_body(cmd.fixed)?;
        let solicited_only = match req.solicited_only.get() {
            0 => false,
            1 => true,
            other => return Err(refuse(Status::InvalidParam, format!("solicited_only {other}: 0 or 1"))),
        };
        let cq = self
            .cqs
            .get_mut(&req.cq.get())
            .ok_or_else(|| refuse(Status::InvalidHandle, format!("no CQ {}", req.cq.get())))?;
        cq.armed = Some(solicited_only);
        Ok(Done::empty())
    }

    fn reg_mr(&mut self, dma: &dyn Dma, cmd: Cmd<'_>) -> CommandResult {
        let (n, fail) = self.engine.injector.reg_mr();
        if fail {
            self.out.emit(HcaEvent::Injected { what: "fail_reg_mr", n, detail: format!("tag {}", cmd.tag) });
            return Err(refuse(Status::Injected, format!("fail_reg_mr={n}")));
        }
        let req: RegMrReq = read_body(cmd.fixed)?;
        let (access, addr, length) = (req.access.get(), req.addr.get(), req.length.get());
        let first_page_offset = u64::from(req.first_page_offset.get());
        if access & !ACCESS_ALL != 0 {
            return Err(refuse(Status::InvalidParam, format!("access {access:#x} has unknown bits")));
        }
        if access & ACCESS_REMOTE_WRITE != 0 && access & ACCESS_LOCAL_WRITE == 0 {
            return Err(refuse(Status::InvalidParam, "REMOTE_WRITE needs LOCAL_WRITE (ibverbs rule)"));
        }
        if length == 0 || addr.checked_add(length).is_none() {
            return Err(refuse(Status::InvalidParam, format!("MR [{addr:#x}, +{length:#x}) is empty or wraps")));
        }
        if first_page_offset >= PAGE_SIZE {
            return Err(refuse(Status::InvalidParam, format!("first_page_offset {first_page_offset:#x} >= page size")));
        }
        let needed = first_page_offset.checked_add(length).map(|end| end.div_ceil(PAGE_SIZE));
        if needed != Some(u64::from(req.page_count.get())) {
            return Err(refuse(
                Status::InvalidParam,
                format!(
                    "{} pages listed, offset {first_page_offset:#x} + length {length:#x} needs {needed:?}",
                    req.page_count
                ),
            ));
        }
        let pages = page_list(cmd.pages, req.page_count.get())?;
        let pd = req.pd.get();
        if !self.pds.contains(pd) {
            return Err(refuse(Status::InvalidHandle, format!("no PD {pd}")));
        }
        let key = self.mrs.allocate_key().ok_or_else(|| refuse(Status::NoResources, "MR table full"))?;
        let registers = match self.map_pages(dma, cmd, Owner::Mr(key), &pages, access & ACCESS_LOCAL_WRITE != 0) {
            Ok(registers) => registers,
            Err(refusal) => {
                self.mrs.forget_key();
                return Err(refusal);
            }
        };
        self.mrs.insert(Mr { key, pd, access, addr, length, first_page_offset, registers });
        let resp = RegMrResp { lkey: key.into(), rkey: key.into() };
        Ok(Done { body: resp.as_bytes().to_vec(), object: Some(("create", "mr", key)) })
    }

    fn dereg_mr(&mut self, cmd: Cmd<'_>) -> CommandResult {
        let key = read_body::<HandleReq>(cmd.fixed)?.handle.get();
        let mr =
            self.mrs.remove(key).ok_or_else(|| refuse(Status::InvalidHandle, format!("no MR with key {key:#x}")))?;
        self.unmap(Owner::Mr(key), mr.registers.registers());
        Ok(Done { body: Vec::new(), object: Some(("destroy", "mr", key)) })
    }

    fn create_qp(&mut self, dma: &dyn Dma, cmd: Cmd<'_>) -> CommandResult {
        let req: CreateQpReq = read_body(cmd.fixed)?;
        if req.qp_type.get() != QP_TYPE_RC {
            return Err(refuse(Status::InvalidParam, format!("qp_type {}: only RC ({QP_TYPE_RC})", req.qp_type)));
        }
        let (sq_entries, rq_entries) = (req.sq_entries.get(), req.rq_entries.get());
        let (sq_pages_n, rq_pages_n) = (req.sq_page_count.get(), req.rq_page_count.get());
        ring_geometry("SQ", sq_entries, self.config.max_qp_wr, WQE_SIZE, sq_pages_n)?;
        ring_geometry("RQ", rq_entries, self.config.max_qp_wr, WQE_SIZE, rq_pages_n)?;
        let total_pages =
            sq_pages_n.checked_add(rq_pages_n).ok_or_else(|| refuse(Status::InvalidParam, "page counts"))?;
        let pages = page_list(cmd.pages, total_pages)?;
        let (sq_pages, rq_pages) = pages.split_at(sq_pages_n as usize);
        let (pd, send_cq, recv_cq) = (req.pd.get(), req.send_cq.get(), req.recv_cq.get());
        if !self.pds.contains(pd) {
            return Err(refuse(Status::InvalidHandle, format!("no PD {pd}")));
        }
        for cq in [send_cq, recv_cq] {
            if !self.cqs.contains_key(&cq) {
                return Err(refuse(Status::InvalidHandle, format!("no CQ {cq}")));
            }
        }
        let qpn = self.qp_handles.allocate().ok_or_else(|| refuse(Status::NoResources, "QP table full"))?;
        let sq = match self.map_ring(dma, cmd, Owner::SendQueue(qpn), sq_pages, false) {
            Ok(sq) => sq,
            Err(refusal) => {
                self.qp_handles.release();
                return Err(refusal);
            }
        };
        let rq = match self.map_ring(dma, cmd, Owner::RecvQueue(qpn), rq_pages, false) {
            Ok(rq) => rq,
            Err(refusal) => {
                self.unmap(Owner::SendQueue(qpn), sq.registers());
                self.qp_handles.release();
                return Err(refusal);
            }
        };
        self.qps.insert(
            qpn,
            Qp {
                qpn,
                pd,
                send_cq,
                recv_cq,
                sq: WorkQueue::new(sq_entries, sq),
                rq: WorkQueue::new(rq_entries, rq),
                state: QpState::Reset,
                dest_qpn: None,
                access: 0,
            },
        );
        Ok(handle_done(qpn, "qp"))
    }

    fn modify_qp(&mut self, dma: &dyn Dma, cmd: Cmd<'_>) -> CommandResult {
        let req: ModifyQpReq = read_body(cmd.fixed)?;
        let (qpn, mask) = (req.qpn.get(), req.attr_mask.get());
        let known = QP_ATTR_STATE | QP_ATTR_ACCESS_FLAGS | QP_ATTR_DEST_QPN;
        if mask & !known != 0 {
            return Err(refuse(Status::InvalidParam, format!("attr_mask {mask:#x} has unknown bits")));
        }
        let from = self.qps.get(&qpn).ok_or_else(|| refuse(Status::InvalidHandle, format!("no QP {qpn}")))?.state;
        let to = if mask & QP_ATTR_STATE != 0 {
            QpState::from_u32(req.state.get())
                .ok_or_else(|| refuse(Status::InvalidParam, format!("state {} is no QP state", req.state)))?
        } else {
            from
        };
        if mask & QP_ATTR_ACCESS_FLAGS != 0 && req.access.get() & !ACCESS_ALL != 0 {
            return Err(refuse(Status::InvalidParam, format!("access {:#x} has unknown bits", req.access)));
        }
        if mask & QP_ATTR_STATE != 0 {
            check_transition(from, to, mask).map_err(|e| match e {
                TransitionError::NotAllowed => {
                    refuse(Status::InvalidState, format!("QP {qpn}: {} -> {} not allowed", from.name(), to.name()))
                }
                TransitionError::MissingAttribute(attr) => {
                    refuse(Status::InvalidParam, format!("QP {qpn}: {} -> {} needs {attr}", from.name(), to.name()))
                }
            })?;
        }
        if let Some(qp) = self.qps.get_mut(&qpn) {
            if mask & QP_ATTR_ACCESS_FLAGS != 0 {
                qp.access = req.access.get();
            }
            if mask & QP_ATTR_DEST_QPN != 0 {
                qp.dest_qpn = Some(req.dest_qpn.get());
            }
        }
        if mask & QP_ATTR_STATE != 0 {
            match to {
                QpState::Err => {
                    self.set_qp_state(qpn, QpState::Err, "modify_qp".to_string());
                    self.flush_qp(dma, qpn);
                }
                QpState::Reset => {
                    self.end_hold(qpn, HoldEnd::Reset);
                    self.set_qp_state(qpn, QpState::Reset, "modify_qp".to_string());
                    if let Some(qp) = self.qps.get_mut(&qpn) {
                        // ibverbs: RESET discards outstanding work without completions and restarts the rings.
                        qp.sq.producer = 0;
                        qp.sq.consumer = 0;
                        qp.rq.producer = 0;
                        qp.rq.consumer = 0;
                    }
                }
                _ => {
                    self.set_qp_state(qpn, to, "modify_qp".to_string());
                    if to == QpState::Rts {
                        // Send WQEs rung before RTS wait for it.
                        self.process_send_queue(dma, qpn);
                    }
                }
            }
        }
        Ok(Done::empty())
    }

    fn destroy_qp(&mut self, cmd: Cmd<'_>) -> CommandResult {
        let qpn = read_body::<HandleReq>(cmd.fixed)?.handle.get();
        let qp = self.qps.remove(&qpn).ok_or_else(|| refuse(Status::InvalidHandle, format!("no QP {qpn}")))?;
        self.end_hold(qpn, HoldEnd::Destroyed);
        self.qp_handles.release();
        self.unmap(Owner::SendQueue(qpn), qp.sq.registers.registers());
        self.unmap(Owner::RecvQueue(qpn), qp.rq.registers.registers());
        Ok(Done { body: Vec::new(), object: Some(("destroy", "qp", qpn)) })
    }

    /// A ring mapping: counted by the fail_ring_map knob, then mapped like any pages.
    fn map_ring(
        &mut self,
        dma: &dyn Dma,
        cmd: Cmd<'_>,
        owner: Owner,
        pages: &[u64],
        device_writes: bool,
    ) -> Result<MappedPages, Refusal> {
        let (n, fail) = self.engine.injector.ring_map();
        if fail {
            let detail = format!("{} {} ({} pages)", owner.kind(), owner.handle(), pages.len());
            self.out.emit(HcaEvent::Injected { what: "fail_ring_map", n, detail });
            return Err(refuse(Status::Injected, format!("fail_ring_map={n}")));
        }
        self.map_pages(dma, cmd, owner, pages, device_writes)
    }

    /// Takes one register per page, after the contiguous-run cap and the optional probe. `device_writes`: the device
    /// may write these pages (a CQ ring, an MR with local write), so their mapping is asked about as a write (a
    /// write-only mapping asked as a read is a fault the vIOMMU records for the guest).
    fn map_pages(
        &mut self,
        dma: &dyn Dma,
        cmd: Cmd<'_>,
        owner: Owner,
        pages: &[u64],
        device_writes: bool,
    ) -> Result<MappedPages, Refusal> {
        if let Some((run, cap)) = self.engine.injector.contiguous_violation(pages) {
            let refused = self.engine.injector.config.contiguous_policy == ContiguousPolicy::Refuse;
            let detail = format!(
                "{} {}: {run} contiguous pages, cap {cap}, {}",
                owner.kind(),
                owner.handle(),
                if refused { "refused" } else { "split" }
            );
            self.out.emit(HcaEvent::Injected { what: "max_contiguous_pages", n: u64::from(run), detail });
            if refused {
                return Err(refuse(Status::Injected, format!("contiguous run of {run} pages over cap {cap}")));
            }
        }
        let wanted = u32::try_from(pages.len()).unwrap_or(u32::MAX);
        let registers = match self.engine.pool.take(pages) {
            Ok(registers) => {
                // Where each page leads now: what an invalidation that covers it later is checked against.
                for (r, &iova) in registers.iter().zip(pages) {
                    self.engine.pool.record_first(*r, dma.translation(iova & !(PAGE_SIZE - 1), device_writes));
                }
                MappedPages::new(&self.engine.pool, registers)
            }
            Err(ex) => {
                self.out.emit(HcaEvent::MapRegistersExhausted {
                    owner: owner.kind(),
                    opcode: cmd.opcode.name().to_string(),
                    tag: cmd.tag,
                    wanted: ex.wanted,
                    free: ex.free,
                    in_use: self.engine.pool.in_use(),
                    total: self.engine.pool.total(),
                });
                self.out.push_async(EventKind::MapRegistersExhausted, owner.handle(), FaultCause::None, wanted, 0);
                return Err(refuse(
                    Status::MapRegistersExhausted,
                    format!("{} needs {} map registers, {} free", owner.kind(), ex.wanted, ex.free),
                ));
            }
        };
        if self.config.probe_pages {
            let ctx = DmaContext {
                purpose: "page_probe",
                opcode: Some(cmd.opcode.name()),
                tag: Some(cmd.tag),
                ..Default::default()
            };
            for page in 0..registers.len() as u64 {
                let mut byte = [0u8; 1];
                let offset = page * PAGE_SIZE;
                if let Err(fault) = self.engine.read(dma, &registers, offset, &mut byte, &ctx, &mut self.out) {
                    self.engine.pool.release(registers.registers());
                    return Err(refuse(
                        Status::IommuFault,
                        format!("{} page {page} iova {:#x?}: {}", owner.kind(), fault.iova, fault.cause.name()),
                    ));
                }
            }
        }
        self.out.emit(HcaEvent::Map {
            owner: owner.kind(),
            handle: owner.handle(),
            registers: wanted,
            first_iova: pages.first().copied().unwrap_or(0),
            in_use: self.engine.pool.in_use(),
            free: self.engine.pool.free_count(),
            total: self.engine.pool.total(),
        });
        Ok(registers)
    }

    fn unmap(&mut self, owner: Owner, registers: &[RegisterRef]) {
        let released = self.engine.pool.release(registers);
        self.out.emit(HcaEvent::Unmap {
            owner: owner.kind(),
            handle: owner.handle(),
            registers: released,
            in_use: self.engine.pool.in_use(),
            free: self.engine.pool.free_count(),
            total: self.engine.pool.total(),
        });
    }
}

fn handle_done(handle: u32, object: &'static str) -> Done {
    let resp = HandleResp { handle: handle.into(), reserved: 0.into() };
    Done { body: resp.as_bytes().to_vec(), object: Some(("create", object, handle)) }
}
