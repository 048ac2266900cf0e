//! Where the model's memory comes from and how the device reaches it: host pages mapped at device addresses.
//! The Linux guest implements `DmaBackend` with mmap + VFIO_IOMMU_MAP_DMA; tests use `HostDmaBackend`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use crate::PAGE;

/// Host memory the backend handed out: an id, never a pointer, so the model stays safe code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostMemId(pub u64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    #[error("host memory exhausted: {pages} pages asked for")]
    OutOfMemory { pages: usize },
    #[error("host memory {0:?} is not allocated")]
    UnknownMemory(HostMemId),
    #[error("range {offset:#x}+{len:#x} is outside host memory {mem:?}")]
    OutOfRange { mem: HostMemId, offset: usize, len: usize },
    #[error("no device address space left for {pages} pages")]
    IovaExhausted { pages: usize },
    #[error("iova {iova:#x} is not mapped")]
    NotMapped { iova: u64 },
    #[error("platform refused the mapping: {0}")]
    Platform(String),
    #[error("this backend cannot keep memory for the CPU without its device mappings")]
    NoCpuOnlyMemory,
}

/// Host pages and their device mappings. All methods take `&self`: implementations lock internally.
pub trait DmaBackend: Send + Sync {
    /// `pages` zeroed, page-aligned pages of host memory.
    fn alloc(&self, pages: usize) -> Result<HostMemId, BackendError>;
    fn free(&self, mem: HostMemId) -> Result<(), BackendError>;
    fn read(&self, mem: HostMemId, offset: usize, buf: &mut [u8]) -> Result<(), BackendError>;
    fn write(&self, mem: HostMemId, offset: usize, buf: &[u8]) -> Result<(), BackendError>;
    /// Maps pages `first_page..first_page + pages` of `mem` at a fresh, contiguous device address range.
    fn map(&self, mem: HostMemId, first_page: usize, pages: usize) -> Result<u64, BackendError>;
    /// Removes the mapping `map` (or `map_at`) made; the device faults on it afterwards.
    fn unmap(&self, iova: u64, pages: usize) -> Result<(), BackendError>;
    /// Maps pages `first_page..first_page + pages` of `mem` at `iova`, an address the model chose: a page's
    /// physical address in a domain without DMA remapping, or a bounce page below a narrow device's reach
    /// (`dma_adapter::device_address`). A backend that cannot place mappings says so.
    fn map_at(&self, _mem: HostMemId, _first_page: usize, _pages: usize, iova: u64) -> Result<(), BackendError> {
        Err(BackendError::Platform(format!("this backend cannot map at a chosen address ({iova:#x})")))
    }
    /// Where `mem`'s pages are in this process, when they are plain memory a driver binary may dereference (the
    /// PE loader hands such addresses to vhca.sys). None: reachable only through `read` and `write`.
    fn host_address(&self, _mem: HostMemId) -> Option<*mut u8> {
        None
    }
    /// Takes the device's view of `mem` away (every mapping into it, as `free` does) and keeps its pages, contents
    /// and process address for the CPU until `free`: pool freed without Special Pool, which Windows leaves mapped.
    /// A backend that cannot says so, and the model frees the memory at once instead.
    fn revoke_device_access(&self, _mem: HostMemId) -> Result<(), BackendError> {
        Err(BackendError::NoCpuOnlyMemory)
    }
}

struct HostState {
    next_mem: u64,
    memory: HashMap<HostMemId, Vec<u8>>,
    /// IOVA page number -> (memory, page index in it).
    iotlb: BTreeMap<u64, (HostMemId, usize)>,
    next_iova: u64,
}

/// The part of a device access that falls in one IOMMU page: which host memory, where in it, how many bytes.
struct Chunk {
    mem: HostMemId,
    start: usize,
    n: usize,
}

