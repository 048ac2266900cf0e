//! The model's address space: pool, contiguous memory, common buffers and user buffers as regions of backend
//! pages at fake virtual addresses, and the CPU's checked access to them (paged memory at raised IRQL faults).

mod pool_quarantine;
mod special_pool;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::panic::Location;

use vhca_ntapi::*;

use crate::bugcheck::Bugcheck;
use crate::interleaving::{Access, Watched};
use crate::low_resources::{at_location, FaultableRoutine};
use crate::pool_types::{PoolRequest, C4_EXECUTABLE_POOL};
use crate::verifier::{c4, SpecialPoolAlignment, VerifierFlags};
use crate::{dma_adapter, lock, mdl, HostMemId, HostView, NtModel, PAGE};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegionKind {
    NonPagedPool,
    PagedPool,
    Contiguous,
    CommonBuffer,
    /// A user-mode buffer: pageable until MmProbeAndLockPages locks it.
    User,
}

impl RegionKind {
    pub fn pageable(self) -> bool {
        matches!(self, RegionKind::PagedPool | RegionKind::User)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Region {
    pub base: u64,
    pub bytes: u64,
    pub pages: usize,
    pub mem: HostMemId,
    pub kind: RegionKind,
    pub tag: u32,
    /// MDLs holding the region's pages locked.
    pub locks: u32,
}

impl Region {
    pub fn end(&self) -> u64 {
        self.base + self.pages as u64 * PAGE
    }
}

const KERNEL_VA_BASE: u64 = 0xFFFF_8000_0000_0000;
const USER_VA_BASE: u64 = 0x0000_0200_0000_0000;

/// Everything the kernel tracks about memory and DMA, under one lock so checks see a consistent picture.
#[derive(Default)]
pub(crate) struct Memory {
    pub regions: BTreeMap<u64, Region>,
    next_kernel_va: u64,
    next_user_va: u64,
    /// Pool bases that were freed (a second free is 0xC4/0x13, not 0x10).
    pub freed_pool: HashSet<u64>,
    /// Freed pool's pages, still backed for the CPU (`NtModel::retire_pool`).
    quarantine: pool_quarantine::PoolQuarantine,
    /// Special Pool's blocks, live and freed, and its alignment setting.
    special: special_pool::SpecialPool,
    pub mdls: HashMap<u64, mdl::Mdl>,
    pub dma: dma_adapter::DmaState,
    /// Blocks freed while the race detector watched, newest last: (base, bytes, what it was), so a report on a late
    /// access still names the block (model addresses are never handed out twice). Kept only when the
    /// interleaving mode is on, at most FREED_NAMES of them.
    freed_names: VecDeque<(u64, u64, String)>,
}

/// Freed blocks a race report can still name: a teardown frees a few hundred; the oldest go first.
const FREED_NAMES: usize = 4096;

impl Memory {
    pub fn region_of(&self, va: u64) -> Option<&Region> {
        self.regions.range(..=va).next_back().map(|(_, r)| r).filter(|r| va < r.end())
    }

    pub fn region_of_mut(&mut self, va: u64) -> Option<&mut Region> {
        self.regions.range_mut(..=va).next_back().map(|(_, r)| r).filter(|r| va < r.end())
    }

    /// A fresh virtual range with an unmapped guard page after it; addresses are never reused.
    fn reserve_va(&mut self, pages: usize, user: bool, in_page_offset: u64) -> u64 {
        let next = if user { &mut self.next_user_va } else { &mut self.next_kernel_va };
        if *next == 0 {
            *next = if user { USER_VA_BASE } else { KERNEL_VA_BASE };
        }
        let base = *next;
        *next += (pages as u64 + 1) * PAGE;
        base + in_page_offset
    }

    /// Copies between the CPU and region memory without IRQL checks (the kernel's own copies, shadow buffers).
    pub fn copy_from(&self, backend: &dyn crate::DmaBackend, va: u64, out: &mut [u8]) -> Result<(), u64> {
        let mut done = 0usize;
        while done < out.len() {
            let at = va + done as u64;
            let r = self.region_of(at).ok_or(at)?;
            let n = ((r.end() - at) as usize).min(out.len() - done);
            backend.read(r.mem, (at - r.base) as usize, &mut out[done..done + n]).map_err(|_| at)?;
            done += n;
        }
        Ok(())
    }

    pub fn copy_to(&self, backend: &dyn crate::DmaBackend, va: u64, data: &[u8]) -> Result<(), u64> {
        let mut done = 0usize;
        while done < data.len() {
            let at = va + done as u64;
            let r = self.region_of(at).ok_or(at)?;
            let n = ((r.end() - at) as usize).min(data.len() - done);
            backend.write(r.mem, (at - r.base) as usize, &data[done..done + n]).map_err(|_| at)?;
            done += n;
        }
        Ok(())
    }
}

impl NtModel {
    /// Allocates `bytes` in a new region of `kind`. `contiguous` regions obey the fragmentation knob.
    pub(crate) fn alloc_region(&self, bytes: u64, kind: RegionKind, tag: u32, in_page_offset: u64) -> Option<u64> {
        let pages = usize::try_from((in_page_offset + bytes).div_ceil(PAGE)).ok()?;
        if pages == 0 {
            return None;
        }
        let contiguous = matches!(kind, RegionKind::Contiguous | RegionKind::CommonBuffer);
        if contiguous && self.config.max_contiguous_pages.is_some_and(|max| pages > max) {
            return None;
        }
        let mem = self.backend.alloc(pages).ok()?;
        let mut m = lock(&self.memory);
        let va = m.reserve_va(pages, kind == RegionKind::User, in_page_offset);
        let base = va - in_page_offset;
        m.regions.insert(base, Region { base, bytes, pages, mem, kind, tag, locks: 0 });
        Some(va)
    }

    /// Removes the region starting at `base`, returning it; its pages go back to the backend.
    pub(crate) fn free_region(&self, m: &mut Memory, base: u64) -> Option<Region> {
        let r = m.regions.remove(&base)?;
        // The backend drops any translation to these pages too; a leak here is a model bug, not the driver's.
        let _ = self.backend.free(r.mem);
        Some(r)
    }

    /// Freed pool leaves the model's books at once (its model address is gone for the model's own accesses and
    /// checks: the native driver's RtlCopyFromVa of it is still 0x50, stricter than Windows, tests/rules.rs pins
    /// it) and the device's view of its pages goes with it, as for any free. Without Special Pool its pages
    /// stay backed, and so mapped where a driver binary was handed them, with what was written: Windows returns a
    /// freed block to the pool allocator, still mapped, so a late reader (a DPC left running past a remove) reads
    /// stale state instead of faulting. Freed special pool (0x1) is held the same way, for another reason: its
    /// range is inaccessible (the model's accesses 0xD5 by its books, a driver binary's by the loader's page
    /// protection, `with_freed_special_pool`), and holding its pages keeps their process addresses from being
    /// reused under the driver until the quarantine lets them go, as Windows delays reusing freed special pool.
    fn retire_pool(&self, m: &mut Memory, base: u64) {
        let Some(r) = m.regions.remove(&base) else { return };
        if m.special.live(base).is_some() {
            m.special.retire(base, r.end(), r.mem);
        }
        if self.backend.revoke_device_access(r.mem).is_err() {
            // A backend that cannot keep CPU-only memory, or one whose unmap failed (it leaked the pages then).
            let _ = self.backend.free(r.mem);
            return;
        }
        for released in m.quarantine.hold(r.mem, r.pages) {
            let _ = self.backend.free(released);
        }
    }

    /// Bytes of freed pool still backed for the CPU (at most 16 MiB; `pool_quarantine.rs` says why).
    pub fn freed_pool_held(&self) -> u64 {
        lock(&self.memory).quarantine.bytes()
    }

    /// ExAllocatePoolWithTag or ExAllocatePool2 as a driver binary calls it: `request` the pool its call named,
    /// `caller` the return address in the driver's code (Code integrity checks' P2).
    #[track_caller]
    pub fn allocate_pool(&self, request: PoolRequest, bytes: usize, tag: u32, caller: u64) -> PVOID {
        let _call = self.kernel_call("ExAllocatePool");
        let r = at_location(Location::caller(), || self.pool_alloc(request, bytes, tag, caller));
        self.ok(r)
    }

    pub(crate) fn pool_alloc(
        &self,
        request: PoolRequest,
        bytes: usize,
        tag: u32,
        caller: u64,
    ) -> Result<PVOID, Bugcheck> {
        let irql = self.irql();
        let pool_type = u64::from(request.pool_type);
        if bytes == 0 && self.verifier().enabled() {
            self.found(Bugcheck::c4(c4::ZERO_BYTE_ALLOCATION, irql as u64, pool_type, 0))?;
        }
        if self.checks(VerifierFlags::IRQL_CHECKING) {
            if request.paged && irql > APC_LEVEL {
                self.found(Bugcheck::c4(c4::PAGED_ALLOC_ABOVE_APC, irql as u64, pool_type, bytes as u64))?;
            }
            if irql > DISPATCH_LEVEL {
                self.found(Bugcheck::c4(c4::NONPAGED_ALLOC_ABOVE_DISPATCH, irql as u64, pool_type, bytes as u64))?;
            }
        }
        // Memory integrity never lets kernel memory be writable and executable at once, so the check refuses the
        // request itself, whether or not the driver ever executes from it; without it Windows hands out the
        // executable block, and so does the model.
        if request.executable && self.checks(VerifierFlags::CODE_INTEGRITY) {
            self.found(Bugcheck::c4(C4_EXECUTABLE_POOL, caller, pool_type, u64::from(tag)))?;
        }
        if self.inject(FaultableRoutine::ExAllocatePoolWithTag, Some(tag)).is_some() {
            return Ok(PVOID::NULL);
        }
        let kind = if request.paged { RegionKind::PagedPool } else { RegionKind::NonPagedPool };
        if self.checks(VerifierFlags::SPECIAL_POOL) {
            return Ok(self.alloc_special(bytes as u64, kind, tag).map(PVOID).unwrap_or(PVOID::NULL));
        }
        Ok(self.alloc_region(bytes as u64, kind, tag, 0).map(PVOID).unwrap_or(PVOID::NULL))
    }

    /// A special pool block: its own pages and a guard page, the allocation against the guard (Verify End) or right
    /// after it (Verify Start), every other byte of its pages the pattern its free checks. The guard page is part of
    /// the region, so the block's pages are one backend allocation and one range of a driver binary's addresses
    /// (the loader makes the guard inaccessible there); the model's own accesses are refused by `check_cpu_access`.
    fn alloc_special(&self, bytes: u64, kind: RegionKind, tag: u32) -> Option<u64> {
        let alignment = lock(&self.memory).special.alignment;
        let placement = special_pool::Placement::new(bytes, alignment)?;
        let mem = self.backend.alloc(placement.pages).ok()?;
        let data = placement.data();
        let pattern = vec![special_pool::PATTERN; (data.end - data.start) as usize];
        let allocation = (placement.start - data.start) as usize..(placement.start - data.start + bytes) as usize;
        let pattern =
            [&pattern[..allocation.start], &vec![0; allocation.len()][..], &pattern[allocation.end..]].concat();
        if self.backend.write(mem, data.start as usize, &pattern).is_err() {
            let _ = self.backend.free(mem);
            return None;
        }
        let mut m = lock(&self.memory);
        let base = m.reserve_va(placement.pages, false, 0);
        m.regions.insert(base, Region { base, bytes, pages: placement.pages, mem, kind, tag, locks: 0 });
        m.special.insert(base, bytes, placement);
        Some(base + placement.start)
    }

    /// Special Pool's alignment from now on (Windows' Verify Start / Verify End; Verify End unless set).
    pub fn set_special_pool_alignment(&self, alignment: SpecialPoolAlignment) {
        lock(&self.memory).special.alignment = alignment;
    }

    /// The model with Special Pool's alignment set, as the guest builds it from `vhca.special_pool`.
    pub fn with_special_pool_alignment(self, alignment: SpecialPoolAlignment) -> NtModel {
        self.set_special_pool_alignment(alignment);
        self
    }

    /// The guard page of the live special pool block handed out at `va`, as a model address (None: not one).
    pub fn special_pool_guard(&self, va: PVOID) -> Option<PVOID> {
        let m = lock(&self.memory);
        let base = m.special.base_of(va.0)?;
        Some(PVOID(base + m.special.live(base)?.placement.guard as u64 * PAGE))
    }

    /// Runs `f` on the process view of the freed special pool block once handed out at `va` while the model still
    /// holds its pages (the quarantine), under the model's memory lock, so the pages cannot be given back (and
    /// their addresses reused) before `f` is done: the PE loader makes them inaccessible there. False: not held.
    pub fn with_freed_special_pool(&self, va: PVOID, f: impl FnOnce(HostView)) -> bool {
        let m = lock(&self.memory);
        let Some(mem) = m.special.freed_memory(va.0).filter(|mem| m.quarantine.holds(*mem)) else { return false };
        let Some(host) = self.backend.host_address(mem) else { return false };
        let Some((base, end)) = m.special.freed_range(va.0) else { return false };
        f(HostView { model_base: base, bytes: end - base, host_base: host as usize });
        true
    }

    /// The special pool block handed out at `va`: the first byte of its pattern the driver changed and 0xC1's
    /// subcode for it (0x23 before the block, 0x24 after its end); None when whole, or not a special pool block.
    /// The PE loader asks before the free, to name the driver's own addresses in the bugcheck.
    pub fn special_pool_corruption(&self, va: PVOID) -> Option<(PVOID, u64)> {
        let m = lock(&self.memory);
        let base = m.special.base_of(va.0)?;
        Self::corruption_in(&*self.backend, &m, base)
    }

    fn corruption_in(backend: &dyn crate::DmaBackend, m: &Memory, base: u64) -> Option<(PVOID, u64)> {
        let block = m.special.live(base).copied()?;
        let r = m.regions.get(&base)?;
        let data = block.placement.data();
        let mut contents = vec![0u8; (data.end - data.start) as usize];
        backend.read(r.mem, data.start as usize, &mut contents).ok()?;
        let start = (block.placement.start - data.start) as usize;
        let (at, subcode) = special_pool::corrupted_pattern(&contents, start..start + block.bytes as usize)?;
        Some((PVOID(base + data.start + at as u64), subcode))
    }

    /// At the free of the special pool block at `base`: its pattern whole, or 0xC1 (Microsoft, "Bug Check 0xC1":
    /// P1 the address freed, P2 where the bits are corrupted, P4 the subcode).
    fn special_pool_free_check(&self, m: &Memory, va: u64, base: u64) -> Result<(), Bugcheck> {
        match Self::corruption_in(&*self.backend, m, base) {
            Some((at, subcode)) => {
                self.found(Bugcheck::new(SPECIAL_POOL_DETECTED_MEMORY_CORRUPTION, va, at.0, 0, subcode))
            }
            None => Ok(()),
        }
    }

    pub(crate) fn pool_free(&self, p: PVOID) -> Result<(), Bugcheck> {
        self.watch_block_free(p.0);
        let irql = self.irql();
        let mut m = lock(&self.memory);
        // A special pool block is handed out inside its region, not at its base.
        let base = m.special.base_of(p.0).unwrap_or(p.0);
        let kind = m.regions.get(&base).map(|r| r.kind);
        let pool_type = match kind {
            Some(RegionKind::PagedPool) => POOL_TYPE::PagedPool,
            Some(RegionKind::NonPagedPool) => POOL_TYPE::NonPagedPool,
            _ if !self.verifier().enabled() => return Ok(()),
            _ if m.freed_pool.contains(&p.0) => return self.found(Bugcheck::c4(c4::FREE_ALREADY_FREED, 0, p.0, 0)),
            _ => return self.found(Bugcheck::c4(c4::FREE_BAD_ADDRESS, p.0, 0, 0)),
        };
        if self.checks(VerifierFlags::IRQL_CHECKING) {
            if pool_type.is_paged() && irql > APC_LEVEL {
                self.found(Bugcheck::c4(c4::FREE_PAGED_ABOVE_APC, irql as u64, pool_type as u64, p.0))?;
            }
            if irql > DISPATCH_LEVEL {
                self.found(Bugcheck::c4(c4::FREE_NONPAGED_ABOVE_DISPATCH, irql as u64, pool_type as u64, p.0))?;
            }
        }
        self.special_pool_free_check(&m, p.0, base)?;
        self.retire_pool(&mut m, base);
        m.freed_pool.insert(p.0);
        Ok(())
    }

    pub(crate) fn contiguous_alloc(&self, bytes: usize) -> Result<PVOID, Bugcheck> {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > DISPATCH_LEVEL {
            self.found(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0))?;
        }
        if self.inject(FaultableRoutine::MmAllocateContiguousMemorySpecifyCache, None).is_some() {
            return Ok(PVOID::NULL);
        }
        Ok(self.alloc_region(bytes as u64, RegionKind::Contiguous, 0, 0).map(PVOID).unwrap_or(PVOID::NULL))
    }

    pub(crate) fn contiguous_free(&self, va: PVOID) -> Result<(), Bugcheck> {
        self.watch_block_free(va.0);
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql >= DISPATCH_LEVEL {
            self.found(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0))?;
        }
        let mut m = lock(&self.memory);
        match m.regions.get(&va.0).map(|r| r.kind) {
            Some(RegionKind::Contiguous) => {
                self.free_region(&mut m, va.0);
                Ok(())
            }
            _ if self.verifier().enabled() => self.found(Bugcheck::c4(c4::FREE_BAD_ADDRESS, va.0, 0, 0)),
            _ => Ok(()),
        }
    }

