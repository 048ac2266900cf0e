//! device-pool-exhaustion: the device's own map-register pool runs out. One-page MRs are registered until REG_MR
//! answers MAP_REGISTERS_EXHAUSTED; that must happen exactly when the free count QUERY_DEVICE gave is used up.

use alloc::string::ToString;
use alloc::vec::Vec;
use core::time::Duration;

use anyhow::{bail, ensure};
use vhca_driver_core::{DriverError, MrMapping};
use vhca_proto::{EventKind, Opcode, Status, ACCESS_LOCAL_WRITE};

use crate::verbs::{register, Buffer};
use crate::{Ctx, ScenarioHost};

/// Registrations tried at most: the runner starts the device with a small pool (`--map-registers 16`).
const MAX_TRIES: u32 = 512;

pub fn run<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let free = ctx.hca.attributes().map_registers_free.get();
    let total = ctx.hca.attributes().map_registers_total.get();
    ctx.detail("device_map_registers", serde_json::json!({"total": total, "free_at_open": free}));
    ensure!(free < MAX_TRIES, "the device has {free} free map registers; run it with --map-registers 16");
    let pd = ctx.hca.alloc_pd().map_err(|e| anyhow::anyhow!("alloc_pd: {e}"))?;
    // One common buffer, registered over and over: each REG_MR of one page takes one device register.
    let page = Buffer::common(ctx, 4096)?;
    let mut keys = Vec::new();
    let refusal = loop {
        match register(ctx, pd, &page, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather, true) {
            Ok(mr) => keys.push(mr),
            Err(e) => break e,
        }
        if keys.len() as u32 > MAX_TRIES {
            bail!("{} registrations and the device never ran out", keys.len());
        }
    };
    let status = refusal.to_string();
    ctx.detail("registered_before_refusal", keys.len());
    ctx.detail("refusal", &status);
    let exhausted = ctx.wait_event(EventKind::MapRegistersExhausted, Duration::from_millis(500));
    ctx.detail("exhausted_event", exhausted.is_some());
    for mr in &keys {
        ctx.hca.dereg_mr(mr.lkey).map_err(|e| anyhow::anyhow!("dereg_mr: {e}"))?;
    }
    // The registers came back: one more registration must work again.
    let again = register(ctx, pd, &page, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather, true)?;
    ctx.hca.dereg_mr(again.lkey).map_err(|e| anyhow::anyhow!("dereg_mr: {e}"))?;
    page.free(ctx);
    ctx.hca.dealloc_pd(pd).map_err(|e| anyhow::anyhow!("dealloc_pd: {e}"))?;

    let expected = DriverError::Device { opcode: Opcode::RegMr, status: Status::MapRegistersExhausted };
    ensure!(status.ends_with(&expected.to_string()), "REG_MR failed with {status:?}, expected {expected}");
    ensure!(
        keys.len() as u32 == free,
        "{} MRs registered before exhaustion, QUERY_DEVICE said {free} free",
        keys.len()
    );
    ensure!(exhausted.is_some(), "no MAP_REGISTERS_EXHAUSTED event arrived");
    ctx.say(format_args!(
        "device-pool-exhaustion: {} registered, then {}",
        keys.len(),
        Status::MapRegistersExhausted.name()
    ));
    Ok(())
}
