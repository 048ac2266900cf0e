//! virtio-pci modern transport: common config, feature negotiation, queue setup, notification and the device config
//! window, over whatever reaches the BARs (`Registers`). Every register offset is checked against its window.

use alloc::vec::Vec;
use core::time::Duration;

use crate::capabilities::{CapWindow, VirtioCaps, COMMON_CFG_MIN_LEN};
use crate::constants::*;
use crate::poll_wait::PollWait;

// Common configuration register offsets (virtio 1.x, 4.1.4.3).
const DEVICE_FEATURE_SELECT: u64 = 0;
const DEVICE_FEATURE: u64 = 4;
const DRIVER_FEATURE_SELECT: u64 = 8;
const DRIVER_FEATURE: u64 = 12;
const CONFIG_MSIX_VECTOR: u64 = 16;
const NUM_QUEUES: u64 = 18;
const DEVICE_STATUS: u64 = 20;
const CONFIG_GENERATION: u64 = 21;
const QUEUE_SELECT: u64 = 22;
const QUEUE_SIZE: u64 = 24;
const QUEUE_MSIX_VECTOR: u64 = 26;
const QUEUE_ENABLE: u64 = 28;
const QUEUE_NOTIFY_OFF: u64 = 30;
const QUEUE_DESC: u64 = 32;
const QUEUE_DRIVER: u64 = 40;
const QUEUE_DEVICE: u64 = 48;

/// VIRTIO_MSI_NO_VECTOR (virtio 1.2, 4.1.4.3): written, it routes a source to no MSI-X entry; read back, it is how
/// the device refuses an entry it cannot use (QEMU: one past its MSI-X table). Hand-written: virtio-bindings 0.2
/// carries no virtio_pci module.
pub const NO_VECTOR: u16 = 0xffff;

/// What an MSI-X vector register routes: configuration changes, or one queue's used-buffer notifications.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsixSource {
    Config,
    Queue(u16),
}

impl core::fmt::Display for MsixSource {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            MsixSource::Config => f.write_str("config changes"),
            MsixSource::Queue(index) => write!(f, "queue {index}"),
        }
    }
}

/// One BAR as the platform reaches it: VFIO region reads and writes in the Linux guest, mapped MMIO in vhca.sys.
/// Offsets are from the BAR's start; the transport has already checked them against the capability window.
pub trait Registers {
    type Error: core::fmt::Display + core::fmt::Debug;
    /// The BAR's size in bytes.
    fn size(&self) -> u64;
    fn read_u8(&self, offset: u64) -> Result<u8, Self::Error>;
    fn read_u16(&self, offset: u64) -> Result<u16, Self::Error>;
    fn read_u32(&self, offset: u64) -> Result<u32, Self::Error>;
    fn write_u8(&self, offset: u64, value: u8) -> Result<(), Self::Error>;
    fn write_u16(&self, offset: u64, value: u16) -> Result<(), Self::Error>;
    fn write_u32(&self, offset: u64, value: u32) -> Result<(), Self::Error>;
}

#[derive(Debug, thiserror::Error)]
pub enum TransportError<E: core::fmt::Display + core::fmt::Debug> {
    #[error("register access: {0}")]
    Registers(E),
    #[error("virtio {kind} capability: window {offset:#x}+{length:#x} outside BAR{bar} of {bar_size:#x} bytes")]
    WindowOutsideBar { kind: &'static str, bar: u8, offset: u32, length: u32, bar_size: u64 },
    #[error("access of {width} bytes at {offset:#x} outside the {len:#x}-byte capability window")]
    OutsideWindow { offset: u64, width: u64, len: u32 },
    #[error("device did not finish reset within {0:?} (status {1:#x})")]
    ResetTimeout(Duration, u8),
    #[error("device status reads all ones: the device is gone (surprise removal)")]
    DeviceGone,
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
    #[error("MSI-X vector {wanted} for {what}: the device read back {got:#x}, refusing it (QEMU: past its table)")]
    VectorRefused { what: MsixSource, wanted: u16, got: u16 },
}

/// What a status read gives when the function behind the BAR is gone (all ones).
const GONE_STATUS: u8 = 0xff;

/// A capability's window inside its BAR: offsets are relative to the window and checked against its length.
#[derive(Debug, Clone)]
struct Window<R> {
    bar: R,
    base: u64,
    len: u32,
}

impl<R: Registers> Window<R> {
    fn new(kind: &'static str, bar: R, cap: CapWindow) -> Result<Window<R>, TransportError<R::Error>> {
        let end = (cap.offset as u64).checked_add(cap.length as u64);
        if !matches!(end, Some(end) if end <= bar.size()) {
            let (offset, length, bar_size) = (cap.offset, cap.length, bar.size());
            return Err(TransportError::WindowOutsideBar { kind, bar: cap.bar, offset, length, bar_size });
        }
        Ok(Window { bar, base: cap.offset as u64, len: cap.length })
    }

