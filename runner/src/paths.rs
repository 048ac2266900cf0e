//! Where things are: the device and guest binaries and the driver package (flag > env > next to the runner > PATH >
//! the workspace target dir it was built in), QEMU, the artifact root (under the current directory) and the cache.
//! Resolved once at start-up so every later error can name the exact path it tried.

use std::ffi::CStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

pub const GUEST_TARGET: &str = "x86_64-unknown-linux-gnu";
/// The driver package's directory name, as ci/build-windows.sh writes it under the target dir.
pub const DRIVER_PACKAGE: &str = "vhca-sys";

#[derive(Debug, Clone, Serialize)]
pub struct Binaries {
    pub device: PathBuf,
    pub guest: PathBuf,
    pub qemu: PathBuf,
}

/// A program the runner starts or puts into the image, and where a build leaves it under a target dir.
#[derive(Debug, Clone, Copy)]
pub struct Program {
    pub name: &'static str,
    pub flag: &'static str,
    pub env: &'static str,
    /// Its directory under a cargo target dir: `release`, or `<triple>/release` for a cross build.
    built_in: &'static [&'static str],
    /// Only a statically linked build will do (the guest program: the initramfs has no dynamic loader, and a
    /// workspace `cargo build`/`cargo test` leaves a dynamically linked vhca-guest in `<target>/release`).
    static_only: bool,
}

pub const DEVICE: Program = Program {
    name: "vhca-device",
    flag: "--device-bin",
    env: "VHCA_DEVICE_BIN",
    built_in: &["release"],
    static_only: false,
};
/// Static, for the initramfs: built with --target, so it sits under `<target>/<triple>/release`, never next to a
/// runner in `<target>/release`.
pub const GUEST: Program = Program {
    name: "vhca-guest",
    flag: "--guest-bin",
    env: "VHCA_GUEST_BIN",
    built_in: &[GUEST_TARGET, "release"],
    static_only: true,
};

impl Binaries {
    pub fn resolve(device_flag: Option<PathBuf>, guest_flag: Option<PathBuf>) -> Binaries {
        let device = device_flag.unwrap_or_else(|| locate(&DEVICE));
        let guest = guest_flag.unwrap_or_else(|| locate(&GUEST));
        let qemu = env_path("VHCA_QEMU").unwrap_or_else(|| PathBuf::from("qemu-system-x86_64"));
        Binaries { device, guest, qemu }
    }
}

/// `program` from its variable, next to the runner, on PATH, or in the target dir the runner was built in; when it
/// is nowhere, the first place looked (so the error names a real candidate, and `search_order` says the rest).
pub fn locate(program: &Program) -> PathBuf {
    if let Some(path) = env_path(program.env) {
        return path;
    }
    let candidates = candidates(program);
    let usable = |p: &&PathBuf| is_executable(p) && (!program.static_only || is_static_elf(p));
    candidates.iter().find(usable).or(candidates.first()).cloned().unwrap_or_else(|| program.name.into())
}

/// Whether `path` is an ELF program with no interpreter (PT_INTERP), i.e. one that runs without a dynamic loader.
pub fn is_static_elf(path: &Path) -> bool {
    use object::read::elf::{FileHeader, ProgramHeader};
    let Ok(data) = std::fs::read(path) else { return false };
    let Ok(header) = object::elf::FileHeader64::<object::Endianness>::parse(&*data) else { return false };
    let Ok(endian) = header.endian() else { return false };
    let Ok(segments) = header.program_headers(endian, &*data) else { return false };
    !segments.iter().any(|segment| segment.p_type(endian) == object::elf::PT_INTERP)
}

/// Every place `locate` looks after the variable, in order.
fn candidates(program: &Program) -> Vec<PathBuf> {
    let built_under = |target: &Path| program.built_in.iter().fold(target.to_path_buf(), |p, d| p.join(d));
    let mut out = Vec::new();
    if let Some(dir) = runner_dir() {
        out.push(dir.join(program.name));
    }
    // A runner run from its own target dir takes the programs of that same build before anything on PATH.
    if let Some(target) = target_of_runner() {
        out.push(built_under(&target).join(program.name));
    }
    out.extend(on_path(program.name));
    if let Some(target) = built_target_dir() {
        out.push(built_under(&target).join(program.name));
    }
    out.dedup();
    out
}

/// For a "not found" error: where `program` was looked for.
pub fn search_order(program: &Program) -> String {
    let looked: Vec<String> = candidates(program).iter().map(|p| p.display().to_string()).collect();
    format!("looked for {} via {}, ${}, then {}", program.name, program.flag, program.env, looked.join(", "))
}

/// The directory of the running vhca-run (an installed runner finds the programs installed beside it).
fn runner_dir() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(Path::to_path_buf)
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).filter(|d| d.is_absolute()).map(|d| d.join(name)).find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    path.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// The target dir a runner run from `<target>/release` (or `debug`, or a test's `deps`) sits in.
fn target_of_runner() -> Option<PathBuf> {
    let profile_dir = runner_dir()?;
    let profile_dir = if profile_dir.ends_with("deps") { profile_dir.parent()?.to_path_buf() } else { profile_dir };
    let name = profile_dir.file_name()?.to_str()?;
    matches!(name, "release" | "debug").then(|| profile_dir.parent().map(Path::to_path_buf))?
}

