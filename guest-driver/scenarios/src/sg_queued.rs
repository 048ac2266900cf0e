//! sg-queued-freed-mdl and sg-queued-mdl-kept: a GetScatterGatherList that waits for map registers, and the MDL it
//! describes its transfer by. The adapter is the scenario's own, a 32-bit device (its buffers above 4 GiB bounce
//! through map registers in every mode); request A holds most of the registers, so request B's list is queued
//! until A gives them back.
//!
//! The bug: the control path frees B's MDL while B's list is still queued (as a driver that treats the call's
//! return as the end of the request does), then A's registers come back and B's AdapterListControl is built from
//! an MDL nothing holds. Under DMA checking that is 0xE6/0x0E, P2 the MDL, raised where A's FreeMapRegisters gives
//! the registers back (the model's assumption: Microsoft's E6 page names no code for a freed MDL, and 0x0E, "The
//! driver tried a DMA transfer without locking the buffer", is the documented one for a buffer nothing keeps
//! locked; https://learn.microsoft.com/windows-hardware/drivers/debugger/bug-check-0xe6--driver-verifier-dma-violation).
//! Unchecked, Windows' HAL would read the freed MDL, whose memory still holds the page frames until it is reused:
//! the model builds the list from the MDL as the call saw it and the routine runs, so the bug passes unseen.
//! The fix keeps the MDL until the routine ran and the list went back: GetScatterGatherList's page says the list
//! stays the driver's until PutScatterGatherList, and STATUS_SUCCESS means the routine will be called
//! (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nc-wdm-pget_scatter_gather_list).

use alloc::boxed::Box;
use alloc::sync::Arc;
use core::sync::atomic::{AtomicU64, Ordering};

use anyhow::ensure;
use once_cell::race::OnceBox;
use vhca_ntapi::*;

use crate::event_wait::set_within as wait;
use crate::verbs::{pattern, Buffer};
use crate::{Ctx, ScenarioHost};

/// 40 pages: IoGetDmaAdapter grants 41 registers per request, so A's and B's together need more than the 64 the
/// platform has.
const MAX_TRANSFER: u32 = 40 * 4096;
/// B's buffer: 32 pages, more than the 23 registers A leaves.
const B_LEN: u32 = 32 * 4096;

pub fn freed_mdl<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, false)
}

pub fn mdl_kept<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let keep = !ctx.options.break_fix;
    run(ctx, keep)
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, keep_mdl: bool) -> anyhow::Result<()> {
    let kernel = ctx.kernel.clone();
    let description = DEVICE_DESCRIPTION {
        Dma64BitAddresses: false,
        DmaAddressWidth: 32,
        ..DEVICE_DESCRIPTION::bus_master_64(MAX_TRANSFER)
    };
    let mut granted = 0;
    let adapter = kernel.IoGetDmaAdapter(ctx.pdo, &description, &mut granted);
    ensure!(!adapter.is_null(), "IoGetDmaAdapter for a 32-bit bus master failed");
    ctx.detail("map_registers_per_request", granted);
    let buffer = Buffer::pool(ctx, B_LEN)?;
    buffer.fill(ctx, &pattern(26, B_LEN as usize));
    let result = requests(ctx, adapter, granted, buffer.va(), keep_mdl);
    buffer.free(ctx);
    kernel.PutDmaAdapter(adapter);
    result
}

fn requests<H: ScenarioHost>(
    ctx: &mut Ctx<H>,
    adapter: PDMA_ADAPTER,
    granted: u32,
    va: PVOID,
    keep_mdl: bool,
) -> anyhow::Result<()> {
    let kernel = ctx.kernel.clone();
    let k = &*kernel;
    let device = ctx.own_device;
    // Request A: its registers stay held until the control path frees them.
    let base_a = Arc::new(AtomicU64::new(0));
    let b = base_a.clone();
    let routine_a: PDRIVER_CONTROL = Box::new(move |_device, base: MAP_REGISTER_BASE| {
        b.store(base.0, Ordering::Release);
        IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters
    });
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let status = k.AllocateAdapterChannel(adapter, device, granted, routine_a);
    k.KeLowerIrql(old);
    let base_a = MAP_REGISTER_BASE(base_a.load(Ordering::Acquire));
    ensure!(status == STATUS_SUCCESS && base_a.0 != 0, "request A's channel: {status:?}");

    // Request B: its list waits for A's registers.
    let mdl = k.IoAllocateMdl(va, B_LEN, false, false);
    ensure!(!mdl.is_null(), "IoAllocateMdl({B_LEN}) failed");
    k.MmBuildMdlForNonPagedPool(mdl);
    let list_b: Arc<OnceBox<SCATTER_GATHER_LIST>> = Arc::new(OnceBox::new());
    let ran_b = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let (slot, k2) = (list_b.clone(), kernel.clone());
    let routine_b: PDRIVER_LIST_CONTROL = Box::new(move |_device, list: &SCATTER_GATHER_LIST| {
        let _ = slot.set(Box::new(list.clone()));
        k2.KeSetEvent(ran_b, 0, false);
    });
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let status = k.GetScatterGatherList(adapter, device, mdl, va, B_LEN, routine_b, true);
    k.KeLowerIrql(old);
    ensure!(status == STATUS_SUCCESS, "request B's GetScatterGatherList: {status:?}");
    let queued = list_b.get().is_none();
    ctx.detail("request_b_queued", queued);
    ctx.say(format_args!(
        "request B's list {} behind A's {granted} map registers",
        if queued { "queued" } else { "not queued" }
    ));
    if !keep_mdl {
        // The bug: the request is taken for done when the call returned.
        k.IoFreeMdl(mdl);
        ctx.say("request B's MDL freed while its list is queued");
    }
    // A's transfer ends: its registers go back, and B's routine runs from the free (with DMA checking the machine
    // stops here after the bug).
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    k.FreeMapRegisters(adapter, base_a, granted);
    k.KeLowerIrql(old);
    let ran = wait(k, ran_b, ctx.timeout);
    ctx.detail("request_b_routine_ran", ran);
    if let Some(list) = list_b.get() {
        ctx.detail("request_b_elements", list.Elements.len());
        let old = k.KeRaiseIrql(DISPATCH_LEVEL);
        k.PutScatterGatherList(adapter, list.Handle, true);
        k.KeLowerIrql(old);
    }
    if keep_mdl {
        k.IoFreeMdl(mdl);
    }
    ensure!(queued, "request B's list was not queued: A's registers left enough for it");
    ensure!(ran, "request B's AdapterListControl never ran within {:?}", ctx.timeout);
    Ok(())
}
