//! The DMA_OPERATIONS routines past version 1's the model stands behind (GetDmaAdapterInfo, GetDmaTransferInfo, ...),
//! reached by pointer through the loader's table: the driver core's NtKernel trait does not name them.

use vhca_ntapi::*;

use super::{Adapter, Refusal, Waiting};
use crate::interleaving::{Access, SyncObject, Watched};
use crate::memory::Memory;
use crate::sg_split::{self, DeviceRun};
use crate::verifier::e6;
use crate::{lock, NtModel, PAGE};

/// 0xE6/0x25 "Unknown device description version": IoGetDmaAdapter under DMA checking with a Version past 3 (the
/// E6 page gives no parameters; without the check the call returns NULL).
pub(super) const UNKNOWN_DEVICE_DESCRIPTION_VERSION: u64 = 0x25;

/// A driver-built list: how its routine is called and how much room the driver gave it.
pub struct ListRequest {
    pub device: PDEVICE_OBJECT,
    pub mdl: PMDL,
    pub va: PVOID,
    pub length: u32,
    pub flags: u32,
    /// None only with DMA_SYNCHRONOUS_CALLBACK: the driver takes the list from the call.
    pub routine: Option<PDRIVER_LIST_CONTROL>,
    pub write_to_device: bool,
    /// The bytes of the driver's ScatterGatherBuffer (u32::MAX where the loader allocates the list).
    pub buffer_length: u32,
    /// GetScatterGatherListEx's IRQL, <= DISPATCH_LEVEL (its page); the Build routines need DISPATCH_LEVEL.
    pub up_to_dispatch: bool,
}

impl Adapter {
    /// Elements and map registers a transfer of `va..va+len` takes at most: one element per physically contiguous
    /// run cut to the maximum segment (a shadow, one run, never takes more), one register per page where the
    /// adapter pays for them.
    fn transfer_needs(&self, model: &NtModel, m: &Memory, va: u64, len: u32) -> Result<(u32, u32, u32), Refusal> {
        let r = m.region_of(va).ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
        if va + len as u64 > r.end() {
            return Err(Refusal::Status(STATUS_INVALID_PARAMETER));
        }
        let runs: Vec<DeviceRun> = sg_split::physical_runs(r, va, len, model.config.max_contiguous_pages)
            .into_iter()
            .map(|p| DeviceRun { va: p.va, len: p.len, iova: 0, pages: p.pages })
            .collect();
        let elements = sg_split::elements(&runs, self.max_segment).len() as u32;
        let pages = ADDRESS_AND_SIZE_TO_SPAN_PAGES(PVOID(va), len as u64) as u32;
        Ok((elements, self.pool_cost(pages), pages))
    }
}

/// Bytes a list of `elements` takes in the driver's buffer (the model keeps no data of its own there).
fn list_bytes(elements: u32) -> u32 {
    SCATTER_GATHER_LIST_HEADER_BYTES + elements * SCATTER_GATHER_ELEMENT_BYTES
}

impl NtModel {
    /// GetDmaAdapterInfo, IRQL <= DISPATCH_LEVEL (E6/0x13 under DMA checking). STATUS_NOT_SUPPORTED for a version
    /// other than DMA_ADAPTER_INFO_VERSION1, as its page says. The platform sets no limit of its own on a bus
    /// master's lists (ScatterGatherLimit all ones), has no DMA counter, and no minimum transfer unit (1).
    #[track_caller]
    pub fn get_dma_adapter_info(&self, adapter: PDMA_ADAPTER, version: u32) -> Result<DMA_ADAPTER_INFO_V1, NTSTATUS> {
        let _call = self.kernel_call("GetDmaAdapterInfo");
        let r = self.dma_irql_max(DISPATCH_LEVEL);
        self.ok(r);
        if version != DMA_ADAPTER_INFO_VERSION1 {
            return Err(STATUS_NOT_SUPPORTED);
        }
        let mut m = lock(&self.memory);
        let r = self.live_adapter(&mut m, adapter).map(|a| DMA_ADAPTER_INFO_V1 {
            ReadDmaCounterAvailable: 0,
            ScatterGatherLimit: u32::MAX,
            DmaAddressWidth: a.width,
            Flags: 0,
            MinimumTransferUnit: 1,
        });
        drop(m);
        self.refusal(r)
    }

