//! Every command and every command status, through `Hca::execute` with a fake IOMMU; map-register exhaustion to
//! the exact register.

mod common;

use common::*;
use vhca_hca::HcaConfig;
use vhca_proto::*;
use zerocopy::{FromBytes, IntoBytes};

fn handle_req(h: u32) -> Vec<u8> {
    HandleReq { handle: h.into(), reserved: 0.into() }.as_bytes().to_vec()
}

#[test]
fn query_device_reports_limits_and_register_use() {
    let mut rig = Rig::with_registers(100);
    let d = rig.query_device();
    assert_eq!(d.abi_version.get(), u32::from(ABI_VERSION));
    assert_eq!(d.map_registers_total.get(), 100);
    assert_eq!(d.map_registers_free.get(), 100);
    assert_eq!(d.page_size.get(), PAGE_SIZE as u32);
    assert_eq!(d.max_sge.get(), MAX_SGE as u32);
    rig.create_cq(256); // 256 * 32 bytes = 2 pages
    assert_eq!(rig.free_registers(), 98);
    assert_eq!(rig.hca.device_config().map_registers.get(), 100);
    assert_eq!(rig.hca.device_config().magic.get(), CONFIG_MAGIC);
}

#[test]
fn query_port() {
    let mut rig = Rig::with_registers(8);
    let (status, body) =
        rig.cmd(Opcode::QueryPort, QueryPortReq { port: 1.into(), reserved: 0.into() }.as_bytes(), &[]);
    assert_eq!(status, Status::Ok);
    let port = QueryPortResp::read_from_bytes(&body).unwrap();
    assert_eq!(port.state.get(), PORT_STATE_ACTIVE);
    assert_eq!(port.active_mtu.get(), MTU_4096);
    let (status, body) =
        rig.cmd(Opcode::QueryPort, QueryPortReq { port: 2.into(), reserved: 0.into() }.as_bytes(), &[]);
    assert_eq!((status, body.len()), (Status::InvalidParam, 0));
}

#[test]
fn pd_lifecycle() {
    let mut rig = Rig::with_registers(8);
    let pd = rig.alloc_pd();
    let mr = rig.reg_mr(pd, ACCESS_LOCAL_WRITE, 100);
    assert_eq!(rig.cmd(Opcode::DeallocPd, &handle_req(pd), &[]).0, Status::InvalidState);
    assert_eq!(rig.dereg_mr(mr.key), Status::Ok);
    assert_eq!(rig.cmd(Opcode::DeallocPd, &handle_req(pd), &[]).0, Status::Ok);
    assert_eq!(rig.cmd(Opcode::DeallocPd, &handle_req(pd), &[]).0, Status::InvalidHandle);
    let refused = rig.events_of("refused");
    assert!(refused.iter().any(|e| e["reason"].as_str().unwrap().contains("still has MRs")), "{refused:?}");
    let objects = rig.events_of("object");
    assert!(objects.iter().any(|e| e["action"] == "destroy" && e["object"] == "pd" && e["handle"] == pd));
}

#[test]
fn cq_lifecycle_and_parameter_checks() {
    let mut rig = Rig::with_registers(16);
    let cq = rig.create_cq(64);
    assert_eq!(rig.free_registers(), 15);
    // Not a power of two, zero, too large.
    for entries in [0u32, 3, 1 << 20] {
        let req = CreateCqReq { entries: entries.into(), page_count: 1.into() };
        assert_eq!(rig.cmd(Opcode::CreateCq, req.as_bytes(), &[0x1000]).0, Status::InvalidParam, "entries {entries}");
    }
    // Page count that does not match the ring size.
    let req = CreateCqReq { entries: 64.into(), page_count: 2.into() };
    assert_eq!(rig.cmd(Opcode::CreateCq, req.as_bytes(), &[0x1000, 0x2000]).0, Status::InvalidParam);
    // Unaligned page.
    let req = CreateCqReq { entries: 64.into(), page_count: 1.into() };
    assert_eq!(rig.cmd(Opcode::CreateCq, req.as_bytes(), &[0x1008]).0, Status::InvalidParam);
    assert_eq!(rig.free_registers(), 15, "refused commands take no registers");

    let pd = rig.alloc_pd();
    let qp = rig.create_qp(pd, cq.handle, cq.handle);
    assert_eq!(rig.cmd(Opcode::DestroyCq, &handle_req(cq.handle), &[]).0, Status::InvalidState);
    assert_eq!(rig.cmd(Opcode::DestroyQp, &handle_req(qp.qpn), &[]).0, Status::Ok);
    assert_eq!(rig.cmd(Opcode::DestroyCq, &handle_req(cq.handle), &[]).0, Status::Ok);
    assert_eq!(rig.cmd(Opcode::DestroyCq, &handle_req(cq.handle), &[]).0, Status::InvalidHandle);
    assert_eq!(rig.free_registers(), 16);
}

