//! The QEMU command line: the one place QEMU arguments live (machine, vIOMMU, the vhost-user carrier, kernel, consoles).
//! Also the carrier probe, since which device QEMU can create is a fact about this QEMU's arguments.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

/// Guest RAM; also the size of the shared memfd backend vhost-user maps.
pub const MEMORY: &str = "512M";

/// vCPUs of a guest whose run names no processor count (a suite entry's `processors` sets its own). The NT
/// model's processors are threads of the guest program either way; more vCPUs let them really run at once.
pub const DEFAULT_VCPUS: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Tcg,
    Kvm,
}

impl Accel {
    pub fn name(self) -> &'static str {
        match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        }
    }

    pub fn parse(s: &str) -> Option<Accel> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tcg" => Some(Accel::Tcg),
            "kvm" => Some(Accel::Kvm),
            _ => None,
        }
    }
}

/// The QEMU device that carries the vhost-user HCA (QEMU 10.0 has no user-creatable generic vhost-user
/// device; docs/architecture.md, "The carrier device", says why the sound device carries it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Carrier {
    /// QEMU >= 10.2: virtio-id 42 (RDMA), 4 queues, 12-byte config.
    TestDevice,
    /// QEMU 10.0: the sound device's vhost-user front end (virtio-id 25, 4 queues, config via GET_CONFIG).
    Snd,
}

impl Carrier {
    pub fn device_name(self) -> &'static str {
        match self {
            Carrier::TestDevice => "vhost-user-test-device-pci",
            Carrier::Snd => "vhost-user-snd-pci",
        }
    }

    /// Picks the carrier from the text of `qemu -device help`.
    pub fn from_device_help(help: &str) -> Carrier {
        let has_test_device = help.lines().any(|l| l.contains("\"vhost-user-test-device-pci\""));
        if has_test_device {
            Carrier::TestDevice
        } else {
            Carrier::Snd
        }
    }
}

/// Asks this QEMU which carrier it can create.
pub fn probe_carrier(qemu: &Path) -> std::io::Result<Carrier> {
    let out = Command::new(qemu).args(["-device", "help"]).output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!("{} -device help failed: {}", qemu.display(), out.status)));
    }
    Ok(Carrier::from_device_help(&String::from_utf8_lossy(&out.stdout)))
}

/// Where the vhost-user device is reached and how it is presented to the guest.
#[derive(Debug, Clone)]
pub struct VhostUserDevice {
    pub socket: PathBuf,
    pub carrier: Carrier,
    /// iommu_platform=on (the device's DMA goes through the vIOMMU, VIRTIO_F_ACCESS_PLATFORM offered); off only for
    /// the device a driver behind an active IOMMU must refuse (`device = { access_platform = false }`).
    pub access_platform: bool,
}

/// The HCA's chardev id, its QEMU device id and the root port it sits in, on the command line and when hot-plugged.
pub const HCA_CHARDEV: &str = "vhca0";
pub const HCA_DEVICE_ID: &str = "hca0";
pub const HCA_BUS: &str = "rp1";

impl VhostUserDevice {
    /// QMP `chardev-add` arguments: QEMU connects to the device's socket as a client, as `-chardev socket` does.
    pub fn qmp_chardev_add(&self) -> serde_json::Value {
        let path = self.socket.display().to_string();
        serde_json::json!({
            "id": HCA_CHARDEV,
            "backend": { "type": "socket", "data": {
                "addr": { "type": "unix", "data": { "path": path } },
                "server": false
            } }
        })
    }

    /// `-chardev` and `-device` for the HCA on the command line: behind the vIOMMU, so every DMA the device makes is an
    /// IOVA translated through the IOTLB. No disable-legacy: these are modern-only devices and QEMU 10.0 rejects the
    /// property on them.
    pub fn command_line_args(&self) -> [String; 4] {
        let chardev = format!("socket,id={HCA_CHARDEV},path={}", self.socket.display());
        let mut device = format!("{},chardev={HCA_CHARDEV},bus={HCA_BUS}", self.carrier.device_name());
        if self.carrier == Carrier::TestDevice {
            device.push_str(",virtio-id=42,num_vqs=4,config_size=12");
        }
        // ATS is the IOMMU's: a device that bypasses it has none.
        device.push_str(if self.access_platform { ",iommu_platform=on,ats=on" } else { ",iommu_platform=off" });
        ["-chardev".into(), chardev, "-device".into(), device]
    }

