//! shared-buffer-sg, shared-buffer-common, io-map-common-buffer: a long-lived MR the device writes (RDMA_WRITE
//! from the other QP) and the CPU reads while it stays registered, mapped three ways (seed: "sharing the buffer").

use alloc::format;

use vhca_driver_core::MrMapping;
use vhca_proto::{WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::verbs::{compare, cqe_view, dereg, expect_success, pattern, register, sge, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

const LEN: u32 = 3 * 4096;
const WRITE_AT: u64 = 100;
const WRITE_LEN: u32 = 2048;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// Non-paged pool, GetScatterGatherList held for the MR's life: double-buffered under DMA checking.
    ScatterGather,
    /// AllocateCommonBuffer: never double-buffered.
    CommonBuffer,
    /// A user buffer, probed and locked, made a common buffer by IoMapCommonBuffer (the seed's proposal).
    IoMapCommonBuffer,
}

pub fn sg<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    shared(ctx, Variant::ScatterGather)
}

pub fn common<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let v = if ctx.options.break_fix { Variant::ScatterGather } else { Variant::CommonBuffer };
    shared(ctx, v)
}

pub fn io_map_common_buffer<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let v = if ctx.options.break_fix { Variant::ScatterGather } else { Variant::IoMapCommonBuffer };
    shared(ctx, v)
}

fn shared<H: ScenarioHost>(ctx: &mut Ctx<H>, variant: Variant) -> anyhow::Result<()> {
    ctx.detail("mapping", format!("{variant:?}"));
    let lb = Loopback::new(ctx, 64, 64)?;
    let src = Buffer::common(ctx, WRITE_LEN)?;
    let data = pattern(9, WRITE_LEN as usize);
    src.fill(ctx, &data);
    let mr_src = register(ctx, lb.pd, &src, 0, MrMapping::ScatterGather, true)?;
    let (dst, mapping) = match variant {
        Variant::ScatterGather => (Buffer::pool(ctx, LEN)?, MrMapping::ScatterGather),
        Variant::CommonBuffer => (Buffer::common(ctx, LEN)?, MrMapping::ScatterGather),
        // Page-aligned: IoMapCommonBuffer ships as DMA_OPERATIONS' CreateCommonBufferFromMdl, which refuses an MDL
        // that is not a page-aligned multiple of PAGE_SIZE with STATUS_INVALID_PARAMETER (Microsoft,
        // "PCREATE_COMMON_BUFFER_FROM_MDL"); vhca.sys calls it, so an unaligned buffer fails there on Windows.
        Variant::IoMapCommonBuffer => (Buffer::user(ctx, LEN, 0)?, MrMapping::IoMapCommonBuffer),
    };
    let mr_dst = register(ctx, lb.pd, &dst, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE, mapping, true)?;

    let c = lb.run_on_a(ctx, &wqe(1, WrOpcode::RdmaWrite, &[sge(&mr_src, 0, WRITE_LEN)], Some((&mr_dst, WRITE_AT))))?;
    ctx.detail("completion", cqe_view(&c));
    expect_success(&c, 1, WrOpcode::RdmaWrite, Some(WRITE_LEN))?;
    // The long-lived registration: the CPU reads the buffer the device just wrote, with no flush in between.
    let seen = dst.read(ctx);
    let check = compare("cpu_read_while_registered", &seen[WRITE_AT as usize..][..WRITE_LEN as usize], &data);
    let fresh = check["matches"] == serde_json::json!(true);
    ctx.detail("data", &check);
    ctx.say(format_args!(
        "{variant:?}: the CPU read {} data while the MR is registered",
        if fresh { "the device's" } else { "STALE" }
    ));
    dereg(ctx, &mr_src)?;
    src.free(ctx);
    dereg(ctx, &mr_dst)?;
    dst.free(ctx);
    lb.destroy(ctx)?;
    // Everything is given back (the S/G list too, at deregistration), so no leak check can stop the run at
    // unload: what fails it is the stale read alone, which Windows' verifier cannot see (its double buffering
    // causes it).
    let dma_checking = ctx.host.dma_checking();
    anyhow::ensure!(
        fresh,
        "the CPU read stale data from the {variant:?} MR while registered (DMA checking {})",
        match dma_checking {
            Some(true) => "on: the device wrote the verifier's shadow",
            Some(false) => "off",
            None => "not known to the driver",
        }
    );
    Ok(())
}