    /// CPU access to `va..va+len`: a missing page is 0x50; pageable, unlocked memory at DISPATCH_LEVEL or above is
    /// 0xD1 when IRQL checking is on (the verifier pages such memory out whenever IRQL is raised).
    fn check_cpu_access(&self, m: &Memory, va: u64, len: usize, write: bool) -> Result<(), Bugcheck> {
        let irql = self.irql();
        let mut at = va;
        let end = va.saturating_add(len as u64);
        while at < end {
            // Not a verifier rule: the access cannot go on, so this one is never disabled.
            let Some(r) = m.region_of(at) else {
                // Freed special pool stays named as such (Special Pool's own verdict, not a verifier rule to
                // disable: the page is gone either way).
                if m.special.is_freed(at) {
                    return Err(Bugcheck::new(DRIVER_PAGE_FAULT_IN_FREED_SPECIAL_POOL, at, write as u64, 0, 0));
                }
                return Err(Bugcheck::new(PAGE_FAULT_IN_NONPAGED_AREA, at, write as u64, 0, 0));
            };
            if let Some(block) = m.special.live(r.base) {
                let guard = r.base + block.placement.guard as u64 * PAGE;
                let first = at.max(guard);
                if first < end.min(guard + PAGE) {
                    // P3, the instruction, is unknown to the model (the native driver's access is a kernel call).
                    return Err(Bugcheck::new(DRIVER_PAGE_FAULT_BEYOND_END_OF_ALLOCATION, first, write as u64, 0, 0));
                }
            }
            if r.kind.pageable() && r.locks == 0 && irql >= DISPATCH_LEVEL && self.checks(VerifierFlags::IRQL_CHECKING)
            {
                self.found(Bugcheck::new(DRIVER_IRQL_NOT_LESS_OR_EQUAL, at, irql as u64, write as u64, 0))?;
            }
            at = r.end();
        }
        Ok(())
    }

