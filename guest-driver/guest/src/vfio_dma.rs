//! DMA memory for the device: pinned host memory mapped at IOVAs this driver chooses, through the VFIO container.
//! The NT model's DMA adapter sits on top of `DmaMapper`; the virtqueues and command buffers live in `DmaRegion`s.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::vfio::{Container, DmaAccess, VfioError};

pub const PAGE_SIZE: usize = vhca_proto::PAGE_SIZE as usize;

/// First IOVA handed out. Guest RAM is at most a few GiB here, so an IOVA at 64 GiB can never be mistaken for a
/// guest-physical address: a device that used a GPA where an IOVA belongs faults instead of silently working.
pub const IOVA_BASE: u64 = 0x10_0000_0000;
/// End of the IOVA window (exclusive): 512 GiB, the 39-bit address width of QEMU's intel-iommu by default.
pub const IOVA_END: u64 = 1 << 39;
/// Where a caller may choose an IOVA itself (the NT model's frames and bounce pages below a narrow device's limit,
/// vhca-ntmodel's `device_address`): below the bump window, except page 0 and the interrupt window from the IOAPIC
/// at 0xFEC0_0000 to 4 GiB, where intel-iommu reserves MSI addresses (0xFEE0_0000) and VFIO refuses mappings.
const CHOSEN_IOVA_WINDOWS: [std::ops::Range<u64>; 2] = [0x1000..0xFEC0_0000, 0x1_0000_0000..IOVA_BASE];

/// Whether `iova..iova+len` lies in one window a mapping may take: the bump window, or one a caller may choose.
fn iova_allowed(iova: u64, len: usize) -> bool {
    let Some(end) = iova.checked_add(len as u64) else { return false };
    let bump = IOVA_BASE..IOVA_END;
    std::iter::once(&bump).chain(CHOSEN_IOVA_WINDOWS.iter()).any(|w| iova >= w.start && end <= w.end)
}

#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    #[error("zero-length DMA region")]
    Empty,
    #[error("DMA region of {0:#x} bytes is too large")]
    TooLarge(usize),
    #[error("IOVA {iova:#x} (+{len:#x}) is not page aligned or leaves the windows a mapping may take")]
    BadIova { iova: u64, len: usize },
    #[error("IOVA window exhausted: {len:#x} bytes wanted at {next:#x}")]
    IovaExhausted { next: u64, len: usize },
    #[error("cannot allocate {len:#x} bytes of DMA memory: {source}")]
    Alloc { len: usize, source: std::io::Error },
    #[error("map {len:#x} bytes at IOVA {iova:#x}: {source}")]
    Map { iova: u64, len: usize, source: VfioError },
    #[error("unmap IOVA {iova:#x}: {source}")]
    Unmap { iova: u64, source: VfioError },
    #[error("unmap IOVA {iova:#x}: kernel unmapped {unmapped:#x} of {len:#x} bytes")]
    PartialUnmap { iova: u64, len: usize, unmapped: u64 },
    #[error(transparent)]
    OutOfRange(#[from] vhca_virtio::DmaRangeError),
}

/// The trait the shared virtqueue takes its memory through (vhca-virtio), implemented here by `DmaRegion`.
pub use vhca_virtio::DmaMemory;

/// Hands out IOVAs and maps memory at them. IOVAs are never reused and each region is followed by an unmapped
/// guard page, so a device overrunning a buffer or using a freed one hits an IOMMU fault, never another buffer.
#[derive(Debug)]
pub struct DmaMapper {
    container: Arc<Container>,
    iovas: Mutex<IovaSpace>,
}

/// The bump allocator behind `DmaMapper`: page-rounded ranges, one unmapped guard page after each, never reused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IovaSpace {
    next: u64,
    end: u64,
}

impl IovaSpace {
    pub fn new(start: u64, end: u64) -> IovaSpace {
        IovaSpace { next: start, end }
    }

    pub fn reserve(&mut self, len: usize) -> Result<u64, DmaError> {
        let len = region_len(len)?;
        let iova = self.next;
        let after = iova.checked_add(len as u64 + PAGE_SIZE as u64).filter(|end| *end <= self.end);
        self.next = after.ok_or(DmaError::IovaExhausted { next: iova, len })?;
        Ok(iova)
    }
}

