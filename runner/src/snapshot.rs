//! The snapshot cache: the guest booted once to its resident agent and saved with QEMU's mapped-ram migration, keyed by
//! everything that shapes the saved state, built once per key under a lock, checked before each session uses it.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::image::{CacheLock, ImageError};
use crate::qemu_cmd::{Accel, QemuConfig};
use crate::qmp::{Qmp, QmpError};
use crate::serial_capture::{ConsolePort, SerialLog};
use crate::supervise::{tick, SuperviseError, Supervised};

/// Bumped when the way a snapshot is made or restored changes, so old files are never restored by a new runner.
const FORMAT: &str = "vhca-snapshot-1";
pub const STATE_FILE: &str = "state.img";
const META_FILE: &str = "snapshot.json";
/// Snapshots kept (about 85 MB on disk each; the file is sparse); the least recently used go first.
const KEEP: usize = 3;
/// A cold boot takes about 5 s under TCG; a loaded machine takes longer.
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);
const SAVE_TIMEOUT: Duration = Duration::from_secs(120);
const QMP_TIMEOUT: Duration = Duration::from_secs(10);
/// The word that makes the guest program wait as the resident agent (guest-driver/guest/src/agent.rs).
pub const AGENT_WORD: &str = "vhca.agent=1";
/// What the agent prints once it waits for a run request.
pub const READY_LINE: &str = "VHCA-AGENT-READY";
/// Leftover build dirs of a runner that was SIGKILLed are removed after this long.
const STALE_BUILD: Duration = Duration::from_secs(3600);

/// Everything of the machine that is saved with it: restored runs must use exactly this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedMachine {
    pub qemu: PathBuf,
    pub accel: Accel,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// Kernel command-line words after the fixed ones: the baked-in guest options and `AGENT_WORD`.
    pub append: Vec<String>,
}

/// The per-run files of a machine: they differ between the save and every restore, and stay out of the key.
#[derive(Debug, Clone)]
pub struct MachineFiles {
    pub serial_log: PathBuf,
    pub serial_socket: PathBuf,
    pub qmp_socket: PathBuf,
}

impl MachineFiles {
    pub fn in_dir(dir: &Path) -> MachineFiles {
        MachineFiles {
            serial_log: dir.join("serial.log"),
            serial_socket: dir.join("serial.sock"),
            qmp_socket: dir.join("qmp.sock"),
        }
    }
}

impl SavedMachine {
    /// The QEMU configuration: no HCA (a vhost-user device blocks migration; it is hot-plugged into the empty root
    /// port after a restore), the console on a socket, and `-incoming defer` for a restore.
    pub fn config(&self, files: &MachineFiles, incoming: bool) -> QemuConfig {
        QemuConfig {
            qemu: self.qemu.clone(),
            accel: self.accel,
            kernel: self.kernel.clone(),
            initrd: self.initrd.clone(),
            append: self.append.clone(),
            device: None,
            serial_log: files.serial_log.clone(),
            serial_socket: Some(files.serial_socket.clone()),
            qmp_socket: files.qmp_socket.clone(),
            gdb: None,
            incoming_defer: incoming,
        }
    }

    /// The key's inputs, by name: the format, QEMU (version and binary), the full command line with the per-run paths
    /// replaced, and the kernel and initramfs files (their paths name the image key; size and mtime catch an edit).
    pub fn key_inputs(&self, qemu_version: &str) -> Vec<(String, String)> {
        let placeholder = MachineFiles::in_dir(Path::new("/RUN"));
        let args: Vec<String> =
            self.config(&placeholder, false).args().iter().map(|a| a.to_string_lossy().into_owned()).collect();
        vec![
            ("format".into(), FORMAT.into()),
            ("qemu_version".into(), qemu_version.trim().into()),
            ("qemu_binary".into(), file_identity(&resolve_program(&self.qemu))),
            ("command_line".into(), args.join("\u{1f}")),
            ("kernel".into(), file_identity(&self.kernel)),
            ("initrd".into(), file_identity(&self.initrd)),
        ]
    }
}

