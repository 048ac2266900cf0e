//! `vhca-run windows-image build`: one command from the user's Windows ISO and the driver package to an image
//! directory the runner boots. Steps, each logged and each named when it fails: check the inputs, write the answer
//! disc (autounattend.xml, the set-up script, the agent, the driver package) with xorriso, create the system disk,
//! install unattended (the guest powers off when its set-up is done, reporting every step on COM1), then one boot
//! state per verifier setting (an overlay on the installed disk, booted once to set Driver Verifier), then image.json.
//!
//! NEVER RUN END TO END: the machines this is developed on have no Windows ISO and no licence. The generated files,
//! the command lines and the QEMU machine's acceptance by QEMU are tested here; the install itself is not.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use super::agent_script::agent_script;
use super::answer_file::AnswerSettings;
use super::guest_setup::{
    first_logon_commands, setup_script, setup_steps, state_file, AGENT_FILE, DISC_DIR, PACKAGE_FILES, SETUP_DONE,
    SETUP_FAILED, SETUP_FILE, SETUP_MARK,
};
use super::image_dir::{ImageMeta, WindowsImage, BASE_DISK, META_FILE, OVMF_VARS};
use super::kdnet::{KdnetKey, KdnetSettings};
use super::machine::{copy_ovmf_vars, Firmware, KdnetNic, WindowsMachine, KDNET_MAC, OVMF_CODE};
use crate::qemu_cmd::Accel;
use crate::qmp::Qmp;
use crate::serial_capture::{ConsolePort, SerialLog};
use crate::snapshot::READY_LINE;
use crate::supervise::{tick, Supervised};

/// The system disk's virtual size; qcow2 grows as Windows writes.
pub const DISK_SIZE: &str = "64G";
/// An unattended install with updates off takes 20-60 minutes under KVM (Microsoft gives no figure; an estimate).
pub const INSTALL_TIMEOUT: Duration = Duration::from_secs(3 * 3600);
/// Booting a boot state, setting the verifier and powering off.
pub const STATE_TIMEOUT: Duration = Duration::from_secs(20 * 60);
/// A long step says it is still alive this often.
const PROGRESS_EVERY: Duration = Duration::from_secs(300);
/// OVMF's "Press any key to boot from CD or DVD" waits about 5 s; keys go in for this long after the start.
const PRESS_KEYS_FOR: Duration = Duration::from_secs(40);

/// What the user asks for.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    pub iso: PathBuf,
    /// The test-signed driver package directory (issue 12: target/vhca-sys/).
    pub driver_package: PathBuf,
    pub out: PathBuf,
    pub edition: String,
    pub locale: String,
    pub product_key: Option<String>,
    pub account: String,
    pub password: String,
    pub firmware: Firmware,
    pub kdnet_host_ip: Ipv4Addr,
    pub kdnet_port: u16,
    /// Boot states besides "off" (0 is always built).
    pub verifier_flags: Vec<u32>,
    pub qemu: PathBuf,
    pub accel: Accel,
    pub vnc: Option<u16>,
}

/// A step that failed, by name.
#[derive(Debug, thiserror::Error)]
#[error("windows-image step \"{step}\" failed: {why}")]
pub struct StepError {
    pub step: String,
    pub why: String,
}

fn fail(step: &str) -> impl Fn(String) -> StepError + '_ {
    move |why| StepError { step: step.to_string(), why }
}

/// The answer disc's files besides the driver package: path on the disc, contents.
pub fn answer_disc_files(opts: &BuildOptions, kdnet: &KdnetSettings) -> Vec<(String, String)> {
    let answers = AnswerSettings {
        edition: opts.edition.clone(),
        locale: opts.locale.clone(),
        product_key: opts.product_key.clone(),
        computer_name: "VHCA-WIN".into(),
        account: opts.account.clone(),
        password: opts.password.clone(),
        firmware: opts.firmware,
        first_logon: first_logon_commands(),
    };
    vec![
        ("autounattend.xml".into(), answers.to_xml()),
        (format!("{DISC_DIR}/{SETUP_FILE}"), setup_script(&setup_steps(kdnet))),
        (format!("{DISC_DIR}/{AGENT_FILE}"), agent_script()),
    ]
}

