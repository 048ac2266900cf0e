//! dpc-grows-cq and work-item-grows-cq: a CQ consumer whose completions run high grows its CQ, a new ring twice
//! the size from AllocateCommonBuffer (the first step of a resize; the device keeps the old ring here).
//!
//! The bug: the consumer does it in its completion callback, at DISPATCH_LEVEL in the DPC. AllocateCommonBuffer is
//! PASSIVE_LEVEL only (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nc-wdm-pallocate_common_buffer),
//! and DMA checking wraps the adapter's DMA_OPERATIONS: 0xE6/0x13 (P2 1: not the IRQL required, P3 0 PASSIVE_LEVEL,
//! P4 2 DISPATCH_LEVEL), as fast-mutex-create-cq's is at APC_LEVEL. Without the verifier it works, as it does on
//! Windows, where nothing checks the IRQL of a routine reached through the adapter's table.
//! The fix: the callback queues a work item (IoAllocateWorkItem, IoQueueWorkItem on the DelayedWorkQueue, both
//! DISPATCH-safe: https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-ioqueueworkitem), whose
//! routine grows the CQ at PASSIVE_LEVEL in a system worker thread and frees its item.

use alloc::sync::Arc;
use core::sync::atomic::{AtomicU64, Ordering};

use anyhow::ensure;
use vhca_ntapi::*;
use vhca_proto::status::WcStatus;
use vhca_proto::{Cqe, CQE_SIZE};

use crate::dpc_consumer::{watch_with, Done, WritePair};
use crate::verbs::Loopback;
use crate::{Ctx, ScenarioHost};

const CQ_ENTRIES: u32 = 16;
/// The consumer grows its CQ when this many of its requests completed: three quarters of the ring.
const GROW_AT: u64 = 12;
const LEN: u32 = 512;

pub fn in_dpc<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, Grow::InDpc)
}

pub fn by_work_item<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let grow = if ctx.options.break_fix { Grow::InDpc } else { Grow::ByWorkItem };
    run(ctx, grow)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grow {
    InDpc,
    ByWorkItem,
}

/// The grown ring, once there: its CPU and device addresses (0: not yet).
#[derive(Default)]
struct GrownRing {
    va: AtomicU64,
    logical: AtomicU64,
    /// The IRQL AllocateCommonBuffer was called at.
    irql: AtomicU64,
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, grow: Grow) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, CQ_ENTRIES, CQ_ENTRIES)?;
    let pair = WritePair::new(ctx, lb.pd, LEN * GROW_AT as u32, 21)?;
    let kernel = ctx.kernel.clone();
    let adapter = ctx.hca.adapter();
    let own_device = ctx.own_device;
    let grown = Arc::new(GrownRing::default());
    let failed = Arc::new(AtomicU64::new(0));
    // Every completion, then the growth.
    let done = Done::new(kernel.clone(), GROW_AT + 1);
    let seen = Arc::new(AtomicU64::new(0));
    let (g, f, d, k) = (grown.clone(), failed.clone(), done.clone(), kernel.clone());
    let callback = Arc::new(move |_cq: u32, cqe: &Cqe| {
        if cqe.status.get() != WcStatus::Success as u32 {
            f.fetch_add(1, Ordering::Relaxed);
        }
        d.one();
        if seen.fetch_add(1, Ordering::AcqRel) + 1 != GROW_AT {
            return;
        }
        match grow {
            // The bug: a PASSIVE_LEVEL-only DMA routine at DISPATCH_LEVEL, here in the DPC.
            Grow::InDpc => {
                grow_ring(&*k, adapter, &g);
                d.one();
            }
            Grow::ByWorkItem => {
                let item = k.IoAllocateWorkItem(own_device);
                if item.is_null() {
                    f.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let (k2, g2, d2) = (k.clone(), g.clone(), d.clone());
                let routine = alloc::boxed::Box::new(move |_device: PDEVICE_OBJECT| {
                    grow_ring(&*k2, adapter, &g2);
                    // The routine runs after its item was dequeued, so it may free it.
                    k2.IoFreeWorkItem(item);
                    d2.one();
                });
                k.IoQueueWorkItem(item, routine, WORK_QUEUE_TYPE::DelayedWorkQueue);
            }
        }
    });
    watch_with(ctx, lb.cq[0], callback)?;
    ctx.say(format_args!(
        "consumer watching CQ {} ({CQ_ENTRIES} entries); it grows the CQ at {GROW_AT} completions {}",
        lb.cq[0],
        match grow {
            Grow::InDpc => "in its completion callback (DISPATCH_LEVEL)",
            Grow::ByWorkItem => "from a work item (PASSIVE_LEVEL)",
        }
    ));
    let writes: alloc::vec::Vec<_> = (0..GROW_AT).map(|i| pair.write(i + 1, i * LEN as u64, LEN)).collect();
    ctx.hca.post_send_many(lb.qp[0], &writes).map_err(|e| anyhow::anyhow!("post_send_many: {e}"))?;
    let all = done.wait(ctx.timeout);
    let irql = grown.irql.load(Ordering::Acquire);
    ctx.detail("cq_grown_at_irql", irql);
    ctx.detail("completions_failed", failed.load(Ordering::Relaxed));
    let data = pair.check(ctx, "rdma_writes", (LEN * GROW_AT as u32) as usize);
    ctx.detail("data", &data);
    let va = PVOID(grown.va.load(Ordering::Acquire));
    let ring_bytes = 2 * CQ_ENTRIES * CQE_SIZE as u32;
    if !va.is_null() {
        // The resize's other steps are the device's; the new ring goes back at PASSIVE_LEVEL, before the CQ.
        let logical = PHYSICAL_ADDRESS(grown.logical.load(Ordering::Acquire));
        ctx.kernel.FreeCommonBuffer(ctx.hca.adapter(), ring_bytes, logical, va, true);
    }
    pair.free(ctx)?;
    lb.destroy(ctx)?;
    ensure!(
        all,
        "the consumer saw {} of {} completions and growths within {:?}",
        GROW_AT + 1 - done.left(),
        GROW_AT + 1,
        ctx.timeout
    );
    ensure!(failed.load(Ordering::Relaxed) == 0, "{} completions failed", failed.load(Ordering::Relaxed));
    ensure!(!va.is_null(), "AllocateCommonBuffer gave no ring for the grown CQ");
    ensure!(data["matches"] == serde_json::json!(true), "the RDMA writes' data did not arrive: {data}");
    ctx.say(format_args!("CQ grown to {} entries, its ring allocated at IRQL {irql}", 2 * CQ_ENTRIES));
    Ok(())
}

/// AllocateCommonBuffer for a ring twice the CQ's size, at whatever IRQL the caller is.
fn grow_ring<K: NtAsyncKernel>(kernel: &K, adapter: PDMA_ADAPTER, grown: &GrownRing) {
    grown.irql.store(kernel.KeGetCurrentIrql() as u64, Ordering::Release);
    let mut logical = PHYSICAL_ADDRESS(0);
    let va = kernel.AllocateCommonBuffer(adapter, 2 * CQ_ENTRIES * CQE_SIZE as u32, &mut logical, true);
    grown.logical.store(logical.0, Ordering::Release);
    grown.va.store(va.0, Ordering::Release);
}
