//! Each refusal the dispatcher gives, against a fake HCA that would accept anything: a test fails if its check
//! is removed, because the fake then performs the verb and the status or the fake's state says so.

use alloc::vec;
use alloc::vec::Vec;

use vhca_ntapi::{STATUS_BUFFER_TOO_SMALL, STATUS_INSUFFICIENT_RESOURCES, STATUS_INVALID_DEVICE_REQUEST};
use vhca_ntapi::{STATUS_INVALID_PARAMETER, STATUS_NOT_SUPPORTED, STATUS_PENDING, STATUS_SUCCESS};
use vhca_proto::{Cqe, QueryDeviceResp, Sge, Wqe, WrOpcode, WR_SIGNALED};
use zerocopy::{FromBytes, IntoBytes};

use super::*;
use crate::hca::RegisteredMr;

/// A device that accepts every verb and numbers objects from 1, one namespace for all files.
#[derive(Default)]
struct FakeHca {
    next: u32,
    cqs: BTreeSet<u32>,
    qps: BTreeSet<u32>,
    pds: BTreeSet<u32>,
    mrs: BTreeSet<u32>,
    posted: Vec<(u32, Wqe)>,
    completions: Vec<Cqe>,
    /// Destroys in the order CLEANUP sent them.
    destroyed: Vec<&'static str>,
}

impl FakeHca {
    fn number(&mut self) -> u32 {
        self.next += 1;
        self.next
    }
}

impl UserVerbs for FakeHca {
    fn query_device(&self) -> QueryDeviceResp {
        QueryDeviceResp { max_cq: 7.into(), ..Default::default() }
    }
    fn alloc_pd(&mut self) -> Result<u32, DriverError> {
        let pd = self.number();
        self.pds.insert(pd);
        Ok(pd)
    }
    fn dealloc_pd(&mut self, pd: u32) -> Result<(), DriverError> {
        self.destroyed.push("pd");
        self.pds.remove(&pd).then_some(()).ok_or(DriverError::UnknownHandle(pd))
    }
    fn create_cq(&mut self, entries: u32) -> Result<u32, DriverError> {
        if !entries.is_power_of_two() {
            return Err(DriverError::InvalidParameter("ring entries must be a power of two"));
        }
        let cq = self.number();
        self.cqs.insert(cq);
        Ok(cq)
    }
    fn destroy_cq(&mut self, cq: u32) -> Result<(), DriverError> {
        self.destroyed.push("cq");
        self.cqs.remove(&cq).then_some(()).ok_or(DriverError::UnknownHandle(cq))
    }
    fn req_notify_cq(&mut self, _cq: u32, _solicited_only: bool) -> Result<(), DriverError> {
        Ok(())
    }
    fn poll_cq(&mut self, _cq: u32, max: usize) -> Result<Vec<Cqe>, DriverError> {
        let n = max.min(self.completions.len());
        Ok(self.completions.drain(..n).collect())
    }
    fn create_qp(&mut self, _pd: u32, _s: u32, _r: u32, _sq: u32, _rq: u32) -> Result<u32, DriverError> {
        let qpn = self.number();
        self.qps.insert(qpn);
        Ok(qpn)
    }
    fn connect_qp(&mut self, _qpn: u32, _dest: u32, _access: u32) -> Result<(), DriverError> {
        Ok(())
    }
    fn destroy_qp(&mut self, qpn: u32) -> Result<(), DriverError> {
        self.destroyed.push("qp");
        self.qps.remove(&qpn).then_some(()).ok_or(DriverError::UnknownHandle(qpn))
    }
    fn reg_user_mr(&mut self, _pd: u32, addr: u64, length: u32, _access: u32) -> Result<RegisteredMr, DriverError> {
        let lkey = self.number();
        self.mrs.insert(lkey);
        Ok(RegisteredMr { lkey, rkey: lkey | 0x100, addr, length })
    }
    fn dereg_mr(&mut self, lkey: u32) -> Result<(), DriverError> {
        self.destroyed.push("mr");
        self.mrs.remove(&lkey).then_some(()).ok_or(DriverError::UnknownHandle(lkey))
    }
    fn post_send(&mut self, qpn: u32, wqe: &Wqe) -> Result<(), DriverError> {
        self.posted.push((qpn, *wqe));
        Ok(())
    }
    fn post_recv(&mut self, qpn: u32, wqe: &Wqe) -> Result<(), DriverError> {
        self.posted.push((qpn, *wqe));
        Ok(())
    }
}

