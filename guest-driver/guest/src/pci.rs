//! The device as sysfs sees it: find it by PCI id, hand it to vfio-pci, and name its IOMMU group.
//! Everything here is file reads and writes under /sys/bus/pci; nothing touches the device itself.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cmdline::PciId;

#[derive(Debug, thiserror::Error)]
pub enum PciError {
    #[error("cannot list {0}: {1}")]
    List(PathBuf, std::io::Error),
    #[error("no PCI device with id {wanted} (seen: {seen})")]
    NotFound { wanted: String, seen: String },
    #[error("{path}: {source}")]
    Sysfs { path: PathBuf, source: std::io::Error },
    #[error("{0}: unexpected content {1:?}")]
    Parse(PathBuf, String),
    #[error("{address} is still bound to {driver:?} after binding to vfio-pci (is the vfio-pci module loaded?)")]
    BindFailed { address: String, driver: Option<String> },
}

/// One device found under /sys/bus/pci/devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    /// Domain:bus:device.function, e.g. `0000:01:00.0`; also the name VFIO knows the device by.
    pub address: String,
    pub id: PciId,
    sysfs: PathBuf,
}

const DEVICES: &str = "/sys/bus/pci/devices";
const DRIVERS_PROBE: &str = "/sys/bus/pci/drivers_probe";
const VFIO_PCI: &str = "vfio-pci";

fn read_trimmed(path: &Path) -> Result<String, PciError> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|source| PciError::Sysfs { path: path.to_path_buf(), source })
}

fn write_str(path: &Path, text: &str) -> Result<(), PciError> {
    fs::write(path, text).map_err(|source| PciError::Sysfs { path: path.to_path_buf(), source })
}

fn read_hex_u16(path: &Path) -> Result<u16, PciError> {
    let text = read_trimmed(path)?;
    u16::from_str_radix(text.trim_start_matches("0x"), 16).map_err(|_| PciError::Parse(path.to_path_buf(), text))
}

/// Finds the first device (in address order, so runs are repeatable) whose id is one of `wanted`.
pub fn find(wanted: &[PciId]) -> Result<PciDevice, PciError> {
    find_in(Path::new(DEVICES), wanted)
}

