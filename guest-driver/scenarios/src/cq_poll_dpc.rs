//! dpc-polls-destroyed-cq and destroy-cq-flushes-dpcs: a CQ consumer polls its CQ from a periodic timer's DPC
//! targeted at another processor than the control path's (KeSetTargetProcessorDpc), and when its requests are done
//! the control path stops the timer and destroys the CQ, whose ring is a common buffer the DPC reads.
//!
//! The bug: the control path cancels the timer and destroys the CQ at once. KeCancelTimer takes the timer out of
//! the timer queue but not a DPC it already queued or one running on the other processor
//! (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-kecanceltimer: "a DPC that is already
//! running runs to completion. The driver must ensure that the DPC has completed before freeing any resources used
//! by the DPC"), so the DPC's ring reads and the ring's free are unordered: the race detector reports them in every
//! recording run (the DPC runs once more after its consumer's last completion before the teardown, so there is
//! always a read the control path never waited for), and a preemption that holds the DPC at its start until the
//! control path has freed the ring makes it read freed memory: 0x50 PAGE_FAULT_IN_NONPAGED_AREA on the ring's
//! address in the native model (P2 0: a read); vhca.sys, whose reads are its own, reads whatever the freed pages
//! hold, and the run reports the DPC's run after the destroy as a wrong result.
//! The fix: disarm (KeCancelTimer), then KeFlushQueuedDpcs, which "returns after all currently queued DPCs on all
//! processors have executed their DPC routines to completion"
//! (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-keflushqueueddpcs), and only then the
//! destroy; the page on KeCancelTimer names the same routine for a periodic timer's DPC.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use core::time::Duration;

use anyhow::{ensure, Context as _};
use vhca_ntapi::*;
use vhca_proto::status::WcStatus;

use crate::dpc_consumer::{relative, Done, WritePair};
use crate::verbs::Loopback;
use crate::{Ctx, ScenarioHost};

const WRITES: u64 = 4;
const LEN: u32 = 1024;
/// The poll timer's period: the shortest KeSetTimerEx takes; the clock's tick decides the real one.
const PERIOD_MS: u32 = 1;
/// How long the bug build's control path goes on after the destroy before it flushes its own DPC: the time a late
/// DPC has to meet the freed ring.
const RUNS_ON: Duration = Duration::from_millis(100);

pub fn polls_destroyed<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, false)
}

pub fn flushes_dpcs<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let flush = !ctx.options.break_fix;
    run(ctx, flush)
}

/// The processor after the caller's, so the DPC and the control path are two processors (the same one when the
/// machine has only one).
fn other_processor<K: NtAsyncKernel>(k: &K) -> u32 {
    let count = k.KeQueryActiveProcessorCount(None).max(1);
    (k.KeGetCurrentProcessorNumber() + 1) % count
}

