//! Where the tests find the built vhca.sys package (ci/build-windows.sh), and the rule for its absence: under CI=true
//! a missing package fails the test (the test command builds it first); elsewhere the test is skipped, said on stderr.

use std::path::{Path, PathBuf};

/// $VHCA_WINDOWS_DRIVER_DIR, else `vhca-sys/` in the target directory.
pub fn package_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("VHCA_WINDOWS_DRIVER_DIR") {
        return PathBuf::from(dir);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    target.join("vhca-sys")
}

/// vhca.sys's bytes, or None (skip) outside CI when it was never built.
#[allow(dead_code)] // Each test crate that includes this module uses the helpers it needs.
pub fn vhca_sys() -> Option<Vec<u8>> {
    package_file("vhca.sys")
}

/// The bytes of the package's file `name`, or None (skip) outside CI when it was never built. Also included by
/// guest-driver/verbs-test's tests, for the user-mode test program in the same package.
pub fn package_file(name: &str) -> Option<Vec<u8>> {
    let path = package_dir().join(name);
    match std::fs::read(&path) {
        Ok(bytes) => Some(bytes),
        Err(e) => {
            let why = format!("{}: {e}: run ci/build-windows.sh", path.display());
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{why}");
            }
            eprintln!("skipped: {why}");
            None
        }
    }
}
