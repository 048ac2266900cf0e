//! START_DEVICE's CM_RESOURCE_LIST in Windows' x64 layout, as bytes: the offsets, and a reader of its memory
//! descriptors. Shared by vhca.sys (which reads the lists the PnP manager passes) and the loader (which writes them
//! as the PnP manager would), so both sides use one definition.
//!
//! Hand-written because no crate has the right layout: wdm.h declares the CM_* resource structures between
//! `pshpack4.h` and `poppack.h`, so on x64 a CM_PARTIAL_RESOURCE_DESCRIPTOR is 20 bytes (0x14, as the kernel's type
//! information for `_CM_PARTIAL_RESOURCE_DESCRIPTOR` says) with `u.Memory.Start` 4 bytes into the descriptor, and
//! the first descriptor sits 20 bytes into the list. windows-sys 0.61 declares the same structures unpacked (24-byte
//! descriptors, Start at 8, the first at 24): reading START_DEVICE's lists through those types misreads them.
//!
//! ```text
//! CM_RESOURCE_LIST                  CM_PARTIAL_RESOURCE_DESCRIPTOR (20 bytes, at 20 + 20 * i)
//!   0 Count (u32)                     0 Type (u8)   1 ShareDisposition (u8)   2 Flags (u16)
//!   4 List[0]: InterfaceType (u32)    4 u.Memory.Start (i64, 4-byte aligned only)
//!   8          BusNumber (u32)       12 u.Memory.Length (u32)
//!  12          Version, Revision (u16 each)
//!  16          PartialResourceList.Count (u32)
//!  20          PartialDescriptors[0]
//! ```

/// CM_RESOURCE_LIST.Count.
pub const LIST_COUNT: usize = 0;
/// List[0].InterfaceType.
pub const FULL_INTERFACE_TYPE: usize = 4;
/// List[0].BusNumber.
pub const FULL_BUS_NUMBER: usize = 8;
/// List[0].PartialResourceList.Version.
pub const PARTIAL_VERSION: usize = 12;
/// List[0].PartialResourceList.Revision.
pub const PARTIAL_REVISION: usize = 14;
/// List[0].PartialResourceList.Count.
pub const PARTIAL_COUNT: usize = 16;
/// List[0].PartialResourceList.PartialDescriptors[0].
pub const FIRST_DESCRIPTOR: usize = 20;
/// sizeof(CM_PARTIAL_RESOURCE_DESCRIPTOR) under pack(4).
pub const DESCRIPTOR_SIZE: usize = 20;
/// Offsets within a descriptor.
pub const DESCRIPTOR_TYPE: usize = 0;
pub const DESCRIPTOR_SHARE: usize = 1;
pub const DESCRIPTOR_FLAGS: usize = 2;
pub const MEMORY_START: usize = 4;
pub const MEMORY_LENGTH: usize = 12;

/// wdm.h's CmResourceTypeMemory.
pub const CM_RESOURCE_TYPE_MEMORY: u8 = 3;
/// wdm.h's INTERFACE_TYPE PCIBus.
pub const PCI_BUS: u32 = 5;
/// wdm.h's CmResourceShareDeviceExclusive.
pub const SHARE_DEVICE_EXCLUSIVE: u8 = 1;

/// One partial descriptor as read: its type, and for a memory descriptor its start and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialDescriptor {
    pub kind: u8,
    pub start: u64,
    pub length: u32,
}

/// How many bytes the list's first full descriptor spans, from its first FIRST_DESCRIPTOR bytes (the header);
/// None when the header is short or the list has no full descriptor. A PCI device's lists have exactly one.
pub fn list_bytes(header: &[u8]) -> Option<usize> {
    if read_u32(header, LIST_COUNT)? == 0 {
        return None;
    }
    let count = read_u32(header, PARTIAL_COUNT)? as usize;
    count.checked_mul(DESCRIPTOR_SIZE)?.checked_add(FIRST_DESCRIPTOR)
}

/// The partial descriptors of the list's first full descriptor; a descriptor the bytes do not hold is left out.
pub fn partial_descriptors(list: &[u8]) -> impl Iterator<Item = PartialDescriptor> + '_ {
    let count = list_bytes(list).map_or(0, |bytes| (bytes - FIRST_DESCRIPTOR) / DESCRIPTOR_SIZE);
    (0..count).map_while(move |i| {
        let d = FIRST_DESCRIPTOR + i * DESCRIPTOR_SIZE;
        Some(PartialDescriptor {
            kind: *list.get(d + DESCRIPTOR_TYPE)?,
            start: read_u64(list, d + MEMORY_START)?,
            length: read_u32(list, d + MEMORY_LENGTH)?,
        })
    })
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A list written byte by byte from wdm.h's pack(4) layout, independent of the constants above.
    fn two_bars() -> [u8; 60] {
        let mut b = [0u8; 60];
        b[0] = 1; // Count
        b[4] = 5; // PCIBus
        b[12] = 1; // Version
        b[14] = 1; // Revision
        b[16] = 2; // two partial descriptors
        b[20] = 3; // memory
        b[24..32].copy_from_slice(&0xfea0_0000u64.to_le_bytes());
        b[32..36].copy_from_slice(&0x4000u32.to_le_bytes());
        b[40] = 3;
        b[44..52].copy_from_slice(&0x1_fe00_0000u64.to_le_bytes());
        b[52..56].copy_from_slice(&0x1000u32.to_le_bytes());
        b
    }

    #[test]
    fn reads_descriptors_at_windows_offsets() {
        let b = two_bars();
        assert_eq!(list_bytes(&b[..FIRST_DESCRIPTOR]), Some(60));
        let got: alloc::vec::Vec<_> = partial_descriptors(&b).collect();
        assert_eq!(
            got,
            [
                PartialDescriptor { kind: 3, start: 0xfea0_0000, length: 0x4000 },
                PartialDescriptor { kind: 3, start: 0x1_fe00_0000, length: 0x1000 },
            ]
        );
    }

    #[test]
    fn short_or_empty_lists_give_what_they_hold() {
        let b = two_bars();
        assert_eq!(partial_descriptors(&b[..40]).count(), 1);
        assert_eq!(list_bytes(&b[..10]), None);
        let mut empty = b;
        empty[0] = 0;
        assert_eq!(partial_descriptors(&empty).count(), 0);
    }
}