/// Finds the device, waiting up to `patience` for it: a hot-plugged device appears after the run request, and the PCI
/// core may still be probing it (vfio-pci claims it by id) when it does. Zero patience is one look.
pub fn wait_for(wanted: &[PciId], patience: Duration) -> Result<PciDevice, PciError> {
    let deadline = Instant::now() + patience;
    if !patience.is_zero() && find(wanted).is_err() {
        // A device hot-plugged while the guest was paused is in config space already; a rescan enumerates it now
        // instead of when the guest's ACPI interpreter gets to the hot-plug event (0.1-0.5 s under TCG). Only the
        // empty buses behind root ports are rescanned: nothing else can have a new device.
        if !rescan_empty_buses(Path::new(PCI_BUSES), Path::new(DEVICES)) {
            let _ = fs::write("/sys/bus/pci/rescan", "1");
        }
    }
    let device = loop {
        match find(wanted) {
            Ok(device) => break device,
            // A device being added can briefly lack its attributes: any error is retried while patience lasts.
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(e),
        }
    };
    let probed = Instant::now() + patience.min(PROBE_SETTLE);
    while device.driver().is_none() && Instant::now() < probed {
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(device)
}

const PCI_BUSES: &str = "/sys/class/pci_bus";

/// Rescans every bus but the root bus that has no device on it (where a hot-plugged device appears: the secondary
/// bus of an empty root port). False when there was none or a rescan failed, so the caller rescans everything.
fn rescan_empty_buses(buses: &Path, devices: &Path) -> bool {
    let Ok(buses) = fs::read_dir(buses) else { return false };
    let Ok(devices) = fs::read_dir(devices) else { return false };
    let occupied: Vec<String> =
        devices.filter_map(|d| d.ok()).map(|d| d.file_name().to_string_lossy().into_owned()).collect();
    let mut rescanned = 0;
    for bus in buses.filter_map(|b| b.ok()) {
        let name = bus.file_name().to_string_lossy().into_owned();
        // "0000:00" is the root bus; a device address is "<bus>:<slot>.<function>".
        if name.ends_with(":00") || occupied.iter().any(|d| d.starts_with(&format!("{name}:"))) {
            continue;
        }
        if fs::write(bus.path().join("rescan"), "1").is_err() {
            return false;
        }
        rescanned += 1;
    }
    rescanned > 0
}

/// How long a found device may stay without a driver before `bind_vfio` binds it itself.
const PROBE_SETTLE: Duration = Duration::from_secs(1);

fn find_in(root: &Path, wanted: &[PciId]) -> Result<PciDevice, PciError> {
    let mut entries: Vec<PathBuf> = fs::read_dir(root)
        .map_err(|e| PciError::List(root.to_path_buf(), e))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    let mut seen = Vec::new();
    for sysfs in entries {
        let id = PciId { vendor: read_hex_u16(&sysfs.join("vendor"))?, device: read_hex_u16(&sysfs.join("device"))? };
        seen.push(id.to_string());
        if wanted.contains(&id) {
            let address = sysfs.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            return Ok(PciDevice { address, id, sysfs });
        }
    }
    let wanted = wanted.iter().map(|id| id.to_string()).collect::<Vec<_>>().join(" or ");
    Err(PciError::NotFound { wanted, seen: seen.join(" ") })
}

impl PciDevice {
    /// The driver bound now, if any.
    pub fn driver(&self) -> Option<String> {
        fs::read_link(self.sysfs.join("driver")).ok()?.file_name().map(|n| n.to_string_lossy().into_owned())
    }

    /// Makes vfio-pci the device's driver: unbinds whatever holds it, sets driver_override so only vfio-pci may
    /// take it, and asks the PCI core to probe. Waits briefly because probing can finish after the write returns.
    pub fn bind_vfio(&self) -> Result<(), PciError> {
        match self.driver() {
            Some(driver) if driver == VFIO_PCI => return Ok(()),
            Some(_) => write_str(&self.sysfs.join("driver/unbind"), &self.address)?,
            None => {}
        }
        write_str(&self.sysfs.join("driver_override"), VFIO_PCI)?;
        write_str(Path::new(DRIVERS_PROBE), &self.address)?;
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let driver = self.driver();
            if driver.as_deref() == Some(VFIO_PCI) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(PciError::BindFailed { address: self.address.clone(), driver });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Chooses how the kernel resets the device (vfio-pci resets at every open and close). `pm` (a D3hot→D0
    /// cycle) is several times faster than FLR under QEMU; `none` leaves the device with no reset method, so
    /// vfio-pci opens and closes it without one; the kernel refuses a method the device lacks.
    pub fn set_reset_method(&self, method: &str) -> Result<(), PciError> {
        // The kernel's word for "no method" is an empty line (an empty write never reaches it).
        let value = if method == "none" { "\n" } else { method };
        write_str(&self.sysfs.join("reset_method"), value)
    }

    /// The IOMMU group number: the name of /dev/vfio/<group>.
    pub fn iommu_group(&self) -> Result<u32, PciError> {
        let link = self.sysfs.join("iommu_group");
        let target = fs::read_link(&link).map_err(|source| PciError::Sysfs { path: link.clone(), source })?;
        let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        name.parse().map_err(|_| PciError::Parse(link, name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_device(root: &Path, address: &str, vendor: &str, device: &str) {
        let dir = root.join(address);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("vendor"), format!("{vendor}\n")).unwrap();
        fs::write(dir.join("device"), format!("{device}\n")).unwrap();
    }

    #[test]
    fn finds_the_wanted_device_among_others() {
        let root = tempfile::tempdir().unwrap();
        fake_device(root.path(), "0000:00:00.0", "0x8086", "0x29c0");
        fake_device(root.path(), "0000:01:00.0", "0x1af4", "0x1059");
        let wanted = [PciId { vendor: 0x1af4, device: 0x106a }, PciId { vendor: 0x1af4, device: 0x1059 }];
        let found = find_in(root.path(), &wanted).unwrap();
        assert_eq!(found.address, "0000:01:00.0");
        assert_eq!(found.id, wanted[1]);
    }

    #[test]
    fn only_empty_buses_other_than_the_root_are_rescanned() {
        let root = tempfile::tempdir().unwrap();
        let (buses, devices) = (root.path().join("buses"), root.path().join("devices"));
        for bus in ["0000:00", "0000:01", "0000:02"] {
            fs::create_dir_all(buses.join(bus)).unwrap();
        }
        fake_device(&devices, "0000:00:01.0", "0x8086", "0x29c0");
        fake_device(&devices, "0000:02:00.0", "0x1af4", "0x1044");
        assert!(rescan_empty_buses(&buses, &devices));
        assert!(buses.join("0000:01/rescan").exists());
        assert!(!buses.join("0000:00/rescan").exists() && !buses.join("0000:02/rescan").exists());
        // Nothing empty: the caller must rescan everything.
        fake_device(&devices, "0000:01:00.0", "0x1af4", "0x1059");
        fs::remove_file(buses.join("0000:01/rescan")).unwrap();
        assert!(!rescan_empty_buses(&buses, &devices));
    }

    #[test]
    fn missing_device_names_what_was_seen() {
        let root = tempfile::tempdir().unwrap();
        fake_device(root.path(), "0000:00:00.0", "0x8086", "0x29c0");
        let err = find_in(root.path(), &[PciId { vendor: 0x1af4, device: 0x1059 }]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("1af4:1059") && text.contains("8086:29c0"), "{text}");
    }
}
