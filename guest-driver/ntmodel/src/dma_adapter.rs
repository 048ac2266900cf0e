//! The DMA adapter: common buffers, scatter/gather lists, adapter channels and map registers, MapTransfer, and
//! the verifier's DMA checking (double buffering with padding, IRQL, leaks, double frees, overlapping maps).
//! Execution routines (AdapterControl, AdapterListControl) run at DISPATCH_LEVEL, at once when the channel and map
//! registers are free, else from the adapter's wait queue when a put or free gives registers back.

mod device_address;
mod dma_v3;
mod queued_list;

pub use dma_v3::ListRequest;

use std::collections::{HashMap, HashSet, VecDeque};

use vhca_ntapi::*;

use crate::address_width;
use crate::bugcheck::Bugcheck;
use crate::interleaving::{Access, SyncObject, Watched};
use crate::low_resources::{Failure, FaultableRoutine};
use crate::mdl::Mdl;
use crate::memory::{Memory, RegionKind};
use crate::sg_split::{self, DeviceRun};
use crate::verifier::{c4, e6, VerifierFlags};
use crate::{lock, HostMemId, NtModel, PAGE};

/// The fill the verifier puts around a double-buffered transfer; a changed byte is an overrun (0xE6/0x0F).
const PADDING: u8 = 0x0F;

/// How one buffer is visible to the device: its own pages, or (under DMA checking) a shadow copy.
#[derive(Debug, Clone)]
pub(crate) struct Mapping {
    pub va: u64,
    pub len: u32,
    /// The ranges the device was given: one per physically contiguous run of the buffer's own pages, or the
    /// shadow's one.
    pub runs: Vec<DeviceRun>,
    pub shadow: Option<HostMemId>,
    /// The shadow is the verifier's: its padding is checked when the mapping ends (a bounce for a narrow device's
    /// reach has no such rule).
    pub padded: bool,
    /// The runs are the identity domain's (no DMA remapping, `device_address`): they outlive the transfer.
    pub identity: bool,
}

impl Mapping {
    pub fn logical(&self) -> u64 {
        self.runs.first().map_or(0, DeviceRun::logical)
    }

    /// Pages the device was given: what a mapping through map registers costs.
    pub fn pages(&self) -> usize {
        self.runs.iter().map(|r| r.pages).sum()
    }

    fn unmap(&self, backend: &dyn crate::DmaBackend) {
        if self.identity {
            return;
        }
        for r in &self.runs {
            let _ = backend.unmap(r.iova, r.pages);
        }
    }
}

/// What a buffer is mapped for, which decides the checks and how its runs reach the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MapFor {
    /// GetScatterGatherList: one element per physically contiguous run.
    List,
    /// MapTransfer: the first run only; the driver learns from Length how much was mapped and maps the rest next.
    Transfer,
    /// IoMapCommonBuffer: one logical range (CreateCommonBufferFromMdl hands back one logical address), never
    /// double-buffered, without DMA checking's map-time rules.
    CommonBuffer,
}

