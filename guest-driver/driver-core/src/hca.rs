//! The HCA driver: opens the DMA adapter, then creates and destroys PDs, CQs, QPs and MRs by command, posts work
//! requests into rings in driver memory and polls completions the device writes there.

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::sync::Arc;
use alloc::vec::Vec;

use vhca_ntapi::*;
use vhca_proto::{
    ring_pages, Cqe, CreateCqReq, CreateQpReq, Doorbell, DoorbellKind, Event, HandleReq, HandleResp, ModifyQpReq,
    Opcode, QpState, QueryDeviceResp, RegMrReq, RegMrResp, Wqe, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, CQE_SIZE,
    QP_ATTR_ACCESS_FLAGS, QP_ATTR_DEST_QPN, QP_ATTR_STATE, QP_TYPE_RC, WQE_SIZE,
};
use zerocopy::IntoBytes;

use crate::command_codec::{body, decode, encode, response_capacity};
use crate::command_transport::CommandTransport;
use crate::cq_reader::CqReader;
use crate::dma_delivery::Delivery;
use crate::error::DriverError;
use crate::ring::{Ring, RingMemory};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HcaConfig {
    /// Where CQ and work-queue rings come from.
    pub ring_memory: RingMemory,
    /// Largest transfer the adapter is described with (sets the map registers IoGetDmaAdapter asks for).
    pub max_transfer: u32,
    /// When one contiguous ring allocation fails, retry with smaller pieces (the seed's algorithm). Off: the
    /// first failure is the caller's.
    pub ring_fallback: bool,
}

impl Default for HcaConfig {
    fn default() -> Self {
        HcaConfig { ring_memory: RingMemory::CommonBuffer, max_transfer: 1 << 20, ring_fallback: true }
    }
}

/// The buffer an MR covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MrSource {
    /// Non-paged kernel memory: MDL built for non-paged pool.
    Kernel { va: PVOID, length: u32 },
    /// A user process's buffer: MDL probed and locked (unless `skip_lock`, the bug the paged-memory rule catches).
    User { va: PVOID, length: u32, skip_lock: bool },
    /// A common buffer the caller allocated: the device already has its logical address, no mapping needed.
    Common { va: PVOID, logical: PHYSICAL_ADDRESS, length: u32 },
}

/// How a Kernel or User MR is made visible to the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MrMapping {
    /// GetScatterGatherList, held for the MR's life: double-buffered under DMA checking.
    ScatterGather,
    /// IoMapCommonBuffer (the seed's proposal): the device sees the real pages.
    IoMapCommonBuffer,
}

/// What a reset does with the CQEs an old CQ left in the ring it keeps (`Hca::reset_cq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingReuse {
    /// Every slot zeroed before the device gets the ring back: zeroed memory is never a CQE.
    Cleared,
    /// The ring as the old CQ left it (the bug: its CQEs read as the new CQ's).
    AsLeft,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisteredMr {
    pub lkey: u32,
    pub rkey: u32,
    /// The MR address SGEs use: the buffer's virtual address.
    pub addr: u64,
    pub length: u32,
}

#[derive(Debug, Clone, Copy)]
enum MrDeviceView {
    Sg(PSCATTER_GATHER_LIST, bool),
    CommonMap(HANDLE),
    None,
}

struct Mr {
    mdl: Option<PMDL>,
    locked: bool,
    view: MrDeviceView,
}

struct Cq {
    ring: Ring,
    reader: CqReader,
}

struct Qp {
    sq: Ring,
    rq: Ring,
    sq_entries: u32,
    rq_entries: u32,
    sq_head: u32,
    rq_head: u32,
}

/// One HCA. Methods take `&mut self`: the caller serialises the control path (with a `ClMutex`, as the seed's
/// upper layer does), which is what puts a FAST_MUTEX around create_cq.
pub struct Hca<K: NtKernel, C: CommandTransport> {
    kernel: Arc<K>,
    transport: C,
    device: PDEVICE_OBJECT,
    adapter: PDMA_ADAPTER,
    map_registers: u32,
    config: HcaConfig,
    attributes: QueryDeviceResp,
    next_tag: u32,
    cqs: BTreeMap<u32, Cq>,
    qps: BTreeMap<u32, Qp>,
    mrs: BTreeMap<u32, Mr>,
}

