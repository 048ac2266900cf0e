//! A real hot-unplug of the HCA mid-run, when the run asks for it (`vhca.pnp=hot-unplug`) and its guest says when
//! (the request line): QMP `device_del` asks the platform to eject the HCA, which the guest sees as a surprise
//! removal, and once QEMU deleted it the HCA's chardev is removed, which hangs up on the device process: it ends.

use std::time::Duration;

use serde_json::{json, Value};
use vhca_suite::ConcreteRun;

use crate::qemu_cmd::{HCA_CHARDEV, HCA_DEVICE_ID};
use crate::qmp::{Qmp, QmpError};

/// The guest program's line (guest-driver/guest/src/hot_unplug.rs prints the same) asking for the unplug.
pub const REQUEST_LINE: &str = "VHCA-HOT-UNPLUG";
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// Where QEMU keeps devices that were given no id: a cold boot's HCA is on the command line without one.
const ANONYMOUS: &str = "/machine/peripheral-anon";

/// Whether the run's guest will ask for the unplug: only then is its request line answered.
pub fn asked_by(run: &ConcreteRun) -> bool {
    run.guest_params()
        .iter()
        .any(|(k, v)| k == "vhca.pnp" && matches!(v.as_str(), "hot-unplug" | "hot-unplug-during-traffic"))
}

pub fn is_request(line: &str) -> bool {
    line.trim() == REQUEST_LINE
}

/// Asks QEMU to eject the HCA. Under QEMU 10's ACPI hot-plug that is a request the guest carries out: the function
/// and its vhost-user backend stay until the guest let go of it. The device process is not stopped first, as a
/// pulled card would be: with it killed at `device_del`, QEMU 10.0.2 aborted in 1 of 4 vhca.sys runs
/// (`memory_region_del_eventfd: Assertion 'i != mr->ioeventfd_nb' failed`: the backend's disconnect and the
/// driver's reset of the device both removed the queues' ioeventfds). Returns the QEMU id or path the HCA goes by.
pub fn pull(qmp: &mut Qmp, carrier: &str) -> Result<String, QmpError> {
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

/// Once QEMU deleted the HCA: its chardev goes, which hangs up on the device process (the vhost-user connection is
/// the chardev's, not the device's), and the process ends by itself, as after the agent's eject on a reused guest.
pub fn let_go_of_backend(qmp: &mut Qmp) -> Result<(), QmpError> {
    qmp.execute("chardev-remove", Some(json!({ "id": HCA_CHARDEV })), QMP_TIMEOUT).map(drop)
}

/// True for QEMU's DEVICE_DELETED of the HCA, by id (a hot-plugged one) or by the path it was deleted by.
pub fn is_deleted(event: &Value, deleted_by: &str) -> bool {
    let data = event.get("data");
    let field = |k: &str| data.and_then(|d| d.get(k)).and_then(Value::as_str);
    event.get("event").and_then(Value::as_str) == Some("DEVICE_DELETED")
        && (field("device") == Some(deleted_by) || field("path") == Some(deleted_by))
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

    #[test]
    fn deleted_is_matched_by_id_or_path() {
        let by_id =
            json!({ "event": "DEVICE_DELETED", "data": { "device": "hca0", "path": "/machine/peripheral/hca0" } });
        assert!(is_deleted(&by_id, "hca0"));
        let backend =
            json!({ "event": "DEVICE_DELETED", "data": { "path": "/machine/peripheral/hca0/virtio-backend" } });
        assert!(!is_deleted(&backend, "hca0"), "the carrier's backend goes first; the HCA is not deleted yet");
        let anon = json!({ "event": "DEVICE_DELETED", "data": { "path": "/machine/peripheral-anon/device[3]" } });
        assert!(is_deleted(&anon, "/machine/peripheral-anon/device[3]"));
        assert!(!is_deleted(&anon, "hca0"));
    }
}