fn call(
    hca: &mut FakeHca,
    file: &mut FileContext,
    code: u32,
    input: &[u8],
    capacity: usize,
) -> (ControlReply, Vec<u8>) {
    let mut output = vec![0u8; capacity];
    let reply = dispatch(hca, file, code, input, &mut output);
    (reply, output)
}

fn status(hca: &mut FakeHca, file: &mut FileContext, code: u32, input: &[u8], capacity: usize) -> NTSTATUS {
    call(hca, file, code, input, capacity).0.status
}

fn opened(hca: &mut FakeHca) -> FileContext {
    let mut file = FileContext::new();
    let open = OpenContextIn { abi_version: USER_ABI_VERSION.into(), reserved: 0.into() };
    assert_eq!(status(hca, &mut file, IOCTL_VHCA_OPEN_CONTEXT, open.as_bytes(), 16), STATUS_SUCCESS);
    file
}

fn handle_out(bytes: &[u8]) -> u32 {
    HandleOut::read_from_prefix(bytes).unwrap().0.handle.get()
}

fn new_pd(hca: &mut FakeHca, file: &mut FileContext) -> u32 {
    let (reply, out) = call(hca, file, IOCTL_VHCA_ALLOC_PD, &[], 8);
    assert_eq!(reply, ControlReply { status: STATUS_SUCCESS, information: 8 });
    handle_out(&out)
}

fn new_cq(hca: &mut FakeHca, file: &mut FileContext) -> u32 {
    let req = CreateCqIn { entries: 16.into(), reserved: 0.into() };
    let (reply, out) = call(hca, file, IOCTL_VHCA_CREATE_CQ, req.as_bytes(), 8);
    assert_eq!(reply.status, STATUS_SUCCESS);
    CreateCqOut::read_from_bytes(&out).unwrap().cq.get()
}

fn new_qp(hca: &mut FakeHca, file: &mut FileContext, pd: u32, cq: u32) -> u32 {
    let req = CreateQpIn {
        pd: pd.into(),
        send_cq: cq.into(),
        recv_cq: cq.into(),
        sq_entries: 8.into(),
        rq_entries: 8.into(),
        reserved: 0.into(),
    };
    let (reply, out) = call(hca, file, IOCTL_VHCA_CREATE_QP, req.as_bytes(), 8);
    assert_eq!(reply.status, STATUS_SUCCESS);
    handle_out(&out)
}

fn new_mr(hca: &mut FakeHca, file: &mut FileContext, pd: u32, addr: u64, length: u32) -> u32 {
    let req = RegMrIn { addr: addr.into(), length: length.into(), pd: pd.into(), access: 1.into(), reserved: 0.into() };
    let (reply, out) = call(hca, file, IOCTL_VHCA_REG_MR, req.as_bytes(), 24);
    assert_eq!(reply.status, STATUS_SUCCESS);
    RegMrOut::read_from_bytes(&out).unwrap().lkey.get()
}

fn send_wqe(lkey: u32, addr: u64, length: u32) -> Wqe {
    let mut wqe = Wqe {
        wr_id: 9.into(),
        opcode: (WrOpcode::Send as u32).into(),
        flags: WR_SIGNALED.into(),
        num_sge: 1.into(),
        ..Default::default()
    };
    wqe.sge[0] = Sge { addr: addr.into(), length: length.into(), lkey: lkey.into() };
    wqe
}

