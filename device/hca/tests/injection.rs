//! Each fault-injection knob fires exactly at its count, with its status and event, and nothing else changes.

mod common;

use common::*;
use vhca_hca::{ContiguousPolicy, FaultInjection, HcaConfig};
use vhca_proto::status::WcStatus;
use vhca_proto::*;

fn rig_with(kvs: &[&str]) -> Rig {
    let mut injection = FaultInjection::default();
    for kv in kvs {
        injection.parse_kv(kv).unwrap();
    }
    Rig::new(HcaConfig { map_registers: 256, injection, ..Default::default() })
}

fn injected(rig: &Rig, what: &str) -> Vec<serde_json::Value> {
    rig.events_of("injected").into_iter().filter(|e| e["what"] == what).collect()
}

#[test]
fn fail_nth_reg_mr() {
    let mut rig = rig_with(&["fail_reg_mr=2"]);
    let pd = rig.alloc_pd();
    let free = rig.free_registers();
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_ALL, 64, 0).0, Status::Ok);
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_ALL, 64, 0).0, Status::Injected);
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_ALL, 64, 0).0, Status::Ok);
    assert_eq!(rig.free_registers(), free - 2);
    let fired = injected(&rig, "fail_reg_mr");
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0]["n"], 2);
}

#[test]
fn fail_nth_ring_mapping() {
    // Ring mappings: CQ (1), QP's SQ (2), QP's RQ (3).
    let mut rig = rig_with(&["fail_ring_map=3"]);
    let pd = rig.alloc_pd();
    let cq = rig.create_cq(64);
    let free = rig.free_registers();
    assert_eq!(rig.try_create_qp(pd, cq.handle, cq.handle, 16, 16).0, Status::Injected);
    assert_eq!(rig.free_registers(), free, "the SQ's registers went back when the RQ failed");
    let unmaps = rig.events_of("unmap");
    assert_eq!((unmaps[0]["owner"].as_str(), unmaps[0]["registers"].as_u64()), (Some("sq"), Some(1)));
    assert_eq!(rig.try_create_qp(pd, cq.handle, cq.handle, 16, 16).0, Status::Ok);
    assert_eq!(injected(&rig, "fail_ring_map")[0]["n"], 3);
}

#[test]
fn drop_nth_completion() {
    let mut rig = rig_with(&["drop_completion=1"]);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    for id in [1u64, 2] {
        rig.post_send(&mut p.a, &wqe(id, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 0, 8)]));
    }
    let c = rig.poll(&mut p.cq_a);
    assert_eq!(c.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [2], "the first CQE never appears");
    assert_eq!(injected(&rig, "drop_completion").len(), 1);
}

#[test]
fn delay_nth_completion_by_k_doorbells() {
    let mut rig = rig_with(&["delay_completion=1", "delay_doorbells=2"]);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    rig.post_send(&mut p.a, &wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 0, 8)]));
    assert!(rig.poll(&mut p.cq_a).is_empty(), "held");
    rig.doorbell(DoorbellKind::CqArm, p.cq_b.handle, 0, 0);
    assert!(rig.poll(&mut p.cq_a).is_empty(), "one further doorbell is not enough");
    rig.post_send(&mut p.a, &wqe(2, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 0, 8)]));
    // The second WR completed during the second doorbell, the held one after it: the driver sees them reordered.
    let c = rig.poll(&mut p.cq_a);
    assert_eq!(c.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [2, 1]);
    assert_eq!(injected(&rig, "delay_completion").len(), 1);
}

#[test]
fn contiguous_cap_refuses_long_runs() {
    let mut rig = rig_with(&["max_contiguous_pages=2"]);
    let pd = rig.alloc_pd();
    let free = rig.free_registers();
    assert_eq!(rig.try_reg_mr_at(pd, ACCESS_ALL, 3 * PAGE_SIZE, 0).0, Status::Injected, "3 contiguous pages");
    assert_eq!(rig.free_registers(), free);
    // The same size in pieces of at most 2 contiguous pages is fine.
    let a = rig.alloc(2);
    let b = rig.alloc(1);
    let list = [a, a + PAGE_SIZE, b];
    assert_eq!(rig.reg_mr_pages(pd, ACCESS_ALL, 3 * PAGE_SIZE, 0, &list).0, Status::Ok);
    // Rings too.
    assert_eq!(rig.try_create_cq(512).0, Status::Injected, "a 4-page CQ ring in one run");
    let fired = injected(&rig, "max_contiguous_pages");
    assert_eq!(fired.len(), 2);
    assert!(fired[0]["detail"].as_str().unwrap().contains("refused"));
}