    fn at(&self, offset: u64, width: u64) -> Result<u64, TransportError<R::Error>> {
        if offset.checked_add(width).is_some_and(|end| end <= self.len as u64) {
            Ok(self.base + offset)
        } else {
            Err(TransportError::OutsideWindow { offset, width, len: self.len })
        }
    }
    fn r8(&self, o: u64) -> Result<u8, TransportError<R::Error>> {
        self.bar.read_u8(self.at(o, 1)?).map_err(TransportError::Registers)
    }
    fn r16(&self, o: u64) -> Result<u16, TransportError<R::Error>> {
        self.bar.read_u16(self.at(o, 2)?).map_err(TransportError::Registers)
    }
    fn r32(&self, o: u64) -> Result<u32, TransportError<R::Error>> {
        self.bar.read_u32(self.at(o, 4)?).map_err(TransportError::Registers)
    }
    fn w8(&self, o: u64, v: u8) -> Result<(), TransportError<R::Error>> {
        self.bar.write_u8(self.at(o, 1)?, v).map_err(TransportError::Registers)
    }
    fn w16(&self, o: u64, v: u16) -> Result<(), TransportError<R::Error>> {
        self.bar.write_u16(self.at(o, 2)?, v).map_err(TransportError::Registers)
    }
    fn w32(&self, o: u64, v: u32) -> Result<(), TransportError<R::Error>> {
        self.bar.write_u32(self.at(o, 4)?, v).map_err(TransportError::Registers)
    }
    /// 64-bit registers as two 32-bit halves, low first: every transport must accept that.
    fn w64(&self, o: u64, v: u64) -> Result<(), TransportError<R::Error>> {
        self.w32(o, v as u32)?;
        self.w32(o + 4, (v >> 32) as u32)
    }
}

/// Writes to one queue's doorbell: `queue_notify_off * notify_off_multiplier` into the notify window.
#[derive(Debug, Clone)]
pub struct QueueNotifier<R> {
    window: Window<R>,
    offset: u64,
    queue: u16,
}

impl<R: Registers> QueueNotifier<R> {
    pub fn notify(&self) -> Result<(), TransportError<R::Error>> {
        self.window.w16(self.offset, self.queue)
    }

    /// Byte offset of the doorbell inside the notify BAR, for reports.
    pub fn bar_offset(&self) -> u64 {
        self.window.base + self.offset
    }
}

/// A virtio-pci modern device whose BARs are reached through `R`.
#[derive(Debug)]
pub struct VirtioPci<R> {
    pub caps: VirtioCaps,
    common: Window<R>,
    notify: Window<R>,
    device_cfg: Option<Window<R>>,
}

impl<R: Registers + Clone> VirtioPci<R> {
    /// Builds the transport from the capabilities found in config space, with `bar(n)` giving access to BAR n.
    /// The caller has enabled memory decoding and bus mastering (the PCI command register).
    pub fn new<F>(caps: VirtioCaps, mut bar: F) -> Result<VirtioPci<R>, TransportError<R::Error>>
    where
        F: FnMut(u8) -> Result<R, R::Error>,
    {
        let mut window =
            |kind, cap: CapWindow| Window::new(kind, bar(cap.bar).map_err(TransportError::Registers)?, cap);
        let common = window("common", caps.common)?;
        let notify = window("notify", caps.notify)?;
        let device_cfg = caps.device.map(|cap| window("device", cap)).transpose()?;
        Ok(VirtioPci { caps, common, notify, device_cfg })
    }
}

impl<R: Registers> VirtioPci<R> {
    /// The BAR holding the common configuration.
    pub fn common_registers(&self) -> &R {
        &self.common.bar
    }

