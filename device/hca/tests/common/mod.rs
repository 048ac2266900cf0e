//! Test rig for the HCA without QEMU: a fake IOMMU over host memory (IOVA pages → host pages, with permissions and
//! unmapping), an event recorder, and a driver-side helper that builds commands, rings and WQEs like a guest would.
#![allow(dead_code)]

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use vhca_hca::{CopyEnd, Dma, DmaError, EventSink, Hca, HcaConfig, HcaEvent};
use vhca_proto::status::WcStatus;
use vhca_proto::*;
use zerocopy::{FromBytes, IntoBytes};

pub const PAGE: u64 = PAGE_SIZE;

struct Page {
    data: Box<[u8]>,
    read: bool,
    write: bool,
}

/// Guest memory behind a fake IOMMU: only mapped IOVA pages are reachable, each with read/write permission.
#[derive(Default)]
pub struct FakeIommu {
    pages: RefCell<BTreeMap<u64, Page>>,
    /// Largest single access the device made (to see bursts split).
    pub largest_access: Cell<usize>,
    pub accesses: Cell<u64>,
    /// Bytes the device moved through `read`/`write`, and through `copy` (memory to memory).
    pub bytes_read_or_written: Cell<u64>,
    pub bytes_copied: Cell<u64>,
}

impl FakeIommu {
    pub fn map(&self, iova: u64, pages: u64, read: bool, write: bool) {
        let mut map = self.pages.borrow_mut();
        for p in 0..pages {
            map.insert(iova + p * PAGE, Page { data: vec![0u8; PAGE as usize].into(), read, write });
        }
    }

    pub fn unmap(&self, iova: u64, pages: u64) {
        let mut map = self.pages.borrow_mut();
        for p in 0..pages {
            map.remove(&(iova + p * PAGE));
        }
    }

    pub fn set_permissions(&self, iova: u64, read: bool, write: bool) {
        let mut map = self.pages.borrow_mut();
        let page = map.get_mut(&(iova & !(PAGE - 1))).expect("page mapped");
        page.read = read;
        page.write = write;
    }

    /// CPU access, as the guest driver writes its own memory: no permission checks.
    pub fn poke(&self, iova: u64, bytes: &[u8]) {
        self.access(iova, bytes.len(), None, |page, off, n, done| {
            page.data[off..off + n].copy_from_slice(&bytes[done..done + n]);
        })
        .expect("poke into mapped memory");
    }

    pub fn peek(&self, iova: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.access(iova, len, None, |page, off, n, done| {
            out[done..done + n].copy_from_slice(&page.data[off..off + n]);
        })
        .expect("peek into mapped memory");
        out
    }

    fn access(
        &self,
        iova: u64,
        len: usize,
        need_write: Option<bool>,
        mut f: impl FnMut(&mut Page, usize, usize, usize),
    ) -> Result<(), DmaError> {
        let mut map = self.pages.borrow_mut();
        let mut done = 0usize;
        while done < len {
            let addr = iova + done as u64;
            let base = addr & !(PAGE - 1);
            let off = (addr - base) as usize;
            let n = (PAGE as usize - off).min(len - done);
            let page = map.get_mut(&base).ok_or(DmaError { iova: addr, cause: FaultCause::IommuUnmapped })?;
            match need_write {
                Some(true) if !page.write => return Err(DmaError { iova: addr, cause: FaultCause::IommuPermission }),
                Some(false) if !page.read => return Err(DmaError { iova: addr, cause: FaultCause::IommuPermission }),
                _ => {}
            }
            f(page, off, n, done);
            done += n;
        }
        Ok(())
    }

    fn note(&self, len: usize) {
        self.bytes_read_or_written.set(self.bytes_read_or_written.get() + len as u64);
        self.accesses.set(self.accesses.get() + 1);
        self.largest_access.set(self.largest_access.get().max(len));
    }
}