#[test]
fn contiguous_cap_split_limits_bursts() {
    let mut rig = rig_with(&["max_contiguous_pages=2", "contiguous_policy=split"]);
    assert_eq!(rig.hca.device_config().map_registers.get(), 256);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let len = 6 * PAGE_SIZE;
    let src = rig.reg_mr(p.pd, ACCESS_ALL, len);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, len);
    let data = pattern(len as usize, 41);
    rig.mem.poke(src.iova, &data);
    rig.mem.largest_access.set(0);
    let w = wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, len as u32)]);
    rig.post_send(&mut p.a, &w);
    assert_eq!(rig.poll(&mut p.cq_a)[0].status, WcStatus::Success);
    assert_eq!(rig.mem.peek(dst.iova, len as usize), data);
    assert_eq!(rig.mem.largest_access.get(), 2 * PAGE_SIZE as usize, "no burst longer than the cap");

    // Without the cap the same transfer goes in one burst per side.
    let mut rig = Rig::with_registers(256);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let src = rig.reg_mr(p.pd, ACCESS_ALL, len);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, len);
    rig.mem.largest_access.set(0);
    let w = wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, len as u32)]);
    rig.post_send(&mut p.a, &w);
    assert_eq!(rig.mem.largest_access.get(), len as usize);
    assert_eq!(FaultInjection::default().contiguous_policy, ContiguousPolicy::Refuse);
}

#[test]
fn invalidate_at_nth_dma_makes_it_stale() {
    // No command DMAs (probe_pages off), so DMA 1 is the first WQE read and DMA 2 its local payload read.
    let mut rig = rig_with(&["invalidate_at_dma=2"]);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let src = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    rig.post_send(&mut p.a, &wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, 8)]));
    let c = rig.poll(&mut p.cq_a);
    assert_eq!((c[0].status, c[0].vendor_err), (WcStatus::LocAccessErr, FaultCause::StaleTranslation as u32));
    let stale = rig.events_of("translations_stale");
    assert_eq!((stale[0]["iova"].as_u64(), stale[0]["injected"].as_bool()), (Some(src.iova), Some(true)));
    let dmas = rig.events_of("dma");
    assert_eq!((dmas[1]["n"].as_u64(), dmas[1]["ok"].as_bool()), (Some(2), Some(false)));
    assert_eq!(injected(&rig, "invalidate_at_dma")[0]["n"], 2);
}

#[test]
fn invalidate_at_nth_dma_with_explicit_range() {
    // A dry run with the same allocation order tells where the remote MR will be.
    let mut probe = Rig::with_registers(256);
    let p = pair(&mut probe, ACCESS_ALL);
    probe.reg_mr(p.pd, ACCESS_ALL, 64);
    let dst = probe.reg_mr(p.pd, ACCESS_ALL, 64);
    let target = dst.iova;
    let mut rig = rig_with(&["invalidate_at_dma=1", &format!("invalidate_iova={target:#x}"), "invalidate_size=4096"]);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let src = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    assert_eq!(dst.iova, target, "same allocation order, same IOVA");
    rig.post_send(&mut p.a, &wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, 8)]));
    let c = rig.poll(&mut p.cq_a);
    assert_eq!((c[0].status, c[0].vendor_err), (WcStatus::RemAccessErr, FaultCause::StaleTranslation as u32));
}

#[test]
fn config_file_form_matches_kv_form() {
    let from_json = FaultInjection::from_json(r#"{"drop_completion": 4, "contiguous_policy": "split"}"#).unwrap();
    let mut from_kv = FaultInjection::default();
    from_kv.parse_kv("drop_completion=4").unwrap();
    from_kv.parse_kv("contiguous_policy=split").unwrap();
    assert_eq!(from_json, from_kv);
}