    pub fn status(&self) -> Result<u8, TransportError<R::Error>> {
        self.common.r8(DEVICE_STATUS)
    }

    /// Sets bits on top of the current status, as the init sequence requires.
    pub fn add_status(&self, bits: u8) -> Result<(), TransportError<R::Error>> {
        let status = self.status()?;
        self.common.w8(DEVICE_STATUS, status | bits)
    }

    /// Writes 0 and waits for the device to read back 0: only then is the reset complete. A status of all ones is
    /// no device at all: a PCI function that is gone answers every read with all ones, and no virtio status has the
    /// reserved bits 0x10 and 0x20 set. That ends the wait at once, so a teardown after a surprise removal does not
    /// poll a gone device for the whole limit (5 s in vhca.sys).
    pub fn reset(&self, wait: &mut impl PollWait) -> Result<(), TransportError<R::Error>> {
        self.common.w8(DEVICE_STATUS, 0)?;
        loop {
            let status = self.status()?;
            if status == 0 {
                return Ok(());
            }
            if status == GONE_STATUS {
                return Err(TransportError::DeviceGone);
            }
            if !wait.pause() {
                return Err(TransportError::ResetTimeout(wait.limit(), status));
            }
        }
    }

    pub fn device_features(&self) -> Result<u64, TransportError<R::Error>> {
        self.common.w32(DEVICE_FEATURE_SELECT, 0)?;
        let low = self.common.r32(DEVICE_FEATURE)? as u64;
        self.common.w32(DEVICE_FEATURE_SELECT, 1)?;
        let high = self.common.r32(DEVICE_FEATURE)? as u64;
        Ok(low | (high << 32))
    }

