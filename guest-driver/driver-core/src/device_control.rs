//! IRP_MJ_DEVICE_CONTROL's decoding and dispatch, shared by both personalities: every input checked before use
//! (code, lengths, record alignment, reserved fields, the caller's own handles), then one driver verb.

use alloc::collections::{BTreeMap, BTreeSet};

use vhca_ntapi::{NTSTATUS, STATUS_BUFFER_TOO_SMALL, STATUS_INSUFFICIENT_RESOURCES, STATUS_INVALID_DEVICE_REQUEST};
use vhca_ntapi::{STATUS_INVALID_PARAMETER, STATUS_NOT_SUPPORTED, STATUS_PENDING, STATUS_SUCCESS};
use vhca_proto::{Cqe, Wqe, WrOpcode, ACCESS_ALL, CQE_SIZE, MAX_SGE, WQE_SIZE, WR_SIGNALED, WR_SOLICITED};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::error::DriverError;
use crate::ioctl_codec::*;
use crate::user_verbs::UserVerbs;

/// What one open of the device interface holds (IRP_MJ_CREATE makes it, CLEANUP releases it). A handle a caller
/// passes is used only if it is in its own table: another file's CQ number is as unknown as a made-up one.
#[derive(Debug, Default)]
pub struct FileContext {
    opened: bool,
    pds: BTreeSet<u32>,
    cqs: BTreeSet<u32>,
    qps: BTreeSet<u32>,
    /// lkey -> the registered range, which every SGE of this file's work requests must fall inside.
    mrs: BTreeMap<u32, MrExtent>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MrExtent {
    addr: u64,
    length: u32,
}

/// What IoCompleteRequest is given: the status and Irp->IoStatus.Information (bytes written to the output, or
/// taken from an IN_DIRECT buffer). STATUS_PENDING (WAIT_CQ with nothing to answer yet) is no completion: the
/// personality keeps the request and answers it later through `poll_for_wait`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlReply {
    pub status: NTSTATUS,
    pub information: usize,
}

/// Objects CLEANUP gave back, and how many of those the device refused to destroy (a device gone, say).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReleasedObjects {
    pub qps: usize,
    pub mrs: usize,
    pub cqs: usize,
    pub pds: usize,
    pub failed: usize,
}

type Outcome = Result<usize, NTSTATUS>;

impl FileContext {
    pub fn new() -> FileContext {
        FileContext::default()
    }

    /// Handles this file still holds, of every kind.
    pub fn live_objects(&self) -> usize {
        self.pds.len() + self.cqs.len() + self.qps.len() + self.mrs.len()
    }

    pub fn owns_cq(&self, cq: u32) -> bool {
        self.cqs.contains(&cq)
    }

    /// The HCA these handles named is gone (a STOP dropped it with everything on it): the file keeps its open
    /// context and holds nothing, so a handle it names later is as unknown as a made-up one.
    pub fn forget(&mut self) {
        self.pds.clear();
        self.cqs.clear();
        self.qps.clear();
        self.mrs.clear();
    }

    /// IRP_MJ_CLEANUP: destroys what the file left, dependents first (QPs use CQs and PDs, MRs use PDs).
    pub fn release(&mut self, verbs: &mut impl UserVerbs) -> ReleasedObjects {
        let mut released = ReleasedObjects::default();
        let mut tally = |result: Result<(), DriverError>| released.failed += result.is_err() as usize;
        let qps = core::mem::take(&mut self.qps);
        for &qpn in &qps {
            tally(verbs.destroy_qp(qpn));
        }
        let mrs = core::mem::take(&mut self.mrs);
        for &lkey in mrs.keys() {
            tally(verbs.dereg_mr(lkey));
        }
        let cqs = core::mem::take(&mut self.cqs);
        for &cq in &cqs {
            tally(verbs.destroy_cq(cq));
        }
        let pds = core::mem::take(&mut self.pds);
        for &pd in &pds {
            tally(verbs.dealloc_pd(pd));
        }
        released.qps = qps.len();
        released.mrs = mrs.len();
        released.cqs = cqs.len();
        released.pds = pds.len();
        released
    }
}

