//! verbs-loopback: every verb once, end to end. Two RC QPs in loopback; RDMA_WRITE, RDMA_READ and SEND/RECV with
//! S/G-mapped MRs, each completion checked, and every byte checked in guest memory after the MRs are deregistered.

use alloc::vec;
use alloc::vec::Vec;

use anyhow::ensure;
use serde_json::json;
use vhca_driver_core::MrMapping;
use vhca_proto::{WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_READ, ACCESS_REMOTE_WRITE};

use crate::verbs::{compare, cqe_view, dereg, expect_success, pattern, register, sge, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

const LEN: u32 = 6000;

pub fn run<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    // a: the write source, the read destination and the send source; b: the write target, the read source and
    // the receive buffer. Each its own pool buffer, so no two S/G mappings overlap.
    let write_src = Buffer::pool(ctx, LEN)?;
    let write_dst = Buffer::pool(ctx, LEN)?;
    let read_src = Buffer::pool(ctx, LEN)?;
    let read_dst = Buffer::pool(ctx, LEN)?;
    let recv = Buffer::pool(ctx, LEN)?;
    let (w, r) = (pattern(1, LEN as usize), pattern(2, LEN as usize));
    let send_len = 1000u32;
    write_src.fill(ctx, &w);
    read_src.fill(ctx, &r);
    read_dst.fill(ctx, &pattern(4, LEN as usize));
    let sg = MrMapping::ScatterGather;
    let write_local = ACCESS_LOCAL_WRITE;
    let mr_ws = register(ctx, lb.pd, &write_src, 0, sg, true)?;
    let mr_wd = register(ctx, lb.pd, &write_dst, write_local | ACCESS_REMOTE_WRITE, sg, true)?;
    let mr_rs = register(ctx, lb.pd, &read_src, ACCESS_REMOTE_READ, sg, true)?;
    let mr_rd = register(ctx, lb.pd, &read_dst, write_local, sg, true)?;
    let mr_recv = register(ctx, lb.pd, &recv, write_local, sg, true)?;

    // The SEND's payload comes from the start of write_src: the receive must see exactly those bytes.
    ctx.hca
        .post_recv(lb.qp[1], &wqe(30, WrOpcode::Recv, &[sge(&mr_recv, 0, LEN)], None))
        .map_err(|e| anyhow::anyhow!("post_recv: {e}"))?;
    let mut cqes = Vec::new();
    let c = lb.run_on_a(ctx, &wqe(10, WrOpcode::RdmaWrite, &[sge(&mr_ws, 0, LEN)], Some((&mr_wd, 0))))?;
    cqes.push(cqe_view(&c));
    expect_success(&c, 10, WrOpcode::RdmaWrite, Some(LEN))?;
    let c = lb.run_on_a(ctx, &wqe(20, WrOpcode::RdmaRead, &[sge(&mr_rd, 0, LEN)], Some((&mr_rs, 0))))?;
    cqes.push(cqe_view(&c));
    expect_success(&c, 20, WrOpcode::RdmaRead, Some(LEN))?;
    // A CPU write to write_src now would not reach a double-buffered mapping: send what it held at map time.
    let c = lb.run_on_a(ctx, &wqe(40, WrOpcode::Send, &[sge(&mr_ws, 0, send_len)], None))?;
    cqes.push(cqe_view(&c));
    expect_success(&c, 40, WrOpcode::Send, Some(send_len))?;
    let rc = ctx.poll_cq(lb.cq[1], 1)?;
    cqes.push(cqe_view(&rc[0]));
    expect_success(&rc[0], 30, WrOpcode::Recv, Some(send_len))?;
    ctx.detail("completions", &cqes);

    // Deregistration ends each mapping (PutScatterGatherList): from here on the CPU owns the bytes in every mode.
    for mr in [mr_ws, mr_wd, mr_rs, mr_rd, mr_recv] {
        dereg(ctx, &mr)?;
    }
    let checks = vec![
        compare("rdma_write", &write_dst.read(ctx), &w),
        compare("rdma_read", &read_dst.read(ctx), &r),
        compare("send_recv", &recv.read(ctx)[..send_len as usize], &w[..send_len as usize]),
    ];
    ctx.detail("data", &checks);
    for b in [write_src, write_dst, read_src, read_dst, recv] {
        b.free(ctx);
    }
    lb.destroy(ctx)?;
    let bad: Vec<_> = checks.iter().filter(|c| c["matches"] != json!(true)).map(|c| c["what"].clone()).collect();
    ensure!(bad.is_empty(), "data check failed for {bad:?}");
    ctx.say("verbs-loopback: RDMA_WRITE, RDMA_READ, SEND/RECV completed and every byte matches");
    Ok(())
}
