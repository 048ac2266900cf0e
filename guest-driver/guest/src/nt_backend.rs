//! The NT model's `DmaBackend` in the guest: its "physical pages" are pinned memory of this process, and its
//! device mappings are real VFIO_IOMMU_MAP_DMA / UNMAP_DMA calls, so an unmapped buffer faults in the vIOMMU.

use std::collections::{BTreeMap, HashMap};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use vhca_ntmodel::{BackendError, DmaBackend, HostMemId};

use crate::vfio::DmaAccess;
use crate::vfio_dma::{DmaMapper, DmaRegion, HostMemory, PAGE_SIZE};

struct Mapping {
    mem: HostMemId,
    pages: usize,
    region: DmaRegion,
}

#[derive(Default)]
struct State {
    next_mem: u64,
    memory: HashMap<HostMemId, HostMemory>,
    /// IOVA -> the mapping `map` made there.
    mappings: BTreeMap<u64, Mapping>,
    /// Pages mapped at most at once, for the report.
    peak_mapped_pages: usize,
}

impl State {
    fn mapped_pages(&self) -> usize {
        self.mappings.values().map(|m| m.pages).sum()
    }

    /// Takes every device mapping into `mem` away; the last unmap that failed, if any.
    fn unmap_all(&mut self, mem: HostMemId) -> Option<BackendError> {
        let iovas: Vec<u64> = self.mappings.iter().filter(|(_, m)| m.mem == mem).map(|(iova, _)| *iova).collect();
        let mut failed = None;
        for iova in iovas {
            if let Some(m) = self.mappings.remove(&iova) {
                if let Err(e) = m.region.unmap() {
                    failed = Some(platform(e));
                }
            }
        }
        failed
    }

    /// `mem` may still be mapped for the device: it is never unmapped from this process nor reused (leaked), so
    /// the device can never write memory that belongs to something else.
    fn leak(&mut self, mem: HostMemId) {
        std::mem::forget(self.memory.remove(&mem));
    }
}

/// Host memory for the NT model, mapped for the device through the VFIO container.
pub struct VfioDmaBackend {
    mapper: Arc<DmaMapper>,
    state: Mutex<State>,
}

fn platform(e: impl std::fmt::Display) -> BackendError {
    BackendError::Platform(e.to_string())
}