/// One IRP_MJ_DEVICE_CONTROL. `input` is the buffered input (SystemBuffer, InputBufferLength); `output` is, for
/// METHOD_BUFFERED, the SystemBuffer's OutputBufferLength bytes and, for the direct methods, the MDL's buffer
/// (read for IN_DIRECT, written for OUT_DIRECT). The caller serialises calls that share `verbs`.
pub fn dispatch(
    verbs: &mut impl UserVerbs,
    file: &mut FileContext,
    code: u32,
    input: &[u8],
    output: &mut [u8],
) -> ControlReply {
    let outcome = match code {
        IOCTL_VHCA_OPEN_CONTEXT => open_context(file, input, output),
        IOCTL_VHCA_QUERY_DEVICE
        | IOCTL_VHCA_ALLOC_PD
        | IOCTL_VHCA_DEALLOC_PD
        | IOCTL_VHCA_CREATE_CQ
        | IOCTL_VHCA_DESTROY_CQ
        | IOCTL_VHCA_CREATE_QP
        | IOCTL_VHCA_DESTROY_QP
        | IOCTL_VHCA_CONNECT_QP
        | IOCTL_VHCA_REG_MR
        | IOCTL_VHCA_DEREG_MR
        | IOCTL_VHCA_POST_SEND
        | IOCTL_VHCA_POST_RECV
        | IOCTL_VHCA_POLL_CQ
        | IOCTL_VHCA_REQ_NOTIFY_CQ
        | IOCTL_VHCA_WAIT_CQ
            if !file.opened =>
        {
            Err(STATUS_INVALID_DEVICE_STATE)
        }
        IOCTL_VHCA_QUERY_DEVICE => no_input(input).and_then(|()| write_out(output, &verbs.query_device())),
        IOCTL_VHCA_ALLOC_PD => alloc_pd(verbs, file, input, output),
        IOCTL_VHCA_DEALLOC_PD => destroy(input, &mut file.pds, |h| verbs.dealloc_pd(h)),
        IOCTL_VHCA_CREATE_CQ => create_cq(verbs, file, input, output),
        IOCTL_VHCA_DESTROY_CQ => destroy(input, &mut file.cqs, |h| verbs.destroy_cq(h)),
        IOCTL_VHCA_CREATE_QP => create_qp(verbs, file, input, output),
        IOCTL_VHCA_DESTROY_QP => destroy(input, &mut file.qps, |h| verbs.destroy_qp(h)),
        IOCTL_VHCA_CONNECT_QP => connect_qp(verbs, file, input),
        IOCTL_VHCA_REG_MR => reg_mr(verbs, file, input, output),
        IOCTL_VHCA_DEREG_MR => dereg_mr(verbs, file, input),
        IOCTL_VHCA_POST_SEND => post(verbs, file, input, output, true),
        IOCTL_VHCA_POST_RECV => post(verbs, file, input, output, false),
        IOCTL_VHCA_POLL_CQ => poll_cq(verbs, file, input, output),
        IOCTL_VHCA_REQ_NOTIFY_CQ => notify_cq(verbs, file, input),
        IOCTL_VHCA_WAIT_CQ => match poll_cq(verbs, file, input, output) {
            Ok(0) => return ControlReply { status: STATUS_PENDING, information: 0 },
            other => other,
        },
        _ => Err(STATUS_INVALID_DEVICE_REQUEST),
    };
    match outcome {
        Ok(information) => ControlReply { status: STATUS_SUCCESS, information },
        Err(status) => ControlReply { status, information: 0 },
    }
}

/// A WAIT_CQ the dispatcher answered STATUS_PENDING, tried again (the personality's poller, serialised with
/// `dispatch` as it is): its input as it came, checked again against the file, which may have destroyed the CQ
/// meanwhile. Some(reply) once there is something to answer (the CQEs, or why the wait cannot go on); None while
/// the CQ is still empty.
pub fn poll_for_wait(
    verbs: &mut impl UserVerbs,
    file: &FileContext,
    input: &[u8],
    output: &mut [u8],
) -> Option<ControlReply> {
    match poll_cq(verbs, file, input, output) {
        Ok(0) => None,
        Ok(information) => Some(ControlReply { status: STATUS_SUCCESS, information }),
        Err(status) => Some(ControlReply { status, information: 0 }),
    }
}