    /// GetDmaTransferInfo, IRQL <= DISPATCH_LEVEL: what a list for `length` bytes at `offset` into the MDL's buffer
    /// needs. STATUS_NOT_SUPPORTED for an unknown version; STATUS_INVALID_PARAMETER outside the buffer (the page:
    /// Offset in 0..N-1, Length in 1..N-Offset).
    #[track_caller]
    pub fn get_dma_transfer_info(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        offset: u64,
        length: u32,
        version: u32,
    ) -> Result<DMA_TRANSFER_INFO_V2, NTSTATUS> {
        let _call = self.kernel_call("GetDmaTransferInfo");
        let r = self.dma_irql_max(DISPATCH_LEVEL);
        self.ok(r);
        if version != DMA_TRANSFER_INFO_VERSION1 && version != DMA_TRANSFER_INFO_VERSION2 {
            return Err(STATUS_NOT_SUPPORTED);
        }
        let mut m = lock(&self.memory);
        let r = (|| {
            let va = self.offset_in_mdl(&m, mdl, offset, length)?;
            let a = self.live_adapter(&mut m, adapter)?.clone();
            let (elements, registers, pages) = a.transfer_needs(self, &m, va.0, length)?;
            Ok(DMA_TRANSFER_INFO_V2 {
                MapRegisterCount: registers,
                ScatterGatherElementCount: elements,
                ScatterGatherListSize: list_bytes(elements),
                LogicalPageCount: pages,
            })
        })();
        drop(m);
        self.refusal(r)
    }

    /// The address `offset` bytes into the MDL's buffer, for a transfer of `length` bytes that must fit in it.
    fn offset_in_mdl(&self, m: &Memory, mdl: PMDL, offset: u64, length: u32) -> Result<PVOID, Refusal> {
        let d = m.mdls.get(&mdl.0).ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
        let fits = offset < d.len as u64 && length >= 1 && length as u64 <= d.len as u64 - offset;
        if !fits {
            return Err(Refusal::Status(STATUS_INVALID_PARAMETER));
        }
        Ok(PVOID(d.va + offset))
    }

    /// AllocateCommonBufferEx, PASSIVE_LEVEL (E6/0x13 under DMA checking, as AllocateCommonBuffer): a common
    /// buffer whose logical address lies below `maximum_address` (and below what the device reaches), else NULL,
    /// as the page says. The buffer is placed below the limit (`device_address`); where nothing is left there, or
    /// the placement ends past it, NULL.
    #[track_caller]
    pub fn allocate_common_buffer_ex(
        &self,
        adapter: PDMA_ADAPTER,
        maximum_address: Option<PHYSICAL_ADDRESS>,
        length: u32,
        logical_address: &mut PHYSICAL_ADDRESS,
    ) -> PVOID {
        let _call = self.kernel_call("AllocateCommonBufferEx");
        let maximum = maximum_address.map(|a| a.0.saturating_add(1));
        let r = self.allocate_common_buffer_below(adapter, length, maximum);
        let (va, logical) = self.ok(r);
        if va.is_null() {
            return va;
        }
        let reach = lock(&self.memory).dma.adapters.get(&adapter.0).and_then(|a| a.reach);
        let limit = [maximum, reach].into_iter().flatten().min();
        let end = logical + (length as u64).div_ceil(PAGE) * PAGE;
        if limit.is_some_and(|limit| end > limit) {
            let r = self.free_common_buffer(adapter, va);
            self.ok(r);
            return PVOID::NULL;
        }
        *logical_address = PHYSICAL_ADDRESS(logical);
        va
    }

    /// CalculateScatterGatherList (version 2), any IRQL: the list's bytes and map registers for `length` bytes at
    /// `va`. With the MDL, what the list will take (GetDmaTransferInfo's count); without it the most it may take,
    /// a page per element, as the page says ("the maximum possible size"). STATUS_BUFFER_TOO_SMALL when the MDL's
    /// buffer does not hold the transfer, STATUS_INSUFFICIENT_RESOURCES past the registers IoGetDmaAdapter granted.
    #[track_caller]
    pub fn calculate_scatter_gather_list(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: Option<PMDL>,
        va: PVOID,
        length: u32,
    ) -> Result<(u32, u32), NTSTATUS> {
        let _call = self.kernel_call("CalculateScatterGatherList");
        let mut m = lock(&self.memory);
        let r = (|| {
            let a = self.live_adapter(&mut m, adapter)?.clone();
            let elements = match mdl {
                Some(mdl) => {
                    let d = m.mdls.get(&mdl.0).ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
                    let inside = va.0 >= d.va && va.0.saturating_add(length as u64) <= d.va + d.len as u64;
                    if !inside {
                        return Err(Refusal::Status(STATUS_BUFFER_TOO_SMALL));
                    }
                    a.transfer_needs(self, &m, va.0, length)?.0
                }
                None => {
                    let end = va.0.saturating_add(length as u64);
                    let pages = (va.0 / PAGE..end.div_ceil(PAGE)).map(|p| {
                        let (from, to) = ((p * PAGE).max(va.0), ((p + 1) * PAGE).min(end));
                        DeviceRun { va: from, len: (to - from) as u32, iova: 0, pages: 1 }
                    });
                    sg_split::elements(&pages.collect::<Vec<_>>(), a.max_segment).len() as u32
                }
            };
            let registers = a.pool_cost(ADDRESS_AND_SIZE_TO_SPAN_PAGES(va, length as u64) as u32);
            if registers > a.granted {
                return Err(Refusal::Status(STATUS_INSUFFICIENT_RESOURCES));
            }
            Ok((list_bytes(elements), registers))
        })();
        drop(m);
        self.refusal(r)
    }

