//! What several scenarios share: buffers of each kind the NT model has, two RC QPs connected by loopback, work
//! requests, data patterns, and completion checks with the statuses named.

use alloc::format;
use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;

use anyhow::{ensure, Context};
use serde_json::{json, Value};
use vhca_driver_core::{DriverError, MrMapping, MrSource, RegisteredMr};
use vhca_ntapi::*;
use vhca_proto::status::WcStatus;
use vhca_proto::{Cqe, Sge, Wqe, WrOpcode, ACCESS_ALL, WR_SIGNALED};

use crate::{Ctx, ScenarioHost};

const TAG: u32 = pool_tag(b"vhca");

/// A buffer the scenario owns, and how to give it back.
#[derive(Debug, Clone, Copy)]
pub enum Buffer {
    /// Non-paged pool, NX (Code integrity checks refuse executable pool: docs/verifier.md).
    Pool { va: PVOID, len: u32 },
    /// AllocateCommonBuffer: shared by CPU and device in every verifier mode.
    Common { va: PVOID, logical: PHYSICAL_ADDRESS, len: u32 },
    /// A user process's pageable buffer.
    User { va: PVOID, len: u32 },
}

impl Buffer {
    pub fn pool<H: ScenarioHost>(ctx: &Ctx<H>, len: u32) -> anyhow::Result<Buffer> {
        let va = ctx.kernel.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, len as usize, TAG);
        ensure!(!va.is_null(), "ExAllocatePoolWithTag({len}) failed");
        Ok(ctx.own(Buffer::Pool { va, len }))
    }

    pub fn common<H: ScenarioHost>(ctx: &Ctx<H>, len: u32) -> anyhow::Result<Buffer> {
        let mut logical = PHYSICAL_ADDRESS(0);
        let va = ctx.kernel.AllocateCommonBuffer(ctx.hca.adapter(), len, &mut logical, true);
        ensure!(!va.is_null(), "AllocateCommonBuffer({len}) failed");
        Ok(ctx.own(Buffer::Common { va, logical, len }))
    }

    /// A user buffer starting `offset` bytes into its first page (user buffers are rarely page aligned).
    pub fn user<H: ScenarioHost>(ctx: &Ctx<H>, len: u32, offset: u64) -> anyhow::Result<Buffer> {
        let va = ctx.host.alloc_user_buffer(len, offset);
        ensure!(!va.is_null(), "user buffer of {len} bytes could not be allocated");
        Ok(ctx.own(Buffer::User { va, len }))
    }

    pub fn va(&self) -> PVOID {
        match *self {
            Buffer::Pool { va, .. } | Buffer::Common { va, .. } | Buffer::User { va, .. } => va,
        }
    }

    pub fn len(&self) -> u32 {
        match *self {
            Buffer::Pool { len, .. } | Buffer::Common { len, .. } | Buffer::User { len, .. } => len,
        }
    }

    /// The MR source describing this buffer.
    pub fn source(&self, lock_user_buffer: bool) -> MrSource {
        match *self {
            Buffer::Pool { va, len } => MrSource::Kernel { va, length: len },
            Buffer::Common { va, logical, len } => MrSource::Common { va, logical, length: len },
            Buffer::User { va, len } => MrSource::User { va, length: len, skip_lock: !lock_user_buffer },
        }
    }

    pub fn fill<H: ScenarioHost>(&self, ctx: &Ctx<H>, data: &[u8]) {
        ctx.kernel.RtlCopyToVa(self.va(), data);
    }

    pub fn fill_at<H: ScenarioHost>(&self, ctx: &Ctx<H>, offset: u64, data: &[u8]) {
        if let Some(va) = self.va().offset(offset) {
            ctx.kernel.RtlCopyToVa(va, data);
        }
    }

    pub fn read<H: ScenarioHost>(&self, ctx: &Ctx<H>) -> Vec<u8> {
        let mut out = vec![0u8; self.len() as usize];
        ctx.kernel.RtlCopyFromVa(&mut out, self.va());
        out
    }

    pub fn free<H: ScenarioHost>(self, ctx: &Ctx<H>) {
        ctx.disown(&self);
        self.give_back(&*ctx.kernel, ctx.host, ctx.hca.adapter());
    }

    /// Frees the buffer without the bookkeeping (`free`, and the run's clean-up of what a stopped scenario left);
    /// `adapter` is used for a common buffer only.
    pub(crate) fn give_back<H: ScenarioHost>(self, kernel: &H::Kernel, host: &H, adapter: PDMA_ADAPTER) {
        match self {
            Buffer::Pool { va, .. } => kernel.ExFreePoolWithTag(va, TAG),
            Buffer::Common { va, logical, len } => kernel.FreeCommonBuffer(adapter, len, logical, va, true),
            Buffer::User { va, .. } => host.free_user_buffer(va),
        }
    }
}