    /// The race detector's free of the whole block at `base` (pool, contiguous memory, a common buffer's bytes),
    /// told before the block leaves the books so a report can still name its tag. Nothing when none starts there.
    pub(crate) fn watch_block_free(&self, base: u64) {
        if !self.interleaving_on() {
            return;
        }
        let bytes = {
            let mut m = lock(&self.memory);
            let block = m.regions.get(&base).map(|r| (r.bytes, block_label(r)));
            if let Some((bytes, label)) = &block {
                if m.freed_names.len() >= FREED_NAMES {
                    m.freed_names.pop_front();
                }
                m.freed_names.push_back((base, *bytes, format!("{label}, freed")));
            }
            block.map(|(bytes, _)| bytes)
        };
        if let Some(len) = bytes {
            self.watched_access(Watched::Memory { va: base, len }, Access::Free);
        }
    }

    /// A race report's name for the memory at `va`: its block's base and the offset, with what the block is.
    pub(crate) fn memory_name(&self, va: u64) -> String {
        let m = lock(&self.memory);
        if let Some(r) = m.region_of(va) {
            return format!("memory {:#x}+{:#x} ({})", r.base, va - r.base, block_label(r));
        }
        match m.freed_names.iter().rev().find(|(base, bytes, _)| (*base..base + bytes).contains(&va)) {
            Some((base, _, label)) => format!("memory {base:#x}+{:#x} ({label})", va - base),
            None => format!("memory {va:#x} (never allocated, or freed unwatched)"),
        }
    }

