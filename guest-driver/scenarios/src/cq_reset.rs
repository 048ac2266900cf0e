//! stale-completion-after-reset and reset-clears-cq: a late completion after a reset. A request fails (a SEND the
//! peer has no RECV for puts the QP in ERR) and the driver recovers by resetting the connection: both QPs destroyed, each CQ
//! recreated over the ring it already had (`Hca::reset_cq`), the QPs created and connected again, the request
//! numbering started over. The device runs with `--inject hold_completion_ms=N` and `hold_completion_wr=3`: it
//! holds the first request after the reset, an RDMA READ into a buffer mapped for that request, and `--revalidate-
//! stale` (its DMA after an unmap asks the vIOMMU again, as a device's DMA on Windows reaches the platform IOMMU).
//!
//! The bug: the reset keeps the ring as the old CQ left it. The device's new CQ starts at index 0 with the first
//! lap's owner, so the old CQ's first CQE, the successful RDMA READ of wr 1 before the reset, reads as new: the
//! driver takes it for the new wr 1 at once, ends the request (its buffer unmapped with PutScatterGatherList, a real
//! VFIO unmap, and freed) and hands the caller data the device has not written. When the hold runs out the device's
//! read lands on an IOVA the vIOMMU no longer maps: a DMAR fault in the guest, 0xE6/0x26 under DMA checking. The
//! device's CQE for that read goes to the new CQ's slot 0, behind the consumer index the stale CQEs moved on, so the
//! driver never sees it: the CQ stays out of step with the device for good.
//! The fix: the reset zeroes the ring before the device gets it back (zeroed memory is never a CQE), so the wait
//! for wr 1 sees the device's own completion, after the hold, and the data it read.

use alloc::vec::Vec;
use core::time::Duration;

use anyhow::ensure;
use vhca_driver_core::{MrMapping, RingReuse};
use vhca_proto::status::WcStatus;
use vhca_proto::{EventKind, WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_READ};

use crate::verbs::{
    compare, cqe_view, dereg, expect_success, pattern, register, sge, status_name, wqe, Buffer, Loopback,
};
use crate::{Ctx, ScenarioHost};

/// How long the seed suite's device holds the request after the reset (`hold_completion_ms`); the run looks for a
/// late DMA this long and more after the request ended.
const HOLD: Duration = Duration::from_millis(500);
const LEN: u32 = 4096;
/// Each connection numbers its requests from 1, as a driver that indexes its request table by wr_id does.
const FIRST_WR: u64 = 1;
/// The request that fails before the reset: a SEND the peer has no RECV for.
const FAILING_WR: u64 = 2;
const ENTRIES: u32 = 64;

pub fn stale<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, RingReuse::AsLeft)
}

