//! isr-passive-unsynchronized and isr-passive-synchronized: the ISR counts its interrupts in a word it shares with
//! the passive path, which reads and resets the count after each completion (as a driver reaps interrupt causes).
//!
//! The bug: the passive path reads and resets the word with plain loads and stores. The ISR runs at DIRQL on the
//! processor its message targets while the passive path runs on another, so nothing orders them: the race detector
//! reports the ISR's write against the passive path's read in every recording run, and a preemption between the
//! passive path's read and its reset lets an ISR's count fall between them, which the reset then wipes out: a wrong
//! result ("lost N of M interrupts"), never a bugcheck. Microsoft: "To access data that an ISR also accesses, a
//! driver routine must call a SynchCritSection routine"
//! (https://learn.microsoft.com/windows-hardware/drivers/kernel/accessing-shared-state-information); a spin lock
//! of the driver's own is no fix, it only raises to DISPATCH_LEVEL (isr-takes-spin-lock shows what it does).
//! The fix: the read and the reset run in KeSynchronizeExecution, which takes the interrupt spin lock the ISR runs
//! under (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-kesynchronizeexecution).
//!
//! Why the passive path polls the CQ and arms it itself instead of waiting on the completion path's event: that
//! wait is set by the DPC the ISR queued, which orders every earlier ISR before the passive path's next read, and the
//! race would hide behind it. Here the passive path's only tie to the ISR is the shared word, as in a driver whose
//! control path reaps a status word on its own schedule.

use alloc::sync::Arc;
use core::sync::atomic::{AtomicU64, Ordering};
use core::time::Duration;

use anyhow::{ensure, Context as _};
use vhca_driver_core::IsrWork;
use vhca_ntapi::*;
use vhca_proto::status::WcStatus;

use crate::dpc_consumer::{hooks, WritePair};
use crate::shared_words::SharedWords;
use crate::verbs::{status_name, Loopback};
use crate::{Ctx, ScenarioHost};

const WRITES: u64 = 8;
const LEN: u32 = 512;
/// The word the ISR counts in.
const MESSAGES: usize = 0;
/// Longer than one 512-byte loopback write takes, on the model's device and on the guest's under TCG.
const ONE_WRITE: Duration = Duration::from_millis(2);

pub fn unsynchronized<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, false)
}

pub fn synchronized<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let synchronize = !ctx.options.break_fix;
    run(ctx, synchronize)
}

