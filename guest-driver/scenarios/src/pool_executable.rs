//! pool-executable and pool-non-executable: the driver keeps its per-device context (the verbs objects it opened
//! at start, looked up on every request) in a non-paged pool block allocated once, as most WDM drivers do.
//!
//! The bug: the context is NonPagedPool, which "is executable" (NonPagedPoolExecute is its other name: the POOL_TYPE
//! page, https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/ne-wdm-_pool_type), the pre-Windows 8 default
//! that memory integrity forbids, since it never lets kernel memory be writable and executable. Driver Verifier's
//! Code integrity checks (0x2000000) stop the allocation itself: 0xC4/0x2000, P2 the address in the driver's code,
//! P3 the pool type (0), P4 the tag ("The caller specified an executable pool type. (Expected: NonPagedPoolNx)",
//! https://learn.microsoft.com/windows-hardware/drivers/devtest/code-integrity-checking). Without the check the
//! block is handed out and the driver works, as on Windows without memory integrity.
//! The fix: NonPagedPoolNx (ExAllocatePool2's POOL_FLAG_NON_PAGED, vhca.sys's form of it).

use alloc::vec::Vec;

use anyhow::ensure;
use vhca_ntapi::*;

use crate::verbs::Loopback;
use crate::{Ctx, ScenarioHost};

const TAG: u32 = u32::from_le_bytes(*b"VhCi");

pub fn executable<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, POOL_TYPE::NonPagedPool)
}

pub fn non_executable<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let pool = if ctx.options.break_fix { POOL_TYPE::NonPagedPool } else { POOL_TYPE::NonPagedPoolNx };
    run(ctx, pool)
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, pool: POOL_TYPE) -> anyhow::Result<()> {
    // The device context: PD, two CQs and two QPs, one u32 each.
    const BYTES: usize = 5 * 4;
    let context = ctx.kernel.ExAllocatePoolWithTag(pool, BYTES, TAG);
    ensure!(!context.is_null(), "ExAllocatePoolWithTag({pool:?}, {BYTES}) failed");
    ctx.say(format_args!("device context: {BYTES} bytes of {pool:?} at {:#x}", context.0));
    let lb = Loopback::new(ctx, 16, 16)?;
    let handles = [lb.pd, lb.cq[0], lb.cq[1], lb.qp[0], lb.qp[1]];
    let table: Vec<u8> = handles.iter().flat_map(|h| h.to_le_bytes()).collect();
    ctx.kernel.RtlCopyToVa(context, &table);
    // A request looks its QP up in the context.
    let mut seen = [0u8; BYTES];
    ctx.kernel.RtlCopyFromVa(&mut seen, context);
    ctx.detail("context_pool", alloc::format!("{pool:?}"));
    let kept = seen == table.as_slice();
    ctx.detail("context_kept", kept);
    lb.destroy(ctx)?;
    ctx.kernel.ExFreePoolWithTag(context, TAG);
    ensure!(kept, "the device context read back {seen:?}, not {table:?}");
    Ok(())
}
