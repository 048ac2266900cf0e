//! The committed seed corpus, built from the protocol's own layouts rather than typed in as bytes: each seed is a
//! well-formed session the fuzzer mutates from, so it starts deep in the state machines. `tests/replay.rs` checks
//! the files in corpus/ are exactly these and replays them.

use vhca_proto::{
    CommandHeader, CreateCqReq, CreateQpReq, Doorbell, HandleReq, ModifyQpReq, Opcode, QpState, RegMrReq, Sge, Wqe,
    WrOpcode, ACCESS_ALL, QP_ATTR_ACCESS_FLAGS, QP_ATTR_DEST_QPN, QP_ATTR_STATE, QP_TYPE_RC,
};
use zerocopy::IntoBytes;

use crate::hca_commands::{command_record, encode, OP_DOORBELLS, OP_GUEST_WRITE, OP_INVALIDATE, OP_RAW_COMMAND};
use crate::vhost_user_connection::{guest_write, message, FD_EVENTFD, FD_MEMFD, FD_SOCKET, FLAG_NEED_REPLY, RAM_SIZE};

/// (target, seed name, bytes).
pub fn all() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let mut seeds = vec![
        ("hca_commands", "loopback-rdma-write", hca_loopback(true)),
        ("hca_commands", "loopback-no-invalidate", hca_loopback(false)),
        ("hca_commands", "raw-short-request", [vec![3], encode(OP_RAW_COMMAND, &[1, 0, 0, 0, 7])].concat()),
        ("vhost_user_connection", "iommu-mapped-query", vhost_session(IotlbAt::BeforeKick)),
        ("vhost_user_connection", "iommu-miss-then-update", vhost_session(IotlbAt::AfterKick)),
        ("vhost_user_connection", "no-iommu", vhost_session(IotlbAt::Never)),
    ];
    for (name, text) in SERIAL {
        seeds.push(("serial_console", name, text.as_bytes().to_vec()));
    }
    for (name, text) in QMP {
        seeds.push(("qmp_events", name, text.as_bytes().to_vec()));
    }
    for (name, text) in EVENT_LOG {
        seeds.push(("event_log", name, text.as_bytes().to_vec()));
    }
    seeds.push(("suite_file", "seed-suite", vhca_suite::SEED_SUITE.as_bytes().to_vec()));
    seeds.push(("ioctl_dispatch", "two-files-verbs-session", ioctl_session()));
    seeds
}

const SERIAL: &[(&str, &str)] = &[
    ("result-pass", "[    1.234567] vhca: probe\nVHCA-RESULT {\"scenario\":\"smoke\",\"ok\":true}\n"),
    (
        "stop-line",
        "*** STOP: 0x000000E6 (0x0000000000000026,0x0000000000001000,0x0000000000000000,0x0000000000000000)\nDRIVER_VERIFIER_DMA_VIOLATION\n",
    ),
    ("linux-panic", "<0>[    2.000000] Kernel panic - not syncing: Fatal exception\n[    T1] BUG: unable to handle page fault\nOops: 0000 [#1]\n"),
    ("cut-result", "VHCA-RESULT {\"scenario\":\"verbs\",\"ok\":tr"),
];

const QMP: &[(&str, &str)] = &[
    ("hyperv-panic", "{\"event\": \"GUEST_PANICKED\", \"data\": {\"action\": \"pause\", \"info\": {\"type\": \"hyper-v\", \"arg1\": 230, \"arg2\": 38, \"arg3\": 4096, \"arg4\": 0, \"arg5\": 0}}}\n{\"event\": \"SHUTDOWN\", \"data\": {\"guest\": true}}\n"),
    ("plain-panic", "{\"event\": \"GUEST_PANICKED\", \"data\": {\"action\": \"poweroff\"}}\n"),
];

