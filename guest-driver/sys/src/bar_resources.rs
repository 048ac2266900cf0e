//! Which translated memory resource is which BAR. The PnP manager hands START_DEVICE the raw and translated
//! resource lists in the same order but without BAR numbers; a raw memory resource starts at the bus address the
//! BAR holds, so matching the BAR registers in config space against the raw starts names each translated entry.

use alloc::vec::Vec;

use vhca_ntapi::resource_list_layout::{partial_descriptors, CM_RESOURCE_TYPE_MEMORY};

/// One CmResourceTypeMemory descriptor from START_DEVICE: raw (bus) start, translated (CPU physical) start, and
/// the length, taken at the same index of the two lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryResource {
    pub raw_start: u64,
    pub translated_start: u64,
    pub length: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarError {
    /// BAR number above 5.
    NoSuchBar(u8),
    /// The BAR decodes I/O space; virtio structures are in memory BARs.
    IoBar(u8),
    /// The upper half of a 64-bit BAR, or a 64-bit BAR in slot 5 with no room for its upper half.
    BadLayout(u8),
    /// No memory resource starts where the BAR points (unassigned BAR, or the resources are for another device).
    NoResource { bar: u8, address: u64 },
}

impl core::fmt::Display for BarError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            BarError::NoSuchBar(b) => write!(f, "BAR{b} does not exist"),
            BarError::IoBar(b) => write!(f, "BAR{b} is an I/O BAR"),
            BarError::BadLayout(b) => write!(f, "BAR{b} is not the start of a memory BAR"),
            BarError::NoResource { bar, address } => {
                write!(f, "no memory resource starts at BAR{bar}'s address {address:#x}")
            }
        }
    }
}

const BAR0: usize = 0x10;