/// The status a caller sees for a verb the driver core refused.
pub fn status_of(error: DriverError) -> NTSTATUS {
    match error {
        DriverError::Kernel { status, .. } => status,
        DriverError::DmaQueued { .. } | DriverError::NoMemory { .. } => STATUS_INSUFFICIENT_RESOURCES,
        DriverError::UnknownHandle(_) => STATUS_INVALID_HANDLE,
        DriverError::InvalidParameter(_) => STATUS_INVALID_PARAMETER,
        DriverError::QueueFull => STATUS_DEVICE_BUSY,
        DriverError::Device { .. } | DriverError::BadResponse { .. } | DriverError::Transport(_) => {
            STATUS_IO_DEVICE_ERROR
        }
    }
}

/// The input is exactly one `T`: a shorter one cannot be read, and a longer one is a caller built for another ABI.
fn read_in<T: FromBytes>(input: &[u8]) -> Result<T, NTSTATUS> {
    T::read_from_bytes(input).map_err(|_| STATUS_INVALID_PARAMETER)
}

fn no_input(input: &[u8]) -> Result<(), NTSTATUS> {
    if input.is_empty() {
        Ok(())
    } else {
        Err(STATUS_INVALID_PARAMETER)
    }
}

fn reserved_zero(value: u32) -> Result<(), NTSTATUS> {
    if value == 0 {
        Ok(())
    } else {
        Err(STATUS_INVALID_PARAMETER)
    }
}

/// Checked before the verb runs, so a too-small output never leaves an object the caller was not told about.
fn room_for(output: &[u8], bytes: usize) -> Result<(), NTSTATUS> {
    if output.len() < bytes {
        Err(STATUS_BUFFER_TOO_SMALL)
    } else {
        Ok(())
    }
}

fn write_out<T: IntoBytes + Immutable + KnownLayout>(output: &mut [u8], value: &T) -> Outcome {
    let bytes = value.as_bytes();
    room_for(output, bytes.len())?;
    output[..bytes.len()].copy_from_slice(bytes);
    Ok(bytes.len())
}

fn owned(set: &BTreeSet<u32>, handle: u32) -> Result<u32, NTSTATUS> {
    if set.contains(&handle) {
        Ok(handle)
    } else {
        Err(STATUS_INVALID_HANDLE)
    }
}

fn below_cap(held: usize) -> Result<(), NTSTATUS> {
    if held < MAX_OBJECTS_PER_FILE {
        Ok(())
    } else {
        Err(STATUS_INSUFFICIENT_RESOURCES)
    }
}

fn open_context(file: &mut FileContext, input: &[u8], output: &mut [u8]) -> Outcome {
    let req: OpenContextIn = read_in(input)?;
    reserved_zero(req.reserved.get())?;
    if file.opened {
        return Err(STATUS_INVALID_DEVICE_STATE);
    }
    if req.abi_version.get() != USER_ABI_VERSION {
        return Err(STATUS_NOT_SUPPORTED);
    }
    let reply = OpenContextOut {
        abi_version: USER_ABI_VERSION.into(),
        max_objects: (MAX_OBJECTS_PER_FILE as u32).into(),
        max_work_per_request: MAX_WORK_PER_REQUEST.into(),
        reserved: 0.into(),
    };
    let written = write_out(output, &reply)?;
    file.opened = true;
    Ok(written)
}

fn alloc_pd(verbs: &mut impl UserVerbs, file: &mut FileContext, input: &[u8], output: &mut [u8]) -> Outcome {
    no_input(input)?;
    room_for(output, size_of::<HandleOut>())?;
    below_cap(file.pds.len())?;
    let pd = verbs.alloc_pd().map_err(status_of)?;
    file.pds.insert(pd);
    write_out(output, &HandleOut { handle: pd.into(), reserved: 0.into() })
}

fn destroy(input: &[u8], set: &mut BTreeSet<u32>, verb: impl FnOnce(u32) -> Result<(), DriverError>) -> Outcome {
    let req: HandleIn = read_in(input)?;
    reserved_zero(req.reserved.get())?;
    let handle = owned(set, req.handle.get())?;
    verb(handle).map_err(status_of)?;
    set.remove(&handle);
    Ok(0)
}

