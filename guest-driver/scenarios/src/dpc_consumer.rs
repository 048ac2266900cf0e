//! What the interrupt-path scenarios share: a CQ consumer of the driver variant's own, watched through the completion
//! path the host connected (its callback runs at DISPATCH_LEVEL in the DPC), a KEVENT that tells PASSIVE_LEVEL code
//! the consumer is done, and the RDMA writes that give it completions.
//!
//! Why the variants live here and not in the driver core: the core's consumers are the right ones; a bug of the
//! interrupt path is a driver that plugs other ones in (`CompletionHooks`), as fast-mutex-create-cq is a lock choice.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering};
use core::time::Duration;

use anyhow::Context as _;
use vhca_driver_core::{CompletionCallback, CompletionHooks, MrMapping, RegisteredMr};
use vhca_ntapi::*;
use vhca_proto::{Wqe, WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::verbs::{compare, dereg, pattern, register, sge, wqe, Buffer};
use crate::{Ctx, ScenarioHost};

/// KeWaitForSingleObject's relative time: negative, in 100 ns units.
pub fn relative(d: Duration) -> i64 {
    -((d.as_nanos() / 100).clamp(1, i64::MAX as u128) as i64)
}

/// A countdown the DPC's consumer ticks and PASSIVE_LEVEL code waits on: a notification KEVENT set when it reaches 0.
pub struct Done<K: NtAsyncKernel> {
    kernel: Arc<K>,
    event: PKEVENT,
    left: AtomicU64,
}

impl<K: NtAsyncKernel> Done<K> {
    pub fn new(kernel: Arc<K>, count: u64) -> Arc<Done<K>> {
        let event = kernel.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
        Arc::new(Done { kernel, event, left: AtomicU64::new(count) })
    }

    /// IRQL <= DISPATCH_LEVEL. One done; the last sets the event (KeSetEvent with Wait = FALSE is DISPATCH-safe).
    pub fn one(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.kernel.KeSetEvent(self.event, 0, false);
        }
    }

    pub fn left(&self) -> u64 {
        self.left.load(Ordering::Acquire)
    }

    /// PASSIVE_LEVEL. Whether everything was done within `wait`.
    pub fn wait(&self, wait: Duration) -> bool {
        let status = self.kernel.KeWaitForSingleObject(
            self.event.into(),
            KWAIT_REASON::Executive,
            KPROCESSOR_MODE::KernelMode,
            false,
            Some(relative(wait)),
        );
        status == STATUS_SUCCESS
    }
}

/// The completion path's seams, or why the run has none (it polls: `vhca.completion=poll`, or a host without them).
pub fn hooks<'c, H: ScenarioHost>(ctx: &'c Ctx<H>) -> anyhow::Result<&'c dyn CompletionHooks> {
    ctx.completions
        .as_ref()
        .and_then(|c| c.hooks())
        .context("this scenario needs the interrupt path and its consumer seams (vhca.completion=interrupt)")
}

/// Hands `cq`'s completions to `callback` (in the DPC) and arms the CQ; one look from the DPC follows, for CQEs
/// written before the arm.
pub fn watch_with<H: ScenarioHost>(ctx: &mut Ctx<H>, cq: u32, callback: CompletionCallback) -> anyhow::Result<()> {
    let reader = ctx.hca.cq_reader(cq).with_context(|| alloc::format!("CQ {cq} is not open"))?;
    hooks(ctx)?.watch_with(cq, reader, callback);
    ctx.hca.req_notify_cq(cq, false).map_err(|e| anyhow::anyhow!("req_notify_cq: {e}"))?;
    if let Some(c) = &ctx.completions {
        c.kick(cq);
    }
    Ok(())
}

/// Two common buffers registered for RDMA writes from `src` into `dst` (common buffers: the data is checked in
/// every verifier mode, none is double-buffered).
pub struct WritePair {
    src: Buffer,
    dst: Buffer,
    mr_src: RegisteredMr,
    mr_dst: RegisteredMr,
    data: Vec<u8>,
}

impl WritePair {
    pub fn new<H: ScenarioHost>(ctx: &mut Ctx<H>, pd: u32, len: u32, seed: u8) -> anyhow::Result<WritePair> {
        let src = Buffer::common(ctx, len)?;
        let data = pattern(seed, len as usize);
        src.fill(ctx, &data);
        let dst = Buffer::common(ctx, len)?;
        let mr_src = register(ctx, pd, &src, 0, MrMapping::ScatterGather, true)?;
        let access = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE;
        let mr_dst = register(ctx, pd, &dst, access, MrMapping::ScatterGather, true)?;
        Ok(WritePair { src, dst, mr_src, mr_dst, data })
    }

    /// A signaled RDMA write of `len` bytes at `offset` of both buffers.
    pub fn write(&self, wr_id: u64, offset: u64, len: u32) -> Wqe {
        wqe(wr_id, WrOpcode::RdmaWrite, &[sge(&self.mr_src, offset, len)], Some((&self.mr_dst, offset)))
    }

    /// Whether the first `len` bytes arrived, for the report.
    pub fn check<H: ScenarioHost>(&self, ctx: &Ctx<H>, what: &str, len: usize) -> serde_json::Value {
        compare(what, &self.dst.read(ctx)[..len], &self.data[..len])
    }

    pub fn free<H: ScenarioHost>(self, ctx: &mut Ctx<H>) -> anyhow::Result<()> {
        dereg(ctx, &self.mr_src)?;
        dereg(ctx, &self.mr_dst)?;
        self.src.free(ctx);
        self.dst.free(ctx);
        Ok(())
    }
}