fn bar_register(config: &[u8], index: usize) -> u32 {
    let at = BAR0 + 4 * index;
    config.get(at..at + 4).map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// The bus address BAR `bar` decodes, from a config space image (PCI 3.0, 6.2.5.1).
pub fn bar_address(config: &[u8], bar: u8) -> Result<u64, BarError> {
    let index = bar as usize;
    if index > 5 {
        return Err(BarError::NoSuchBar(bar));
    }
    // The slot before a 64-bit memory BAR holds our upper half: then `bar` is not a BAR of its own.
    if index > 0 {
        let before = bar_register(config, index - 1);
        if before & 1 == 0 && (before >> 1) & 3 == 2 {
            return Err(BarError::BadLayout(bar));
        }
    }
    let low = bar_register(config, index);
    if low & 1 == 1 {
        return Err(BarError::IoBar(bar));
    }
    let base = (low & !0xf) as u64;
    match (low >> 1) & 3 {
        2 if index == 5 => Err(BarError::BadLayout(bar)),
        2 => Ok(base | (bar_register(config, index + 1) as u64) << 32),
        _ => Ok(base),
    }
}

/// The translated resource for BAR `bar`: where to map it (CPU physical address) and how long it is.
pub fn locate_bar(config: &[u8], bar: u8, resources: &[MemoryResource]) -> Result<MemoryResource, BarError> {
    let address = bar_address(config, bar)?;
    resources
        .iter()
        .find(|r| r.raw_start == address && address != 0)
        .copied()
        .ok_or(BarError::NoResource { bar, address })
}

/// The memory resources of START_DEVICE's raw and translated CM_RESOURCE_LISTs, given as their bytes: the
/// descriptors at the same index of the two lists, read in Windows' pack(4) layout (`resource_list_layout`), never
/// through windows-sys's unpacked CM_* types, which put every descriptor 4 bytes too far.
/// CmResourceTypeMemoryLarge (BARs past 4 GiB in length) is not handled: vhca's BARs are small.
pub fn memory_resources(raw: &[u8], translated: &[u8]) -> Vec<MemoryResource> {
    partial_descriptors(raw)
        .zip(partial_descriptors(translated))
        .filter(|(r, t)| r.kind == CM_RESOURCE_TYPE_MEMORY && t.kind == CM_RESOURCE_TYPE_MEMORY)
        .map(|(r, t)| MemoryResource { raw_start: r.start, translated_start: t.start, length: t.length as u64 })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// START_DEVICE's list for QEMU's virtio-pci BARs as wdm.h lays it out (pack 4), byte by byte: BAR1's 4 KiB
    /// MSI-X table then BAR4's 16 KiB at 0x1_fe000000. Read with 24-byte descriptors (windows-sys's layout) the
    /// second start would come from the wrong bytes and BAR4 would find no resource, as vhca.sys did under QEMU.
    fn windows_list(first: u64) -> [u8; 60] {
        let mut b = [0u8; 60];
        b[0] = 1;
        b[4] = 5;
        b[12] = 1;
        b[14] = 1;
        b[16] = 2;
        b[20] = 3;
        b[24..32].copy_from_slice(&first.to_le_bytes());
        b[32..36].copy_from_slice(&0x1000u32.to_le_bytes());
        b[40] = 3;
        b[44..52].copy_from_slice(&0x1_fe00_0000u64.to_le_bytes());
        b[52..56].copy_from_slice(&0x4000u32.to_le_bytes());
        b
    }

    #[test]
    fn start_device_lists_are_read_in_windows_layout() {
        let (raw, translated) = (windows_list(0xfebf_1000), windows_list(0xfebf_1000));
        let resources = memory_resources(&raw, &translated);
        assert_eq!(
            resources,
            [
                MemoryResource { raw_start: 0xfebf_1000, translated_start: 0xfebf_1000, length: 0x1000 },
                MemoryResource { raw_start: 0x1_fe00_0000, translated_start: 0x1_fe00_0000, length: 0x4000 },
            ]
        );
        assert_eq!(locate_bar(&config(), 4, &resources).map(|r| r.length), Ok(0x4000));
    }

    /// QEMU's virtio-pci layout: BAR1 a 32-bit MSI-X table, BAR4+5 the 64-bit prefetchable virtio BAR.
    fn config() -> [u8; 256] {
        let mut c = [0u8; 256];
        c[0x14..0x18].copy_from_slice(&0xfebf_1000u32.to_le_bytes());
        c[0x20..0x24].copy_from_slice(&(0xfe00_0000u32 | 0b1100).to_le_bytes());
        c[0x24..0x28].copy_from_slice(&0x1u32.to_le_bytes());
        c[0x18..0x1c].copy_from_slice(&0xc001u32.to_le_bytes()); // BAR2: I/O
        c
    }

    const RESOURCES: [MemoryResource; 2] = [
        MemoryResource { raw_start: 0xfebf_1000, translated_start: 0xfebf_1000, length: 0x1000 },
        MemoryResource { raw_start: 0x1_fe00_0000, translated_start: 0x8_0000_0000, length: 0x4000 },
    ];

    #[test]
    fn each_bar_finds_its_translated_resource() {
        assert_eq!(bar_address(&config(), 4), Ok(0x1_fe00_0000));
        assert_eq!(locate_bar(&config(), 4, &RESOURCES), Ok(RESOURCES[1]));
        assert_eq!(locate_bar(&config(), 1, &RESOURCES), Ok(RESOURCES[0]));
    }

    #[test]
    fn wrong_bars_are_refused_with_the_cause() {
        assert_eq!(bar_address(&config(), 5), Err(BarError::BadLayout(5)));
        assert_eq!(bar_address(&config(), 2), Err(BarError::IoBar(2)));
        assert_eq!(bar_address(&config(), 6), Err(BarError::NoSuchBar(6)));
        assert_eq!(locate_bar(&config(), 0, &RESOURCES), Err(BarError::NoResource { bar: 0, address: 0 }));
        let moved = [MemoryResource { raw_start: 0x2_0000_0000, ..RESOURCES[1] }];
        assert_eq!(locate_bar(&config(), 4, &moved), Err(BarError::NoResource { bar: 4, address: 0x1_fe00_0000 }));
    }
}
