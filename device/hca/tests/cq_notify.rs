//! CQ arming as in verbs (ibv_req_notify_cq): one CQ_COMPLETION event for the next CQE, or with solicited_only for
//! the next solicited one (the RECV of a SEND with the solicited flag, or any error), then disarmed.

mod common;

use common::*;
use vhca_proto::status::WcStatus;
use vhca_proto::*;
use zerocopy::IntoBytes;

fn cq_events(rig: &mut Rig) -> Vec<(u32, u32)> {
    rig.async_events()
        .into_iter()
        .filter(|e| e.kind.get() == EventKind::CqCompletion as u32)
        .map(|e| (e.handle.get(), e.detail.get()))
        .collect()
}

#[test]
fn solicited_only_waits_for_a_solicited_or_failed_completion() {
    let mut rig = Rig::with_registers(64);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 256);
    let arm = ReqNotifyCqReq { cq: p.cq_b.handle.into(), solicited_only: 1.into() };
    assert_eq!(rig.cmd(Opcode::ReqNotifyCq, arm.as_bytes(), &[]).0, Status::Ok);

    // An unsolicited SEND's RECV completes on b's CQ without an event.
    rig.post_recv(&mut p.b, 0x10, &[sge(&mr, 0, 64)]);
    rig.post_send(&mut p.a, &wqe(1, WrOpcode::Send, WR_SIGNALED, 0, 0, &[sge(&mr, 64, 8)]));
    assert_eq!(rig.poll(&mut p.cq_b).len(), 1);
    assert!(cq_events(&mut rig).is_empty(), "an unsolicited completion fired a solicited-only arm");

    // The solicited one fires it, once.
    rig.post_recv(&mut p.b, 0x11, &[sge(&mr, 0, 64)]);
    rig.post_send(&mut p.a, &wqe(2, WrOpcode::Send, WR_SIGNALED | WR_SOLICITED, 0, 0, &[sge(&mr, 64, 8)]));
    rig.post_recv(&mut p.b, 0x12, &[sge(&mr, 0, 64)]);
    rig.post_send(&mut p.a, &wqe(3, WrOpcode::Send, WR_SIGNALED | WR_SOLICITED, 0, 0, &[sge(&mr, 64, 8)]));
    assert_eq!(rig.poll(&mut p.cq_b).len(), 2);
    assert_eq!(cq_events(&mut rig), [(p.cq_b.handle, 1)], "one event, for CQE 1; disarmed after it");

    // An error completion is solicited too.
    assert_eq!(rig.cmd(Opcode::ReqNotifyCq, arm.as_bytes(), &[]).0, Status::Ok);
    rig.post_recv(&mut p.b, 0x13, &[sge(&mr, 0, 4)]);
    rig.post_send(&mut p.a, &wqe(4, WrOpcode::Send, WR_SIGNALED, 0, 0, &[sge(&mr, 64, 8)]));
    let c = rig.poll(&mut p.cq_b);
    assert_eq!(c[0].status, WcStatus::LocLenErr, "the RECV was too small");
    assert_eq!(cq_events(&mut rig), [(p.cq_b.handle, 3)]);
}

#[test]
fn arming_by_doorbell_is_the_same_one_shot() {
    let mut rig = Rig::with_registers(64);
    let mut p = pair(&mut rig, ACCESS_ALL);
    let mr = rig.reg_mr(p.pd, ACCESS_ALL, 64);
    let write = |id| wqe(id, WrOpcode::RdmaWrite, WR_SIGNALED, mr.addr, mr.key, &[sge(&mr, 0, 8)]);
    rig.post_send(&mut p.a, &write(1));
    rig.poll(&mut p.cq_a);
    assert!(cq_events(&mut rig).is_empty(), "a CQ never armed raises nothing");
    for round in 0..3u32 {
        rig.doorbell(DoorbellKind::CqArm, p.cq_a.handle, 0, 0);
        rig.post_send(&mut p.a, &write(10 + u64::from(round)));
        rig.post_send(&mut p.a, &write(20 + u64::from(round)));
        assert_eq!(rig.poll(&mut p.cq_a).len(), 2);
        assert_eq!(cq_events(&mut rig), [(p.cq_a.handle, 1 + 2 * round)], "round {round}: one event per arm");
    }
}