/// The key: a hash of the inputs, each length-prefixed so bytes cannot move between them unnoticed.
pub fn key_of(inputs: &[(String, String)]) -> String {
    let mut h = Sha256::new();
    for (name, value) in inputs {
        for part in [name, value] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
    }
    h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect()
}

/// Path, size and modification time: changes whenever the file is replaced or edited.
fn file_identity(path: &Path) -> String {
    match fs::metadata(path) {
        Ok(m) => {
            let mtime = m.modified().ok().and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok());
            format!("{} {} {}", path.display(), m.len(), mtime.map_or(0, |d| d.as_nanos()))
        }
        Err(e) => format!("{} ({e})", path.display()),
    }
}

/// A bare program name as the shell would find it on PATH.
fn resolve_program(program: &Path) -> PathBuf {
    if program.components().count() > 1 {
        return program.to_path_buf();
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|d| d.join(program)).find(|p| p.is_file()).unwrap_or_else(|| program.into())
}

fn qemu_version(qemu: &Path) -> io::Result<String> {
    let out = Command::new(qemu).arg("--version").output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!("{} --version: {}", qemu.display(), out.status)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("").to_string())
}

/// What is recorded next to the state file: how to check it, and what it was made from (for people).
#[derive(Debug, Serialize, Deserialize)]
struct Meta {
    key: String,
    size: u64,
    digest: String,
    build_seconds: f64,
    inputs: Vec<(String, String)>,
}

/// A snapshot this session restores from.
#[derive(Debug)]
pub struct Snapshot {
    pub key: String,
    pub state: PathBuf,
    pub machine: SavedMachine,
    /// Built by this session, with how long the boot and save took.
    pub built: Option<f64>,
    /// Found stored, with how long checking it against its record took.
    pub checked: Option<f64>,
    broken: AtomicBool,
}

impl Snapshot {
    /// False once a restore showed the file cannot be loaded: later runs boot cold without trying.
    pub fn usable(&self) -> bool {
        !self.broken.load(Ordering::SeqCst)
    }

    /// Marks the snapshot unusable and removes it so the next session rebuilds it; true for the first caller only.
    pub fn mark_broken(&self) -> bool {
        let first = !self.broken.swap(true, Ordering::SeqCst);
        if first {
            if let Some(dir) = self.state.parent() {
                let _ = fs::remove_dir_all(dir);
            }
        }
        first
    }
}

#[derive(Debug, thiserror::Error)]
enum BuildError {
    #[error(transparent)]
    Process(#[from] SuperviseError),
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error("{0}")]
    Failed(String),
}

