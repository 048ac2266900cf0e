//! A built Windows image as the runner finds it: one directory holding the installed base disk, one boot state per
//! verifier setting (qcow2 overlays on the base, Driver Verifier already configured, so a run never reboots to switch),
//! the firmware variables and `image.json` saying how it was built (firmware, KDNET port and key, states).

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::guest_setup::state_file;
use super::kdnet::{KdnetKey, KdnetSettings};
use super::machine::Firmware;

pub const META_FILE: &str = "image.json";
pub const BASE_DISK: &str = "base.qcow2";
pub const OVMF_VARS: &str = "OVMF_VARS.fd";

/// `image.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageMeta {
    pub firmware: Firmware,
    pub edition: String,
    pub kdnet_host_ip: Ipv4Addr,
    pub kdnet_port: u16,
    pub kdnet_key: String,
    /// Verifier flags of every boot state built, 0 for "off".
    pub verifier_states: Vec<u32>,
    /// The driver package the image installed, as given to the recipe.
    pub driver_package: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(
        "no Windows image at {dir}: {why}. Build one from your own Windows ISO with `vhca-run windows-image build \
         --iso WIN.iso --driver-package target/vhca-sys --out {dir}` (docs/windows.md)"
    )]
    Missing { dir: String, why: String },
    #[error("Windows image {dir}: {META_FILE} unreadable: {why}")]
    BadMeta { dir: String, why: String },
    #[error(
        "Windows image {dir} has no boot state for Driver Verifier flags {flags:#x} (it has: {have}); add it with \
         `vhca-run windows-image add-state --image {dir} --verifier-flags {flags:#x}`"
    )]
    NoState { dir: String, flags: u32, have: String },
}

/// An image directory whose metadata and base disk are there.
#[derive(Debug, Clone)]
pub struct WindowsImage {
    pub dir: PathBuf,
    pub meta: ImageMeta,
}

impl WindowsImage {
    pub fn open(dir: &Path) -> Result<WindowsImage, ImageError> {
        let d = dir.display().to_string();
        let missing = |why: String| ImageError::Missing { dir: d.clone(), why };
        if !dir.is_dir() {
            return Err(missing("the directory does not exist".into()));
        }
        let meta_path = dir.join(META_FILE);
        let text = std::fs::read_to_string(&meta_path).map_err(|e| missing(format!("{META_FILE}: {e}")))?;
        let meta: ImageMeta =
            serde_json::from_str(&text).map_err(|e| ImageError::BadMeta { dir: d.clone(), why: e.to_string() })?;
        if let Err(e) = KdnetKey::parse(&meta.kdnet_key) {
            return Err(ImageError::BadMeta { dir: d.clone(), why: e.to_string() });
        }
        if !dir.join(BASE_DISK).is_file() {
            return Err(missing(format!("{BASE_DISK} is missing (the install did not finish?)")));
        }
        Ok(WindowsImage { dir: dir.to_path_buf(), meta })
    }

    pub fn kdnet(&self) -> KdnetSettings {
        // `open` checked the key; the port was checked when the image was built.
        let key = KdnetKey::parse(&self.meta.kdnet_key).unwrap_or_else(|_| KdnetKey::from_words([0; 4]));
        KdnetSettings { host_ip: self.meta.kdnet_host_ip, port: self.meta.kdnet_port, key }
    }

    /// The boot state a run with these verifier flags starts from (0: verifier off).
    pub fn state(&self, flags: u32) -> Result<PathBuf, ImageError> {
        let path = self.dir.join(state_file(flags));
        if self.meta.verifier_states.contains(&flags) && path.is_file() {
            return Ok(path);
        }
        let mut have = String::new();
        for f in &self.meta.verifier_states {
            let _ = write!(have, "{}{f:#x}", if have.is_empty() { "" } else { ", " });
        }
        Err(ImageError::NoState { dir: self.dir.display().to_string(), flags, have })
    }

    pub fn ovmf_vars(&self) -> Option<PathBuf> {
        (self.meta.firmware == Firmware::Uefi).then(|| self.dir.join(OVMF_VARS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> ImageMeta {
        ImageMeta {
            firmware: Firmware::Uefi,
            edition: "Windows 11 Pro".into(),
            kdnet_host_ip: Ipv4Addr::new(10, 0, 2, 2),
            kdnet_port: 50000,
            kdnet_key: "a.b.c.d".into(),
            verifier_states: vec![0, 0xAA],
            driver_package: "target/vhca-sys".into(),
        }
    }

    #[test]
    fn missing_image_names_the_command_that_builds_one() {
        let err = WindowsImage::open(Path::new("/nonexistent/win")).unwrap_err().to_string();
        assert!(err.contains("no Windows image at /nonexistent/win"), "{err}");
        assert!(err.contains("vhca-run windows-image build"), "{err}");
    }

    #[test]
    fn opens_a_complete_directory_and_finds_its_states() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(META_FILE), serde_json::to_string(&meta()).unwrap()).unwrap();
        let err = WindowsImage::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("base.qcow2 is missing"), "{err}");
        std::fs::write(dir.path().join(BASE_DISK), b"").unwrap();
        std::fs::write(dir.path().join(state_file(0)), b"").unwrap();
        let img = WindowsImage::open(dir.path()).unwrap();
        assert_eq!(img.state(0).unwrap(), dir.path().join("state-verifier-off.qcow2"));
        let err = img.state(0xAA).unwrap_err().to_string();
        assert!(err.contains("no boot state for Driver Verifier flags 0xaa (it has: 0x0, 0xaa)"), "{err}");
        assert!(img.state(0x2).unwrap_err().to_string().contains("--verifier-flags 0x2"));
        assert_eq!(img.kdnet().windbg_line(), "windbg -k net:port=50000,key=a.b.c.d");
        assert_eq!(img.ovmf_vars(), Some(dir.path().join("OVMF_VARS.fd")));
    }
}