/// The passive path's read-and-reset of the ISR's count.
fn take<K: NtAsyncKernel>(k: &K, words: SharedWords<1>, interrupt: PKINTERRUPT, synchronize: bool) -> u64 {
    if !synchronize {
        // The bug: an ISR on another processor may count between the load and the store.
        let n = words.get(k, MESSAGES);
        words.set(k, MESSAGES, 0);
        return n;
    }
    let mut n = 0;
    k.KeSynchronizeExecution(interrupt, &mut || {
        n = words.get(k, MESSAGES);
        words.set(k, MESSAGES, 0);
        true
    });
    n
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, synchronize: bool) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    let pair = WritePair::new(ctx, lb.pd, LEN * WRITES as u32, 63)?;
    let kernel = ctx.kernel.clone();
    let interrupt = hooks(ctx)?.interrupt().context("the completion path is not connected")?;
    let words = SharedWords::<1>::new(&*kernel).context("ExAllocatePoolWithTag for the ISR's count failed")?;
    // The count as it really was: the rig's, apart from the driver's word, so a lost update shows.
    let counted = Arc::new(AtomicU64::new(0));
    let (k, c) = (kernel.clone(), counted.clone());
    let isr: IsrWork = Arc::new(move || {
        // The kernel holds the interrupt spin lock around the ISR: its side is right in both builds.
        let n = words.get(&*k, MESSAGES);
        words.set(&*k, MESSAGES, n + 1);
        c.fetch_add(1, Ordering::Relaxed);
    });
    hooks(ctx)?.set_isr_work(Some(isr));
    ctx.say(format_args!(
        "the ISR counts interrupts in {:#x}; the passive path reads and resets it {}",
        words.va().0,
        if synchronize { "in KeSynchronizeExecution" } else { "with plain loads and stores" }
    ));

    let mut taken = 0;
    let mut failed = 0;
    let outcome = (|| -> anyhow::Result<()> {
        for i in 0..WRITES {
            // Armed for this write's CQ event: its message is the ISR run that races the next take.
            ctx.hca.req_notify_cq(lb.cq[0], false).map_err(|e| anyhow::anyhow!("req_notify_cq: {e}"))?;
            ctx.hca
                .post_send(lb.qp[0], &pair.write(i + 1, i * LEN as u64, LEN))
                .map_err(|e| anyhow::anyhow!("post_send: {e}"))?;
            let cqe = poll_one(ctx, lb.cq[0])?;
            if cqe.status.get() != WcStatus::Success as u32 {
                failed += 1;
                ctx.say(format_args!("write {} completed with {}", i + 1, status_name(cqe.status.get())));
            }
            taken += take(&*kernel, words, interrupt, synchronize);
        }
        // The CQ event's message may still be on its way after the last completion (the device writes the CQE,
        // then the event, then signals): the passive path takes the count on, each millisecond, until the ISR
        // counted one, within the run's timeout.
        let deadline = ctx.host.now() + ctx.timeout;
        while counted.load(Ordering::Relaxed) == 0 && ctx.host.now() < deadline {
            ctx.host.sleep(Duration::from_millis(1));
            taken += take(&*kernel, words, interrupt, synchronize);
        }
        Ok(())
    })();
    // Through KeSynchronizeExecution (the core's set_isr_work): no ISR touches the word after this, and everything
    // the ISRs wrote is ordered before the last look, in both builds.
    hooks(ctx)?.set_isr_work(None);
    taken += words.get(&*kernel, MESSAGES);
    words.free(&*kernel);
    let counted = counted.load(Ordering::Relaxed);
    ctx.detail("isr_interrupts_counted", counted);
    ctx.detail("passive_interrupts_taken", taken);
    let data = pair.check(ctx, "rdma_writes", (LEN * WRITES as u32) as usize);
    ctx.detail("data", &data);
    pair.free(ctx)?;
    lb.destroy(ctx)?;
    outcome?;
    ensure!(failed == 0, "{failed} of {WRITES} writes failed");
    ensure!(counted >= 1, "no interrupt reached the ISR in {WRITES} armed completions");
    ensure!(
        taken == counted,
        "the passive path took {taken} of the {counted} interrupts the ISR counted: its unsynchronized reset wiped \
         out {} counted between its read and its store",
        counted.saturating_sub(taken)
    );
    ensure!(data["matches"] == serde_json::json!(true), "the RDMA writes' data did not arrive: {data}");
    Ok(())
}

/// The CQ's next completion, polled from its ring (no event wait: see the module's why-note). Each look is one
/// kernel call (the ring read), so the look comes after a sleep long enough for one write: the passive path's
/// scheduling points then number alike from run to run, and a preemption named by its point finds it again.
fn poll_one<H: ScenarioHost>(ctx: &mut Ctx<H>, cq: u32) -> anyhow::Result<vhca_proto::Cqe> {
    let deadline = ctx.host.now() + ctx.timeout;
    loop {
        ctx.host.sleep(ONE_WRITE);
        let got = ctx.hca.poll_cq(cq, 1).map_err(|e| anyhow::anyhow!("poll_cq: {e}"))?;
        if let Some(cqe) = got.into_iter().next() {
            return Ok(cqe);
        }
        ensure!(ctx.host.now() < deadline, "CQ {cq}: no completion within {:?}", ctx.timeout);
    }
}
