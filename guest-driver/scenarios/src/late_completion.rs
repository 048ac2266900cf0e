//! timeout-frees-buffer and timeout-flushes-qp: the device completes a request late, after the driver's timeout
//! for it passed. The device runs with `--inject hold_completion_ms=N` (it holds the first send work request,
//! unstarted, for N ms) and `--revalidate-stale` (its DMA after an unmap asks the vIOMMU again, as a device's DMA on
//! Windows reaches the platform IOMMU).
//!
//! The bug: when the wait times out the driver gives the request's buffer back at once (PutScatterGatherList, a real
//! VFIO unmap, then the pool freed) while the device still holds the request; its late RDMA write meets an IOVA the
//! vIOMMU no longer maps (a DMAR fault in the guest, which the NT model turns into 0xE6/0x26 under DMA checking).
//! The fix: on the timeout the driver first moves the QP to ERR (`Hca::flush_qp`), which the device honours by
//! dropping the held request with a WR_FLUSH_ERR completion and no DMA; the driver reaps that completion, and only
//! then is the buffer the driver's to free. The run goes on past the hold either way, so a late DMA has its chance.

use core::time::Duration;

use anyhow::ensure;
use vhca_driver_core::MrMapping;
use vhca_proto::status::WcStatus;
use vhca_proto::{Cqe, EventKind, WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::verbs::{cqe_view, dereg, pattern, register, sge, status_name, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

/// The driver's timeout for one data-path request.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(200);
/// How long the seed suite's device holds the request (`hold_completion_ms`); the run waits this long and more
/// after the timeout, so the held request's DMA happens (or, fixed, would have happened) while it looks.
const HOLD: Duration = Duration::from_millis(1000);
const LEN: u32 = 4096;
const WR_ID: u64 = 1;

pub fn frees_buffer<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, false)
}

pub fn flushes_qp<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let flush = !ctx.options.break_fix;
    run(ctx, flush)
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, flush_first: bool) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    let src = Buffer::common(ctx, LEN)?;
    src.fill(ctx, &pattern(11, LEN as usize));
    // The request's data buffer: pool memory mapped for the device for this request, as a driver maps an I/O's
    // buffer with GetScatterGatherList and gives it back when the request ends.
    let dst = Buffer::pool(ctx, LEN)?;
    let mr_src = register(ctx, lb.pd, &src, 0, MrMapping::ScatterGather, true)?;
    let mr_dst = register(ctx, lb.pd, &dst, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE, MrMapping::ScatterGather, true)?;
    let request = wqe(WR_ID, WrOpcode::RdmaWrite, &[sge(&mr_src, 0, LEN)], Some((&mr_dst, 0)));
    ctx.hca.post_send(lb.qp[0], &request).map_err(|e| anyhow::anyhow!("post_send: {e}"))?;
    let in_time = completion_within(ctx, lb.cq[0], REQUEST_TIMEOUT);
    ensure!(
        in_time.is_none(),
        "the request completed within its {REQUEST_TIMEOUT:?} timeout (is the device run with --inject \
         hold_completion_ms?)"
    );
    ctx.say(format_args!("request {WR_ID} timed out after {REQUEST_TIMEOUT:?}; the device still holds it"));

    let flushed = if flush_first {
        ctx.hca.flush_qp(lb.qp[0]).map_err(|e| anyhow::anyhow!("flush_qp: {e}"))?;
        let c = ctx.poll_cq(lb.cq[0], 1)?.into_iter().next();
        ctx.detail("flushed_completion", c.as_ref().map(cqe_view));
        let c = c.ok_or_else(|| anyhow::anyhow!("no completion after the QP went to ERR"))?;
        ensure!(
            c.wr_id.get() == WR_ID && c.status.get() == WcStatus::WrFlushErr as u32,
            "the flushed request completed as wr {} with {}, expected wr {WR_ID} with WR_FLUSH_ERR",
            c.wr_id.get(),
            status_name(c.status.get())
        );
        ctx.say("QP moved to ERR: the device dropped the held request (WR_FLUSH_ERR, no DMA); its buffer is free now");
        Some(c)
    } else {
        None
    };
    // The timeout path gives the request's buffer back: its mapping ends (a VFIO unmap), the pool is freed.
    ctx.hca.release_mr_buffer_early(mr_dst.lkey).map_err(anyhow::Error::msg)?;
    dst.free(ctx);
    ctx.say("the request's buffer is unmapped and freed");

    // The system goes on; the device's hold runs out meanwhile.
    let late = completion_within(ctx, lb.cq[0], HOLD + HOLD / 2);
    ctx.detail("late_completion", late.as_ref().map(cqe_view));
    if let Some(c) = &late {
        ctx.say(format_args!("late completion of wr {}: {}", c.wr_id.get(), status_name(c.status.get())));
    }
    // The platform's IOMMU report of the late DMA: with DMA checking, 0xE6/0x26 stops the machine here.
    let dmar = ctx.report_platform_iommu_faults(if flushed.is_some() { Duration::from_millis(200) } else { HOLD });
    let fault = ctx.wait_event(EventKind::DmaFault, Duration::from_millis(200));
    ctx.detail("dma_fault_event", fault.is_some());

    dereg(ctx, &mr_src)?;
    dereg(ctx, &mr_dst)?;
    src.free(ctx);
    lb.destroy(ctx)?;
    if flushed.is_some() {
        ensure!(late.is_none(), "a completion came after the flushed one: the device still ran the request");
        ensure!(fault.is_none(), "the device reported a DMA fault after the QP was flushed");
        ensure!(dmar.unwrap_or(0) == 0, "the vIOMMU logged a DMAR fault for the device after the QP was flushed");
    } else {
        let late = late.ok_or_else(|| anyhow::anyhow!("the held request never completed"))?;
        ensure!(late.status.get() != WcStatus::Success as u32, "the late write into a freed buffer reported success");
        ensure!(fault.is_some(), "the device reported no DMA fault for its late write");
        ensure!(dmar != Some(0), "the vIOMMU logged no DMAR fault for the late write (is --revalidate-stale set?)");
    }
    Ok(())
}

/// The next completion of `cq` within `wait`, or None: the driver's bounded wait for one request (a wait that
/// fails otherwise counts as none: the checks after it name what is missing).
fn completion_within<H: ScenarioHost>(ctx: &mut Ctx<H>, cq: u32, wait: Duration) -> Option<Cqe> {
    let timeout = core::mem::replace(&mut ctx.timeout, wait);
    let got = ctx.poll_cq(cq, 1);
    ctx.timeout = timeout;
    got.ok().and_then(|c| c.into_iter().next())
}