/// The snapshot for `machine`, verified, or built now; None (with the reason logged) when this session must boot
/// cold. Err only for an interrupt.
pub fn prepare(
    root: &Path,
    machine: &SavedMachine,
    log: &mut dyn FnMut(&str),
) -> Result<Option<Snapshot>, SuperviseError> {
    let version = match qemu_version(&machine.qemu) {
        Ok(v) => v,
        Err(e) => {
            log(&format!("cold boot: cannot ask QEMU its version for the snapshot key ({e})"));
            return Ok(None);
        }
    };
    let inputs = machine.key_inputs(&version);
    let key = key_of(&inputs);
    if let Err(e) = fs::create_dir_all(root) {
        log(&format!("cold boot: snapshot dir {}: {e}", root.display()));
        return Ok(None);
    }
    // One builder per key; others wait here, then find it built.
    let _lock = match CacheLock::acquire_file(&root.join(format!("{key}.lock"))) {
        Ok(lock) => lock,
        Err(ImageError::Process(e)) => return Err(e),
        Err(e) => {
            log(&format!("cold boot: cannot lock the snapshot {key}: {e}"));
            return Ok(None);
        }
    };
    let dir = root.join(&key);
    let state = dir.join(STATE_FILE);
    let snapshot = |built, checked| Snapshot {
        key: key.clone(),
        state: state.clone(),
        machine: machine.clone(),
        built,
        checked,
        broken: AtomicBool::new(false),
    };
    if dir.exists() {
        let started = Instant::now();
        return Ok(match verify(&dir) {
            Ok(()) => {
                touch(&dir);
                Some(snapshot(None, Some(started.elapsed().as_secs_f64())))
            }
            Err(why) => {
                let _ = fs::remove_dir_all(&dir);
                log(&format!(
                    "snapshot {key} is corrupt ({why}): removed; this session boots cold, the next one rebuilds it"
                ));
                None
            }
        });
    }
    let others = other_snapshots(root, &key);
    let stale = if others.is_empty() {
        String::new()
    } else {
        format!("; stale for this QEMU, kernel, image and command line, not used: {}", others.join(", "))
    };
    log(&format!("no snapshot {key} yet: booting the guest to its agent to save it{stale}"));
    let started = Instant::now();
    let work = match tempfile::Builder::new().prefix(".build-").tempdir_in(root) {
        Ok(w) => w,
        Err(e) => {
            log(&format!("cold boot: snapshot build dir in {}: {e}", root.display()));
            return Ok(None);
        }
    };
    match build(machine, work.path()) {
        Ok(()) => {}
        Err(BuildError::Process(SuperviseError::Interrupted)) => return Err(SuperviseError::Interrupted),
        Err(e) => {
            log(&format!("cold boot: the snapshot build failed: {e}{}", logs_tail(work.path())));
            return Ok(None);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let saved = work.path().join(STATE_FILE);
    let finished = (|| -> io::Result<u64> {
        let size = fs::metadata(&saved)?.len();
        let meta = Meta { key: key.clone(), size, digest: state_digest(&saved)?, build_seconds: seconds, inputs };
        fs::write(work.path().join(META_FILE), serde_json::to_string_pretty(&meta).map_err(io::Error::other)?)?;
        // Kept for people: how the guest came up before it was saved.
        for name in ["serial.sock", "qmp.sock"] {
            let _ = fs::remove_file(work.path().join(name));
        }
        let _ = fs::remove_dir_all(&dir);
        fs::rename(work.path(), &dir)?;
        Ok(on_disk(&dir.join(STATE_FILE)))
    })();
    match finished {
        Ok(bytes) => {
            // The rename moved the temp dir away: nothing is left for its guard to remove.
            let _ = work.keep();
            log(&format!("snapshot {key} saved in {seconds:.1} s ({} MB on disk)", bytes >> 20));
            prune(root, &key);
            Ok(Some(snapshot(Some(seconds), None)))
        }
        Err(e) => {
            log(&format!("cold boot: storing the snapshot in {}: {e}", dir.display()));
            Ok(None)
        }
    }
}

/// Boots the machine, waits for the agent, stops the guest and saves it to `work/state.img`.
fn build(machine: &SavedMachine, work: &Path) -> Result<(), BuildError> {
    let files = MachineFiles::in_dir(work);
    let config = machine.config(&files, false);
    fs::write(work.join("qemu.cmdline"), crate::qemu_cmd::shell_line(&config.qemu, &config.args()) + "\n")?;
    let mut qemu = Supervised::spawn("qemu (snapshot build)", config.command(), Some(&work.join("qemu.log")))?;
    let _port = ConsolePort::connect(&files.serial_socket, &files.serial_log, QMP_TIMEOUT)?;
    let mut qmp = Qmp::connect(&files.qmp_socket, QMP_TIMEOUT)?;
    let mut serial = SerialLog::new(&files.serial_log);
    let booted = Instant::now();
    loop {
        if serial.poll()?.iter().any(|l| l.contains(READY_LINE)) {
            break;
        }
        if let Some(status) = qemu.try_status()? {
            return Err(BuildError::Failed(format!("QEMU ended ({status}) before the guest agent was ready")));
        }
        if booted.elapsed() >= BOOT_TIMEOUT {
            return Err(BuildError::Failed(format!("no {READY_LINE} within {} s", BOOT_TIMEOUT.as_secs())));
        }
        tick()?;
    }
    qmp.execute("stop", None, QMP_TIMEOUT)?;
    qmp.execute("migrate-set-capabilities", Some(capabilities()), QMP_TIMEOUT)?;
    let uri = format!("file:{}", work.join(STATE_FILE).display());
    qmp.execute("migrate", Some(json!({ "uri": uri })), QMP_TIMEOUT)?;
    wait_migration(&mut qmp, &mut qemu, SAVE_TIMEOUT)?;
    qmp.execute("quit", None, QMP_TIMEOUT)?;
    if qemu.wait_timeout(QMP_TIMEOUT)?.is_none() {
        qemu.kill();
    }
    Ok(())
}

/// The migration capabilities of both the save and every restore: mapped-ram puts each RAM page at a fixed offset of
/// the file (zero pages stay holes), so a restore reads only what the guest used.
pub fn capabilities() -> serde_json::Value {
    json!({ "capabilities": [
        { "capability": "events", "state": true },
        { "capability": "mapped-ram", "state": true },
    ] })
}

/// Polls `query-migrate` until the migration completes. Errors name QEMU's reason.
fn wait_migration(qmp: &mut Qmp, qemu: &mut Supervised, timeout: Duration) -> Result<(), BuildError> {
    let end = Instant::now() + timeout;
    loop {
        let status = qmp.execute("query-migrate", None, QMP_TIMEOUT)?;
        match status.get("status").and_then(|s| s.as_str()) {
            Some("completed") => return Ok(()),
            Some("failed") | Some("cancelled") => {
                let why = status.get("error-desc").and_then(|s| s.as_str()).unwrap_or("no reason given");
                return Err(BuildError::Failed(format!("migration failed: {why}")));
            }
            _ => {}
        }
        if let Some(status) = qemu.try_status()? {
            return Err(BuildError::Failed(format!("QEMU ended ({status}) during the save")));
        }
        if Instant::now() >= end {
            return Err(BuildError::Failed(format!("the save took more than {} s", timeout.as_secs())));
        }
        tick()?;
    }
}

/// Checks a stored snapshot against its record: size and content digest.
fn verify(dir: &Path) -> Result<(), String> {
    let meta: Meta = fs::read_to_string(dir.join(META_FILE))
        .map_err(|e| format!("{META_FILE}: {e}"))
        .and_then(|t| serde_json::from_str(&t).map_err(|e| format!("{META_FILE}: {e}")))?;
    let state = dir.join(STATE_FILE);
    let size = fs::metadata(&state).map_err(|e| format!("{STATE_FILE}: {e}"))?.len();
    if size != meta.size {
        return Err(format!("{STATE_FILE} is {size} bytes, {} were saved", meta.size));
    }
    let digest = state_digest(&state).map_err(|e| format!("{STATE_FILE}: {e}"))?;
    if digest != meta.digest {
        return Err(format!("{STATE_FILE} content digest {digest} differs from the saved {}", meta.digest));
    }
    Ok(())
}

const PAGE: u64 = 4096;

/// A SHA-256 of the file's non-zero 4 KiB pages and their offsets. Holes and zero pages hash alike and are skipped,
/// so only the data the guest used is read (about 85 of 540 MB); any changed byte, or data written into a hole,
/// changes the digest.
pub fn state_digest(path: &Path) -> io::Result<String> {
    let file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut h = Sha256::new();
    h.update(len.to_le_bytes());
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    while pos < len {
        let Some((start, end)) = data_extent(&file, pos, len)? else { break };
        // Whole pages at page-aligned offsets, whatever the file system's extent boundaries.
        let mut at = start - start % PAGE;
        let end = end.div_ceil(PAGE).saturating_mul(PAGE).min(len);
        while at < end {
            let want = usize::try_from((end - at).min(buf.len() as u64)).unwrap_or(buf.len());
            let got = file.read_at(&mut buf[..want], at)?;
            if got == 0 {
                break;
            }
            for (i, page) in buf[..got].chunks(PAGE as usize).enumerate() {
                if page.iter().any(|&b| b != 0) {
                    h.update((at + i as u64 * PAGE).to_le_bytes());
                    h.update(page);
                }
            }
            at += got as u64;
        }
        pos = end.max(pos + 1);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The next run of data at or after `pos`, from SEEK_DATA/SEEK_HOLE; the rest of the file where those are not
/// supported. None when only a hole is left.
fn data_extent(file: &File, pos: u64, len: u64) -> io::Result<Option<(u64, u64)>> {
    let seek = |offset: u64, whence: libc::c_int| -> io::Result<Option<u64>> {
        let offset = libc::off_t::try_from(offset).map_err(io::Error::other)?;
        // SAFETY: lseek on a descriptor `file` owns; it moves only the file offset, which no other code here uses
        // (reads go through read_at/pread).
        let r = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(e),
        }
    };
    match seek(pos, libc::SEEK_DATA) {
        Ok(None) => Ok(None),
        Ok(Some(start)) => Ok(Some((start, seek(start, libc::SEEK_HOLE)?.unwrap_or(len).min(len)))),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(Some((pos, len))),
        Err(e) => Err(e),
    }
}

fn on_disk(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

fn touch(dir: &Path) {
    // The record's mtime orders snapshots for pruning: a used snapshot is a recent one.
    let _ = File::open(dir.join(META_FILE)).and_then(|f| f.set_modified(SystemTime::now()));
}

fn other_snapshots(root: &Path, key: &str) -> Vec<String> {
    let Ok(entries) = fs::read_dir(root) else { return Vec::new() };
    let mut keys: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().join(META_FILE).is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name != key && !name.starts_with('.'))
        .collect();
    keys.sort();
    keys
}

/// Keeps the `KEEP` most recently used snapshots and removes build dirs a killed runner left behind. A session still
/// restoring from a pruned snapshot sees its restores fail and boots cold.
fn prune(root: &Path, keep_key: &str) {
    let Ok(entries) = fs::read_dir(root) else { return };
    let mut snapshots = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with(".build-") {
            let old = fs::metadata(&path).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
            if old.is_some_and(|age| age > STALE_BUILD) {
                let _ = fs::remove_dir_all(&path);
            }
        } else if name != keep_key && path.is_dir() {
            let mtime = fs::metadata(path.join(META_FILE)).and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
            snapshots.push((mtime, path));
        }
    }
    snapshots.sort();
    let excess = (snapshots.len() + 1).saturating_sub(KEEP);
    for (_, path) in snapshots.into_iter().take(excess) {
        let _ = fs::remove_dir_all(path);
    }
}

/// The last lines of the build's console and QEMU log, for a failed build's message.
fn logs_tail(work: &Path) -> String {
    let mut out = String::new();
    for (name, file) in [("console", "serial.log"), ("QEMU", "qemu.log")] {
        let text = fs::read_to_string(work.join(file)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if !lines.is_empty() {
            out.push_str(&format!("\n  {name}:\n    {}", lines[lines.len().saturating_sub(8)..].join("\n    ")));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(dir: &Path) -> SavedMachine {
        fs::write(dir.join("vmlinux"), b"kernel").unwrap();
        fs::write(dir.join("initramfs.cpio"), b"initrd").unwrap();
        SavedMachine {
            qemu: "qemu-system-x86_64".into(),
            accel: Accel::Tcg,
            kernel: dir.join("vmlinux"),
            initrd: dir.join("initramfs.cpio"),
            append: vec!["vhca.reset_method=pm".into(), AGENT_WORD.into()],
        }
    }

    #[test]
    fn key_changes_with_qemu_kernel_image_and_command_line_but_not_run_paths() {
        let dir = tempfile::tempdir().unwrap();
        let m = machine(dir.path());
        let base = key_of(&m.key_inputs("QEMU emulator version 10.0.2"));
        assert_eq!(base, key_of(&m.key_inputs("QEMU emulator version 10.0.2")));
        assert_ne!(base, key_of(&m.key_inputs("QEMU emulator version 10.0.3")), "QEMU version");
        let mut other = m.clone();
        other.append.push("vhca.timeout_ms=9000".into());
        assert_ne!(base, key_of(&other.key_inputs("QEMU emulator version 10.0.2")), "baked-in guest option");
        let mut other = m.clone();
        other.accel = Accel::Kvm;
        assert_ne!(base, key_of(&other.key_inputs("QEMU emulator version 10.0.2")), "command line");
        fs::write(dir.path().join("vmlinux"), b"kernel, rebuilt").unwrap();
        let kernel = key_of(&m.key_inputs("QEMU emulator version 10.0.2"));
        assert_ne!(base, kernel, "kernel file");
        fs::write(dir.path().join("initramfs.cpio"), b"initrd, rebuilt").unwrap();
        assert_ne!(kernel, key_of(&m.key_inputs("QEMU emulator version 10.0.2")), "initramfs file");
        // The per-run files are not inputs: every restore has its own.
        let a = m.config(&MachineFiles::in_dir(Path::new("/a")), true).args();
        let b = m.config(&MachineFiles::in_dir(Path::new("/b")), true).args();
        assert_eq!(a.len(), b.len());
    }

    #[test]
    fn digest_sees_a_changed_byte_and_data_in_a_hole_but_not_hole_layout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.img");
        let file = File::create(&path).unwrap();
        file.set_len(64 * PAGE).unwrap();
        file.write_at(b"QEVM header", 0).unwrap();
        file.write_at(&[7u8; 100], 40 * PAGE + 10).unwrap();
        let base = state_digest(&path).unwrap();
        assert_eq!(base, state_digest(&path).unwrap());
        // Zeros written over a hole are the same content.
        file.write_at(&[0u8; 4096], 20 * PAGE).unwrap();
        assert_eq!(base, state_digest(&path).unwrap(), "explicit zeros hash like a hole");
        file.write_at(&[8u8], 40 * PAGE + 50).unwrap();
        let changed = state_digest(&path).unwrap();
        assert_ne!(base, changed, "a changed byte in data");
        file.write_at(&[1u8], 60 * PAGE).unwrap();
        assert_ne!(changed, state_digest(&path).unwrap(), "data written into a hole");
    }

    #[test]
    fn verify_rejects_a_truncated_or_altered_file_and_a_missing_record() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join(STATE_FILE);
        fs::write(&state, vec![5u8; 3 * PAGE as usize]).unwrap();
        assert!(verify(dir.path()).unwrap_err().contains(META_FILE));
        let meta = Meta {
            key: "k".into(),
            size: 3 * PAGE,
            digest: state_digest(&state).unwrap(),
            build_seconds: 1.0,
            inputs: vec![],
        };
        fs::write(dir.path().join(META_FILE), serde_json::to_string(&meta).unwrap()).unwrap();
        assert_eq!(verify(dir.path()), Ok(()));
        File::options().write(true).open(&state).unwrap().write_at(&[6u8], PAGE).unwrap();
        assert!(verify(dir.path()).unwrap_err().contains("digest"));
        File::options().write(true).open(&state).unwrap().set_len(PAGE).unwrap();
        assert!(verify(dir.path()).unwrap_err().contains("bytes"));
    }

    #[test]
    fn prune_keeps_the_newest_and_the_current_one() {
        let root = tempfile::tempdir().unwrap();
        for (i, key) in ["a", "b", "c", "d"].iter().enumerate() {
            let dir = root.path().join(key);
            fs::create_dir(&dir).unwrap();
            let f = File::create(dir.join(META_FILE)).unwrap();
            f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(1000 + i as u64)).unwrap();
        }
        fs::write(root.path().join("a.lock"), b"").unwrap();
        prune(root.path(), "a");
        let mut left: Vec<String> =
            fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        assert_eq!(left, ["a", "a.lock", "c", "d"]);
        assert_eq!(other_snapshots(root.path(), "a"), ["c", "d"]);
    }
}
