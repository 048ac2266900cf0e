//! map-register-exhaustion: CQ rings made the seed's DISPATCH_LEVEL way (contiguous memory + MapTransfer), which
//! costs adapter map registers for as long as the ring lives, until AllocateAdapterChannel/MapTransfer runs out.

use anyhow::{bail, ensure};
use vhca_driver::{DriverError, HcaConfig, RingMemory};
use vhca_ntapi::STATUS_INSUFFICIENT_RESOURCES;

use super::Ctx;
use crate::cmdline::Options;

/// 1024 CQEs: 8 pages, 8 map registers per ring.
const CQ_ENTRIES: u32 = 1024;
const PAGES_PER_CQ: u32 = 8;
/// CQs tried at most, whatever the adapter has.
const MAX_CQS: u32 = 64;

pub fn config(_: &Options) -> HcaConfig {
    HcaConfig { ring_memory: RingMemory::ContiguousMapTransfer, ..HcaConfig::default() }
}

pub fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let registers = ctx.kernel.config().map_registers;
    let granted = ctx.hca.map_registers();
    let expected = registers / PAGES_PER_CQ;
    ctx.detail("adapter_pool", registers);
    ctx.detail("granted_per_transfer", granted);
    ctx.detail("expected_cqs", expected);
    ctx.say(format_args!("MapTransfer rings: {registers} adapter map registers, {PAGES_PER_CQ} per CQ"));
    let mut cqs = Vec::new();
    let failure = loop {
        match ctx.hca.create_cq(CQ_ENTRIES) {
            Ok(cq) => cqs.push(cq),
            Err(e) => break e,
        }
        if cqs.len() as u32 >= MAX_CQS {
            bail!("{} CQs created and the map registers never ran out", cqs.len());
        }
    };
    ctx.detail("cqs_created", cqs.len());
    ctx.detail("failure", failure.to_string());
    ctx.say(format_args!("CQ {} refused cleanly: {failure}", cqs.len() + 1));
    for cq in &cqs {
        ctx.hca.destroy_cq(*cq).map_err(anyhow::Error::msg)?;
    }
    let clean =
        DriverError::Kernel { routine: "AllocateAdapterChannel/MapTransfer", status: STATUS_INSUFFICIENT_RESOURCES };
    ensure!(failure == clean, "create_cq failed with {failure}, expected {clean}");
    ensure!(cqs.len() as u32 == expected, "{} CQs before exhaustion, expected {expected}", cqs.len());
    Ok(())
}