fn round_up_to_page(len: usize) -> Option<usize> {
    len.checked_add(PAGE_SIZE - 1).map(|l| l & !(PAGE_SIZE - 1))
}

/// Page-rounded, non-zero length of a region.
fn region_len(len: usize) -> Result<usize, DmaError> {
    match round_up_to_page(len) {
        Some(0) => Err(DmaError::Empty),
        Some(rounded) => Ok(rounded),
        None => Err(DmaError::TooLarge(len)),
    }
}

impl DmaMapper {
    pub fn new(container: Arc<Container>) -> DmaMapper {
        DmaMapper { container, iovas: Mutex::new(IovaSpace::new(IOVA_BASE, IOVA_END)) }
    }

    /// Reserves the next free IOVA range of `len` bytes (page-rounded) plus a guard page.
    pub fn reserve_iova(&self, len: usize) -> Result<u64, DmaError> {
        self.iovas.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).reserve(len)
    }

    /// Fresh zeroed, pinned memory at the next free IOVA.
    pub fn alloc(&self, len: usize, access: DmaAccess) -> Result<DmaRegion, DmaError> {
        let iova = self.reserve_iova(len)?;
        self.alloc_at(iova, len, access)
    }

    /// Fresh zeroed, pinned memory at an IOVA the caller chose (page aligned, inside the window).
    pub fn alloc_at(&self, iova: u64, len: usize, access: DmaAccess) -> Result<DmaRegion, DmaError> {
        let len = region_len(len)?;
        let host = anonymous_memory(len)?;
        // SAFETY: `host` is a fresh private mapping of `len` bytes that only the region will own and unmap.
        unsafe { self.map_raw(host, len, iova, access, true) }
    }

    /// Maps memory the caller owns (e.g. a buffer an NT-model MDL describes) at `iova`.
    ///
    /// # Safety
    /// `host` must be page aligned and valid for reads and writes of `len` bytes until the returned region is
    /// unmapped or dropped; the caller keeps ownership and frees it only after that.
    pub unsafe fn map_host(
        &self,
        host: NonNull<u8>,
        len: usize,
        iova: u64,
        access: DmaAccess,
    ) -> Result<DmaRegion, DmaError> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.map_raw(host, len, iova, access, false) }
    }

    /// # Safety
    /// As `map_host`; with `owns_memory` the region also munmaps `host` when dropped.
    unsafe fn map_raw(
        &self,
        host: NonNull<u8>,
        len: usize,
        iova: u64,
        access: DmaAccess,
        owns_memory: bool,
    ) -> Result<DmaRegion, DmaError> {
        // Built first so an early return frees owned memory through Drop (unmapped regions skip the IOVA unmap).
        let mut region = DmaRegion { container: self.container.clone(), host, len, iova, owns_memory, mapped: false };
        let in_window = iova_allowed(iova, len);
        let aligned = iova.is_multiple_of(PAGE_SIZE as u64)
            && len.is_multiple_of(PAGE_SIZE)
            && (host.as_ptr() as usize).is_multiple_of(PAGE_SIZE);
        if !in_window || !aligned {
            return Err(DmaError::BadIova { iova, len });
        }
        self.container.map_dma(host.as_ptr() as u64, iova, len as u64, access).map_err(|source| DmaError::Map {
            iova,
            len,
            source,
        })?;
        region.mapped = true;
        Ok(region)
    }
}

static SHARE_HOST_MEMORY: AtomicBool = AtomicBool::new(false);

/// From now on this process's host memory is mapped shared (still anonymous, still zeroed and lazily populated):
/// what a run's process does before it makes its model when vhca.sys runs with the race watch on. The process
/// forks nothing after that point (the agent forks each run before it).
pub fn share_host_memory() {
    SHARE_HOST_MEMORY.store(true, Ordering::Relaxed);
}

