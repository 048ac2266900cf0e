//! unload-timer-set and unload-timer-cancelled: the driver runs its health watchdog (a periodic timer and its DPC)
//! while it works, then is removed and unloads. The bug: the remove path forgets the watchdog, so the timer is
//! still set when the driver unloads; with any verifier flag that is 0xC7/0x0 at once (the automatic checks look
//! for timers right after a verified driver unloads); without, Windows runs on and the timer's next expiry queues
//! a DPC whose routine is gone: 0xD4 at DISPATCH_LEVEL. The fix: the remove path stops the watchdog
//! (KeCancelTimer, then KeFlushQueuedDpcs at PASSIVE_LEVEL) after the interrupt is disconnected and before unload.
//! The run goes on for `RUNS_ON` after the unload (`Scenario::runs_on_after_unload`), so the late expiry comes.

use core::time::Duration;

use vhca_driver_core::MrMapping;
use vhca_proto::{WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::health_watchdog::HealthWatchdog;
use crate::verbs::{compare, dereg, expect_success, pattern, register, sge, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

/// The watchdog's period: a few of the NT model's clock ticks (15.625 ms), short enough that the run sees several.
pub const PERIOD: Duration = Duration::from_millis(50);
/// How long the system runs on after the unload: four periods, so a timer left set expires at least three times.
pub const RUNS_ON: Duration = Duration::from_millis(200);
/// Checks the watchdog must have made before the driver is removed (it is live, not merely set).
const CHECKS: u64 = 3;
const LEN: u32 = 4096;

pub fn timer_set<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, false)
}

pub fn timer_cancelled<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let stop = !ctx.options.break_fix;
    run(ctx, stop)
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, stop_watchdog: bool) -> anyhow::Result<()> {
    let watchdog = HealthWatchdog::start(ctx.kernel.clone(), PERIOD);
    ctx.say(format_args!("health watchdog set: KeSetTimerEx every {PERIOD:?}, its DPC checks the device"));
    // The driver's ordinary work while the watchdog runs: one RDMA write between two QPs.
    let lb = Loopback::new(ctx, 64, 64)?;
    let src = Buffer::common(ctx, LEN)?;
    let data = pattern(9, LEN as usize);
    src.fill(ctx, &data);
    let dst = Buffer::common(ctx, LEN)?;
    let mr_src = register(ctx, lb.pd, &src, 0, MrMapping::ScatterGather, true)?;
    let mr_dst = register(ctx, lb.pd, &dst, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE, MrMapping::ScatterGather, true)?;
    let c = lb.run_on_a(ctx, &wqe(1, WrOpcode::RdmaWrite, &[sge(&mr_src, 0, LEN)], Some((&mr_dst, 0))))?;
    expect_success(&c, 1, WrOpcode::RdmaWrite, Some(LEN))?;
    let check = compare("rdma_write", &dst.read(ctx), &data);
    let checks = watchdog.wait_for_checks(CHECKS, PERIOD * 20);
    ctx.detail("watchdog_checks_before_remove", checks);
    ctx.detail("data", &check);
    dereg(ctx, &mr_src)?;
    dereg(ctx, &mr_dst)?;
    src.free(ctx);
    dst.free(ctx);
    lb.destroy(ctx)?;
    anyhow::ensure!(check["matches"] == serde_json::json!(true), "the RDMA write's data did not arrive: {check}");
    anyhow::ensure!(checks >= CHECKS, "the watchdog ran {checks} checks in {:?}, {CHECKS} expected", PERIOD * 20);
    if stop_watchdog {
        let was_set = watchdog.stop();
        ctx.detail("watchdog_stopped", was_set);
        ctx.say("remove: health watchdog stopped (KeCancelTimer, KeFlushQueuedDpcs) before unload");
    } else {
        // The bug: the remove path never stops the watchdog; the timer stays in the timer queue past unload.
        ctx.detail("watchdog_stopped", false);
        ctx.say("remove: the health watchdog is left set; the driver unloads with its timer in the timer queue");
    }
    Ok(())
}