/// A file with a PD, a CQ, a QP and a 4 KiB MR at 0x10000.
struct Fixture {
    hca: FakeHca,
    file: FileContext,
    cq: u32,
    qp: u32,
    lkey: u32,
}

fn fixture() -> Fixture {
    let mut hca = FakeHca::default();
    let mut file = opened(&mut hca);
    let pd = new_pd(&mut hca, &mut file);
    let cq = new_cq(&mut hca, &mut file);
    let qp = new_qp(&mut hca, &mut file, pd, cq);
    let lkey = new_mr(&mut hca, &mut file, pd, 0x10000, 4096);
    Fixture { hca, file, cq, qp, lkey }
}

fn post_status(f: &mut Fixture, code: u32, wqes: &[Wqe], count: u32) -> ControlReply {
    let req = PostIn { qpn: f.qp.into(), count: count.into() };
    let mut bytes: Vec<u8> = wqes.iter().flat_map(|w| w.as_bytes().to_vec()).collect();
    dispatch(&mut f.hca, &mut f.file, code, req.as_bytes(), &mut bytes)
}

#[test]
fn a_verbs_session_runs_and_cleanup_releases_dependents_first() {
    let mut f = fixture();
    let wqe = send_wqe(f.lkey, 0x10000, 64);
    assert_eq!(
        post_status(&mut f, IOCTL_VHCA_POST_SEND, &[wqe], 1),
        ControlReply { status: STATUS_SUCCESS, information: 64 }
    );
    assert_eq!(f.hca.posted, vec![(f.qp, wqe)]);
    f.hca.completions = vec![Cqe { wr_id: 9.into(), ..Default::default() }];
    let poll = PollCqIn { cq: f.cq.into(), max: 4.into() };
    let (reply, out) = call(&mut f.hca, &mut f.file, IOCTL_VHCA_POLL_CQ, poll.as_bytes(), 4 * CQE_SIZE);
    assert_eq!(reply, ControlReply { status: STATUS_SUCCESS, information: CQE_SIZE });
    assert_eq!(Cqe::read_from_prefix(&out).unwrap().0.wr_id.get(), 9);
    let (reply, out) = call(&mut f.hca, &mut f.file, IOCTL_VHCA_QUERY_DEVICE, &[], 64);
    assert_eq!(reply.information, size_of::<QueryDeviceResp>());
    assert_eq!(QueryDeviceResp::read_from_bytes(&out[..reply.information]).unwrap().max_cq.get(), 7);

    let released = f.file.release(&mut f.hca);
    assert_eq!(released, ReleasedObjects { qps: 1, mrs: 1, cqs: 1, pds: 1, failed: 0 });
    assert_eq!(f.hca.destroyed, ["qp", "mr", "cq", "pd"]);
    assert!(f.hca.qps.is_empty() && f.hca.cqs.is_empty() && f.hca.pds.is_empty() && f.hca.mrs.is_empty());
    assert_eq!(f.file.live_objects(), 0);
}

#[test]
fn an_unknown_code_or_a_known_function_with_another_method_is_an_invalid_device_request() {
    let mut f = fixture();
    assert_eq!(status(&mut f.hca, &mut f.file, 0x0022_0000, &[], 0), STATUS_INVALID_DEVICE_REQUEST);
    // POLL_CQ's function and access with METHOD_BUFFERED: the method is part of the code, not a hint.
    let buffered_poll = (IOCTL_VHCA_POLL_CQ & !3) | TransferMethod::Buffered as u32;
    let poll = PollCqIn { cq: f.cq.into(), max: 1.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, buffered_poll, poll.as_bytes(), 32), STATUS_INVALID_DEVICE_REQUEST);
}

#[test]
fn verbs_before_open_context_are_refused_and_reach_no_verb() {
    let mut hca = FakeHca::default();
    let mut file = FileContext::new();
    let req = CreateCqIn { entries: 16.into(), reserved: 0.into() };
    assert_eq!(status(&mut hca, &mut file, IOCTL_VHCA_CREATE_CQ, req.as_bytes(), 8), STATUS_INVALID_DEVICE_STATE);
    assert!(hca.cqs.is_empty());
}