    /// The driver's read of model memory (RtlCopyFromVa): a watched read before it is checked, so one that faults
    /// (freed pool) still meets the free it follows.
    pub(crate) fn cpu_read(&self, va: PVOID, out: &mut [u8]) -> Result<(), Bugcheck> {
        self.watched_access(Watched::Memory { va: va.0, len: out.len() as u64 }, Access::Read);
        let m = lock(&self.memory);
        self.check_cpu_access(&m, va.0, out.len(), false)?;
        m.copy_from(&*self.backend, va.0, out).map_err(|at| Bugcheck::new(PAGE_FAULT_IN_NONPAGED_AREA, at, 0, 0, 0))
    }

    pub(crate) fn cpu_write(&self, va: PVOID, data: &[u8]) -> Result<(), Bugcheck> {
        self.watched_access(Watched::Memory { va: va.0, len: data.len() as u64 }, Access::Write);
        let m = lock(&self.memory);
        self.check_cpu_access(&m, va.0, data.len(), true)?;
        m.copy_to(&*self.backend, va.0, data).map_err(|at| Bugcheck::new(PAGE_FAULT_IN_NONPAGED_AREA, at, 1, 0, 0))
    }

    /// A user-mode process's buffer of `bytes`, starting `in_page_offset` bytes into its first page: pageable
    /// memory the driver must probe and lock before DMA.
    pub fn alloc_user_buffer(&self, bytes: u64, in_page_offset: u64) -> PVOID {
        self.alloc_region(bytes, RegionKind::User, 0, in_page_offset % PAGE).map(PVOID).unwrap_or(PVOID::NULL)
    }