    /// GetDmaAlignment: the model's adapters need no alignment of a buffer's start (1 byte).
    #[track_caller]
    pub fn get_dma_alignment(&self, _adapter: PDMA_ADAPTER) -> u32 {
        let _call = self.kernel_call("GetDmaAlignment");
        1
    }

    /// BuildScatterGatherList and BuildScatterGatherListEx, DISPATCH_LEVEL (E6/0x13 under DMA checking): a list
    /// into the driver's buffer of `buffer_length` bytes, STATUS_BUFFER_TOO_SMALL when it cannot hold the most
    /// elements the transfer may take (GetDmaTransferInfo's ScatterGatherListSize). Without DMA_SYNCHRONOUS_CALLBACK
    /// the routine is required and may wait for map registers as GetScatterGatherList's does (`queued_list`); with
    /// it, registers short now is STATUS_INSUFFICIENT_RESOURCES, and a call without a routine gets the list back
    /// (Ok(Some)). A routine that ran or will run is Ok(None).
    #[track_caller]
    pub fn build_scatter_gather_list(
        &self,
        adapter: PDMA_ADAPTER,
        request: ListRequest,
    ) -> Result<Option<SCATTER_GATHER_LIST>, NTSTATUS> {
        let _call = self.kernel_call("BuildScatterGatherListEx");
        let r = if request.up_to_dispatch {
            self.dma_irql_max(DISPATCH_LEVEL)
        } else {
            self.dma_irql_exact(DISPATCH_LEVEL)
        };
        self.ok(r);
        let synchronous = request.flags & DMA_SYNCHRONOUS_CALLBACK != 0;
        if request.routine.is_none() && !synchronous {
            return Err(STATUS_INVALID_PARAMETER);
        }
        self.watched_access(Watched::Mdl(request.mdl.0), Access::Read);
        self.hb_release(SyncObject::AdapterQueue(adapter.0));
        let checking = self.dma_checking();
        let mut m = lock(&self.memory);
        let r = (|| {
            let ListRequest { device, mdl, va, length, routine, write_to_device, buffer_length, .. } = request;
            let at_call = m.mdls.get(&mdl.0).cloned().ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
            let a = self.live_adapter(&mut m, adapter)?.clone();
            let (elements, registers, _) = a.transfer_needs(self, &m, va.0, length)?;
            if buffer_length < list_bytes(elements) {
                return Err(Refusal::Status(STATUS_BUFFER_TOO_SMALL));
            }
            if registers > a.granted {
                if checking {
                    let b =
                        crate::Bugcheck::e6(e6::TOO_MANY_MAP_REGISTERS_AT_ONCE, registers as u64, a.granted as u64, 0);
                    self.found(b)?;
                }
                return Err(Refusal::Status(STATUS_INSUFFICIENT_RESOURCES));
            }
            let queue_empty = m.dma.waiting.get(&adapter.0).is_none_or(|q| q.is_empty());
            let Some(routine) = routine else {
                if !queue_empty || a.pool_free < registers {
                    return Err(Refusal::Status(STATUS_INSUFFICIENT_RESOURCES));
                }
                return self.build_list(&mut m, adapter, mdl, va, length, write_to_device).map(|l| (Some(l), None));
            };
            let ready_now = queue_empty && a.pool_free >= registers;
            if synchronous && !ready_now {
                return Err(Refusal::Status(STATUS_INSUFFICIENT_RESOURCES));
            }
            let waiting = Waiting::List { device, mdl, va, length, write_to_device, routine, at_call };
            let Some(waiting) = m.dma.run_now_or_queue(adapter.0, waiting) else { return Ok((None, None)) };
            let Waiting::List { routine, .. } = waiting else { unreachable!("built as a list above") };
            let list = self.build_list(&mut m, adapter, mdl, va, length, write_to_device)?;
            Ok((Some(list), Some((device, routine))))
        })();
        drop(m);
        match self.refusal(r)? {
            (Some(list), Some((device, routine))) => {
                self.at_dispatch(|| routine(device, &list));
                Ok(None)
            }
            (list, _) => Ok(list),
        }
    }
}