    /// Accepts `required` (all must be offered) plus whatever of `optional` is offered, then sets FEATURES_OK and
    /// checks that it stuck. Returns the negotiated set.
    pub fn negotiate(&self, required: u64, optional: u64) -> Result<u64, TransportError<R::Error>> {
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

    pub fn num_queues(&self) -> Result<u16, TransportError<R::Error>> {
        self.common.r16(NUM_QUEUES)
    }

    /// The largest size the device allows for queue `index` (0: the queue does not exist).
    pub fn queue_max_size(&self, index: u16) -> Result<u16, TransportError<R::Error>> {
        self.common.w16(QUEUE_SELECT, index)?;
        self.common.r16(QUEUE_SIZE)
    }

    /// Routes configuration-change notifications to MSI-X table entry `vector` (`NO_VECTOR`: to none) and reads the
    /// register back: the device keeps only an entry it can signal (virtio 1.2, 4.1.5.1.2).
    pub fn set_config_msix_vector(&self, vector: u16) -> Result<(), TransportError<R::Error>> {
        self.common.w16(CONFIG_MSIX_VECTOR, vector)?;
        check_vector(MsixSource::Config, vector, self.common.r16(CONFIG_MSIX_VECTOR)?)
    }

    /// Routes queue `index`'s used-buffer notifications to MSI-X table entry `vector`, read back as for the config
    /// vector. Virtio 1.2, 4.1.5.1.3 step 3 programs it before the queue is enabled; `setup_queue` leaves the
    /// register alone, so call this first. Polling drivers never call it: the queue then has no vector.
    pub fn set_queue_msix_vector(&self, index: u16, vector: u16) -> Result<(), TransportError<R::Error>> {
        self.common.w16(QUEUE_SELECT, index)?;
        self.common.w16(QUEUE_MSIX_VECTOR, vector)?;
        check_vector(MsixSource::Queue(index), vector, self.common.r16(QUEUE_MSIX_VECTOR)?)
    }

    /// Programs a queue's size and ring addresses, enables it, and returns its doorbell.
    pub fn setup_queue(
        &self,
        index: u16,
        size: u16,
        rings: [u64; 3],
    ) -> Result<QueueNotifier<R>, TransportError<R::Error>>
    where
        R: Clone,
    {
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
    pub fn driver_ok(&self) -> Result<(), TransportError<R::Error>> {
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
    pub fn read_device_config(&self, len: usize) -> Result<Option<Vec<u8>>, TransportError<R::Error>> {
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

fn check_vector<E: core::fmt::Display + core::fmt::Debug>(
    what: MsixSource,
    wanted: u16,
    got: u16,
) -> Result<(), TransportError<E>> {
    if got == wanted {
        Ok(())
    } else {
        Err(TransportError::VectorRefused { what, wanted, got })
    }
}

// COMMON_CFG_MIN_LEN is checked by the capability parser; the last register written here must fit inside it.
const _: () = assert!(QUEUE_DEVICE + 8 <= COMMON_CFG_MIN_LEN as u64);

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::*;
    use crate::testing::CountedWait;

    /// One BAR with a device behind the common config at 0 and the notify window at 0x1000: feature words by
    /// select, per-queue sizes and notify offsets, status written back as read. Every write is recorded.
    #[derive(Default)]
    struct FakeDevice {
        memory: Vec<u8>,
        offered: u64,
        queue_sizes: [u16; 4],
        writes: Vec<(u64, u32)>,
        reset_polls_left: u32,
        /// MSI-X table entries: a vector register keeps a value below this, or reads back NO_VECTOR (as QEMU's).
        msix_entries: u16,
        queue_vectors: [u16; 4],
        /// Hot-unplugged: every read is all ones, as from a PCI function that is gone.
        gone: bool,
    }

    #[derive(Clone)]
    struct FakeBar(Rc<RefCell<FakeDevice>>);

    impl FakeBar {
        fn new(offered: u64) -> FakeBar {
            let device = FakeDevice {
                memory: vec![0; 0x2000],
                offered,
                queue_sizes: [64, 0, 256, 8],
                msix_entries: 2,
                queue_vectors: [NO_VECTOR; 4],
                ..Default::default()
            };
            FakeBar(Rc::new(RefCell::new(device)))
        }
        fn read(&self, offset: u64, width: usize) -> u32 {
            let mut d = self.0.borrow_mut();
            if d.gone {
                return u32::MAX >> (32 - 8 * width as u32);
            }
            let select = |d: &FakeDevice, at: usize| u16::from_le_bytes([d.memory[at], d.memory[at + 1]]) as usize;
            match offset {
                DEVICE_FEATURE => (d.offered >> (32 * (d.memory[DEVICE_FEATURE_SELECT as usize] & 1))) as u32,
                QUEUE_SIZE => d.queue_sizes.get(select(&d, QUEUE_SELECT as usize)).copied().unwrap_or(0) as u32,
                QUEUE_NOTIFY_OFF => select(&d, QUEUE_SELECT as usize) as u32 * 2,
                QUEUE_MSIX_VECTOR => {
                    d.queue_vectors.get(select(&d, QUEUE_SELECT as usize)).map_or(0xffff, |v| *v as u32)
                }
                DEVICE_STATUS if d.reset_polls_left > 0 => {
                    d.reset_polls_left -= 1;
                    1
                }
                _ => {
                    let at = offset as usize;
                    let mut bytes = [0u8; 4];
                    bytes[..width].copy_from_slice(&d.memory[at..at + width]);
                    u32::from_le_bytes(bytes)
                }
            }
        }
        fn write(&self, offset: u64, value: u32, width: usize) {
            let mut d = self.0.borrow_mut();
            d.writes.push((offset, value));
            let value = match offset {
                CONFIG_MSIX_VECTOR | QUEUE_MSIX_VECTOR if value >= d.msix_entries as u32 => NO_VECTOR as u32,
                _ => value,
            };
            if offset == QUEUE_MSIX_VECTOR {
                let queue = u16::from_le_bytes([d.memory[QUEUE_SELECT as usize], d.memory[QUEUE_SELECT as usize + 1]]);
                if let Some(vector) = d.queue_vectors.get_mut(queue as usize) {
                    *vector = value as u16;
                }
                return;
            }
            let at = offset as usize;
            d.memory[at..at + width].copy_from_slice(&value.to_le_bytes()[..width]);
        }
        fn written(&self, offset: u64) -> Vec<u32> {
            self.0.borrow().writes.iter().filter(|w| w.0 == offset).map(|w| w.1).collect()
        }
    }

    impl Registers for FakeBar {
        type Error = core::convert::Infallible;
        fn size(&self) -> u64 {
            0x2000
        }
        fn read_u8(&self, offset: u64) -> Result<u8, Self::Error> {
            Ok(self.read(offset, 1) as u8)
        }
        fn read_u16(&self, offset: u64) -> Result<u16, Self::Error> {
            Ok(self.read(offset, 2) as u16)
        }
        fn read_u32(&self, offset: u64) -> Result<u32, Self::Error> {
            Ok(self.read(offset, 4))
        }
        fn write_u8(&self, offset: u64, value: u8) -> Result<(), Self::Error> {
            self.write(offset, value as u32, 1);
            Ok(())
        }
        fn write_u16(&self, offset: u64, value: u16) -> Result<(), Self::Error> {
            self.write(offset, value as u32, 2);
            Ok(())
        }
        fn write_u32(&self, offset: u64, value: u32) -> Result<(), Self::Error> {
            self.write(offset, value, 4);
            Ok(())
        }
    }

    fn caps() -> VirtioCaps {
        VirtioCaps {
            common: CapWindow { bar: 4, offset: 0, length: 0x100 },
            notify: CapWindow { bar: 4, offset: 0x1000, length: 0x100 },
            notify_off_multiplier: 4,
            isr: None,
            device: None,
        }
    }

    #[test]
    fn bring_up_negotiates_programs_queues_and_notifies_at_the_spec_offsets() {
        let bar = FakeBar::new(F_VERSION_1 | F_ACCESS_PLATFORM | 1);
        bar.0.borrow_mut().reset_polls_left = 2;
        let t = VirtioPci::new(caps(), |_| Ok(bar.clone())).unwrap();
        t.reset(&mut CountedWait(5)).unwrap();
        t.add_status(STATUS_ACKNOWLEDGE).unwrap();
        t.add_status(STATUS_DRIVER).unwrap();
        assert_eq!(t.negotiate(F_VERSION_1 | F_ACCESS_PLATFORM, 0).unwrap(), F_VERSION_1 | F_ACCESS_PLATFORM);
        // Driver features written as two halves, low then high: bit 32 and 33 are 0b11 in the high word.
        assert_eq!(bar.written(DRIVER_FEATURE), vec![0, 0b11]);
        assert_eq!(t.queue_max_size(2).unwrap(), 256);
        let notifier = t.setup_queue(2, 128, [0x10_0000_1000, 0x10_0000_2000, 0x10_0000_3000]).unwrap();
        // 64-bit ring addresses as two 32-bit halves, low first.
        assert_eq!((bar.written(QUEUE_DESC), bar.written(QUEUE_DESC + 4)), (vec![0x1000], vec![0x10]));
        assert_eq!((bar.written(QUEUE_DEVICE), bar.written(QUEUE_DEVICE + 4)), (vec![0x3000], vec![0x10]));
        let desc_writes = bar.0.borrow().writes.iter().position(|w| w.0 == QUEUE_DESC + 4).unwrap();
        assert!(bar.0.borrow().writes[desc_writes - 1].0 == QUEUE_DESC, "low half first");
        assert_eq!(bar.written(QUEUE_ENABLE), vec![1]);
        // queue_notify_off (2 * 2) * multiplier 4 into the notify window at 0x1000.
        assert_eq!(notifier.bar_offset(), 0x1000 + 16);
        notifier.notify().unwrap();
        assert_eq!(bar.written(0x1000 + 16), vec![2]);
        t.driver_ok().unwrap();
        assert_eq!(t.status().unwrap(), STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK);
    }

    #[test]
    fn a_gone_device_ends_the_reset_at_once() {
        let bar = FakeBar::new(F_VERSION_1);
        let t = VirtioPci::new(caps(), |_| Ok(bar.clone())).unwrap();
        bar.0.borrow_mut().gone = true;
        // One pause allowed: a reset that polled the all-ones status like a busy device would time out instead.
        assert!(matches!(t.reset(&mut CountedWait(1)), Err(TransportError::DeviceGone)));
        bar.0.borrow_mut().gone = false;
        t.reset(&mut CountedWait(1)).unwrap();
    }

    #[test]
    fn refusals_name_their_cause() {
        let bar = FakeBar::new(F_VERSION_1);
        let t = VirtioPci::new(caps(), |_| Ok(bar.clone())).unwrap();
        let missing = t.negotiate(F_VERSION_1 | F_ACCESS_PLATFORM, 0).unwrap_err();
        assert!(matches!(missing, TransportError::MissingFeatures { missing: F_ACCESS_PLATFORM, .. }));
        assert!(missing.to_string().contains("iommu_platform=on"), "{missing}");
        assert!(matches!(t.setup_queue(1, 8, [0; 3]), Err(TransportError::QueueUnavailable(1))));
        bar.0.borrow_mut().reset_polls_left = 10;
        assert!(matches!(t.reset(&mut CountedWait(3)), Err(TransportError::ResetTimeout(_, 1))));

        let mut outside = caps();
        outside.notify.offset = 0x1f80;
        let Err(e) = VirtioPci::new(outside, |_| Ok(bar.clone())) else { panic!("a window past the BAR's end") };
        assert!(matches!(e, TransportError::WindowOutsideBar { kind: "notify", .. }), "{e}");
    }

    #[test]
    fn msix_vectors_are_read_back_per_queue_and_a_refusal_names_its_source() {
        // Two table entries, as the fake's device has: 0 and 1 are kept, 2 reads back NO_VECTOR.
        let bar = FakeBar::new(F_VERSION_1);
        let t = VirtioPci::new(caps(), |_| Ok(bar.clone())).unwrap();
        t.set_config_msix_vector(0).unwrap();
        t.set_queue_msix_vector(0, 1).unwrap();
        t.set_queue_msix_vector(2, 0).unwrap();
        assert_eq!(bar.read(CONFIG_MSIX_VECTOR, 2), 0);
        // Each queue keeps its own: selecting queue 0 again reads back its 1, not queue 2's 0.
        bar.write(QUEUE_SELECT, 0, 2);
        assert_eq!(bar.read(QUEUE_MSIX_VECTOR, 2), 1);
        assert_eq!(bar.written(QUEUE_MSIX_VECTOR), vec![1, 0]);

        let refused = t.set_queue_msix_vector(3, 2).unwrap_err();
        assert!(
            matches!(refused, TransportError::VectorRefused { what: MsixSource::Queue(3), wanted: 2, got: NO_VECTOR }),
            "{refused}"
        );
        assert!(refused.to_string().contains("queue 3") && refused.to_string().contains("0xffff"), "{refused}");
        let refused = t.set_config_msix_vector(7).unwrap_err();
        assert!(matches!(refused, TransportError::VectorRefused { what: MsixSource::Config, .. }), "{refused}");
        // Routing a source to no vector is always accepted: that is what the device reads back.
        t.set_queue_msix_vector(0, NO_VECTOR).unwrap();
        t.set_config_msix_vector(NO_VECTOR).unwrap();

        // A plan for the table the device has is kept whole; one for a larger table stops at the first refusal.
        crate::MsixPlan::new(2, 4).unwrap().program(&t).unwrap();
        assert_eq!(bar.0.borrow().queue_vectors, [1, 1, 1, 1]);
        assert_eq!(bar.read(CONFIG_MSIX_VECTOR, 2), 0);
        let refused = crate::MsixPlan::new(5, 4).unwrap().program(&t).unwrap_err();
        assert!(matches!(refused, TransportError::VectorRefused { what: MsixSource::Queue(1), wanted: 2, .. }));
    }
}