#[test]
fn open_context_twice_or_with_another_abi_is_refused() {
    let mut hca = FakeHca::default();
    let mut file = FileContext::new();
    let wrong = OpenContextIn { abi_version: (USER_ABI_VERSION + 1).into(), reserved: 0.into() };
    assert_eq!(status(&mut hca, &mut file, IOCTL_VHCA_OPEN_CONTEXT, wrong.as_bytes(), 16), STATUS_NOT_SUPPORTED);
    let mut file = opened(&mut hca);
    let again = OpenContextIn { abi_version: USER_ABI_VERSION.into(), reserved: 0.into() };
    assert_eq!(status(&mut hca, &mut file, IOCTL_VHCA_OPEN_CONTEXT, again.as_bytes(), 16), STATUS_INVALID_DEVICE_STATE);
}

#[test]
fn an_input_of_another_length_is_an_invalid_parameter() {
    let mut f = fixture();
    let req = CreateCqIn { entries: 16.into(), reserved: 0.into() };
    let short = &req.as_bytes()[..4];
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_CREATE_CQ, short, 8), STATUS_INVALID_PARAMETER);
    let mut long = req.as_bytes().to_vec();
    long.extend([0; 4]);
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_CREATE_CQ, &long, 8), STATUS_INVALID_PARAMETER);
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_ALLOC_PD, &[0; 8], 8), STATUS_INVALID_PARAMETER);
    assert_eq!(f.hca.cqs.len(), 1, "only the fixture's CQ");
    assert_eq!(f.hca.pds.len(), 1, "only the fixture's PD");
}

#[test]
fn a_nonzero_reserved_field_is_an_invalid_parameter() {
    let mut f = fixture();
    let req = CreateCqIn { entries: 16.into(), reserved: 1.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_CREATE_CQ, req.as_bytes(), 8), STATUS_INVALID_PARAMETER);
    assert_eq!(f.hca.cqs.len(), 1);
    let destroy = HandleIn { handle: f.cq.into(), reserved: 2.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_DESTROY_CQ, destroy.as_bytes(), 0), STATUS_INVALID_PARAMETER);
    assert!(f.hca.cqs.contains(&f.cq));
    let notify = NotifyCqIn { cq: f.cq.into(), flags: 2.into() };
    assert_eq!(
        status(&mut f.hca, &mut f.file, IOCTL_VHCA_REQ_NOTIFY_CQ, notify.as_bytes(), 0),
        STATUS_INVALID_PARAMETER
    );
}

#[test]
fn an_output_too_small_is_refused_before_the_object_is_made() {
    let mut f = fixture();
    let req = CreateCqIn { entries: 16.into(), reserved: 0.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_CREATE_CQ, req.as_bytes(), 7), STATUS_BUFFER_TOO_SMALL);
    assert_eq!(f.hca.cqs.len(), 1, "no CQ the caller was never told about");
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_ALLOC_PD, &[], 4), STATUS_BUFFER_TOO_SMALL);
    assert_eq!(f.hca.pds.len(), 1);
    let mr = RegMrIn { addr: 0x20000.into(), length: 64.into(), pd: 1.into(), access: 0.into(), reserved: 0.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_REG_MR, mr.as_bytes(), 20), STATUS_BUFFER_TOO_SMALL);
    assert_eq!(f.hca.mrs.len(), 1);
}