    pub fn free_user_buffer(&self, va: PVOID) {
        let mut m = lock(&self.memory);
        let base = va.0 - va.0 % PAGE;
        if m.regions.get(&base).is_some_and(|r| r.kind == RegionKind::User) {
            self.free_region(&mut m, base);
        }
    }

    /// Pool allocations still live: (paged bytes, non-paged bytes, count).
    pub fn pool_outstanding(&self) -> (u64, u64, u64) {
        let m = lock(&self.memory);
        m.regions.values().fold((0, 0, 0), |(p, n, c), r| match r.kind {
            RegionKind::PagedPool => (p + r.bytes, n, c + 1),
            RegionKind::NonPagedPool => (p, n + r.bytes, c + 1),
            _ => (p, n, c),
        })
    }

    /// What the driver still holds that no Windows check reports at unload (contiguous memory, MDLs, locked user
    /// pages): the rig's own leak census, which the low-resources runs use so a leaking error path fails its run.
    /// Pool and DMA resources are left to the verifier's own unload checks (0xC4/0x60, 0xE6/0x07..0x0A).
    pub fn unreleased_resources(&self) -> Vec<String> {
        let m = lock(&self.memory);
        let mut out = Vec::new();
        for r in m.regions.values() {
            match r.kind {
                RegionKind::Contiguous => out.push(format!("contiguous memory {:#x} ({} bytes)", r.base, r.bytes)),
                RegionKind::User if r.locks > 0 => {
                    out.push(format!("user pages at {:#x} locked {} time(s)", r.base, r.locks))
                }
                _ => {}
            }
        }
        let mut mdls: Vec<_> = m.mdls.iter().collect();
        mdls.sort_by_key(|(addr, _)| **addr);
        out.extend(mdls.into_iter().map(|(addr, d)| format!("MDL {addr:#x} for {:#x} ({} bytes)", d.va, d.len)));
        out
    }

