//! The guest image cache: builds images/linux with its script on demand and keeps the result under a key made of the
//! scripts, the kernel package and the guest binary's bytes, so any change to one of them rebuilds and nothing else does.

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::cache_in_use::{self, use_file, InUse, InUseError};
use crate::supervise::{tick, SuperviseError, Supervised};

/// The recipe is compiled in, so the runner builds the image it was built with, wherever it is run from.
const BUILD_SH: &str = include_str!("../../images/linux/build.sh");
const INIT: &str = include_str!("../../images/linux/init");
/// `apt-get update` may run inside `resolve`; downloads and extraction inside `build`.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(300);
const BUILD_TIMEOUT: Duration = Duration::from_secs(900);
/// Images kept in the cache; older ones (other guest builds) are pruned.
const KEEP_IMAGES: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image cache {path}: {source}")]
    Cache { path: String, source: io::Error },
    #[error("guest binary {path}: {source}")]
    Guest { path: String, source: io::Error },
    #[error(
        "guest binary {0} is dynamically linked, and the initramfs has no dynamic loader; use the static build \
         ci/build.sh makes (RUSTFLAGS=\"-C target-feature=+crt-static\" cargo build --release -p vhca-guest \
         --target x86_64-unknown-linux-gnu) or pass it with --guest-bin / VHCA_GUEST_BIN"
    )]
    DynamicGuest(String),
    #[error(transparent)]
    Process(#[from] SuperviseError),
    #[error("images/linux/build.sh {step} failed ({status}); its log:\n{log}")]
    Script { step: &'static str, status: String, log: String },
    #[error("images/linux/build.sh {0} timed out")]
    ScriptTimeout(&'static str),
    #[error("the built image in {0} has no kernel or no initramfs")]
    Incomplete(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelKind {
    /// Uncompressed ELF with a PVH entry: boots in about half the time of the bzImage under TCG.
    Vmlinux,
    BzImage,
}

#[derive(Debug, Clone, Serialize)]
pub struct Image {
    pub key: String,
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub kernel_kind: KernelKind,
    pub initrd: PathBuf,
    pub kernel_package: String,
    /// False when the image came from the cache.
    pub built: bool,
    /// Keeps another runner sharing the cache from pruning this image while this session boots it (`cache_in_use`).
    #[serde(skip)]
    pub in_use: Option<Arc<InUse>>,
}

fn cache_err(path: &Path) -> impl FnOnce(io::Error) -> ImageError + '_ {
    move |source| ImageError::Cache { path: path.display().to_string(), source }
}

/// An exclusive lock on the cache for the whole check-or-build, so parallel runners (e.g. tests) build once.
pub struct CacheLock {
    _file: File,
}

impl CacheLock {
    pub fn acquire(cache: &Path) -> Result<CacheLock, ImageError> {
        fs::create_dir_all(cache).map_err(cache_err(cache))?;
        CacheLock::acquire_file(&cache.join("lock"))
    }

    /// Locks one file (created if missing) exclusively, waiting for whoever holds it.
    pub fn acquire_file(path: &Path) -> Result<CacheLock, ImageError> {
        let path = path.to_path_buf();
        let file = File::create(&path).map_err(cache_err(&path))?;
        loop {
            // SAFETY: flock on a descriptor this function owns; non-blocking, so the wait stays interruptible.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                return Ok(CacheLock { _file: file });
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::WouldBlock {
                return Err(ImageError::Cache { path: path.display().to_string(), source: err });
            }
            tick()?;
        }
    }
}

/// The image for this guest binary, from the cache or freshly built. Call with the cache locked.
pub fn ensure(cache: &Path, guest: &Path, on_build: &mut dyn FnMut(&str)) -> Result<Image, ImageError> {
    let guest_bytes =
        fs::read(guest).map_err(|source| ImageError::Guest { path: guest.display().to_string(), source })?;
    // Refused here, where it is cheap: booted, such a guest only says "/init: exec: /bin/vhca-guest: not found".
    if !crate::paths::is_static_elf(guest) {
        return Err(ImageError::DynamicGuest(guest.display().to_string()));
    }
    let scripts = tempfile::Builder::new().prefix(".scripts-").tempdir_in(cache).map_err(cache_err(cache))?;
    let build_sh = scripts.path().join("build.sh");
    write_file(&build_sh, BUILD_SH, 0o755)?;
    write_file(&scripts.path().join("init"), INIT, 0o755)?;

    let resolved = resolve_kernel(cache, &build_sh, scripts.path())?;
    let mut words = resolved.split_whitespace();
    let (Some(pkg), Some(ver)) = (words.next(), words.next()) else {
        return Err(ImageError::Script { step: "resolve", status: "bad output".into(), log: resolved });
    };
    // vhca.sys, when built, goes into the image for `driver = "sys"` runs; its bytes are part of the key.
    let driver = crate::paths::windows_driver();
    let driver_bytes = driver.as_deref().and_then(|p| fs::read(p).ok()).unwrap_or_default();
    let key = image_key(pkg, ver, &[guest_bytes.as_slice(), b"vhca.sys", driver_bytes.as_slice()].concat());
    let images = cache.join("images");
    let dir = images.join(&key);
    let kernel_package = format!("{pkg} {ver}");
    if let Some(image) = complete_image(&dir, &key, &kernel_package, false) {
        touch(&dir);
        return mark_in_use(image, &images);
    }

    on_build(&format!("building guest image {key} ({kernel_package})"));
    fs::create_dir_all(&images).map_err(cache_err(&images))?;
    let staging = tempfile::Builder::new().prefix(".build-").tempdir_in(&images).map_err(cache_err(&images))?;
    let out = staging.path().join("image");
    let mut args = vec![
        "build",
        "--out",
        path_str(&out),
        "--guest",
        path_str(guest),
        "--kernel-pkg",
        pkg,
        "--kernel-ver",
        ver,
        "--cache",
        path_str(cache),
    ];
    if let Some(driver) = driver.as_deref().filter(|_| !driver_bytes.is_empty()) {
        args.extend(["--driver", path_str(driver)]);
    }
    run_script(&build_sh, &args, scripts.path(), "build", BUILD_TIMEOUT)?;
    // The lock is held, so nobody else is filling `dir`; a leftover incomplete one is replaced.
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&out, &dir).map_err(cache_err(&dir))?;
    prune(&images, &key);
    let image = complete_image(&dir, &key, &kernel_package, true)
        .ok_or_else(|| ImageError::Incomplete(dir.display().to_string()))?;
    mark_in_use(image, &images)
}

/// Marked in use under the cache lock `ensure` is called with, which every pruner holds too.
fn mark_in_use(mut image: Image, images: &Path) -> Result<Image, ImageError> {
    let in_use = InUse::acquire(&use_file(images, &image.key)).map_err(|e| match e {
        InUseError::Process(e) => ImageError::Process(e),
        InUseError::Io { source, .. } => ImageError::Cache { path: images.display().to_string(), source },
    })?;
    image.in_use = Some(Arc::new(in_use));
    Ok(image)
}

/// `build.sh resolve` costs seconds of apt-cache; its answer only changes with the apt lists, so it is remembered
/// under a fingerprint of them.
fn resolve_kernel(cache: &Path, build_sh: &Path, scripts: &Path) -> Result<String, ImageError> {
    let memo = cache.join("kernel-resolve.txt");
    let fingerprint = apt_lists_fingerprint();
    if let (Some(fp), Ok(text)) = (&fingerprint, fs::read_to_string(&memo)) {
        if let Some(answer) = text.strip_prefix(fp.as_str()).and_then(|rest| rest.strip_prefix('\n')) {
            return Ok(answer.to_string());
        }
    }
    let answer = run_script(build_sh, &["resolve"], scripts, "resolve", RESOLVE_TIMEOUT)?;
    // Fingerprint taken after the script, which may have run apt-get update.
    if let Some(fp) = apt_lists_fingerprint() {
        let _ = fs::write(&memo, format!("{fp}\n{answer}"));
    }
    Ok(answer)
}

/// Names, sizes and mtimes of the apt package lists: changes whenever `apt-get update` brings anything new.
fn apt_lists_fingerprint() -> Option<String> {
    let mut entries: Vec<(String, u64, u64)> = fs::read_dir("/var/lib/apt/lists")
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            let mtime = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs();
            Some((e.file_name().to_string_lossy().into_owned(), meta.len(), mtime))
        })
        .filter(|(name, _, _)| name.contains("Packages") || name.ends_with("Release"))
        .collect();
    if entries.is_empty() {
        return None;
    }
    entries.sort();
    let mut h = Sha256::new();
    for (name, len, mtime) in entries {
        h.update(format!("{name}\0{len}\0{mtime}\n"));
    }
    Some(hex::encode(&h.finalize()[..12]))
}

