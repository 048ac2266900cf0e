//! The machine's hot-plug slots as sysfs shows them (`/sys/bus/pci/slots/<name>/address`, `.../power`): which are
//! empty while the agent waits, and giving back what a run's HCA left in them. Writing 0 to a slot's `power` makes
//! the kernel remove the device and the platform eject it (QEMU's ACPI hot-plug unplugs it on the guest's `_EJ0`,
//! and announces DEVICE_DELETED on QMP), so the slot is empty again for the next run's HCA.

use std::fs;
use std::path::{Path, PathBuf};

const SLOTS: &str = "/sys/bus/pci/slots";
const DEVICES: &str = "/sys/bus/pci/devices";

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("cannot list {0}: {1}")]
    List(PathBuf, std::io::Error),
    #[error("powering off slot {slot} ({address}): {source}")]
    PowerOff { slot: String, address: String, source: std::io::Error },
    #[error("slot {slot} ({address}) still holds a device after its power-off")]
    StillThere { slot: String, address: String },
}

/// One hot-plug slot: its name under /sys/bus/pci/slots and the `domain:bus:device` it holds devices at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub name: String,
    pub address: String,
}

/// The slots that hold no device now.
pub fn empty() -> Result<Vec<Slot>, SlotError> {
    empty_in(Path::new(SLOTS), Path::new(DEVICES))
}

/// Ejects whatever now sits in `slots` (the ones that were empty before the run), and checks it is gone.
pub fn eject_occupied(slots: &[Slot]) -> Result<usize, SlotError> {
    eject_in(Path::new(SLOTS), Path::new(DEVICES), slots)
}

fn empty_in(slots: &Path, devices: &Path) -> Result<Vec<Slot>, SlotError> {
    let mut found = Vec::new();
    for entry in fs::read_dir(slots).map_err(|e| SlotError::List(slots.to_path_buf(), e))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        // A slot with no address file (an empty ACPI slot on some kernels) cannot be matched to devices: skipped.
        let Ok(address) = fs::read_to_string(entry.path().join("address")) else { continue };
        let slot = Slot { name, address: address.trim().to_string() };
        if !occupied(devices, &slot)? {
            found.push(slot);
        }
    }
    found.sort_by(|a, b| a.address.cmp(&b.address));
    Ok(found)
}

/// True if any function of the slot's device is present (`<domain:bus:device>.<function>`).
fn occupied(devices: &Path, slot: &Slot) -> Result<bool, SlotError> {
    let prefix = format!("{}.", slot.address);
    let entries = fs::read_dir(devices).map_err(|e| SlotError::List(devices.to_path_buf(), e))?;
    Ok(entries.flatten().any(|d| d.file_name().to_string_lossy().starts_with(&prefix)))
}

fn eject_in(slots: &Path, devices: &Path, wanted: &[Slot]) -> Result<usize, SlotError> {
    let mut ejected = 0;
    for slot in wanted {
        if !occupied(devices, slot)? {
            continue;
        }
        let power = slots.join(&slot.name).join("power");
        let failed = |source| SlotError::PowerOff { slot: slot.name.clone(), address: slot.address.clone(), source };
        fs::write(&power, "0").map_err(failed)?;
        // The kernel removes the device before the write returns; the check makes a slot that ignored it an error
        // here instead of a device the next run finds twice.
        if occupied(devices, slot)? {
            return Err(SlotError::StillThere { slot: slot.name.clone(), address: slot.address.clone() });
        }
        ejected += 1;
    }
    Ok(ejected)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(root: &Path, name: &str, address: &str) {
        let dir = root.join("slots").join(name);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("address"), format!("{address}\n")).unwrap();
    }

    fn device(root: &Path, address: &str) {
        fs::create_dir_all(root.join("devices").join(address)).unwrap();
    }

    #[test]
    fn empty_slots_are_those_with_no_function_present() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        slot(r, "0", "0000:01:00");
        slot(r, "1", "0000:02:00");
        fs::create_dir_all(r.join("slots/9")).unwrap(); // no address: skipped
        device(r, "0000:00:01.0");
        device(r, "0000:02:00.0");
        let empty = empty_in(&r.join("slots"), &r.join("devices")).unwrap();
        assert_eq!(empty, [Slot { name: "0".into(), address: "0000:01:00".into() }]);
    }

    #[test]
    fn ejecting_writes_power_off_and_fails_if_the_device_stays() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        slot(r, "0", "0000:01:00");
        slot(r, "1", "0000:02:00");
        fs::create_dir_all(r.join("devices")).unwrap();
        let wanted = empty_in(&r.join("slots"), &r.join("devices")).unwrap();
        assert_eq!(wanted.len(), 2);
        // Nothing plugged: nothing to do, nothing written.
        assert_eq!(eject_in(&r.join("slots"), &r.join("devices"), &wanted).unwrap(), 0);
        assert!(!r.join("slots/0/power").exists());
        // A device that a fake sysfs does not remove on power-off is reported, naming the slot.
        device(r, "0000:01:00.0");
        let err = eject_in(&r.join("slots"), &r.join("devices"), &wanted).unwrap_err();
        assert_eq!(fs::read_to_string(r.join("slots/0/power")).unwrap(), "0");
        assert!(matches!(err, SlotError::StillThere { ref slot, .. } if slot == "0"), "{err}");
    }
}
