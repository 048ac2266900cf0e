//! dpc-waits-for-device, dpc-spins-on-completion and dpc-bounded-batch: a consumer whose requests come in pairs (a
//! write on QP a, then a batch on QP b) finishes a pair only when both completed. The device holds QP a's write for
//! a while (`--inject hold_completion_ms`), so QP b's completions reach the DPC first.
//!
//! The bugs: the consumer's callback for QP b's first completion waits for QP a's in the DPC.
//! - dpc-waits-for-device: KeWaitForSingleObject on the consumer's KEVENT with a timeout, at DISPATCH_LEVEL. A wait
//!   there is legal only with a zero timeout
//!   (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-kewaitforsingleobject); IRQL checking
//!   stops it with 0xC4/0x122 (P2 the IRQL, P3 the object, P4 the timeout:
//!   https://learn.microsoft.com/windows-hardware/drivers/debugger/bug-check-0xc4--driver-verifier-detected-violation).
//!   Without the verifier (or with 0xC4/0x122 disabled) the kernel's own wait cannot block a DPC: 0xB8
//!   ATTEMPTED_SWITCH_FROM_DPC at the wait, P1 the thread the DPC borrowed, P2 the processor's idle thread, P3 an
//!   address on the DPC's stack, P4 0
//!   (https://learn.microsoft.com/windows-hardware/drivers/debugger/bug-check-0xb8--attempted-switch-from-dpc).
//!   The event can never be set meanwhile: QP a's callback would run in this same DPC.
//! - dpc-spins-on-completion: KeStallExecutionProcessor in a loop, reading QP a's CQ, until the held write
//!   completes: the DPC runs past its allotment, 0x133 DPC_WATCHDOG_VIOLATION with P1 0 in every mode (the
//!   kernel's own watchdog: https://learn.microsoft.com/windows-hardware/drivers/debugger/bug-check-0x133-dpc-watchdog-violation).
//!
//! The fix (dpc-bounded-batch): the callbacks only record what completed and return; the driver core's DPC hands
//! out at most its budget of CQEs per run and queues itself again for the rest (`DEFAULT_CQE_BUDGET`), and the pair
//! is finished at PASSIVE_LEVEL, where waiting for the device is allowed.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use core::time::Duration;

use anyhow::ensure;
use vhca_driver_core::CqReader;
use vhca_ntapi::*;
use vhca_proto::status::WcStatus;
use vhca_proto::Cqe;

use crate::dpc_consumer::{relative, watch_with, Done, WritePair};
use crate::verbs::Loopback;
use crate::{Ctx, ScenarioHost};

/// QP b's writes: more than the DPC's budget, so the fixed DPC runs in bounded batches.
const BATCH: u64 = 100;
const LEN: u32 = 256;
/// How long the buggy callbacks wait or spin for QP a's write at most: longer than the device's hold
/// (`hold_completion_ms=1500` in the seed suite) and than the model's DPC allotment (64 ticks, 1 s).
const IN_DPC_WAIT: Duration = Duration::from_secs(2);
/// One spin of the spinning callback.
const SPIN_US: u32 = 1000;
const WR_A: u64 = 1;

pub fn waits<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, InDpc::Wait)
}

pub fn spins<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, InDpc::Spin)
}

pub fn bounded_batch<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let in_dpc = if ctx.options.break_fix { InDpc::Wait } else { InDpc::Record };
    run(ctx, in_dpc)
}

/// What QP b's callback does about QP a's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InDpc {
    Wait,
    Spin,
    /// Nothing: the pair is finished at PASSIVE_LEVEL.
    Record,
}

/// QP a's write, completed once: whichever path sees its CQE first (its callback, or the spinning one).
struct WriteA<K: NtAsyncKernel> {
    kernel: Arc<K>,
    done: AtomicBool,
    event: PKEVENT,
    failed: AtomicU64,
}