fn path_str(p: &Path) -> &str {
    // Cache and binary paths come from the environment; a non-UTF-8 one is replaced lossily by the caller's display.
    p.to_str().unwrap_or("/nonexistent-non-utf8-path")
}

pub fn image_key(pkg: &str, ver: &str, guest: &[u8]) -> String {
    let mut h = Sha256::new();
    for part in [b"build.sh".as_slice(), BUILD_SH.as_bytes(), b"init", INIT.as_bytes(), pkg.as_bytes(), ver.as_bytes()]
    {
        // Length-prefixed, so moving bytes between parts changes the key.
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.update((guest.len() as u64).to_le_bytes());
    h.update(guest);
    hex::encode(&h.finalize()[..12])
}

fn complete_image(dir: &Path, key: &str, kernel_package: &str, built: bool) -> Option<Image> {
    let initrd = dir.join("initramfs.cpio");
    if !initrd.is_file() {
        return None;
    }
    let (kernel, kernel_kind) = if dir.join("vmlinux").is_file() {
        (dir.join("vmlinux"), KernelKind::Vmlinux)
    } else if dir.join("bzImage").is_file() {
        (dir.join("bzImage"), KernelKind::BzImage)
    } else {
        return None;
    };
    Some(Image {
        key: key.to_string(),
        dir: dir.to_path_buf(),
        kernel,
        kernel_kind,
        initrd,
        kernel_package: kernel_package.to_string(),
        built,
        in_use: None,
    })
}

fn write_file(path: &Path, text: &str, mode: u32) -> Result<(), ImageError> {
    let mut f = File::create(path).map_err(cache_err(path))?;
    f.write_all(text.as_bytes()).map_err(cache_err(path))?;
    f.set_permissions(fs::Permissions::from_mode(mode)).map_err(cache_err(path))
}

/// Runs the script under supervision; returns its stdout, or its log on failure.
fn run_script(
    script: &Path,
    args: &[&str],
    dir: &Path,
    step: &'static str,
    timeout: Duration,
) -> Result<String, ImageError> {
    let stdout_path = dir.join(format!("{step}.out"));
    let log_path = dir.join(format!("{step}.log"));
    let mut cmd = Command::new("bash");
    cmd.arg(script).args(args);
    let stdout = File::create(&stdout_path).map_err(cache_err(&stdout_path))?;
    let stderr = File::create(&log_path).map_err(cache_err(&log_path))?;
    cmd.stdout(stdout).stderr(stderr);
    let mut child = Supervised::spawn(&format!("build.sh {step}"), cmd, None)?;
    let end = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_status()? {
            break s;
        }
        if Instant::now() >= end {
            return Err(ImageError::ScriptTimeout(step));
        }
        tick()?;
    };
    let out = fs::read_to_string(&stdout_path).unwrap_or_default();
    if !status.success() {
        let log = fs::read_to_string(&log_path).unwrap_or_default();
        return Err(ImageError::Script { step, status: status.to_string(), log });
    }
    Ok(out)
}