/// xorriso in mkisofs mode: Joliet (Windows reads its long names) and Rock Ridge, a volume label Setup does not care
/// about; autounattend.xml at the root, where Windows Setup looks for it on every removable drive.
pub fn xorriso_args(staging: &Path, iso: &Path) -> Vec<String> {
    ["-as", "mkisofs", "-quiet", "-J", "-joliet-long", "-r", "-V", "VHCA_ANSWER", "-o"]
        .iter()
        .map(|s| s.to_string())
        .chain([iso.display().to_string(), staging.display().to_string()])
        .collect()
}

pub fn qemu_img_create(disk: &Path) -> Vec<String> {
    vec!["create".into(), "-q".into(), "-f".into(), "qcow2".into(), disk.display().to_string(), DISK_SIZE.into()]
}

/// An overlay on `backing` (named as given: a bare file name keeps an image directory movable).
pub fn qemu_img_overlay(backing: &str, overlay: &Path) -> Vec<String> {
    ["create", "-q", "-f", "qcow2", "-b", backing, "-F", "qcow2"]
        .iter()
        .map(|s| s.to_string())
        .chain([overlay.display().to_string()])
        .collect()
}

/// The request that makes a boot state's agent set Driver Verifier and power off.
pub fn state_request(flags: u32) -> String {
    json!({ "params": ["vhca.setup=verifier", format!("vhca.verifier={flags:#x}")] }).to_string()
}

fn run_tool(program: &str, args: &[String], step: &str) -> Result<(), StepError> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| fail(step)(format!("cannot run {program}: {e} (ci/setup-host.sh installs it)")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(fail(step)(format!("{program} {}: {}: {}", args.join(" "), out.status, err.trim())));
    }
    Ok(())
}