impl<K: NtAsyncKernel> WriteA<K> {
    fn completed(&self, cqe: &Cqe, all: &Done<K>) {
        if cqe.wr_id.get() != WR_A || cqe.status.get() != WcStatus::Success as u32 {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        if !self.done.swap(true, Ordering::AcqRel) {
            self.kernel.KeSetEvent(self.event, 0, false);
            all.one();
        }
    }
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, in_dpc: InDpc) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 256, 256)?;
    let pair_a = WritePair::new(ctx, lb.pd, LEN, 51)?;
    let pair_b = WritePair::new(ctx, lb.pd, LEN * BATCH as u32, 52)?;
    let kernel = ctx.kernel.clone();
    let all = Done::new(kernel.clone(), 1 + BATCH);
    let event = kernel.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let write_a =
        Arc::new(WriteA { kernel: kernel.clone(), done: AtomicBool::new(false), event, failed: AtomicU64::new(0) });
    let reader_a: CqReader = ctx.hca.cq_reader(lb.cq[0]).ok_or_else(|| anyhow::anyhow!("CQ a is not open"))?;

    let (w, d) = (write_a.clone(), all.clone());
    watch_with(ctx, lb.cq[0], Arc::new(move |_cq: u32, cqe: &Cqe| w.completed(cqe, &d)))?;
    let (w, d, k) = (write_a.clone(), all.clone(), kernel.clone());
    let first = Arc::new(AtomicBool::new(true));
    let failed_b = Arc::new(AtomicU64::new(0));
    let f = failed_b.clone();
    let callback_b = Arc::new(move |_cq: u32, cqe: &Cqe| {
        if cqe.status.get() != WcStatus::Success as u32 {
            f.fetch_add(1, Ordering::Relaxed);
        }
        d.one();
        if !first.swap(false, Ordering::AcqRel) {
            return;
        }
        match in_dpc {
            // The bug: a wait with a timeout at DISPATCH_LEVEL, for an event only a later DPC run could set.
            InDpc::Wait => {
                k.KeWaitForSingleObject(
                    w.event.into(),
                    KWAIT_REASON::Executive,
                    KPROCESSOR_MODE::KernelMode,
                    false,
                    Some(relative(IN_DPC_WAIT)),
                );
            }
            // The bug: a busy wait on QP a's CQ in the DPC, which the watchdog counts.
            InDpc::Spin => {
                let mut waited = 0u64;
                while !w.done.load(Ordering::Acquire) && waited < IN_DPC_WAIT.as_micros() as u64 {
                    if let Some(cqe) = reader_a.poll(&*k, 1).first() {
                        w.completed(cqe, &d);
                        break;
                    }
                    k.KeStallExecutionProcessor(SPIN_US);
                    waited += SPIN_US as u64;
                }
            }
            InDpc::Record => {}
        }
    });
    watch_with(ctx, lb.cq[1], callback_b)?;
    ctx.say(format_args!(
        "QP b's consumer {} QP a's held write",
        match in_dpc {
            InDpc::Wait => "waits in the DPC (KeWaitForSingleObject with a timeout) for",
            InDpc::Spin => "spins in the DPC (KeStallExecutionProcessor) on",
            InDpc::Record => "records its completions and returns; PASSIVE_LEVEL code waits for",
        }
    ));
    ctx.hca.post_send(lb.qp[0], &pair_a.write(WR_A, 0, LEN)).map_err(|e| anyhow::anyhow!("post_send a: {e}"))?;
    let batch: Vec<_> = (0..BATCH).map(|i| pair_b.write(100 + i, i * LEN as u64, LEN)).collect();
    ctx.hca.post_send_many(lb.qp[1], &batch).map_err(|e| anyhow::anyhow!("post_send_many b: {e}"))?;
    let finished = all.wait(ctx.timeout);
    // A callback still running (the spinning one reads QP a's ring through its own reader) has returned once this
    // does: only then may the CQs go.
    ctx.kernel.KeFlushQueuedDpcs();
    if let Some(c) = &ctx.completions {
        let counts = c.counts();
        ctx.detail("dpc_calls_so_far", counts.dpc_calls);
        ctx.detail("dpc_requeues_so_far", counts.dpc_requeues);
    }
    let data_a = pair_a.check(ctx, "write_a", LEN as usize);
    let data_b = pair_b.check(ctx, "batch_b", (LEN * BATCH as u32) as usize);
    ctx.detail("data", serde_json::json!([data_a.clone(), data_b.clone()]));
    pair_a.free(ctx)?;
    pair_b.free(ctx)?;
    lb.destroy(ctx)?;
    ensure!(finished, "{} of {} completions within {:?}", 1 + BATCH - all.left(), 1 + BATCH, ctx.timeout);
    let failed = write_a.failed.load(Ordering::Relaxed) + failed_b.load(Ordering::Relaxed);
    ensure!(failed == 0, "{failed} completions failed");
    ensure!(data_a["matches"] == serde_json::json!(true), "QP a's write did not arrive: {data_a}");
    ensure!(data_b["matches"] == serde_json::json!(true), "QP b's batch did not arrive: {data_b}");
    Ok(())
}