impl VfioDmaBackend {
    pub fn new(mapper: Arc<DmaMapper>) -> VfioDmaBackend {
        VfioDmaBackend { mapper, state: Mutex::new(State { next_mem: 1, ..State::default() }) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// (pages mapped now, most pages mapped at once).
    pub fn mapped_pages(&self) -> (usize, usize) {
        let s = self.lock();
        (s.mapped_pages(), s.peak_mapped_pages)
    }
}

impl DmaBackend for VfioDmaBackend {
    fn alloc(&self, pages: usize) -> Result<HostMemId, BackendError> {
        let len = pages.checked_mul(PAGE_SIZE).filter(|l| *l > 0).ok_or(BackendError::OutOfMemory { pages })?;
        let memory = HostMemory::new(len).map_err(|_| BackendError::OutOfMemory { pages })?;
        let mut s = self.lock();
        let id = HostMemId(s.next_mem);
        s.next_mem += 1;
        s.memory.insert(id, memory);
        Ok(id)
    }

    fn free(&self, mem: HostMemId) -> Result<(), BackendError> {
        let mut s = self.lock();
        if !s.memory.contains_key(&mem) {
            return Err(BackendError::UnknownMemory(mem));
        }
        // Memory freed while mapped: take the device's view away first, so it can never write freed pages.
        if let Some(e) = s.unmap_all(mem) {
            s.leak(mem);
            return Err(e);
        }
        s.memory.remove(&mem);
        Ok(())
    }

    /// The device's view goes now; the pages stay mapped in this process, where vhca.sys was handed them, until
    /// `free` (freed pool without Special Pool, `NtModel::retire_pool`).
    fn revoke_device_access(&self, mem: HostMemId) -> Result<(), BackendError> {
        let mut s = self.lock();
        if !s.memory.contains_key(&mem) {
            return Err(BackendError::UnknownMemory(mem));
        }
        if let Some(e) = s.unmap_all(mem) {
            s.leak(mem);
            return Err(e);
        }
        Ok(())
    }

    fn read(&self, mem: HostMemId, offset: usize, buf: &mut [u8]) -> Result<(), BackendError> {
        let s = self.lock();
        let m = s.memory.get(&mem).ok_or(BackendError::UnknownMemory(mem))?;
        m.read(offset, buf).map_err(|_| BackendError::OutOfRange { mem, offset, len: buf.len() })
    }

    fn write(&self, mem: HostMemId, offset: usize, buf: &[u8]) -> Result<(), BackendError> {
        let s = self.lock();
        let m = s.memory.get(&mem).ok_or(BackendError::UnknownMemory(mem))?;
        m.write(offset, buf).map_err(|_| BackendError::OutOfRange { mem, offset, len: buf.len() })
    }

    fn map(&self, mem: HostMemId, first_page: usize, pages: usize) -> Result<u64, BackendError> {
        self.map_pages(mem, first_page, pages, None)
    }

    /// At an IOVA the model chose (its frames, a bounce page below a device's limit): VFIO_IOMMU_MAP_DMA refuses one
    /// that overlaps a live mapping, and `DmaMapper` one outside the windows a caller may choose.
    fn map_at(&self, mem: HostMemId, first_page: usize, pages: usize, iova: u64) -> Result<(), BackendError> {
        self.map_pages(mem, first_page, pages, Some(iova)).map(|_| ())
    }

    fn unmap(&self, iova: u64, pages: usize) -> Result<(), BackendError> {
        let mut s = self.lock();
        match s.mappings.get(&iova) {
            Some(m) if m.pages == pages => {}
            _ => return Err(BackendError::NotMapped { iova }),
        }
        let m = s.mappings.remove(&iova).ok_or(BackendError::NotMapped { iova })?;
        m.region.unmap().map_err(platform)
    }

    /// Each allocation is one anonymous mapping that stays put until `free`.
    fn host_address(&self, mem: HostMemId) -> Option<*mut u8> {
        self.lock().memory.get(&mem).map(|m| m.ptr().as_ptr())
    }
}

impl VfioDmaBackend {
    /// Maps pages of `mem` at `chosen`, or at the mapper's next fresh IOVA.
    fn map_pages(
        &self,
        mem: HostMemId,
        first_page: usize,
        pages: usize,
        chosen: Option<u64>,
    ) -> Result<u64, BackendError> {
        let mut s = self.lock();
        let m = s.memory.get(&mem).ok_or(BackendError::UnknownMemory(mem))?;
        let offset = first_page.checked_mul(PAGE_SIZE);
        let len = pages.checked_mul(PAGE_SIZE).filter(|l| *l > 0);
        let (offset, len) = match (offset, len) {
            (Some(o), Some(l)) if o.checked_add(l).is_some_and(|end| end <= m.len()) => (o, l),
            _ => return Err(BackendError::OutOfRange { mem, offset: first_page, len: pages }),
        };
        // In bounds (checked above) of a live, page-aligned mapping, so never null.
        let host = NonNull::new(m.ptr().as_ptr().wrapping_add(offset)).ok_or(BackendError::UnknownMemory(mem))?;
        let iova = match chosen {
            Some(iova) => iova,
            None => self.mapper.reserve_iova(len).map_err(|_| BackendError::IovaExhausted { pages })?,
        };
        // SAFETY: `host..host+len` lies inside `m`, page aligned; `free` unmaps every mapping into a memory before
        // dropping it, so the pages stay valid for as long as the region is mapped.
        let region = unsafe { self.mapper.map_host(host, len, iova, DmaAccess::READ_WRITE) }.map_err(platform)?;
        s.mappings.insert(iova, Mapping { mem, pages, region });
        s.peak_mapped_pages = s.peak_mapped_pages.max(s.mapped_pages());
        Ok(iova)
    }
}