#[test]
fn req_notify_cq_arms_one_notification() {
    let mut rig = Rig::with_registers(64);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let arm = |cq: u32, s: u32| ReqNotifyCqReq { cq: cq.into(), solicited_only: s.into() };
    assert_eq!(rig.cmd(Opcode::ReqNotifyCq, arm(p.cq_a.handle, 2).as_bytes(), &[]).0, Status::InvalidParam);
    assert_eq!(rig.cmd(Opcode::ReqNotifyCq, arm(999, 0).as_bytes(), &[]).0, Status::InvalidHandle);
    assert_eq!(rig.cmd(Opcode::ReqNotifyCq, arm(p.cq_a.handle, 0).as_bytes(), &[]).0, Status::Ok);
    for id in 1..=2 {
        let w = wqe(id, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 0, 8)]);
        rig.post_send(&mut p.a, &w);
    }
    assert_eq!(rig.poll(&mut p.cq_a).len(), 2);
    let notes: Vec<_> =
        rig.async_events().into_iter().filter(|e| e.kind.get() == EventKind::CqCompletion as u32).collect();
    assert_eq!(notes.len(), 1, "armed once, notified once");
    assert_eq!(notes[0].handle.get(), p.cq_a.handle);
}

#[test]
fn mr_registration_checks() {
    let mut rig = Rig::with_registers(16);
    let pd = rig.alloc_pd();
    let (s, mr) = rig.try_reg_mr_at(pd, ACCESS_ALL, 3 * PAGE_SIZE, 0x80);
    assert_eq!(s, Status::Ok);
    assert_eq!(rig.free_registers(), 12, "offset 0x80 + 3 pages spans 4 pages");
    assert_eq!(rig.try_reg_mr_at(pd, 0x40, 64, 0).0, Status::InvalidParam, "unknown access bit");
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_REMOTE_WRITE, 64, 0).0, Status::InvalidParam, "remote write w/o local");
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_ALL, 0, 0).0, Status::InvalidParam, "empty");
    assert_eq!(rig.try_reg_mr_at(pd + 10, ACCESS_ALL, 64, 0).0, Status::InvalidHandle);
    // Page count that does not match offset + length.
    assert_eq!(rig.reg_mr_pages(pd, ACCESS_ALL, 64, 0, &[0x1000, 0x2000]).0, Status::InvalidParam);
    assert_eq!(rig.free_registers(), 12);
    let key = mr.unwrap().key;
    assert_eq!(rig.dereg_mr(key), Status::Ok);
    assert_eq!(rig.dereg_mr(key), Status::InvalidHandle);
    assert_eq!(rig.free_registers(), 16);
}

