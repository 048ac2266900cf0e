//! The Windows guest's QEMU command line: golden words, then the real QEMU here starting that machine paused (blank
//! disk, OVMF, the HCA from a real vhca-device, the e1000e) and showing the PCI devices a Windows guest would see; and
//! No Windows boots in any of this: there is no Windows image here.
//! Prerequisites missing (QEMU, OVMF, vhca-device): the test fails under CI=true, is skipped elsewhere.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use vhca_run::device::{launch, DeviceConfig};
use vhca_run::paths::Binaries;
use vhca_run::qemu_cmd::{probe_carrier, Accel, Carrier, GdbStub, VhostUserDevice};
use vhca_run::qmp::Qmp;
use vhca_run::supervise::Supervised;
use vhca_run::windows_guest::machine::{Firmware, KdnetNic, WindowsMachine, KDNET_MAC, OVMF_CODE, OVMF_VARS_TEMPLATE};

fn machine(dir: &Path, device: Option<VhostUserDevice>) -> WindowsMachine {
    WindowsMachine {
        qemu: Binaries::resolve(None, None).qemu,
        accel: Accel::Tcg,
        firmware: Firmware::Uefi,
        ovmf_vars: Some(dir.join("OVMF_VARS.fd")),
        disk: dir.join("disk.qcow2"),
        cdroms: Vec::new(),
        device,
        nic: Some(KdnetNic { mac: KDNET_MAC.into() }),
        serial_socket: dir.join("serial.sock"),
        qmp_socket: dir.join("qmp.sock"),
        gdb: None,
        paused: true,
        end_at_reboot: true,
        vnc: None,
    }
}

fn words(m: &WindowsMachine) -> Vec<String> {
    m.args().into_iter().map(|a| a.into_string().unwrap()).collect()
}

fn values<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
    args.windows(2).filter(|w| w[0] == flag).map(|w| w[1].as_str()).collect()
}

#[test]
fn windows_command_line_golden() {
    let hca = VhostUserDevice { socket: "/r/device.sock".into(), carrier: Carrier::Snd, access_platform: true };
    let mut m = machine(Path::new("/r"), Some(hca));
    m.accel = Accel::Kvm;
    m.cdroms = vec!["/isos/win.iso".into(), "/r/answer.iso".into()];
    let a = words(&m);
    assert_eq!(values(&a, "-machine"), ["q35,kernel-irqchip=split"]);
    assert_eq!(values(&a, "-accel"), ["kvm"]);
    assert_eq!(
        values(&a, "-cpu"),
        ["host,hv-relaxed,hv-vapic,hv-spinlocks=0x1fff,hv-vpindex,hv-runtime,hv-time,hv-synic,hv-stimer,\
          hv-frequencies,hv-reset,hv-crash,hv-vendor-id=KVMKVMKVM"]
    );
    assert_eq!(values(&a, "-m"), ["4G"]);
    assert_eq!(values(&a, "-object"), ["memory-backend-memfd,id=mem,size=4G,share=on"]);
    assert_eq!(
        values(&a, "-device"),
        [
            "intel-iommu,intremap=on,device-iotlb=on",
            "pcie-root-port,id=rp1,bus=pcie.0,chassis=1",
            "vhost-user-snd-pci,chardev=vhca0,bus=rp1,iommu_platform=on,ats=on",
            "ide-hd,drive=disk0,bus=ide.0,bootindex=1",
            "ide-cd,drive=cd0,bus=ide.1,bootindex=2",
            "ide-cd,drive=cd1,bus=ide.2,bootindex=3",
            "e1000e,netdev=kd0,mac=52:54:00:76:68:01",
        ]
    );
    assert_eq!(
        values(&a, "-drive"),
        [
            format!("if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}").as_str(),
            "if=pflash,format=raw,unit=1,file=/r/OVMF_VARS.fd",
            "file=/r/disk.qcow2,if=none,id=disk0,format=qcow2,cache=unsafe",
            "file=/isos/win.iso,if=none,id=cd0,media=cdrom,readonly=on",
            "file=/r/answer.iso,if=none,id=cd1,media=cdrom,readonly=on",
        ]
    );
    assert_eq!(values(&a, "-netdev"), ["user,id=kd0"]);
    assert_eq!(
        values(&a, "-chardev"),
        ["socket,id=vhca0,path=/r/device.sock", "socket,id=ser0,path=/r/serial.sock,server=on,wait=off"]
    );
    assert_eq!(values(&a, "-serial"), ["chardev:ser0"]);
    assert_eq!(values(&a, "-action"), ["panic=none"]);
    assert_eq!(values(&a, "-qmp"), ["unix:/r/qmp.sock,server=on,wait=off"]);
    assert!(a.contains(&"-no-reboot".into()) && a.contains(&"-S".into()));
    assert!(values(&a, "-kernel").is_empty() && !a.contains(&"pvpanic".into()), "Windows has no pvpanic driver inbox");

    // The install reboots; a BIOS machine has no pflash; the debug machine has a stub that does not pause twice.
    m.end_at_reboot = false;
    m.firmware = Firmware::Bios;
    m.gdb = Some(GdbStub { port: 1234, wait: false });
    let a = words(&m);
    assert!(!a.contains(&"-no-reboot".into()));
    assert!(!values(&a, "-drive").iter().any(|d| d.starts_with("if=pflash")));
    assert_eq!(values(&a, "-gdb"), ["tcp::1234"]);
    assert_eq!(a.iter().filter(|w| *w == "-S").count(), 1);
}