#[derive(Debug, Clone)]
pub(crate) struct CommonBuffer {
    pub logical: u64,
    pub pages: usize,
    /// Mapped by the identity domain, which keeps it until the memory goes.
    pub identity: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct Transfer {
    pub mdl: u64,
    pub write_to_device: bool,
    pub mapping: Mapping,
}

#[derive(Debug, Clone)]
pub(crate) struct MapRegisterSet {
    pub adapter: u64,
    /// Registers the driver asked for: what MapTransfer may use.
    pub count: u32,
    /// Registers taken from the adapter's pool: `count` where the adapter needs map registers, else 0.
    pub from_pool: u32,
    pub used: u32,
    /// Taken with KeepObject: they go back with FreeAdapterChannel.
    pub with_channel: bool,
    pub transfers: Vec<Transfer>,
}

#[derive(Debug, Clone)]
pub(crate) struct SgList {
    pub adapter: u64,
    pub write_to_device: bool,
    pub mapping: Mapping,
    /// Map registers the list holds from the adapter's pool (0 where the adapter needs none).
    pub from_pool: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct Adapter {
    pub addr: u64,
    /// The per-request maximum IoGetDmaAdapter returned in NumberOfMapRegisters.
    pub granted: u32,
    /// The longest scatter/gather element the device takes: DEVICE_DESCRIPTION's MaximumLength (`sg_split`).
    pub max_segment: Option<u32>,
    /// The device's address width in bits and the first device address it cannot reach (`address_width`); None:
    /// 64 bits.
    pub width: u32,
    pub reach: Option<u64>,
    /// Whether transfers cost map registers: under DMA checking (the verifier double-buffers through map
    /// registers) or for an adapter narrower than 64 bits (`address_width`), whose transfers bounce where its
    /// buffer's pages are out of its reach. A 64-bit scatter/gather bus master needs none
    /// (the model has no DMA remapping of its own: the platform's IOMMU is VFIO's, below the model).
    pub needs_map_registers: bool,
    pub pool_free: u32,
    pub released: bool,
    pub common: HashMap<u64, CommonBuffer>,
    pub common_maps: HashMap<u64, Mapping>,
    pub channel_held: bool,
    pub registers_out: u32,
    pub sg_allocated: u64,
    pub sg_freed: u64,
    pub sg_out: HashSet<u64>,
}

impl Adapter {
    /// 0xE6/0x07..0x0A: what must be given back before the adapter goes.
    pub fn outstanding_check(&self, model: &NtModel) -> Result<(), Bugcheck> {
        let common = (self.common.len() + self.common_maps.len()) as u64;
        if common > 0 {
            model.found(Bugcheck::e6(e6::OUTSTANDING_COMMON_BUFFERS, self.addr, common, 0))?;
        }
        if self.channel_held {
            model.found(Bugcheck::e6(e6::OUTSTANDING_ADAPTER_CHANNELS, self.addr, 1, 0))?;
        }
        if self.registers_out > 0 {
            model.found(Bugcheck::e6(e6::OUTSTANDING_MAP_REGISTERS, self.addr, self.registers_out as u64, 0))?;
        }
        if !self.sg_out.is_empty() {
            model.found(Bugcheck::e6(e6::OUTSTANDING_SG_LISTS, self.addr, self.sg_out.len() as u64, 0))?;
        }
        Ok(())
    }
}

/// A request whose execution routine waits for the channel or for map registers.
enum Waiting {
    Channel {
        device: PDEVICE_OBJECT,
        registers: u32,
        routine: PDRIVER_CONTROL,
    },
    List {
        device: PDEVICE_OBJECT,
        mdl: PMDL,
        va: PVOID,
        length: u32,
        write_to_device: bool,
        routine: PDRIVER_LIST_CONTROL,
        /// The MDL as the call saw it (`queued_list`).
        at_call: Mdl,
    },
}

impl Waiting {
    /// Whether the adapter can serve it now.
    fn ready(&self, a: &Adapter) -> bool {
        match self {
            Waiting::Channel { registers, .. } => !a.channel_held && a.pool_free >= a.pool_cost(*registers),
            Waiting::List { va, length, .. } => {
                a.pool_free >= a.pool_cost(ADDRESS_AND_SIZE_TO_SPAN_PAGES(*va, *length as u64) as u32)
            }
        }
    }
}

impl Adapter {
    /// Registers a request of `registers` takes from the pool.
    fn pool_cost(&self, registers: u32) -> u32 {
        if self.needs_map_registers {
            registers
        } else {
            0
        }
    }
}

#[derive(Default)]
pub(crate) struct DmaState {
    pub adapters: HashMap<u64, Adapter>,
    pub sg_lists: HashMap<u64, SgList>,
    pub register_sets: HashMap<u64, MapRegisterSet>,
    /// Per adapter, execution routines waiting in the order they were queued.
    waiting: HashMap<u64, VecDeque<Waiting>>,
    /// The physical frames and the device domain's shape (`device_address`).
    pub layout: device_address::PhysicalLayout,
}

impl DmaState {
    /// The request back when the adapter can serve it now (nothing queued before it, resources free); else it
    /// joins the adapter's wait queue.
    fn run_now_or_queue(&mut self, adapter: u64, waiting: Waiting) -> Option<Waiting> {
        let queue = self.waiting.entry(adapter).or_default();
        match self.adapters.get(&adapter) {
            Some(a) if queue.is_empty() && waiting.ready(a) => Some(waiting),
            _ => {
                queue.push_back(waiting);
                None
            }
        }
    }

    /// Every buffer range the verifier currently double-buffers: (va start, va end).
    fn shadowed_ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let sg = self.sg_lists.values().map(|l| &l.mapping);
        let tr = self.register_sets.values().flat_map(|s| s.transfers.iter().map(|t| &t.mapping));
        sg.chain(tr).map(|m| (m.va, m.va + m.len as u64))
    }
}

/// A violation found, or a clean failure status for the driver.
enum Refusal {
    Stop(Bugcheck),
    Status(NTSTATUS),
}

impl From<Bugcheck> for Refusal {
    fn from(b: Bugcheck) -> Refusal {
        Refusal::Stop(b)
    }
}

impl NtModel {
    fn dma_checking(&self) -> bool {
        self.checks(VerifierFlags::DMA_CHECKING)
    }

    /// 0xE6/0x13: the routine needs exactly `expected`.
    fn dma_irql_exact(&self, expected: KIRQL) -> Result<(), Bugcheck> {
        let irql = self.irql();
        if self.dma_checking() && irql != expected {
            self.found(Bugcheck::e6(e6::IMPROPER_IRQL, e6::IRQL_NOT_EXPECTED, expected as u64, irql as u64))?;
        }
        Ok(())
    }

    /// 0xE6/0x13: the routine runs at `max` or below.
    fn dma_irql_max(&self, max: KIRQL) -> Result<(), Bugcheck> {
        let irql = self.irql();
        if self.dma_checking() && irql > max {
            self.found(Bugcheck::e6(e6::IMPROPER_IRQL, e6::IRQL_ABOVE_MAXIMUM, max as u64, irql as u64))?;
        }
        Ok(())
    }

    /// PASSIVE_LEVEL routines of the DMA_OPERATIONS table. The driver reaches them through the adapter, not by an
    /// import, so IRQL checking's thunks (0xC4/0xE5) never see the call: only DMA checking does (0xE6/0x13).
    fn passive_dma_routine(&self) -> Result<(), Bugcheck> {
        self.dma_irql_exact(PASSIVE_LEVEL)
    }

    /// Calls an execution routine as Windows does, at DISPATCH_LEVEL, then puts the thread's IRQL back.
    fn at_dispatch<T>(&self, f: impl FnOnce() -> T) -> T {
        let old = self.irql();
        self.set_irql(DISPATCH_LEVEL);
        let r = f();
        self.set_irql(old);
        r
    }

