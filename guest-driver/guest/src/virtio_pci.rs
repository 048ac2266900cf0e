//! virtio-pci modern transport over VFIO: vendor capabilities, common config, feature negotiation, queue setup,
//! notification and the device config window. Register access goes through `vfio::Region`, bounds-checked.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::vfio::{Device, Region, VfioError, CONFIG_REGION};

pub const STATUS_ACKNOWLEDGE: u8 = 1;
pub const STATUS_DRIVER: u8 = 2;
pub const STATUS_DRIVER_OK: u8 = 4;
pub const STATUS_FEATURES_OK: u8 = 8;
pub const STATUS_NEEDS_RESET: u8 = 0x40;
pub const STATUS_FAILED: u8 = 0x80;

pub const F_VERSION_1: u64 = 1 << 32;
pub const F_ACCESS_PLATFORM: u64 = 1 << 33;

const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 0x2;
const PCI_COMMAND_MASTER: u16 = 0x4;
const PCI_STATUS: usize = 0x06;
const PCI_STATUS_CAP_LIST: u16 = 0x10;
const PCI_CAPABILITY_LIST: usize = 0x34;
const PCI_CAP_ID_VNDR: u8 = 0x09;
/// Capabilities live in the standard header's 256 bytes.
pub const PCI_CONFIG_SPACE_SIZE: usize = 256;

const CAP_COMMON: u8 = 1;
const CAP_NOTIFY: u8 = 2;
const CAP_ISR: u8 = 3;
const CAP_DEVICE: u8 = 4;

