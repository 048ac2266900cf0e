//! use-after-unmap: the driver ends the DMA mapping of a buffer (PutScatterGatherList) while the MR over it is
//! still registered; the device's next write into that MR meets an IOVA the vIOMMU no longer maps. The vIOMMU
//! refuses it and logs a DMAR fault record in the guest kernel: that record, not the device's own event, is the
//! platform's IOMMU fault report the NT model turns into 0xE6/0x26 (as Windows does under DMA remapping).
//! The device must run with `--revalidate-stale`, so its DMA after the unmap asks the vIOMMU again instead of being
//! refused by its own stale-register check (which stays in its event log as a diagnostic).

use core::time::Duration;

use anyhow::ensure;
use vhca_driver_core::MrMapping;
use vhca_proto::status::WcStatus;
use vhca_proto::{EventKind, WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::verbs::{cqe_view, dereg, pattern, register, sge, status_name, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

const LEN: u32 = 4096;

pub fn run<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    let src = Buffer::common(ctx, LEN)?;
    src.fill(ctx, &pattern(5, LEN as usize));
    let dst = Buffer::pool(ctx, LEN)?;
    let mr_src = register(ctx, lb.pd, &src, 0, MrMapping::ScatterGather, true)?;
    let mr_dst = register(ctx, lb.pd, &dst, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE, MrMapping::ScatterGather, true)?;
    // The bug: the buffer's mapping goes (its IOVA is unmapped through VFIO) but the registration stays.
    ctx.hca.release_mr_buffer_early(mr_dst.lkey).map_err(anyhow::Error::msg)?;
    ctx.say("mapping of the registered buffer released; the MR is still registered on the device");

    let c = lb.run_on_a(ctx, &wqe(1, WrOpcode::RdmaWrite, &[sge(&mr_src, 0, LEN)], Some((&mr_dst, 0))))?;
    ctx.detail("completion", cqe_view(&c));
    ctx.say(format_args!("RDMA_WRITE into the unmapped buffer completed with {}", status_name(c.status.get())));
    // The platform's IOMMU report: with DMA checking, 0xE6/0x26 stops the machine here.
    let dmar = ctx.report_platform_iommu_faults(Duration::from_secs(2));
    let fault = ctx.wait_event(EventKind::DmaFault, Duration::from_secs(1));
    ctx.detail("dma_fault_event", fault.is_some());

    dereg(ctx, &mr_src)?;
    dereg(ctx, &mr_dst)?;
    src.free(ctx);
    dst.free(ctx);
    lb.destroy(ctx)?;
    ensure!(c.status.get() != WcStatus::Success as u32, "the write into an unmapped buffer reported success");
    ensure!(fault.is_some(), "the device reported no DMA fault");
    // Where the platform reports IOMMU faults to its own kernel only (Windows), the driver cannot check them.
    ensure!(dmar != Some(0), "the vIOMMU logged no DMAR fault for the device (is it run with --revalidate-stale?)");
    Ok(())
}
