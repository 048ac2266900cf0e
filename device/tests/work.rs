//! Work through the real transport: rings, MRs and CQs in the shared memfd, commands on queue 0, doorbells on
//! queue 2, CQEs read from the CQ ring and async events from queue 1; DMA faults after an IOTLB invalidation.

mod common;

use common::verbs::*;
use common::*;
use vhca_proto::status::WcStatus;
use vhca_proto::{DoorbellKind, EventKind, FaultCause, Opcode, QpState, QueryDeviceResp, Status, WrOpcode};
use zerocopy::FromBytes;

const LEN: u32 = 2 * PAGE as u32;

fn line_kinds<'a>(events: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    kinds(events, kind)
}

/// After a fault the device must still serve every queue: a command on queue 0 answers.
fn query_device_still_answers(s: &mut Session) {
    let body = s.command_ok(Opcode::QueryDevice, &[], &[]);
    let resp = QueryDeviceResp::read_from_bytes(&body).unwrap();
    assert_eq!(resp.map_registers_total.get(), 4096);
}

#[test]
fn rdma_write_through_doorbell_cq_ring_and_event_queue() {
    let mut s = Session::start(&[], true);
    s.post_event_buffers(2);
    let lb = s.loopback(2);
    let data = pattern(LEN as usize, 3);
    s.ram.write(lb.src.off, &data);
    s.ring(&doorbell(DoorbellKind::CqArm, lb.cq, 0, 0));
    assert!(s.cqe(&lb, 0).is_none(), "no CQE before any work");
    assert!(s.events_delivered().is_empty(), "arming alone raises no event");

    s.post_send(&lb, 0, &rdma_write_wqe(0x51, lb.src.addr, lb.src.key, LEN, lb.dst.addr, lb.dst.key));
    let cqe = s.cqe(&lb, 0).expect("the CQE is in the CQ ring once the doorbell chain is used");
    assert_eq!(cqe_status(&cqe), WcStatus::Success);
    assert_eq!(cqe.wr_id.get(), 0x51);
    assert_eq!(cqe.opcode.get(), WrOpcode::RdmaWrite as u32);
    assert_eq!((cqe.qpn.get(), cqe.byte_len.get(), cqe.vendor_err.get()), (lb.qpn, LEN, 0));
    assert_eq!(s.ram.read(lb.dst.off, LEN as usize), data, "the bytes landed in the destination MR's pages");
    assert!(s.cqe(&lb, 1).is_none());

    s.wait_events(1);
    let events = s.events_delivered();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].kind.get(), EventKind::CqCompletion as u32);
    assert_eq!((events[0].handle.get(), events[0].detail.get()), (lb.cq, 0), "CQ handle and CQE index");

    // The CQ fired once and is disarmed: a second write completes without an event.
    s.post_send(&lb, 1, &rdma_write_wqe(0x52, lb.src.addr, lb.src.key, 64, lb.dst.addr + 64, lb.dst.key));
    assert_eq!(s.cqe(&lb, 1).map(|c| c.wr_id.get()), Some(0x52));
    query_device_still_answers(&mut s);
    assert_eq!(s.events_delivered().len(), 1);

    let (status, _stderr, events) = s.close();
    assert!(status.success());
    let doorbells = line_kinds(&events, "doorbell");
    assert_eq!(doorbells.len(), 3, "{doorbells:?}");
    assert_eq!((doorbells[0]["db"].as_str(), doorbells[0]["ok"].as_bool()), (Some("cq_arm"), Some(true)));
    assert_eq!((doorbells[1]["db"].as_str(), doorbells[1]["index"].as_u64()), (Some("sq"), Some(1)));
    let completions = line_kinds(&events, "completion");
    assert_eq!(completions[0]["status"], "SUCCESS");
    assert_eq!(completions[0]["byte_len"].as_u64(), Some(u64::from(LEN)));
    assert!(line_kinds(&events, "desc").iter().any(|d| d["queue"] == 2), "the doorbell chain is logged");
    assert!(line_kinds(&events, "dma_fault").is_empty() && line_kinds(&events, "fault").is_empty());
    // CQ 1 page, SQ 1, RQ 1, two MRs of 2: every map line says how many registers are in use of how many.
    let maps = line_kinds(&events, "map");
    let in_use: Vec<u64> = maps.iter().map(|m| m["in_use"].as_u64().unwrap()).collect();
    assert_eq!(in_use, vec![1, 2, 3, 5, 7]);
    assert!(maps
        .iter()
        .all(|m| m["total"] == 4096 && m["free"].as_u64().unwrap() + m["in_use"].as_u64().unwrap() == 4096));
}

/// Sets up the loopback, then has "QEMU" invalidate the source MR's pages and posts an RDMA_WRITE from them.
fn write_from_invalidated_pages(extra: &[&str]) -> (Session, Loopback) {
    let mut s = Session::start(extra, true);
    s.post_event_buffers(4);
    let lb = s.loopback(2);
    s.ram.write(lb.src.off, &pattern(LEN as usize, 4));
    s.iotlb(IOTLB_INVALIDATE, IOVA + lb.src.off, 2 * PAGE, 0, 0);
    s.post_send(&lb, 0, &rdma_write_wqe(0x77, lb.src.addr, lb.src.key, LEN, lb.dst.addr, lb.dst.key));
    (s, lb)
}

