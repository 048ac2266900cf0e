//! map-register-exhaustion: CQ rings made the seed's DISPATCH_LEVEL way (contiguous memory, AllocateAdapterChannel,
//! MapTransfer in the AdapterControl routine), on an adapter described for 32 KiB transfers (IoGetDmaAdapter grants
//! 9 map registers per request). Two things run out, as on Windows:
//! 1. the device's own map-register pool (`vhca-device --map-registers`): CREATE_CQ is refused with
//!    MAP_REGISTERS_EXHAUSTED once the device's pages are taken. The adapter's map registers never run out first:
//!    a 64-bit bus master needs none, and DMA checking's double buffering waits for them instead of failing;
//! 2. the per-request maximum: a 16-page ring asks AllocateAdapterChannel for 16 > 9 registers, which Windows
//!    refuses (STATUS_INSUFFICIENT_RESOURCES) and DMA checking stops (0xE6/0x0C, P2 = 16 asked, P3 = 9 maximum).

use alloc::format;
use alloc::string::ToString;
use alloc::vec::Vec;

use anyhow::{bail, ensure};
use vhca_driver_core::{DriverError, HcaConfig, RingMemory};
use vhca_ntapi::STATUS_INSUFFICIENT_RESOURCES;
use vhca_proto::{Opcode, Status};

use crate::ScenarioOptions;
use crate::{Ctx, ScenarioHost};

/// 1024 CQEs: 8 pages, 8 map registers per ring.
const CQ_ENTRIES: u32 = 1024;
const PAGES_PER_CQ: u32 = 8;
/// 2048 CQEs: 16 pages, more than the adapter grants per request.
const TOO_LARGE_CQ_ENTRIES: u32 = 2048;
/// The adapter's largest transfer: 8 pages, so IoGetDmaAdapter asks for 8 + 1 registers.
const MAX_TRANSFER: u32 = 8 * 4096;
/// CQs tried at most, whatever the device has.
const MAX_CQS: u32 = 64;

pub fn config(_: &ScenarioOptions) -> HcaConfig {
    HcaConfig { ring_memory: RingMemory::ContiguousMapTransfer, max_transfer: MAX_TRANSFER, ..HcaConfig::default() }
}

pub fn run<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let device_free = ctx.hca.attributes().map_registers_free.get();
    let granted = ctx.hca.map_registers();
    let expected = device_free / PAGES_PER_CQ;
    ctx.detail("device_map_registers_free", device_free);
    ctx.detail("granted_per_request", granted);
    ctx.detail("expected_cqs", expected);
    ctx.say(format_args!("MapTransfer rings: device has {device_free} map registers, {PAGES_PER_CQ} per CQ"));
    let mut cqs = Vec::new();
    let failure = loop {
        match ctx.hca.create_cq(CQ_ENTRIES) {
            Ok(cq) => cqs.push(cq),
            Err(e) => break e,
        }
        if cqs.len() as u32 >= MAX_CQS {
            bail!("{} CQs created and the device's map registers never ran out", cqs.len());
        }
    };
    ctx.detail("cqs_created", cqs.len());
    ctx.detail("failure", failure.to_string());
    ctx.say(format_args!("CQ {} refused cleanly: {failure}", cqs.len() + 1));
    for cq in &cqs {
        ctx.destroy_cq(*cq).map_err(anyhow::Error::msg)?;
    }
    let device_refusal = DriverError::Device { opcode: Opcode::CreateCq, status: Status::MapRegistersExhausted };
    ensure!(failure == device_refusal, "create_cq failed with {failure}, expected the device's {device_refusal}");
    ensure!(cqs.len() as u32 == expected, "{} CQs before the device ran out, expected {expected}", cqs.len());

    // Past the per-request maximum: with DMA checking the machine stops here (0xE6/0x0C).
    ctx.say(format_args!("asking for a {}-page ring, {granted} map registers granted per request", 2 * PAGES_PER_CQ));
    let too_large = ctx.hca.create_cq(TOO_LARGE_CQ_ENTRIES);
    ctx.detail("too_large_ring", format!("{too_large:?}"));
    let refused = DriverError::Kernel { routine: "AllocateAdapterChannel", status: STATUS_INSUFFICIENT_RESOURCES };
    match too_large {
        Err(e) if e == refused => Ok(()),
        Err(e) => bail!("the {TOO_LARGE_CQ_ENTRIES}-entry CQ failed with {e}, expected {refused}"),
        Ok(cq) => {
            ctx.destroy_cq(cq).map_err(anyhow::Error::msg)?;
            bail!("a ring of more map registers than IoGetDmaAdapter granted ({granted}) was created")
        }
    }
}
