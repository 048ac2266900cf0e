//! Loopback data movement verified byte for byte: RDMA_WRITE, RDMA_READ, SEND/RECV, over MRs whose pages are not
//! IOVA-contiguous and start mid-page; CQE ring layout and owner laps; doorbell refusals.

mod common;

use common::*;
use vhca_hca::{HcaConfig, HcaEvent};
use vhca_proto::status::WcStatus;
use vhca_proto::*;
use zerocopy::IntoBytes;

#[test]
fn rdma_write_moves_every_byte() {
    let mut rig = Rig::with_registers(256);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let len = 5 * PAGE_SIZE + 123;
    let (_, src) = rig.try_reg_mr_at(p.pd, ACCESS_ALL, len, 0x321);
    let (_, dst) = rig.try_reg_mr_at(p.pd, ACCESS_ALL, len + 64, 0x10);
    let (src, dst) = (src.unwrap(), dst.unwrap());
    let data = pattern(len as usize, 7);
    rig.mem.poke(src.iova, &data);
    // Two SGEs: the payload is their concatenation.
    let first = 3000u32;
    let sges = [sge(&src, 0, first), sge(&src, u64::from(first), len as u32 - first)];
    rig.post_send(&mut p.a, &wqe(0xabc, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr + 64, dst.key, &sges));
    let done = rig.poll(&mut p.cq_a);
    assert_eq!(done.len(), 1);
    assert_eq!((done[0].wr_id, done[0].status, done[0].byte_len), (0xabc, WcStatus::Success, len as u32));
    assert_eq!(done[0].opcode, WrOpcode::RdmaWrite as u32);
    assert_eq!(rig.mem.peek(dst.iova + 64, len as usize), data);
    assert_eq!(rig.mem.peek(dst.iova, 64), vec![0u8; 64], "bytes before the target untouched");
    assert!(rig.poll(&mut p.cq_b).is_empty(), "RDMA_WRITE completes nothing on the responder");
    let dmas = rig.events_of("dma");
    assert!(dmas.iter().any(|d| d["purpose"] == "rdma_write_remote" && d["wr_id"] == 0xabc && d["ok"] == true));
}

/// RDMA_WRITE, RDMA_READ and SEND move their payload memory to memory (`Dma::copy`), once; only WQEs and CQEs go
/// through `read`/`write`.
#[test]
fn payloads_move_once_memory_to_memory() {
    let mut rig = Rig::with_registers(256);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let len = 16 * PAGE_SIZE;
    let src = rig.reg_mr(p.pd, ACCESS_ALL, len);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, len);
    rig.mem.poke(src.iova, &pattern(len as usize, 3));
    let before = (rig.mem.bytes_read_or_written.get(), rig.mem.bytes_copied.get());
    let write = wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, len as u32)]);
    rig.post_send(&mut p.a, &write);
    let read = wqe(2, WrOpcode::RdmaRead, WR_SIGNALED, src.addr, src.key, &[sge(&dst, 0, len as u32)]);
    rig.post_send(&mut p.a, &read);
    rig.post_recv(&mut p.b, 3, &[sge(&dst, 0, len as u32)]);
    rig.post_send(&mut p.a, &wqe(4, WrOpcode::Send, WR_SIGNALED, 0, 0, &[sge(&src, 0, len as u32)]));
    let done = rig.poll(&mut p.cq_a);
    assert_eq!(done.iter().map(|c| c.status).collect::<Vec<_>>(), [WcStatus::Success; 3]);
    assert_eq!(rig.mem.peek(dst.iova, len as usize), pattern(len as usize, 3));
    let copied = rig.mem.bytes_copied.get() - before.1;
    let through_buffers = rig.mem.bytes_read_or_written.get() - before.0;
    assert_eq!(copied, 3 * len, "each payload copied once");
    assert!(through_buffers < 1024, "only WQEs and CQEs are read or written: {through_buffers} bytes");
}

