//! sg-fragmented and sg-fragmented-fixed: a buffer whose pages are physically fragmented (the run sets the
//! fragmentation knob, `vhca.fragmentation=4`: no more than four of its pages adjacent), so GetScatterGatherList gives one
//! element per page run, each mapped on its own.
//!
//! The fix hands the device every element (one MR per element here, so each element's data is checked on its own
//! at the device: an RDMA_WRITE out of each into its place in a second buffer). The bug assumes a list has one
//! element, as a driver that only ever met contiguous buffers does: it programs the device with the first element
//! and moves what that element covers, so the device sees a short transfer and the rest of the buffer never
//! arrives (a wrong result: the device did nothing it was not told to). Under DMA checking the list is the
//! verifier's shadow, one element, and the bug goes unseen. Microsoft:
//! SCATTER_GATHER_LIST's NumberOfElements, "the number of elements in the Elements array"
//! (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/ns-wdm-_scatter_gather_list); the HAL makes one
//! element per physically contiguous run (https://learn.microsoft.com/windows-hardware/drivers/kernel/using-scatter-gather-dma).

use alloc::vec;
use alloc::vec::Vec;

use anyhow::ensure;
use vhca_driver_core::{MrMapping, RegisteredMr};
use vhca_ntapi::*;
use vhca_proto::{WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::own_list::{register_at, OwnList};
use crate::verbs::{compare, cqe_view, dereg, expect_success, pattern, register, sge, wqe, Buffer, Loopback};
use crate::{Ctx, ScenarioHost};

const LEN: u32 = 8 * 4096;

pub fn first_element_only<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    run(ctx, false)
}

pub fn every_element<H: ScenarioHost>(ctx: &mut Ctx<H>) -> anyhow::Result<()> {
    let every = !ctx.options.break_fix;
    run(ctx, every)
}

fn run<H: ScenarioHost>(ctx: &mut Ctx<H>, every_element: bool) -> anyhow::Result<()> {
    let lb = Loopback::new(ctx, 64, 64)?;
    let src = Buffer::pool(ctx, LEN)?;
    let data = pattern(7, LEN as usize);
    src.fill(ctx, &data);
    // Pool too: a common buffer this long needs contiguous pages, which the fragmented machine does not have.
    let dst = Buffer::pool(ctx, LEN)?;
    dst.fill(ctx, &vec![0; LEN as usize]);
    let mr_dst = register(ctx, lb.pd, &dst, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE, MrMapping::ScatterGather, true)?;
    let list = OwnList::take(ctx, ctx.hca.adapter(), src.va(), LEN, true)?;
    let elements = list.elements();
    ctx.detail("elements", &elements);
    ctx.say(format_args!("the fragmented buffer's list has {} elements", elements.len()));
    let handed: &[(u64, u32)] = if every_element { &elements } else { &elements[..1] };
    let moved = transfers(ctx, &lb, src.va(), handed, &mr_dst);
    // Read after the deregistration: its PutScatterGatherList copies a double-buffered write back.
    dereg(ctx, &mr_dst)?;
    let check = compare("device_read_every_element", &dst.read(ctx), &data);
    ctx.detail("data", &check);
    list.give_back(ctx);
    src.free(ctx);
    dst.free(ctx);
    lb.destroy(ctx)?;
    let moved = moved?;
    ctx.detail("bytes_moved", moved);
    // DMA checking double-buffers the transfer into a shadow of its own, one element (docs/verifier.md): there the
    // bug goes unseen, and only an unchecked run must have met the fragmented list.
    ensure!(
        elements.len() > 1 || ctx.host.dma_checking() != Some(false),
        "the buffer's list has one element: is the run's fragmentation 4?"
    );
    ensure!(
        moved == LEN && check["matches"] == serde_json::json!(true),
        "the device moved {moved} of the buffer's {LEN} bytes: the driver programmed {} of the list's {} elements",
        handed.len(),
        elements.len()
    );
    Ok(())
}

/// One MR and one RDMA_WRITE per element handed, into the element's place in `mr_dst`; the bytes moved.
fn transfers<H: ScenarioHost>(
    ctx: &mut Ctx<H>,
    lb: &Loopback,
    va: PVOID,
    handed: &[(u64, u32)],
    mr_dst: &RegisteredMr,
) -> anyhow::Result<u32> {
    let mut offset = 0u32;
    let mut mrs: Vec<RegisteredMr> = Vec::new();
    let mut result = Ok(());
    for (i, &(address, len)) in handed.iter().enumerate() {
        let mr = match register_at(ctx, lb.pd, PVOID(va.0 + offset as u64), address, len, 0) {
            Ok(mr) => mr,
            Err(e) => {
                result = Err(e);
                break;
            }
        };
        mrs.push(mr);
        let w = wqe(i as u64 + 1, WrOpcode::RdmaWrite, &[sge(&mr, 0, len)], Some((mr_dst, offset as u64)));
        let c = lb.run_on_a(ctx, &w)?;
        ctx.detail("completion", cqe_view(&c));
        if let Err(e) = expect_success(&c, i as u64 + 1, WrOpcode::RdmaWrite, Some(len)) {
            result = Err(e);
            break;
        }
        offset += len;
    }
    for mr in &mrs {
        dereg(ctx, mr)?;
    }
    result.map(|()| offset)
}
