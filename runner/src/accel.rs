//! Accelerator choice: KVM only when a real probe boot of the guest kernel reaches userspace under it within seconds
//! (this machine's kvm_pvm fails Linux guests only minutes in), else TCG. Probed once per host boot, cached by boot id.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::image::Image;
use crate::qemu_cmd::{Accel, QemuConfig};
use crate::serial_capture::SerialLog;
use crate::supervise::{tick, SuperviseError, Supervised};

/// A working KVM reaches the probe's userspace in about a second; allow for a loaded host.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
const KVM: &str = "/dev/kvm";
pub const PROBE_MARKER: &str = "VHCA-PROBE-OK";

#[derive(Debug, Clone, Serialize)]
pub struct AccelChoice {
    pub accel: Accel,
    /// How it was decided, for the report.
    pub how: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct ProbeRecord {
    boot_id: String,
    accel: Accel,
    detail: String,
}

#[derive(Debug, thiserror::Error)]
pub enum AccelError {
    #[error("VHCA_ACCEL={0}: expected tcg or kvm")]
    BadEnv(String),
    #[error(transparent)]
    Process(#[from] SuperviseError),
    #[error("accelerator probe work dir: {0}")]
    Io(#[from] std::io::Error),
    #[error("the KVM probe boots the Linux guest image, which is not at hand: {0}")]
    NoImage(String),
}

/// The one accelerator decision for every command that starts a guest: VHCA_ACCEL, else TCG when /dev/kvm does not
/// open for this user (saying why), else this boot's cached probe, else a probe boot of `image()`'s kernel (asked
/// for only then, so a command with no image of its own builds one only when there is something to probe).
pub fn choose(
    cache: &Path,
    qemu: &Path,
    image: &mut dyn FnMut() -> Result<Image, String>,
) -> Result<AccelChoice, AccelError> {
    if let Some(forced) = std::env::var("VHCA_ACCEL").ok().filter(|v| !v.is_empty()) {
        let accel = Accel::parse(&forced).ok_or(AccelError::BadEnv(forced))?;
        return Ok(AccelChoice { accel, how: "forced by VHCA_ACCEL".into() });
    }
    if let Err(e) = fs::OpenOptions::new().read(true).write(true).open(KVM) {
        return Ok(AccelChoice { accel: Accel::Tcg, how: crate::kvm_access::why_unusable(Path::new(KVM), &e) });
    }
    let boot_id = fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default().trim().to_string();
    let record_path = cache.join("accel-probe.json");
    if let Some(rec) = read_record(&record_path).filter(|r| !boot_id.is_empty() && r.boot_id == boot_id) {
        return Ok(AccelChoice { accel: rec.accel, how: format!("cached probe for this boot: {}", rec.detail) });
    }
    let image = image().map_err(AccelError::NoImage)?;
    let (accel, detail) = probe_kvm(qemu, &image)?;
    let rec = ProbeRecord { boot_id, accel, detail: detail.clone() };
    if let Ok(text) = serde_json::to_string(&rec) {
        // A lost cache write only costs another probe next time.
        let _ = fs::write(&record_path, text);
    }
    Ok(AccelChoice { accel, how: format!("probe: {detail}") })
}

fn read_record(path: &Path) -> Option<ProbeRecord> {
    serde_json::from_str(&fs::read_to_string(path).ok()?).ok()
}

/// Boots the guest kernel under KVM with `vhca.init=probe` and waits for its marker line.
fn probe_kvm(qemu: &Path, image: &Image) -> Result<(Accel, String), AccelError> {
    let work = crate::leftovers::work_dir("vhca-accel-probe-")?;
    let _claim = crate::leftovers::claim(work.path())?;
    let serial: PathBuf = work.path().join("serial.log");
    let config = QemuConfig {
        qemu: qemu.to_path_buf(),
        accel: Accel::Kvm,
        kernel: image.kernel.clone(),
        initrd: image.initrd.clone(),
        append: vec!["vhca.init=probe".into()],
        device: None,
        serial_log: serial.clone(),
        serial_socket: None,
        qmp_socket: work.path().join("qmp.sock"),
        gdb: None,
        incoming_defer: false,
        rng: false,
        vcpus: crate::qemu_cmd::DEFAULT_VCPUS,
    };
    let start = Instant::now();
    let mut child = Supervised::spawn("qemu (kvm probe)", config.command(), Some(&work.path().join("qemu.log")))?;
    let mut log = SerialLog::new(&serial);
    loop {
        if log.poll()?.iter().any(|l| l.contains(PROBE_MARKER)) {
            return Ok((Accel::Kvm, format!("KVM guest reached userspace in {:.1} s", start.elapsed().as_secs_f64())));
        }
        if let Some(status) = child.try_status()? {
            if log.poll()?.iter().any(|l| l.contains(PROBE_MARKER)) {
                return Ok((Accel::Kvm, "KVM guest reached userspace".into()));
            }
            let why = fs::read_to_string(work.path().join("qemu.log")).unwrap_or_default();
            let why = why.lines().last().unwrap_or("").to_string();
            return Ok((Accel::Tcg, format!("KVM probe QEMU ended ({status}) before userspace: {why}")));
        }
        if start.elapsed() >= PROBE_TIMEOUT {
            return Ok((Accel::Tcg, format!("KVM guest silent for {} s", PROBE_TIMEOUT.as_secs())));
        }
        tick()?;
    }
}