fn create_cq(verbs: &mut impl UserVerbs, file: &mut FileContext, input: &[u8], output: &mut [u8]) -> Outcome {
    let req: CreateCqIn = read_in(input)?;
    reserved_zero(req.reserved.get())?;
    room_for(output, size_of::<CreateCqOut>())?;
    below_cap(file.cqs.len())?;
    let entries = req.entries.get();
    let cq = verbs.create_cq(entries).map_err(status_of)?;
    file.cqs.insert(cq);
    write_out(output, &CreateCqOut { cq: cq.into(), entries: entries.into() })
}

fn create_qp(verbs: &mut impl UserVerbs, file: &mut FileContext, input: &[u8], output: &mut [u8]) -> Outcome {
    let req: CreateQpIn = read_in(input)?;
    reserved_zero(req.reserved.get())?;
    room_for(output, size_of::<HandleOut>())?;
    let pd = owned(&file.pds, req.pd.get())?;
    let send_cq = owned(&file.cqs, req.send_cq.get())?;
    let recv_cq = owned(&file.cqs, req.recv_cq.get())?;
    below_cap(file.qps.len())?;
    let qpn = verbs.create_qp(pd, send_cq, recv_cq, req.sq_entries.get(), req.rq_entries.get()).map_err(status_of)?;
    file.qps.insert(qpn);
    write_out(output, &HandleOut { handle: qpn.into(), reserved: 0.into() })
}

fn connect_qp(verbs: &mut impl UserVerbs, file: &mut FileContext, input: &[u8]) -> Outcome {
    let req: ConnectQpIn = read_in(input)?;
    reserved_zero(req.reserved.get())?;
    let qpn = owned(&file.qps, req.qpn.get())?;
    // The destination is the remote side's number: the device judges it, the caller need not own it.
    let access = req.access.get();
    if access & !ACCESS_ALL != 0 {
        return Err(STATUS_INVALID_PARAMETER);
    }
    verbs.connect_qp(qpn, req.dest_qpn.get(), access).map_err(status_of)?;
    Ok(0)
}

fn reg_mr(verbs: &mut impl UserVerbs, file: &mut FileContext, input: &[u8], output: &mut [u8]) -> Outcome {
    let req: RegMrIn = read_in(input)?;
    reserved_zero(req.reserved.get())?;
    room_for(output, size_of::<RegMrOut>())?;
    let (addr, length, access) = (req.addr.get(), req.length.get(), req.access.get());
    // A kernel address is refused by the probe itself (UserMode, in the caller's context); what is left to check
    // here is what no probe sees: an empty or wrapping range, and access bits the device does not define.
    if addr == 0 || length == 0 || addr.checked_add(u64::from(length)).is_none() || access & !ACCESS_ALL != 0 {
        return Err(STATUS_INVALID_PARAMETER);
    }
    let pd = owned(&file.pds, req.pd.get())?;
    below_cap(file.mrs.len())?;
    let mr = verbs.reg_user_mr(pd, addr, length, access).map_err(status_of)?;
    file.mrs.insert(mr.lkey, MrExtent { addr: mr.addr, length: mr.length });
    let reply = RegMrOut {
        addr: mr.addr.into(),
        length: mr.length.into(),
        lkey: mr.lkey.into(),
        rkey: mr.rkey.into(),
        reserved: 0.into(),
    };
    write_out(output, &reply)
}

fn dereg_mr(verbs: &mut impl UserVerbs, file: &mut FileContext, input: &[u8]) -> Outcome {
    let req: HandleIn = read_in(input)?;
    reserved_zero(req.reserved.get())?;
    let lkey = req.handle.get();
    if !file.mrs.contains_key(&lkey) {
        return Err(STATUS_INVALID_HANDLE);
    }
    verbs.dereg_mr(lkey).map_err(status_of)?;
    file.mrs.remove(&lkey);
    Ok(0)
}

/// `count` from 1 to MAX_WORK_PER_REQUEST, the records a whole number of `record` bytes.
fn work_count(count: u32, bytes: usize, record: usize) -> Result<usize, NTSTATUS> {
    if count == 0 || count > MAX_WORK_PER_REQUEST {
        return Err(STATUS_INVALID_PARAMETER);
    }
    if bytes % record != 0 {
        return Err(STATUS_INVALID_PARAMETER);
    }
    Ok(count as usize)
}