fn anonymous_memory(len: usize) -> Result<NonNull<u8>, DmaError> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // Neither populated nor locked: a page is faulted in (zeroed) when first touched, by the CPU or by
    // VFIO_IOMMU_MAP_DMA, which pins the pages it maps for as long as they are mapped. What is never touched costs
    // nothing: vhca.sys reserves a 4 MiB pool block for its Rust heap in DriverEntry and uses a few hundred KB of it,
    // and populating all of it cost every vhca.sys run ~30 ms under TCG.
    // Shared when asked (`share_host_memory`): a shared mapping can be mapped a second time, which the race watch
    // runs trapped instructions through; a private one cannot.
    let sharing = if SHARE_HOST_MEMORY.load(Ordering::Relaxed) { libc::MAP_SHARED } else { libc::MAP_PRIVATE };
    let flags = sharing | libc::MAP_ANONYMOUS;
    // SAFETY: a new anonymous mapping at an address the kernel picks; no existing memory is affected.
    let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
    if ptr == libc::MAP_FAILED {
        return Err(DmaError::Alloc { len, source: std::io::Error::last_os_error() });
    }
    NonNull::new(ptr.cast::<u8>()).ok_or(DmaError::Alloc { len, source: std::io::ErrorKind::OutOfMemory.into() })
}

/// Page-aligned memory this process owns but has not mapped for the device (VFIO pins what it maps): what the NT model's backend
/// hands out as "physical pages", mapped at IOVAs later (and as often) as the model's DMA adapter decides.
#[derive(Debug)]
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the memory is owned exclusively by this value; every access goes through volatile byte copies on `&self`
// (the device may write it concurrently anyway), so sharing across threads adds no data race of Rust's own.
unsafe impl Send for HostMemory {}
// SAFETY: see Send.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// `len` bytes (page-rounded) of zeroed memory.
    pub fn new(len: usize) -> Result<HostMemory, DmaError> {
        let len = region_len(len)?;
        Ok(HostMemory { ptr: anonymous_memory(len)?, len })
    }

    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn range(&self, op: &'static str, offset: usize, len: usize) -> Result<*mut u8, DmaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.ptr.as_ptr().wrapping_add(offset)),
            _ => Err(DmaError::OutOfRange(vhca_virtio::DmaRangeError { op, offset, len, size: self.len })),
        }
    }

    /// Copies out with volatile loads: the device may have written these bytes behind the compiler's back.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DmaError> {
        let base = self.range("read", offset, out.len())?;
        for (i, byte) in out.iter_mut().enumerate() {
            // SAFETY: `range` proved offset..offset+len lies inside our mapping, which lives as long as `self`.
            *byte = unsafe { std::ptr::read_volatile(base.add(i)) };
        }
        Ok(())
    }

    /// Copies in with volatile stores: the device may read these bytes at any time.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), DmaError> {
        let base = self.range("write", offset, data.len())?;
        for (i, byte) in data.iter().enumerate() {
            // SAFETY: `range` proved offset..offset+len lies inside our mapping, which lives as long as `self`.
            unsafe { std::ptr::write_volatile(base.add(i), *byte) };
        }
        Ok(())
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what our own mmap returned; the owner of this value unmapped every IOVA
        // pointing here before dropping it (NtDmaBackend::free), so neither the CPU nor the device refers to it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// One mapping: host memory the device reaches at `iova`. Dropping it unmaps the IOVA before freeing the memory.
#[derive(Debug)]
pub struct DmaRegion {
    container: Arc<Container>,
    host: NonNull<u8>,
    len: usize,
    iova: u64,
    owns_memory: bool,
    mapped: bool,
}

// SAFETY: the region owns (or was promised exclusive use of) its memory; all shared access goes through volatile
// byte copies or the virtqueue's atomics, so moving or sharing it across threads adds no data race of Rust's own.
unsafe impl Send for DmaRegion {}
// SAFETY: see Send.
unsafe impl Sync for DmaRegion {}