#[test]
fn rdma_read_moves_every_byte() {
    let mut rig = Rig::with_registers(256);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let len = 3 * PAGE_SIZE as usize + 17;
    let remote = rig.reg_mr(p.pd, ACCESS_ALL, len as u64);
    let (_, local) = rig.try_reg_mr_at(p.pd, ACCESS_LOCAL_WRITE, len as u64, 0x800);
    let local = local.unwrap();
    let data = pattern(len, 99);
    rig.mem.poke(remote.iova, &data);
    let w = wqe(5, WrOpcode::RdmaRead, WR_SIGNALED, remote.addr, remote.key, &[sge(&local, 0, len as u32)]);
    rig.post_send(&mut p.a, &w);
    let done = rig.poll(&mut p.cq_a);
    assert_eq!((done[0].status, done[0].byte_len, done[0].opcode), (WcStatus::Success, len as u32, 2));
    assert_eq!(rig.mem.peek(local.iova, len), data);
}

#[test]
fn send_recv_moves_every_byte() {
    let mut rig = Rig::with_registers(256);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let len = 2 * PAGE_SIZE as usize + 300;
    let src = rig.reg_mr(p.pd, 0, len as u64);
    let dst = rig.reg_mr(p.pd, ACCESS_LOCAL_WRITE, 4 * PAGE_SIZE);
    let data = pattern(len, 3);
    rig.mem.poke(src.iova, &data);
    // The receive buffer is two SGEs; the payload fills the first and part of the second.
    rig.post_recv(&mut p.b, 0x77, &[sge(&dst, 0, 1000), sge(&dst, 2 * PAGE_SIZE, 2 * PAGE_SIZE as u32)]);
    rig.post_send(&mut p.a, &wqe(0x66, WrOpcode::Send, WR_SIGNALED | WR_SOLICITED, 0, 0, &[sge(&src, 0, len as u32)]));
    let sent = rig.poll(&mut p.cq_a);
    assert_eq!((sent[0].wr_id, sent[0].status, sent[0].byte_len), (0x66, WcStatus::Success, len as u32));
    let recv = rig.poll(&mut p.cq_b);
    assert_eq!(recv.len(), 1);
    assert_eq!((recv[0].wr_id, recv[0].status, recv[0].byte_len), (0x77, WcStatus::Success, len as u32));
    assert_eq!((recv[0].opcode, recv[0].qpn), (WrOpcode::Recv as u32, p.b.qpn));
    assert_eq!(rig.mem.peek(dst.iova, 1000), data[..1000]);
    assert_eq!(rig.mem.peek(dst.iova + 2 * PAGE_SIZE, len - 1000), data[1000..]);
    assert_eq!(rig.mem.peek(dst.iova + 1000, 16), vec![0u8; 16], "gap between SGEs untouched");
}

/// The event log stamps the HCA's lines with the time their request began: every command and every doorbell record
/// must start one, before its first line.
#[test]
fn every_command_and_doorbell_record_starts_a_request_before_its_lines() {
    let mut rig = Rig::with_registers(64);
    let starts = |rig: &Rig| rig.events.1.lock().unwrap().clone();
    let pd = rig.alloc_pd();
    assert_eq!(starts(&rig), vec![0], "the command started one request, before its lines");
    let mut cq = rig.create_cq(16);
    let mut a = rig.create_qp(pd, cq.handle, cq.handle);
    rig.bring_up(a.qpn, a.qpn, ACCESS_ALL);
    let mr = rig.reg_mr(pd, ACCESS_ALL, 64);
    let commands = starts(&rig).len();
    for id in [1, 2] {
        rig.write_send_wqe(&mut a, &wqe(id, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 0, 8)]));
    }
    let record = |index: u32| Doorbell {
        kind: (DoorbellKind::SendQueue as u32).into(),
        handle: a.qpn.into(),
        index: index.into(),
        flags: 0.into(),
    };
    let records = [record(1).as_bytes(), record(2).as_bytes()].concat();
    rig.hca.doorbell(&rig.mem, &records);
    assert_eq!(rig.poll(&mut cq).len(), 2);
    let starts = starts(&rig);
    assert_eq!(starts.len(), commands + 2, "one request per doorbell record");
    let events = rig.events.0.lock().unwrap();
    let doorbells: Vec<usize> =
        events.iter().enumerate().filter(|(_, e)| matches!(e, HcaEvent::Doorbell { .. })).map(|(i, _)| i).collect();
    let (first, second) = (starts[commands], starts[commands + 1]);
    assert_eq!(doorbells[doorbells.len() - 2..], [first, second], "each record's lines start with its own request");
}

