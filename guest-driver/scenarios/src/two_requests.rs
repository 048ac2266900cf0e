//! two-requests-race and two-requests-locked: two resize requests for the same CQ run at once, the passive path's
//! and a second one beside it (a work item on the driver's own device object, which the NT model runs on a worker
//! thread of another processor), and each records its resize in the CQ's entry of the driver's CQ table (entries
//! and a generation number, read then written back, as `entry->entries *= 2; entry->generation++` is in C).
//!
//! The second request starts, polls its device for 5 ms (busy with the resize), then records it; the passive path
//! records its own once the second has started, so in a plain run its update lands inside those 5 ms and nothing
//! is lost. The bug: no lock around the entry. The race detector reports the two requests' accesses in every
//! recording run (the work item is ordered after what the passive path did before queuing it, and before what it
//! does after its event, but not against the passive path's own update); a preemption of the passive path between
//! its loads and its stores lets the second's whole update fall between them, and the late stores wipe it out: a
//! wrong result (generation 1 after two resizes), never a bugcheck. Work items run in a system worker thread at
//! PASSIVE_LEVEL, beside whatever queued them
//! (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-ioqueueworkitem).
//! The fix: both requests update the entry under one FAST_MUTEX, the driver's control-path lock (PASSIVE_LEVEL
//! callers, held at APC_LEVEL:
//! https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-exacquirefastmutex).

use alloc::boxed::Box;
use anyhow::{ensure, Context as _};
use core::time::Duration;
use vhca_ntapi::*;

use crate::event_wait::set_within as wait;
use crate::shared_words::SharedWords;
use crate::{Ctx, ScenarioHost};

/// The CQ's size in the table before the two resizes.
const CQ_ENTRIES: u64 = 64;
const ENTRIES: usize = 0;
const GENERATION: usize = 1;

pub fn race<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, false)
}

pub fn locked<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let lock = !ctx.options.break_fix;
    run(ctx, lock)
}

/// How long the second request's device is busy before it takes the resize, and how often it is polled: the
/// first request's update falls inside it in a plain run.
const DEVICE_BUSY: Duration = Duration::from_millis(5);
const POLL: Duration = Duration::from_micros(50);

/// The lock both requests take, or none (the bug).
#[derive(Clone, Copy)]
struct EntryLock(Option<PFAST_MUTEX>);

/// One resize request's bookkeeping: the CQ's entry doubled and its generation advanced. PASSIVE_LEVEL.
fn record_resize<K: NtKernel + ?Sized>(k: &K, entry: SharedWords<2>, lock: EntryLock) {
    if let Some(m) = lock.0 {
        k.ExAcquireFastMutex(m);
    }
    let (entries, generation) = (entry.get(k, ENTRIES), entry.get(k, GENERATION));
    entry.set(k, ENTRIES, entries * 2);
    entry.set(k, GENERATION, generation + 1);
    if let Some(m) = lock.0 {
        k.ExReleaseFastMutex(m);
    }
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, locked: bool) -> anyhow::Result<()> {
    let kernel = ctx.kernel.clone();
    let entry = SharedWords::<2>::new(&*kernel).context("ExAllocatePoolWithTag for the CQ table entry failed")?;
    entry.set(&*kernel, ENTRIES, CQ_ENTRIES);
    let lock = EntryLock(locked.then(|| kernel.ExInitializeFastMutex()));
    let done = kernel.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let item = kernel.IoAllocateWorkItem(ctx.own_device);
    ensure!(!item.is_null(), "IoAllocateWorkItem failed");
    ctx.say(format_args!(
        "two resize requests for one CQ update its table entry at {:#x} {}",
        entry.va().0,
        if locked { "under a FAST_MUTEX" } else { "with no lock" }
    ));

    // The second request, beside this one: it starts, waits for the device to take its resize (a status register
    // polled for DEVICE_BUSY), then records it.
    let started = kernel.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let k = kernel.clone();
    let second: PIO_WORKITEM_ROUTINE = Box::new(move |_device: PDEVICE_OBJECT| {
        k.KeSetEvent(started, 0, false);
        for _ in 0..DEVICE_BUSY.as_micros() / POLL.as_micros() {
            k.KeStallExecutionProcessor(POLL.as_micros() as u32);
        }
        record_resize(&*k, entry, lock);
        // The routine runs after its item was dequeued, so it may free it; the event is what the first waits on.
        k.IoFreeWorkItem(item);
        k.KeSetEvent(done, 0, false);
    });
    kernel.IoQueueWorkItem(item, second, WORK_QUEUE_TYPE::DelayedWorkQueue);
    // The first request, the passive path's own, once the second is under way: the two overlap. Its update comes
    // long before the second's in a plain run; held between its loads and its stores for longer than DEVICE_BUSY,
    // it loses the second's.
    ensure!(wait(&*kernel, started, ctx.timeout), "the second request did not start within {:?}", ctx.timeout);
    record_resize(&*kernel, entry, lock);

    ensure!(wait(&*kernel, done, ctx.timeout), "the second request did not finish within {:?}", ctx.timeout);
    // Ordered after both requests (the second's event), so this read is no part of the race.
    let (entries, generation) = (entry.get(&*kernel, ENTRIES), entry.get(&*kernel, GENERATION));
    entry.free(&*kernel);
    ctx.detail("cq_table_entries", entries);
    ctx.detail("cq_table_generation", generation);
    ensure!(
        generation == 2 && entries == CQ_ENTRIES * 4,
        "after two resizes of a {CQ_ENTRIES}-entry CQ its table entry says {entries} entries, generation \
         {generation}: one request's update was lost to the other's"
    );
    Ok(())
}
