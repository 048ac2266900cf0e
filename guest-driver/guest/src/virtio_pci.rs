//! The shared virtio-pci transport (vhca-virtio) bound to VFIO: BARs are VFIO regions, config space is read
//! through the VFIO config region, and waits sleep on the monotonic clock. The transport logic itself lives in
//! vhca-virtio, which vhca.sys uses too; `VirtioPci` here only adds opening through VFIO and timeouts in time.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::vfio::{Device, Region, VfioError, CONFIG_REGION};

pub use vhca_virtio::{
    CapabilityError, PollWait, F_ACCESS_PLATFORM, F_VERSION_1, PCI_CONFIG_SPACE_SIZE, STATUS_ACKNOWLEDGE, STATUS_DRIVER,
};

/// One BAR as a VFIO region (mmapped where the kernel allows it, else pread/pwrite).
#[derive(Debug, Clone)]
pub struct VfioBar(Arc<Region>);

impl vhca_virtio::Registers for VfioBar {
    type Error = VfioError;
    fn size(&self) -> u64 {
        self.0.info().size
    }
    fn read_u8(&self, offset: u64) -> Result<u8, VfioError> {
        self.0.read_u8(offset)
    }
    fn read_u16(&self, offset: u64) -> Result<u16, VfioError> {
        self.0.read_u16(offset)
    }
    fn read_u32(&self, offset: u64) -> Result<u32, VfioError> {
        self.0.read_u32(offset)
    }
    fn write_u8(&self, offset: u64, value: u8) -> Result<(), VfioError> {
        self.0.write_u8(offset, value)
    }
    fn write_u16(&self, offset: u64, value: u16) -> Result<(), VfioError> {
        self.0.write_u16(offset, value)
    }
    fn write_u32(&self, offset: u64, value: u32) -> Result<(), VfioError> {
        self.0.write_u32(offset, value)
    }
}

impl VfioBar {
    /// Whether the BAR is mmapped (else every access is a pread/pwrite syscall).
    pub fn is_mapped(&self) -> bool {
        self.0.is_mapped()
    }
}

/// The transport over VFIO; every register operation is vhca-virtio's (through Deref).
#[derive(Debug)]
pub struct VirtioPci(vhca_virtio::VirtioPci<VfioBar>);

impl Deref for VirtioPci {
    type Target = vhca_virtio::VirtioPci<VfioBar>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

pub type QueueNotifier = vhca_virtio::QueueNotifier<VfioBar>;
pub type TransportError = vhca_virtio::TransportError<VfioError>;

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Vfio(#[from] VfioError),
    #[error(transparent)]
    Capabilities(#[from] CapabilityError),
    #[error(transparent)]
    Transport(#[from] TransportError),
}

impl VirtioPci {
    /// Reads config space, finds the capabilities, opens the BARs they name (each once) and enables memory
    /// decoding and bus mastering (vfio-pci leaves both off after its reset).
    pub fn open(device: &Device) -> Result<VirtioPci, OpenError> {
        open(device).map(VirtioPci)
    }

    /// Whether the BAR holding the common config is mmapped (else every access is a pread/pwrite syscall).
    pub fn mmio_mapped(&self) -> bool {
        self.0.common_registers().is_mapped()
    }

    /// Resets the device and waits up to `timeout` for it to read back 0.
    pub fn reset(&self, timeout: Duration) -> Result<(), TransportError> {
        self.0.reset(&mut Deadline::after(timeout))
    }
}

fn open(device: &Device) -> Result<vhca_virtio::VirtioPci<VfioBar>, OpenError> {
    let config = device.region(CONFIG_REGION)?;
    let mut image = [0u8; PCI_CONFIG_SPACE_SIZE];
    config.pread(0, &mut image)?;
    let caps = vhca_virtio::parse_capabilities(&image)?;
    let mut bars: BTreeMap<u8, VfioBar> = BTreeMap::new();
    let transport = vhca_virtio::VirtioPci::new(caps, |index| match bars.get(&index) {
        Some(bar) => Ok(bar.clone()),
        None => {
            let bar = VfioBar(Arc::new(device.region(index as u32)?));
            bars.insert(index, bar.clone());
            Ok(bar)
        }
    })?;
    let at = vhca_virtio::PCI_COMMAND as u64;
    config.write_u16(at, vhca_virtio::command_with_decoding_and_mastering(config.read_u16(at)?))?;
    Ok(transport)
}

/// How long a wait spins on the used ring before its first sleep: a device that busy-polls answers well within it
/// (docs/bench.md section 5), and one sleep under TCG overshoots by more than this.
pub const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(50);

/// A wait on the monotonic clock: spins `SPIN_BEFORE_SLEEP`, then sleeps between polls, growing from a few
/// microseconds to 1 ms, so a slow device under TCG is not starved by a spinning vCPU, and gives up once `limit` has
/// passed.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    deadline: Instant,
    spin_until: Instant,
    limit: Duration,
    pause: Duration,
}

impl Deadline {
    pub fn after(limit: Duration) -> Deadline {
        let now = Instant::now();
        Deadline {
            deadline: now + limit,
            spin_until: now + SPIN_BEFORE_SLEEP.min(limit),
            limit,
            pause: Duration::from_micros(5),
        }
    }
}

impl PollWait for Deadline {
    fn keep_spinning(&mut self, _polls: u32) -> bool {
        Instant::now() < self.spin_until
    }
    fn pause(&mut self) -> bool {
        if Instant::now() >= self.deadline {
            return false;
        }
        std::thread::sleep(self.pause);
        self.pause = (self.pause * 2).min(Duration::from_millis(1));
        true
    }
    fn limit(&self) -> Duration {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_waits_out_its_limit_and_then_gives_up() {
        let started = Instant::now();
        let mut wait = Deadline::after(Duration::from_millis(20));
        let mut pauses = 0;
        while wait.pause() {
            pauses += 1;
        }
        assert!(started.elapsed() >= Duration::from_millis(20));
        assert!(pauses > 1, "it paused before giving up");
        assert_eq!(wait.limit(), Duration::from_millis(20));
    }

    #[test]
    fn a_deadline_spins_for_its_spin_time_only() {
        let started = Instant::now();
        let mut wait = Deadline::after(Duration::from_secs(1));
        let mut polls = 0;
        while wait.keep_spinning(polls) {
            polls += 1;
        }
        assert!(started.elapsed() >= SPIN_BEFORE_SLEEP);
        assert!(polls > 0);
        // A limit shorter than the spin bounds the spin too.
        let mut short = Deadline::after(Duration::ZERO);
        assert!(!short.keep_spinning(0));
    }
}