/// `len` bytes that differ per `seed` and per position, so a misplaced or stale byte never matches by chance.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32 * 17 + 1) as u8).collect()
}

/// Compares what the CPU sees with what it should; the summary goes into the report.
pub fn compare(what: &str, seen: &[u8], expected: &[u8]) -> Value {
    let mismatches = seen.iter().zip(expected).filter(|(a, b)| a != b).count() + seen.len().abs_diff(expected.len());
    let first = seen.iter().zip(expected).position(|(a, b)| a != b);
    json!({
        "what": what,
        "bytes": expected.len(),
        "matches": mismatches == 0,
        "mismatched_bytes": mismatches,
        "first_mismatch": first,
        "seen_head": hex(&seen[..seen.len().min(16)]),
        "expected_head": hex(&expected[..expected.len().min(16)]),
    })
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn register<H: ScenarioHost>(
    ctx: &mut Ctx<H>,
    pd: u32,
    buffer: &Buffer,
    access: u32,
    mapping: MrMapping,
    lock_user_buffer: bool,
) -> anyhow::Result<RegisteredMr> {
    ctx.hca.reg_mr(pd, buffer.source(lock_user_buffer), access, mapping).map_err(|e| anyhow::anyhow!("reg_mr: {e}"))
}

pub fn sge(mr: &RegisteredMr, offset: u64, length: u32) -> Sge {
    Sge { addr: (mr.addr + offset).into(), length: length.into(), lkey: mr.lkey.into() }
}

pub fn wqe(wr_id: u64, opcode: WrOpcode, sges: &[Sge], remote: Option<(&RegisteredMr, u64)>) -> Wqe {
    let mut w = Wqe {
        wr_id: wr_id.into(),
        opcode: (opcode as u32).into(),
        flags: WR_SIGNALED.into(),
        num_sge: (sges.len() as u32).into(),
        ..Wqe::default()
    };
    for (slot, s) in w.sge.iter_mut().zip(sges) {
        *slot = *s;
    }
    if let Some((mr, offset)) = remote {
        w.remote_addr = (mr.addr + offset).into();
        w.rkey = mr.rkey.into();
    }
    w
}

pub fn status_name(status: u32) -> &'static str {
    WcStatus::from_u32(status).map_or("UNKNOWN", WcStatus::name)
}

pub fn cqe_view(c: &Cqe) -> Value {
    json!({
        "wr_id": c.wr_id.get(),
        "status": status_name(c.status.get()),
        "opcode": WrOpcode::from_u32(c.opcode.get()).map_or("UNKNOWN", WrOpcode::name),
        "qpn": c.qpn.get(),
        "byte_len": c.byte_len.get(),
        "vendor_err": vhca_proto::FaultCause::from_u32(c.vendor_err.get()).map_or("unknown", |f| f.name()),
    })
}

