//! pool-overrun, pool-use-after-free and their fixes: the two misuses of a pool block Special Pool (Driver Verifier
//! flag 0x1) exists to catch, in the driver's per-device name record (a NUL-terminated name in a 64-byte block).
//!
//! pool-overrun: the name fills the block and its terminating NUL goes one byte past it. Without Special Pool the
//! byte lands in the rest of the pool page and nothing notices; with it the block ends against a no-access page
//! and the store faults at once: 0xD6 DRIVER_PAGE_FAULT_BEYOND_END_OF_ALLOCATION, P1 the address, P2 1 (a write), P3
//! the instruction, P4 reserved (https://learn.microsoft.com/windows-hardware/drivers/debugger/bug-check-0xd6--driver-page-fault-beyond-end-of-allocation).
//! The fix, pool-overrun-fixed: the name is cut to leave room for its NUL.
//! pool-use-after-free: the record is freed at the device's removal and read once more afterwards (a late status
//! line). Without Special Pool Windows leaves freed pool mapped, so the read sees stale bytes; with it freed special
//! pool is inaccessible: 0xD5 DRIVER_PAGE_FAULT_IN_FREED_SPECIAL_POOL with the same parameters
//! (https://learn.microsoft.com/windows-hardware/drivers/debugger/bug-check-0xd5--driver-page-fault-in-freed-special-pool).
//! The fix, pool-use-after-free-fixed: the status line is read before the free.

use alloc::vec::Vec;

use anyhow::ensure;
use vhca_ntapi::*;

use crate::{Ctx, ScenarioHost};

const TAG: u32 = u32::from_le_bytes(*b"VhNm");
/// The record's size: a multiple of 16, so under Special Pool's Verify End its last byte touches the guard page.
const RECORD: usize = 64;

/// The device's name as its firmware reports it: exactly as long as the record.
const NAME: &[u8; RECORD] = b"vhca virtual RDMA host channel adapter, emulated for the rig 001";

fn allocate<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<PVOID> {
    let record = ctx.kernel.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, RECORD, TAG);
    ensure!(!record.is_null(), "ExAllocatePoolWithTag({RECORD}) failed");
    Ok(record)
}

/// The name and its NUL into the record: all of the name (the bug), or as much as leaves room for the NUL.
fn store_name<H: ScenarioHost>(ctx: &mut Ctx<H>, whole_name: bool) -> anyhow::Result<()> {
    let record = allocate(ctx)?;
    let kept = if whole_name { NAME.len() } else { RECORD - 1 };
    let mut terminated: Vec<u8> = NAME[..kept].to_vec();
    terminated.push(0);
    ctx.say(format_args!("name record: {} bytes into {RECORD} at {:#x}", terminated.len(), record.0));
    ctx.kernel.RtlCopyToVa(record, &terminated);
    let mut seen = [0u8; RECORD];
    ctx.kernel.RtlCopyFromVa(&mut seen, record);
    ctx.kernel.ExFreePoolWithTag(record, TAG);
    ensure!(seen[..kept] == NAME[..kept], "the record read back other bytes than the name");
    ctx.detail("name_bytes", terminated.len());
    Ok(())
}

pub fn overrun<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    store_name(ctx, true)
}

pub fn overrun_fixed<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let whole_name = ctx.options.break_fix;
    store_name(ctx, whole_name)
}

/// The record written, freed at removal, and its status byte read for a last line: after the free (the bug) or
/// before it.
fn late_status<H: ScenarioHost>(ctx: &mut Ctx<H>, after_free: bool) -> anyhow::Result<()> {
    let record = allocate(ctx)?;
    ctx.kernel.RtlCopyToVa(record, &NAME[..RECORD - 1]);
    let mut status = [0u8; 8];
    if !after_free {
        ctx.kernel.RtlCopyFromVa(&mut status, record);
    }
    ctx.kernel.ExFreePoolWithTag(record, TAG);
    if after_free {
        ctx.kernel.RtlCopyFromVa(&mut status, record);
    }
    // Without Special Pool a late read sees what the freed block still holds; nothing else checks it.
    ctx.detail("status_read_after_free", after_free);
    ctx.say(format_args!("last status: {:?}", core::str::from_utf8(&status).unwrap_or("(not text)")));
    Ok(())
}

pub fn use_after_free<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    late_status(ctx, true)
}

pub fn use_after_free_fixed<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let after_free = ctx.options.break_fix;
    late_status(ctx, after_free)
}
