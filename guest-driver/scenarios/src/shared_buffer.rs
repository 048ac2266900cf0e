//! shared-buffer-sg, shared-buffer-common, io-map-common-buffer: a long-lived MR the device writes (RDMA_WRITE
//! from the other QP) and the CPU reads while it stays registered, mapped three ways (seed: "sharing the buffer").
//!
//! io-map-common-buffer-unchecked: io-map-common-buffer without its fallback. IoMapCommonBuffer ships as
//! CreateCommonBufferFromMdl, whose page says "If DMA remapping is not being used, the MDL must represent physically
//! contiguous memory" (STATUS_INVALID_PARAMETER otherwise; Microsoft, "PCREATE_COMMON_BUFFER_FROM_MDL"). Under
//! remapping any locked user buffer gets one logical range, so a driver tested only there never meets the refusal;
//! on a machine without remapping a user buffer whose pages are not physically contiguous is refused, and the bug
//! fails the registration. The fix (io-map-common-buffer) falls back to a scatter/gather list over the same pages,
//! Windows' way for any buffer: the device gets one element per physical run, and the CPU reads what it wrote only
//! once the list is put back (at DEREG_MR; DMA checking double-buffers a list, "PutScatterGatherList" copies it
//! back), not while the MR stays registered. A common buffer of the driver's own is no fallback there: memory so
//! fragmented has no contiguous run of the MR's size either.

use alloc::format;

use vhca_driver_core::{DriverError, MrMapping, RegisteredMr};
use vhca_ntapi::STATUS_INVALID_PARAMETER;
use vhca_proto::{WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::verbs::{compare, cqe_view, dereg, expect_success, pattern, register, sge, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

const LEN: u32 = 3 * 4096;
/// The user buffer IoMapCommonBuffer maps: eight pages, so the seed's fragmentation knob (runs of four pages, which
/// vhca.sys's own three-page channel buffers still find) splits it into two runs.
const USER_LEN: u32 = 8 * 4096;
const WRITE_AT: u64 = 100;
const WRITE_LEN: u32 = 2048;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// Non-paged pool, GetScatterGatherList held for the MR's life: double-buffered under DMA checking.
    ScatterGather,
    /// AllocateCommonBuffer: never double-buffered.
    CommonBuffer,
    /// A user buffer, probed and locked, made a common buffer by IoMapCommonBuffer (the seed's proposal); a
    /// buffer it refuses (physically fragmented, no DMA remapping) is registered through a scatter/gather list.
    IoMapCommonBuffer,
    /// The same, a refusal ending the registration: the bug.
    IoMapCommonBufferUnchecked,
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

pub fn io_map_common_buffer_unchecked<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    shared(ctx, Variant::IoMapCommonBufferUnchecked)
}

/// How the MR's buffer is shared with the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sharing {
    /// Device and CPU see the same bytes while the MR is registered.
    WhileRegistered,
    /// A scatter/gather list: the CPU sees the device's writes once the list is put back.
    AtDeregistration,
}

/// The user buffer registered through IoMapCommonBuffer. `fallback`: a buffer the routine refuses as incompatible
/// (STATUS_INVALID_PARAMETER) is registered through a scatter/gather list instead.
fn io_mapped<H: ScenarioHost>(
    ctx: &mut Ctx<H>,
    pd: u32,
    access: u32,
    fallback: bool,
) -> anyhow::Result<(Buffer, RegisteredMr, Sharing)> {
    let user = Buffer::user(ctx, USER_LEN, 0)?;
    match ctx.hca.reg_mr(pd, user.source(true), access, MrMapping::IoMapCommonBuffer) {
        Ok(mr) => {
            ctx.detail("io_map_common_buffer", "mapped");
            Ok((user, mr, Sharing::WhileRegistered))
        }
        Err(DriverError::Kernel { routine: "IoMapCommonBuffer", status })
            if fallback && status == STATUS_INVALID_PARAMETER =>
        {
            ctx.detail("io_map_common_buffer", "refused: a scatter/gather list instead");
            ctx.say(format_args!(
                "IoMapCommonBuffer refused the user buffer (STATUS_INVALID_PARAMETER: not physically contiguous \
                 without DMA remapping); registered through a scatter/gather list instead"
            ));
            let mr = register(ctx, pd, &user, access, MrMapping::ScatterGather, true)?;
            Ok((user, mr, Sharing::AtDeregistration))
        }
        Err(e) => {
            user.free(ctx);
            Err(anyhow::anyhow!("reg_mr: {e}"))
        }
    }
}

fn shared<H: ScenarioHost>(ctx: &mut Ctx<H>, variant: Variant) -> anyhow::Result<()> {
    ctx.detail("mapping", format!("{variant:?}"));
    let lb = Loopback::new(ctx, 64, 64)?;
    let src = Buffer::common(ctx, WRITE_LEN)?;
    let data = pattern(9, WRITE_LEN as usize);
    src.fill(ctx, &data);
    let mr_src = register(ctx, lb.pd, &src, 0, MrMapping::ScatterGather, true)?;
    let access = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE;
    let (dst, mr_dst, sharing) = match variant {
        Variant::ScatterGather | Variant::CommonBuffer => {
            let dst = match variant {
                Variant::ScatterGather => Buffer::pool(ctx, LEN)?,
                _ => Buffer::common(ctx, LEN)?,
            };
            let mr = register(ctx, lb.pd, &dst, access, MrMapping::ScatterGather, true)?;
            (dst, mr, Sharing::WhileRegistered)
        }
        // Page-aligned (Buffer::user at offset 0): IoMapCommonBuffer ships as DMA_OPERATIONS'
        // CreateCommonBufferFromMdl, which refuses an MDL that is not a page-aligned multiple of PAGE_SIZE with
        // STATUS_INVALID_PARAMETER (Microsoft, "PCREATE_COMMON_BUFFER_FROM_MDL"); vhca.sys calls it, so an unaligned
        // buffer fails there on Windows.
        Variant::IoMapCommonBuffer => io_mapped(ctx, lb.pd, access, true)?,
        // The bug reports the refusal as its REG_MR's failure, after giving back what it holds (a leak would be
        // a second bug, and under DMA checking vhca.sys's adapter would then go with common buffers out, 0xE6/0x7).
        Variant::IoMapCommonBufferUnchecked => match io_mapped(ctx, lb.pd, access, false) {
            Ok(mapped) => mapped,
            Err(e) => {
                dereg(ctx, &mr_src)?;
                src.free(ctx);
                lb.destroy(ctx)?;
                return Err(e);
            }
        },
    };

    let c = lb.run_on_a(ctx, &wqe(1, WrOpcode::RdmaWrite, &[sge(&mr_src, 0, WRITE_LEN)], Some((&mr_dst, WRITE_AT))))?;
    ctx.detail("completion", cqe_view(&c));
    expect_success(&c, 1, WrOpcode::RdmaWrite, Some(WRITE_LEN))?;
    if sharing == Sharing::AtDeregistration {
        dereg(ctx, &mr_src)?;
        src.free(ctx);
        dereg(ctx, &mr_dst)?;
        let seen = dst.read(ctx);
        let check = compare("cpu_read_after_deregistration", &seen[WRITE_AT as usize..][..WRITE_LEN as usize], &data);
        ctx.detail("data", &check);
        dst.free(ctx);
        lb.destroy(ctx)?;
        anyhow::ensure!(
            check["matches"] == serde_json::json!(true),
            "the device's write was not in the user buffer at DEREG_MR"
        );
        return Ok(());
    }
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