impl Dma for FakeIommu {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.note(buf.len());
        self.access(iova, buf.len(), Some(false), |page, off, n, done| {
            buf[done..done + n].copy_from_slice(&page.data[off..off + n]);
        })
    }

    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaError> {
        self.note(buf.len());
        self.access(iova, buf.len(), Some(true), |page, off, n, done| {
            page.data[off..off + n].copy_from_slice(&buf[done..done + n]);
        })
    }

    /// Checks both ends before moving a byte, as the device's real `QueueDma::copy` does; counted apart from
    /// `read`/`write` so tests see the payload go memory to memory.
    fn copy(&self, src: u64, dst: u64, len: usize) -> Result<(), (CopyEnd, DmaError)> {
        self.bytes_copied.set(self.bytes_copied.get() + len as u64);
        self.accesses.set(self.accesses.get() + 1);
        self.largest_access.set(self.largest_access.get().max(len));
        let mut data = vec![0u8; len];
        self.access(src, len, Some(false), |page, off, n, done| {
            data[done..done + n].copy_from_slice(&page.data[off..off + n])
        })
        .map_err(|e| (CopyEnd::Source, e))?;
        self.access(dst, len, Some(true), |_, _, _, _| {}).map_err(|e| (CopyEnd::Destination, e))?;
        self.access(dst, len, Some(true), |page, off, n, done| {
            page.data[off..off + n].copy_from_slice(&data[done..done + n])
        })
        .map_err(|e| (CopyEnd::Destination, e))
    }
}

/// The HCA's events, and where each request began (the number of events before it).
#[derive(Default)]
pub struct Recorder(pub Mutex<Vec<HcaEvent>>, pub Mutex<Vec<usize>>);

impl EventSink for Recorder {
    fn emit(&self, event: HcaEvent) {
        self.0.lock().unwrap().push(event);
    }

    fn request_started(&self) {
        let before = self.0.lock().unwrap().len();
        self.1.lock().unwrap().push(before);
    }
}

pub struct Rig {
    pub hca: Hca,
    pub mem: FakeIommu,
    pub events: Arc<Recorder>,
    next_iova: u64,
    next_tag: u32,
}

pub struct CqInfo {
    pub handle: u32,
    pub entries: u32,
    pub iova: u64,
    pub consumer: u32,
}

pub struct QpInfo {
    pub qpn: u32,
    pub sq_iova: u64,
    pub rq_iova: u64,
    pub sq_entries: u32,
    pub rq_entries: u32,
    pub sq_posted: u32,
    pub rq_posted: u32,
}

#[derive(Debug, Clone, Copy)]
pub struct MrInfo {
    pub key: u32,
    /// The MR address SGEs use (deliberately not the IOVA).
    pub addr: u64,
    pub len: u64,
    pub iova: u64,
}

/// A parsed CQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: u32,
    pub qpn: u32,
    pub byte_len: u32,
    pub vendor_err: u32,
}

impl Rig {
    pub fn new(config: HcaConfig) -> Rig {
        let events = Arc::new(Recorder::default());
        Rig {
            hca: Hca::new(config, events.clone()),
            mem: FakeIommu::default(),
            events,
            next_iova: 0x10_0000,
            next_tag: 1,
        }
    }

    /// A rig whose events go nowhere (benchmarks: no log growing under the measurement).
    pub fn quiet(config: HcaConfig) -> Rig {
        let hca = Hca::new(config, Arc::new(vhca_hca::NullSink));
        Rig { hca, mem: FakeIommu::default(), events: Arc::default(), next_iova: 0x10_0000, next_tag: 1 }
    }

    pub fn with_registers(n: u32) -> Rig {
        Rig::new(HcaConfig { map_registers: n, ..Default::default() })
    }

    /// Maps `pages` fresh pages at the next IOVA, leaving an unmapped guard page after them (so separate
    /// allocations are never IOVA-contiguous).
    pub fn alloc(&mut self, pages: u64) -> u64 {
        let iova = self.next_iova;
        self.mem.map(iova, pages, true, true);
        self.next_iova += (pages + 1) * PAGE;
        iova
    }

    pub fn events(&self) -> Vec<HcaEvent> {
        self.events.0.lock().unwrap().clone()
    }

    pub fn clear_events(&self) {
        self.events.0.lock().unwrap().clear();
    }

    /// Events serialised as the transport would log them, for matching on kind and fields.
    pub fn event_json(&self) -> Vec<serde_json::Value> {
        self.events().iter().map(|e| serde_json::to_value(e).unwrap()).collect()
    }

