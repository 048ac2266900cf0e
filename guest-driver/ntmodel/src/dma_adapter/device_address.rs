//! Which address the device is handed for memory the adapter maps: an IOVA of the device's domain under DMA
//! remapping, the page's physical address without it, and bounce pages below a narrow device's reach either way.
//! Also the model's physical layout behind MmGetPhysicalAddress, which only a domain without remapping honours.
//!
//! Microsoft's "Enabling DMA remapping for device drivers" (learn.microsoft.com/windows-hardware/drivers/pci/
//! enabling-dma-remapping-for-device-drivers): a driver opts in with DmaRemappingCompatible=1 (vhca.inf does), and
//! must then reach memory only through the DMA adapter's routines, whose logical addresses the IOMMU translates.
//! The page does not say what a physical address handed to the device does; the model assumes what the hardware
//! does: the domain has no translation there, so the device's access faults (the real intel-iommu refuses it in
//! the guest). Without remapping the domain is the identity: logical address equals physical address, and every
//! page of the machine is reachable, so the same driver works.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use crate::backend::{BackendError, DmaBackend, HostMemId};
use crate::memory::{Region, RegionKind};
use crate::{lock, NtModel, PAGE};

/// The model's page frames for pool, contiguous memory and common buffers: above 4 GiB (a machine with RAM there,
/// which a 32-bit device cannot reach), below the guest's own IOVA window (64 GiB, `vfio_dma::IOVA_BASE`) and
/// far from a small guest's real RAM, so a physical address is never mistaken for either.
const PHYSICAL_HIGH: Range<u64> = 0x8_0000_0000..0x10_0000_0000;
/// Frames and IOVAs below 4 GiB: bounce pages and a narrow device's common buffers. It stops short of the
/// interrupt window (IOAPIC 0xFEC0_0000, MSI 0xFEE0_0000), which the IOMMU reserves, and starts above 3 GiB,
/// where QEMU's q35 never puts RAM, so no real guest-physical address is in it.
const BELOW_4G: Range<u64> = 0xC000_0000..0xFE00_0000;

/// Where one host memory's frames are: frame of page p is `base + (p + p / run_pages) * PAGE`, a hole page after
/// every physically contiguous run (`sg_split::physical_runs`), so runs are never contiguous with each other.
#[derive(Debug, Clone, Copy)]
struct Placed {
    base: u64,
    run_pages: u64,
}

impl Placed {
    fn frame(&self, page: usize) -> u64 {
        let p = page as u64;
        self.base + (p + p / self.run_pages) * PAGE
    }
}

/// Whether a memory is placed for a device that needs it below 4 GiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    Anywhere,
    Below(u64),
}

impl Placement {
    /// Memory the device must reach wherever the rest lies: a bounce page, a narrow device's common buffer.
    pub fn within(reach: Option<u64>) -> Placement {
        reach.map_or(Placement::Anywhere, Placement::Below)
    }
}

/// The model's physical memory map and the device domain's shape.
#[derive(Debug, Default)]
pub(crate) struct PhysicalLayout {
    /// The platform's DMA remapping is off for this driver (DmaRemappingCompatible=0, or none on a system that
    /// enforces nothing): the identity domain. Off by default: vhca.inf opts in.
    pub without_remapping: bool,
    placed: HashMap<HostMemId, Placed>,
    next_high: u64,
    next_low: u64,
    /// Pages the identity domain maps (at their frames): made as the device is first handed them, kept until the
    /// memory is freed (the backend drops them then; memory ids are never reused, so a stale entry never matches).
    identity: HashSet<(HostMemId, usize)>,
}

/// What `map_for_device` gave the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DeviceAddress {
    pub iova: u64,
    /// The identity domain's: not unmapped when the transfer ends (the device reaches all memory then).
    pub identity: bool,
}

fn no_room(pages: usize) -> BackendError {
    BackendError::IovaExhausted { pages }
}

impl PhysicalLayout {
    /// Bump-allocates `span` pages (and a guard page) below 4 GiB, ending at or below `limit`.
    fn take_low(&mut self, span: u64, limit: u64) -> Option<u64> {
        let at = self.next_low.max(BELOW_4G.start);
        let end = at.checked_add(span * PAGE)?;
        (end <= BELOW_4G.end && end <= limit).then(|| {
            self.next_low = end + PAGE;
            at
        })
    }

    /// Gives `mem` (of `pages` pages, contiguous in runs of `run_pages`) its frames, once.
    fn place(&mut self, mem: HostMemId, pages: usize, run_pages: u64, placement: Placement) -> Option<Placed> {
        if let Some(p) = self.placed.get(&mem) {
            return Some(*p);
        }
        let run_pages = run_pages.max(1);
        let span = pages as u64 + (pages as u64).div_ceil(run_pages);
        let base = match placement {
            Placement::Below(limit) => self.take_low(span, limit)?,
            Placement::Anywhere => {
                let at = self.next_high.max(PHYSICAL_HIGH.start);
                let end = at.checked_add(span * PAGE).filter(|e| *e <= PHYSICAL_HIGH.end)?;
                self.next_high = end;
                at
            }
        };
        let placed = Placed { base, run_pages };
        self.placed.insert(mem, placed);
        Some(placed)
    }

    /// The frames of a region's pages, placed on first use as its kind and the fragmentation knob say.
    fn place_region(
        &mut self,
        r: &Region,
        max_contiguous_pages: Option<usize>,
        placement: Placement,
    ) -> Option<Placed> {
        let whole = matches!(r.kind, RegionKind::Contiguous | RegionKind::CommonBuffer);
        let run_pages = match max_contiguous_pages {
            Some(max) if !whole && max > 0 => max as u64,
            _ => r.pages as u64,
        };
        self.place(r.mem, r.pages, run_pages, placement)
    }

