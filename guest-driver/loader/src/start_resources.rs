//! START_DEVICE's resource lists: a CM_RESOURCE_LIST in Windows' layout (one full descriptor for the PCI bus, one
//! CmResourceTypeMemory partial descriptor per memory BAR), raw and translated. On x86 PCI the bus address of a
//! memory BAR is its CPU physical address, so the two lists carry the same ranges, as Windows gives them there.
//!
//! Laid out by hand, byte by byte, at the offsets of `vhca_ntapi::resource_list_layout` (the definition vhca.sys
//! reads them with): wdm.h declares the CM_* resource structures inside `pshpack4.h`, so on x64 a
//! CM_PARTIAL_RESOURCE_DESCRIPTOR is 20 bytes with its Start at offset 4, and the first one sits 20 bytes into the
//! list (the kernel's own type information says the same: 0x14 bytes, PartialDescriptors at 0x8 of its list).
//! windows-sys 0.61 declares them without that packing (24 bytes, Start at 8), so they cannot be used here: a
//! driver reading START_DEVICE's lists through windows-sys's types misreads what Windows passes, and should.

use std::alloc::{alloc_zeroed, dealloc, Layout};

use vhca_ntapi::resource_list_layout::*;

/// One CM_RESOURCE_LIST, freed on drop.
pub struct ResourceList {
    list: *mut u8,
    layout: Layout,
}

impl ResourceList {
    /// A list of the memory ranges (start, length).
    pub fn memory(ranges: &[(u64, u32)]) -> ResourceList {
        let bytes = FIRST_DESCRIPTOR + ranges.len().max(1) * DESCRIPTOR_SIZE;
        let layout = Layout::from_size_align(bytes, 16).expect("resource list layout");
        // SAFETY: a non-zero size.
        let list = unsafe { alloc_zeroed(layout) };
        assert!(!list.is_null(), "out of memory for a resource list");
        let put = |at: usize, bytes: &[u8]| {
            // SAFETY: every offset written lies inside the block (FIRST_DESCRIPTOR + n * DESCRIPTOR_SIZE bytes).
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), list.add(at), bytes.len()) }
        };
        put(LIST_COUNT, &1u32.to_le_bytes());
        put(FULL_INTERFACE_TYPE, &PCI_BUS.to_le_bytes());
        put(FULL_BUS_NUMBER, &0u32.to_le_bytes());
        put(PARTIAL_VERSION, &1u16.to_le_bytes());
        put(PARTIAL_REVISION, &1u16.to_le_bytes());
        put(PARTIAL_COUNT, &(ranges.len() as u32).to_le_bytes());
        for (i, (start, length)) in ranges.iter().enumerate() {
            let d = FIRST_DESCRIPTOR + i * DESCRIPTOR_SIZE;
            put(d + DESCRIPTOR_TYPE, &[CM_RESOURCE_TYPE_MEMORY]);
            put(d + DESCRIPTOR_SHARE, &[SHARE_DEVICE_EXCLUSIVE]);
            put(d + DESCRIPTOR_FLAGS, &0u16.to_le_bytes()); // CM_RESOURCE_MEMORY_READ_WRITE
            put(d + MEMORY_START, &start.to_le_bytes());
            put(d + MEMORY_LENGTH, &length.to_le_bytes());
        }
        ResourceList { list, layout }
    }

    /// The list, as START_DEVICE's Parameters hold it.
    pub fn as_ptr<T>(&self) -> *mut T {
        self.list.cast()
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the whole block, initialized (zeroed, then written).
        unsafe { std::slice::from_raw_parts(self.list, self.layout.size()) }
    }
}

impl Drop for ResourceList {
    fn drop(&mut self) {
        // SAFETY: the block `memory` allocated with this layout, freed once.
        unsafe { dealloc(self.list, self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_sit_where_windows_puts_them() {
        let list = ResourceList::memory(&[(0xfebf_1000, 0x1000), (0x1_fe00_0000, 0x4000)]);
        let b = list.bytes();
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        assert_eq!((u32_at(0), u32_at(4), u32_at(16)), (1, 5, 2));
        // The second descriptor: 20 + 20 bytes in, its Start 4 bytes into it (unaligned, as pack 4 puts it).
        assert_eq!(b[40], 3);
        assert_eq!(u64::from_le_bytes(b[44..52].try_into().unwrap()), 0x1_fe00_0000);
        assert_eq!(u32_at(52), 0x4000);
        assert_eq!(b.len(), 60);
    }

    #[test]
    fn the_drivers_reader_reads_back_what_is_written() {
        let list = ResourceList::memory(&[(0xfea0_0000, 0x4000), (0xfebf_1000, 0x1000)]);
        let read: Vec<_> = partial_descriptors(list.bytes()).map(|d| (d.kind, d.start, d.length)).collect();
        assert_eq!(read, [(3, 0xfea0_0000, 0x4000), (3, 0xfebf_1000, 0x1000)]);
    }
}