#[test]
fn qp_lifecycle_and_state_machine() {
    let mut rig = Rig::with_registers(64);
    let pd = rig.alloc_pd();
    let cq = rig.create_cq(64);
    let free = rig.free_registers();
    let (s, _) = rig.try_create_qp(pd, cq.handle, 999, 16, 16);
    assert_eq!(s, Status::InvalidHandle);
    let (s, _) = rig.try_create_qp(pd, cq.handle, cq.handle, 12, 16);
    assert_eq!(s, Status::InvalidParam);
    let mut bad_type = CreateQpReq { pd: pd.into(), qp_type: 4.into(), ..Default::default() };
    bad_type.send_cq = cq.handle.into();
    assert_eq!(rig.cmd(Opcode::CreateQp, bad_type.as_bytes(), &[]).0, Status::InvalidParam);
    let (s, qp) = rig.try_create_qp(pd, cq.handle, cq.handle, 128, 64); // 2 + 1 pages
    assert_eq!(s, Status::Ok);
    let qp = qp.unwrap();
    assert_eq!(rig.free_registers(), free - 3);

    use QpState::*;
    let st = QP_ATTR_STATE;
    assert_eq!(rig.modify_qp(qp.qpn, st, Rts, 0, 0), Status::InvalidState, "RESET -> RTS");
    assert_eq!(rig.modify_qp(qp.qpn, st, Init, 0, 0), Status::InvalidParam, "INIT needs access flags");
    assert_eq!(rig.modify_qp(qp.qpn, st, QpState::Init, 0, 0x80), Status::InvalidParam);
    assert_eq!(rig.modify_qp(qp.qpn, st | QP_ATTR_ACCESS_FLAGS, Init, 0, ACCESS_ALL), Status::Ok);
    assert_eq!(rig.modify_qp(qp.qpn, st, Rtr, 0, 0), Status::InvalidParam, "RTR needs dest_qpn");
    let bad_state = ModifyQpReq { qpn: qp.qpn.into(), attr_mask: st.into(), state: 9.into(), ..Default::default() };
    assert_eq!(rig.cmd(Opcode::ModifyQp, bad_state.as_bytes(), &[]).0, Status::InvalidParam);
    assert_eq!(rig.modify_qp(qp.qpn, st | QP_ATTR_DEST_QPN, Rtr, qp.qpn, 0), Status::Ok);
    assert_eq!(rig.modify_qp(qp.qpn, st, Rts, 0, 0), Status::Ok);
    assert_eq!(rig.modify_qp(qp.qpn, st, Sqd, 0, 0), Status::Ok);
    assert_eq!(rig.modify_qp(qp.qpn, st, Rts, 0, 0), Status::Ok);
    assert_eq!(rig.modify_qp(qp.qpn, st, Err, 0, 0), Status::Ok);
    assert_eq!(rig.modify_qp(qp.qpn, st, Rts, 0, 0), Status::InvalidState, "ERR -> RTS");
    assert_eq!(rig.modify_qp(qp.qpn, st, Reset, 0, 0), Status::Ok);
    assert_eq!(rig.modify_qp(999, st, Reset, 0, 0), Status::InvalidHandle);
    let transitions: Vec<_> = rig.events_of("qp_state").iter().map(|e| e["to"].as_str().unwrap().to_string()).collect();
    assert_eq!(transitions, ["INIT", "RTR", "RTS", "SQD", "RTS", "ERR", "RESET"]);

    assert_eq!(rig.cmd(Opcode::DestroyQp, &handle_req(qp.qpn), &[]).0, Status::Ok);
    assert_eq!(rig.cmd(Opcode::DestroyQp, &handle_req(qp.qpn), &[]).0, Status::InvalidHandle);
    assert_eq!(rig.free_registers(), free);
}