/// The workspace target dir this runner was built in ($CARGO_TARGET_DIR, else the workspace's `target`), only if it
/// exists: the last place to look, since an installed runner may outlive, or not be allowed into, its build tree.
fn built_target_dir() -> Option<PathBuf> {
    let dir = env_path("CARGO_TARGET_DIR").unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    dir.is_dir().then_some(dir)
}

/// The driver package's directory (vhca.sys and its INF and catalog): $VHCA_WINDOWS_DRIVER_DIR (ci/build-windows.sh
/// exports it), else `vhca-sys/` next to the runner, else `<target>/vhca-sys` of the runner's own build or of the
/// workspace it was built in. None when there is none. (Not on PATH: it is a directory of files, not a program.)
pub fn driver_package() -> Option<PathBuf> {
    if let Some(dir) = env_path("VHCA_WINDOWS_DRIVER_DIR") {
        return Some(dir);
    }
    let next_to_runner = runner_dir().map(|d| d.join(DRIVER_PACKAGE));
    let in_target = [target_of_runner(), built_target_dir()].into_iter().flatten().map(|t| t.join(DRIVER_PACKAGE));
    next_to_runner.into_iter().chain(in_target).find(|d| d.join("vhca.sys").is_file())
}

/// The signed vhca.sys for the guest image, from `driver_package`; None when it was never built (then
/// `driver = "sys"` runs report it missing).
pub fn windows_driver() -> Option<PathBuf> {
    Some(driver_package()?.join("vhca.sys")).filter(|p| p.is_file())
}

/// Where a command's artifacts go when `--artifacts` does not say: `./vhca-artifacts/<name>` under the current
/// directory, which the user running it can write (the build tree may not be theirs, or may be gone).
pub fn default_artifacts(name: &str) -> PathBuf {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    cwd.join("vhca-artifacts").join(name)
}

/// $VHCA_CACHE_DIR, else $XDG_CACHE_HOME/vhca, else `~/.cache/vhca` of $HOME, else of the user's home in the
/// password database (a service or `setpriv` start may have no HOME), else a per-user dir in the temp dir.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = env_path("VHCA_CACHE_DIR") {
        return dir;
    }
    if let Some(dir) = env_path("XDG_CACHE_HOME") {
        return dir.join("vhca");
    }
    match env_path("HOME").or_else(home_of_user) {
        Some(home) => home.join(".cache").join("vhca"),
        // SAFETY: getuid has no preconditions and cannot fail.
        None => std::env::temp_dir().join(format!("vhca-cache-{}", unsafe { libc::getuid() })),
    }
}

/// The home directory the password database gives this process's real user.
fn home_of_user() -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let mut entry = std::mem::MaybeUninit::<libc::passwd>::uninit();
    let mut buf = vec![0 as libc::c_char; 4096];
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: getpwuid_r writes only into `entry` and `buf` (whose length it is told) and sets `found` to `entry`
    // (then filled in) or null; getuid has no preconditions.
    let rc = unsafe { libc::getpwuid_r(libc::getuid(), entry.as_mut_ptr(), buf.as_mut_ptr(), buf.len(), &mut found) };
    if rc != 0 || found.is_null() {
        return None;
    }
    // SAFETY: `found` is non-null, so it points at `entry`, which getpwuid_r filled in; its strings live in `buf`.
    let dir = unsafe { (*found).pw_dir };
    if dir.is_null() {
        return None;
    }
    // SAFETY: pw_dir is a NUL-terminated string inside `buf`, which is alive here.
    let dir = PathBuf::from(std::ffi::OsStr::from_bytes(unsafe { CStr::from_ptr(dir) }.to_bytes()));
    (dir.is_absolute() && dir != Path::new("/")).then_some(dir)
}

/// $VHCA_SNAPSHOT_DIR, else `<cache>/snapshots`: where saved guests are kept.
pub fn snapshot_dir() -> PathBuf {
    env_path("VHCA_SNAPSHOT_DIR").unwrap_or_else(|| cache_dir().join("snapshots"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 executable header with one program header of type `p_type`.
    fn elf_with_segment(p_type: u32) -> Vec<u8> {
        let mut elf = vec![0u8; 64 + 56];
        elf[..8].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0]);
        elf[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        elf[18..20].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
        elf[20..24].copy_from_slice(&1u32.to_le_bytes());
        elf[32..40].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        elf[52..54].copy_from_slice(&64u16.to_le_bytes()); // e_ehsize
        elf[54..56].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        elf[56..58].copy_from_slice(&1u16.to_le_bytes()); // e_phnum
        elf[64..68].copy_from_slice(&p_type.to_le_bytes());
        elf
    }

    #[test]
    fn only_an_elf_without_an_interpreter_counts_as_static() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, bytes: &[u8]| {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            path
        };
        assert!(is_static_elf(&write("static", &elf_with_segment(object::elf::PT_LOAD))));
        assert!(!is_static_elf(&write("dynamic", &elf_with_segment(object::elf::PT_INTERP))));
        assert!(!is_static_elf(&write("script", b"#!/bin/sh\nexit 0\n")));
        assert!(!is_static_elf(&dir.path().join("missing")));
        // This test program is linked against the system's libc: it names its interpreter.
        assert!(!is_static_elf(&std::env::current_exe().unwrap()));
    }
}