const EVENT_LOG: &[(&str, &str)] = &[(
    "device-log",
    r#"{"seq":0,"t_us":0,"kind":"start","schema":1,"pid":7,"socket":"s","map_registers":64,"version":"0"}
{"seq":1,"t_us":10,"kind":"iotlb_update","iova":4096,"size":4096,"uaddr":140000000000,"perm":"rw"}
{"seq":2,"t_us":20,"kind":"desc","queue":0,"iova":4096,"len":16,"writable":false,"uaddr":140000000000}
{"seq":3,"t_us":120,"kind":"map","owner":"cq","handle":1,"registers":4,"first_iova":4096,"in_use":4,"free":60}
{"seq":4,"t_us":150,"kind":"command","opcode":"CREATE_CQ","tag":1,"status":"OK"}
{"seq":5,"t_us":300,"kind":"fault","cause":"iommu_unmapped","dir":"write","purpose":"cqe","iova":8192}
{"seq":6,"t_us":310,"kind":"dma_fault","iova":8192,"cause":"iommu_unmapped","queue":0}
{"seq":7,"t_us":320,"kind":"iotlb_invalidate","iova":4096,"size":4096}
{"seq":8,"t_us":500,"kind":"unmap","owner":"cq","handle":1,"registers":4,"in_use":0,"free":64}
{"seq":9,"t_us":5"#,
)];

fn modify(qpn: u32, mask: u32, state: QpState, dest: u32) -> Vec<u8> {
    let req = ModifyQpReq {
        qpn: qpn.into(),
        attr_mask: mask.into(),
        state: (state as u32).into(),
        dest_qpn: dest.into(),
        access: ACCESS_ALL.into(),
        reserved: 0.into(),
    };
    command_record(Opcode::ModifyQp, 6, &[], req.as_bytes())
}

/// A driver's loopback RDMA WRITE: PD, CQ, QP to itself in RTS, two MRs, a WQE in the SQ page, the doorbell;
/// optionally the destination MR's page invalidated and a second WQE rung against it; then teardown.
fn hca_loopback(invalidate: bool) -> Vec<u8> {
    const QPN: u32 = 0x10;
    let (src_addr, dst_addr) = (0x7000_0000_0000u64, 0x7000_0100_0000u64);
    let mut input = vec![63];
    input.extend(command_record(Opcode::AllocPd, 1, &[], &[]));
    let cq = CreateCqReq { entries: 64.into(), page_count: 1.into() };
    input.extend(command_record(Opcode::CreateCq, 2, &[0], cq.as_bytes()));
    let qp = CreateQpReq {
        pd: 1.into(),
        qp_type: QP_TYPE_RC.into(),
        send_cq: 1.into(),
        recv_cq: 1.into(),
        sq_entries: 16.into(),
        rq_entries: 16.into(),
        sq_page_count: 1.into(),
        rq_page_count: 1.into(),
    };
    input.extend(command_record(Opcode::CreateQp, 3, &[1, 2], qp.as_bytes()));
    for (addr, pages) in [(src_addr, [3u8, 4]), (dst_addr, [5, 6])] {
        let mr = RegMrReq {
            pd: 1.into(),
            access: ACCESS_ALL.into(),
            addr: addr.into(),
            length: 0x2000.into(),
            first_page_offset: 0.into(),
            page_count: 2.into(),
        };
        input.extend(command_record(Opcode::RegMr, 4, &pages, mr.as_bytes()));
    }
    input.extend(modify(QPN, QP_ATTR_STATE | QP_ATTR_ACCESS_FLAGS, QpState::Init, 0));
    input.extend(modify(QPN, QP_ATTR_STATE | QP_ATTR_DEST_QPN, QpState::Rtr, QPN));
    input.extend(modify(QPN, QP_ATTR_STATE, QpState::Rts, 0));
    input.extend(encode(OP_GUEST_WRITE, &[[3, 0, 0].as_slice(), &[0x5a; 64]].concat()));
    let rounds = if invalidate { 2u32 } else { 1 };
    for n in 0..rounds {
        let mut wqe = Wqe {
            wr_id: u64::from(n + 1).into(),
            opcode: (WrOpcode::RdmaWrite as u32).into(),
            flags: 1.into(),
            remote_addr: dst_addr.into(),
            rkey: 0x101.into(),
            num_sge: 1.into(),
            ..Wqe::default()
        };
        wqe.sge[0] = Sge { addr: src_addr.into(), length: 64.into(), lkey: 0x100.into() };
        let offset = (n * 64) as u16;
        input.extend(encode(OP_GUEST_WRITE, &[&[1][..], &offset.to_le_bytes(), wqe.as_bytes()].concat()));
        if n == 1 {
            input.extend(encode(OP_INVALIDATE, &[5, 0]));
        }
        let db = Doorbell { kind: 1.into(), handle: QPN.into(), index: (n + 1).into(), flags: 0.into() };
        input.extend(encode(OP_DOORBELLS, db.as_bytes()));
    }
    for (opcode, handle) in
        [(Opcode::DestroyQp, QPN), (Opcode::DeregMr, 0x100), (Opcode::DeregMr, 0x101), (Opcode::DestroyCq, 1)]
    {
        let req = HandleReq { handle: handle.into(), reserved: 0.into() };
        input.extend(command_record(opcode, 9, &[], req.as_bytes()));
    }
    input.extend(command_record(
        Opcode::DeallocPd,
        9,
        &[],
        HandleReq { handle: 1.into(), reserved: 0.into() }.as_bytes(),
    ));
    input
}

#[derive(PartialEq)]
enum IotlbAt {
    BeforeKick,
    AfterKick,
    Never,
}

/// QEMU's set-up of queue 0 with a QUERY_DEVICE chain already in guest RAM, behind the IOMMU or not.
fn vhost_session(iotlb: IotlbAt) -> Vec<u8> {
    const IOVA: u64 = 0x8000_0000;
    const UADDR: u64 = 0x7f12_3400_0000;
    let (desc, avail, used, req, resp) = (0x1000u64, 0x2000u64, 0x3000u64, 0x4000u64, 0x5000u64);
    let base = if iotlb == IotlbAt::Never { UADDR } else { IOVA };
    let buf_base = if iotlb == IotlbAt::Never { 0 } else { IOVA };
    let ne = |words: &[u64]| words.iter().flat_map(|w| w.to_ne_bytes()).collect::<Vec<u8>>();
    let state = |index: u32, num: u32| [index.to_ne_bytes(), num.to_ne_bytes()].concat();
    let mut input = Vec::new();
    // Guest RAM: descriptors (little-endian, as virtio lays them), the avail ring, the request.
    let mut descs = Vec::new();
    for (addr, len, flags, next) in [(buf_base + req, 16u32, 1u16, 1u16), (buf_base + resp, 64, 2, 0)] {
        descs.extend(addr.to_le_bytes());
        descs.extend(len.to_le_bytes());
        descs.extend(flags.to_le_bytes());
        descs.extend(next.to_le_bytes());
    }
    input.extend(guest_write(desc as u16, &descs));
    input.extend(guest_write(avail as u16, &[0, 0, 1, 0, 0, 0]));
    let request = CommandHeader {
        opcode: (Opcode::QueryDevice as u32).into(),
        tag: 7.into(),
        body_len: 0.into(),
        reserved: 0.into(),
    };
    input.extend(guest_write(req as u16, request.as_bytes()));

    let features = (1u64 << 32) | (1 << 30) | if iotlb == IotlbAt::Never { 0 } else { 1 << 33 };
    input.extend(message(3, 1, &[], &[]));
    input.extend(message(1, 1, &[], &[]));
    input.extend(message(2, 1, &[], &features.to_ne_bytes()));
    input.extend(message(15, 1, &[], &[]));
    input.extend(message(16, 1, &[], &0x229u64.to_ne_bytes()));
    input.extend(message(21, 1 | FLAG_NEED_REPLY, &[FD_SOCKET], &[]));
    let table = [vec![1, 0, 0, 0, 0, 0, 0, 0], ne(&[0, RAM_SIZE, UADDR, 0])].concat();
    input.extend(message(5, 1 | FLAG_NEED_REPLY, &[FD_MEMFD], &table));
    let update = [ne(&[IOVA, RAM_SIZE, UADDR]), vec![3, 2, 0, 0, 0, 0, 0, 0]].concat();
    input.extend(message(8, 1 | FLAG_NEED_REPLY, &[], &state(0, 16)));
    let addr = [state(0, 0), ne(&[base + desc, base + used, base + avail, 0])].concat();
    input.extend(message(9, 1 | FLAG_NEED_REPLY, &[], &addr));
    input.extend(message(10, 1 | FLAG_NEED_REPLY, &[], &state(0, 0)));
    input.extend(message(13, 1 | FLAG_NEED_REPLY, &[FD_EVENTFD], &0u64.to_ne_bytes()));
    if iotlb == IotlbAt::BeforeKick {
        input.extend(message(22, 1 | FLAG_NEED_REPLY, &[], &update));
    }
    input.extend(message(12, 1 | FLAG_NEED_REPLY, &[FD_EVENTFD], &0u64.to_ne_bytes()));
    input.extend(message(18, 1 | FLAG_NEED_REPLY, &[], &state(0, 1)));
    if iotlb == IotlbAt::AfterKick {
        input.extend(message(22, 1 | FLAG_NEED_REPLY, &[], &update));
    }
    if iotlb != IotlbAt::Never {
        let invalidate = [ne(&[IOVA + resp, 0x1000, 0]), vec![0, 3, 0, 0, 0, 0, 0, 0]].concat();
        input.extend(message(22, 1 | FLAG_NEED_REPLY, &[], &invalidate));
    }
    input.extend(message(11, 1, &[], &state(0, 0)));
    input
}

/// File 0 opens a context and makes a PD, a CQ, a QP and an MR, posts a SEND and polls; file 1 opens and names file
/// 0's CQ and MR (refused); file 0 closes with everything live, so CLEANUP has work.
fn ioctl_session() -> Vec<u8> {
    use crate::ioctl_dispatch::{record, selector::*};
    use vhca_driver_core::ioctl_codec::*;
    let open = OpenContextIn { abi_version: USER_ABI_VERSION.into(), reserved: 0.into() };
    let cq = CreateCqIn { entries: 16.into(), reserved: 0.into() };
    // The model numbers objects from 1 in creation order: PD 1, CQ 2, QP 3, MR 4.
    let qp = CreateQpIn {
        pd: 1.into(),
        send_cq: 2.into(),
        recv_cq: 2.into(),
        sq_entries: 8.into(),
        rq_entries: 8.into(),
        reserved: 0.into(),
    };
    let mr = RegMrIn { addr: 0x10000.into(), length: 4096.into(), pd: 1.into(), access: 1.into(), reserved: 0.into() };
    let mut wqe = Wqe { wr_id: 1.into(), opcode: (WrOpcode::Send as u32).into(), num_sge: 1.into(), ..Wqe::default() };
    wqe.sge[0] = Sge { addr: 0x10000.into(), length: 64.into(), lkey: 4.into() };
    let post = PostIn { qpn: 3.into(), count: 1.into() };
    let poll = PollCqIn { cq: 2.into(), max: 4.into() };
    let theirs = HandleIn { handle: 2.into(), reserved: 0.into() };
    let their_mr = HandleIn { handle: 4.into(), reserved: 0.into() };
    [
        record(0, OPEN_CONTEXT, open.as_bytes(), 16, &[]),
        record(0, QUERY_DEVICE, &[], 64, &[]),
        record(0, ALLOC_PD, &[], 8, &[]),
        record(0, CREATE_CQ, cq.as_bytes(), 8, &[]),
        record(0, CREATE_QP, qp.as_bytes(), 8, &[]),
        record(0, REG_MR, mr.as_bytes(), 24, &[]),
        record(0, POST_SEND, post.as_bytes(), 64, wqe.as_bytes()),
        record(0, POLL_CQ, poll.as_bytes(), 128, &[]),
        record(1, OPEN_CONTEXT, open.as_bytes(), 16, &[]),
        record(1, DESTROY_CQ, theirs.as_bytes(), 0, &[]),
        record(1, DEREG_MR, their_mr.as_bytes(), 0, &[]),
        record(0, CLOSE, &[], 0, &[]),
    ]
    .concat()
}
