//! A scatter/gather list a scenario takes itself, on an adapter of its choosing, and the MRs over its elements: the
//! DMA scenarios need to see the elements the driver core's reg_mr would hide (how many, where they lie).
//! The list comes back only when GetScatterGatherList called its routine before returning (registers to spare).

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec::Vec;

use anyhow::{ensure, Context as _};
use once_cell::race::OnceBox;
use vhca_driver_core::{MrMapping, MrSource, RegisteredMr};
use vhca_ntapi::*;

use crate::{Ctx, ScenarioHost};

/// A list over a non-paged buffer, and what gives it back.
pub struct OwnList {
    pub adapter: PDMA_ADAPTER,
    pub mdl: PMDL,
    pub list: SCATTER_GATHER_LIST,
    pub write_to_device: bool,
}

impl OwnList {
    /// PASSIVE_LEVEL. An MDL over `len` bytes of non-paged `va`, and its list from GetScatterGatherList at
    /// DISPATCH_LEVEL (where Windows requires the call).
    pub fn take<H: ScenarioHost>(
        ctx: &Ctx<H>,
        adapter: PDMA_ADAPTER,
        va: PVOID,
        len: u32,
        write_to_device: bool,
    ) -> anyhow::Result<OwnList> {
        let k = &*ctx.kernel;
        let mdl = k.IoAllocateMdl(va, len, false, false);
        ensure!(!mdl.is_null(), "IoAllocateMdl({len}) failed");
        k.MmBuildMdlForNonPagedPool(mdl);
        let arrived: Arc<OnceBox<SCATTER_GATHER_LIST>> = Arc::new(OnceBox::new());
        let slot = arrived.clone();
        let routine: PDRIVER_LIST_CONTROL = Box::new(move |_device, list: &SCATTER_GATHER_LIST| {
            let _ = slot.set(Box::new(list.clone()));
        });
        let old = k.KeRaiseIrql(DISPATCH_LEVEL);
        let status = k.GetScatterGatherList(adapter, ctx.own_device, mdl, va, len, routine, write_to_device);
        k.KeLowerIrql(old);
        let list = arrived.get().cloned();
        if !status.is_success() || list.is_none() {
            // A queued routine still describes its transfer by the MDL: only a failed call frees it here.
            if !status.is_success() {
                k.IoFreeMdl(mdl);
            }
            anyhow::bail!("GetScatterGatherList: {status:?}, list delivered before the return: {}", list.is_some());
        }
        Ok(OwnList { adapter, mdl, list: list.context("no list")?, write_to_device })
    }

    /// The elements as (address, length) pairs, for the result's details.
    pub fn elements(&self) -> Vec<(u64, u32)> {
        self.list.Elements.iter().map(|e| (e.Address.0, e.Length)).collect()
    }

    /// PASSIVE_LEVEL. PutScatterGatherList at DISPATCH_LEVEL (copying a bounced device write back), then the MDL.
    pub fn give_back<H: ScenarioHost>(self, ctx: &Ctx<H>) {
        let k = &*ctx.kernel;
        let old = k.KeRaiseIrql(DISPATCH_LEVEL);
        k.PutScatterGatherList(self.adapter, self.list.Handle, self.write_to_device);
        k.KeLowerIrql(old);
        k.IoFreeMdl(self.mdl);
    }
}

/// An MR the device reaches at `device_address` for `len` bytes of the buffer at `va`: the driver hands the device
/// that address as it stands, which is where the scenarios' bugs put a wrong one.
pub fn register_at<H: ScenarioHost>(
    ctx: &mut Ctx<H>,
    pd: u32,
    va: PVOID,
    device_address: u64,
    len: u32,
    access: u32,
) -> anyhow::Result<RegisteredMr> {
    let source = MrSource::Common { va, logical: PHYSICAL_ADDRESS(device_address), length: len };
    ctx.hca
        .reg_mr(pd, source, access, MrMapping::ScatterGather)
        .map_err(|e| anyhow::anyhow!("reg_mr at {device_address:#x}: {e}"))
}