    pub fn events_of(&self, kind: &str) -> Vec<serde_json::Value> {
        self.event_json().into_iter().filter(|e| e["kind"] == kind).collect()
    }

    /// Sends a raw request and returns the status and response body.
    pub fn raw(&mut self, request: &[u8]) -> (Status, Vec<u8>) {
        let resp = self.hca.execute(&self.mem, request);
        let (header, body) = ResponseHeader::read_from_prefix(&resp).expect("response header");
        let status = Status::from_u32(header.status.get()).expect("known status");
        assert_eq!(header.body_len.get() as usize, body.len());
        (status, body.to_vec())
    }

    pub fn request(opcode: Opcode, tag: u32, body: &[u8], pages: &[u64]) -> Vec<u8> {
        let mut req = vec![0; request_len(body.len(), pages.len()).expect("request size")];
        encode_request(&mut req, opcode, tag, body, pages).expect("request encodes");
        req
    }

    pub fn cmd(&mut self, opcode: Opcode, body: &[u8], pages: &[u64]) -> (Status, Vec<u8>) {
        let tag = self.next_tag;
        self.next_tag += 1;
        let req = Rig::request(opcode, tag, body, pages);
        let (status, resp) = self.raw(&req);
        let logged = self.events_of("command");
        if let Some(last) = logged.last() {
            assert_eq!(last["opcode"], opcode.name());
            assert_eq!(last["tag"], tag);
            assert_eq!(last["status"], status.name());
        }
        (status, resp)
    }

    pub fn handle_of(resp: &[u8]) -> u32 {
        HandleResp::read_from_bytes(resp).expect("handle response").handle.get()
    }

    pub fn query_device(&mut self) -> QueryDeviceResp {
        let (status, body) = self.cmd(Opcode::QueryDevice, &[], &[]);
        assert_eq!(status, Status::Ok);
        QueryDeviceResp::read_from_bytes(&body).unwrap()
    }

    pub fn free_registers(&mut self) -> u32 {
        self.query_device().map_registers_free.get()
    }

    pub fn alloc_pd(&mut self) -> u32 {
        let (status, body) = self.cmd(Opcode::AllocPd, &[], &[]);
        assert_eq!(status, Status::Ok);
        Rig::handle_of(&body)
    }

    pub fn try_create_cq(&mut self, entries: u32) -> (Status, Option<CqInfo>) {
        let pages = ring_pages(entries, CQE_SIZE);
        let iova = self.alloc(pages);
        let list: Vec<u64> = (0..pages).map(|p| iova + p * PAGE).collect();
        let req = CreateCqReq { entries: entries.into(), page_count: (pages as u32).into() };
        let (status, body) = self.cmd(Opcode::CreateCq, req.as_bytes(), &list);
        let info = (status == Status::Ok).then(|| CqInfo { handle: Rig::handle_of(&body), entries, iova, consumer: 0 });
        (status, info)
    }

    pub fn create_cq(&mut self, entries: u32) -> CqInfo {
        let (status, cq) = self.try_create_cq(entries);
        assert_eq!(status, Status::Ok);
        cq.unwrap()
    }

    /// Registers `len` bytes starting `offset` into freshly mapped pages, at MR address 0x7000_0000_0000 ^ IOVA.
    pub fn try_reg_mr_at(&mut self, pd: u32, access: u32, len: u64, offset: u64) -> (Status, Option<MrInfo>) {
        let pages = (offset + len).div_ceil(PAGE);
        let iova = self.alloc(pages);
        let list: Vec<u64> = (0..pages).map(|p| iova + p * PAGE).collect();
        self.reg_mr_pages(pd, access, len, offset, &list)
    }

