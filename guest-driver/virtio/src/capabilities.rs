//! Finding the virtio structures in PCI config space: the vendor capabilities that name the common config, notify,
//! ISR and device config windows (virtio 1.x, 4.1.4). The capability list is the device's data and is checked.

use alloc::collections::BTreeMap;

/// Offset of the PCI command register in config space.
pub const PCI_COMMAND: usize = 0x04;
const PCI_COMMAND_MEMORY: u16 = 0x2;
const PCI_COMMAND_MASTER: u16 = 0x4;
const PCI_STATUS: usize = 0x06;
const PCI_STATUS_CAP_LIST: u16 = 0x10;
const PCI_CAPABILITY_LIST: usize = 0x34;
const PCI_CAP_ID_VNDR: u8 = 0x09;
/// Capabilities live in the standard header's 256 bytes.
pub const PCI_CONFIG_SPACE_SIZE: usize = 256;

// virtio_pci_cap.cfg_type values (virtio 1.x, 4.1.4). virtio-bindings 0.2 carries no virtio_pci module.
const CAP_COMMON: u8 = 1;
const CAP_NOTIFY: u8 = 2;
const CAP_ISR: u8 = 3;
const CAP_DEVICE: u8 = 4;
/// Common configuration structure size (virtio 1.x, 4.1.4.3, up to queue_device).
pub(crate) const COMMON_CFG_MIN_LEN: u32 = 56;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CapabilityError {
    #[error("PCI config space shorter than the header")]
    ShortHeader,
    #[error("PCI config space has no capability list")]
    NoList,
    #[error("bad or looping capability pointer {0:#x}")]
    BadPointer(usize),
    #[error("capability at {0:#x} truncated")]
    Truncated(usize),
    #[error("no virtio {0} capability")]
    Missing(&'static str),
    #[error("virtio common capability of {0} bytes, need {COMMON_CFG_MIN_LEN}")]
    ShortCommon(u32),
    #[error("virtio notify capability truncated before notify_off_multiplier")]
    ShortNotify,
}

/// Where one capability's structure lives: a BAR and a window inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapWindow {
    pub bar: u8,
    pub offset: u32,
    pub length: u32,
}

/// The virtio structures a driver needs, found in config space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioCaps {
    pub common: CapWindow,
    pub notify: CapWindow,
    pub notify_off_multiplier: u32,
    pub isr: Option<CapWindow>,
    pub device: Option<CapWindow>,
}

/// The command register value that turns on memory decoding and bus mastering, which the transport needs (vfio-pci
/// leaves both off after its reset; Windows' PCI bus driver enables decoding at start but mastering only on request).
pub fn command_with_decoding_and_mastering(command: u16) -> u16 {
    command | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER
}

