//! Guest RAM as QEMU shares it: the SET_MEM_TABLE regions mmapped here and keyed by QEMU's virtual address, which
//! is what IOTLB entries point at. Also the GPA ↔ QEMU-address table for front-ends without an IOMMU.

use std::fs::File;
use std::sync::Arc;

use vm_memory::mmap::MmapRegionError;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, IommuMemory, MmapRegion};

use crate::iommu::DeviceIommu;

/// Everything the device reads or writes goes through this: IOVA → IOTLB → QEMU address → our mapping.
pub type GuestMem = IommuMemory<GuestMemoryMmap<()>, DeviceIommu>;

/// One SET_MEM_TABLE region as QEMU describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionDesc {
    pub guest_phys_addr: u64,
    pub memory_size: u64,
    pub userspace_addr: u64,
    pub mmap_offset: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("memory region {index} has size 0")]
    Empty { index: usize },
    #[error("memory region {index} wraps around the address space (gpa {gpa:#x}, uaddr {uaddr:#x}, size {size:#x})")]
    Overflow { index: usize, gpa: u64, uaddr: u64, size: u64 },
    #[error("memory region {index} needs {needed:#x} bytes of its fd but the file has {available:#x}")]
    BeyondFile { index: usize, needed: u64, available: u64 },
    #[error("memory region {index}: cannot inspect its fd: {source}")]
    Stat { index: usize, source: std::io::Error },
    #[error("memory region {index}: mmap failed: {source}")]
    Mmap { index: usize, source: MmapRegionError },
    #[error("memory regions overlap in QEMU's address space: {0}")]
    Overlap(String),
}

/// The regions of the current mem table, kept for address conversions without an IOMMU.
#[derive(Debug, Clone, Default)]
pub struct MemTable {
    pub regions: Vec<RegionDesc>,
}

impl MemTable {
    /// QEMU address → guest-physical address (ring addresses without an IOMMU are QEMU addresses).
    pub fn uaddr_to_gpa(&self, uaddr: u64) -> Option<u64> {
        self.regions.iter().find_map(|r| {
            let offset = uaddr.checked_sub(r.userspace_addr)?;
            (offset < r.memory_size).then(|| r.guest_phys_addr + offset)
        })
    }
}

/// Maps every region's fd and builds the QEMU-address-keyed memory. Nothing is mapped if any region is bad.
pub fn map_regions(regions: &[RegionDesc], files: Vec<File>) -> Result<GuestMemoryMmap<()>, RegionError> {
    let mut mapped = Vec::with_capacity(regions.len());
    for (index, (desc, file)) in regions.iter().zip(files).enumerate() {
        let size = desc.memory_size;
        if size == 0 {
            return Err(RegionError::Empty { index });
        }
        let overflow = RegionError::Overflow { index, gpa: desc.guest_phys_addr, uaddr: desc.userspace_addr, size };
        if desc.guest_phys_addr.checked_add(size).is_none() || desc.userspace_addr.checked_add(size).is_none() {
            return Err(overflow);
        }
        let Some(needed) = desc.mmap_offset.checked_add(size) else {
            return Err(overflow);
        };
        // Mapping past the end of the file would succeed and then SIGBUS on first touch.
        let available = file.metadata().map_err(|source| RegionError::Stat { index, source })?.len();
        if needed > available {
            return Err(RegionError::BeyondFile { index, needed, available });
        }
        let len = usize::try_from(size).map_err(|_| overflow)?;
        let region = MmapRegion::<()>::from_file(FileOffset::new(file, desc.mmap_offset), len)
            .map_err(|source| RegionError::Mmap { index, source })?;
        let region = GuestRegionMmap::new(region, GuestAddress(desc.userspace_addr)).ok_or(RegionError::Overflow {
            index,
            gpa: desc.guest_phys_addr,
            uaddr: desc.userspace_addr,
            size,
        })?;
        mapped.push(Arc::new(region));
    }
    GuestMemoryMmap::from_arc_regions(mapped).map_err(|err| RegionError::Overlap(err.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use vm_memory::{Bytes, GuestMemory, Permissions};

    fn file_of(len: usize) -> File {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&vec![0u8; len]).unwrap();
        file
    }

    #[test]
    fn regions_are_keyed_by_qemu_address_and_reached_through_the_iotlb() {
        let desc = RegionDesc {
            guest_phys_addr: 0,
            memory_size: 0x4000,
            userspace_addr: 0x7f00_0000_0000,
            mmap_offset: 0x1000,
        };
        let backend = map_regions(&[desc], vec![file_of(0x5000)]).unwrap();
        let mem = GuestMem::new(backend, DeviceIommu::new(), true, ());
        mem.iommu().update(0x9000_0000, 0x1000, 0x7f00_0000_2000, Permissions::ReadWrite).unwrap();
        mem.write_slice(b"vhca", GuestAddress(0x9000_0010)).unwrap();
        let mut out = [0u8; 4];
        mem.get_backend().read_slice(&mut out, GuestAddress(0x7f00_0000_2010)).unwrap();
        assert_eq!(&out, b"vhca");
        assert!(mem.read_slice(&mut out, GuestAddress(0x9000_1000)).is_err(), "unmapped IOVA must not resolve");
        assert!(!mem.check_range(GuestAddress(0x9000_0ff0), 0x20, Permissions::Read));
    }

    #[test]
    fn bad_regions_are_refused_with_their_cause() {
        let big = RegionDesc { guest_phys_addr: 0, memory_size: 0x10000, userspace_addr: 0x1000_0000, mmap_offset: 0 };
        assert!(matches!(map_regions(&[big], vec![file_of(0x1000)]), Err(RegionError::BeyondFile { .. })));
        let empty = RegionDesc { memory_size: 0, ..big };
        assert!(matches!(map_regions(&[empty], vec![file_of(0x1000)]), Err(RegionError::Empty { .. })));
        let wrap = RegionDesc { userspace_addr: u64::MAX - 10, memory_size: 0x1000, ..big };
        assert!(matches!(map_regions(&[wrap], vec![file_of(0x1000)]), Err(RegionError::Overflow { .. })));
        let a = RegionDesc { guest_phys_addr: 0, memory_size: 0x2000, userspace_addr: 0x1000_0000, mmap_offset: 0 };
        let b = RegionDesc { guest_phys_addr: 0x10000, userspace_addr: 0x1000_1000, ..a };
        assert!(matches!(map_regions(&[a, b], vec![file_of(0x2000), file_of(0x2000)]), Err(RegionError::Overlap(_))));
    }

    #[test]
    fn uaddr_to_gpa_uses_the_region_offsets() {
        let table = MemTable {
            regions: vec![RegionDesc {
                guest_phys_addr: 0x10_0000,
                memory_size: 0x1000,
                userspace_addr: 0x7000_0000,
                mmap_offset: 0,
            }],
        };
        assert_eq!(table.uaddr_to_gpa(0x7000_0010), Some(0x10_0010));
        assert_eq!(table.uaddr_to_gpa(0x7000_1000), None);
        assert_eq!(table.uaddr_to_gpa(0x10), None);
    }
}