/// Every WQE is checked before the first is posted, so a refused request leaves the queue as it was.
fn post(verbs: &mut impl UserVerbs, file: &FileContext, input: &[u8], wqes: &[u8], send: bool) -> Outcome {
    let req: PostIn = read_in(input)?;
    let count = work_count(req.count.get(), wqes.len(), WQE_SIZE)?;
    if wqes.len() != count * WQE_SIZE {
        return Err(STATUS_INVALID_PARAMETER);
    }
    let qpn = owned(&file.qps, req.qpn.get())?;
    let mut checked = alloc::vec::Vec::with_capacity(count);
    for record in wqes.chunks_exact(WQE_SIZE) {
        let wqe = Wqe::read_from_bytes(record).map_err(|_| STATUS_INVALID_PARAMETER)?;
        check_wqe(file, &wqe, send)?;
        checked.push(wqe);
    }
    for (posted, wqe) in checked.iter().enumerate() {
        let result = if send { verbs.post_send(qpn, wqe) } else { verbs.post_recv(qpn, wqe) };
        if let Err(e) = result {
            // The ones already posted will complete; the caller learns how many from Information.
            return if posted == 0 { Err(status_of(e)) } else { Ok(posted * WQE_SIZE) };
        }
    }
    Ok(count * WQE_SIZE)
}

fn check_wqe(file: &FileContext, wqe: &Wqe, send: bool) -> Result<(), NTSTATUS> {
    let opcode = WrOpcode::from_u32(wqe.opcode.get()).ok_or(STATUS_INVALID_PARAMETER)?;
    if send == (opcode == WrOpcode::Recv) {
        return Err(STATUS_INVALID_PARAMETER);
    }
    if wqe.flags.get() & !(WR_SIGNALED | WR_SOLICITED) != 0 {
        return Err(STATUS_INVALID_PARAMETER);
    }
    let used = wqe.num_sge.get() as usize;
    if used > MAX_SGE {
        return Err(STATUS_INVALID_PARAMETER);
    }
    if wqe.sge[used..].iter().any(|sge| sge.as_bytes().iter().any(|&b| b != 0)) {
        return Err(STATUS_INVALID_PARAMETER);
    }
    for sge in &wqe.sge[..used] {
        // The lkey must be this file's: another process's MR is memory this caller must not reach.
        let mr = file.mrs.get(&sge.lkey.get()).ok_or(STATUS_INVALID_HANDLE)?;
        let end = sge.addr.get().checked_add(u64::from(sge.length.get())).ok_or(STATUS_INVALID_PARAMETER)?;
        let mr_end = mr.addr + u64::from(mr.length);
        if sge.addr.get() < mr.addr || end > mr_end {
            return Err(STATUS_INVALID_PARAMETER);
        }
    }
    Ok(())
}

fn poll_cq(verbs: &mut impl UserVerbs, file: &FileContext, input: &[u8], output: &mut [u8]) -> Outcome {
    let req: PollCqIn = read_in(input)?;
    let max = work_count(req.max.get(), output.len(), CQE_SIZE)?;
    room_for(output, max * CQE_SIZE)?;
    let cq = owned(&file.cqs, req.cq.get())?;
    let cqes = verbs.poll_cq(cq, max).map_err(status_of)?;
    let mut written = 0;
    for cqe in cqes.iter().take(max) {
        written += write_out(&mut output[written..], cqe)?;
    }
    Ok(written)
}

fn notify_cq(verbs: &mut impl UserVerbs, file: &FileContext, input: &[u8]) -> Outcome {
    let req: NotifyCqIn = read_in(input)?;
    let flags = req.flags.get();
    reserved_zero(flags & !NOTIFY_SOLICITED_ONLY)?;
    let cq = owned(&file.cqs, req.cq.get())?;
    verbs.req_notify_cq(cq, flags & NOTIFY_SOLICITED_ONLY != 0).map_err(status_of)?;
    Ok(0)
}

const _: () = assert!(size_of::<Cqe>() == CQE_SIZE);

#[cfg(test)]
mod tests;
