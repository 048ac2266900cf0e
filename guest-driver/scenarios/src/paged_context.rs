//! dpc-reads-paged-context and dpc-reads-nonpaged-context: a CQ consumer keeps its context (the requests it has in
//! flight) in pool, and its completion callback reads it for each completion, at DISPATCH_LEVEL in the DPC.
//!
//! The bug: the context is PagedPool. Pageable memory must not be touched at DISPATCH_LEVEL or above (a page fault
//! there cannot be served); IRQL checking makes that deterministic by trimming pageable memory whenever IRQL is
//! raised (https://learn.microsoft.com/windows-hardware/drivers/devtest/force-irql-checking), so the first read in
//! the DPC is 0xD1 DRIVER_IRQL_NOT_LESS_OR_EQUAL (P1 the address, P2 the IRQL, P3 0 read, P4 the referencing
//! address: https://learn.microsoft.com/windows-hardware/drivers/debugger/bug-check-0xd1--driver-irql-not-less-or-equal).
//! Without the verifier the page is resident and it works, as on Windows until memory pressure pages it out.
//! The fix: NonPagedPoolNx.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering};

use anyhow::ensure;
use vhca_ntapi::*;
use vhca_proto::status::WcStatus;
use vhca_proto::Cqe;

use crate::dpc_consumer::{watch_with, Done, WritePair};
use crate::verbs::Loopback;
use crate::{Ctx, ScenarioHost};

const WRITES: u64 = 4;
const LEN: u32 = 1024;
const TAG: u32 = u32::from_le_bytes(*b"VhCx");

pub fn paged<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, POOL_TYPE::PagedPool)
}

pub fn nonpaged<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let pool = if ctx.options.break_fix { POOL_TYPE::PagedPool } else { POOL_TYPE::NonPagedPoolNx };
    run(ctx, pool)
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, pool: POOL_TYPE) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    let pair = WritePair::new(ctx, lb.pd, LEN * WRITES as u32, 33)?;
    // The consumer's context: the wr_id of each request in flight, one u64 per slot.
    let bytes = (WRITES as usize) * 8;
    let context = ctx.kernel.ExAllocatePoolWithTag(pool, bytes, TAG);
    ensure!(!context.is_null(), "ExAllocatePoolWithTag({pool:?}, {bytes}) failed");
    let table: Vec<u8> = (1..=WRITES).flat_map(u64::to_le_bytes).collect();
    ctx.kernel.RtlCopyToVa(context, &table);
    ctx.say(format_args!("consumer context: {bytes} bytes of {pool:?} at {:#x}", context.0));

    let kernel = ctx.kernel.clone();
    let done = Done::new(kernel.clone(), WRITES);
    let (matched, d) = (Arc::new(AtomicU64::new(0)), done.clone());
    let m = matched.clone();
    let callback = Arc::new(move |_cq: u32, cqe: &Cqe| {
        // The consumer looks the completion up in its context: a CPU read at DISPATCH_LEVEL.
        let slot = cqe.wr_id.get().wrapping_sub(1);
        if let Some(at) = context.offset(slot.saturating_mul(8)).filter(|_| slot < WRITES) {
            let mut wr_id = [0u8; 8];
            kernel.RtlCopyFromVa(&mut wr_id, at);
            if u64::from_le_bytes(wr_id) == cqe.wr_id.get() && cqe.status.get() == WcStatus::Success as u32 {
                m.fetch_add(1, Ordering::Relaxed);
            }
        }
        d.one();
    });
    watch_with(ctx, lb.cq[0], callback)?;
    let writes: Vec<_> = (0..WRITES).map(|i| pair.write(i + 1, i * LEN as u64, LEN)).collect();
    ctx.hca.post_send_many(lb.qp[0], &writes).map_err(|e| anyhow::anyhow!("post_send_many: {e}"))?;
    let all = done.wait(ctx.timeout);
    let matched = matched.load(Ordering::Relaxed);
    ctx.detail("context_pool", alloc::format!("{pool:?}"));
    ctx.detail("completions_matched", matched);
    let data = pair.check(ctx, "rdma_writes", (LEN * WRITES as u32) as usize);
    ctx.detail("data", &data);
    pair.free(ctx)?;
    lb.destroy(ctx)?;
    // After the CQ is gone no callback reads the context any more.
    ctx.kernel.ExFreePoolWithTag(context, TAG);
    ensure!(all, "the consumer saw {} of {WRITES} completions within {:?}", WRITES - done.left(), ctx.timeout);
    ensure!(matched == WRITES, "{matched} of {WRITES} completions matched the consumer's context");
    ensure!(data["matches"] == serde_json::json!(true), "the RDMA writes' data did not arrive: {data}");
    Ok(())
}