fn check_inputs(opts: &BuildOptions) -> Result<(), StepError> {
    let f = fail("check inputs");
    if !opts.iso.is_file() {
        return Err(f(format!("Windows ISO {} not found", opts.iso.display())));
    }
    for file in PACKAGE_FILES {
        let p = opts.driver_package.join(file);
        if !p.is_file() {
            return Err(f(format!(
                "driver package {} lacks {file} (ci/build-windows.sh writes the package to target/vhca-sys/)",
                opts.driver_package.display()
            )));
        }
    }
    if opts.firmware == Firmware::Uefi && !Path::new(OVMF_CODE).is_file() {
        return Err(f(format!("{OVMF_CODE} not found: apt-get install ovmf (or --firmware bios)")));
    }
    if opts.out.join(BASE_DISK).exists() {
        return Err(f(format!("{} already holds an image; pick another --out", opts.out.display())));
    }
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// How a guest's boot ended, from COM1.
#[derive(Debug, Default)]
struct SetupOutcome {
    done: bool,
    failed: Option<String>,
}

/// Boots `machine` until QEMU exits (the guest powers off) or `timeout`; logs every set-up line; types `request` once
/// the agent says it is ready; presses Enter early on (the UEFI CD prompt) when `press_keys`. COM1 and QEMU's output
/// are kept in `logs` (the image directory's `logs/`), so a failed step can be read afterwards.
fn boot_until_poweroff(
    machine: &WindowsMachine,
    logs: &Path,
    step: &str,
    request: Option<&str>,
    press_keys: bool,
    timeout: Duration,
    log: &mut dyn FnMut(&str),
) -> Result<SetupOutcome, StepError> {
    let f = fail(step);
    std::fs::create_dir_all(logs).map_err(|e| f(format!("{}: {e}", logs.display())))?;
    let serial_log = logs.join(format!("{}.serial.log", step.replace(' ', "-")));
    let qemu_log = logs.join(format!("{}.qemu.log", step.replace(' ', "-")));
    let mut qemu = Supervised::spawn("qemu", machine.command(), Some(&qemu_log)).map_err(|e| f(e.to_string()))?;
    let port = ConsolePort::connect(&machine.serial_socket, &serial_log, Duration::from_secs(10));
    let mut port = port.map_err(|e| f(format!("{e}; QEMU's log: {}", qemu_log.display())))?;
    let mut qmp = Qmp::connect(&machine.qmp_socket, Duration::from_secs(10)).ok();
    let mut serial = SerialLog::new(&serial_log);
    let (started, mut last_key, mut last_note) = (Instant::now(), Instant::now(), Instant::now());
    let mut outcome = SetupOutcome::default();
    let mut sent = request.is_none();
    loop {
        for line in serial.poll().unwrap_or_default() {
            if line.contains(SETUP_MARK) || line.contains(READY_LINE) {
                log(&format!("{step}: {line}"));
            }
            if line.contains(SETUP_DONE) {
                outcome.done = true;
            } else if line.contains(SETUP_FAILED) {
                outcome.failed = Some(line.trim().to_string());
            }
            if !sent && line.contains(READY_LINE) {
                port.send_line(request.unwrap_or_default()).map_err(|e| f(format!("typing the request: {e}")))?;
                sent = true;
            }
        }
        if press_keys && started.elapsed() < PRESS_KEYS_FOR && last_key.elapsed() >= Duration::from_secs(1) {
            if let Some(q) = qmp.as_mut() {
                let _ = q.execute(
                    "send-key",
                    Some(json!({ "keys": [{ "type": "qcode", "data": "ret" }] })),
                    Duration::from_secs(2),
                );
            }
            last_key = Instant::now();
        }
        if last_note.elapsed() >= PROGRESS_EVERY {
            log(&format!(
                "{step}: still going after {} min (COM1: {})",
                started.elapsed().as_secs() / 60,
                serial_log.display()
            ));
            last_note = Instant::now();
        }
        if let Some(status) = qemu.try_status().map_err(|e| f(e.to_string()))? {
            if !status.success() {
                return Err(f(format!("QEMU {status}; its log: {}", qemu_log.display())));
            }
            break;
        }
        if started.elapsed() >= timeout {
            qemu.kill();
            return Err(f(format!(
                "the guest did not power off within {} s (serial log {}; watch it with --vnc)",
                timeout.as_secs(),
                serial_log.display()
            )));
        }
        tick().map_err(|e| f(e.to_string()))?;
    }
    drop(qmp);
    port.close(Duration::from_millis(500));
    for line in serial.poll().unwrap_or_default().into_iter().chain(serial.take_partial()) {
        if line.contains(SETUP_DONE) {
            outcome.done = true;
        } else if line.contains(SETUP_FAILED) {
            outcome.failed = Some(line.trim().to_string());
        }
    }
    Ok(outcome)
}

fn machine(
    opts: &BuildOptions,
    disk: &Path,
    work: &Path,
    cdroms: Vec<PathBuf>,
    vars: Option<PathBuf>,
) -> WindowsMachine {
    WindowsMachine {
        qemu: opts.qemu.clone(),
        accel: opts.accel,
        firmware: opts.firmware,
        ovmf_vars: vars,
        disk: disk.to_path_buf(),
        cdroms,
        device: None,
        nic: Some(KdnetNic { mac: KDNET_MAC.into() }),
        serial_socket: work.join("serial.sock"),
        qmp_socket: work.join("qmp.sock"),
        gdb: None,
        paused: false,
        end_at_reboot: true,
        vnc: opts.vnc,
    }
}

/// Builds the boot state for `flags` in `image_dir` (an overlay on the base disk, booted once).
pub fn add_state(
    opts: &BuildOptions,
    image_dir: &Path,
    flags: u32,
    log: &mut dyn FnMut(&str),
) -> Result<(), StepError> {
    let step = format!("boot state {flags:#x}");
    let f = fail(&step);
    let overlay = image_dir.join(state_file(flags));
    let _ = std::fs::remove_file(&overlay);
    run_tool("qemu-img", &qemu_img_overlay(BASE_DISK, &overlay), &step)?;
    let work = tempfile::Builder::new().prefix("vhca-winstate-").tempdir().map_err(|e| f(e.to_string()))?;
    let vars = (opts.firmware == Firmware::Uefi).then(|| work.path().join(OVMF_VARS));
    if let Some(v) = &vars {
        std::fs::copy(image_dir.join(OVMF_VARS), v).map_err(|e| f(format!("firmware variables: {e}")))?;
    }
    let m = machine(opts, &overlay, work.path(), Vec::new(), vars);
    let request = state_request(flags);
    let logs = image_dir.join("logs");
    let outcome = boot_until_poweroff(&m, &logs, &step, Some(&request), false, STATE_TIMEOUT, log)?;
    if let Some(line) = outcome.failed {
        let _ = std::fs::remove_file(&overlay);
        return Err(f(line));
    }
    if !outcome.done {
        let _ = std::fs::remove_file(&overlay);
        return Err(f(format!("the guest powered off without {SETUP_DONE}")));
    }
    log(&format!("{step}: done ({})", overlay.display()));
    Ok(())
}

/// Writes the answer disc's files and the driver package under `staging`, then the ISO with xorriso.
pub fn write_answer_disc(
    opts: &BuildOptions,
    kdnet: &KdnetSettings,
    staging: &Path,
    iso: &Path,
) -> Result<(), StepError> {
    let f = fail("answer disc");
    for (path, text) in answer_disc_files(opts, kdnet) {
        let p = staging.join(&path);
        let made = p.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|_| std::fs::write(&p, text));
        made.map_err(|e| f(format!("{}: {e}", p.display())))?;
    }
    copy_dir(&opts.driver_package, &staging.join(DISC_DIR).join("driver"))
        .map_err(|e| f(format!("copying the driver package: {e}")))?;
    run_tool("xorriso", &xorriso_args(staging, iso), "answer disc")
}