    /// Live pool allocations as (address, bytes, tag, paged): what `!poolused` would list for the driver.
    pub fn pool_allocations(&self) -> Vec<(PVOID, u64, u32, bool)> {
        let m = lock(&self.memory);
        m.regions
            .values()
            .filter(|r| matches!(r.kind, RegionKind::PagedPool | RegionKind::NonPagedPool))
            .map(|r| (PVOID(r.base), r.bytes, r.tag, r.kind == RegionKind::PagedPool))
            .collect()
    }

    pub(crate) fn unload_checks(&self) -> Result<(), Bugcheck> {
        if self.checks(VerifierFlags::DMA_CHECKING) {
            let m = lock(&self.memory);
            for adapter in m.dma.adapters.values().filter(|a| !a.released) {
                adapter.outstanding_check(self)?;
            }
        }
        if self.checks(VerifierFlags::POOL_TRACKING) {
            let (paged, nonpaged, count) = self.pool_outstanding();
            if count > 0 {
                self.found(Bugcheck::c4(c4::UNLOAD_WITH_POOL_ALLOCATIONS, paged, nonpaged, count))?;
            }
        }
        Ok(())
    }
}

/// The model goes away at the end of a run: the freed pool it still held goes back to the backend.
impl Drop for NtModel {
    fn drop(&mut self) {
        let held = lock(&self.memory).quarantine.drain();
        for mem in held {
            let _ = self.backend.free(mem);
        }
    }
}

/// What a block is, as a race report says it.
fn block_label(r: &Region) -> String {
    match r.kind {
        RegionKind::NonPagedPool | RegionKind::PagedPool => {
            let tag: String = r.tag.to_le_bytes().iter().map(|b| char::from(*b)).collect();
            format!("pool tag '{tag}'")
        }
        RegionKind::Contiguous => "contiguous memory".to_string(),
        RegionKind::CommonBuffer => "common buffer".to_string(),
        RegionKind::User => "user buffer".to_string(),
    }
}
