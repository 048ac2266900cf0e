//! The hold_completion knob: the chosen send work request waits, unstarted, until the transport releases it; then
//! its DMA meets the translations of that moment. Its QP's later requests wait behind it, everything else goes on,
//! and a flush, reset or destroy of the QP ends the hold without the DMA.

mod common;

use common::*;
use vhca_hca::{FaultInjection, HcaConfig};
use vhca_proto::status::WcStatus;
use vhca_proto::*;

fn rig_with(kvs: &[&str], revalidate_stale: bool) -> Rig {
    let mut injection = FaultInjection::default();
    for kv in kvs {
        injection.parse_kv(kv).unwrap();
    }
    Rig::new(HcaConfig { map_registers: 256, injection, revalidate_stale, ..Default::default() })
}

/// A pair, the MR an RDMA_READ reads (filled with a pattern) and the MR it lands in.
struct ReadSetup {
    p: Pair,
    remote: MrInfo,
    local: MrInfo,
}

fn read_setup(rig: &mut Rig) -> ReadSetup {
    let p = pair(rig, ACCESS_ALL);
    let remote = rig.reg_mr(p.pd, ACCESS_ALL, 2 * PAGE_SIZE);
    let local = rig.reg_mr(p.pd, ACCESS_ALL, 2 * PAGE_SIZE);
    rig.mem.poke(remote.iova, &pattern(2 * PAGE_SIZE as usize, 9));
    ReadSetup { p, remote, local }
}

fn rdma_read(s: &ReadSetup, wr_id: u64) -> Wqe {
    wqe(wr_id, WrOpcode::RdmaRead, WR_SIGNALED, s.remote.addr, s.remote.key, &[sge(&s.local, 0, 2 * PAGE_SIZE as u32)])
}

/// Posts an RDMA_READ of the whole remote MR into the local one on QP a.
fn post_read(rig: &mut Rig, s: &mut ReadSetup, wr_id: u64) {
    let w = rdma_read(s, wr_id);
    rig.post_send(&mut s.p.a, &w);
}

fn hold_lines(rig: &Rig) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let started = rig.events_of("injected").into_iter().filter(|e| e["what"] == "hold_completion").collect();
    (started, rig.events_of("hold_released"))
}

#[test]
fn the_held_read_waits_then_lands_and_completes() {
    let mut rig = rig_with(&["hold_completion_ms=40"], false);
    let mut s = read_setup(&mut rig);
    post_read(&mut rig, &mut s, 0x11);
    assert!(rig.hca.holding());
    assert_eq!(rig.hca.take_new_hold(), Some(std::time::Duration::from_millis(40)));
    assert_eq!(rig.hca.take_new_hold(), None, "a hold is told once");
    assert!(rig.poll(&mut s.p.cq_a).is_empty(), "no CQE while held");
    assert_eq!(rig.mem.peek(s.local.iova, 16), vec![0u8; 16], "no byte moved while held");
    assert!(rig.events_of("dma").iter().all(|d| d["purpose"] != "rdma_read_local"));

    // Everything else goes on: commands, and another QP's work.
    rig.query_device();
    let w = wqe(0x21, WrOpcode::RdmaWrite, WR_SIGNALED, s.local.addr + PAGE_SIZE, s.local.key, &[sge(&s.remote, 0, 8)]);
    rig.post_send(&mut s.p.b, &w);
    assert_eq!(rig.poll(&mut s.p.cq_b).iter().map(|c| c.wr_id).collect::<Vec<_>>(), [0x21]);
    // The held QP's next request waits behind it (RC runs a QP's requests in order).
    let second = wqe(0x12, WrOpcode::RdmaWrite, WR_SIGNALED, s.remote.addr, s.remote.key, &[sge(&s.local, 0, 8)]);
    rig.post_send(&mut s.p.a, &second);
    assert!(rig.poll(&mut s.p.cq_a).is_empty());

    rig.hca.release_held_work(&rig.mem);
    assert!(!rig.hca.holding());
    let c = rig.poll(&mut s.p.cq_a);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(0x11, WcStatus::Success), (0x12, WcStatus::Success)]
    );
    assert_eq!(rig.mem.peek(s.local.iova, 2 * PAGE_SIZE as usize), pattern(2 * PAGE_SIZE as usize, 9));
    let (started, released) = hold_lines(&rig);
    assert_eq!(started.len(), 1);
    assert_eq!(started[0]["n"], 1);
    assert!(started[0]["detail"].as_str().unwrap().contains(&format!("qpn {}", s.p.a.qpn)));
    assert_eq!(released.len(), 1);
    assert_eq!(
        (released[0]["reason"].as_str(), released[0]["qpn"].as_u64()),
        (Some("timer"), Some(u64::from(s.p.a.qpn)))
    );

    // Released once: a second release does nothing, and no later request is held.
    rig.hca.release_held_work(&rig.mem);
    post_read(&mut rig, &mut s, 0x13);
    assert_eq!(rig.poll(&mut s.p.cq_a).len(), 1);
    assert_eq!(hold_lines(&rig).1.len(), 1);
}