/// The whole recipe.
pub fn build(opts: &BuildOptions, log: &mut dyn FnMut(&str)) -> Result<WindowsImage, StepError> {
    log("check inputs");
    check_inputs(opts)?;
    let key = KdnetKey::generate().map_err(|e| fail("KDNET key")(e.to_string()))?;
    let kdnet =
        KdnetSettings::new(opts.kdnet_host_ip, opts.kdnet_port, key).map_err(|e| fail("KDNET key")(e.to_string()))?;
    std::fs::create_dir_all(&opts.out).map_err(|e| fail("check inputs")(format!("{}: {e}", opts.out.display())))?;
    let work =
        tempfile::Builder::new().prefix("vhca-winimage-").tempdir().map_err(|e| fail("answer disc")(e.to_string()))?;

    log("answer disc: autounattend.xml, set-up script, agent, driver package");
    let answer_iso = opts.out.join("answer.iso");
    write_answer_disc(opts, &kdnet, &work.path().join("answer"), &answer_iso)?;

    log("system disk");
    let base = opts.out.join(BASE_DISK);
    run_tool("qemu-img", &qemu_img_create(&base), "system disk")?;
    let vars = (opts.firmware == Firmware::Uefi).then(|| opts.out.join(OVMF_VARS));
    if let Some(v) = &vars {
        copy_ovmf_vars(v).map_err(|e| fail("system disk")(format!("OVMF variables: {e}")))?;
    }

    log("install: Windows Setup from the ISO with the answer disc (a long step; --vnc N shows the screen)");
    let mut m = machine(opts, &base, work.path(), vec![opts.iso.clone(), answer_iso.clone()], vars);
    // Setup reboots several times; the set-up script's poweroff ends the step.
    m.end_at_reboot = false;
    let press = opts.firmware == Firmware::Uefi;
    let outcome = boot_until_poweroff(&m, &opts.out.join("logs"), "install", None, press, INSTALL_TIMEOUT, log)?;
    if let Some(line) = outcome.failed {
        return Err(fail("install")(line));
    }
    if !outcome.done {
        return Err(fail("install")(format!(
            "the guest powered off without {SETUP_DONE}: Setup or the first logon did not get to the set-up script"
        )));
    }

    let meta = ImageMeta {
        firmware: opts.firmware,
        edition: opts.edition.clone(),
        kdnet_host_ip: kdnet.host_ip,
        kdnet_port: kdnet.port,
        kdnet_key: kdnet.key.to_string(),
        verifier_states: Vec::new(),
        driver_package: opts.driver_package.display().to_string(),
    };
    write_meta(&opts.out, &meta).map_err(|e| fail("image.json")(e.to_string()))?;
    let mut flags = vec![0];
    flags.extend(opts.verifier_flags.iter().copied().filter(|f| *f != 0));
    flags.dedup();
    for f in flags {
        add_state(opts, &opts.out, f, log)?;
        record_state(&opts.out, f).map_err(|e| fail("image.json")(e.to_string()))?;
    }
    let _ = std::fs::remove_file(&answer_iso);
    WindowsImage::open(&opts.out).map_err(|e| fail("image.json")(e.to_string()))
}

pub fn write_meta(dir: &Path, meta: &ImageMeta) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(meta).map_err(std::io::Error::other)?;
    std::fs::write(dir.join(META_FILE), text + "\n")
}

/// Adds a built state to image.json.
pub fn record_state(dir: &Path, flags: u32) -> std::io::Result<()> {
    let text = std::fs::read_to_string(dir.join(META_FILE))?;
    let mut meta: ImageMeta = serde_json::from_str(&text).map_err(std::io::Error::other)?;
    if !meta.verifier_states.contains(&flags) {
        meta.verifier_states.push(flags);
        meta.verifier_states.sort_unstable();
    }
    write_meta(dir, &meta)
}