/// Marks an image used. Its own marker file, not the initramfs: the snapshot key includes the image files' mtimes,
/// which must change only when their content does.
const USED: &str = ".used";

fn touch(dir: &Path) {
    // The marker's mtime orders images for pruning: a used image is a recent one.
    let _ = File::create(dir.join(USED));
}

fn prune(images: &Path, keep_key: &str) {
    let Ok(entries) = fs::read_dir(images) else { return };
    let mut dirs: Vec<(std::time::SystemTime, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.') && e.file_name() != keep_key)
        .filter_map(|e| {
            let last_use = |name: &str| fs::metadata(e.path().join(name)).and_then(|m| m.modified()).ok();
            let mtime = last_use(USED).or_else(|| last_use("initramfs.cpio"))?;
            Some((mtime, e.path()))
        })
        .collect();
    dirs.sort();
    let mut excess = (dirs.len() + 1).saturating_sub(KEEP_IMAGES);
    for (_, dir) in dirs {
        if excess == 0 {
            break;
        }
        // An image another runner boots its guests from is skipped; the next older one goes in its place.
        let key = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let unused = cache_in_use::unused(&use_file(images, &key));
        if unused.is_some() && fs::remove_dir_all(&dir).is_ok() {
            excess -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_changes_with_each_input() {
        let base = image_key("linux-image-6.1.0-57-amd64", "6.1.192-3", b"guest");
        assert_eq!(base, image_key("linux-image-6.1.0-57-amd64", "6.1.192-3", b"guest"));
        assert_ne!(base, image_key("linux-image-6.1.0-58-amd64", "6.1.192-3", b"guest"));
        assert_ne!(base, image_key("linux-image-6.1.0-57-amd64", "6.1.193-1", b"guest"));
        assert_ne!(base, image_key("linux-image-6.1.0-57-amd64", "6.1.192-3", b"guest2"));
        assert_eq!(base.len(), 24);
    }

    #[test]
    fn prune_skips_an_image_another_runner_uses() {
        let images = tempfile::tempdir().unwrap();
        let keys = ["new", "a", "b", "c", "d"];
        for (i, key) in keys.iter().enumerate() {
            let dir = images.path().join(key);
            fs::create_dir(&dir).unwrap();
            let used = File::create(dir.join(USED)).unwrap();
            used.set_modified(std::time::UNIX_EPOCH + Duration::from_secs(1000 + i as u64)).unwrap();
        }
        // Another runner boots from a, the oldest.
        let _using_a = InUse::acquire(&use_file(images.path(), "a")).unwrap();
        prune(images.path(), "new");
        let left: Vec<bool> = keys.iter().map(|k| images.path().join(k).exists()).collect();
        // One must go (4 others + the new one, 4 kept): a is in use, so b goes.
        assert_eq!(left, [true, true, false, true, true]);
    }

    #[test]
    fn incomplete_image_dirs_are_not_images() {
        let dir = tempfile::tempdir().unwrap();
        assert!(complete_image(dir.path(), "k", "p", false).is_none());
        fs::write(dir.path().join("initramfs.cpio"), b"x").unwrap();
        assert!(complete_image(dir.path(), "k", "p", false).is_none(), "no kernel");
        fs::write(dir.path().join("bzImage"), b"x").unwrap();
        assert_eq!(complete_image(dir.path(), "k", "p", false).unwrap().kernel_kind, KernelKind::BzImage);
        fs::write(dir.path().join("vmlinux"), b"x").unwrap();
        assert_eq!(complete_image(dir.path(), "k", "p", false).unwrap().kernel_kind, KernelKind::Vmlinux);
    }
}