#[test]
fn another_files_handles_are_invalid_handles() {
    let mut f = fixture();
    let mut other = opened(&mut f.hca);
    let their_pd = new_pd(&mut f.hca, &mut other);
    let their_cq = new_cq(&mut f.hca, &mut other);
    let destroy = HandleIn { handle: their_cq.into(), reserved: 0.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_DESTROY_CQ, destroy.as_bytes(), 0), STATUS_INVALID_HANDLE);
    assert!(f.hca.cqs.contains(&their_cq), "the other file's CQ lives on");
    let qp = CreateQpIn {
        pd: their_pd.into(),
        send_cq: f.cq.into(),
        recv_cq: f.cq.into(),
        sq_entries: 8.into(),
        rq_entries: 8.into(),
        reserved: 0.into(),
    };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_CREATE_QP, qp.as_bytes(), 8), STATUS_INVALID_HANDLE);
    let qp = CreateQpIn { pd: 1.into(), recv_cq: their_cq.into(), ..qp };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_CREATE_QP, qp.as_bytes(), 8), STATUS_INVALID_HANDLE);
    assert_eq!(f.hca.qps.len(), 1);
    let poll = PollCqIn { cq: their_cq.into(), max: 1.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_POLL_CQ, poll.as_bytes(), 32), STATUS_INVALID_HANDLE);
    let their_mr = new_mr(&mut f.hca, &mut other, their_pd, 0x40000, 4096);
    let dereg = HandleIn { handle: their_mr.into(), reserved: 0.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_DEREG_MR, dereg.as_bytes(), 0), STATUS_INVALID_HANDLE);
    assert!(f.hca.mrs.contains(&their_mr));
}

#[test]
fn a_work_request_naming_another_files_mr_or_outside_its_own_is_refused_whole() {
    let mut f = fixture();
    let mut other = opened(&mut f.hca);
    let their_pd = new_pd(&mut f.hca, &mut other);
    let their_mr = new_mr(&mut f.hca, &mut other, their_pd, 0x40000, 4096);
    let good = send_wqe(f.lkey, 0x10000, 64);
    let theirs = send_wqe(their_mr, 0x40000, 64);
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[good, theirs], 2).status, STATUS_INVALID_HANDLE);
    // One byte past the MR's end.
    let past = send_wqe(f.lkey, 0x10000 + 4096 - 63, 64);
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[good, past], 2).status, STATUS_INVALID_PARAMETER);
    let before = send_wqe(f.lkey, 0xFFFF, 64);
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[before], 1).status, STATUS_INVALID_PARAMETER);
    let wrapping = send_wqe(f.lkey, u64::MAX - 8, 64);
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[wrapping], 1).status, STATUS_INVALID_PARAMETER);
    assert!(f.hca.posted.is_empty(), "a refused request posts none of its WQEs");
}

#[test]
fn a_malformed_work_request_is_an_invalid_parameter() {
    let mut f = fixture();
    let good = send_wqe(f.lkey, 0x10000, 64);
    let too_many_sges = Wqe { num_sge: 3.into(), ..good };
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[too_many_sges], 1).status, STATUS_INVALID_PARAMETER);
    let mut unused_sge_set = good;
    unused_sge_set.sge[1].length = 1.into();
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[unused_sge_set], 1).status, STATUS_INVALID_PARAMETER);
    let unknown_flag = Wqe { flags: 0x80.into(), ..good };
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[unknown_flag], 1).status, STATUS_INVALID_PARAMETER);
    let unknown_opcode = Wqe { opcode: 77.into(), ..good };
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[unknown_opcode], 1).status, STATUS_INVALID_PARAMETER);
    // A SEND on the receive queue and a RECV on the send queue.
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_RECV, &[good], 1).status, STATUS_INVALID_PARAMETER);
    let recv = Wqe { opcode: (WrOpcode::Recv as u32).into(), flags: 0.into(), ..good };
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[recv], 1).status, STATUS_INVALID_PARAMETER);
    assert!(f.hca.posted.is_empty());
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_RECV, &[recv], 1).status, STATUS_SUCCESS);
}

