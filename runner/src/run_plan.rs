//! A run's plan, before any process starts: the device's and QEMU's configurations (cold, or the saved machine's for
//! a restore) and the command lines written into the run's files, as a person would repeat the run.

use std::fs;
use std::path::Path;

use vhca_suite::ConcreteRun;

use crate::device::DeviceConfig;
use crate::qemu_cmd::{shell_line, QemuConfig, VhostUserDevice, DEFAULT_VCPUS};
use crate::run_context::{baked_guest_options, RunContext};
use crate::run_files::RunFiles;
use crate::snapshot::{MachineFiles, SavedMachine, Snapshot};
use crate::windows_guest::machine::WindowsMachine;

/// The guest scenario that times the round trip; a run of it gets QEMU's virtio-rng next to the HCA.
pub const ROUNDTRIP_SCENARIO: &str = "roundtrip";

/// The device and QEMU configurations of a run whose files live in `dir`: the run's device arguments and its guest
/// parameters on the kernel command line.
pub fn plan(ctx: &RunContext, run: &ConcreteRun, dir: &Path) -> (DeviceConfig, QemuConfig) {
    let files = RunFiles { dir: dir.to_path_buf() };
    let device = DeviceConfig {
        bin: ctx.bins.device.clone(),
        socket: files.socket(),
        event_log: files.events(),
        run_args: run.device_args(),
    };
    let qemu = QemuConfig {
        qemu: ctx.bins.qemu.clone(),
        accel: ctx.accel,
        kernel: ctx.image.kernel.clone(),
        initrd: ctx.image.initrd.clone(),
        append: baked_guest_options()
            .into_iter()
            .chain(run.guest_params().into_iter().map(|(k, v)| format!("{k}={v}")))
            .collect(),
        device: Some(VhostUserDevice {
            socket: files.socket(),
            carrier: ctx.carrier,
            access_platform: !run.device.without_access_platform,
        }),
        serial_log: files.serial(),
        serial_socket: None,
        qmp_socket: files.qmp(),
        gdb: ctx.gdb,
        incoming_defer: false,
        rng: run.guest.scenario == ROUNDTRIP_SCENARIO,
        vcpus: vcpus(run),
    };
    (device, qemu)
}

/// The guest's vCPUs for a run: as many as its NT model's processors when it names them.
pub fn vcpus(run: &ConcreteRun) -> u32 {
    run.interleaving.processors.unwrap_or(DEFAULT_VCPUS)
}

/// The snapshot path's QEMU: the saved machine's exact command line with this run's files and `-incoming defer`.
pub fn plan_restore(machine: &SavedMachine, dir: &Path) -> QemuConfig {
    let files = RunFiles { dir: dir.to_path_buf() };
    let machine_files =
        MachineFiles { serial_log: files.serial(), serial_socket: files.serial_socket(), qmp_socket: files.qmp() };
    machine.config(&machine_files, true)
}

/// The two command lines of a run, shell-pastable: device first, then QEMU.
pub fn command_lines(device: &DeviceConfig, qemu: &QemuConfig) -> (String, String) {
    let device_args: Vec<std::ffi::OsString> = device.args().into_iter().map(Into::into).collect();
    (shell_line(&device.bin, &device_args), shell_line(&qemu.qemu, &qemu.args()))
}

/// Writes the run's two command lines into its files: a Windows run's QEMU with the request it then types on COM1,
/// and for a restore the QMP steps and the request that follow QEMU's start.
pub fn record_command_lines(
    files: &RunFiles,
    device: &DeviceConfig,
    qemu: &QemuConfig,
    windows: Option<&WindowsMachine>,
    snapshot: Option<&Snapshot>,
    hca: &VhostUserDevice,
    request: &str,
) -> std::io::Result<()> {
    let (device_line, mut qemu_line) = command_lines(device, qemu);
    if let Some(m) = windows {
        qemu_line = format!(
            "{}\n# then on COM1, after {}: {request}",
            shell_line(&m.qemu, &m.args()),
            crate::snapshot::READY_LINE
        );
    }
    if let Some(s) = snapshot {
        qemu_line.push_str(&format!(
            "\n# then over QMP: migrate-set-capabilities {}; migrate-incoming file:{}; chardev-add {}; device_add {}; cont\n\
             # then on the console: {request}",
            crate::snapshot::capabilities(),
            s.state.display(),
            hca.qmp_chardev_add(),
            hca.qmp_device_add(),
        ));
    }
    fs::write(files.device_cmdline(), format!("{device_line}\n"))?;
    fs::write(files.qemu_cmdline(), format!("{qemu_line}\n"))
}
