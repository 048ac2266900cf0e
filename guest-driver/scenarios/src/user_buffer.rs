//! user-buffer-probe-lock and user-buffer-no-lock: a user process's buffer registered as an MR, with and without
//! MmProbeAndLockPages. Mapped per registration (S/G), read by the CPU after deregistration, as a correct driver does.

use anyhow::ensure;
use vhca_driver_core::MrMapping;
use vhca_proto::{WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::verbs::{compare, cqe_view, dereg, expect_success, pattern, register, sge, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

const LEN: u32 = 2 * 4096 + 300;

pub fn probe_lock<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let lock = !ctx.options.break_fix;
    user_buffer(ctx, lock)
}

pub fn no_lock<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    user_buffer(ctx, false)
}

fn user_buffer<H: ScenarioHost>(ctx: &mut Ctx<H>, lock: bool) -> anyhow::Result<()> {
    ctx.detail("probe_and_lock", lock);
    let lb = Loopback::new(ctx, 64, 64)?;
    let src = Buffer::common(ctx, LEN)?;
    let data = pattern(11, LEN as usize);
    src.fill(ctx, &data);
    let mr_src = register(ctx, lb.pd, &src, 0, MrMapping::ScatterGather, true)?;
    // Unaligned, as user buffers are: the MR starts 0x1a0 bytes into its first page.
    let user = Buffer::user(ctx, LEN, 0x1a0)?;
    ctx.say(format_args!("registering a user buffer {} MmProbeAndLockPages", if lock { "after" } else { "WITHOUT" }));
    let mr_user =
        register(ctx, lb.pd, &user, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE, MrMapping::ScatterGather, lock)?;
    let c = lb.run_on_a(ctx, &wqe(1, WrOpcode::RdmaWrite, &[sge(&mr_src, 0, LEN)], Some((&mr_user, 0))))?;
    ctx.detail("completion", cqe_view(&c));
    expect_success(&c, 1, WrOpcode::RdmaWrite, Some(LEN))?;
    dereg(ctx, &mr_user)?;
    dereg(ctx, &mr_src)?;
    let check = compare("user_buffer_after_dereg", &user.read(ctx), &data);
    ctx.detail("data", &check);
    user.free(ctx);
    src.free(ctx);
    lb.destroy(ctx)?;
    ensure!(check["matches"] == serde_json::json!(true), "the user buffer does not hold what the device wrote");
    Ok(())
}
