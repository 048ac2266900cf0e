//! physical-address-to-device and logical-address-to-device: which address of a pool buffer the driver programs
//! the device with.
//!
//! The bug hands the device MmGetPhysicalAddress of the buffer, the page frame behind it (the NT model's frames lie
//! at 32-64 GiB). Under DMA remapping, which vhca.inf asks for (DmaRemappingCompatible=1), the device reaches memory
//! only at the adapter's logical addresses: nothing maps the frame in the device's domain, the real intel-iommu
//! refuses the device's read there, the device's event log names the refusal and the guest reports the platform's
//! DMA fault as use-after-unmap does (0xE6/0x26 under DMA checking). Without remapping the domain is the identity
//! and the frame works, which is why such a driver passes its tests on a machine without an IOMMU. Microsoft:
//! "Enabling DMA remapping for device drivers"
//! (https://learn.microsoft.com/windows-hardware/drivers/pci/enabling-dma-remapping-for-device-drivers), and
//! MmGetPhysicalAddress's page: "do not use this routine to obtain physical addresses for DMA operations"
//! (https://learn.microsoft.com/windows-hardware/drivers/ddi/ntddk/nf-ntddk-mmgetphysicaladdress).
//! The fix hands the device the logical address GetScatterGatherList gives for the buffer.

use anyhow::ensure;
use vhca_ntapi::*;

use crate::device_read::device_reads;
use crate::own_list::OwnList;
use crate::verbs::{pattern, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

const LEN: u32 = 4096;

pub fn physical<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, false)
}

pub fn logical<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let logical = !ctx.options.break_fix;
    run(ctx, logical)
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, logical: bool) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    let src = Buffer::pool(ctx, LEN)?;
    let data = pattern(61, LEN as usize);
    src.fill(ctx, &data);
    let physical = ctx.kernel.MmGetPhysicalAddress(src.va()).0;
    ctx.detail("physical_address", physical);
    let list = OwnList::take(ctx, ctx.hca.adapter(), src.va(), LEN, true)?;
    let elements = list.elements();
    ctx.detail("elements", &elements);
    let device_address = if logical { elements[0].0 } else { physical };
    ctx.say(format_args!(
        "the device is programmed with the buffer's {} address {device_address:#x}",
        if logical { "logical" } else { "physical" }
    ));
    let read = if elements.len() == 1 { Some(device_reads(ctx, &lb, src.va(), device_address, &data)) } else { None };
    list.give_back(ctx);
    src.free(ctx);
    lb.destroy(ctx)?;
    let read = read.ok_or_else(|| anyhow::anyhow!("the one-page buffer's list has {} elements", elements.len()))??;
    if let Some(status) = read.refused {
        anyhow::bail!(
            "the device's read at the {} address {device_address:#x} was refused ({status}; device DMA fault event: \
             {}, platform IOMMU reports: {:?})",
            if logical { "logical" } else { "physical" },
            read.fault_event,
            read.iommu_reports
        );
    }
    ensure!(physical != 0, "MmGetPhysicalAddress gave 0 for a resident pool buffer");
    ensure!(read.matches, "the device read other data than the buffer's");
    Ok(())
}