#[test]
fn unsignaled_success_writes_no_cqe_and_owner_laps() {
    let mut rig = Rig::with_registers(256);
    let pd = rig.alloc_pd();
    let mut cq = rig.create_cq(4);
    let mut a = rig.create_qp(pd, cq.handle, cq.handle);
    rig.bring_up(a.qpn, a.qpn, ACCESS_ALL); // loopback to itself
    let mr = rig.reg_mr(pd, ACCESS_ALL, 64);
    rig.post_send(&mut a, &wqe(1, WrOpcode::RdmaWrite, 0, mr.addr, mr.key, &[sge(&mr, 0, 8)]));
    assert!(rig.poll(&mut cq).is_empty());
    // 10 signaled completions through a 4-entry CQ, polled as they come: owner laps 1, 2, 1.
    for id in 10..20u64 {
        rig.post_send(&mut a, &wqe(id, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 0, 8)]));
        let c = rig.poll(&mut cq);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].wr_id, id);
    }
    let completions = rig.events_of("completion");
    let indices: Vec<_> = completions.iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(indices, (0..10).collect::<Vec<_>>());
}

#[test]
fn wqes_rung_before_rts_run_at_rts() {
    let mut rig = Rig::with_registers(64);
    let pd = rig.alloc_pd();
    let mut cq = rig.create_cq(16);
    let mut a = rig.create_qp(pd, cq.handle, cq.handle);
    let mr = rig.reg_mr(pd, ACCESS_ALL, 64);
    assert_eq!(rig.modify_qp(a.qpn, QP_ATTR_STATE | QP_ATTR_ACCESS_FLAGS, QpState::Init, 0, ACCESS_ALL), Status::Ok);
    assert_eq!(rig.modify_qp(a.qpn, QP_ATTR_STATE | QP_ATTR_DEST_QPN, QpState::Rtr, a.qpn, 0), Status::Ok);
    rig.post_send(&mut a, &wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 0, 8)]));
    assert!(rig.poll(&mut cq).is_empty(), "RTR does not send");
    assert_eq!(rig.modify_qp(a.qpn, QP_ATTR_STATE, QpState::Rts, 0, 0), Status::Ok);
    assert_eq!(rig.poll(&mut cq)[0].status, WcStatus::Success);
}

/// One doorbell record for several WQEs runs them all, in order; a failure among them sends the QP to ERR and the
/// rest are flushed, whichever WQE was the last posted.
#[test]
fn one_doorbell_runs_every_posted_wqe_and_a_failure_flushes_the_rest() {
    for failing in [None, Some(1u64), Some(3)] {
        let mut rig = Rig::with_registers(64);
        let mut p = pair(&mut rig, ACCESS_ALL);
        let mr = rig.reg_mr(p.pd, ACCESS_ALL, 4 * 64);
        for wr_id in 0..4u64 {
            // A write past the end of the MR fails its WR with REM_ACCESS_ERR.
            let at = if failing == Some(wr_id) { mr.addr + 4 * 64 } else { mr.addr + wr_id * 64 };
            rig.write_send_wqe(&mut p.a, &wqe(wr_id, WrOpcode::RdmaWrite, WR_SIGNALED, at, mr.key, &[sge(&mr, 0, 8)]));
        }
        rig.doorbell(DoorbellKind::SendQueue, p.a.qpn, p.a.sq_posted, 0);
        let done = rig.poll(&mut p.cq_a);
        let expected: Vec<(u64, WcStatus)> = (0..4u64)
            .map(|wr_id| match failing {
                Some(f) if wr_id == f => (wr_id, WcStatus::RemAccessErr),
                Some(f) if wr_id > f => (wr_id, WcStatus::WrFlushErr),
                _ => (wr_id, WcStatus::Success),
            })
            .collect();
        assert_eq!(done.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(), expected, "failing {failing:?}");
    }
}

