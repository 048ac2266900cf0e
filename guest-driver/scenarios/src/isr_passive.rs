//! isr-passive-unsynchronized and isr-passive-synchronized: the ISR counts its interrupts in a word it shares with
//! the passive path, whose reaper (a work item, as a driver reaps interrupt causes at PASSIVE_LEVEL) reads and
//! resets the count after each completion.
//!
//! The bug: the reaper reads and resets the word with plain loads and stores. The ISR runs at DIRQL on the
//! processor its message targets while the reaper runs on a system worker thread on another, so nothing orders
//! them: the race detector reports the ISR's write against the reaper's read in every recording run, and a
//! preemption between the reaper's read and its reset lets an ISR's count fall between them, which the reset then
//! wipes out: a wrong result ("lost N of M interrupts"), never a bugcheck. Microsoft: "To access data that an ISR
//! also accesses, a driver routine must call a SynchCritSection routine"
//! (https://learn.microsoft.com/windows-hardware/drivers/kernel/accessing-shared-state-information); a spin lock
//! of the driver's own is no fix, it only raises to DISPATCH_LEVEL (isr-takes-spin-lock shows what it does).
//! The fix: the read and the reset run in KeSynchronizeExecution, which takes the interrupt spin lock the ISR runs
//! under (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-kesynchronizeexecution).
//!
//! Why a reaper beside the verbs, and not a take on the verbs' own thread: vhca.sys's verbs (a CQ arm, a post)
//! ring a doorbell and wait for the device to take it, and that wait ends on the event the DPC sets after the
//! device's interrupt. The carrier has one message for every queue, so the ISR that counted a write's CQ event ran
//! before the ISR whose DPC ended the wait, under the same interrupt spin lock: every count is ordered before the
//! verbs thread's next look, and a take there never races (what the first version of this scenario found as
//! vhca.sys: no race in a recording or 17 preempted runs). A work item has no such tie: it is ordered after what
//! the verbs thread did before it signalled the reaper, and not against the ISRs that come after, in both builds.

use alloc::boxed::Box;
use alloc::sync::Arc;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use core::time::Duration;

use anyhow::{ensure, Context as _};
use vhca_driver_core::IsrWork;
use vhca_ntapi::*;
use vhca_proto::status::WcStatus;

use crate::dpc_consumer::{hooks, WritePair};
use crate::event_wait::set_within as wait;
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