    pub fn reg_mr_pages(
        &mut self,
        pd: u32,
        access: u32,
        len: u64,
        offset: u64,
        list: &[u64],
    ) -> (Status, Option<MrInfo>) {
        let first = list.first().copied().unwrap_or(0);
        // Not the IOVA, so a device mixing the two up is caught; XOR keeps top-of-space IOVAs from overflowing.
        let addr = (0x7000_0000_0000 ^ first) + offset;
        let req = RegMrReq {
            pd: pd.into(),
            access: access.into(),
            addr: addr.into(),
            length: len.into(),
            first_page_offset: (offset as u32).into(),
            page_count: (list.len() as u32).into(),
        };
        let (status, body) = self.cmd(Opcode::RegMr, req.as_bytes(), list);
        let info = (status == Status::Ok).then(|| {
            let resp = RegMrResp::read_from_bytes(&body).unwrap();
            assert_eq!(resp.lkey, resp.rkey);
            MrInfo { key: resp.lkey.get(), addr, len, iova: first + offset }
        });
        (status, info)
    }

    pub fn reg_mr(&mut self, pd: u32, access: u32, len: u64) -> MrInfo {
        let (status, mr) = self.try_reg_mr_at(pd, access, len, 0);
        assert_eq!(status, Status::Ok);
        mr.unwrap()
    }

    pub fn dereg_mr(&mut self, key: u32) -> Status {
        let req = HandleReq { handle: key.into(), reserved: 0.into() };
        self.cmd(Opcode::DeregMr, req.as_bytes(), &[]).0
    }

    pub fn try_create_qp(
        &mut self,
        pd: u32,
        scq: u32,
        rcq: u32,
        sq_entries: u32,
        rq_entries: u32,
    ) -> (Status, Option<QpInfo>) {
        let sq_pages = ring_pages(sq_entries, WQE_SIZE);
        let rq_pages = ring_pages(rq_entries, WQE_SIZE);
        let sq_iova = self.alloc(sq_pages);
        let rq_iova = self.alloc(rq_pages);
        let mut list: Vec<u64> = (0..sq_pages).map(|p| sq_iova + p * PAGE).collect();
        list.extend((0..rq_pages).map(|p| rq_iova + p * PAGE));
        let req = CreateQpReq {
            pd: pd.into(),
            qp_type: QP_TYPE_RC.into(),
            send_cq: scq.into(),
            recv_cq: rcq.into(),
            sq_entries: sq_entries.into(),
            rq_entries: rq_entries.into(),
            sq_page_count: (sq_pages as u32).into(),
            rq_page_count: (rq_pages as u32).into(),
        };
        let (status, body) = self.cmd(Opcode::CreateQp, req.as_bytes(), &list);
        let info = (status == Status::Ok).then(|| QpInfo {
            qpn: Rig::handle_of(&body),
            sq_iova,
            rq_iova,
            sq_entries,
            rq_entries,
            sq_posted: 0,
            rq_posted: 0,
        });
        (status, info)
    }

    pub fn create_qp(&mut self, pd: u32, scq: u32, rcq: u32) -> QpInfo {
        let (status, qp) = self.try_create_qp(pd, scq, rcq, 16, 16);
        assert_eq!(status, Status::Ok);
        qp.unwrap()
    }

    pub fn modify_qp(&mut self, qpn: u32, mask: u32, state: QpState, dest_qpn: u32, access: u32) -> Status {
        let req = ModifyQpReq {
            qpn: qpn.into(),
            attr_mask: mask.into(),
            state: (state as u32).into(),
            dest_qpn: dest_qpn.into(),
            access: access.into(),
            reserved: 0.into(),
        };
        self.cmd(Opcode::ModifyQp, req.as_bytes(), &[]).0
    }

    /// RESET → INIT → RTR → RTS with `dest` as peer, granting `access`.
    pub fn bring_up(&mut self, qpn: u32, dest: u32, access: u32) {
        assert_eq!(self.modify_qp(qpn, QP_ATTR_STATE | QP_ATTR_ACCESS_FLAGS, QpState::Init, 0, access), Status::Ok);
        assert_eq!(self.modify_qp(qpn, QP_ATTR_STATE | QP_ATTR_DEST_QPN, QpState::Rtr, dest, 0), Status::Ok);
        assert_eq!(self.modify_qp(qpn, QP_ATTR_STATE, QpState::Rts, 0, 0), Status::Ok);
        assert_eq!(self.hca.qp_state(qpn), Some(QpState::Rts));
    }

