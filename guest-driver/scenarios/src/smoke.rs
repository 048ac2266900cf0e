//! smoke with the verifier on: the driver core on the NT model, every kind of object created and destroyed once
//! (PD, CQs, QPs and their rings, an S/G-mapped MR, one RDMA write between them), then the driver closes and
//! unloads, so the verifier's IRQL, DMA and leak checks all run on a correct driver and must stay silent.
//! (With the verifier off, smoke stays the transport's own check: one QUERY_DEVICE, no NT model.)

use vhca_driver_core::MrMapping;
use vhca_ntapi::{pool_tag, NtKernel, POOL_TYPE};
use vhca_proto::{WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::verbs::{compare, dereg, expect_success, pattern, register, sge, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

const LEN: u32 = 4096;

pub fn run<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    let src = Buffer::pool(ctx, LEN)?;
    let data = pattern(3, LEN as usize);
    src.fill(ctx, &data);
    if ctx.options.break_fix {
        shadow_copy_ignoring_failure(ctx, &data[..64]);
    }
    let dst = Buffer::common(ctx, LEN)?;
    let mr_src = register(ctx, lb.pd, &src, 0, MrMapping::ScatterGather, true)?;
    let mr_dst = register(ctx, lb.pd, &dst, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE, MrMapping::ScatterGather, true)?;
    let c = lb.run_on_a(ctx, &wqe(1, WrOpcode::RdmaWrite, &[sge(&mr_src, 0, LEN)], Some((&mr_dst, 0))))?;
    expect_success(&c, 1, WrOpcode::RdmaWrite, Some(LEN))?;
    let check = compare("rdma_write", &dst.read(ctx), &data);
    ctx.detail("data", &check);
    dereg(ctx, &mr_src)?;
    dereg(ctx, &mr_dst)?;
    src.free(ctx);
    dst.free(ctx);
    lb.destroy(ctx)?;
    anyhow::ensure!(check["matches"] == serde_json::json!(true), "the RDMA write's data did not arrive: {check}");
    ctx.say("smoke on the NT model: objects created and destroyed, verifier silent");
    Ok(())
}

/// A deliberately broken path (`vhca.break_fix=1`): a shadow copy whose pool allocation is never checked. It works
/// until the low-resources simulation fails that allocation; then the copy writes through NULL and the machine
/// stops (0x50). The low-resources e2e test runs it to prove such a path is caught and named.
fn shadow_copy_ignoring_failure<H: ScenarioHost>(ctx: &Ctx<H>, data: &[u8]) {
    const SHADOW: u32 = pool_tag(b"shdw");
    let shadow = ctx.kernel.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, data.len(), SHADOW);
    ctx.kernel.RtlCopyToVa(shadow, data);
    ctx.kernel.ExFreePoolWithTag(shadow, SHADOW);
}