// Common configuration register offsets (virtio 1.x, 4.1.4.3).
const DEVICE_FEATURE_SELECT: u64 = 0;
const DEVICE_FEATURE: u64 = 4;
const DRIVER_FEATURE_SELECT: u64 = 8;
const DRIVER_FEATURE: u64 = 12;
const NUM_QUEUES: u64 = 18;
const DEVICE_STATUS: u64 = 20;
const CONFIG_GENERATION: u64 = 21;
const QUEUE_SELECT: u64 = 22;
const QUEUE_SIZE: u64 = 24;
const QUEUE_ENABLE: u64 = 28;
const QUEUE_NOTIFY_OFF: u64 = 30;
const QUEUE_DESC: u64 = 32;
const QUEUE_DRIVER: u64 = 40;
const QUEUE_DEVICE: u64 = 48;
const COMMON_CFG_MIN_LEN: u32 = 56;

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("PCI config space: {0}")]
    Config(String),
    #[error("no virtio {0} capability")]
    MissingCapability(&'static str),
    #[error("virtio {kind} capability: {why}")]
    BadCapability { kind: &'static str, why: String },
    #[error(transparent)]
    Vfio(#[from] VfioError),
    #[error("device did not finish reset within {0:?} (status {1:#x})")]
    ResetTimeout(Duration, u8),
    #[error("device lacks required features {missing:#x} (offers {offered:#x}){hint}")]
    MissingFeatures { missing: u64, offered: u64, hint: &'static str },
    #[error("device refused FEATURES_OK (status {0:#x}) for features {1:#x}")]
    FeaturesRefused(u8, u64),
    #[error("device status {0:#x} after DRIVER_OK: it failed or needs reset")]
    DeviceFailed(u8),
    #[error("queue {0} is not available (size 0)")]
    QueueUnavailable(u16),
    #[error("queue {queue}: notify offset {offset:#x} outside the {len:#x}-byte notify window")]
    NotifyOutOfRange { queue: u16, offset: u64, len: u32 },
    #[error("device config changed {0} times while being read")]
    ConfigUnstable(u32),
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

fn le16(config: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(config.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

fn le32(config: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(config.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

/// Walks the capability list of a config space image. The list is the device's data: pointers are checked against
/// the image, and a loop or a chain longer than the space could hold is an error, not a hang.
pub fn parse_capabilities(config: &[u8]) -> Result<VirtioCaps, TransportError> {
    let status = le16(config, PCI_STATUS).ok_or(TransportError::Config("shorter than the header".into()))?;
    if status & PCI_STATUS_CAP_LIST == 0 {
        return Err(TransportError::Config("no capability list".into()));
    }
    let mut found: BTreeMap<u8, (CapWindow, usize)> = BTreeMap::new();
    let mut ptr = config.get(PCI_CAPABILITY_LIST).copied().unwrap_or(0) as usize & !3;
    let mut hops = 0;
    while ptr != 0 {
        hops += 1;
        if ptr < 0x40 || hops > (PCI_CONFIG_SPACE_SIZE - 0x40) / 4 {
            return Err(TransportError::Config(format!("bad or looping capability pointer {ptr:#x}")));
        }
        let header =
            config.get(ptr..ptr + 2).ok_or(TransportError::Config(format!("capability at {ptr:#x} truncated")))?;
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
    let common = found.get(&CAP_COMMON).map(|f| f.0).ok_or(TransportError::MissingCapability("common"))?;
    if common.length < COMMON_CFG_MIN_LEN {
        let why = format!("{} bytes, need {COMMON_CFG_MIN_LEN}", common.length);
        return Err(TransportError::BadCapability { kind: "common", why });
    }
    let (notify, notify_at) = *found.get(&CAP_NOTIFY).ok_or(TransportError::MissingCapability("notify"))?;
    let notify_off_multiplier = le32(config, notify_at + 16).ok_or(TransportError::BadCapability {
        kind: "notify",
        why: "truncated before notify_off_multiplier".into(),
    })?;
    Ok(VirtioCaps {
        common,
        notify,
        notify_off_multiplier,
        isr: found.get(&CAP_ISR).map(|f| f.0),
        device: found.get(&CAP_DEVICE).map(|f| f.0),
    })
}

/// A capability's window inside its BAR: offsets are relative to the window and checked against its length.
#[derive(Debug, Clone)]
struct Window {
    bar: Arc<Region>,
    base: u64,
    len: u32,
}

impl Window {
    fn at(&self, offset: u64, width: u64) -> Result<u64, VfioError> {
        if offset.checked_add(width).is_some_and(|end| end <= self.len as u64) {
            Ok(self.base + offset)
        } else {
            let info = self.bar.info();
            Err(VfioError::OutOfRange {
                index: info.index,
                what: "capability window",
                offset,
                len: width as usize,
                size: self.len as u64,
            })
        }
    }
    fn r8(&self, o: u64) -> Result<u8, VfioError> {
        self.bar.read_u8(self.at(o, 1)?)
    }
    fn r16(&self, o: u64) -> Result<u16, VfioError> {
        self.bar.read_u16(self.at(o, 2)?)
    }
    fn r32(&self, o: u64) -> Result<u32, VfioError> {
        self.bar.read_u32(self.at(o, 4)?)
    }
    fn w8(&self, o: u64, v: u8) -> Result<(), VfioError> {
        self.bar.write_u8(self.at(o, 1)?, v)
    }
    fn w16(&self, o: u64, v: u16) -> Result<(), VfioError> {
        self.bar.write_u16(self.at(o, 2)?, v)
    }
    fn w32(&self, o: u64, v: u32) -> Result<(), VfioError> {
        self.bar.write_u32(self.at(o, 4)?, v)
    }
    /// 64-bit registers as two 32-bit halves, low first: every transport must accept that.
    fn w64(&self, o: u64, v: u64) -> Result<(), VfioError> {
        self.w32(o, v as u32)?;
        self.w32(o + 4, (v >> 32) as u32)
    }
}

/// Writes to one queue's doorbell: `queue_notify_off * notify_off_multiplier` into the notify window.
#[derive(Debug, Clone)]
pub struct QueueNotifier {
    window: Window,
    offset: u64,
    queue: u16,
}

impl QueueNotifier {
    pub fn notify(&self) -> Result<(), VfioError> {
        self.window.w16(self.offset, self.queue)
    }

    /// Byte offset of the doorbell inside the notify BAR, for reports.
    pub fn bar_offset(&self) -> u64 {
        self.window.base + self.offset
    }
}

/// A virtio-pci modern device driven through VFIO.
#[derive(Debug)]
pub struct VirtioPci {
    pub caps: VirtioCaps,
    common: Window,
    notify: Window,
    device_cfg: Option<Window>,
    /// Kept so mapped BARs stay mapped while the windows use them.
    _bars: BTreeMap<u8, Arc<Region>>,
}

impl VirtioPci {
    /// Reads config space, finds the capabilities, opens the BARs they name and enables memory decoding and bus
    /// mastering (vfio-pci leaves both off after its reset).
    pub fn open(device: &Device) -> Result<VirtioPci, TransportError> {
        let config = device.region(CONFIG_REGION)?;
        let mut image = [0u8; PCI_CONFIG_SPACE_SIZE];
        config.pread(0, &mut image)?;
        let caps = parse_capabilities(&image)?;

        let mut bars = BTreeMap::new();
        let mut window = |kind: &'static str, cap: CapWindow| -> Result<Window, TransportError> {
            let bar = match bars.get(&cap.bar) {
                Some(bar) => Arc::clone(bar),
                None => {
                    let bar = Arc::new(device.region(cap.bar as u32)?);
                    bars.insert(cap.bar, Arc::clone(&bar));
                    bar
                }
            };
            let end = (cap.offset as u64).checked_add(cap.length as u64);
            if !matches!(end, Some(end) if end <= bar.info().size) {
                let why = format!(
                    "window {:#x}+{:#x} outside BAR{} of {:#x} bytes",
                    cap.offset,
                    cap.length,
                    cap.bar,
                    bar.info().size
                );
                return Err(TransportError::BadCapability { kind, why });
            }
            Ok(Window { bar, base: cap.offset as u64, len: cap.length })
        };
        let common = window("common", caps.common)?;
        let notify = window("notify", caps.notify)?;
        let device_cfg = caps.device.map(|cap| window("device", cap)).transpose()?;

        let command = config.read_u16(PCI_COMMAND)?;
        config.write_u16(PCI_COMMAND, command | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER)?;
        Ok(VirtioPci { caps, common, notify, device_cfg, _bars: bars })
    }

    /// Whether the BAR holding the common config is mmapped (else every access is a pread/pwrite syscall).
    pub fn mmio_mapped(&self) -> bool {
        self.common.bar.is_mapped()
    }

    pub fn status(&self) -> Result<u8, TransportError> {
        Ok(self.common.r8(DEVICE_STATUS)?)
    }

    /// Sets bits on top of the current status, as the init sequence requires.
    pub fn add_status(&self, bits: u8) -> Result<(), TransportError> {
        let status = self.status()?;
        Ok(self.common.w8(DEVICE_STATUS, status | bits)?)
    }

    /// Writes 0 and waits for the device to read back 0: only then is the reset complete.
    pub fn reset(&self, timeout: Duration) -> Result<(), TransportError> {
        self.common.w8(DEVICE_STATUS, 0)?;
        let deadline = Instant::now() + timeout;
        loop {
            let status = self.status()?;
            if status == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(TransportError::ResetTimeout(timeout, status));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    pub fn device_features(&self) -> Result<u64, TransportError> {
        self.common.w32(DEVICE_FEATURE_SELECT, 0)?;
        let low = self.common.r32(DEVICE_FEATURE)? as u64;
        self.common.w32(DEVICE_FEATURE_SELECT, 1)?;
        let high = self.common.r32(DEVICE_FEATURE)? as u64;
        Ok(low | (high << 32))
    }

    /// Accepts `required` (all must be offered) plus whatever of `optional` is offered, then sets FEATURES_OK and
    /// checks that it stuck. Returns the negotiated set.
    pub fn negotiate(&self, required: u64, optional: u64) -> Result<u64, TransportError> {
        let offered = self.device_features()?;
        let missing = required & !offered;
        if missing != 0 {
            let hint = if missing & F_ACCESS_PLATFORM != 0 {
                " (VIRTIO_F_ACCESS_PLATFORM: start the device with iommu_platform=on, and the backend must offer bit 33)"
            } else {
                ""
            };
            return Err(TransportError::MissingFeatures { missing, offered, hint });
        }
        let accepted = required | (optional & offered);
        self.common.w32(DRIVER_FEATURE_SELECT, 0)?;
        self.common.w32(DRIVER_FEATURE, accepted as u32)?;
        self.common.w32(DRIVER_FEATURE_SELECT, 1)?;
        self.common.w32(DRIVER_FEATURE, (accepted >> 32) as u32)?;
        self.add_status(STATUS_FEATURES_OK)?;
        let status = self.status()?;
        if status & STATUS_FEATURES_OK == 0 {
            return Err(TransportError::FeaturesRefused(status, accepted));
        }
        Ok(accepted)
    }

    pub fn num_queues(&self) -> Result<u16, TransportError> {
        Ok(self.common.r16(NUM_QUEUES)?)
    }

    /// The largest size the device allows for queue `index` (0: the queue does not exist).
    pub fn queue_max_size(&self, index: u16) -> Result<u16, TransportError> {
        self.common.w16(QUEUE_SELECT, index)?;
        Ok(self.common.r16(QUEUE_SIZE)?)
    }

    /// Programs a queue's size and ring IOVAs, enables it, and returns its doorbell.
    pub fn setup_queue(&self, index: u16, size: u16, rings: [u64; 3]) -> Result<QueueNotifier, TransportError> {
        self.common.w16(QUEUE_SELECT, index)?;
        if self.common.r16(QUEUE_SIZE)? == 0 {
            return Err(TransportError::QueueUnavailable(index));
        }
        self.common.w16(QUEUE_SIZE, size)?;
        self.common.w64(QUEUE_DESC, rings[0])?;
        self.common.w64(QUEUE_DRIVER, rings[1])?;
        self.common.w64(QUEUE_DEVICE, rings[2])?;
        let notify_off = self.common.r16(QUEUE_NOTIFY_OFF)? as u64;
        self.common.w16(QUEUE_ENABLE, 1)?;
        let offset = notify_off * self.caps.notify_off_multiplier as u64;
        if !matches!(offset.checked_add(2), Some(end) if end <= self.notify.len as u64) {
            return Err(TransportError::NotifyOutOfRange { queue: index, offset, len: self.notify.len });
        }
        Ok(QueueNotifier { window: self.notify.clone(), offset, queue: index })
    }

    /// Sets DRIVER_OK and checks the device did not give up on the way.
    pub fn driver_ok(&self) -> Result<(), TransportError> {
        self.add_status(STATUS_DRIVER_OK)?;
        let status = self.status()?;
        if status & (STATUS_FAILED | STATUS_NEEDS_RESET) != 0 {
            return Err(TransportError::DeviceFailed(status));
        }
        Ok(())
    }

    /// Reads `len` bytes of device config (None when the device has no device config capability). Retries while
    /// config_generation changes, so the bytes come from one consistent snapshot. Read in 32-bit units where
    /// possible: a vhost-user front-end may forward every access to the backend as a GET_CONFIG.
    pub fn read_device_config(&self, len: usize) -> Result<Option<Vec<u8>>, TransportError> {
        let Some(window) = &self.device_cfg else { return Ok(None) };
        const ATTEMPTS: u32 = 5;
        for _ in 0..ATTEMPTS {
            let before = self.common.r8(CONFIG_GENERATION)?;
            let mut bytes = Vec::with_capacity(len);
            while bytes.len() < len {
                let at = bytes.len() as u64;
                if len - bytes.len() >= 4 {
                    bytes.extend_from_slice(&window.r32(at)?.to_le_bytes());
                } else {
                    bytes.push(window.r8(at)?);
                }
            }
            if self.common.r8(CONFIG_GENERATION)? == before {
                return Ok(Some(bytes));
            }
        }
        Err(TransportError::ConfigUnstable(ATTEMPTS))
    }
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
        assert!(matches!(parse_capabilities(&no_notify), Err(TransportError::MissingCapability("notify"))));

        let short_common = ConfigBuilder::new()
            .virtio(0x40, CAP_COMMON, 4, 0, 0x20, None)
            .virtio(0x50, CAP_NOTIFY, 4, 0x3000, 0x1000, Some(4))
            .image;
        assert!(matches!(parse_capabilities(&short_common), Err(TransportError::BadCapability { kind: "common", .. })));

        let mut looping = qemu_like().image;
        looping[0x41] = 0x98; // PCIe cap points back to the MSI-X cap at the head of the list
        assert!(matches!(parse_capabilities(&looping), Err(TransportError::Config(_))));

        let mut into_header = qemu_like().image;
        into_header[PCI_CAPABILITY_LIST] = 0x10;
        assert!(matches!(parse_capabilities(&into_header), Err(TransportError::Config(_))));

        let mut no_list = qemu_like().image;
        no_list[PCI_STATUS] = 0;
        assert!(matches!(parse_capabilities(&no_list), Err(TransportError::Config(_))));

        // A notify capability at the very end of config space, cut off before its multiplier.
        let truncated_notify = ConfigBuilder::new()
            .virtio(0x40, CAP_COMMON, 4, 0, 0x1000, None)
            .virtio(0xf0, CAP_NOTIFY, 4, 0x3000, 0x1000, None)
            .image;
        assert!(matches!(
            parse_capabilities(&truncated_notify),
            Err(TransportError::BadCapability { kind: "notify", .. })
        ));
    }
}