#[test]
fn a_work_array_of_the_wrong_count_or_record_size_is_an_invalid_parameter() {
    let mut f = fixture();
    let good = send_wqe(f.lkey, 0x10000, 64);
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[good], 0).status, STATUS_INVALID_PARAMETER);
    assert_eq!(post_status(&mut f, IOCTL_VHCA_POST_SEND, &[good], 2).status, STATUS_INVALID_PARAMETER);
    let many = vec![good; MAX_WORK_PER_REQUEST as usize + 1];
    assert_eq!(
        post_status(&mut f, IOCTL_VHCA_POST_SEND, &many, MAX_WORK_PER_REQUEST + 1).status,
        STATUS_INVALID_PARAMETER
    );
    let req = PostIn { qpn: f.qp.into(), count: 1.into() };
    let mut ragged = good.as_bytes().to_vec();
    ragged.push(0);
    assert_eq!(
        dispatch(&mut f.hca, &mut f.file, IOCTL_VHCA_POST_SEND, req.as_bytes(), &mut ragged).status,
        STATUS_INVALID_PARAMETER
    );
    assert!(f.hca.posted.is_empty());
}

#[test]
fn a_poll_whose_buffer_cannot_hold_max_cqes_is_refused() {
    let mut f = fixture();
    f.hca.completions = vec![Cqe::default(); 4];
    let poll = PollCqIn { cq: f.cq.into(), max: 4.into() };
    assert_eq!(
        status(&mut f.hca, &mut f.file, IOCTL_VHCA_POLL_CQ, poll.as_bytes(), 3 * CQE_SIZE),
        STATUS_BUFFER_TOO_SMALL
    );
    assert_eq!(
        status(&mut f.hca, &mut f.file, IOCTL_VHCA_POLL_CQ, poll.as_bytes(), 4 * CQE_SIZE + 1),
        STATUS_INVALID_PARAMETER
    );
    let none = PollCqIn { cq: f.cq.into(), max: 0.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_POLL_CQ, none.as_bytes(), 0), STATUS_INVALID_PARAMETER);
    assert_eq!(f.hca.completions.len(), 4, "no completion taken by a refused poll");
}

#[test]
fn a_registration_of_an_empty_wrapping_or_oddly_accessed_range_is_an_invalid_parameter() {
    let mut f = fixture();
    let mr = |addr: u64, length: u32, access: u32| RegMrIn {
        addr: addr.into(),
        length: length.into(),
        pd: 1.into(),
        access: access.into(),
        reserved: 0.into(),
    };
    for bad in [mr(0x20000, 0, 1), mr(0, 64, 1), mr(u64::MAX - 10, 64, 1), mr(0x20000, 64, 0x40)] {
        assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_REG_MR, bad.as_bytes(), 24), STATUS_INVALID_PARAMETER);
    }
    assert_eq!(f.hca.mrs.len(), 1);
}

#[test]
fn a_file_at_its_object_cap_gets_insufficient_resources() {
    let mut hca = FakeHca::default();
    let mut file = opened(&mut hca);
    for _ in 0..MAX_OBJECTS_PER_FILE {
        new_cq(&mut hca, &mut file);
    }
    let req = CreateCqIn { entries: 16.into(), reserved: 0.into() };
    assert_eq!(status(&mut hca, &mut file, IOCTL_VHCA_CREATE_CQ, req.as_bytes(), 8), STATUS_INSUFFICIENT_RESOURCES);
    assert_eq!(hca.cqs.len(), MAX_OBJECTS_PER_FILE);
}

#[test]
fn a_verb_the_driver_core_refuses_answers_its_status() {
    let mut f = fixture();
    let req = CreateCqIn { entries: 12.into(), reserved: 0.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_CREATE_CQ, req.as_bytes(), 8), STATUS_INVALID_PARAMETER);
    assert_eq!(status_of(DriverError::UnknownHandle(3)), STATUS_INVALID_HANDLE);
    assert_eq!(status_of(DriverError::QueueFull), STATUS_DEVICE_BUSY);
    assert_eq!(status_of(DriverError::NoMemory { routine: "x", bytes: 1 }), STATUS_INSUFFICIENT_RESOURCES);
}