/// What the DPC and the control path observe of each other, apart from the driver's state (the rig's notes).
#[derive(Default)]
struct PollNotes {
    runs: AtomicU64,
    /// The CQ was destroyed: a DPC run that starts after it reads a freed ring.
    destroyed: AtomicBool,
    runs_after_destroy: AtomicU64,
    failed: AtomicU64,
    processor: AtomicU64,
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, flush: bool) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    let pair = WritePair::new(ctx, lb.pd, LEN * WRITES as u32, 71)?;
    let kernel = ctx.kernel.clone();
    let reader = ctx.hca.cq_reader(lb.cq[0]).context("the loopback's CQ has no reader")?;
    let done = Done::new(kernel.clone(), WRITES);
    let notes = Arc::new(PollNotes::default());
    // The kernel keeps its DPC routine as long as it lives (vhca.sys's shim until its own drop), so the routine
    // holds the kernel and the countdown (which holds the kernel too) weakly: a strong hold would be a cycle, and
    // vhca.sys's heap would never be empty at unload (0xC4/0x60).
    let (k, d, n) = (Arc::downgrade(&kernel), Arc::downgrade(&done), notes.clone());
    let dpc = kernel.KeInitializeDpc(Arc::new(move |_dpc, _, _| {
        let (Some(k), Some(d)) = (k.upgrade(), d.upgrade()) else { return };
        n.runs.fetch_add(1, Ordering::AcqRel);
        n.processor.store(u64::from(k.KeGetCurrentProcessorNumber()), Ordering::Relaxed);
        if n.destroyed.load(Ordering::Acquire) {
            n.runs_after_destroy.fetch_add(1, Ordering::AcqRel);
        }
        // The consumer's poll: RtlCopyFromVa of the ring's next slots (CqReader), DISPATCH_LEVEL.
        for cqe in reader.poll(&*k, WRITES as usize) {
            if cqe.status.get() != WcStatus::Success as u32 {
                n.failed.fetch_add(1, Ordering::Relaxed);
            }
            d.one();
        }
    }));
    let target = other_processor(&*kernel);
    kernel.KeSetTargetProcessorDpc(dpc, target as CCHAR);
    let timer = kernel.KeInitializeTimerEx(TIMER_TYPE::NotificationTimer);
    kernel.KeSetTimerEx(timer, relative(Duration::from_millis(1)), PERIOD_MS, dpc);
    ctx.say(format_args!(
        "CQ {} polled every {PERIOD_MS} ms by a timer DPC on processor {target}; the control path runs on {}",
        lb.cq[0],
        kernel.KeGetCurrentProcessorNumber()
    ));

    let writes: Vec<_> = (0..WRITES).map(|i| pair.write(i + 1, i * LEN as u64, LEN)).collect();
    ctx.hca.post_send_many(lb.qp[0], &writes).map_err(|e| anyhow::anyhow!("post_send_many: {e}"))?;
    let all = done.wait(ctx.timeout);
    // One poll more than the consumer needed: the DPC keeps running until it is stopped, and this run is the one
    // whose ring reads nothing orders before the teardown but the teardown's own wait.
    let seen = notes.runs.load(Ordering::Acquire);
    let deadline = ctx.host.now() + ctx.timeout;
    while notes.runs.load(Ordering::Acquire) == seen && ctx.host.now() < deadline {
        ctx.host.sleep(Duration::from_millis(1));
    }
    let data = pair.check(ctx, "rdma_writes", (LEN * WRITES as u32) as usize);
    ctx.detail("data", &data);
    pair.free(ctx)?;

    // The teardown: disarm, then (the fix) wait for the DPC's end, then destroy the CQ and its ring. A DPC run
    // that starts after the destroy reads a ring that is gone.
    kernel.KeCancelTimer(timer);
    if flush {
        kernel.KeFlushQueuedDpcs();
    }
    let destroyed = lb.destroy(ctx);
    notes.destroyed.store(true, Ordering::Release);
    if !flush {
        // The system goes on: a DPC the timer queued before the cancel, or one held on its processor, runs now.
        ctx.host.sleep(RUNS_ON);
        kernel.KeFlushQueuedDpcs();
    }
    destroyed?;
    let late = notes.runs_after_destroy.load(Ordering::Acquire);
    ctx.detail("dpc_processor", notes.processor.load(Ordering::Relaxed));
    ctx.detail("dpc_runs", notes.runs.load(Ordering::Acquire));
    ctx.detail("dpc_runs_after_destroy", late);
    ensure!(all, "the poll DPC saw {} of {WRITES} completions within {:?}", WRITES - done.left(), ctx.timeout);
    ensure!(notes.failed.load(Ordering::Relaxed) == 0, "{} completions failed", notes.failed.load(Ordering::Relaxed));
    ensure!(late == 0, "the poll DPC ran {late} time(s) after its CQ was destroyed: it read the freed ring");
    ensure!(data["matches"] == serde_json::json!(true), "the RDMA writes' data did not arrive: {data}");
    Ok(())
}
