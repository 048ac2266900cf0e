//! The I/O manager's device interfaces: what IoRegisterDeviceInterface recorded (the PDO, the class GUID, the
//! symbolic link it answered) and whether the driver enabled it, which is what a user process may open.

use std::sync::Mutex;

/// One registered interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInterface {
    pub pdo: usize,
    pub class: u128,
    /// `\??\...#{class}`, as Windows names an interface's link.
    pub link: String,
    pub enabled: bool,
}

/// Why IoSetDeviceInterfaceState answers what it does (ntstatus.h values in the thunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateChange {
    Changed,
    /// Enabled again while enabled, or disabled while disabled.
    Unchanged,
    NoSuchLink,
}

static INTERFACES: Mutex<Vec<DeviceInterface>> = Mutex::new(Vec::new());

/// The link of `class` on `pdo`, registered now or earlier: Windows answers the same link for the same PDO and
/// class (a driver registers again at each START).
pub fn register(pdo: usize, class: u128) -> String {
    let mut all = crate::lock(&INTERFACES);
    if let Some(known) = all.iter().find(|i| i.pdo == pdo && i.class == class) {
        return known.link.clone();
    }
    let guid = format_guid(class);
    let link = format!("\\??\\PCI#VEN_1AF4&DEV_1059#{}#{guid}", all.len());
    all.push(DeviceInterface { pdo, class, link: link.clone(), enabled: false });
    link
}

pub fn set_state(link: &str, enabled: bool) -> StateChange {
    let mut all = crate::lock(&INTERFACES);
    match all.iter_mut().find(|i| i.link.eq_ignore_ascii_case(link)) {
        None => StateChange::NoSuchLink,
        Some(i) if i.enabled == enabled => StateChange::Unchanged,
        Some(i) => {
            i.enabled = enabled;
            StateChange::Changed
        }
    }
}

/// The enabled interfaces of `class`: what SetupDiGetClassDevs(DIGCF_DEVICEINTERFACE | DIGCF_PRESENT) lists.
pub fn enabled(class: u128) -> Vec<DeviceInterface> {
    crate::lock(&INTERFACES).iter().filter(|i| i.class == class && i.enabled).cloned().collect()
}

/// Every interface, enabled or not (tests and reports).
pub fn all() -> Vec<DeviceInterface> {
    crate::lock(&INTERFACES).clone()
}

/// {XXXXXXXX-XXXX-XXXX-XXXX-XXXXXXXXXXXX}, as a GUID's u128 (Data1 first) prints.
pub fn format_guid(class: u128) -> String {
    let h = format!("{class:032X}");
    format!("{{{}-{}-{}-{}-{}}}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_pdo_and_class_get_the_same_link_and_state_changes_once() {
        let a = register(0x1000, 0x5648_4341_0000_0000_0000_0000_0000_0001);
        assert_eq!(register(0x1000, 0x5648_4341_0000_0000_0000_0000_0000_0001), a);
        assert!(a.ends_with("#{56484341-0000-0000-0000-000000000001}"), "{a}");
        assert_eq!(set_state(&a, true), StateChange::Changed);
        assert_eq!(set_state(&a, true), StateChange::Unchanged);
        assert_eq!(enabled(0x5648_4341_0000_0000_0000_0000_0000_0001).len(), 1);
        assert_eq!(set_state(&a, false), StateChange::Changed);
        assert!(enabled(0x5648_4341_0000_0000_0000_0000_0000_0001).is_empty());
        assert_eq!(set_state("\\??\\nothing", true), StateChange::NoSuchLink);
    }
}