#[test]
fn malformed_requests() {
    let mut rig = Rig::with_registers(8);
    assert_eq!(rig.raw(&[1, 0, 0]).0, Status::BadLength, "shorter than the header");
    let unknown = Rig::request(Opcode::QueryDevice, 7, &[], &[]);
    let mut unknown = unknown.clone();
    unknown[0] = 99;
    assert_eq!(rig.raw(&unknown).0, Status::UnknownOpcode);
    // body_len promises more than was sent.
    let mut req =
        Rig::request(Opcode::QueryPort, 1, QueryPortReq { port: 1.into(), reserved: 0.into() }.as_bytes(), &[]);
    req.truncate(req.len() - 2);
    assert_eq!(rig.raw(&req).0, Status::BadLength);
    // Body shorter than the fixed request.
    assert_eq!(rig.cmd(Opcode::QueryPort, &[1, 0, 0, 0], &[]).0, Status::BadLength);
    // Trailing bytes after a body that takes no page list.
    assert_eq!(rig.cmd(Opcode::AllocPd, &[0; 8], &[]).0, Status::BadLength);
    // Page list shorter than page_count says.
    let req = CreateCqReq { entries: 256.into(), page_count: 2.into() };
    assert_eq!(rig.cmd(Opcode::CreateCq, req.as_bytes(), &[0x1000]).0, Status::BadLength);
    // body_len over the request limit.
    let mut huge = Rig::request(Opcode::AllocPd, 1, &[], &[]);
    huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(rig.raw(&huge).0, Status::BadLength);
    // Too many pages for one command.
    let req = CreateCqReq { entries: (1u32 << 17).into(), page_count: 1025.into() };
    let mut big = Rig::new(HcaConfig { max_cqe: 1 << 20, ..Default::default() });
    assert_eq!(big.cmd(Opcode::CreateCq, req.as_bytes(), &[]).0, Status::InvalidParam);
}

#[test]
fn object_tables_full_is_no_resources() {
    let config = HcaConfig { max_pd: 1, max_cq: 1, max_qp: 1, max_mr: 1, ..Default::default() };
    let mut rig = Rig::new(config);
    let pd = rig.alloc_pd();
    assert_eq!(rig.cmd(Opcode::AllocPd, &[], &[]).0, Status::NoResources);
    let cq = rig.create_cq(64);
    assert_eq!(rig.try_create_cq(64).0, Status::NoResources);
    rig.create_qp(pd, cq.handle, cq.handle);
    assert_eq!(rig.try_create_qp(pd, cq.handle, cq.handle, 16, 16).0, Status::NoResources);
    rig.reg_mr(pd, ACCESS_ALL, 64);
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_ALL, 64, 0).0, Status::NoResources);
}

#[test]
fn exhaustion_to_the_exact_register() {
    let mut rig = Rig::with_registers(10);
    let pd = rig.alloc_pd();
    let cq = rig.create_cq(64); // 1 register
    let nine = rig.reg_mr(pd, ACCESS_ALL, 9 * PAGE_SIZE); // 9 registers: the pool is now empty
    assert_eq!(rig.free_registers(), 0);
    rig.clear_events();
    let (s, _) = rig.try_reg_mr_at(pd, ACCESS_ALL, 1, 0);
    assert_eq!(s, Status::MapRegistersExhausted);
    let ex = rig.events_of("map_registers_exhausted");
    assert_eq!(ex.len(), 1);
    assert_eq!(
        (ex[0]["wanted"].as_u64(), ex[0]["free"].as_u64(), ex[0]["opcode"].as_str()),
        (Some(1), Some(0), Some("REG_MR"))
    );
    let asyncs = rig.async_events();
    assert_eq!(asyncs.len(), 1);
    assert_eq!(asyncs[0].kind.get(), EventKind::MapRegistersExhausted as u32);
    assert_eq!(asyncs[0].detail.get(), 1);

    // Give back 9, then exactly 9 fit again and a 10th page does not.
    assert_eq!(rig.dereg_mr(nine.key), Status::Ok);
    let unmap = rig.events_of("unmap");
    assert_eq!(
        (unmap[0]["registers"].as_u64(), unmap[0]["in_use"].as_u64(), unmap[0]["free"].as_u64()),
        (Some(9), Some(1), Some(9))
    );
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_ALL, 9 * PAGE_SIZE + 1, 0).0, Status::MapRegistersExhausted);
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_ALL, 9 * PAGE_SIZE, 0).0, Status::Ok);
    let maps = rig.events_of("map");
    let last = maps.last().unwrap();
    assert_eq!(
        (last["registers"].as_u64(), last["in_use"].as_u64(), last["free"].as_u64()),
        (Some(9), Some(10), Some(0))
    );
    // A QP needs 2 registers: refused cleanly, nothing leaks.
    assert_eq!(rig.try_create_qp(pd, cq.handle, cq.handle, 16, 16).0, Status::MapRegistersExhausted);
    assert_eq!(rig.free_registers(), 0);
}

