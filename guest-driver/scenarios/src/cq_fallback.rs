//! contiguous-cq-fallback: the CQ ring (8 pages) cannot be one contiguous buffer (`vhca.fragmentation=4`, and
//! the device refuses runs over 4 pages), so the driver falls back to pieces; real completions then cross them.

use alloc::vec::Vec;

use anyhow::ensure;
use vhca_driver_core::{HcaConfig, MrMapping};
use vhca_proto::{WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, CQE_SIZE};

use crate::verbs::{dereg, expect_success, register, sge, wqe, Buffer, Loopback};
use crate::ScenarioOptions;
use crate::{Ctx, ScenarioHost};

/// 1024 CQEs of 32 bytes: an 8-page ring.
const CQ_ENTRIES: u32 = 1024;
const SQ_ENTRIES: u32 = 64;
/// Past the first 4-page piece (512 CQEs) and a bit: every completion is polled, in order.
const WRITES: u32 = 640;

/// `vhca.break_fix` takes the fallback away: one contiguous attempt, as a driver without the seed's algorithm.
pub fn config(options: &ScenarioOptions) -> HcaConfig {
    HcaConfig { ring_fallback: !options.break_fix, ..HcaConfig::default() }
}

pub fn run<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, CQ_ENTRIES, SQ_ENTRIES)?;
    let pieces = ctx.hca.cq_ring_pieces(lb.cq[0]).unwrap_or_default();
    ctx.detail("cq_entries", CQ_ENTRIES);
    ctx.detail("cq_pieces", &pieces);
    ctx.say(format_args!("CQ of {CQ_ENTRIES} entries in pieces of {pieces:?} pages"));
    let per_page = 4096 / CQE_SIZE as u32;
    let first_piece_cqes = pieces.first().copied().unwrap_or(0) * per_page;

    // Common buffers: the payload is beside the point here, and they are shared in every verifier mode.
    let src = Buffer::common(ctx, 4096)?;
    let dst = Buffer::common(ctx, 4096)?;
    let mr_src = register(ctx, lb.pd, &src, 0, MrMapping::ScatterGather, true)?;
    let mr_dst = register(ctx, lb.pd, &dst, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE, MrMapping::ScatterGather, true)?;
    let mut polled = 0u32;
    while polled < WRITES {
        let batch = (WRITES - polled).min(SQ_ENTRIES);
        // Each write carries its own sequence number to its own 8-byte slot of dst.
        let wqes: Vec<_> = (polled..polled + batch)
            .map(|i| {
                let slot = (i % 512) as u64 * 8;
                src.fill_at(ctx, slot, &(i as u64).to_le_bytes());
                wqe(1000 + i as u64, WrOpcode::RdmaWrite, &[sge(&mr_src, slot, 8)], Some((&mr_dst, slot)))
            })
            .collect();
        ctx.hca.post_send_many(lb.qp[0], &wqes).map_err(anyhow::Error::msg)?;
        for (k, c) in ctx.poll_cq(lb.cq[0], batch as usize)?.iter().enumerate() {
            expect_success(c, 1000 + polled as u64 + k as u64, WrOpcode::RdmaWrite, Some(8))?;
        }
        polled += batch;
    }
    ctx.detail("completions_polled", polled);
    ctx.detail("first_piece_cqes", first_piece_cqes);
    let bytes = dst.read(ctx);
    let last_lap_ok = (WRITES - 512..WRITES).all(|i| {
        let at = (i % 512) as usize * 8;
        bytes[at..at + 8] == (i as u64).to_le_bytes()
    });
    ctx.detail("data_matches", last_lap_ok);
    dereg(ctx, &mr_src)?;
    dereg(ctx, &mr_dst)?;
    src.free(ctx);
    dst.free(ctx);
    lb.destroy(ctx)?;
    ensure!(pieces.len() > 1, "the CQ ring is one piece of {pieces:?} pages: no fallback happened");
    ensure!(polled > first_piece_cqes, "only {polled} completions: none crossed into the second piece");
    ensure!(last_lap_ok, "dst does not hold the sequence numbers the writes carried");
    ctx.say(format_args!("{polled} completions polled across {} ring pieces, in order", pieces.len()));
    Ok(())
}