pub fn cleared<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let reuse = if ctx.options.break_fix { RingReuse::AsLeft } else { RingReuse::Cleared };
    run(ctx, reuse)
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, reuse: RingReuse) -> anyhow::Result<()> {
    let mut lb = Loopback::new(ctx, ENTRIES, ENTRIES)?;
    // The peer's data: what each RDMA READ fetches (before the reset one pattern, after it another).
    let remote = Buffer::common(ctx, LEN)?;
    remote.fill(ctx, &pattern(21, LEN as usize));
    let mr_remote = register(ctx, lb.pd, &remote, ACCESS_REMOTE_READ, MrMapping::ScatterGather, true)?;

    // Before the reset: wr 1 reads into its own request buffer and completes (slot 0 of QP a's CQ).
    let first = Buffer::pool(ctx, LEN)?;
    let mr_first = register(ctx, lb.pd, &first, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather, true)?;
    let read = wqe(FIRST_WR, WrOpcode::RdmaRead, &[sge(&mr_first, 0, LEN)], Some((&mr_remote, 0)));
    let c = lb.run_on_a(ctx, &read)?;
    expect_success(&c, FIRST_WR, WrOpcode::RdmaRead, Some(LEN))?;
    // Then wr 2 is a SEND the peer posted no RECV for: RNR_RETRY_EXC_ERR (its retries exhausted), and QP a is in
    // ERR. No DMA is refused: the device has nothing to report but the completion and QP_FATAL.
    let send = wqe(FAILING_WR, WrOpcode::Send, &[sge(&mr_first, 0, 64)], None);
    let c = lb.run_on_a(ctx, &send)?;
    ctx.detail("failed_request", cqe_view(&c));
    ensure!(
        c.wr_id.get() == FAILING_WR && c.status.get() == WcStatus::RnrRetryExcErr as u32,
        "wr {FAILING_WR}, a SEND without a RECV, completed as wr {} with {}, expected RNR_RETRY_EXC_ERR",
        c.wr_id.get(),
        status_name(c.status.get())
    );
    // The MR's list given back (PutScatterGatherList: under DMA checking the bounce copy reaches the buffer now).
    dereg(ctx, &mr_first)?;
    ensure!(first.read(ctx) == pattern(21, LEN as usize), "wr {FIRST_WR} before the reset read the wrong data");
    first.free(ctx);
    ctx.drain_events();
    ctx.say("QP a is in ERR after its SEND found no RECV; the driver resets the connection");

    // The reset: QPs destroyed (the device forgets their work), each CQ recreated over its own ring, QPs again.
    for qp in lb.qp {
        ctx.hca.destroy_qp(qp).map_err(|e| anyhow::anyhow!("destroy_qp: {e}"))?;
    }
    for cq in lb.cq.iter_mut() {
        *cq = ctx.reset_cq(*cq, reuse).map_err(|e| anyhow::anyhow!("reset_cq: {e}"))?;
    }
    ctx.detail("ring_reuse", if reuse == RingReuse::Cleared { "cleared" } else { "as_left" });
    lb.reconnect(ctx, ENTRIES)?;
    remote.fill(ctx, &pattern(22, LEN as usize));
    ctx.say(format_args!("connection reset: CQs recreated over their rings ({reuse:?}), QPs connected again"));

    // After the reset: the new wr 1 reads into a buffer mapped for it; the device holds it.
    let second = Buffer::pool(ctx, LEN)?;
    let mr_second = register(ctx, lb.pd, &second, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather, true)?;
    let read = wqe(FIRST_WR, WrOpcode::RdmaRead, &[sge(&mr_second, 0, LEN)], Some((&mr_remote, 0)));
    let started = ctx.host.now();
    let c = lb.run_on_a(ctx, &read)?;
    let waited = ctx.host.now() - started;
    ctx.detail("completion_after_reset", cqe_view(&c));
    ctx.detail("completion_wait_ms", waited.as_millis() as u64);
    expect_success(&c, FIRST_WR, WrOpcode::RdmaRead, Some(LEN))?;
    // The driver's request ends with its completion: the buffer's mapping given back (PutScatterGatherList, which
    // under DMA checking copies the bounce buffer in), the data to the caller, the buffer freed.
    ctx.hca.release_mr_buffer_early(mr_second.lkey).map_err(anyhow::Error::msg)?;
    let data = compare("read after the reset", &second.read(ctx), &pattern(22, LEN as usize));
    let data_read = data["matches"] == true;
    ctx.detail("data_after_reset", data);
    second.free(ctx);
    ctx.say(format_args!(
        "wr {FIRST_WR} after the reset completed after {waited:?}; the caller {} the peer's data; the request's \
         buffer is unmapped and freed",
        if data_read { "got" } else { "did not get" }
    ));

    // The system goes on; a hold the stale CQE hid runs out meanwhile. Every completion until the device's own
    // for wr 1, or until the hold is long past (more stale CQEs of the old CQ come first in the bug).
    let deadline = started + HOLD + HOLD / 2;
    let mut after = Vec::new();
    while ctx.host.now() < deadline {
        let timeout = core::mem::replace(&mut ctx.timeout, deadline - ctx.host.now());
        let got = ctx.poll_cq(lb.cq[0], 1);
        ctx.timeout = timeout;
        let Some(c) = got.ok().and_then(|c| c.into_iter().next()) else { break };
        after.push(c);
        if c.wr_id.get() == FIRST_WR {
            break;
        }
    }
    ctx.detail("completions_after_the_request", after.iter().map(cqe_view).collect::<Vec<_>>());
    let late = after.iter().find(|c| c.wr_id.get() == FIRST_WR).copied();
    // The platform's IOMMU report of the late DMA: with DMA checking, 0xE6/0x26 stops the machine here.
    let dmar = ctx.report_platform_iommu_faults(if data_read { Duration::from_millis(200) } else { HOLD });
    let fault = ctx.wait_event(EventKind::DmaFault, Duration::from_millis(200));
    ctx.detail("dma_fault_event", fault.is_some());

    dereg(ctx, &mr_second)?;
    dereg(ctx, &mr_remote)?;
    remote.free(ctx);
    lb.destroy(ctx)?;
    if reuse == RingReuse::Cleared {
        ensure!(data_read, "the read after the reset completed without the peer's data");
        ensure!(after.is_empty(), "{} more completions came after the read after the reset", after.len());
        ensure!(fault.is_none(), "the device reported a DMA fault after the reset");
        ensure!(dmar.unwrap_or(0) == 0, "the vIOMMU logged a DMAR fault for the device after the reset");
    } else {
        ensure!(!data_read, "the stale completion came after the device's own read: no window to show");
        // The device's own CQE for the read went to the new CQ's slot 0, behind the consumer index the stale CQEs
        // moved on: the driver never sees it, and the CQ stays out of step.
        if let Some(late) = late {
            ensure!(
                late.status.get() != WcStatus::Success as u32,
                "the late read into a freed buffer reported success"
            );
        }
        ensure!(fault.is_some(), "the device reported no DMA fault for its late read");
        ensure!(dmar != Some(0), "the vIOMMU logged no DMAR fault for the late read (is --revalidate-stale set?)");
    }
    Ok(())
}
