//! The checks on every DMA: outside the MR, missing rights, freed map register, IOMMU refusal, stale translation.
//! Each must give the ibverbs completion status, an event naming the work request, QP → ERR and flushed WRs after.

mod common;

use common::*;
use vhca_hca::HcaConfig;
use vhca_proto::status::WcStatus;
use vhca_proto::*;

/// Posts `bad`, then a good RDMA_WRITE; returns the completions on A's CQ. Asserts the ibverbs aftermath: `bad`
/// failed with `status`/`cause`, A went to ERR with an async QP_FATAL, the good WR was flushed.
fn expect_failure(rig: &mut Rig, p: &mut Pair, bad: Wqe, status: WcStatus, cause: FaultCause) {
    let good_mr = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    rig.async_events();
    rig.post_send(&mut p.a, &bad);
    rig.post_send(&mut p.a, &wqe(0xf00d, WrOpcode::RdmaWrite, 0, good_mr.addr, good_mr.key, &[sge(&good_mr, 0, 8)]));
    let c = rig.poll(&mut p.cq_a);
    assert_eq!(c.len(), 2, "{c:?}");
    assert_eq!((c[0].wr_id, c[0].status, c[0].vendor_err), (bad.wr_id.get(), status, cause as u32), "{c:?}");
    assert_eq!((c[1].wr_id, c[1].status), (0xf00d, WcStatus::WrFlushErr), "unsignaled WRs are flushed too");
    assert_eq!(rig.hca.qp_state(p.a.qpn), Some(QpState::Err));
    let asyncs = rig.async_events();
    let fatal = asyncs.iter().find(|e| e.kind.get() == EventKind::QpFatal as u32).expect("QP_FATAL event");
    assert_eq!((fatal.handle.get(), fatal.cause.get()), (p.a.qpn, cause as u32));
    // Failures that are not access faults (RNR, malformed WQE) show in the completion event only.
    if cause != FaultCause::None {
        let faults = rig.events_of("fault");
        let fault = faults.last().expect("fault event");
        assert_eq!(fault["cause"], cause.name());
        let names = (fault["qpn"].as_u64(), fault["wr_id"].as_u64());
        assert_eq!(names, (Some(u64::from(p.a.qpn)), Some(bad.wr_id.get())));
    }
    let completions = rig.events_of("completion");
    let logged = completions.iter().find(|e| e["wr_id"] == bad.wr_id.get()).expect("completion event");
    assert_eq!((logged["status"].as_str(), logged["vendor_err"].as_str()), (Some(status.name()), Some(cause.name())));
    let states = rig.events_of("qp_state");
    let last = states.last().unwrap();
    assert_eq!((last["qpn"].as_u64(), last["to"].as_str()), (Some(u64::from(p.a.qpn)), Some("ERR")));
}

#[test]
fn local_sge_outside_mr_is_loc_prot_err() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 100);
    let bad = wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 90, 20)]);
    expect_failure(&mut rig, &mut p, bad, WcStatus::LocProtErr, FaultCause::OutsideMr);
}

#[test]
fn bad_lkey_and_foreign_pd_are_loc_prot_err() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let other_pd = rig.alloc_pd();
    let foreign = rig.reg_mr(other_pd, ACCESS_ALL, 100);
    let bad = wqe(2, WrOpcode::Send, WR_SIGNALED, 0, 0, &[sge(&foreign, 0, 8)]);
    expect_failure(&mut rig, &mut p, bad, WcStatus::LocProtErr, FaultCause::OutsideMr);
}

#[test]
fn remote_range_outside_mr_is_rem_access_err() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 100);
    let bad = wqe(3, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr + 96, mr.key, &[sge(&mr, 0, 8)]);
    expect_failure(&mut rig, &mut p, bad, WcStatus::RemAccessErr, FaultCause::OutsideMr);
    assert_eq!(rig.mem.peek(mr.iova + 96, 4), vec![0u8; 4], "nothing written past the check");
}

#[test]
fn missing_local_write_is_loc_access_err() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let remote = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let read_only = rig.reg_mr(p.pd, 0, 64);
    let bad = wqe(4, WrOpcode::RdmaRead, WR_SIGNALED, remote.addr, remote.key, &[sge(&read_only, 0, 8)]);
    expect_failure(&mut rig, &mut p, bad, WcStatus::LocAccessErr, FaultCause::AccessRight);
}