#[test]
fn doorbell_refusals_are_logged_not_acted_on() {
    let mut rig = Rig::with_registers(64);
    let mut p = pair(&mut rig, ACCESS_ALL);
    rig.doorbell(DoorbellKind::SendQueue, 999, 1, 0);
    rig.doorbell(DoorbellKind::SendQueue, p.a.qpn, 17, 0); // ring has 16 entries
    rig.hca.doorbell(&rig.mem, &[1, 2, 3]);
    let bogus = Doorbell { kind: 9.into(), handle: 0.into(), index: 0.into(), flags: 0.into() };
    rig.hca.doorbell(&rig.mem, zerocopy::IntoBytes::as_bytes(&bogus));
    rig.doorbell(DoorbellKind::CqArm, 999, 0, 0);
    let pd = p.pd;
    let cq = p.cq_a.handle;
    let fresh = rig.create_qp(pd, cq, cq);
    rig.doorbell(DoorbellKind::RecvQueue, fresh.qpn, 1, 0); // RESET
    let dbs = rig.events_of("doorbell");
    assert_eq!(dbs.len(), 6);
    assert!(dbs.iter().all(|d| d["ok"] == false), "{dbs:?}");
    assert!(rig.poll(&mut p.cq_a).is_empty());
    assert!(rig.events_of("dma").is_empty(), "a refused doorbell moves nothing");
    let _ = &mut p.a;
}

/// A sink that keeps no events (`EventSink::keeps_events` false) is given no records, and nothing else changes:
/// the same work requests, including refused ones, leave the same CQEs, async events and guest memory.
#[test]
fn a_sink_that_keeps_no_events_changes_nothing_but_the_records() {
    let run = |mut rig: Rig| {
        let mut p = pair(&mut rig, ACCESS_ALL);
        let len = 3 * PAGE_SIZE + 77;
        let (_, src) = rig.try_reg_mr_at(p.pd, ACCESS_ALL, len, 0x40);
        let dst = rig.reg_mr(p.pd, ACCESS_ALL, len + PAGE_SIZE);
        let src = src.unwrap();
        rig.mem.poke(src.iova, &pattern(len as usize, 9));
        let sges = [sge(&src, 0, len as u32)];
        rig.post_send(&mut p.a, &wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr + 5, dst.key, &sges));
        // Refused: past the end of the destination MR; the QP goes to ERR and the next WR is flushed.
        rig.post_send(&mut p.a, &wqe(2, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr + PAGE_SIZE + 6, dst.key, &sges));
        rig.post_send(&mut p.a, &wqe(3, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &sges));
        let done = rig.poll(&mut p.cq_a);
        let events = rig.async_events().iter().map(|e| e.as_bytes().to_vec()).collect::<Vec<_>>();
        (done, events, rig.mem.peek(dst.iova, (len + PAGE_SIZE) as usize), rig.events().len())
    };
    let kept = run(Rig::with_registers(64));
    let dropped = run(Rig::quiet(HcaConfig { map_registers: 64, ..Default::default() }));
    assert_eq!(kept.0.iter().map(|c| c.status).collect::<Vec<_>>()[..2], [WcStatus::Success, WcStatus::RemAccessErr]);
    assert!(!kept.1.is_empty(), "the refusal raised async events");
    assert!(kept.3 > 0 && dropped.3 == 0, "records: {} kept, {} dropped", kept.3, dropped.3);
    assert_eq!((kept.0, kept.1, kept.2), (dropped.0, dropped.1, dropped.2));
}