/// The reaper's read-and-reset of the ISR's count.
fn take<K: NtAsyncKernel + ?Sized>(k: &K, words: SharedWords<1>, interrupt: PKINTERRUPT, synchronize: bool) -> u64 {
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

/// The reaper's side: what it took, and how the verbs thread wakes and stops it.
struct Reaper {
    /// A synchronization event: set after each completion, each wait takes one set (two sets before a wait are
    /// one wake, and one take then gets both counts).
    reap: PKEVENT,
    stop: Arc<AtomicBool>,
    /// Set by the reaper as it ends, after its last take.
    done: PKEVENT,
    taken: Arc<AtomicU64>,
}

impl Reaper {
    /// Queues the reaper on a system worker thread: it takes the count at each wake until told to stop, then once
    /// more. A wake that does not come within `timeout` ends it too (the verbs thread failed).
    fn start<H: ScenarioHost>(
        ctx: &Ctx<H>,
        words: SharedWords<1>,
        interrupt: PKINTERRUPT,
        synchronize: bool,
    ) -> anyhow::Result<Reaper> {
        let kernel = ctx.kernel.clone();
        let item = kernel.IoAllocateWorkItem(ctx.own_device);
        ensure!(!item.is_null(), "IoAllocateWorkItem for the reaper failed");
        let reaper = Reaper {
            reap: kernel.KeInitializeEvent(EVENT_TYPE::SynchronizationEvent, false),
            stop: Arc::new(AtomicBool::new(false)),
            done: kernel.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false),
            taken: Arc::new(AtomicU64::new(0)),
        };
        let (k, timeout) = (kernel.clone(), ctx.timeout);
        let (reap, stop, done, taken) = (reaper.reap, reaper.stop.clone(), reaper.done, reaper.taken.clone());
        let routine: PIO_WORKITEM_ROUTINE = Box::new(move |_device: PDEVICE_OBJECT| {
            loop {
                let woken = wait(&*k, reap, timeout);
                let last = stop.load(Ordering::Acquire) || !woken;
                taken.fetch_add(take(&*k, words, interrupt, synchronize), Ordering::Relaxed);
                if last {
                    break;
                }
            }
            // The routine runs after its item was dequeued, so it may free it; `done` is what the verbs wait on.
            k.IoFreeWorkItem(item);
            k.KeSetEvent(done, 0, false);
        });
        kernel.IoQueueWorkItem(item, routine, WORK_QUEUE_TYPE::DelayedWorkQueue);
        Ok(reaper)
    }

    /// Stops the reaper and waits for its last take: whether it ended within `timeout`.
    fn stop<K: NtAsyncKernel>(&self, k: &K, timeout: Duration) -> bool {
        self.stop.store(true, Ordering::Release);
        k.KeSetEvent(self.reap, 0, false);
        wait(k, self.done, timeout)
    }
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
        "the ISR counts interrupts in {:#x}; a reaper work item reads and resets it {}",
        words.va().0,
        if synchronize { "in KeSynchronizeExecution" } else { "with plain loads and stores" }
    ));
    let reaper = match Reaper::start(ctx, words, interrupt, synchronize) {
        Ok(r) => r,
        Err(e) => {
            hooks(ctx)?.set_isr_work(None);
            words.free(&*kernel);
            return Err(e);
        }
    };

    let mut failed = 0;
    let outcome = (|| -> anyhow::Result<()> {
        for i in 0..WRITES {
            // Armed for this write's CQ event: its message is the ISR run that races the reaper's take.
            ctx.hca.req_notify_cq(lb.cq[0], false).map_err(|e| anyhow::anyhow!("req_notify_cq: {e}"))?;
            ctx.hca
                .post_send(lb.qp[0], &pair.write(i + 1, i * LEN as u64, LEN))
                .map_err(|e| anyhow::anyhow!("post_send: {e}"))?;
            let cqe = poll_one(ctx, lb.cq[0])?;
            if cqe.status.get() != WcStatus::Success as u32 {
                failed += 1;
                ctx.say(format_args!("write {} completed with {}", i + 1, status_name(cqe.status.get())));
            }
            kernel.KeSetEvent(reaper.reap, 0, false);
        }
        // The CQ event's message may still be on its way after the last completion (the device writes the CQE,
        // then the event, then signals): the verbs thread waits, each millisecond, until the ISR counted one,
        // within the run's timeout (the rig's count: no driver state is touched meanwhile).
        let deadline = ctx.host.now() + ctx.timeout;
        while counted.load(Ordering::Relaxed) == 0 && ctx.host.now() < deadline {
            ctx.host.sleep(Duration::from_millis(1));
        }
        Ok(())
    })();
    let reaper_ended = reaper.stop(&*kernel, ctx.timeout);
    // Through KeSynchronizeExecution (the core's set_isr_work): no ISR touches the word after this, and everything
    // the ISRs wrote is ordered before the last look, in both builds.
    hooks(ctx)?.set_isr_work(None);
    let mut taken = reaper.taken.load(Ordering::Relaxed);
    if reaper_ended {
        // Ordered after the reaper's last take (its `done`), so this read is no part of the race. A reaper that
        // did not end may still touch the word: it is left allocated then.
        taken += words.get(&*kernel, MESSAGES);
        words.free(&*kernel);
    }
    let counted = counted.load(Ordering::Relaxed);
    ctx.detail("isr_interrupts_counted", counted);
    ctx.detail("reaper_interrupts_taken", taken);
    let data = pair.check(ctx, "rdma_writes", (LEN * WRITES as u32) as usize);
    ctx.detail("data", &data);
    pair.free(ctx)?;
    lb.destroy(ctx)?;
    outcome?;
    ensure!(reaper_ended, "the reaper work item did not end within {:?}", ctx.timeout);
    ensure!(failed == 0, "{failed} of {WRITES} writes failed");
    ensure!(counted >= 1, "no interrupt reached the ISR in {WRITES} armed completions");
    ensure!(
        taken == counted,
        "the reaper took {taken} of the {counted} interrupts the ISR counted: its unsynchronized reset wiped out {} \
         counted between its read and its store",
        counted.saturating_sub(taken)
    );
    ensure!(data["matches"] == serde_json::json!(true), "the RDMA writes' data did not arrive: {data}");
    Ok(())
}

/// The CQ's next completion, polled from its ring. Each look is one kernel call (the ring read), so the look comes
/// after a sleep long enough for one write: the verbs thread's scheduling points then number alike from run to
/// run, and a preemption named by its point finds it again.
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