#[test]
fn a_forgotten_file_keeps_its_context_and_names_nothing() {
    let mut f = fixture();
    f.file.forget();
    assert_eq!(f.file.live_objects(), 0);
    let destroy = HandleIn { handle: f.cq.into(), reserved: 0.into() };
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_DESTROY_CQ, destroy.as_bytes(), 0), STATUS_INVALID_HANDLE);
    // Still opened: a new object needs no second OPEN_CONTEXT.
    let pd = new_pd(&mut f.hca, &mut f.file);
    assert!(f.file.live_objects() == 1 && f.hca.pds.contains(&pd));
}

#[test]
fn wait_cq_answers_at_once_when_the_cq_has_completions_and_pends_while_it_has_none() {
    let mut f = fixture();
    let wait = PollCqIn { cq: f.cq.into(), max: 2.into() };
    let (reply, _) = call(&mut f.hca, &mut f.file, IOCTL_VHCA_WAIT_CQ, wait.as_bytes(), 2 * CQE_SIZE);
    assert_eq!(reply, ControlReply { status: STATUS_PENDING, information: 0 }, "an empty CQ: kept pending");
    let mut out = vec![0u8; 2 * CQE_SIZE];
    assert_eq!(poll_for_wait(&mut f.hca, &f.file, wait.as_bytes(), &mut out), None, "still empty");
    f.hca.completions = vec![Cqe { wr_id: 5.into(), ..Default::default() }];
    let reply = poll_for_wait(&mut f.hca, &f.file, wait.as_bytes(), &mut out);
    assert_eq!(reply, Some(ControlReply { status: STATUS_SUCCESS, information: CQE_SIZE }));
    assert_eq!(Cqe::read_from_prefix(&out).unwrap().0.wr_id.get(), 5);
    f.hca.completions = vec![Cqe { wr_id: 6.into(), ..Default::default() }];
    let (reply, out) = call(&mut f.hca, &mut f.file, IOCTL_VHCA_WAIT_CQ, wait.as_bytes(), 2 * CQE_SIZE);
    assert_eq!(reply, ControlReply { status: STATUS_SUCCESS, information: CQE_SIZE }, "completions: at once");
    assert_eq!(Cqe::read_from_prefix(&out).unwrap().0.wr_id.get(), 6);
}

#[test]
fn wait_cq_is_checked_as_poll_cq_and_a_destroyed_cq_ends_the_wait() {
    let mut f = fixture();
    let foreign = PollCqIn { cq: (f.cq + 100).into(), max: 1.into() };
    assert_eq!(
        status(&mut f.hca, &mut f.file, IOCTL_VHCA_WAIT_CQ, foreign.as_bytes(), CQE_SIZE),
        STATUS_INVALID_HANDLE
    );
    let none = PollCqIn { cq: f.cq.into(), max: 0.into() };
    assert_eq!(
        status(&mut f.hca, &mut f.file, IOCTL_VHCA_WAIT_CQ, none.as_bytes(), CQE_SIZE),
        STATUS_INVALID_PARAMETER
    );
    let wait = PollCqIn { cq: f.cq.into(), max: 1.into() };
    assert_eq!(
        status(&mut f.hca, &mut f.file, IOCTL_VHCA_WAIT_CQ, wait.as_bytes(), CQE_SIZE - 1),
        STATUS_INVALID_PARAMETER
    );
    let mut unopened = FileContext::new();
    assert_eq!(
        status(&mut f.hca, &mut unopened, IOCTL_VHCA_WAIT_CQ, wait.as_bytes(), CQE_SIZE),
        STATUS_INVALID_DEVICE_STATE
    );
    let destroy = HandleIn { handle: f.cq.into(), reserved: 0.into() };
    // The fixture's QP uses the CQ; the fake does not care, the file's table is what the wait is checked against.
    assert_eq!(status(&mut f.hca, &mut f.file, IOCTL_VHCA_DESTROY_CQ, destroy.as_bytes(), 0), STATUS_SUCCESS);
    let mut out = vec![0u8; CQE_SIZE];
    let reply = poll_for_wait(&mut f.hca, &f.file, wait.as_bytes(), &mut out);
    assert_eq!(reply, Some(ControlReply { status: STATUS_INVALID_HANDLE, information: 0 }));
}
