//! dma32-above-4g and dma32-above-4g-fixed: a device that drives 32 address lines, with its buffer in pages above
//! 4 GiB (the NT model's frames lie at 32-64 GiB, as on a machine with that much RAM).
//!
//! The fix describes the device as it is (Dma64BitAddresses false, DmaAddressWidth 32): the list's element is a
//! bounce page below 4 GiB (the HAL's map registers; with DMA remapping, an IOVA the platform places below the
//! device's limit), the data is copied there when the list is built, and the device reads it from there: checked
//! at the device by an RDMA_WRITE out of that MR into a common buffer. Microsoft: "DMA devices that support only
//! 32-bit addressing" use map registers for buffers above 4 GiB
//! (https://learn.microsoft.com/windows-hardware/drivers/kernel/using-map-registers and DEVICE_DESCRIPTION's
//! DmaAddressWidth, https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/ns-wdm-_device_description).
//! The bug describes a 64-bit device: the element is the buffer's own high logical address, which the 32-bit
//! device's address register cannot hold; it keeps the low 32 bits (the scenario hands it what such a register
//! keeps), an IOVA the domain never mapped, and the platform's IOMMU refuses the read: the device's event log names
//! the refusal and the guest reports the platform's DMA fault as use-after-unmap does.

use anyhow::ensure;
use vhca_ntapi::*;

use crate::device_read::device_reads;
use crate::own_list::OwnList;
use crate::verbs::{pattern, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

const LEN: u32 = 4096;
const FOUR_GIB: u64 = 1 << 32;

pub fn ignores_width<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, false)
}

pub fn honours_width<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let honour = !ctx.options.break_fix;
    run(ctx, honour)
}

fn description(honour_width: bool) -> DEVICE_DESCRIPTION {
    if honour_width {
        DEVICE_DESCRIPTION { Dma64BitAddresses: false, DmaAddressWidth: 32, ..DEVICE_DESCRIPTION::bus_master_64(LEN) }
    } else {
        DEVICE_DESCRIPTION::bus_master_64(LEN)
    }
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, honour_width: bool) -> anyhow::Result<()> {
    let kernel = ctx.kernel.clone();
    let mut granted = 0;
    let adapter = kernel.IoGetDmaAdapter(ctx.pdo, &description(honour_width), &mut granted);
    ensure!(!adapter.is_null(), "IoGetDmaAdapter for the 32-bit device failed");
    ctx.detail("described_width", if honour_width { 32 } else { 64 });
    let result = transfer(ctx, adapter);
    kernel.PutDmaAdapter(adapter);
    result
}

fn transfer<H: ScenarioHost>(ctx: &mut Ctx<H>, adapter: PDMA_ADAPTER) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    let src = Buffer::pool(ctx, LEN)?;
    let data = pattern(32, LEN as usize);
    src.fill(ctx, &data);
    let list = OwnList::take(ctx, adapter, src.va(), LEN, true)?;
    let elements = list.elements();
    ctx.detail("elements", &elements);
    let &[(logical, len)] = elements.as_slice() else {
        list.give_back(ctx);
        anyhow::bail!("the one-page buffer's list has {} elements", elements.len());
    };
    // What a 32-bit address register holds of the address it is given.
    let device_address = logical & (FOUR_GIB - 1);
    ctx.detail("device_address", device_address);
    ctx.say(format_args!("element {logical:#x}+{len}; the 32-bit device is programmed with {device_address:#x}"));
    let read = device_reads(ctx, &lb, src.va(), device_address, &data);
    list.give_back(ctx);
    src.free(ctx);
    lb.destroy(ctx)?;
    let read = read?;
    if let Some(status) = read.refused {
        anyhow::bail!(
            "the device's read at {device_address:#x} (the low 32 bits of the logical address {logical:#x}) was \
             refused ({status}; device DMA fault event: {}, platform IOMMU reports: {:?})",
            read.fault_event,
            read.iommu_reports
        );
    }
    ensure!(logical + len as u64 <= FOUR_GIB, "the 32-bit device's element {logical:#x}+{len} ends above 4 GiB");
    ensure!(read.matches, "the device read other data than the buffer's");
    Ok(())
}