impl<K: NtKernel + 'static, C: CommandTransport> Hca<K, C> {
    /// Gets the DMA adapter (PASSIVE_LEVEL) and asks the device what it is.
    pub fn open(kernel: Arc<K>, transport: C, device: PDEVICE_OBJECT, config: HcaConfig) -> Result<Self, DriverError> {
        let description = DEVICE_DESCRIPTION::bus_master_64(config.max_transfer);
        let mut map_registers = 0;
        let adapter = kernel.IoGetDmaAdapter(device, &description, &mut map_registers);
        if adapter.is_null() {
            return Err(DriverError::Kernel { routine: "IoGetDmaAdapter", status: STATUS_INSUFFICIENT_RESOURCES });
        }
        let mut hca = Hca {
            kernel,
            transport,
            device,
            adapter,
            map_registers,
            config,
            attributes: QueryDeviceResp::default(),
            next_tag: 1,
            cqs: BTreeMap::new(),
            qps: BTreeMap::new(),
            mrs: BTreeMap::new(),
        };
        match hca.command(Opcode::QueryDevice, &[], &[]).and_then(|b| body::<QueryDeviceResp>(Opcode::QueryDevice, &b))
        {
            Ok(attributes) => hca.attributes = attributes,
            Err(e) => {
                hca.kernel.PutDmaAdapter(adapter);
                return Err(e);
            }
        }
        Ok(hca)
    }

    pub fn attributes(&self) -> &QueryDeviceResp {
        &self.attributes
    }

    pub fn adapter(&self) -> PDMA_ADAPTER {
        self.adapter
    }

    /// Map registers IoGetDmaAdapter granted.
    pub fn map_registers(&self) -> u32 {
        self.map_registers
    }

    pub fn kernel(&self) -> &Arc<K> {
        &self.kernel
    }

    pub fn transport(&self) -> &C {
        &self.transport
    }

    /// Tears the HCA down as a driver's remove path must: every MR, QP and CQ still open is destroyed on the device
    /// and its memory given back, then the adapter. A caller that gave up half way (an error path, e.g. after a
    /// failed allocation) leaves such objects behind; before this, close returned the adapter with their rings
    /// still allocated and the verifier stopped the machine at PutDmaAdapter (0xE6/0x07, outstanding common
    /// buffers; found by the low-resources simulation). Device errors here do not stop the teardown: the device
    /// is reset after close anyway, and host memory must be returned either way.
    pub fn close(self) {
        self.teardown(true);
    }

    /// The same teardown after a surprise removal: every MR, QP and CQ's host memory is given back (a user's pages
    /// unlocked, lists and map registers put back, rings freed) and the device is sent nothing, since a device that
    /// is gone answers nothing and each destroy would wait out its command's deadline. The caller resets the
    /// device (or finds it gone) before the memory it could still DMA into goes.
    pub fn abandon(self) {
        self.teardown(false);
    }

    fn teardown(mut self, tell_device: bool) {
        for (lkey, mr) in core::mem::take(&mut self.mrs) {
            if tell_device {
                let _ = self.handle_command(Opcode::DeregMr, lkey);
            }
            self.release_mr(&mr);
        }
        for (qpn, mut qp) in core::mem::take(&mut self.qps) {
            if tell_device {
                let _ = self.handle_command(Opcode::DestroyQp, qpn);
            }
            qp.sq.free(&*self.kernel, self.adapter);
            qp.rq.free(&*self.kernel, self.adapter);
        }
        for (cq, mut c) in core::mem::take(&mut self.cqs) {
            if tell_device {
                let _ = self.handle_command(Opcode::DestroyCq, cq);
            }
            c.ring.free(&*self.kernel, self.adapter);
        }
        self.kernel.PutDmaAdapter(self.adapter);
    }

    fn command(&mut self, opcode: Opcode, body: &[u8], pages: &[u64]) -> Result<Vec<u8>, DriverError> {
        let tag = self.next_tag;
        self.next_tag = self.next_tag.wrapping_add(1);
        let request = encode(opcode, tag, body, pages)?;
        let response = self.transport.execute(&request, response_capacity(opcode))?;
        decode(opcode, tag, &response).map(|b| b.to_vec())
    }

    fn handle_command(&mut self, opcode: Opcode, handle: u32) -> Result<(), DriverError> {
        let req = HandleReq { handle: handle.into(), reserved: 0.into() };
        self.command(opcode, req.as_bytes(), &[]).map(|_| ())
    }

    pub fn alloc_pd(&mut self) -> Result<u32, DriverError> {
        let b = self.command(Opcode::AllocPd, &[], &[])?;
        Ok(body::<HandleResp>(Opcode::AllocPd, &b)?.handle.get())
    }

    pub fn dealloc_pd(&mut self, pd: u32) -> Result<(), DriverError> {
        self.handle_command(Opcode::DeallocPd, pd)
    }

    fn ring(&self, entries: u32, entry_size: usize) -> Result<Ring, DriverError> {
        if entries == 0 || !entries.is_power_of_two() {
            return Err(DriverError::InvalidParameter("ring entries must be a power of two"));
        }
        let pages = u32::try_from(ring_pages(entries, entry_size))
            .map_err(|_| DriverError::InvalidParameter("ring too large"))?;
        Ring::allocate(
            &self.kernel,
            self.adapter,
            self.device,
            self.config.ring_memory,
            pages,
            self.config.ring_fallback,
        )
    }

    /// Allocates the CQ ring (contiguous first, then smaller pieces) and sends CREATE_CQ with its page list.
    pub fn create_cq(&mut self, entries: u32) -> Result<u32, DriverError> {
        let ring = self.ring(entries, CQE_SIZE)?;
        self.open_cq(ring, entries)
    }

    /// CREATE_CQ over `ring` with a reader at index 0: the new handle, or the ring freed and the error. A reply
    /// without a handle leaves the device holding no CQ over the ring, so it is freed then too.
    fn open_cq(&mut self, mut ring: Ring, entries: u32) -> Result<u32, DriverError> {
        let created = CqReader::new(&ring, entries).and_then(|reader| {
            let req = CreateCqReq { entries: entries.into(), page_count: ring.pages().into() };
            let reply = self.command(Opcode::CreateCq, req.as_bytes(), &ring.page_list())?;
            Ok((body::<HandleResp>(Opcode::CreateCq, &reply)?.handle.get(), reader))
        });
        match created {
            Ok((handle, reader)) => {
                self.cqs.insert(handle, Cq { ring, reader });
                Ok(handle)
            }
            Err(e) => {
                ring.free(&*self.kernel, self.adapter);
                Err(e)
            }
        }
    }

    /// Pages per piece of a CQ's ring: `[n]` when one contiguous buffer was found.
    pub fn cq_ring_pieces(&self, cq: u32) -> Option<Vec<u32>> {
        self.cqs.get(&cq).map(|c| c.ring.piece_pages())
    }

    pub fn destroy_cq(&mut self, cq: u32) -> Result<(), DriverError> {
        if !self.cqs.contains_key(&cq) {
            return Err(DriverError::UnknownHandle(cq));
        }
        self.handle_command(Opcode::DestroyCq, cq)?;
        if let Some(mut c) = self.cqs.remove(&cq) {
            c.ring.free(&*self.kernel, self.adapter);
        }
        Ok(())
    }

    /// Recreates `cq` over the ring it already has, as a recovery reset does: DESTROY_CQ, then CREATE_CQ with the
    /// same pages and a reader at index 0. Keeping the ring spares the reset an AllocateCommonBuffer (PASSIVE_LEVEL
    /// only, and contiguous memory may be gone by then). The device's new CQ starts again at index 0 with the first
    /// lap's owner, so every CQE the old CQ left in the ring reads as new until it is overwritten: the ring is
    /// cleared before the device gets it back, as a controller reset clears a completion queue whose phase bit
    /// marks new entries. `RingReuse::AsLeft` is the bug (the stale-completion-after-reset scenario). The QPs that
    /// used the CQ are destroyed first (the device refuses otherwise). Returns the new handle; on a refused
    /// CREATE_CQ the ring is freed and the CQ is gone.
    pub fn reset_cq(&mut self, cq: u32, reuse: RingReuse) -> Result<u32, DriverError> {
        if !self.cqs.contains_key(&cq) {
            return Err(DriverError::UnknownHandle(cq));
        }
        self.handle_command(Opcode::DestroyCq, cq)?;
        let Some(Cq { ring, reader }) = self.cqs.remove(&cq) else { return Err(DriverError::UnknownHandle(cq)) };
        if reuse == RingReuse::Cleared {
            reader.clear(&*self.kernel);
        }
        let entries = reader.entries();
        self.open_cq(ring, entries)
    }

    /// Arms `cq` for one CQ_COMPLETION event (ibv_req_notify_cq): the CQ-arm doorbell alone, as mlx4/mlx5 arm a CQ
    /// with a doorbell write and no firmware command. The ring returns once the device has taken the record, so the
    /// arm is in place before the caller posts work. The REQ_NOTIFY_CQ command arms the same way and stays in the
    /// device's ABI; sending it as well cost every arm a command and its interrupt (docs/bench.md section 6).
    pub fn req_notify_cq(&mut self, cq: u32, solicited_only: bool) -> Result<(), DriverError> {
        let c = self.cqs.get(&cq).ok_or(DriverError::UnknownHandle(cq))?;
        let db = Doorbell {
            kind: (DoorbellKind::CqArm as u32).into(),
            handle: cq.into(),
            index: c.reader.consumer().into(),
            flags: (solicited_only as u32).into(),
        };
        self.transport.ring_doorbell(db.as_bytes()).map_err(DriverError::from)
    }

    /// Takes up to `max` new completions: a CQE is new when its owner field matches this lap of the ring.
    pub fn poll_cq(&mut self, cq: u32, max: usize) -> Result<Vec<Cqe>, DriverError> {
        let c = self.cqs.get(&cq).ok_or(DriverError::UnknownHandle(cq))?;
        Ok(c.reader.poll(&*self.kernel, max))
    }

    /// Another view of `cq`'s ring for the interrupt path's DPC, sharing the consumer index with poll_cq. The
    /// holder lets go of it before destroy_cq (the completion path's `unwatch`).
    pub fn cq_reader(&self, cq: u32) -> Option<CqReader> {
        self.cqs.get(&cq).map(|c| c.reader.clone())
    }

    pub fn create_qp(
        &mut self,
        pd: u32,
        send_cq: u32,
        recv_cq: u32,
        sq_entries: u32,
        rq_entries: u32,
    ) -> Result<u32, DriverError> {
        let mut sq = self.ring(sq_entries, WQE_SIZE)?;
        let mut rq = match self.ring(rq_entries, WQE_SIZE) {
            Ok(rq) => rq,
            Err(e) => {
                sq.free(&*self.kernel, self.adapter);
                return Err(e);
            }
        };
        let req = CreateQpReq {
            pd: pd.into(),
            qp_type: QP_TYPE_RC.into(),
            send_cq: send_cq.into(),
            recv_cq: recv_cq.into(),
            sq_entries: sq_entries.into(),
            rq_entries: rq_entries.into(),
            sq_page_count: sq.pages().into(),
            rq_page_count: rq.pages().into(),
        };
        let mut pages = sq.page_list();
        pages.extend(rq.page_list());
        match self.command(Opcode::CreateQp, req.as_bytes(), &pages) {
            Ok(b) => {
                let qpn = body::<HandleResp>(Opcode::CreateQp, &b)?.handle.get();
                self.qps.insert(qpn, Qp { sq, rq, sq_entries, rq_entries, sq_head: 0, rq_head: 0 });
                Ok(qpn)
            }
            Err(e) => {
                sq.free(&*self.kernel, self.adapter);
                rq.free(&*self.kernel, self.adapter);
                Err(e)
            }
        }
    }

    pub fn modify_qp(&mut self, qpn: u32, state: QpState, dest_qpn: u32, access: u32) -> Result<(), DriverError> {
        if !self.qps.contains_key(&qpn) {
            return Err(DriverError::UnknownHandle(qpn));
        }
        let req = ModifyQpReq {
            qpn: qpn.into(),
            attr_mask: (QP_ATTR_STATE | QP_ATTR_DEST_QPN | QP_ATTR_ACCESS_FLAGS).into(),
            state: (state as u32).into(),
            dest_qpn: dest_qpn.into(),
            access: access.into(),
            reserved: 0.into(),
        };
        self.command(Opcode::ModifyQp, req.as_bytes(), &[]).map(|_| ())
    }

    /// Moves the QP to ERR, the state attribute alone: the device stops the QP's work and completes every request
    /// still outstanding with WR_FLUSH_ERR, without its DMA (ibverbs' flush). A driver whose request timed out
    /// does this and reaps the flushed completion before it unmaps, frees or completes the request's buffers:
    /// until the device has let go of the request it may still DMA into them, late, after the memory went back.
    pub fn flush_qp(&mut self, qpn: u32) -> Result<(), DriverError> {
        if !self.qps.contains_key(&qpn) {
            return Err(DriverError::UnknownHandle(qpn));
        }
        let req = ModifyQpReq {
            qpn: qpn.into(),
            attr_mask: QP_ATTR_STATE.into(),
            state: (QpState::Err as u32).into(),
            dest_qpn: 0.into(),
            access: 0.into(),
            reserved: 0.into(),
        };
        self.command(Opcode::ModifyQp, req.as_bytes(), &[]).map(|_| ())
    }

    /// RESET → INIT → RTR → RTS towards `dest_qpn` (loopback on this device).
    pub fn connect_qp(&mut self, qpn: u32, dest_qpn: u32, access: u32) -> Result<(), DriverError> {
        for state in [QpState::Init, QpState::Rtr, QpState::Rts] {
            self.modify_qp(qpn, state, dest_qpn, access)?;
        }
        Ok(())
    }

    pub fn destroy_qp(&mut self, qpn: u32) -> Result<(), DriverError> {
        if !self.qps.contains_key(&qpn) {
            return Err(DriverError::UnknownHandle(qpn));
        }
        self.handle_command(Opcode::DestroyQp, qpn)?;
        if let Some(mut q) = self.qps.remove(&qpn) {
            q.sq.free(&*self.kernel, self.adapter);
            q.rq.free(&*self.kernel, self.adapter);
        }
        Ok(())
    }

    /// Writes the WQE into the SQ slot and rings the SQ doorbell with the new producer index.
    pub fn post_send(&mut self, qpn: u32, wqe: &Wqe) -> Result<(), DriverError> {
        self.post(qpn, wqe, true)
    }

    pub fn post_recv(&mut self, qpn: u32, wqe: &Wqe) -> Result<(), DriverError> {
        self.post(qpn, wqe, false)
    }

    /// Writes several WQEs into consecutive SQ slots and rings the doorbell once, as drivers batch posts. At most
    /// one ring's worth: the device refuses a producer index more than one ring ahead of its consumer.
    pub fn post_send_many(&mut self, qpn: u32, wqes: &[Wqe]) -> Result<(), DriverError> {
        self.post_many(qpn, wqes, true)
    }

    fn post(&mut self, qpn: u32, wqe: &Wqe, send: bool) -> Result<(), DriverError> {
        self.post_many(qpn, core::slice::from_ref(wqe), send)
    }

    fn post_many(&mut self, qpn: u32, wqes: &[Wqe], send: bool) -> Result<(), DriverError> {
        let kernel = self.kernel.clone();
        let q = self.qps.get_mut(&qpn).ok_or(DriverError::UnknownHandle(qpn))?;
        let (ring, entries, head) =
            if send { (&q.sq, q.sq_entries, &mut q.sq_head) } else { (&q.rq, q.rq_entries, &mut q.rq_head) };
        if wqes.is_empty() || wqes.len() > entries as usize {
            return Err(DriverError::InvalidParameter("batch empty or longer than the work queue"));
        }
        for wqe in wqes {
            let slot = (*head % entries) as u64 * WQE_SIZE as u64;
            let va = ring.va(slot).ok_or(DriverError::InvalidParameter("WQE slot outside its ring"))?;
            kernel.RtlCopyToVa(va, wqe.as_bytes());
            *head = head.wrapping_add(1);
        }
        let kind = if send { DoorbellKind::SendQueue } else { DoorbellKind::RecvQueue };
        let db = Doorbell { kind: (kind as u32).into(), handle: qpn.into(), index: (*head).into(), flags: 0.into() };
        self.transport.ring_doorbell(db.as_bytes())?;
        Ok(())
    }

    /// Registers a memory region: describes the buffer with an MDL (locked for user buffers), maps it for the
    /// device for the MR's whole life, and sends REG_MR with one IOVA per page.
    pub fn reg_mr(
        &mut self,
        pd: u32,
        source: MrSource,
        access: u32,
        mapping: MrMapping,
    ) -> Result<RegisteredMr, DriverError> {
        let k = self.kernel.clone();
        let (va, length) = match source {
            MrSource::Kernel { va, length } | MrSource::User { va, length, .. } => (va, length),
            MrSource::Common { va, length, .. } => (va, length),
        };
        if length == 0 {
            return Err(DriverError::InvalidParameter("zero-length MR"));
        }
        // The device writes an MR the QP may receive or be RDMA-written into; the transfer direction follows.
        let write_to_device = access & (ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE) == 0;
        let mut mr = Mr { mdl: None, locked: false, view: MrDeviceView::None };
        let elements = match source {
            MrSource::Common { logical, .. } => {
                alloc::vec![SCATTER_GATHER_ELEMENT { Address: logical, Length: length }]
            }
            MrSource::Kernel { .. } | MrSource::User { .. } => {
                let mdl = k.IoAllocateMdl(va, length, false, false);
                if mdl.is_null() {
                    return Err(DriverError::NoMemory { routine: "IoAllocateMdl", bytes: length as u64 });
                }
                mr.mdl = Some(mdl);
                match source {
                    MrSource::User { skip_lock: false, .. } => {
                        let status =
                            k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, LOCK_OPERATION::IoModifyAccess);
                        if !status.is_success() {
                            k.IoFreeMdl(mdl);
                            return Err(DriverError::Kernel { routine: "MmProbeAndLockPages", status });
                        }
                        mr.locked = true;
                    }
                    MrSource::User { skip_lock: true, .. } => {}
                    _ => k.MmBuildMdlForNonPagedPool(mdl),
                }
                let mapped = match mapping {
                    MrMapping::ScatterGather => self
                        .scatter_gather_list(mdl, mr.locked, va, length, write_to_device)
                        .map(|sg| (MrDeviceView::Sg(sg.Handle, write_to_device), sg.Elements)),
                    MrMapping::IoMapCommonBuffer => k
                        .IoMapCommonBuffer(self.adapter, mdl, length, true)
                        .map(|(h, sg)| (MrDeviceView::CommonMap(h), sg.Elements))
                        .map_err(|status| DriverError::Kernel { routine: "IoMapCommonBuffer", status }),
                };
                match mapped {
                    Ok((view, elements)) => {
                        mr.view = view;
                        elements
                    }
                    Err(e) => {
                        if let DriverError::DmaQueued { .. } = e {
                            // The queued request owns the MDL now: its routine frees it (scatter_gather_list).
                            mr.mdl = None;
                        }
                        self.release_mr(&mr);
                        return Err(e);
                    }
                }
            }
        };
        let pages = page_list(&elements);
        let req = RegMrReq {
            pd: pd.into(),
            access: access.into(),
            addr: va.0.into(),
            length: (length as u64).into(),
            first_page_offset: ((va.0 % PAGE_SIZE) as u32).into(),
            page_count: (pages.len() as u32).into(),
        };
        match self.command(Opcode::RegMr, req.as_bytes(), &pages).and_then(|b| body::<RegMrResp>(Opcode::RegMr, &b)) {
            Ok(resp) => {
                let lkey = resp.lkey.get();
                self.mrs.insert(lkey, mr);
                Ok(RegisteredMr { lkey, rkey: resp.rkey.get(), addr: va.0, length })
            }
            Err(e) => {
                self.release_mr(&mr);
                Err(e)
            }
        }
    }

    /// GetScatterGatherList as a Windows driver calls it: at DISPATCH_LEVEL, the list arriving in AdapterListControl.
    /// A list that does not arrive before the call returns (map registers short) is given up: the routine puts it
    /// back when it comes, and only then unlocks and frees the MDL (`locked`: MmProbeAndLockPages locked it), since
    /// the queued request describes the transfer by that MDL until its routine has run. Freeing it at the give-up,
    /// as reg_mr's error path did, left the request over a freed MDL (0xE6/0x0E under DMA checking when the
    /// routine ran).
    fn scatter_gather_list(
        &self,
        mdl: PMDL,
        locked: bool,
        va: PVOID,
        length: u32,
        write_to_device: bool,
    ) -> Result<SCATTER_GATHER_LIST, DriverError> {
        let delivery: Arc<Delivery<SCATTER_GATHER_LIST, (PMDL, bool)>> = Arc::new(Delivery::new());
        let routine: PDRIVER_LIST_CONTROL = {
            let (delivery, kernel, adapter) = (delivery.clone(), self.kernel.clone(), self.adapter);
            Box::new(move |_device, list: &SCATTER_GATHER_LIST| {
                if let Err(late) = delivery.deliver(list.clone()) {
                    // DISPATCH_LEVEL, which all three allow.
                    kernel.PutScatterGatherList(adapter, late.Handle, write_to_device);
                    if let Some(&(mdl, locked)) = delivery.left_behind() {
                        if locked {
                            kernel.MmUnlockPages(mdl);
                        }
                        kernel.IoFreeMdl(mdl);
                    }
                }
            })
        };
        let old = self.kernel.KeRaiseIrql(DISPATCH_LEVEL);
        let status =
            self.kernel.GetScatterGatherList(self.adapter, self.device, mdl, va, length, routine, write_to_device);
        self.kernel.KeLowerIrql(old);
        if !status.is_success() {
            return Err(DriverError::Kernel { routine: "GetScatterGatherList", status });
        }
        delivery.take_or_leave((mdl, locked)).cloned().ok_or(DriverError::DmaQueued { routine: "GetScatterGatherList" })
    }

    /// Undoes what reg_mr did to the buffer, in reverse: device view (PutScatterGatherList at DISPATCH_LEVEL, as
    /// Windows requires), lock, MDL.
    fn release_mr(&self, mr: &Mr) {
        match mr.view {
            MrDeviceView::Sg(sg, write_to_device) => {
                let old = self.kernel.KeRaiseIrql(DISPATCH_LEVEL);
                self.kernel.PutScatterGatherList(self.adapter, sg, write_to_device);
                self.kernel.KeLowerIrql(old);
            }
            MrDeviceView::CommonMap(h) => self.kernel.IoUnmapCommonBuffer(self.adapter, h),
            MrDeviceView::None => {}
        }
        if let Some(mdl) = mr.mdl {
            if mr.locked {
                self.kernel.MmUnlockPages(mdl);
            }
            self.kernel.IoFreeMdl(mdl);
        }
    }

    /// The use-after-unmap bug: gives the MR's buffer back (Put/IoUnmap, unlock, free the MDL) while the device
    /// still holds the registration. The device's next DMA through the MR meets an unmapped IOVA. A later
    /// dereg_mr only deregisters.
    pub fn release_mr_buffer_early(&mut self, lkey: u32) -> Result<(), DriverError> {
        let mr = self.mrs.get_mut(&lkey).ok_or(DriverError::UnknownHandle(lkey))?;
        let taken = core::mem::replace(mr, Mr { mdl: None, locked: false, view: MrDeviceView::None });
        self.release_mr(&taken);
        Ok(())
    }

    /// MR keys still registered.
    pub fn registered_mrs(&self) -> Vec<u32> {
        self.mrs.keys().copied().collect()
    }

    pub fn dereg_mr(&mut self, lkey: u32) -> Result<(), DriverError> {
        if !self.mrs.contains_key(&lkey) {
            return Err(DriverError::UnknownHandle(lkey));
        }
        self.handle_command(Opcode::DeregMr, lkey)?;
        if let Some(mr) = self.mrs.remove(&lkey) {
            self.release_mr(&mr);
        }
        Ok(())
    }

    /// The next asynchronous event from the device (completion notice, QP error, DMA fault).
    pub fn poll_event(&self) -> Option<Event> {
        self.transport.poll_event()
    }
}

/// One device address per 4 KiB page the elements cover, in order.
fn page_list(elements: &[SCATTER_GATHER_ELEMENT]) -> Vec<u64> {
    let mut pages = Vec::new();
    for e in elements {
        let start = e.Address.0 - e.Address.0 % PAGE_SIZE;
        let n = ADDRESS_AND_SIZE_TO_SPAN_PAGES(PVOID(e.Address.0), e.Length as u64);
        pages.extend((0..n).map(|i| start + i * PAGE_SIZE));
    }
    pages
}