fn check_error_cqe_and_events(s: &mut Session, lb: &Loopback, cause: FaultCause) {
    let cqe = s.cqe(lb, 0).expect("an error CQE");
    assert_eq!(cqe_status(&cqe), WcStatus::LocAccessErr);
    assert_eq!((cqe.wr_id.get(), cqe.vendor_err.get(), cqe.byte_len.get()), (0x77, cause as u32, 0));
    assert_eq!(s.ram.read(lb.dst.off, LEN as usize), vec![0u8; LEN as usize], "nothing was written");
    s.wait_events(2);
    let events = s.events_delivered();
    let seen: Vec<(u32, u32, u32)> = events.iter().map(|e| (e.kind.get(), e.handle.get(), e.cause.get())).collect();
    assert_eq!(
        seen,
        vec![(EventKind::DmaFault as u32, lb.qpn, cause as u32), (EventKind::QpFatal as u32, lb.qpn, cause as u32)]
    );
    assert_eq!(events[0].addr.get(), IOVA + lb.src.off, "the DmaFault event names the refused IOVA");
    query_device_still_answers(s);
}

#[test]
fn invalidated_mr_pages_are_a_stale_translation() {
    // The device asks the vIOMMU again about each invalidated register it is about to use (a page still mapped where
    // it led is confirmed); this "QEMU" never answers a miss, so the ask ends at the miss timeout and the register
    // stays stale.
    let (mut s, lb) = write_from_invalidated_pages(&["--miss-timeout-ms", "200"]);
    check_error_cqe_and_events(&mut s, &lb, FaultCause::StaleTranslation);
    // Re-registering the pages after QEMU maps them again works; the QP is in ERR until reset.
    s.iotlb(IOTLB_UPDATE, IOVA + lb.src.off, 2 * PAGE, UADDR + lb.src.off, ACCESS_RW);
    let (status, mr) = s.reg_mr(lb.pd, vhca_proto::ACCESS_ALL, 1);
    assert_eq!((status, mr.is_some()), (Status::Ok, true));

    let (status, _stderr, events) = s.close();
    assert!(status.success());
    let stale = line_kinds(&events, "translations_stale");
    assert_eq!((stale[0]["iova"].as_u64(), stale[0]["registers"].as_u64()), (Some(IOVA + lb.src.off), Some(2)));
    let fault = line_kinds(&events, "fault");
    assert_eq!(fault.len(), 1, "{fault:?}");
    assert_eq!(fault[0]["cause"], "stale_translation");
    assert_eq!((fault[0]["purpose"].as_str(), fault[0]["wr_id"].as_u64()), (Some("rdma_write_local"), Some(0x77)));
    assert!(line_kinds(&events, "qp_state").iter().any(|l| l["to"] == QpState::Err.name()));
}

#[test]
fn an_invalidation_wider_than_its_unmap_is_confirmed_and_the_write_goes_through() {
    // VT-d invalidates an aligned power-of-two range, so an unmap of one buffer also invalidates live pages beside it.
    // Asked again, "QEMU" maps the source pages where they led when the MR was registered: the registers are
    // confirmed fresh (no revalidate knob), the write goes through, and nothing is refused.
    let mut s = Session::start(&[], true);
    s.post_event_buffers(4);
    let lb = s.loopback(2);
    let data = pattern(LEN as usize, 5);
    s.ram.write(lb.src.off, &data);
    s.iotlb(IOTLB_INVALIDATE, (IOVA + lb.src.off) & !0xffff, 0x10000, 0, 0);
    s.answer_misses = true;
    s.post_send(&lb, 0, &rdma_write_wqe(0x78, lb.src.addr, lb.src.key, LEN, lb.dst.addr, lb.dst.key));
    let cqe = s.cqe(&lb, 0).expect("the write's CQE");
    assert_eq!((cqe_status(&cqe), cqe.wr_id.get()), (WcStatus::Success, 0x78));
    assert_eq!(s.ram.read(lb.dst.off, LEN as usize), data, "the bytes landed");

    let (status, _stderr, events) = s.close();
    assert!(status.success());
    assert!(!line_kinds(&events, "translations_stale").is_empty(), "the invalidation met the MR's registers");
    let confirmed = line_kinds(&events, "translations_confirmed");
    assert!(confirmed.iter().map(|c| c["registers"].as_u64().unwrap()).sum::<u64>() >= 2, "{confirmed:?}");
    assert!(line_kinds(&events, "fault").is_empty() && line_kinds(&events, "dma_fault").is_empty());
}

#[test]
fn revalidated_register_meets_the_iommu_fault() {
    // With --revalidate-stale the register is trusted again, so the DMA reaches the IOTLB, misses, asks QEMU (which
    // never answers here) and becomes an IOMMU fault: a transport dma_fault line and the HCA's fault line.
    let (mut s, lb) = write_from_invalidated_pages(&["--revalidate-stale", "--miss-timeout-ms", "200"]);
    check_error_cqe_and_events(&mut s, &lb, FaultCause::IommuUnmapped);

    let (status, _stderr, events) = s.close();
    assert!(status.success());
    assert_eq!(events[0]["revalidate_stale"], true, "the start line carries the knob");
    let page = IOVA + lb.src.off;
    let dma_faults = line_kinds(&events, "dma_fault");
    assert_eq!(dma_faults.len(), 1, "{dma_faults:?}");
    assert_eq!(
        (dma_faults[0]["iova"].as_u64(), dma_faults[0]["cause"].as_str(), dma_faults[0]["queue"].as_u64()),
        (Some(page), Some("iommu_unmapped"), Some(2))
    );
    assert!(line_kinds(&events, "iotlb_miss").iter().any(|m| m["iova"].as_u64() == Some(page)));
    let fault = line_kinds(&events, "fault");
    assert_eq!((fault[0]["cause"].as_str(), fault[0]["iova"].as_u64()), (Some("iommu_unmapped"), Some(page)));
}