#[test]
fn missing_remote_right_on_mr_is_rem_access_err() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let src = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let no_remote_write = rig.reg_mr(p.pd, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_READ, 64);
    let bad = wqe(5, WrOpcode::RdmaWrite, WR_SIGNALED, no_remote_write.addr, no_remote_write.key, &[sge(&src, 0, 8)]);
    expect_failure(&mut rig, &mut p, bad, WcStatus::RemAccessErr, FaultCause::AccessRight);
}

#[test]
fn missing_remote_right_on_peer_qp_is_rem_access_err() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE); // the peer grants no REMOTE_READ
    let src = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let bad = wqe(6, WrOpcode::RdmaRead, WR_SIGNALED, src.addr, src.key, &[sge(&dst, 0, 8)]);
    expect_failure(&mut rig, &mut p, bad, WcStatus::RemAccessErr, FaultCause::AccessRight);
}

#[test]
fn dereg_under_a_posted_wqe_is_a_freed_map_register() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let good = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    // Written into the ring while the MR lived; the doorbell comes after DEREG_MR.
    rig.write_send_wqe(&mut p.a, &wqe(7, WrOpcode::RdmaWrite, WR_SIGNALED, good.addr, good.key, &[sge(&mr, 0, 8)]));
    assert_eq!(rig.dereg_mr(mr.key), Status::Ok);
    rig.doorbell(DoorbellKind::SendQueue, p.a.qpn, p.a.sq_posted, 0);
    let c = rig.poll(&mut p.cq_a);
    assert_eq!((c[0].status, c[0].vendor_err), (WcStatus::LocProtErr, FaultCause::FreedMapRegister as u32));
    let fault = rig.events_of("fault").pop().unwrap();
    assert_eq!((fault["cause"].as_str(), fault["key"].as_u64()), (Some("freed_map_register"), Some(u64::from(mr.key))));
    assert_eq!(rig.hca.qp_state(p.a.qpn), Some(QpState::Err));
}

#[test]
fn iommu_unmapped_page_is_loc_access_err_with_dma_fault_event() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let src = rig.reg_mr(p.pd, ACCESS_ALL, 2 * PAGE_SIZE);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, 2 * PAGE_SIZE);
    rig.mem.unmap(src.iova + PAGE_SIZE, 1); // the driver unmapped a page it still has registered
    let bad = wqe(8, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, 2 * PAGE_SIZE as u32)]);
    rig.post_send(&mut p.a, &bad);
    let c = rig.poll(&mut p.cq_a);
    assert_eq!((c[0].status, c[0].vendor_err), (WcStatus::LocAccessErr, FaultCause::IommuUnmapped as u32));
    let asyncs = rig.async_events();
    let dma_fault = asyncs.iter().find(|e| e.kind.get() == EventKind::DmaFault as u32).expect("DMA_FAULT");
    assert_eq!(dma_fault.addr.get(), src.iova + PAGE_SIZE);
    assert_eq!(dma_fault.handle.get(), p.a.qpn);
    let fault = rig.events_of("fault").pop().unwrap();
    assert_eq!((fault["iova"].as_u64(), fault["wr_id"].as_u64()), (Some(src.iova + PAGE_SIZE), Some(8)));
    assert_eq!(rig.mem.peek(dst.iova, 8), vec![0u8; 8], "no partial payload reached the target");
}

#[test]
fn iommu_permission_on_remote_target_is_rem_access_err() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let src = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    rig.mem.set_permissions(dst.iova, true, false); // the vIOMMU maps the page read-only
    let bad = wqe(9, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, 8)]);
    expect_failure(&mut rig, &mut p, bad, WcStatus::RemAccessErr, FaultCause::IommuPermission);
}

