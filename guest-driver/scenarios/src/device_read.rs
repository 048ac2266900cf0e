//! The device reading a buffer at the address the driver programmed it with, checked where it lands: an
//! RDMA_WRITE out of an MR at that address into a common buffer, and the platform's refusal if the IOMMU refused it.
//! Shared by the scenarios whose bug is the address itself (dma32-above-4g, physical-address-to-device).

use alloc::vec;
use core::time::Duration;

use vhca_driver_core::MrMapping;
use vhca_ntapi::PVOID;
use vhca_proto::status::WcStatus;
use vhca_proto::{EventKind, WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::own_list::register_at;
use crate::verbs::{compare, cqe_view, dereg, register, sge, status_name, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

/// What the device's read came to.
pub struct DeviceRead {
    /// The completion's status name when the device could not read (the IOMMU refused it), None when it read.
    pub refused: Option<&'static str>,
    /// Whether what arrived is `expected`.
    pub matches: bool,
    /// The device's own DMA fault event, and the platform's IOMMU reports (None where the driver cannot see them).
    pub fault_event: bool,
    pub iommu_reports: Option<usize>,
}

/// PASSIVE_LEVEL. The device reads `expected.len()` bytes of the buffer at `va` through `device_address`; with DMA
/// checking a refusal's platform report stops the machine inside (0xE6/0x26).
pub fn device_reads<H: ScenarioHost>(
    ctx: &mut Ctx<H>,
    lb: &Loopback,
    va: PVOID,
    device_address: u64,
    expected: &[u8],
) -> anyhow::Result<DeviceRead> {
    let len = expected.len() as u32;
    let dst = Buffer::common(ctx, len)?;
    dst.fill(ctx, &vec![0; len as usize]);
    let mr_dst = register(ctx, lb.pd, &dst, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE, MrMapping::ScatterGather, true)?;
    let mr_src = register_at(ctx, lb.pd, va, device_address, len, 0)?;
    let c = lb.run_on_a(ctx, &wqe(1, WrOpcode::RdmaWrite, &[sge(&mr_src, 0, len)], Some((&mr_dst, 0))))?;
    ctx.detail("completion", cqe_view(&c));
    ctx.say(format_args!("the device's read at {device_address:#x} completed with {}", status_name(c.status.get())));
    let refused = (c.status.get() != WcStatus::Success as u32).then(|| status_name(c.status.get()));
    let (iommu_reports, fault) = if refused.is_some() {
        let reports = ctx.report_platform_iommu_faults(Duration::from_secs(2));
        (reports, ctx.wait_event(EventKind::DmaFault, Duration::from_secs(1)))
    } else {
        (None, None)
    };
    ctx.detail("dma_fault_event", fault.is_some());
    let check = compare("device_read", &dst.read(ctx), expected);
    ctx.detail("data", &check);
    dereg(ctx, &mr_src)?;
    dereg(ctx, &mr_dst)?;
    dst.free(ctx);
    Ok(DeviceRead {
        refused,
        matches: check["matches"] == serde_json::json!(true),
        fault_event: fault.is_some(),
        iommu_reports,
    })
}
