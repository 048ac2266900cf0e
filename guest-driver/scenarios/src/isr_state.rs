//! isr-takes-spin-lock and isr-synchronizes-state: the ISR records each interrupt in state it shares with the CQ
//! consumer in the DPC (how many messages came since the consumer last looked, as drivers count interrupt causes).
//!
//! The bug: both sides guard that state with an ordinary spin lock, so the ISR calls KeAcquireSpinLock at DIRQL.
//! KeAcquireSpinLock is for IRQL <= DISPATCH_LEVEL
//! (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-keacquirespinlock); IRQL checking stops
//! it with 0xC4/0x42 (P2 the IRQL, P3 the lock:
//! https://learn.microsoft.com/windows-hardware/drivers/debugger/bug-check-0xc4--driver-verifier-detected-violation).
//! Without the verifier the model lets it run (the IRQL stays at DIRQL); on Windows the same code deadlocks when
//! the interrupt arrives on a processor whose DPC holds the lock, which no run can make happen on purpose.
//! The fix: the ISR acknowledges, writes the state under the interrupt spin lock it already holds, and queues the
//! DPC; the consumer reads and resets the state through KeSynchronizeExecution, which takes that same lock at
//! DIRQL (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-kesynchronizeexecution).

use alloc::sync::Arc;
use core::sync::atomic::{AtomicU64, Ordering};

use anyhow::ensure;
use vhca_driver_core::IsrWork;
use vhca_ntapi::*;
use vhca_proto::status::WcStatus;
use vhca_proto::Cqe;

use crate::dpc_consumer::{hooks, watch_with, Done, WritePair};
use crate::verbs::Loopback;
use crate::{Ctx, ScenarioHost};

const WRITES: u64 = 4;
const LEN: u32 = 1024;

pub fn spin_lock<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, Guard::SpinLock)
}

pub fn synchronized<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let guard = if ctx.options.break_fix { Guard::SpinLock } else { Guard::InterruptSpinLock };
    run(ctx, guard)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Guard {
    /// KeAcquireSpinLock in the ISR and in the DPC.
    SpinLock,
    /// The interrupt spin lock: held by the kernel around the ISR, taken by KeSynchronizeExecution in the DPC.
    InterruptSpinLock,
}

/// What the ISR and the consumer share. Atomics only so the type is Sync; the guard is what makes each
/// read-and-reset one step, as a plain field under a lock would be in C.
struct IsrState {
    messages: AtomicU64,
}

/// The consumer's read-and-reset of the ISR's count, under `guard` (from the DPC, or at PASSIVE_LEVEL at the end).
fn take<K: NtAsyncKernel>(k: &K, guard: Guard, lock: PKSPIN_LOCK, interrupt: PKINTERRUPT, s: &IsrState) -> u64 {
    match guard {
        Guard::SpinLock => {
            let old = k.KeAcquireSpinLock(lock);
            let n = s.messages.swap(0, Ordering::Relaxed);
            k.KeReleaseSpinLock(lock, old);
            n
        }
        Guard::InterruptSpinLock => {
            let mut n = 0;
            k.KeSynchronizeExecution(interrupt, &mut || {
                n = s.messages.swap(0, Ordering::Relaxed);
                true
            });
            n
        }
    }
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, guard: Guard) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    let pair = WritePair::new(ctx, lb.pd, LEN * WRITES as u32, 45)?;
    let kernel = ctx.kernel.clone();
    let state = Arc::new(IsrState { messages: AtomicU64::new(0) });
    let lock = kernel.KeInitializeSpinLock();
    let interrupt = hooks(ctx)?.interrupt().ok_or_else(|| anyhow::anyhow!("the completion path is not connected"))?;

    let (k, s) = (kernel.clone(), state.clone());
    let isr: IsrWork = Arc::new(move || match guard {
        // The bug: an ordinary spin lock at DIRQL.
        Guard::SpinLock => {
            let old = k.KeAcquireSpinLock(lock);
            s.messages.fetch_add(1, Ordering::Relaxed);
            k.KeReleaseSpinLock(lock, old);
        }
        // The kernel holds the interrupt spin lock around the ISR: the state is the ISR's to write.
        Guard::InterruptSpinLock => {
            s.messages.fetch_add(1, Ordering::Relaxed);
        }
    });
    hooks(ctx)?.set_isr_work(Some(isr));

    let done = Done::new(kernel.clone(), WRITES);
    let (seen_messages, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let (k, s, d, seen, f) = (kernel.clone(), state.clone(), done.clone(), seen_messages.clone(), failed.clone());
    let callback = Arc::new(move |_cq: u32, cqe: &Cqe| {
        seen.fetch_add(take(&*k, guard, lock, interrupt, &s), Ordering::Relaxed);
        if cqe.status.get() != WcStatus::Success as u32 {
            f.fetch_add(1, Ordering::Relaxed);
        }
        d.one();
    });
    watch_with(ctx, lb.cq[0], callback)?;
    ctx.say(format_args!(
        "ISR and consumer share the interrupt count under {}",
        match guard {
            Guard::SpinLock => "an ordinary spin lock (KeAcquireSpinLock in the ISR, at DIRQL)",
            Guard::InterruptSpinLock => "the interrupt spin lock (the ISR's own; KeSynchronizeExecution in the DPC)",
        }
    ));
    let writes: alloc::vec::Vec<_> = (0..WRITES).map(|i| pair.write(i + 1, i * LEN as u64, LEN)).collect();
    ctx.hca.post_send_many(lb.qp[0], &writes).map_err(|e| anyhow::anyhow!("post_send_many: {e}"))?;
    let all = done.wait(ctx.timeout);
    // A DPC that an earlier message queued may drain the CQ before the CQ event's own message reaches the ISR (the
    // device writes the CQE and the event, then signals; the DPC reads whatever is there), so the completions can
    // all be handed over before the ISR counts anything: as on Windows. The consumer then takes the count once more
    // at PASSIVE_LEVEL, until the CQ event's message has come, within the run's timeout.
    let deadline = ctx.host.now() + ctx.timeout;
    while all && seen_messages.load(Ordering::Relaxed) == 0 && ctx.host.now() < deadline {
        seen_messages.fetch_add(take(&*kernel, guard, lock, interrupt, &state), Ordering::Relaxed);
        ctx.host.sleep(core::time::Duration::from_millis(1));
    }
    // The ISR's work goes before anything it touches: set through KeSynchronizeExecution, no ISR runs it after.
    hooks(ctx)?.set_isr_work(None);
    let seen = seen_messages.load(Ordering::Relaxed);
    ctx.detail("isr_messages_seen_by_consumer", seen);
    let data = pair.check(ctx, "rdma_writes", (LEN * WRITES as u32) as usize);
    ctx.detail("data", &data);
    pair.free(ctx)?;
    lb.destroy(ctx)?;
    ensure!(all, "the consumer saw {} of {WRITES} completions within {:?}", WRITES - done.left(), ctx.timeout);
    ensure!(failed.load(Ordering::Relaxed) == 0, "{} completions failed", failed.load(Ordering::Relaxed));
    ensure!(seen >= 1, "the consumer saw no interrupt the ISR recorded");
    ensure!(data["matches"] == serde_json::json!(true), "the RDMA writes' data did not arrive: {data}");
    Ok(())
}