fn le16(config: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(config.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

fn le32(config: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(config.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

/// Walks the capability list of a config space image. Pointers are checked against the image, and a loop or a
/// chain longer than the space could hold is an error, not a hang.
pub fn parse_capabilities(config: &[u8]) -> Result<VirtioCaps, CapabilityError> {
    let status = le16(config, PCI_STATUS).ok_or(CapabilityError::ShortHeader)?;
    if status & PCI_STATUS_CAP_LIST == 0 {
        return Err(CapabilityError::NoList);
    }
    let mut found: BTreeMap<u8, (CapWindow, usize)> = BTreeMap::new();
    let mut ptr = config.get(PCI_CAPABILITY_LIST).copied().unwrap_or(0) as usize & !3;
    let mut hops = 0;
    while ptr != 0 {
        hops += 1;
        if ptr < 0x40 || hops > (PCI_CONFIG_SPACE_SIZE - 0x40) / 4 {
            return Err(CapabilityError::BadPointer(ptr));
        }
        let header = config.get(ptr..ptr + 2).ok_or(CapabilityError::Truncated(ptr))?;
        let (id, next) = (header[0], header[1] as usize & !3);
        if id == PCI_CAP_ID_VNDR {
            // virtio_pci_cap: cap_vndr, cap_next, cap_len, cfg_type, bar, id, padding[2], offset, length.
            let cfg_type = config.get(ptr + 3).copied();
            let bar = config.get(ptr + 4).copied();
            let (offset, length) = (le32(config, ptr + 8), le32(config, ptr + 12));
            if let (Some(cfg_type), Some(bar), Some(offset), Some(length)) = (cfg_type, bar, offset, length) {
                // The spec lets a device offer several of a type, best first; drivers take the first usable one.
                // BAR numbers above 5 are reserved: such capabilities are skipped, as the spec says.
                if bar <= 5 && !found.contains_key(&cfg_type) {
                    found.insert(cfg_type, (CapWindow { bar, offset, length }, ptr));
                }
            }
        }
        ptr = next;
    }
    let common = found.get(&CAP_COMMON).map(|f| f.0).ok_or(CapabilityError::Missing("common"))?;
    if common.length < COMMON_CFG_MIN_LEN {
        return Err(CapabilityError::ShortCommon(common.length));
    }
    let (notify, notify_at) = *found.get(&CAP_NOTIFY).ok_or(CapabilityError::Missing("notify"))?;
    let notify_off_multiplier = le32(config, notify_at + 16).ok_or(CapabilityError::ShortNotify)?;
    Ok(VirtioCaps {
        common,
        notify,
        notify_off_multiplier,
        isr: found.get(&CAP_ISR).map(|f| f.0),
        device: found.get(&CAP_DEVICE).map(|f| f.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config space image with a capability list built the way QEMU's virtio-pci lays it out.
    struct ConfigBuilder {
        image: [u8; PCI_CONFIG_SPACE_SIZE],
        last_next: usize,
    }

    impl ConfigBuilder {
        fn new() -> Self {
            let mut image = [0u8; PCI_CONFIG_SPACE_SIZE];
            image[PCI_STATUS..PCI_STATUS + 2].copy_from_slice(&PCI_STATUS_CAP_LIST.to_le_bytes());
            ConfigBuilder { image, last_next: PCI_CAPABILITY_LIST }
        }

        fn cap(mut self, at: usize, id: u8, body: &[u8]) -> Self {
            self.image[self.last_next] = at as u8;
            self.image[at] = id;
            self.image[at + 1] = 0;
            self.image[at + 2..at + 2 + body.len()].copy_from_slice(body);
            self.last_next = at + 1;
            self
        }

        fn virtio(self, at: usize, cfg_type: u8, bar: u8, offset: u32, length: u32, extra: Option<u32>) -> Self {
            let mut body = vec![if extra.is_some() { 20 } else { 16 }, cfg_type, bar, 0, 0, 0];
            body.extend_from_slice(&offset.to_le_bytes());
            body.extend_from_slice(&length.to_le_bytes());
            if let Some(extra) = extra {
                body.extend_from_slice(&extra.to_le_bytes());
            }
            self.cap(at, PCI_CAP_ID_VNDR, &body)
        }
    }

    fn qemu_like() -> ConfigBuilder {
        ConfigBuilder::new()
            .cap(0x98, 0x11, &[0; 10]) // MSI-X, not ours
            .virtio(0x84, CAP_COMMON, 4, 0x0000, 0x1000, None)
            .virtio(0x70, CAP_ISR, 4, 0x1000, 0x1000, None)
            .virtio(0x60, CAP_DEVICE, 4, 0x2000, 0x1000, None)
            .virtio(0x4c, CAP_NOTIFY, 4, 0x3000, 0x1000, Some(4)) // 20 bytes: ends where the device cap starts
            .cap(0x40, 0x10, &[0; 2]) // PCI Express, not ours
    }

    #[test]
    fn finds_every_virtio_structure() {
        let caps = parse_capabilities(&qemu_like().image).unwrap();
        assert_eq!(caps.common, CapWindow { bar: 4, offset: 0, length: 0x1000 });
        assert_eq!(caps.notify, CapWindow { bar: 4, offset: 0x3000, length: 0x1000 });
        assert_eq!(caps.notify_off_multiplier, 4);
        assert_eq!(caps.isr, Some(CapWindow { bar: 4, offset: 0x1000, length: 0x1000 }));
        assert_eq!(caps.device, Some(CapWindow { bar: 4, offset: 0x2000, length: 0x1000 }));
    }

    #[test]
    fn first_capability_of_a_type_wins_and_reserved_bars_are_skipped() {
        let image = ConfigBuilder::new()
            .virtio(0x40, CAP_COMMON, 7, 0x0, 0x1000, None) // reserved BAR: skip
            .virtio(0x50, CAP_COMMON, 2, 0x100, 0x40, None)
            .virtio(0x60, CAP_COMMON, 4, 0x0, 0x1000, None)
            .virtio(0x70, CAP_NOTIFY, 2, 0x200, 0x100, Some(0))
            .image;
        let caps = parse_capabilities(&image).unwrap();
        assert_eq!(caps.common, CapWindow { bar: 2, offset: 0x100, length: 0x40 });
        assert_eq!(caps.notify_off_multiplier, 0);
        assert_eq!(caps.device, None);
    }

    #[test]
    fn missing_or_malformed_lists_are_errors() {
        let no_notify = ConfigBuilder::new().virtio(0x40, CAP_COMMON, 4, 0, 0x1000, None).image;
        assert!(matches!(parse_capabilities(&no_notify), Err(CapabilityError::Missing("notify"))));

        let short_common = ConfigBuilder::new()
            .virtio(0x40, CAP_COMMON, 4, 0, 0x20, None)
            .virtio(0x50, CAP_NOTIFY, 4, 0x3000, 0x1000, Some(4))
            .image;
        assert!(matches!(parse_capabilities(&short_common), Err(CapabilityError::ShortCommon(0x20))));

        let mut looping = qemu_like().image;
        looping[0x41] = 0x98; // PCIe cap points back to the MSI-X cap at the head of the list
        assert!(matches!(parse_capabilities(&looping), Err(CapabilityError::BadPointer(_))));

        let mut into_header = qemu_like().image;
        into_header[PCI_CAPABILITY_LIST] = 0x10;
        assert!(matches!(parse_capabilities(&into_header), Err(CapabilityError::BadPointer(0x10))));

        let mut no_list = qemu_like().image;
        no_list[PCI_STATUS] = 0;
        assert!(matches!(parse_capabilities(&no_list), Err(CapabilityError::NoList)));

        // A notify capability at the very end of config space, cut off before its multiplier.
        let truncated_notify = ConfigBuilder::new()
            .virtio(0x40, CAP_COMMON, 4, 0, 0x1000, None)
            .virtio(0xf0, CAP_NOTIFY, 4, 0x3000, 0x1000, None)
            .image;
        assert!(matches!(parse_capabilities(&truncated_notify), Err(CapabilityError::ShortNotify)));
    }
}