    /// QMP `device_add` arguments: the same device as the command line's `-device`, into the empty root port.
    /// Through QMP the booleans are JSON booleans, not "on".
    pub fn qmp_device_add(&self) -> serde_json::Value {
        let mut args = serde_json::json!({
            "driver": self.carrier.device_name(),
            "id": HCA_DEVICE_ID,
            "chardev": HCA_CHARDEV,
            "bus": HCA_BUS,
            "iommu_platform": self.access_platform,
            "ats": self.access_platform,
        });
        if self.carrier == Carrier::TestDevice {
            args["virtio-id"] = 42.into();
            args["num_vqs"] = 4.into();
            args["config_size"] = 12.into();
        }
        args
    }
}

/// QEMU's gdb stub: `-gdb tcp::PORT`, and `-S` (start paused until gdb continues) only when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdbStub {
    pub port: u16,
    pub wait: bool,
}

/// Appends words to a command line.
pub fn push<S: AsRef<str>>(args: &mut Vec<OsString>, words: &[S]) {
    args.extend(words.iter().map(|w| OsString::from(w.as_ref())));
}

// The facts every guest's machine shares (Linux here, Windows in `windows_guest::machine`), one function each.

/// Which of q35's built-in controllers a guest keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtins {
    /// All of them: Windows boots from a disk on q35's AHCI.
    All,
    /// Neither the AHCI (SATA) controller nor the SMBus: the Linux guest has no disk and no SMBus driver. An AHCI
    /// controller that no guest driver owns still has its command list touched by QEMU as it loads a snapshot, which
    /// the vIOMMU refused with a DMAR fault on every restore: a fault interrupt and two console lines in every run
    /// and an unrelated fault in every run's `kernel_log`.
    NoDiskNoSmbus,
}

/// q35 with the split irqchip intel-iommu's interrupt remapping needs, and the accelerator.
pub fn machine_args(accel: Accel, builtins: Builtins) -> [String; 4] {
    let machine = match builtins {
        Builtins::All => "q35,kernel-irqchip=split",
        Builtins::NoDiskNoSmbus => "q35,kernel-irqchip=split,sata=off,smbus=off",
    };
    ["-machine".into(), machine.into(), "-accel".into(), accel.name().into()]
}

/// Guest RAM as a shared memfd: vhost-user maps guest RAM from the backend process.
pub fn shared_memory_args(size: &str) -> [String; 4] {
    let mem = format!("memory-backend-memfd,id=mem,size={size},share=on");
    ["-object".into(), mem, "-numa".into(), "node,memdev=mem".into()]
}

/// The vIOMMU every DMA of the HCA goes through, and the root port the HCA sits in (on the command line, or
/// hot-plugged into it after a restore).
pub fn iommu_args() -> [String; 4] {
    [
        "-device".into(),
        "intel-iommu,intremap=on,device-iotlb=on".into(),
        "-device".into(),
        format!("pcie-root-port,id={HCA_BUS},bus=pcie.0,chassis=1"),
    ]
}

/// The console as a socket QEMU serves (`wait=off`: QEMU starts at once; the runner connects before the guest says
/// anything it needs).
pub fn console_socket_args(socket: &Path) -> [String; 4] {
    let chardev = format!("socket,id=ser0,path={},server=on,wait=off", socket.display());
    ["-chardev".into(), chardev, "-serial".into(), "chardev:ser0".into()]
}

/// No human monitor, QMP on `qmp_socket`, and a guest reboot ends QEMU instead of looping (after a Linux panic with
/// panic=-1, or after Windows wrote its crash dump).
pub fn control_args(qmp_socket: &Path) -> [String; 5] {
    let qmp = format!("unix:{},server=on,wait=off", qmp_socket.display());
    ["-monitor".into(), "none".into(), "-qmp".into(), qmp, "-no-reboot".into()]
}