#[test]
fn stale_translation_after_invalidate() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let src = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    rig.clear_events();
    rig.hca.iotlb_invalidated(0xdead_0000, PAGE_SIZE); // nobody's page: nothing turns stale
    assert!(rig.events_of("translations_stale").is_empty());
    rig.hca.iotlb_invalidated(src.iova, 1);
    let stale = rig.events_of("translations_stale");
    assert_eq!((stale[0]["registers"].as_u64(), stale[0]["injected"].as_bool()), (Some(1), Some(false)));
    // The page is still mapped in the IOMMU: only the register's cached translation is refused.
    let bad = wqe(10, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, 8)]);
    expect_failure(&mut rig, &mut p, bad, WcStatus::LocAccessErr, FaultCause::StaleTranslation);
    let fault = rig.events_of("fault").into_iter().find(|f| f["cause"] == "stale_translation").unwrap();
    assert!(fault["register"].is_u64());
    // Re-registering revalidates: a new MR over the same page takes a fresh register and works, once the QP is
    // recycled through RESET (which restarts the rings on both sides).
    assert_eq!(rig.dereg_mr(src.key), Status::Ok);
    let (s, again) = rig.reg_mr_pages(p.pd, ACCESS_ALL, 64, 0, &[src.iova]);
    assert_eq!(s, Status::Ok);
    let again = again.unwrap();
    rig.mem.poke(again.iova, b"fresh");
    assert_eq!(rig.modify_qp(p.a.qpn, QP_ATTR_STATE, QpState::Reset, 0, 0), Status::Ok);
    p.a.sq_posted = 0;
    rig.bring_up(p.a.qpn, p.b.qpn, ACCESS_ALL);
    rig.post_send(&mut p.a, &wqe(17, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&again, 0, 5)]));
    assert_eq!(rig.poll(&mut p.cq_a)[0].status, WcStatus::Success);
    assert_eq!(rig.mem.peek(dst.iova, 5), b"fresh");
}

#[test]
fn revalidate_stale_policy_lets_the_dma_through() {
    let mut rig = Rig::new(HcaConfig { map_registers: 128, revalidate_stale: true, ..Default::default() });
    let mut p = pair(&mut rig, ACCESS_ALL);
    let src = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    rig.mem.poke(src.iova, b"revalidated");
    rig.hca.iotlb_invalidated(src.iova, PAGE_SIZE);
    rig.post_send(&mut p.a, &wqe(11, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, 11)]));
    assert_eq!(rig.poll(&mut p.cq_a)[0].status, WcStatus::Success);
    assert_eq!(rig.mem.peek(dst.iova, 11), b"revalidated");
}

#[test]
fn send_without_recv_is_rnr_and_recv_too_small_is_loc_len_err() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let src = rig.reg_mr(p.pd, ACCESS_ALL, 256);
    let bad = wqe(12, WrOpcode::Send, WR_SIGNALED, 0, 0, &[sge(&src, 0, 8)]);
    expect_failure(&mut rig, &mut p, bad, WcStatus::RnrRetryExcErr, FaultCause::None);

    let mut q = pair(&mut rig, ACCESS_ALL);
    let small = rig.reg_mr(q.pd, ACCESS_ALL, 256);
    let src = rig.reg_mr(q.pd, ACCESS_ALL, 256);
    rig.post_recv(&mut q.b, 0x51, &[sge(&small, 0, 16)]);
    rig.post_recv(&mut q.b, 0x52, &[sge(&small, 16, 16)]);
    rig.post_send(&mut q.a, &wqe(13, WrOpcode::Send, WR_SIGNALED, 0, 0, &[sge(&src, 0, 32)]));
    let sender = rig.poll(&mut q.cq_a);
    assert_eq!(sender[0].status, WcStatus::RemAccessErr);
    let receiver = rig.poll(&mut q.cq_b);
    assert_eq!((receiver[0].wr_id, receiver[0].status), (0x51, WcStatus::LocLenErr));
    assert_eq!((receiver[1].wr_id, receiver[1].status), (0x52, WcStatus::WrFlushErr), "peer's other RECV flushed");
    assert_eq!(rig.hca.qp_state(q.b.qpn), Some(QpState::Err));
    assert_eq!(rig.hca.qp_state(q.a.qpn), Some(QpState::Err));
}