/// Fails unless the CQE is the successful completion of `wr_id` with `opcode`.
pub fn expect_success(c: &Cqe, wr_id: u64, opcode: WrOpcode, byte_len: Option<u32>) -> anyhow::Result<()> {
    ensure!(
        c.status.get() == WcStatus::Success as u32,
        "wr {} completed with {} (vendor_err {})",
        c.wr_id.get(),
        status_name(c.status.get()),
        c.vendor_err.get()
    );
    ensure!(c.wr_id.get() == wr_id, "completion for wr {}, expected {wr_id}", c.wr_id.get());
    ensure!(c.opcode.get() == opcode as u32, "wr {wr_id}: opcode {} in the CQE, expected {opcode:?}", c.opcode.get());
    if let Some(n) = byte_len {
        ensure!(c.byte_len.get() == n, "wr {wr_id}: byte_len {}, expected {n}", c.byte_len.get());
    }
    Ok(())
}

/// A PD, two CQs and two RC QPs: `a` sends to `b` and back, both granting remote read and write.
pub struct Loopback {
    pub pd: u32,
    pub cq: [u32; 2],
    pub qp: [u32; 2],
}

fn driver(what: &'static str) -> impl Fn(DriverError) -> anyhow::Error {
    move |e| anyhow::anyhow!("{what}: {e}")
}

impl Loopback {
    pub fn new<H: ScenarioHost>(ctx: &mut Ctx<H>, cq_entries: u32, wq_entries: u32) -> anyhow::Result<Loopback> {
        let hca = &mut ctx.hca;
        let pd = hca.alloc_pd().map_err(driver("alloc_pd"))?;
        let cq = [
            hca.create_cq(cq_entries).map_err(driver("create_cq"))?,
            hca.create_cq(cq_entries).map_err(driver("create_cq"))?,
        ];
        let qp = [
            hca.create_qp(pd, cq[0], cq[0], wq_entries, wq_entries).map_err(driver("create_qp"))?,
            hca.create_qp(pd, cq[1], cq[1], wq_entries, wq_entries).map_err(driver("create_qp"))?,
        ];
        hca.connect_qp(qp[0], qp[1], ACCESS_ALL).map_err(driver("connect_qp a->b"))?;
        hca.connect_qp(qp[1], qp[0], ACCESS_ALL).map_err(driver("connect_qp b->a"))?;
        Ok(Loopback { pd, cq, qp })
    }

    /// Creates both QPs again on the CQs `cq` names and connects them (after a reset destroyed the old ones).
    pub fn reconnect<H: ScenarioHost>(&mut self, ctx: &mut Ctx<H>, wq_entries: u32) -> anyhow::Result<()> {
        let hca = &mut ctx.hca;
        for (qp, cq) in self.qp.iter_mut().zip(self.cq) {
            *qp = hca.create_qp(self.pd, cq, cq, wq_entries, wq_entries).map_err(driver("create_qp"))?;
        }
        hca.connect_qp(self.qp[0], self.qp[1], ACCESS_ALL).map_err(driver("connect_qp a->b"))?;
        hca.connect_qp(self.qp[1], self.qp[0], ACCESS_ALL).map_err(driver("connect_qp b->a"))
    }

    /// Posts one signaled WR on QP `a` and waits for its completion on `a`'s CQ.
    pub fn run_on_a<H: ScenarioHost>(&self, ctx: &mut Ctx<H>, w: &Wqe) -> anyhow::Result<Cqe> {
        ctx.hca.post_send(self.qp[0], w).map_err(driver("post_send"))?;
        let cqe = ctx.poll_cq(self.cq[0], 1)?;
        cqe.into_iter().next().context("no completion")
    }

    /// QPs, CQs, then the PD (MRs must be deregistered first).
    pub fn destroy<H: ScenarioHost>(self, ctx: &mut Ctx<H>) -> anyhow::Result<()> {
        for qp in self.qp {
            ctx.hca.destroy_qp(qp).map_err(driver("destroy_qp"))?;
        }
        for cq in self.cq {
            ctx.destroy_cq(cq).map_err(driver("destroy_cq"))?;
        }
        ctx.hca.dealloc_pd(self.pd).map_err(driver("dealloc_pd"))
    }
}

pub fn dereg<H: ScenarioHost>(ctx: &mut Ctx<H>, mr: &RegisteredMr) -> anyhow::Result<()> {
    ctx.hca.dereg_mr(mr.lkey).map_err(driver("dereg_mr"))
}