#[test]
fn the_hold_counts_send_work_requests() {
    let mut rig = rig_with(&["hold_completion_ms=1", "hold_completion_wr=2"], false);
    let mut s = read_setup(&mut rig);
    post_read(&mut rig, &mut s, 1);
    assert_eq!(rig.poll(&mut s.p.cq_a).len(), 1, "the first runs");
    post_read(&mut rig, &mut s, 2);
    assert!(rig.hca.holding() && rig.poll(&mut s.p.cq_a).is_empty(), "the second is held");
    rig.hca.release_held_work(&rig.mem);
    assert_eq!(rig.poll(&mut s.p.cq_a)[0].wr_id, 2);
}

/// The driver's timeout fired: it unmapped the buffer (QEMU's invalidation reaches the HCA), then the device writes.
fn late_read_into_unmapped_buffer(revalidate_stale: bool) -> (Rig, Completion) {
    let mut rig = rig_with(&["hold_completion_ms=40"], revalidate_stale);
    let mut s = read_setup(&mut rig);
    post_read(&mut rig, &mut s, 0x31);
    rig.mem.unmap(s.local.iova, 2);
    rig.hca.iotlb_invalidated(s.local.iova, 2 * PAGE_SIZE);
    rig.hca.release_held_work(&rig.mem);
    let c = rig.poll(&mut s.p.cq_a);
    assert_eq!(c.len(), 1);
    (rig, c[0])
}

#[test]
fn a_late_dma_into_an_unmapped_buffer_meets_the_iommu() {
    let (rig, c) = late_read_into_unmapped_buffer(true);
    assert_eq!((c.wr_id, c.status, c.vendor_err), (0x31, WcStatus::LocAccessErr, FaultCause::IommuUnmapped as u32));
    let faults = rig.events_of("fault");
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(
        (faults[0]["cause"].as_str(), faults[0]["purpose"].as_str()),
        (Some("iommu_unmapped"), Some("rdma_read_local"))
    );
    assert_eq!(faults[0]["wr_id"], 0x31);
}

#[test]
fn without_revalidation_the_late_dma_meets_the_stale_register() {
    let (rig, c) = late_read_into_unmapped_buffer(false);
    assert_eq!((c.status, c.vendor_err), (WcStatus::LocAccessErr, FaultCause::StaleTranslation as u32));
    assert_eq!(rig.events_of("fault")[0]["cause"], "stale_translation");
}

#[test]
fn a_flushed_reset_or_destroyed_qp_ends_the_hold_without_the_dma() {
    // ERR: the held request is flushed like any outstanding one.
    let mut rig = rig_with(&["hold_completion_ms=40"], false);
    let mut s = read_setup(&mut rig);
    post_read(&mut rig, &mut s, 0x41);
    assert_eq!(rig.modify_qp(s.p.a.qpn, QP_ATTR_STATE, QpState::Err, 0, 0), Status::Ok);
    let c = rig.poll(&mut s.p.cq_a);
    assert_eq!(c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(), [(0x41, WcStatus::WrFlushErr)]);
    rig.hca.release_held_work(&rig.mem);
    assert!(rig.poll(&mut s.p.cq_a).is_empty(), "the release finds nothing to run");
    assert_eq!(rig.mem.peek(s.local.iova, 16), vec![0u8; 16]);
    assert_eq!(hold_lines(&rig).1[0]["reason"], "qp_flushed");

    // RESET and destroy: discarded without a completion.
    for (reset, reason) in [(true, "qp_reset"), (false, "qp_destroyed")] {
        let mut rig = rig_with(&["hold_completion_ms=40"], false);
        let mut s = read_setup(&mut rig);
        post_read(&mut rig, &mut s, 0x42);
        if reset {
            assert_eq!(rig.modify_qp(s.p.a.qpn, QP_ATTR_STATE, QpState::Reset, 0, 0), Status::Ok);
        } else {
            let (status, _) = rig.cmd(Opcode::DestroyQp, &[s.p.a.qpn.to_le_bytes(), [0; 4]].concat(), &[]);
            assert_eq!(status, Status::Ok);
        }
        rig.hca.release_held_work(&rig.mem);
        assert!(rig.poll(&mut s.p.cq_a).is_empty(), "{reason}");
        assert_eq!(rig.mem.peek(s.local.iova, 16), vec![0u8; 16], "{reason}");
        let released = hold_lines(&rig).1;
        assert_eq!(released.len(), 1, "{reason}");
        assert_eq!(released[0]["reason"], reason);
    }
}
