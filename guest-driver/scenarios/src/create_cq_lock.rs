//! fast-mutex-create-cq and fixed-lock-create-cq: the seed's control path holds the driver's cl_mutex around
//! create_cq. As a FAST_MUTEX that runs AllocateCommonBuffer at APC_LEVEL; as a KMUTEX at PASSIVE_LEVEL.

use vhca_driver_core::{ClMutex, ClMutexKind};
use vhca_ntapi::NtKernel;
use vhca_proto::WrOpcode;

use crate::verbs::{cqe_view, expect_success, pattern, register, sge, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

pub fn fast_mutex<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let kind = ctx.lock_kind(ClMutexKind::FastMutex);
    create_under(ctx, kind)
}

pub fn fixed_lock<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let kind = ctx.lock_kind(ClMutexKind::KMutex);
    create_under(ctx, kind)
}

/// Creates the CQs and QPs under the lock (as IPoIB's PnP callback did), then shows they work with one SEND.
fn create_under<H: ScenarioHost>(ctx: &mut Ctx<H>, kind: ClMutexKind) -> anyhow::Result<()> {
    let lock = ClMutex::new(ctx.kernel.clone(), kind);
    lock.acquire();
    let irql = ctx.kernel.KeGetCurrentIrql();
    ctx.detail("irql_under_lock", irql);
    ctx.say(format_args!("{kind:?} held: IRQL {irql}; create_cq calls AllocateCommonBuffer (PASSIVE_LEVEL only)"));
    let lb = Loopback::new(ctx, 256, 16);
    lock.release();
    let lb = lb?;
    ctx.detail("cq_pieces", lb.cq.map(|cq| ctx.hca.cq_ring_pieces(cq)));

    let send = Buffer::common(ctx, 256)?;
    let recv = Buffer::common(ctx, 256)?;
    send.fill(ctx, &pattern(7, 256));
    let mr_s = register(ctx, lb.pd, &send, 0, vhca_driver_core::MrMapping::ScatterGather, true)?;
    let mr_r =
        register(ctx, lb.pd, &recv, vhca_proto::ACCESS_LOCAL_WRITE, vhca_driver_core::MrMapping::ScatterGather, true)?;
    ctx.hca.post_recv(lb.qp[1], &wqe(2, WrOpcode::Recv, &[sge(&mr_r, 0, 256)], None)).map_err(anyhow::Error::msg)?;
    let c = lb.run_on_a(ctx, &wqe(1, WrOpcode::Send, &[sge(&mr_s, 0, 256)], None))?;
    expect_success(&c, 1, WrOpcode::Send, Some(256))?;
    let r = ctx.poll_cq(lb.cq[1], 1)?;
    ctx.detail("completions", [cqe_view(&c), cqe_view(&r[0])]);
    expect_success(&r[0], 2, WrOpcode::Recv, Some(256))?;
    anyhow::ensure!(recv.read(ctx) == pattern(7, 256), "received bytes differ from the sent ones");

    lock.acquire();
    let torn_down = (|| {
        for mr in [mr_s, mr_r] {
            ctx.hca.dereg_mr(mr.lkey).map_err(anyhow::Error::msg)?;
        }
        lb.destroy(ctx)
    })();
    lock.release();
    torn_down?;
    send.free(ctx);
    recv.free(ctx);
    Ok(())
}