    pub fn doorbell(&mut self, kind: DoorbellKind, handle: u32, index: u32, flags: u32) {
        let db =
            Doorbell { kind: (kind as u32).into(), handle: handle.into(), index: index.into(), flags: flags.into() };
        self.hca.doorbell(&self.mem, db.as_bytes());
    }

    /// Writes a WQE into the SQ ring (as the driver) without ringing the doorbell.
    pub fn write_send_wqe(&mut self, qp: &mut QpInfo, wqe: &Wqe) {
        let slot = qp.sq_posted % qp.sq_entries;
        self.mem.poke(qp.sq_iova + u64::from(slot) * WQE_SIZE as u64, wqe.as_bytes());
        qp.sq_posted += 1;
    }

    pub fn post_send(&mut self, qp: &mut QpInfo, wqe: &Wqe) {
        self.write_send_wqe(qp, wqe);
        self.doorbell(DoorbellKind::SendQueue, qp.qpn, qp.sq_posted, 0);
    }

    pub fn post_recv(&mut self, qp: &mut QpInfo, wr_id: u64, sges: &[Sge]) {
        let slot = qp.rq_posted % qp.rq_entries;
        let wqe = wqe(wr_id, WrOpcode::Recv, 0, 0, 0, sges);
        self.mem.poke(qp.rq_iova + u64::from(slot) * WQE_SIZE as u64, wqe.as_bytes());
        qp.rq_posted += 1;
        self.doorbell(DoorbellKind::RecvQueue, qp.qpn, qp.rq_posted, 0);
    }

    /// Reads the CQEs the device completed since the last poll (owner word says which are new).
    pub fn poll(&mut self, cq: &mut CqInfo) -> Vec<Completion> {
        let mut out = Vec::new();
        loop {
            let slot = cq.consumer % cq.entries;
            let raw = self.mem.peek(cq.iova + u64::from(slot) * CQE_SIZE as u64, CQE_SIZE);
            let cqe = Cqe::read_from_bytes(&raw).unwrap();
            if cqe.owner.get() != cqe_owner(cq.consumer, cq.entries) {
                return out;
            }
            out.push(Completion {
                wr_id: cqe.wr_id.get(),
                status: WcStatus::from_u32(cqe.status.get()).expect("known wc status"),
                opcode: cqe.opcode.get(),
                qpn: cqe.qpn.get(),
                byte_len: cqe.byte_len.get(),
                vendor_err: cqe.vendor_err.get(),
            });
            cq.consumer += 1;
        }
    }

    pub fn async_events(&mut self) -> Vec<Event> {
        std::iter::from_fn(|| self.hca.pop_async_event()).collect()
    }
}

pub fn sge(mr: &MrInfo, offset: u64, len: u32) -> Sge {
    Sge { addr: (mr.addr + offset).into(), length: len.into(), lkey: mr.key.into() }
}

pub fn wqe(wr_id: u64, opcode: WrOpcode, flags: u32, remote_addr: u64, rkey: u32, sges: &[Sge]) -> Wqe {
    let mut w = Wqe {
        wr_id: wr_id.into(),
        opcode: (opcode as u32).into(),
        flags: flags.into(),
        remote_addr: remote_addr.into(),
        rkey: rkey.into(),
        num_sge: (sges.len() as u32).into(),
        sge: [Sge::default(); MAX_SGE],
    };
    w.sge[..sges.len()].copy_from_slice(sges);
    w
}

/// A deterministic byte pattern, different per seed, so misplaced bytes show.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8)).collect()
}

/// Two QPs on one PD, each with its own CQ, connected to each other and in RTS.
pub struct Pair {
    pub pd: u32,
    pub cq_a: CqInfo,
    pub cq_b: CqInfo,
    pub a: QpInfo,
    pub b: QpInfo,
}

pub fn pair(rig: &mut Rig, access: u32) -> Pair {
    let pd = rig.alloc_pd();
    let cq_a = rig.create_cq(64);
    let cq_b = rig.create_cq(64);
    let a = rig.create_qp(pd, cq_a.handle, cq_a.handle);
    let b = rig.create_qp(pd, cq_b.handle, cq_b.handle);
    rig.bring_up(a.qpn, b.qpn, access);
    rig.bring_up(b.qpn, a.qpn, access);
    Pair { pd, cq_a, cq_b, a, b }
}