    /// Forgets a memory the model freed (a bounce page).
    pub fn forget(&mut self, mem: HostMemId) {
        self.placed.remove(&mem);
        self.identity.retain(|(m, _)| *m != mem);
    }

    /// Maps pages `first..first+pages` of `mem` at their frames in the identity domain where not yet mapped.
    fn identity_map(
        &mut self,
        backend: &dyn DmaBackend,
        mem: HostMemId,
        placed: Placed,
        first: usize,
        pages: usize,
    ) -> Result<u64, BackendError> {
        for page in first..first + pages {
            if self.identity.insert((mem, page)) {
                if let Err(e) = backend.map_at(mem, page, 1, placed.frame(page)) {
                    self.identity.remove(&(mem, page));
                    return Err(e);
                }
            }
        }
        Ok(placed.frame(first))
    }
}

impl NtModel {
    /// Hands the device pages `first..first+pages` of region `r` (one physically contiguous run): under remapping
    /// the domain's fresh IOVA (or one below the limit for `Placement::Below`), without it the pages' frames
    /// (placed below the limit if this is their first use).
    pub(super) fn map_region_for_device(
        &self,
        layout: &mut PhysicalLayout,
        r: &Region,
        first: usize,
        pages: usize,
        placement: Placement,
    ) -> Result<DeviceAddress, BackendError> {
        if layout.without_remapping {
            let placed = layout.place_region(r, self.config.max_contiguous_pages, placement).ok_or(no_room(pages))?;
            let iova = layout.identity_map(self.backend(), r.mem, placed, first, pages)?;
            return Ok(DeviceAddress { iova, identity: true });
        }
        self.map_in_domain(layout, r.mem, first, pages, placement)
    }

    /// Hands the device a bounce (or verifier shadow) memory of `pages` pages, placed for `reach`.
    pub(super) fn map_bounce_for_device(
        &self,
        layout: &mut PhysicalLayout,
        mem: HostMemId,
        pages: usize,
        reach: Option<u64>,
    ) -> Result<DeviceAddress, BackendError> {
        let placement = Placement::within(reach);
        if layout.without_remapping {
            let placed = layout.place(mem, pages, pages as u64, placement).ok_or(no_room(pages))?;
            let iova = layout.identity_map(self.backend(), mem, placed, 0, pages)?;
            return Ok(DeviceAddress { iova, identity: true });
        }
        self.map_in_domain(layout, mem, 0, pages, placement)
    }

    /// Under remapping: the backend's own fresh IOVA where the device reaches everything, else one the model picks
    /// below the reach (the HAL's bounce pages lie where the device can put them on the bus).
    fn map_in_domain(
        &self,
        layout: &mut PhysicalLayout,
        mem: HostMemId,
        first: usize,
        pages: usize,
        placement: Placement,
    ) -> Result<DeviceAddress, BackendError> {
        let iova = match placement {
            Placement::Anywhere => self.backend().map(mem, first, pages)?,
            Placement::Below(limit) => {
                let iova = layout.take_low(pages as u64, limit).ok_or(no_room(pages))?;
                self.backend().map_at(mem, first, pages, iova)?;
                iova
            }
        };
        Ok(DeviceAddress { iova, identity: false })
    }

    /// MmGetPhysicalAddress: the frame behind `va` plus its offset, 0 for an address no region holds. Without DMA
    /// remapping the identity domain maps the page, so a device handed this address reaches it; with remapping
    /// nothing does, and the device faults.
    pub fn mm_get_physical_address(&self, va: u64) -> u64 {
        let _call = self.kernel_call("MmGetPhysicalAddress");
        let mut m = lock(&self.memory);
        let Some(r) = m.region_of(va).cloned() else { return 0 };
        let page = ((va - r.base) / PAGE) as usize;
        let max = self.config.max_contiguous_pages;
        let layout = &mut m.dma.layout;
        let Some(placed) = layout.place_region(&r, max, Placement::Anywhere) else { return 0 };
        if layout.without_remapping && layout.identity_map(self.backend(), r.mem, placed, page, 1).is_err() {
            return 0;
        }
        placed.frame(page) + va % PAGE
    }

    /// Turns the platform's DMA remapping off (or back on) for this driver, as DmaRemappingCompatible=0 would:
    /// before the driver maps anything (the layout of what is already mapped does not change).
    pub fn set_dma_remapping(&self, on: bool) {
        lock(&self.memory).dma.layout.without_remapping = !on;
    }

    /// Whether the platform remaps DMA for this driver.
    pub fn dma_remapping(&self) -> bool {
        !lock(&self.memory).dma.layout.without_remapping
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_leave_a_hole_after_every_run_and_low_placements_stay_below_the_limit() {
        let mut layout = PhysicalLayout::default();
        let p = layout.place(HostMemId(1), 4, 2, Placement::Anywhere).unwrap();
        assert_eq!(p.frame(1), p.frame(0) + PAGE, "contiguous inside a run");
        assert_eq!(p.frame(2), p.frame(1) + 2 * PAGE, "a hole between runs");
        assert!(p.frame(0) >= 1 << 32);
        let low = layout.place(HostMemId(2), 3, 3, Placement::Below(1 << 32)).unwrap();
        assert!(low.frame(2) + PAGE <= 1 << 32);
        assert!(layout.place(HostMemId(3), 1, 1, Placement::Below(1 << 24)).is_none(), "nothing below 16 MiB");
    }
}
