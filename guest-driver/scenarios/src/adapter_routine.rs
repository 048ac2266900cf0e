//! late-adapter-routine and adapter-routine-awaited: a request's AdapterControl routine is queued because map
//! registers are short, and the control path gives the request up before the routine runs. The adapter is the
//! scenario's own, described for a 32-bit device (its transfers bounce through map registers in every verifier
//! mode); request A holds most of them for a transfer that a work item finishes on another processor, so request B's
//! AllocateAdapterChannel queues its routine, which the kernel calls from A's FreeMapRegisters on that processor.
//! Request contexts come from the driver's own free list (a lookaside, as drivers keep them), one block here.
//!
//! The bug: after its timeout the control path gives B up and puts B's context back on the free list, where request
//! C takes it at once; B's routine runs later and writes its map-register base into what is now C's context. The
//! race detector reports C's initialisation against the routine's write in every recording run (the work item is
//! ordered after what the control path did before queuing it, not after); with the seed's timings the routine comes
//! 250 ms after the give-up in every run, so no preemption is needed: C finds B's base in its context, a wrong result
//! in both personalities and every mode, never a bugcheck (the block is live pool: nothing faults, as on Windows).
//! Microsoft: AllocateAdapterChannel queues AdapterControl "until these resources are available"
//! (https://learn.microsoft.com/windows-hardware/drivers/kernel/writing-adaptercontrol-routines), and a
//! STATUS_SUCCESS return means the routine will be called
//! (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nc-wdm-pallocate_adapter_channel); there is no
//! call that takes a queued routine back.
//! The fix: the control path cannot cancel the routine, so it waits for the event the routine sets before the
//! context goes back to the list (the wait is the happens-before edge the bug lacks).

use alloc::boxed::Box;
use alloc::sync::Arc;
use core::sync::atomic::{AtomicU64, Ordering};
use core::time::Duration;

use anyhow::{ensure, Context as _};
use vhca_ntapi::*;

use crate::event_wait::set_within as wait;
use crate::shared_words::SharedWords;
use crate::{Ctx, ScenarioHost};

/// The adapter's largest transfer: 40 pages, so IoGetDmaAdapter grants 41 registers per request, and two requests
/// need more than the 64 the platform has.
const MAX_TRANSFER: u32 = 40 * 4096;
/// How long A's transfer holds its registers after the work item took it over.
const TRANSFER: Duration = Duration::from_millis(300);
/// How long the control path waits for B's routine before it gives B up.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(50);
/// A request context: the request it belongs to, and the map-register base its AdapterControl was given (0: none).
const OWNER: usize = 0;
const BASE: usize = 1;
const REQUEST_B: u64 = 2;
/// Request C needs no map registers: its context's base must stay 0.
const REQUEST_C: u64 = 3;

pub fn late<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, false)
}

pub fn awaited<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let wait = !ctx.options.break_fix;
    run(ctx, wait)
}

/// A 32-bit bus master: every transfer may need map registers (`address_width` in the NT model; on Windows the
/// same for buffers above 4 GiB).
fn description() -> DEVICE_DESCRIPTION {
    DEVICE_DESCRIPTION {
        Dma64BitAddresses: false,
        DmaAddressWidth: 32,
        ..DEVICE_DESCRIPTION::bus_master_64(MAX_TRANSFER)
    }
}

/// PASSIVE_LEVEL. AllocateAdapterChannel at DISPATCH_LEVEL, as it must be called.
fn allocate_channel<K: NtKernel>(
    k: &K,
    adapter: PDMA_ADAPTER,
    device: PDEVICE_OBJECT,
    n: u32,
    routine: PDRIVER_CONTROL,
) -> NTSTATUS {
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let status = k.AllocateAdapterChannel(adapter, device, n, routine);
    k.KeLowerIrql(old);
    status
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, wait_for_routine: bool) -> anyhow::Result<()> {
    let kernel = ctx.kernel.clone();
    let device = ctx.own_device;
    let mut granted = 0;
    let adapter = kernel.IoGetDmaAdapter(ctx.pdo, &description(), &mut granted);
    ensure!(!adapter.is_null(), "IoGetDmaAdapter for a 32-bit bus master failed");
    ctx.detail("map_registers_per_request", granted);
    let result = requests(ctx, adapter, granted, device, wait_for_routine);
    kernel.PutDmaAdapter(adapter);
    result
}

