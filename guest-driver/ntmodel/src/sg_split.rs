//! How a buffer becomes scatter/gather elements: the physically contiguous runs of its pages (the model's page
//! frames), each mapped for the device on its own, then cut to the adapter's maximum segment.

use vhca_ntapi::{PHYSICAL_ADDRESS, SCATTER_GATHER_ELEMENT};

use crate::memory::{Region, RegionKind};
use crate::PAGE;

/// A stretch of a buffer whose pages are physically contiguous: bytes `va..va+len`, on pages `first_page..` of
/// its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PhysicalRun {
    pub va: u64,
    pub len: u32,
    pub first_page: usize,
    pub pages: usize,
}

/// One range the device was given: bytes `va..va+len` of the buffer (or its shadow) at `iova` (the first page's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceRun {
    pub va: u64,
    pub len: u32,
    pub iova: u64,
    pub pages: usize,
}

impl DeviceRun {
    /// The device address of the run's first byte: the page's IOVA plus the byte's offset in its page.
    pub fn logical(&self) -> u64 {
        self.iova + self.va % PAGE
    }
}

/// The model's page frames: a region the allocator must make physically contiguous (contiguous memory, common
/// buffers) is one run; pool and user pages are contiguous in runs of at most `max_contiguous_pages` (the
/// fragmentation knob: the longest run the machine can still find), counted from the region's first page, as a
/// fragmented machine hands a large allocation the runs it has. Without the knob every region is one run.
pub(crate) fn physical_runs(r: &Region, va: u64, len: u32, max_contiguous_pages: Option<usize>) -> Vec<PhysicalRun> {
    let whole = matches!(r.kind, RegionKind::Contiguous | RegionKind::CommonBuffer);
    let run_pages = match max_contiguous_pages {
        Some(max) if !whole && max > 0 => max as u64,
        _ => r.pages as u64,
    };
    let end = va + len as u64;
    let mut runs = Vec::new();
    let mut at = va;
    while at < end {
        let page = (at - r.base) / PAGE;
        let run_end_page = (page / run_pages + 1) * run_pages;
        let run_end = (r.base + run_end_page * PAGE).min(end);
        let pages = (run_end - at + at % PAGE).div_ceil(PAGE) as usize;
        runs.push(PhysicalRun { va: at, len: (run_end - at) as u32, first_page: page as usize, pages });
        at = run_end;
    }
    runs
}

/// The elements the device gets for `runs`, each at most `max_segment` bytes. A run longer than that is cut at
/// page boundaries (when the segment is at least a page) so that no two elements share a page: a driver that
/// builds a page list from the elements, as the HCA's REG_MR does, sees each page once.
pub(crate) fn elements(runs: &[DeviceRun], max_segment: Option<u32>) -> Vec<SCATTER_GATHER_ELEMENT> {
    let mut out = Vec::new();
    for run in runs {
        let mut offset = 0u64;
        while offset < run.len as u64 {
            let at = run.va + offset;
            let left = run.len as u64 - offset;
            let n = match max_segment {
                Some(max) if (max as u64) < left => {
                    let max = max as u64;
                    let aligned = (at + max) / PAGE * PAGE;
                    if max >= PAGE && aligned > at {
                        aligned - at
                    } else {
                        max.max(1)
                    }
                }
                _ => left,
            };
            let address = run.iova + run.va % PAGE + offset;
            out.push(SCATTER_GATHER_ELEMENT { Address: PHYSICAL_ADDRESS(address), Length: n as u32 });
            offset += n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostMemId;

    fn region(kind: RegionKind, pages: usize) -> Region {
        Region { base: 0x10_0000, bytes: pages as u64 * PAGE, pages, mem: HostMemId(1), kind, tag: 0, locks: 0 }
    }

    #[test]
    fn a_fragmented_pool_buffer_is_one_run_per_stretch_of_contiguous_frames() {
        let r = region(RegionKind::NonPagedPool, 5);
        // 0x100 into page 0 up to 0x80 into page 4, frames contiguous in pairs.
        let runs = physical_runs(&r, r.base + 0x100, 4 * 4096 - 0x80, Some(2));
        let got: Vec<_> = runs.iter().map(|x| (x.va - r.base, x.len, x.first_page, x.pages)).collect();
        assert_eq!(got, vec![(0x100, 0x2000 - 0x100, 0, 2), (0x2000, 0x2000, 2, 2), (0x4000, 0x80, 4, 1)]);
        assert_eq!(runs.iter().map(|x| x.len).sum::<u32>(), 4 * 4096 - 0x80, "the runs cover the buffer");
    }

    #[test]
    fn contiguous_memory_and_an_unfragmented_machine_give_one_run() {
        let contiguous = region(RegionKind::Contiguous, 8);
        assert_eq!(physical_runs(&contiguous, contiguous.base + 10, 8 * 4096 - 10, Some(2)).len(), 1);
        let pool = region(RegionKind::PagedPool, 8);
        assert_eq!(physical_runs(&pool, pool.base, 8 * 4096, None).len(), 1);
    }

    #[test]
    fn a_long_run_is_cut_to_the_maximum_segment_on_page_boundaries() {
        let run = DeviceRun { va: 0x5000 + 0x200, len: 3 * 4096, iova: 0x9_0000, pages: 4 };
        let got: Vec<_> = elements(&[run], Some(8192)).iter().map(|e| (e.Address.0, e.Length)).collect();
        // 0x200 into its page: the first element stops at the second page's end, the next starts on a page.
        assert_eq!(got, vec![(0x9_0200, 0x2000 - 0x200), (0x9_2000, 0x1200)]);
        let whole: Vec<_> = elements(&[run], None).iter().map(|e| (e.Address.0, e.Length)).collect();
        assert_eq!(whole, vec![(0x9_0200, 3 * 4096)]);
        let small: Vec<_> = elements(&[run], Some(1000)).iter().map(|e| e.Length).collect();
        assert!(small.iter().all(|l| *l <= 1000) && small.iter().sum::<u32>() == 3 * 4096);
    }
}
