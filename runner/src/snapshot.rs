//! Snapshots: the guest booted once to its resident agent and saved with QEMU's mapped-ram migration, keyed by
//! everything that shapes the saved state, built once per key under a lock, checked before each session uses it.
//! This module says what a snapshot is and how it is keyed; `cache` stores and checks them, `save` makes one,
//! `state_digest` is the content check.

mod cache;
mod save;
mod state_digest;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

use crate::cache_in_use::InUse;
use crate::qemu_cmd::{Accel, QemuConfig};

pub use cache::prepare;
pub use save::capabilities;
pub use state_digest::state_digest;

/// Bumped when the way a snapshot is made or restored changes, so old files are never restored by a new runner.
const FORMAT: &str = "vhca-snapshot-1";
pub const STATE_FILE: &str = "state.img";
/// The word that makes the guest program wait as the resident agent (guest-driver/guest/src/agent.rs).
pub const AGENT_WORD: &str = "vhca.agent=1";
/// What the agent prints once it waits for a run request.
pub const READY_LINE: &str = "VHCA-AGENT-READY";

/// Everything of the machine that is saved with it: restored runs must use exactly this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedMachine {
    pub qemu: PathBuf,
    pub accel: Accel,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// Kernel command-line words after the fixed ones: the baked-in guest options and `AGENT_WORD`.
    pub append: Vec<String>,
    /// `-smp`: in the key through the command line, and a run asking for other vCPUs boots cold (a saved
    /// machine restores only with the CPUs it was saved with).
    pub vcpus: u32,
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
            rng: false,
            vcpus: self.vcpus,
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
    hex::encode(&h.finalize()[..12])
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
    /// Keeps another runner sharing the cache from pruning this snapshot while this session restores from it.
    _in_use: Option<InUse>,
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
            vcpus: 1,
        }
    }

    #[test]
    fn a_machine_saved_with_other_vcpus_has_another_key() {
        let dir = tempfile::tempdir().unwrap();
        let one = machine(dir.path());
        let two = SavedMachine { vcpus: 2, ..one.clone() };
        assert_ne!(key_of(&one.key_inputs("QEMU 10")), key_of(&two.key_inputs("QEMU 10")));
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
}