#[test]
fn malformed_wqe_is_loc_qp_op_err() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let mut bad = wqe(14, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 0, 8)]);
    bad.num_sge = 3.into();
    expect_failure(&mut rig, &mut p, bad, WcStatus::LocQpOpErr, FaultCause::None);
    let mut q = pair(&mut rig, ACCESS_ALL);
    let mut bad = wqe(15, WrOpcode::Recv, WR_SIGNALED, 0, 0, &[]); // RECV on the SQ
    bad.opcode = (WrOpcode::Recv as u32).into();
    expect_failure(&mut rig, &mut q, bad, WcStatus::LocQpOpErr, FaultCause::None);
}

#[test]
fn unreadable_send_ring_fails_the_qp() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    rig.mem.unmap(p.a.sq_iova, 1);
    rig.doorbell(DoorbellKind::SendQueue, p.a.qpn, 1, 0);
    let c = rig.poll(&mut p.cq_a);
    assert_eq!((c[0].status, c[0].vendor_err), (WcStatus::LocQpOpErr, FaultCause::IommuUnmapped as u32));
    assert_eq!(rig.hca.qp_state(p.a.qpn), Some(QpState::Err));
    let fault = rig.events_of("fault").pop().unwrap();
    assert_eq!((fault["purpose"].as_str(), fault["qpn"].as_u64()), (Some("wqe"), Some(u64::from(p.a.qpn))));
}

#[test]
fn unwritable_cq_ring_loses_the_cqe_visibly() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    rig.mem.set_permissions(p.cq_a.iova, true, false);
    rig.post_send(&mut p.a, &wqe(16, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 0, 8)]));
    let completion = rig.events_of("completion").pop().unwrap();
    assert_eq!((completion["written"].as_bool(), completion["wr_id"].as_u64()), (Some(false), Some(16)));
    let asyncs = rig.async_events();
    let f = asyncs.iter().find(|e| e.kind.get() == EventKind::DmaFault as u32).unwrap();
    assert_eq!((f.handle.get(), f.cause.get()), (p.cq_a.handle, FaultCause::IommuPermission as u32));
    rig.mem.set_permissions(p.cq_a.iova, true, true);
    assert!(rig.poll(&mut p.cq_a).is_empty());
}

#[test]
fn modify_to_err_flushes_posted_receives() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    rig.post_recv(&mut p.b, 0x21, &[sge(&mr, 0, 8)]);
    rig.post_recv(&mut p.b, 0x22, &[sge(&mr, 8, 8)]);
    assert_eq!(rig.modify_qp(p.b.qpn, QP_ATTR_STATE, QpState::Err, 0, 0), Status::Ok);
    let c = rig.poll(&mut p.cq_b);
    let got: Vec<_> = c.iter().map(|c| (c.wr_id, c.status, c.opcode)).collect();
    let recv = WrOpcode::Recv as u32;
    assert_eq!(got, [(0x21, WcStatus::WrFlushErr, recv), (0x22, WcStatus::WrFlushErr, recv)]);
    // A RECV posted in ERR is flushed at once.
    rig.post_recv(&mut p.b, 0x23, &[sge(&mr, 0, 8)]);
    assert_eq!(rig.poll(&mut p.cq_b)[0].wr_id, 0x23);
}

#[test]
fn page_at_the_top_of_the_iova_space_does_not_wrap() {
    let mut rig = Rig::with_registers(128);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let top = !(PAGE_SIZE - 1);
    rig.mem.map(top, 1, true, true);
    rig.mem.map(0, 1, true, true);
    let (s, dst) = rig.reg_mr_pages(p.pd, ACCESS_ALL, 2 * PAGE_SIZE, 0, &[top, 0]);
    assert_eq!(s, Status::Ok);
    let dst = dst.unwrap();
    let src = rig.reg_mr(p.pd, ACCESS_ALL, 2 * PAGE_SIZE);
    let data = pattern(2 * PAGE_SIZE as usize, 13);
    rig.mem.poke(src.iova, &data);
    let w = wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, 2 * PAGE_SIZE as u32)]);
    rig.post_send(&mut p.a, &w);
    assert_eq!(rig.poll(&mut p.cq_a)[0].status, WcStatus::Success);
    assert_eq!(rig.mem.peek(top, PAGE_SIZE as usize), data[..PAGE_SIZE as usize]);
    assert_eq!(rig.mem.peek(0, PAGE_SIZE as usize), data[PAGE_SIZE as usize..]);
}
