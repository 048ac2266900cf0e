//! Memory descriptor lists: which pages a buffer spans and whether they are locked, and the rules for building,
//! probing, locking and unlocking them (0xC4/0x70, 0x78, 0x7C, 0x7D, 0x7F, 0xB0; 0xA for pageable at DISPATCH).

use vhca_ntapi::*;

use crate::bugcheck::Bugcheck;
use crate::interleaving::{Access, Watched};
use crate::low_resources::{Failure, FaultableRoutine};
use crate::memory::RegionKind;
use crate::verifier::{c4, VerifierFlags};
use crate::{lock, NtModel, PAGE};

#[derive(Debug, Clone)]
pub(crate) struct Mdl {
    pub va: u64,
    pub len: u32,
    pub flags: u16,
}

impl Mdl {
    /// The pages are resident for as long as a DMA may run: locked, or non-paged by construction.
    pub fn dma_safe(&self) -> bool {
        self.flags & (MDL_PAGES_LOCKED | MDL_SOURCE_IS_NONPAGED_POOL) != 0
    }
}

impl NtModel {
    pub(crate) fn mdl(&self, mdl: PMDL) -> Option<Mdl> {
        lock(&self.memory).mdls.get(&mdl.0).cloned()
    }

    pub(crate) fn mdl_alloc(&self, va: PVOID, length: u32) -> Result<PMDL, Bugcheck> {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > DISPATCH_LEVEL {
            self.found(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0))?;
        }
        if length == 0 || self.inject(FaultableRoutine::IoAllocateMdl, None).is_some() {
            return Ok(PMDL::NULL);
        }
        let addr = self.new_object();
        lock(&self.memory).mdls.insert(addr, Mdl { va: va.0, len: length, flags: 0 });
        self.watched_access(Watched::Mdl(addr), Access::Write);
        Ok(PMDL(addr))
    }

    pub(crate) fn mdl_free(&self, mdl: PMDL) {
        self.watched_access(Watched::Mdl(mdl.0), Access::Free);
        lock(&self.memory).mdls.remove(&mdl.0);
    }

    pub(crate) fn mdl_build_nonpaged(&self, mdl: PMDL) -> Result<(), Bugcheck> {
        self.watched_access(Watched::Mdl(mdl.0), Access::Write);
        let irql = self.irql();
        let mut m = lock(&self.memory);
        let Some(d) = m.mdls.get(&mdl.0).cloned() else { return Ok(()) };
        let pageable = m.region_of(d.va).is_none_or(|r| r.kind.pageable());
        if pageable && self.verifier().enabled() {
            self.found(Bugcheck::c4(c4::BUILD_MDL_FOR_PAGED_POOL, irql as u64, mdl.0, d.flags as u64))?;
        }
        if let Some(d) = m.mdls.get_mut(&mdl.0) {
            d.flags |= MDL_SOURCE_IS_NONPAGED_POOL | MDL_MAPPED_TO_SYSTEM_VA;
        }
        Ok(())
    }

    /// Probes every page of the MDL and pins the regions behind it.
    pub(crate) fn mdl_probe_and_lock(
        &self,
        mdl: PMDL,
        mode: KPROCESSOR_MODE,
        op: LOCK_OPERATION,
    ) -> Result<NTSTATUS, Bugcheck> {
        self.watched_access(Watched::Mdl(mdl.0), Access::Write);
        let irql = self.irql();
        let mut m = lock(&self.memory);
        let Some(d) = m.mdls.get(&mdl.0).cloned() else { return Ok(STATUS_INVALID_PARAMETER) };
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > DISPATCH_LEVEL {
            self.found(Bugcheck::c4(c4::PROBE_AND_LOCK_ABOVE_DISPATCH, irql as u64, mdl.0, mode as u64))?;
        }
        if d.flags & MDL_SOURCE_IS_NONPAGED_POOL != 0 && self.verifier().enabled() {
            let flags = d.flags as u64;
            self.found(Bugcheck::c4(
                c4::PROBE_AND_LOCK_NONPAGED_MDL,
                mdl.0,
                flags,
                MDL_SOURCE_IS_NONPAGED_POOL as u64,
            ))?;
        }
        if let Some(Failure::Status(status)) = self.inject(FaultableRoutine::MmProbeAndLockPages, None) {
            return Ok(status);
        }
        let Some(end) = d.va.checked_add(d.len as u64) else { return Ok(STATUS_ACCESS_VIOLATION) };
        let mut bases = Vec::new();
        let mut at = d.va;
        while at < end {
            let Some(r) = m.region_of(at) else { return Ok(STATUS_ACCESS_VIOLATION) };
            if mode == KPROCESSOR_MODE::UserMode && r.kind != RegionKind::User {
                return Ok(STATUS_ACCESS_VIOLATION);
            }
            // Touching a non-resident page at DISPATCH_LEVEL: the kernel's page fault cannot be served.
            if r.kind.pageable() && r.locks == 0 && irql >= DISPATCH_LEVEL && self.checks(VerifierFlags::IRQL_CHECKING)
            {
                let write = op != LOCK_OPERATION::IoReadAccess;
                self.found(Bugcheck::new(IRQL_NOT_LESS_OR_EQUAL, at, irql as u64, write as u64, 0))?;
            }
            bases.push(r.base);
            at = r.end().max(at + PAGE);
        }
        for b in bases {
            if let Some(r) = m.regions.get_mut(&b) {
                r.locks += 1;
            }
        }
        if let Some(d) = m.mdls.get_mut(&mdl.0) {
            d.flags |= MDL_PAGES_LOCKED;
        }
        Ok(STATUS_SUCCESS)
    }

    /// MmUnlockPages writes the MDL (its flags; the pages it describes stay described): its end is IoFreeMdl.
    pub(crate) fn mdl_unlock(&self, mdl: PMDL) -> Result<(), Bugcheck> {
        self.watched_access(Watched::Mdl(mdl.0), Access::Write);
        let irql = self.irql();
        let mut m = lock(&self.memory);
        let Some(d) = m.mdls.get(&mdl.0).cloned() else { return Ok(()) };
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > DISPATCH_LEVEL {
            self.found(Bugcheck::c4(c4::UNLOCK_PAGES_ABOVE_DISPATCH, irql as u64, mdl.0, 0))?;
        }
        if d.flags & MDL_SOURCE_IS_NONPAGED_POOL != 0 {
            if self.verifier().enabled() {
                self.found(Bugcheck::c4(c4::UNLOCK_PAGES_NONPAGED_POOL, mdl.0, d.flags as u64, 0))?;
            }
            return Ok(());
        }
        if d.flags & MDL_PAGES_LOCKED == 0 {
            if self.verifier().enabled() {
                self.found(Bugcheck::c4(c4::UNLOCK_PAGES_NEVER_LOCKED, mdl.0, d.flags as u64, 0))?;
            }
            return Ok(());
        }
        let mut at = d.va;
        let end = d.va.saturating_add(d.len as u64);
        while at < end {
            let Some(r) = m.region_of_mut(at) else { break };
            r.locks = r.locks.saturating_sub(1);
            at = r.end().max(at + PAGE);
        }
        if let Some(d) = m.mdls.get_mut(&mdl.0) {
            d.flags &= !MDL_PAGES_LOCKED;
        }
        Ok(())
    }
}