impl HostState {
    /// Translates the page holding byte `done` of an access of `len` bytes at `iova`.
    fn chunk(&self, iova: u64, done: usize, len: usize) -> Result<Chunk, BackendError> {
        let addr = iova.checked_add(done as u64).ok_or(BackendError::NotMapped { iova })?;
        let (mem, page) = *self.iotlb.get(&(addr / PAGE)).ok_or(BackendError::NotMapped { iova: addr })?;
        let in_page = (addr % PAGE) as usize;
        Ok(Chunk { mem, start: page * PAGE as usize + in_page, n: (PAGE as usize - in_page).min(len - done) })
    }
}

/// Host memory in `Vec`s and a bump IOVA allocator that never reuses an address, so a stale IOVA always faults.
/// Also the device's side of the IOMMU for in-process tests: `device_read` / `device_write`.
pub struct HostDmaBackend {
    state: Mutex<HostState>,
    /// Pages handed out at most, to test allocation failure; None for no limit.
    page_limit: Option<usize>,
}

impl Default for HostDmaBackend {
    fn default() -> Self {
        HostDmaBackend::new(None)
    }
}

/// First IOVA handed out: high enough that an IOVA is never mistaken for a small number.
const IOVA_BASE: u64 = 0x1_0000_0000;

impl HostDmaBackend {
    pub fn new(page_limit: Option<usize>) -> HostDmaBackend {
        HostDmaBackend {
            state: Mutex::new(HostState {
                next_mem: 1,
                memory: HashMap::new(),
                iotlb: BTreeMap::new(),
                next_iova: IOVA_BASE,
            }),
            page_limit,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HostState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The device reads `buf.len()` bytes at `iova`, page by page through the IOTLB.
    pub fn device_read(&self, iova: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        let s = self.lock();
        let mut done = 0usize;
        while done < buf.len() {
            let Chunk { mem, start, n } = s.chunk(iova, done, buf.len())?;
            let bytes = s.memory.get(&mem).ok_or(BackendError::UnknownMemory(mem))?;
            buf[done..done + n].copy_from_slice(&bytes[start..start + n]);
            done += n;
        }
        Ok(())
    }

    pub fn device_write(&self, iova: u64, buf: &[u8]) -> Result<(), BackendError> {
        let mut s = self.lock();
        let mut done = 0usize;
        // Page by page, as a device writes: the pages before an unmapped one are written.
        while done < buf.len() {
            let Chunk { mem, start, n } = s.chunk(iova, done, buf.len())?;
            let bytes = s.memory.get_mut(&mem).ok_or(BackendError::UnknownMemory(mem))?;
            bytes[start..start + n].copy_from_slice(&buf[done..done + n]);
            done += n;
        }
        Ok(())
    }

    /// Pages currently mapped for the device.
    pub fn mapped_pages(&self) -> usize {
        self.lock().iotlb.len()
    }

    /// Pages of host memory currently allocated.
    pub fn allocated_pages(&self) -> usize {
        self.lock().memory.values().map(|m| m.len() / PAGE as usize).sum()
    }

    fn range(s: &HostState, mem: HostMemId, offset: usize, len: usize) -> Result<std::ops::Range<usize>, BackendError> {
        let size = s.memory.get(&mem).ok_or(BackendError::UnknownMemory(mem))?.len();
        let end =
            offset.checked_add(len).filter(|e| *e <= size).ok_or(BackendError::OutOfRange { mem, offset, len })?;
        Ok(offset..end)
    }
}

impl DmaBackend for HostDmaBackend {
    fn alloc(&self, pages: usize) -> Result<HostMemId, BackendError> {
        let mut s = self.lock();
        let in_use: usize = s.memory.values().map(|m| m.len() / PAGE as usize).sum();
        if pages == 0 || self.page_limit.is_some_and(|limit| in_use.saturating_add(pages) > limit) {
            return Err(BackendError::OutOfMemory { pages });
        }
        let bytes = pages.checked_mul(PAGE as usize).ok_or(BackendError::OutOfMemory { pages })?;
        let id = HostMemId(s.next_mem);
        s.next_mem += 1;
        s.memory.insert(id, vec![0; bytes]);
        Ok(id)
    }

    fn free(&self, mem: HostMemId) -> Result<(), BackendError> {
        let mut s = self.lock();
        s.memory.remove(&mem).ok_or(BackendError::UnknownMemory(mem))?;
        // A page freed while mapped would let the device write freed memory: drop its translations too.
        s.iotlb.retain(|_, (m, _)| *m != mem);
        Ok(())
    }

    fn read(&self, mem: HostMemId, offset: usize, buf: &mut [u8]) -> Result<(), BackendError> {
        let s = self.lock();
        let r = Self::range(&s, mem, offset, buf.len())?;
        buf.copy_from_slice(&s.memory[&mem][r]);
        Ok(())
    }

    fn write(&self, mem: HostMemId, offset: usize, buf: &[u8]) -> Result<(), BackendError> {
        let mut s = self.lock();
        let r = Self::range(&s, mem, offset, buf.len())?;
        s.memory.get_mut(&mem).ok_or(BackendError::UnknownMemory(mem))?[r].copy_from_slice(buf);
        Ok(())
    }

    fn map(&self, mem: HostMemId, first_page: usize, pages: usize) -> Result<u64, BackendError> {
        let mut s = self.lock();
        let bytes = pages.checked_mul(PAGE as usize).ok_or(BackendError::IovaExhausted { pages })?;
        Self::range(&s, mem, first_page.saturating_mul(PAGE as usize), bytes)?;
        let iova = s.next_iova;
        // One unmapped guard page after every mapping, so running off its end faults.
        let span = (pages as u64 + 1).checked_mul(PAGE).ok_or(BackendError::IovaExhausted { pages })?;
        s.next_iova = iova.checked_add(span).ok_or(BackendError::IovaExhausted { pages })?;
        for i in 0..pages {
            s.iotlb.insert(iova / PAGE + i as u64, (mem, first_page + i));
        }
        Ok(iova)
    }

    fn map_at(&self, mem: HostMemId, first_page: usize, pages: usize, iova: u64) -> Result<(), BackendError> {
        let mut s = self.lock();
        let bytes = pages.checked_mul(PAGE as usize).ok_or(BackendError::IovaExhausted { pages })?;
        Self::range(&s, mem, first_page.saturating_mul(PAGE as usize), bytes)?;
        let first = iova / PAGE;
        // A chosen address over a live mapping would silently retarget the device: refuse it, as VFIO does.
        if !iova.is_multiple_of(PAGE) || (first..first + pages as u64).any(|p| s.iotlb.contains_key(&p)) {
            return Err(BackendError::Platform(format!("iova {iova:#x} (+{pages} pages) is taken or unaligned")));
        }
        for i in 0..pages {
            s.iotlb.insert(first + i as u64, (mem, first_page + i));
        }
        Ok(())
    }

    fn unmap(&self, iova: u64, pages: usize) -> Result<(), BackendError> {
        let mut s = self.lock();
        for i in 0..pages as u64 {
            s.iotlb.remove(&(iova / PAGE + i)).ok_or(BackendError::NotMapped { iova: iova + i * PAGE })?;
        }
        Ok(())
    }

    fn revoke_device_access(&self, mem: HostMemId) -> Result<(), BackendError> {
        let mut s = self.lock();
        if !s.memory.contains_key(&mem) {
            return Err(BackendError::UnknownMemory(mem));
        }
        s.iotlb.retain(|_, (m, _)| *m != mem);
        Ok(())
    }

    /// Each allocation is one `Vec` that never grows, so its buffer stays put until `free`.
    fn host_address(&self, mem: HostMemId) -> Option<*mut u8> {
        self.lock().memory.get_mut(&mem).map(|m| m.as_mut_ptr())
    }
}