impl GdbStub {
    /// `-gdb tcp::PORT`, then `-S` when the guest waits for the debugger.
    pub fn args(&self) -> Vec<String> {
        let mut a = vec!["-gdb".to_string(), format!("tcp::{}", self.port)];
        if self.wait {
            a.push("-S".into());
        }
        a
    }
}

/// Everything one QEMU invocation depends on; `args()` turns it into the command line.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    pub qemu: PathBuf,
    pub accel: Accel,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// Kernel command-line words after the fixed ones (`vhca.scenario=smoke`, `vhca.init=probe`, ...).
    pub append: Vec<String>,
    /// None: no HCA (the accelerator probe boots the same machine without it).
    pub device: Option<VhostUserDevice>,
    /// Where the guest's console output goes.
    pub serial_log: PathBuf,
    /// Console as a socket (QEMU the server) the runner reads into `serial_log` and types into; None: QEMU writes
    /// `serial_log` itself. The resident agent of a snapshot reads its run request from it. (Not the chardev's
    /// `logfile=`: QEMU logs a byte again each time the socket is full and the serial retries it.)
    pub serial_socket: Option<PathBuf>,
    pub qmp_socket: PathBuf,
    pub gdb: Option<GdbStub>,
    /// `-incoming defer`: wait for `migrate-incoming` (restore from a snapshot) instead of booting.
    pub incoming_defer: bool,
    /// QEMU's own virtio-rng behind the vIOMMU on a second root port: the in-process device the round-trip bench
    /// measures the HCA against.
    pub rng: bool,
    /// `-smp`: the guest's vCPUs.
    pub vcpus: u32,
}

impl QemuConfig {
    pub fn kernel_cmdline(&self) -> String {
        // no_timer_check: on a loaded host the TCG guest's boot-time check that the timer interrupt arrives through
        // the interrupt-remapped IO-APIC can time out, and the kernel panics ("timer doesn't work through
        // Interrupt-remapped IO-APIC", seen at load 10+ on 2 cores); the timer itself works, the check is too strict.
        let mut words = vec!["console=ttyS0", "intel_iommu=on", "panic=-1", "quiet", "no_timer_check"];
        words.extend(self.append.iter().map(String::as_str));
        words.join(" ")
    }

    pub fn args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::new();
        push(&mut a, &machine_args(self.accel, Builtins::NoDiskNoSmbus));
        push(&mut a, &["-cpu", if self.accel == Accel::Kvm { "host" } else { "max" }]);
        push(&mut a, &["-m".to_string(), MEMORY.to_string(), "-smp".to_string(), self.vcpus.to_string()]);
        push(&mut a, &shared_memory_args(MEMORY));
        push(&mut a, &iommu_args());
        // A guest kernel panic reaches QMP as GUEST_PANICKED through the pvpanic device (the image loads
        // pvpanic-mmio), so a panic is seen even when the console is quiet or cut off.
        push(&mut a, &["-device", "pvpanic"]);
        if let Some(dev) = &self.device {
            push(&mut a, &dev.command_line_args());
        }
        if self.rng {
            push(&mut a, &["-device", "pcie-root-port,id=rp2,bus=pcie.0,chassis=2"]);
            push(&mut a, &["-device", "virtio-rng-pci,bus=rp2,iommu_platform=on,ats=on,disable-legacy=on"]);
        }
        a.push("-kernel".into());
        a.push(self.kernel.clone().into());
        a.push("-initrd".into());
        a.push(self.initrd.clone().into());
        push(&mut a, &["-append".to_string(), self.kernel_cmdline()]);
        push(&mut a, &["-display", "none", "-vga", "none", "-nic", "none"]);
        match &self.serial_socket {
            None => push(&mut a, &["-serial".to_string(), format!("file:{}", self.serial_log.display())]),
            Some(socket) => push(&mut a, &console_socket_args(socket)),
        }
        push(&mut a, &control_args(&self.qmp_socket));
        if let Some(gdb) = self.gdb {
            push(&mut a, &gdb.args());
        }
        if self.incoming_defer {
            push(&mut a, &["-incoming", "defer"]);
        }
        a
    }

    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.qemu);
        cmd.args(self.args());
        cmd
    }
}

