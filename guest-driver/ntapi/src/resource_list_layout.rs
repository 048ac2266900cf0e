//! START_DEVICE's CM_RESOURCE_LIST in Windows' x64 layout, as bytes: the offsets of the list, of its memory and
//! interrupt descriptors, and readers of its descriptors. Shared by vhca.sys (which reads the lists the PnP manager
//! passes) and the loader (which writes them as the PnP manager would), so both sides use one definition.
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
//!
//! The interrupt descriptor's union (u.Interrupt, u.MessageInterrupt) in the same pack(4): the raw list's
//! u.MessageInterrupt.Raw says what the bus sees (the message count), the translated list's
//! u.MessageInterrupt.Translated (= u.Interrupt) what the processor sees (the DIRQL in Level, the vector, the
//! affinity), following Microsoft's "Using Interrupt Resource Descriptors".
//!
//! ```text
//!   u.MessageInterrupt.Raw                          u.Interrupt / u.MessageInterrupt.Translated
//!    4 Group (u16; Reserved without groups)          4 Level (u16, the DIRQL)
//!    6 MessageCount (u16)                            6 Group (u16)
//!    8 Vector (u32)                                  8 Vector (u32)
//!   12 Affinity (KAFFINITY, u64, 4-aligned)         12 Affinity
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
/// u.MessageInterrupt.Raw.Group and .MessageCount (raw list).
pub const INTERRUPT_RAW_GROUP: usize = 4;
pub const INTERRUPT_RAW_MESSAGE_COUNT: usize = 6;
/// u.Interrupt.Level and .Group (translated list; a line-based interrupt's raw one too).
pub const INTERRUPT_LEVEL: usize = 4;
pub const INTERRUPT_TRANSLATED_GROUP: usize = 6;
/// Vector and Affinity, at the same offsets in both lists.
pub const INTERRUPT_VECTOR: usize = 8;
pub const INTERRUPT_AFFINITY: usize = 12;

/// wdm.h's CmResourceTypeMemory.
pub const CM_RESOURCE_TYPE_MEMORY: u8 = 3;
/// wdm.h's INTERFACE_TYPE PCIBus.
pub const PCI_BUS: u32 = 5;
/// wdm.h's CmResourceShareDeviceExclusive.
pub const SHARE_DEVICE_EXCLUSIVE: u8 = 1;
/// wdm.h's CmResourceTypeInterrupt.
pub const CM_RESOURCE_TYPE_INTERRUPT: u8 = 2;
/// An interrupt descriptor's Flags: edge-triggered (every message is).
pub const CM_RESOURCE_INTERRUPT_LATCHED: u16 = 0x1;
/// An interrupt descriptor's Flags: a message-signalled interrupt (MSI or MSI-X).
pub const CM_RESOURCE_INTERRUPT_MESSAGE: u16 = 0x2;

/// One CM_PARTIAL_RESOURCE_DESCRIPTOR's bytes.
pub type Descriptor = [u8; DESCRIPTOR_SIZE];

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

/// Each partial descriptor of the list's first full descriptor, whole; one the bytes do not hold whole is left out,
/// and so is every one after it.
pub fn descriptors(list: &[u8]) -> impl Iterator<Item = &Descriptor> + '_ {
    let count = list_bytes(list).map_or(0, |bytes| (bytes - FIRST_DESCRIPTOR) / DESCRIPTOR_SIZE);
    (0..count).map_while(move |i| {
        let at = FIRST_DESCRIPTOR + i * DESCRIPTOR_SIZE;
        list.get(at..at + DESCRIPTOR_SIZE)?.try_into().ok()
    })
}

/// The partial descriptors of the list's first full descriptor, read as memory descriptors (`kind` tells which
/// are); one the bytes do not hold whole is left out.
pub fn partial_descriptors(list: &[u8]) -> impl Iterator<Item = PartialDescriptor> + '_ {
    descriptors(list).map(|d| PartialDescriptor {
        kind: d[DESCRIPTOR_TYPE],
        start: descriptor_u64(d, MEMORY_START),
        length: descriptor_u32(d, MEMORY_LENGTH),
    })
}

/// A u16 field of a descriptor at one of the offsets above. Each field lies inside the 20 bytes, so no read fails;
/// fields are little-endian and only 4-byte aligned (pack(4)), hence bytes and never a cast.
pub fn descriptor_u16(d: &Descriptor, at: usize) -> u16 {
    u16::from_le_bytes([d[at], d[at + 1]])
}

/// A u32 field of a descriptor, as `descriptor_u16`.
pub fn descriptor_u32(d: &Descriptor, at: usize) -> u32 {
    u32::from_le_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]])
}

/// A u64 field of a descriptor (Start, Affinity), as `descriptor_u16`.
pub fn descriptor_u64(d: &Descriptor, at: usize) -> u64 {
    (u64::from(descriptor_u32(d, at + 4)) << 32) | u64::from(descriptor_u32(d, at))
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
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

    #[test]
    fn interrupt_fields_sit_in_the_union_at_windows_offsets() {
        let mut b = two_bars();
        // The second descriptor as a translated message interrupt, written byte by byte: Level 11 at 4, Group 0 at
        // 6, Vector 0x62 at 8, Affinity 4 at 12 (4-byte aligned only).
        b[40..60].copy_from_slice(&[2, 1, 3, 0, 11, 0, 0, 0, 0x62, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0]);
        let d = descriptors(&b).nth(1).expect("the second descriptor");
        assert_eq!(d[DESCRIPTOR_TYPE], CM_RESOURCE_TYPE_INTERRUPT);
        assert_eq!(descriptor_u16(d, DESCRIPTOR_FLAGS), CM_RESOURCE_INTERRUPT_LATCHED | CM_RESOURCE_INTERRUPT_MESSAGE);
        assert_eq!((descriptor_u16(d, INTERRUPT_LEVEL), descriptor_u16(d, INTERRUPT_TRANSLATED_GROUP)), (11, 0));
        assert_eq!((descriptor_u32(d, INTERRUPT_VECTOR), descriptor_u64(d, INTERRUPT_AFFINITY)), (0x62, 4));
        // The raw form of the same union: Group 0 at 4, MessageCount 1 at 6.
        b[44..48].copy_from_slice(&[0, 0, 1, 0]);
        let d = descriptors(&b).nth(1).expect("the second descriptor");
        assert_eq!((descriptor_u16(d, INTERRUPT_RAW_GROUP), descriptor_u16(d, INTERRUPT_RAW_MESSAGE_COUNT)), (0, 1));
        assert_eq!(descriptors(&b[..59]).count(), 1, "a cut descriptor is left out");
    }
}