// SAFETY: `host` is valid for `len` bytes while the region lives (fresh mmap or the `map_host` contract), page
// aligned (checked in `map_raw`), and the container maps exactly those bytes at `iova`.
unsafe impl DmaMemory for DmaRegion {
    fn host_ptr(&self) -> NonNull<u8> {
        self.host
    }
    fn iova(&self) -> u64 {
        self.iova
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// The guest-physical address behind a host pointer, from /proc/self/pagemap (needs CAP_SYS_ADMIN, which the
/// guest's init has). Reported next to the IOVA so a checker can tell the device used one and not the other.
pub fn guest_physical(ptr: *const u8) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let vaddr = ptr as u64;
    let mut entry = [0u8; 8];
    let pagemap = std::fs::File::open("/proc/self/pagemap")?;
    pagemap.read_exact_at(&mut entry, (vaddr / PAGE_SIZE as u64) * 8)?;
    let entry = u64::from_le_bytes(entry);
    let pfn = entry & ((1 << 55) - 1);
    if entry & (1 << 63) == 0 || pfn == 0 {
        // Not present, or the kernel hid the frame number (no CAP_SYS_ADMIN).
        return Err(std::io::Error::other(format!("no frame number for {vaddr:#x} (pagemap entry {entry:#x})")));
    }
    Ok(pfn * PAGE_SIZE as u64 + vaddr % PAGE_SIZE as u64)
}

impl DmaRegion {
    /// Guest-physical address of the region's first byte (its pages need not be physically contiguous).
    pub fn guest_physical(&self) -> std::io::Result<u64> {
        guest_physical(self.host.as_ptr())
    }

    /// Unmaps now and reports failure, which `drop` cannot.
    pub fn unmap(mut self) -> Result<(), DmaError> {
        self.unmap_iova()
    }

    fn unmap_iova(&mut self) -> Result<(), DmaError> {
        if !self.mapped {
            return Ok(());
        }
        let (iova, len) = (self.iova, self.len);
        let unmapped = self.container.unmap_dma(iova, len as u64).map_err(|source| DmaError::Unmap { iova, source })?;
        self.mapped = false;
        if unmapped != len as u64 {
            return Err(DmaError::PartialUnmap { iova, len, unmapped });
        }
        Ok(())
    }
}

impl Drop for DmaRegion {
    fn drop(&mut self) {
        // If the IOMMU mapping could not be removed the device may still write here: leak rather than free.
        if self.unmap_iova().is_err() || !self.owns_memory {
            return;
        }
        // SAFETY: `host`/`len` came from our own mmap (owns_memory), nothing refers into it any more, and the
        // device can no longer reach it because the IOVA was unmapped just above.
        unsafe { libc::munmap(self.host.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iovas_are_page_aligned_guarded_and_bounded() {
        let mut space = IovaSpace::new(IOVA_BASE, IOVA_BASE + 6 * PAGE_SIZE as u64);
        assert_eq!(space.reserve(1).unwrap(), IOVA_BASE);
        // One page used, one guard page skipped.
        assert_eq!(space.reserve(PAGE_SIZE + 1).unwrap(), IOVA_BASE + 2 * PAGE_SIZE as u64);
        assert!(matches!(space.reserve(0), Err(DmaError::Empty)));
        // 5 pages used or guarded so far; 1 page + guard does not fit in the 1 left.
        assert!(matches!(space.reserve(1), Err(DmaError::IovaExhausted { .. })));
        assert!(matches!(space.reserve(usize::MAX), Err(DmaError::TooLarge(_))));
    }

    #[test]
    fn chosen_iovas_stay_out_of_page_0_the_interrupt_window_and_past_the_end() {
        let page = PAGE_SIZE;
        assert!(iova_allowed(0xC000_0000, page));
        assert!(iova_allowed(0x8_0000_0000, page));
        assert!(iova_allowed(IOVA_BASE, page));
        assert!(!iova_allowed(0, page));
        assert!(!iova_allowed(0xFEE0_0000, page), "MSI");
        assert!(!iova_allowed(0xFEBF_F000, 2 * page), "runs into the interrupt window");
        assert!(!iova_allowed(IOVA_BASE - page as u64, 2 * page), "straddles two windows");
        assert!(!iova_allowed(IOVA_END, page));
    }

    #[test]
    fn page_rounding() {
        assert_eq!(round_up_to_page(1), Some(PAGE_SIZE));
        assert_eq!(round_up_to_page(PAGE_SIZE), Some(PAGE_SIZE));
        assert_eq!(round_up_to_page(usize::MAX), None);
    }
}
