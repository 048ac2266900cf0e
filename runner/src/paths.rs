//! Where things are: the device and guest binaries (flag > env > workspace target dir), QEMU, and the cache directory.
//! Resolved once at start-up so every later error can name the exact path it tried.

use std::path::{Path, PathBuf};

use serde::Serialize;

pub const GUEST_TARGET: &str = "x86_64-unknown-linux-gnu";

#[derive(Debug, Clone, Serialize)]
pub struct Binaries {
    pub device: PathBuf,
    pub guest: PathBuf,
    pub qemu: PathBuf,
}

impl Binaries {
    pub fn resolve(device_flag: Option<PathBuf>, guest_flag: Option<PathBuf>) -> Binaries {
        let target = target_dir();
        let device = device_flag
            .or_else(|| env_path("VHCA_DEVICE_BIN"))
            .unwrap_or_else(|| target.join("release").join("vhca-device"));
        let guest = guest_flag
            .or_else(|| env_path("VHCA_GUEST_BIN"))
            .unwrap_or_else(|| target.join(GUEST_TARGET).join("release").join("vhca-guest"));
        let qemu = env_path("VHCA_QEMU").unwrap_or_else(|| PathBuf::from("qemu-system-x86_64"));
        Binaries { device, guest, qemu }
    }
}

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// The cargo target dir: $CARGO_TARGET_DIR, else the one this runner was built into (it sits in <target>/release or
/// <target>/debug), else the workspace's `target`.
pub fn target_dir() -> PathBuf {
    if let Some(dir) = env_path("CARGO_TARGET_DIR") {
        return dir;
    }
    let from_exe = std::env::current_exe().ok().and_then(|exe| {
        let profile_dir = exe.parent()?;
        let profile_dir = if profile_dir.ends_with("deps") { profile_dir.parent()? } else { profile_dir };
        let name = profile_dir.file_name()?.to_str()?;
        matches!(name, "release" | "debug").then(|| profile_dir.parent().map(Path::to_path_buf))?
    });
    from_exe.unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("target"))
}

/// The signed vhca.sys for the guest image: $VHCA_WINDOWS_DRIVER_DIR (ci/build-windows.sh exports it), else
/// <target>/vhca-sys; None when it was never built (then `driver = "sys"` runs report it missing).
pub fn windows_driver() -> Option<PathBuf> {
    let dir = env_path("VHCA_WINDOWS_DRIVER_DIR").unwrap_or_else(|| target_dir().join("vhca-sys"));
    Some(dir.join("vhca.sys")).filter(|p| p.is_file())
}

/// $VHCA_CACHE_DIR, else $XDG_CACHE_HOME/vhca, else ~/.cache/vhca.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = env_path("VHCA_CACHE_DIR") {
        return dir;
    }
    if let Some(dir) = env_path("XDG_CACHE_HOME") {
        return dir.join("vhca");
    }
    env_path("HOME").unwrap_or_else(|| PathBuf::from("/root")).join(".cache").join("vhca")
}

/// $VHCA_SNAPSHOT_DIR, else `<cache>/snapshots`: where saved guests are kept.
pub fn snapshot_dir() -> PathBuf {
    env_path("VHCA_SNAPSHOT_DIR").unwrap_or_else(|| cache_dir().join("snapshots"))
}