/// A shell-pastable rendering of a command line, for reproducers and `vhca-run qemu-args`.
pub fn shell_line(program: &Path, args: &[OsString]) -> String {
    std::iter::once(program.as_os_str())
        .chain(args.iter().map(OsString::as_os_str))
        .map(|w| shell_words::quote(&w.to_string_lossy()).into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(device: Option<VhostUserDevice>, accel: Accel) -> QemuConfig {
        QemuConfig {
            qemu: "qemu-system-x86_64".into(),
            accel,
            kernel: "/img/vmlinux".into(),
            initrd: "/img/initramfs.cpio".into(),
            append: vec!["vhca.scenario=smoke".into()],
            device,
            serial_log: "/run/serial.log".into(),
            serial_socket: None,
            qmp_socket: "/run/qmp.sock".into(),
            gdb: None,
            incoming_defer: false,
            rng: false,
            vcpus: DEFAULT_VCPUS,
        }
    }

    fn strings(c: &QemuConfig) -> Vec<String> {
        c.args().into_iter().map(|s| s.into_string().unwrap()).collect()
    }

    /// The value following `flag`, for every occurrence.
    fn values<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
        args.windows(2).filter(|w| w[0] == flag).map(|w| w[1].as_str()).collect()
    }

    #[test]
    fn the_guest_gets_the_vcpus_its_run_asks_for() {
        let mut c = config(None, Accel::Tcg);
        assert_eq!(values(&strings(&c), "-smp"), [DEFAULT_VCPUS.to_string()]);
        c.vcpus = 4;
        assert_eq!(values(&strings(&c), "-smp"), ["4"]);
    }

    #[test]
    fn snd_carrier_behind_the_iommu_with_shared_memory() {
        let dev = VhostUserDevice { socket: "/run/dev.sock".into(), carrier: Carrier::Snd, access_platform: true };
        let args = strings(&config(Some(dev), Accel::Tcg));
        assert_eq!(values(&args, "-machine"), ["q35,kernel-irqchip=split,sata=off,smbus=off"]);
        assert_eq!(values(&args, "-accel"), ["tcg"]);
        assert_eq!(values(&args, "-cpu"), ["max"]);
        assert_eq!(values(&args, "-object"), ["memory-backend-memfd,id=mem,size=512M,share=on"]);
        assert_eq!(values(&args, "-chardev"), ["socket,id=vhca0,path=/run/dev.sock"]);
        let devices = values(&args, "-device");
        assert!(devices.contains(&"intel-iommu,intremap=on,device-iotlb=on"));
        assert!(devices.contains(&"pcie-root-port,id=rp1,bus=pcie.0,chassis=1"));
        assert!(devices.contains(&"vhost-user-snd-pci,chardev=vhca0,bus=rp1,iommu_platform=on,ats=on"));
        let append = values(&args, "-append");
        assert_eq!(append, ["console=ttyS0 intel_iommu=on panic=-1 quiet no_timer_check vhca.scenario=smoke"]);
        assert_eq!(values(&args, "-serial"), ["file:/run/serial.log"]);
        assert_eq!(values(&args, "-qmp"), ["unix:/run/qmp.sock,server=on,wait=off"]);
        assert_eq!(values(&args, "-kernel"), ["/img/vmlinux"]);
        assert!(args.contains(&"-no-reboot".to_string()));
        assert!(devices.contains(&"pvpanic"));
        assert!(!args.contains(&"-S".to_string()) && values(&args, "-gdb").is_empty());
    }

    #[test]
    fn test_device_carrier_gets_its_virtio_id_and_kvm_uses_host_cpu() {
        let dev = VhostUserDevice { socket: "/s".into(), carrier: Carrier::TestDevice, access_platform: true };
        let mut c = config(Some(dev), Accel::Kvm);
        c.gdb = Some(GdbStub { port: 4321, wait: true });
        let args = strings(&c);
        assert_eq!(values(&args, "-accel"), ["kvm"]);
        assert_eq!(values(&args, "-cpu"), ["host"]);
        let dev = values(&args, "-device").into_iter().find(|d| d.starts_with("vhost-user")).unwrap();
        assert!(
            dev.starts_with("vhost-user-test-device-pci,chardev=vhca0,bus=rp1,virtio-id=42,num_vqs=4,config_size=12")
        );
        assert_eq!(values(&args, "-gdb"), ["tcp::4321"]);
        assert!(args.contains(&"-S".to_string()));
        c.gdb = Some(GdbStub { port: 1234, wait: false });
        let args = strings(&c);
        assert_eq!(values(&args, "-gdb"), ["tcp::1234"]);
        assert!(!args.contains(&"-S".to_string()), "a gdb stub without --gdb-wait must not pause the guest");
    }

    #[test]
    fn probe_machine_has_no_hca() {
        let args = strings(&config(None, Accel::Kvm));
        assert!(values(&args, "-chardev").is_empty());
        assert!(!values(&args, "-device").iter().any(|d| d.starts_with("vhost-user")));
    }

    #[test]
    fn snapshot_machine_has_a_console_socket_an_empty_root_port_and_waits_for_its_state() {
        let mut c = config(None, Accel::Tcg);
        c.serial_socket = Some("/run/serial.sock".into());
        c.incoming_defer = true;
        let args = strings(&c);
        assert_eq!(values(&args, "-chardev"), ["socket,id=ser0,path=/run/serial.sock,server=on,wait=off"]);
        assert_eq!(values(&args, "-serial"), ["chardev:ser0"]);
        assert_eq!(values(&args, "-incoming"), ["defer"]);
        assert!(values(&args, "-device").contains(&"pcie-root-port,id=rp1,bus=pcie.0,chassis=1"));
        c.incoming_defer = false;
        assert!(values(&strings(&c), "-incoming").is_empty());
    }

    #[test]
    fn a_device_without_access_platform_bypasses_the_viommu_on_the_command_line_and_when_hot_plugged() {
        let dev = VhostUserDevice { socket: "/s".into(), carrier: Carrier::Snd, access_platform: false };
        assert_eq!(dev.command_line_args()[3], "vhost-user-snd-pci,chardev=vhca0,bus=rp1,iommu_platform=off");
        let add = dev.qmp_device_add();
        assert_eq!((add["iommu_platform"].as_bool(), add["ats"].as_bool()), (Some(false), Some(false)));
    }

    #[test]
    fn hot_plug_arguments_match_the_command_line_device() {
        let dev = VhostUserDevice { socket: "/r/dev.sock".into(), carrier: Carrier::Snd, access_platform: true };
        let chardev = dev.qmp_chardev_add();
        assert_eq!(chardev["id"], "vhca0");
        assert_eq!(chardev["backend"]["data"]["addr"]["data"]["path"], "/r/dev.sock");
        assert_eq!(chardev["backend"]["data"]["server"], false);
        let add = dev.qmp_device_add();
        assert_eq!(add["driver"], "vhost-user-snd-pci");
        assert_eq!((add["bus"].as_str(), add["chardev"].as_str()), (Some("rp1"), Some("vhca0")));
        assert_eq!((add["iommu_platform"].as_bool(), add["ats"].as_bool()), (Some(true), Some(true)));
        assert!(add.get("virtio-id").is_none());
        let test = VhostUserDevice { socket: "/s".into(), carrier: Carrier::TestDevice, access_platform: true }
            .qmp_device_add();
        assert_eq!((test["virtio-id"].as_u64(), test["num_vqs"].as_u64()), (Some(42), Some(4)));
    }

    #[test]
    fn carrier_choice_from_device_help() {
        let old = "name \"vhost-user-snd-pci\", bus PCI\nname \"virtio-rng-pci\", bus PCI\n";
        let new = "name \"vhost-user-test-device-pci\", bus PCI\nname \"vhost-user-snd-pci\", bus PCI\n";
        assert_eq!(Carrier::from_device_help(old), Carrier::Snd);
        assert_eq!(Carrier::from_device_help(new), Carrier::TestDevice);
    }

    #[test]
    fn shell_line_quotes_what_needs_it() {
        let line = shell_line(Path::new("qemu"), &["-append".into(), "a b 'c'".into(), "x=1,y".into()]);
        assert_eq!(line, r"qemu -append 'a b '\''c'\''' 'x=1,y'");
        // What a shell reads back is the command line itself.
        assert_eq!(shell_words::split(&line).unwrap(), ["qemu", "-append", "a b 'c'", "x=1,y"]);
    }
}
