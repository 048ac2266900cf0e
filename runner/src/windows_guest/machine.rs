//! The QEMU command line of a Windows guest. The facts it shares with the Linux guest's machine (q35 with the split
//! irqchip, the shared memfd RAM, intel-iommu and the root port, the HCA on its carrier, the console socket, QMP, the
//! gdb stub) come from `qemu_cmd`; what is Windows' own is here: firmware, disks, the e1000e KDNET needs, and the
//! Hyper-V enlightenments with `hv-crash`. QEMU 10.0.2 here accepts this command line (runner/tests/windows_machine.rs
//! starts it paused with a blank disk); no Windows has booted on it here.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::qemu_cmd::{
    console_socket_args, control_args, iommu_args, machine_args, push, shared_memory_args, Accel, Builtins, GdbStub,
    VhostUserDevice,
};

/// Windows 11 asks for 4 GiB; the shared memfd is as large as guest RAM.
pub const WINDOWS_MEMORY: &str = "4G";
pub const WINDOWS_CPUS: &str = "2";

/// OVMF from Debian's `ovmf` package, without Secure Boot (test signing needs it off).
pub const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
pub const OVMF_VARS_TEMPLATE: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";

/// The Hyper-V enlightenments: Windows runs better with them, and `hv-crash` makes it write a bugcheck's code and
/// parameters to the crash MSRs, which QEMU reports in GUEST_PANICKED. With enlightenments on, KDNET needs the KVM
/// vendor id (virtio-win/kvm-guest-drivers-windows#1325): Windows then does not take the hypervisor for Hyper-V and
/// looks for a physical NIC (the e1000e) instead of a Hyper-V synthetic one QEMU does not have.
pub const HYPERV_FLAGS: &str = "hv-relaxed,hv-vapic,hv-spinlocks=0x1fff,hv-vpindex,hv-runtime,hv-time,hv-synic,\
hv-stimer,hv-frequencies,hv-reset,hv-crash,hv-vendor-id=KVMKVMKVM";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Firmware {
    /// OVMF: needed for Windows 11 (GPT, UEFI boot).
    Uefi,
    /// SeaBIOS: Windows 10 and Server install on MBR this way too, without the UEFI "press any key" prompt.
    Bios,
}

/// The KDNET NIC: an e1000e (one of the NICs Microsoft lists for KDNET; virtio-net is not) on QEMU's user-mode
/// network, so the guest reaches the QEMU host as 10.0.2.2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KdnetNic {
    /// Fixed, so Windows sees the same NIC at every boot of the image.
    pub mac: String,
}

pub const KDNET_MAC: &str = "52:54:00:76:68:01";

/// Everything one Windows QEMU invocation depends on.
#[derive(Debug, Clone)]
pub struct WindowsMachine {
    pub qemu: PathBuf,
    pub accel: Accel,
    pub firmware: Firmware,
    /// UEFI only: this machine's own copy of the OVMF variables (boot order and the like live there).
    pub ovmf_vars: Option<PathBuf>,
    /// The system disk (qcow2): the install target, a boot state, or a run's throwaway overlay.
    pub disk: PathBuf,
    /// Install media, in order (the Windows ISO, then the answer disc); none for a run.
    pub cdroms: Vec<PathBuf>,
    pub device: Option<VhostUserDevice>,
    pub nic: Option<KdnetNic>,
    /// COM1 as a socket the runner reads (results) and writes (the run's request).
    pub serial_socket: PathBuf,
    pub qmp_socket: PathBuf,
    pub gdb: Option<GdbStub>,
    /// `-S`: start paused (the debug subcommand continues it once the debugger is attached).
    pub paused: bool,
    /// `-no-reboot`: a run or boot-state machine ends at the guest's reboot; the install must reboot several times.
    pub end_at_reboot: bool,
    /// A VNC display for watching the install (`-vnc 127.0.0.1:N`).
    pub vnc: Option<u16>,
}

impl WindowsMachine {
    pub fn args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::new();
        push(&mut a, &machine_args(self.accel, Builtins::All));
        let cpu = if self.accel == Accel::Kvm { "host" } else { "max" };
        push(&mut a, &["-cpu".to_string(), format!("{cpu},{HYPERV_FLAGS}")]);
        push(&mut a, &["-m", WINDOWS_MEMORY, "-smp", WINDOWS_CPUS]);
        push(&mut a, &shared_memory_args(WINDOWS_MEMORY));
        push(&mut a, &iommu_args());
        if let Some(dev) = &self.device {
            push(&mut a, &dev.command_line_args());
        }
        if self.firmware == Firmware::Uefi {
            push(&mut a, &["-drive".to_string(), format!("if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}")]);
            if let Some(vars) = &self.ovmf_vars {
                push(&mut a, &["-drive".to_string(), format!("if=pflash,format=raw,unit=1,file={}", vars.display())]);
            }
        }
        // q35's built-in AHCI (ich9-ahci): Windows' inbox storahci drives it, no virtio-win needed.
        let disk = format!("file={},if=none,id=disk0,format=qcow2,cache=unsafe", self.disk.display());
        push(
            &mut a,
            &["-drive".to_string(), disk, "-device".into(), "ide-hd,drive=disk0,bus=ide.0,bootindex=1".into()],
        );
        for (i, iso) in self.cdroms.iter().enumerate() {
            let drive = format!("file={},if=none,id=cd{i},media=cdrom,readonly=on", iso.display());
            let dev = format!("ide-cd,drive=cd{i},bus=ide.{},bootindex={}", i + 1, i + 2);
            push(&mut a, &["-drive".to_string(), drive, "-device".into(), dev]);
        }
        match &self.nic {
            Some(nic) => {
                push(&mut a, &["-netdev", "user,id=kd0", "-device", &format!("e1000e,netdev=kd0,mac={}", nic.mac)])
            }
            None => push(&mut a, &["-nic", "none"]),
        }
        // Windows keeps the RTC in local time.
        push(&mut a, &["-rtc", "base=localtime"]);
        push(&mut a, &["-vga", "std", "-display", "none"]);
        if let Some(display) = self.vnc {
            push(&mut a, &["-vnc".to_string(), format!("127.0.0.1:{display}")]);
        }
        push(&mut a, &console_socket_args(&self.serial_socket));
        // On a bugcheck QEMU reports GUEST_PANICKED and lets the guest go on (`none`): Windows writes its dump and
        // reboots, which -no-reboot turns into QEMU's exit. The default (shutdown) would stop it before the dump.
        push(&mut a, &["-action", "panic=none"]);
        let mut control: Vec<String> = control_args(&self.qmp_socket).to_vec();
        if !self.end_at_reboot {
            control.retain(|w| w != "-no-reboot");
        }
        push(&mut a, &control);
        if let Some(gdb) = self.gdb {
            push(&mut a, &gdb.args());
        }
        if self.paused && !self.gdb.is_some_and(|g| g.wait) {
            push(&mut a, &["-S"]);
        }
        a
    }

    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.qemu);
        cmd.args(self.args());
        cmd
    }
}

/// A fresh copy of OVMF's variable store for one machine (each run's firmware writes to its own).
pub fn copy_ovmf_vars(to: &Path) -> std::io::Result<()> {
    std::fs::copy(OVMF_VARS_TEMPLATE, to).map(|_| ())
}
