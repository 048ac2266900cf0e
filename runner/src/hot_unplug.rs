//! A real hot-unplug of the HCA mid-run, when the run asks for it (`vhca.pnp=hot-unplug`) and its guest says when
//! (the request line): the device process is stopped, as a card pulled out answers nothing more, then QMP
//! `device_del` asks the platform to eject the HCA, which the guest sees as a surprise removal.

use std::time::Duration;

use serde_json::{json, Value};
use vhca_suite::ConcreteRun;

use crate::qemu_cmd::HCA_DEVICE_ID;
use crate::qmp::{Qmp, QmpError};
use crate::supervise::Supervised;

/// The guest program's line (guest-driver/guest/src/hot_unplug.rs prints the same) asking for the unplug.
pub const REQUEST_LINE: &str = "VHCA-HOT-UNPLUG";
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// Where QEMU keeps devices that were given no id: a cold boot's HCA is on the command line without one.
const ANONYMOUS: &str = "/machine/peripheral-anon";

/// Whether the run's guest will ask for the unplug: only then is its request line answered.
pub fn asked_by(run: &ConcreteRun) -> bool {
    run.guest_params().iter().any(|(k, v)| k == "vhca.pnp" && v == "hot-unplug")
}

pub fn is_request(line: &str) -> bool {
    line.trim() == REQUEST_LINE
}

/// Pulls the HCA out: the device process is told to end (SIGTERM, so its event log is flushed first), then QEMU is
/// asked to eject the HCA. The device goes first because under QEMU 10's ACPI hot-plug `device_del` only asks the
/// guest to eject: the function and its vhost-user backend would stay, and keep serving the rings and DMA-ing, until
/// the guest's driver let go, which a removed card never does. Returns the QEMU id or path the HCA was deleted by.
pub fn pull(qmp: &mut Qmp, device: &Supervised, carrier: &str) -> Result<String, QmpError> {
    device.terminate();
    match qmp.execute("device_del", Some(json!({ "id": HCA_DEVICE_ID })), QMP_TIMEOUT) {
        Ok(_) => Ok(HCA_DEVICE_ID.to_string()),
        Err(QmpError::Command { class, .. }) if class == "DeviceNotFound" => {
            let listed = qmp.execute("qom-list", Some(json!({ "path": ANONYMOUS })), QMP_TIMEOUT)?;
            let path = anonymous_path(&listed, carrier).ok_or_else(|| QmpError::Command {
                command: "device_del".into(),
                class: "DeviceNotFound".into(),
                desc: format!("no {carrier} under {ANONYMOUS} either"),
            })?;
            qmp.execute("device_del", Some(json!({ "id": path })), QMP_TIMEOUT)?;
            Ok(path)
        }
        Err(e) => Err(e),
    }
}

/// The QOM path of the one anonymous device of type `carrier`, from `qom-list`'s answer.
fn anonymous_path(listed: &Value, carrier: &str) -> Option<String> {
    let wanted = format!("child<{carrier}>");
    let mut found = listed
        .as_array()?
        .iter()
        .filter(|p| p.get("type").and_then(Value::as_str) == Some(wanted.as_str()))
        .filter_map(|p| p.get("name").and_then(Value::as_str));
    let name = found.next()?;
    found.next().is_none().then(|| format!("{ANONYMOUS}/{name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_is_its_line_alone() {
        assert!(is_request("VHCA-HOT-UNPLUG\r"));
        assert!(!is_request("vhca: VHCA-HOT-UNPLUG later"));
    }

    #[test]
    fn a_cold_hca_is_found_by_its_type_and_only_if_it_is_the_one() {
        let listed = json!([
            { "name": "type", "type": "string" },
            { "name": "device[0]", "type": "child<pcie-root-port>" },
            { "name": "device[3]", "type": "child<vhost-user-snd-pci>" },
        ]);
        let path = anonymous_path(&listed, "vhost-user-snd-pci");
        assert_eq!(path.as_deref(), Some("/machine/peripheral-anon/device[3]"));
        assert_eq!(anonymous_path(&listed, "vhost-user-test-device-pci"), None);
        let two = json!([
            { "name": "device[3]", "type": "child<vhost-user-snd-pci>" },
            { "name": "device[4]", "type": "child<vhost-user-snd-pci>" },
        ]);
        assert_eq!(anonymous_path(&two, "vhost-user-snd-pci"), None, "two candidates: none is pulled");
    }
}