/// The runner draws "map registers in use over time" from map/unmap lines alone: replaying them must give the pool's
/// real count at every step, with `total` on every line.
#[test]
fn map_and_unmap_lines_carry_in_use_and_total() {
    let mut rig = Rig::with_registers(12);
    let pd = rig.alloc_pd();
    let cq = rig.create_cq(128); // 1 page
    let mr = rig.reg_mr(pd, ACCESS_ALL, 3 * PAGE_SIZE);
    let qp = rig.create_qp(pd, cq.handle, cq.handle); // SQ and RQ: 1 page each
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_ALL, 20 * PAGE_SIZE, 0).0, Status::MapRegistersExhausted);
    assert_eq!(rig.dereg_mr(mr.key), Status::Ok);
    assert_eq!(rig.cmd(Opcode::DestroyQp, &handle_req(qp.qpn), &[]).0, Status::Ok);
    assert_eq!(rig.cmd(Opcode::DestroyCq, &handle_req(cq.handle), &[]).0, Status::Ok);

    let mut replayed = 0i64;
    let mut lines = 0;
    let mut curve = Vec::new();
    for e in rig.event_json() {
        let sign = match e["kind"].as_str() {
            Some("map") => 1,
            Some("unmap") => -1,
            Some("map_registers_exhausted") => {
                assert_eq!((e["in_use"].as_i64(), e["total"].as_u64()), (Some(replayed), Some(12)), "{e}");
                continue;
            }
            _ => continue,
        };
        lines += 1;
        replayed += sign * e["registers"].as_i64().unwrap();
        assert_eq!(e["in_use"].as_i64(), Some(replayed), "{e}");
        assert_eq!(e["total"].as_u64(), Some(12), "{e}");
        assert_eq!(e["in_use"].as_u64().unwrap() + e["free"].as_u64().unwrap(), 12, "{e}");
        curve.push(replayed);
    }
    // cq, mr, sq, rq mapped; mr, sq, rq, cq unmapped.
    assert_eq!(lines, 8);
    assert_eq!(curve, vec![1, 4, 5, 6, 3, 2, 1, 0]);
    assert_eq!(rig.free_registers(), 12);
}

#[test]
fn probe_pages_turns_iommu_refusal_into_a_status() {
    let mut rig = Rig::new(HcaConfig { map_registers: 16, probe_pages: true, ..Default::default() });
    let pd = rig.alloc_pd();
    let iova = rig.alloc(2);
    rig.mem.unmap(iova + PAGE_SIZE, 1);
    let (s, _) = rig.reg_mr_pages(pd, ACCESS_ALL, 2 * PAGE_SIZE, 0, &[iova, iova + PAGE_SIZE]);
    assert_eq!(s, Status::IommuFault);
    assert_eq!(rig.free_registers(), 16, "registers taken for the probe went back");
    let faults = rig.events_of("fault");
    assert_eq!(faults.len(), 1);
    assert_eq!(faults[0]["cause"], "iommu_unmapped");
    assert_eq!(faults[0]["opcode"], "REG_MR");
    assert_eq!(faults[0]["iova"].as_u64(), Some(iova + PAGE_SIZE));
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_ALL, 2 * PAGE_SIZE, 0).0, Status::Ok);
}

#[test]
fn every_command_is_logged_with_status() {
    let mut rig = Rig::with_registers(8);
    rig.cmd(Opcode::QueryDevice, &[], &[]);
    rig.raw(&[0; 4]);
    let cmds = rig.events_of("command");
    assert_eq!(cmds.len(), 2);
    assert_eq!(cmds[1]["status"], "BAD_LENGTH");
    let line = serde_json::to_string(&rig.events()[0]).unwrap();
    assert!(line.starts_with("{\"kind\":\"command\""), "{line}");
}