fn requests<H: ScenarioHost>(
    ctx: &mut Ctx<H>,
    adapter: PDMA_ADAPTER,
    granted: u32,
    device: PDEVICE_OBJECT,
    wait_for_routine: bool,
) -> anyhow::Result<()> {
    let kernel = ctx.kernel.clone();
    // Request A: its routine runs at once and keeps its registers for the transfer.
    let base_a = Arc::new(AtomicU64::new(0));
    let b = base_a.clone();
    let routine_a: PDRIVER_CONTROL = Box::new(move |_device, base: MAP_REGISTER_BASE| {
        b.store(base.0, Ordering::Release);
        IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters
    });
    let status = allocate_channel(&*kernel, adapter, device, granted, routine_a);
    let base_a = MAP_REGISTER_BASE(base_a.load(Ordering::Acquire));
    ensure!(
        status == STATUS_SUCCESS && base_a.0 != 0,
        "request A's channel: {status:?}, routine called: {}",
        base_a.0 != 0
    );

    // The driver's free list of request contexts: one block, taken by B first.
    let context = SharedWords::<2>::new(&*kernel).context("ExAllocatePoolWithTag for the request context failed")?;
    context.set(&*kernel, OWNER, REQUEST_B);
    let ran_b = kernel.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let k = kernel.clone();
    let routine_b: PDRIVER_CONTROL = Box::new(move |_device, base: MAP_REGISTER_BASE| {
        // B's routine knows only the context it was handed; whose it is by now it cannot tell.
        context.set(&*k, BASE, base.0);
        k.KeSetEvent(ran_b, 0, false);
        IO_ALLOCATION_ACTION::DeallocateObject
    });
    let status = allocate_channel(&*kernel, adapter, device, granted, routine_b);
    ensure!(status == STATUS_SUCCESS, "request B's AllocateAdapterChannel: {status:?}");
    let queued = !wait(&*kernel, ran_b, Duration::ZERO);
    ctx.detail("request_b_queued", queued);

    // A's transfer ends on another processor: the work item frees A's registers there, which runs B's routine.
    let transfer_done = kernel.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let never = kernel.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let item = kernel.IoAllocateWorkItem(device);
    ensure!(!item.is_null(), "IoAllocateWorkItem failed");
    let k = kernel.clone();
    let end_of_transfer: PIO_WORKITEM_ROUTINE = Box::new(move |_device: PDEVICE_OBJECT| {
        // The transfer's time on the bus: a wait nothing ends but its timeout, so it orders nothing.
        wait(&*k, never, TRANSFER);
        let old = k.KeRaiseIrql(DISPATCH_LEVEL);
        k.FreeMapRegisters(adapter, base_a, granted);
        k.KeLowerIrql(old);
        k.IoFreeWorkItem(item);
        k.KeSetEvent(transfer_done, 0, false);
    });
    kernel.IoQueueWorkItem(item, end_of_transfer, WORK_QUEUE_TYPE::DelayedWorkQueue);
    ctx.say(format_args!(
        "request B {} behind A's {granted} map registers; the control path waits {REQUEST_TIMEOUT:?} for its routine",
        if queued { "queued" } else { "not queued" }
    ));

    let in_time = wait(&*kernel, ran_b, REQUEST_TIMEOUT);
    ctx.detail("request_b_in_time", in_time);
    if !in_time {
        ctx.say(format_args!("request B given up after {REQUEST_TIMEOUT:?}; its AdapterControl is still queued"));
        if wait_for_routine {
            // Nothing takes a queued AdapterControl back: the context is the routine's until it ran.
            ensure!(wait(&*kernel, ran_b, ctx.timeout), "request B's routine never ran within {:?}", ctx.timeout);
        }
    }
    let base_b = context.get(&*kernel, BASE);
    // B's context goes back to the list; request C takes it and starts clean.
    context.set(&*kernel, OWNER, REQUEST_C);
    context.set(&*kernel, BASE, 0);
    let finished = wait(&*kernel, transfer_done, ctx.timeout);
    let (owner, base_c) = (context.get(&*kernel, OWNER), context.get(&*kernel, BASE));
    context.free(&*kernel);
    ctx.detail("request_c_context_base", base_c);
    ensure!(finished, "request A's transfer did not end within {:?}", ctx.timeout);
    ensure!(
        owner == REQUEST_C && base_c == 0,
        "request C's context holds a map-register base: request B's AdapterControl ran after the control path gave \
         B up and wrote into the context request C took over (the base is the detail request_c_context_base)"
    );
    ensure!(base_b != 0 || !wait_for_routine, "request B's routine never wrote its map-register base");
    Ok(())
}