/// What this test needs, or why it cannot run.
fn prerequisites(need_device: bool) -> Result<Binaries, String> {
    let bins = Binaries::resolve(None, None);
    for (path, what) in [(OVMF_CODE, "OVMF (apt-get install ovmf)"), (OVMF_VARS_TEMPLATE, "OVMF variables")] {
        if !Path::new(path).is_file() {
            return Err(format!("{what}: {path} missing"));
        }
    }
    Command::new(&bins.qemu).arg("--version").output().map_err(|e| format!("{}: {e}", bins.qemu.display()))?;
    if need_device && !bins.device.is_file() {
        return Err(format!("vhca-device not built at {} (or set VHCA_DEVICE_BIN)", bins.device.display()));
    }
    Ok(bins)
}

fn ready(test: &str, need_device: bool) -> Option<Binaries> {
    match prerequisites(need_device) {
        Ok(b) => Some(b),
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{test}: prerequisite missing under CI: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED {test}: {why}");
            None
        }
    }
}

#[test]
fn qemu_here_starts_the_windows_machine_with_the_hca_and_the_kdnet_nic() {
    let Some(bins) = ready("qemu_here_starts_the_windows_machine", true) else { return };
    let dir = tempfile::tempdir().unwrap();
    let made = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(dir.path().join("disk.qcow2"))
        .arg("1G")
        .status()
        .unwrap();
    assert!(made.success());
    std::fs::copy(OVMF_VARS_TEMPLATE, dir.path().join("OVMF_VARS.fd")).unwrap();
    let socket = dir.path().join("device.sock");
    let cfg = DeviceConfig {
        bin: bins.device.clone(),
        socket: socket.clone(),
        event_log: dir.path().join("events.jsonl"),
        run_args: Vec::new(),
    };
    let _device = launch(&cfg, &dir.path().join("device.log"), Duration::from_secs(10)).unwrap();
    let carrier = probe_carrier(&bins.qemu).unwrap();
    let m = machine(dir.path(), Some(VhostUserDevice { socket, carrier, access_platform: true }));
    let log = dir.path().join("qemu.log");
    let mut qemu = Supervised::spawn("qemu", m.command(), Some(&log)).unwrap();
    let qmp = Qmp::connect(&m.qmp_socket, Duration::from_secs(20));
    let mut qmp =
        qmp.unwrap_or_else(|e| panic!("{e}; QEMU said: {}", std::fs::read_to_string(&log).unwrap_or_default()));
    let t = Duration::from_secs(10);
    assert_eq!(qmp.query_status(t).unwrap(), "prelaunch", "-S: paused before the first instruction");
    let pci = qmp.execute("query-pci", None, t).unwrap();
    let mut ids = Vec::new();
    collect_ids(&pci, &mut ids);
    assert!(ids.contains(&(0x8086, 0x10D3)), "the e1000e KDNET needs: {ids:04x?}");
    // Before the firmware numbers the buses, query-pci cannot walk behind the root port: the device tree can.
    let qtree =
        qmp.execute("human-monitor-command", Some(serde_json::json!({"command-line": "info qtree"})), t).unwrap();
    let qtree = qtree.as_str().unwrap_or_default();
    let carrier_in_root_port =
        qtree.split("dev: pcie-root-port").nth(1).is_some_and(|rest| rest.contains(carrier.device_name()));
    assert!(carrier_in_root_port, "the HCA ({}) behind the root port:\n{qtree}", carrier.device_name());
    assert!(qtree.contains("iommu_platform = true") && qtree.contains("ats = true"), "{qtree}");
    assert!(qtree.contains("dev: intel-iommu"), "{qtree}");
    assert!(ids.contains(&(0x8086, 0x2922)), "q35's ich9-ahci for the disk: {ids:04x?}");
    let _ = qmp.execute("quit", None, t);
    assert!(qemu.wait_timeout(Duration::from_secs(10)).unwrap().is_some(), "QEMU did not quit");
}

/// Every (vendor, device) id in a query-pci answer, bridges' buses included.
fn collect_ids(v: &serde_json::Value, out: &mut Vec<(u64, u64)>) {
    if let (Some(vendor), Some(device)) =
        (v.get("id").and_then(|i| i.get("vendor")), v.get("id").and_then(|i| i.get("device")))
    {
        out.push((vendor.as_u64().unwrap_or(0), device.as_u64().unwrap_or(0)));
    }
    match v {
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_ids(x, out)),
        serde_json::Value::Object(o) => o.values().for_each(|x| collect_ids(x, out)),
        _ => {}
    }
}