    fn live_adapter<'m>(&self, m: &'m mut Memory, adapter: PDMA_ADAPTER) -> Result<&'m mut Adapter, Refusal> {
        let checking = self.dma_checking();
        match m.dma.adapters.get_mut(&adapter.0) {
            Some(a) if !a.released => Ok(a),
            Some(_) if checking && self.enforced(&Bugcheck::e6(e6::ADAPTER_ALREADY_RELEASED, adapter.0, 0, 0)) => {
                Err(Bugcheck::e6(e6::ADAPTER_ALREADY_RELEASED, adapter.0, 0, 0).into())
            }
            _ => Err(Refusal::Status(STATUS_INVALID_PARAMETER)),
        }
    }

    /// Makes `va..va+len` (inside `mdl`) visible to a device that reaches addresses below `reach`. Under DMA
    /// checking, and where its own pages are out of the device's reach, the device gets a shadow (`map_shadow`).
    #[allow(clippy::too_many_arguments)]
    fn map_buffer(
        &self,
        m: &mut Memory,
        mdl: u64,
        va: u64,
        len: u32,
        map_for: MapFor,
        reach: Option<u64>,
    ) -> Result<Mapping, Refusal> {
        let d = m.mdls.get(&mdl).cloned().ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
        let end = va.checked_add(len as u64).ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
        let checking = self.dma_checking() && map_for != MapFor::CommonBuffer;
        if checking && len == 0 {
            self.found(Bugcheck::e6(e6::ZERO_LENGTH_MAP, 0, 0, 0))?;
        }
        if len == 0 || va < d.va || end > d.va + d.len as u64 {
            return Err(Refusal::Status(STATUS_INVALID_PARAMETER));
        }
        if checking && !d.dma_safe() {
            self.found(Bugcheck::e6(e6::PAGED_MEMORY, mdl, 0, 0))?;
        }
        if checking {
            if let Some((s, e)) = m.dma.shadowed_ranges().find(|(s, e)| *s < end && va < *e) {
                self.found(Bugcheck::e6(e6::ALREADY_MAPPED, va, end, s.max(va).min(e - 1)))?;
            }
        }
        let pages = ADDRESS_AND_SIZE_TO_SPAN_PAGES(PVOID(va), len as u64) as usize;
        let verifier_shadow = checking && self.config.double_buffering;
        if !verifier_shadow {
            let own = self.map_own_pages(m, va, len, pages, map_for)?;
            if map_for == MapFor::CommonBuffer || address_width::within_reach(&own.runs, reach) {
                return Ok(own);
            }
            // The device cannot reach the buffer's pages: the HAL copies the transfer through map registers (one
            // bounce per page, the adapter's pool paying for them, the bounce pages below the device's limit), as
            // the verifier's double buffering does but without its padding rules.
            own.unmap(self.backend());
        }
        self.map_shadow(m, va, len, pages, verifier_shadow, reach)
    }

    /// The device gets a shadow: fresh pages filled with PADDING and the buffer's bytes copied in at the same page
    /// offset, at an address the device reaches. `padded`: the verifier's, whose padding is checked at put/flush.
    fn map_shadow(
        &self,
        m: &mut Memory,
        va: u64,
        len: u32,
        pages: usize,
        padded: bool,
        reach: Option<u64>,
    ) -> Result<Mapping, Refusal> {
        let backend = self.backend();
        let no_memory = |_| Refusal::Status(STATUS_INSUFFICIENT_RESOURCES);
        let shadow = backend.alloc(pages).map_err(no_memory)?;
        let mut image = vec![PADDING; pages * PAGE as usize];
        let off = (va % PAGE) as usize;
        if m.copy_from(backend, va, &mut image[off..off + len as usize]).is_err() {
            let _ = backend.free(shadow);
            return Err(Refusal::Status(STATUS_INVALID_PARAMETER));
        }
        let layout = &mut m.dma.layout;
        let mapped =
            backend.write(shadow, 0, &image).and_then(|()| self.map_bounce_for_device(layout, shadow, pages, reach));
        let Ok(at) = mapped else {
            let _ = backend.free(shadow);
            layout.forget(shadow);
            return Err(Refusal::Status(STATUS_INSUFFICIENT_RESOURCES));
        };
        let runs = vec![DeviceRun { va, len, iova: at.iova, pages }];
        Ok(Mapping { va, len, runs, shadow: Some(shadow), padded, identity: at.identity })
    }

    /// The device gets the buffer's own pages, which must lie in one region, each physically contiguous run at an
    /// address of its own (`sg_split`); MapTransfer takes the first run, a common-buffer mapping one range.
    fn map_own_pages(
        &self,
        m: &mut Memory,
        va: u64,
        len: u32,
        pages: usize,
        map_for: MapFor,
    ) -> Result<Mapping, Refusal> {
        let backend = self.backend();
        let r = m.region_of(va).cloned().ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
        if va + len as u64 > r.end() {
            return Err(Refusal::Status(STATUS_INVALID_PARAMETER));
        }
        let mut physical = sg_split::physical_runs(&r, va, len, self.config.max_contiguous_pages);
        match map_for {
            MapFor::List => {}
            MapFor::Transfer => physical.truncate(1),
            // CreateCommonBufferFromMdl's page: "If DMA remapping is not being used, the MDL must represent
            // physically contiguous memory" (STATUS_INVALID_PARAMETER, "an incompatible MDL"). Under remapping the
            // domain gives the pages one logical range whatever their frames; without it the range would be the
            // first frame onwards, across the holes between runs, where the buffer's later pages are not.
            MapFor::CommonBuffer if m.dma.layout.without_remapping && physical.len() > 1 => {
                return Err(Refusal::Status(STATUS_INVALID_PARAMETER));
            }
            MapFor::CommonBuffer => {
                let first_page = ((va - r.base) / PAGE) as usize;
                physical = vec![sg_split::PhysicalRun { va, len, first_page, pages }];
            }
        }
        let layout = &mut m.dma.layout;
        let identity = layout.without_remapping;
        let mut runs = Vec::with_capacity(physical.len());
        for p in physical {
            match self.map_region_for_device(layout, &r, p.first_page, p.pages, device_address::Placement::Anywhere) {
                Ok(at) => runs.push(DeviceRun { va: p.va, len: p.len, iova: at.iova, pages: p.pages }),
                Err(_) => {
                    Mapping { va, len, runs, shadow: None, padded: false, identity }.unmap(backend);
                    return Err(Refusal::Status(STATUS_INSUFFICIENT_RESOURCES));
                }
            }
        }
        let len = runs.iter().map(|r| r.len).sum();
        Ok(Mapping { va, len, runs, shadow: None, padded: false, identity })
    }

    /// Takes the device's view away. A shadow is checked for overruns and, for device-to-memory transfers,
    /// copied back: the moment the CPU first sees what the device wrote.
    fn unmap_buffer(&self, m: &mut Memory, mapping: &Mapping, copy_back: bool) -> Result<(), Bugcheck> {
        let backend = self.backend();
        mapping.unmap(backend);
        let Some(shadow) = mapping.shadow else { return Ok(()) };
        let mut image = vec![0u8; mapping.pages() * PAGE as usize];
        let read = backend.read(shadow, 0, &mut image);
        let _ = backend.free(shadow);
        m.dma.layout.forget(shadow);
        if read.is_err() {
            return Ok(());
        }
        let off = (mapping.va % PAGE) as usize;
        let end = off + mapping.len as usize;
        if !mapping.padded {
            if copy_back {
                let _ = m.copy_to(backend, mapping.va, &image[off..end]);
            }
            return Ok(());
        }
        if let Some(i) = image[..off].iter().position(|b| *b != PADDING) {
            let at = mapping.va - (off - i) as u64;
            self.found(Bugcheck::e6(e6::OVERRUN, e6::OVERRUN_PADDING_BEFORE, mapping.va, at))?;
        }
        if let Some(i) = image[end..].iter().position(|b| *b != PADDING) {
            let at = mapping.va + mapping.len as u64 + i as u64;
            self.found(Bugcheck::e6(e6::OVERRUN, e6::OVERRUN_PADDING_AFTER, mapping.va, at))?;
        }
        if copy_back {
            let _ = m.copy_to(backend, mapping.va, &image[off..end]);
        }
        Ok(())
    }

    fn refusal<T>(&self, r: Result<T, Refusal>) -> Result<T, NTSTATUS> {
        match r {
            Ok(v) => Ok(v),
            Err(Refusal::Status(s)) => Err(s),
            Err(Refusal::Stop(b)) => self.raise(b),
        }
    }

    pub(crate) fn get_dma_adapter(&self, desc: &DEVICE_DESCRIPTION, n: &mut u32) -> PDMA_ADAPTER {
        let irql = self.irql();
        // A DDI compliance rule (IrqlIoPassive5 "Run Driver Verifier and select the DDI compliance checking option"),
        // not IRQL checking's.
        if self.checks(VerifierFlags::DDI_COMPLIANCE) && irql != PASSIVE_LEVEL {
            self.violation(Bugcheck::c4(c4::RULE_IRQL_IO_PASSIVE5, 0, 0, 0));
        }
        if desc.Version > DEVICE_DESCRIPTION_VERSION3 && self.dma_checking() {
            self.violation(Bugcheck::e6(dma_v3::UNKNOWN_DEVICE_DESCRIPTION_VERSION, 0, 0, 0));
        }
        if desc.Version > DEVICE_DESCRIPTION_VERSION3 || !desc.Master {
            return PDMA_ADAPTER::NULL;
        }
        // Windows asks for enough registers for the largest transfer plus one for an unaligned start.
        let wanted = (desc.MaximumLength as u64).div_ceil(PAGE) as u32 + 1;
        let granted = wanted.min(self.config.map_registers);
        *n = granted;
        let width = address_width::address_width(desc);
        let reach = address_width::reach(width);
        let addr = self.new_object();
        let adapter = Adapter {
            addr,
            granted,
            max_segment: Some(desc.MaximumLength).filter(|n| *n > 0),
            width,
            reach,
            needs_map_registers: (self.dma_checking() && self.config.double_buffering) || reach.is_some(),
            pool_free: self.config.map_registers,
            released: false,
            common: HashMap::new(),
            common_maps: HashMap::new(),
            channel_held: false,
            registers_out: 0,
            sg_allocated: 0,
            sg_freed: 0,
            sg_out: HashSet::new(),
        };
        lock(&self.memory).dma.adapters.insert(addr, adapter);
        PDMA_ADAPTER(addr)
    }

    pub(crate) fn put_dma_adapter(&self, adapter: PDMA_ADAPTER) -> Result<(), Bugcheck> {
        let irql = self.irql();
        if self.dma_checking() && irql != PASSIVE_LEVEL {
            self.found(Bugcheck::e6(e6::IMPROPER_IRQL_OTHER, 0, 0, 0))?;
        }
        let mut m = lock(&self.memory);
        let checking = self.dma_checking();
        let Some(a) = m.dma.adapters.get_mut(&adapter.0) else { return Ok(()) };
        if a.released {
            return if checking {
                self.found(Bugcheck::e6(e6::ADAPTER_ALREADY_RELEASED, adapter.0, 0, 0))
            } else {
                Ok(())
            };
        }
        if checking {
            a.outstanding_check(self)?;
        }
        a.released = true;
        Ok(())
    }

    pub(crate) fn allocate_common_buffer(&self, adapter: PDMA_ADAPTER, length: u32) -> Result<(PVOID, u64), Bugcheck> {
        self.allocate_common_buffer_below(adapter, length, None)
    }

    /// A common buffer the device reaches, its logical range ending at or below `limit` too where given
    /// (AllocateCommonBufferEx's maximum address).
    fn allocate_common_buffer_below(
        &self,
        adapter: PDMA_ADAPTER,
        length: u32,
        limit: Option<u64>,
    ) -> Result<(PVOID, u64), Bugcheck> {
        self.passive_dma_routine()?;
        if length == 0 {
            return Ok((PVOID::NULL, 0));
        }
        {
            let mut m = lock(&self.memory);
            if let Err(Refusal::Stop(b)) = self.live_adapter(&mut m, adapter).map(|_| ()) {
                return Err(b);
            }
        }
        if self.inject(FaultableRoutine::AllocateCommonBuffer, None).is_some() {
            return Ok((PVOID::NULL, 0));
        }
        let Some(va) = self.alloc_region(length as u64, RegionKind::CommonBuffer, 0, 0) else {
            return Ok((PVOID::NULL, 0));
        };
        let mut m = lock(&self.memory);
        let Some(r) = m.regions.get(&va).cloned() else { return Ok((PVOID::NULL, 0)) };
        // Windows allocates a common buffer the device reaches: below a narrow device's limit.
        let reach = m.dma.adapters.get(&adapter.0).and_then(|a| a.reach);
        let placement = device_address::Placement::within([reach, limit].into_iter().flatten().min());
        let Ok(at) = self.map_region_for_device(&mut m.dma.layout, &r, 0, r.pages, placement) else {
            self.free_region(&mut m, va);
            return Ok((PVOID::NULL, 0));
        };
        let iova = at.iova;
        if let Ok(a) = self.live_adapter(&mut m, adapter) {
            a.common.insert(va, CommonBuffer { logical: iova, pages: r.pages, identity: at.identity });
        }
        drop(m);
        self.watched_access(Watched::CommonBuffer(va), Access::Write);
        Ok((PVOID(va), iova))
    }

    pub(crate) fn free_common_buffer(&self, adapter: PDMA_ADAPTER, va: PVOID) -> Result<(), Bugcheck> {
        self.passive_dma_routine()?;
        // The bookkeeping and the bytes (a ring, a CQ) both end here: a DPC still polling one races with this.
        self.watched_access(Watched::CommonBuffer(va.0), Access::Free);
        self.watch_block_free(va.0);
        let checking = self.dma_checking();
        let mut m = lock(&self.memory);
        let a = match self.live_adapter(&mut m, adapter) {
            Ok(a) => a,
            Err(Refusal::Stop(b)) => return Err(b),
            Err(Refusal::Status(_)) => return Ok(()),
        };
        let Some(cb) = a.common.remove(&va.0) else {
            return if checking {
                self.found(Bugcheck::e6(e6::TOO_MANY_COMMON_BUFFERS_FREED, 1, 0, 0))
            } else {
                Ok(())
            };
        };
        if !cb.identity {
            let _ = self.backend().unmap(cb.logical, cb.pages);
        }
        if let Some(r) = self.free_region(&mut m, va.0) {
            m.dma.layout.forget(r.mem);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn get_scatter_gather_list(
        &self,
        adapter: PDMA_ADAPTER,
        device: PDEVICE_OBJECT,
        mdl: PMDL,
        va: PVOID,
        length: u32,
        routine: PDRIVER_LIST_CONTROL,
        write_to_device: bool,
    ) -> NTSTATUS {
        let r = self.dma_irql_exact(DISPATCH_LEVEL);
        self.ok(r);
        if let Some(Failure::Status(status)) = self.inject(FaultableRoutine::GetScatterGatherList, None) {
            return status;
        }
        self.watched_access(Watched::Mdl(mdl.0), Access::Read);
        self.hb_release(SyncObject::AdapterQueue(adapter.0));
        let checking = self.dma_checking();
        let mut m = lock(&self.memory);
        let r = (|| {
            let a = self.live_adapter(&mut m, adapter)?;
            let registers = ADDRESS_AND_SIZE_TO_SPAN_PAGES(va, length as u64) as u32;
            if a.pool_cost(registers) > a.granted {
                if checking {
                    self.found(Bugcheck::e6(
                        e6::TOO_MANY_MAP_REGISTERS_AT_ONCE,
                        registers as u64,
                        a.granted as u64,
                        0,
                    ))?;
                }
                return Err(Refusal::Status(STATUS_INSUFFICIENT_RESOURCES));
            }
            let at_call = m.mdls.get(&mdl.0).cloned().ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
            let waiting = Waiting::List { device, mdl, va, length, write_to_device, routine, at_call };
            let Some(waiting) = m.dma.run_now_or_queue(adapter.0, waiting) else { return Ok(None) };
            let Waiting::List { routine, .. } = waiting else { unreachable!("built as a list above") };
            let list = self.build_list(&mut m, adapter, mdl, va, length, write_to_device)?;
            Ok(Some((list, routine)))
        })();
        drop(m);
        match self.refusal(r) {
            Ok(Some((list, routine))) => {
                self.watched_access(Watched::SgList(list.Handle.0), Access::Write);
                self.at_dispatch(|| routine(device, &list));
                STATUS_SUCCESS
            }
            Ok(None) => STATUS_SUCCESS,
            Err(status) => status,
        }
    }

    /// Maps the buffer for the device and records the list; the caller hands it to AdapterListControl.
    fn build_list(
        &self,
        m: &mut Memory,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        va: PVOID,
        length: u32,
        write_to_device: bool,
    ) -> Result<SCATTER_GATHER_LIST, Refusal> {
        let handle = self.new_object();
        let reach = m.dma.adapters.get(&adapter.0).and_then(|a| a.reach);
        let mapping = self.map_buffer(m, mdl.0, va.0, length, MapFor::List, reach)?;
        let a = self.live_adapter(m, adapter)?;
        let from_pool = a.pool_cost(mapping.pages() as u32);
        a.pool_free -= from_pool;
        a.sg_allocated += 1;
        a.sg_out.insert(handle);
        let elements = sg_split::elements(&mapping.runs, a.max_segment);
        m.dma.sg_lists.insert(handle, SgList { adapter: adapter.0, write_to_device, mapping, from_pool });
        Ok(SCATTER_GATHER_LIST { Handle: PSCATTER_GATHER_LIST(handle), Elements: elements })
    }

    pub(crate) fn put_scatter_gather_list(
        &self,
        adapter: PDMA_ADAPTER,
        list: PSCATTER_GATHER_LIST,
    ) -> Result<(), Bugcheck> {
        self.dma_irql_exact(DISPATCH_LEVEL)?;
        self.watched_access(Watched::SgList(list.0), Access::Free);
        let checking = self.dma_checking();
        let mut m = lock(&self.memory);
        let Some(sg) = m.dma.sg_lists.remove(&list.0) else {
            if !checking {
                return Ok(());
            }
            let (allocated, freed) =
                m.dma.adapters.get(&adapter.0).map(|a| (a.sg_allocated, a.sg_freed)).unwrap_or((0, 0));
            return self.found(Bugcheck::e6(e6::TOO_MANY_SG_LISTS_FREED, allocated, freed + 1, 0));
        };
        if let Some(a) = m.dma.adapters.get_mut(&sg.adapter) {
            a.sg_freed += 1;
            a.sg_out.remove(&list.0);
            a.pool_free += sg.from_pool;
        }
        self.unmap_buffer(&mut m, &sg.mapping, !sg.write_to_device)?;
        drop(m);
        self.run_waiting(PDMA_ADAPTER(sg.adapter));
        Ok(())
    }

    pub(crate) fn allocate_adapter_channel(
        &self,
        adapter: PDMA_ADAPTER,
        device: PDEVICE_OBJECT,
        n: u32,
        routine: PDRIVER_CONTROL,
    ) -> NTSTATUS {
        let r = self.dma_irql_exact(DISPATCH_LEVEL);
        self.ok(r);
        self.watched_access(Watched::Adapter(adapter.0), Access::Write);
        self.hb_release(SyncObject::AdapterQueue(adapter.0));
        let checking = self.dma_checking();
        let mut m = lock(&self.memory);
        let r = (|| {
            let a = self.live_adapter(&mut m, adapter)?;
            if n > a.granted {
                if checking {
                    self.found(Bugcheck::e6(e6::TOO_MANY_MAP_REGISTERS_AT_ONCE, n as u64, a.granted as u64, 0))?;
                }
                return Err(Refusal::Status(STATUS_INSUFFICIENT_RESOURCES));
            }
            if a.channel_held && checking {
                self.found(Bugcheck::e6(e6::TOO_MANY_ADAPTER_CHANNELS, 1, 0, 0))?;
            }
            let waiting = Waiting::Channel { device, registers: n, routine };
            let Some(waiting) = m.dma.run_now_or_queue(adapter.0, waiting) else { return Ok(None) };
            let Waiting::Channel { routine, .. } = waiting else { unreachable!("built as a channel above") };
            Ok(Some((self.grant_channel(&mut m, adapter, n), routine)))
        })();
        drop(m);
        match self.refusal(r) {
            Ok(Some((base, routine))) => {
                self.run_channel_routine(adapter, device, base, routine);
                STATUS_SUCCESS
            }
            Ok(None) => STATUS_SUCCESS,
            Err(status) => status,
        }
    }

    /// Takes the channel and `n` registers (from the pool where the adapter needs them) for a routine about to run.
    fn grant_channel(&self, m: &mut Memory, adapter: PDMA_ADAPTER, n: u32) -> MAP_REGISTER_BASE {
        let base = self.new_object();
        let from_pool = match m.dma.adapters.get_mut(&adapter.0) {
            Some(a) => {
                let from_pool = a.pool_cost(n);
                a.channel_held = true;
                a.pool_free -= from_pool;
                a.registers_out += n;
                from_pool
            }
            None => 0,
        };
        let set = MapRegisterSet {
            adapter: adapter.0,
            count: n,
            from_pool,
            used: 0,
            with_channel: true,
            transfers: Vec::new(),
        };
        m.dma.register_sets.insert(base, set);
        MAP_REGISTER_BASE(base)
    }

    /// Runs AdapterControl at DISPATCH_LEVEL and does what its IO_ALLOCATION_ACTION asks.
    fn run_channel_routine(
        &self,
        adapter: PDMA_ADAPTER,
        device: PDEVICE_OBJECT,
        base: MAP_REGISTER_BASE,
        routine: PDRIVER_CONTROL,
    ) {
        let action = self.at_dispatch(|| routine(device, base));
        let mut m = lock(&self.memory);
        let keep_channel = action == IO_ALLOCATION_ACTION::KeepObject;
        if let Some(a) = m.dma.adapters.get_mut(&adapter.0) {
            a.channel_held = keep_channel;
        }
        if let Some(set) = m.dma.register_sets.get_mut(&base.0) {
            set.with_channel = keep_channel;
        }
        if action == IO_ALLOCATION_ACTION::DeallocateObject {
            let r = self.release_registers(&mut m, base.0);
            drop(m);
            self.ok(r);
        } else {
            drop(m);
        }
        if !keep_channel {
            self.run_waiting(adapter);
        }
    }

    /// Runs, in order, every waiting routine the adapter can now serve; stops at the first it cannot.
    fn run_waiting(&self, adapter: PDMA_ADAPTER) {
        loop {
            let mut m = lock(&self.memory);
            let Some(a) = m.dma.adapters.get(&adapter.0).filter(|a| !a.released).cloned() else { return };
            let Some(queue) = m.dma.waiting.get_mut(&adapter.0) else { return };
            if !queue.front().is_some_and(|w| w.ready(&a)) {
                return;
            }
            let Some(next) = queue.pop_front() else { return };
            match next {
                Waiting::Channel { device, registers, routine } => {
                    let base = self.grant_channel(&mut m, adapter, registers);
                    drop(m);
                    self.hb_acquire(SyncObject::AdapterQueue(adapter.0));
                    self.run_channel_routine(adapter, device, base, routine);
                }
                Waiting::List { device, mdl, va, length, write_to_device, routine, at_call } => {
                    // Checked when mapped, as at the call: a refusal now means the routine is never called.
                    let r = self.with_queued_mdl(&mut m, mdl, &at_call, |k, m| {
                        k.build_list(m, adapter, mdl, va, length, write_to_device)
                    });
                    drop(m);
                    if let Ok(Some(list)) = self.refusal(r.map(Some)) {
                        self.hb_acquire(SyncObject::AdapterQueue(adapter.0));
                        self.watched_access(Watched::SgList(list.Handle.0), Access::Write);
                        self.at_dispatch(|| routine(device, &list));
                    }
                }
            }
        }
    }

    /// Gives a register set back to its adapter's pool; under DMA checking, registers still mapped are 0x10.
    fn release_registers(&self, m: &mut Memory, base: u64) -> Result<(), Bugcheck> {
        let Some(set) = m.dma.register_sets.remove(&base) else { return Ok(()) };
        let mapped: u32 = set.transfers.iter().map(|t| t.mapping.pages() as u32).sum();
        let bugcheck = Bugcheck::e6(e6::FREED_WHILE_MAPPED, mapped as u64, 0, 0);
        if mapped > 0 && self.dma_checking() && self.enforced(&bugcheck) {
            m.dma.register_sets.insert(base, set);
            return Err(bugcheck);
        }
        for t in &set.transfers {
            t.mapping.unmap(self.backend());
            if let Some(s) = t.mapping.shadow {
                let _ = self.backend().free(s);
                m.dma.layout.forget(s);
            }
        }
        if let Some(a) = m.dma.adapters.get_mut(&set.adapter) {
            a.pool_free += set.from_pool;
            a.registers_out = a.registers_out.saturating_sub(set.count);
        }
        Ok(())
    }

    pub(crate) fn free_adapter_channel(&self, adapter: PDMA_ADAPTER) -> Result<(), Bugcheck> {
        self.dma_irql_exact(DISPATCH_LEVEL)?;
        self.watched_access(Watched::Adapter(adapter.0), Access::Write);
        let checking = self.dma_checking();
        let mut m = lock(&self.memory);
        let Some(a) = m.dma.adapters.get_mut(&adapter.0) else { return Ok(()) };
        if !a.channel_held {
            return if checking {
                self.found(Bugcheck::e6(e6::TOO_MANY_ADAPTER_CHANNELS_FREED, 1, 0, 0))
            } else {
                Ok(())
            };
        }
        let bases: Vec<u64> = m
            .dma
            .register_sets
            .iter()
            .filter(|(_, s)| s.adapter == adapter.0 && s.with_channel)
            .map(|(b, _)| *b)
            .collect();
        // Check every set before changing anything, so a refused free leaves the channel as it was.
        let mapped: usize = bases.iter().filter_map(|b| m.dma.register_sets.get(b)).map(|s| s.transfers.len()).sum();
        if mapped > 0 && checking {
            let pages: usize = bases
                .iter()
                .filter_map(|b| m.dma.register_sets.get(b))
                .flat_map(|s| s.transfers.iter().map(|t| t.mapping.pages()))
                .sum();
            self.found(Bugcheck::e6(e6::FREED_WHILE_MAPPED, pages as u64, 0, 0))?;
        }
        if let Some(a) = m.dma.adapters.get_mut(&adapter.0) {
            a.channel_held = false;
        }
        for b in bases {
            self.release_registers(&mut m, b)?;
        }
        drop(m);
        self.run_waiting(adapter);
        Ok(())
    }

    pub(crate) fn free_map_registers(
        &self,
        adapter: PDMA_ADAPTER,
        base: MAP_REGISTER_BASE,
        n: u32,
    ) -> Result<(), Bugcheck> {
        self.dma_irql_exact(DISPATCH_LEVEL)?;
        let checking = self.dma_checking();
        let mut m = lock(&self.memory);
        match m.dma.register_sets.get(&base.0) {
            Some(s) if s.adapter == adapter.0 && !s.with_channel => self.release_registers(&mut m, base.0)?,
            _ if checking => return self.found(Bugcheck::e6(e6::TOO_MANY_MAP_REGISTERS_FREED, n as u64, 0, 0)),
            _ => return Ok(()),
        }
        drop(m);
        self.run_waiting(adapter);
        Ok(())
    }

    pub(crate) fn map_transfer(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        base: MAP_REGISTER_BASE,
        va: PVOID,
        length: &mut u32,
        write_to_device: bool,
    ) -> Result<PHYSICAL_ADDRESS, NTSTATUS> {
        let r = self.dma_irql_max(DISPATCH_LEVEL);
        self.ok(r);
        self.watched_access(Watched::Adapter(adapter.0), Access::Write);
        self.watched_access(Watched::Mdl(mdl.0), Access::Read);
        let checking = self.dma_checking();
        let mut m = lock(&self.memory);
        let r = (|| {
            self.live_adapter(&mut m, adapter)?;
            let set = m.dma.register_sets.get(&base.0).ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
            let pages = ADDRESS_AND_SIZE_TO_SPAN_PAGES(va, *length as u64) as u32;
            if set.used + pages > set.count {
                if checking {
                    self.found(Bugcheck::e6(
                        e6::TOO_MANY_MAP_REGISTERS,
                        (set.used + pages) as u64,
                        set.count as u64,
                        0,
                    ))?;
                }
                return Err(Refusal::Status(STATUS_INSUFFICIENT_RESOURCES));
            }
            if checking && set.transfers.iter().any(|t| t.mdl != mdl.0) {
                let mapped: u64 = set.transfers.iter().map(|t| t.mapping.len as u64).sum();
                self.found(Bugcheck::e6(e6::NOT_FLUSHED, mapped, set.count as u64 * PAGE, 0))?;
            }
            let reach = m.dma.adapters.get(&adapter.0).and_then(|a| a.reach);
            let mapping = self.map_buffer(&mut m, mdl.0, va.0, *length, MapFor::Transfer, reach)?;
            let logical = mapping.logical();
            // Windows' MapTransfer maps what is contiguous and says so in Length; the driver maps the rest next.
            *length = mapping.len;
            let set = m.dma.register_sets.get_mut(&base.0).ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
            set.used += mapping.pages() as u32;
            set.transfers.push(Transfer { mdl: mdl.0, write_to_device, mapping });
            Ok(PHYSICAL_ADDRESS(logical))
        })();
        drop(m);
        self.refusal(r)
    }

    pub(crate) fn flush_adapter_buffers(
        &self,
        mdl: PMDL,
        base: MAP_REGISTER_BASE,
        va: PVOID,
    ) -> Result<bool, Bugcheck> {
        self.dma_irql_max(DISPATCH_LEVEL)?;
        // No adapter argument here: the flush is the MDL's (and, through the register set, the adapter's).
        self.watched_access(Watched::Mdl(mdl.0), Access::Read);
        let checking = self.dma_checking();
        let mut m = lock(&self.memory);
        let found = m
            .dma
            .register_sets
            .get(&base.0)
            .and_then(|set| set.transfers.iter().position(|t| t.mdl == mdl.0 && t.mapping.va == va.0));
        let Some(i) = found else {
            drop(m);
            if checking {
                self.found(Bugcheck::e6(e6::FLUSH_NOT_MAPPED, base.0, 0, 0))?;
            }
            return Ok(false);
        };
        let Some(set) = m.dma.register_sets.get_mut(&base.0) else { return Ok(false) };
        let t = set.transfers.remove(i);
        set.used = set.used.saturating_sub(t.mapping.pages() as u32);
        self.unmap_buffer(&mut m, &t.mapping, !t.write_to_device)?;
        Ok(true)
    }

    pub(crate) fn map_common_buffer(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        length: u32,
    ) -> Result<(HANDLE, SCATTER_GATHER_LIST), NTSTATUS> {
        let r = self.dma_irql_max(DISPATCH_LEVEL);
        self.ok(r);
        let handle = self.new_object();
        let mut m = lock(&self.memory);
        let r = (|| {
            self.live_adapter(&mut m, adapter)?;
            let d = m.mdls.get(&mdl.0).cloned().ok_or(Refusal::Status(STATUS_INVALID_PARAMETER))?;
            if !d.dma_safe() {
                return Err(Refusal::Status(STATUS_INVALID_PARAMETER));
            }
            // Never double-buffered: the point of the API is that the device sees the real pages.
            let mapping = self.map_buffer(&mut m, mdl.0, d.va, length.min(d.len), MapFor::CommonBuffer, None)?;
            let element = SCATTER_GATHER_ELEMENT { Address: PHYSICAL_ADDRESS(mapping.logical()), Length: mapping.len };
            self.live_adapter(&mut m, adapter)?.common_maps.insert(handle, mapping);
            let list = SCATTER_GATHER_LIST { Handle: PSCATTER_GATHER_LIST(handle), Elements: vec![element] };
            Ok((HANDLE(handle), list))
        })();
        drop(m);
        self.refusal(r)
    }

    pub(crate) fn unmap_common_buffer(&self, adapter: PDMA_ADAPTER, handle: HANDLE) -> Result<(), Bugcheck> {
        self.dma_irql_max(DISPATCH_LEVEL)?;
        let checking = self.dma_checking();
        let mut m = lock(&self.memory);
        let mapping = m.dma.adapters.get_mut(&adapter.0).and_then(|a| a.common_maps.remove(&handle.0));
        match mapping {
            Some(mp) => self.unmap_buffer(&mut m, &mp, false),
            None if checking => self.found(Bugcheck::e6(e6::TOO_MANY_COMMON_BUFFERS_FREED, 1, 0, 0)),
            None => Ok(()),
        }
    }

    /// Map registers free in an adapter's pool (for tests and reports).
    pub fn map_registers_free(&self, adapter: PDMA_ADAPTER) -> Option<u32> {
        lock(&self.memory).dma.adapters.get(&adapter.0).map(|a| a.pool_free)
    }
}
