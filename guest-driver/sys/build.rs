//! Link arguments for vhca.sys when the target is Windows: a native-subsystem WDM driver entered at DriverEntry,
//! with no C runtime, relocatable and NX, with a checksum (/RELEASE) and a PDB (/DEBUG), and the one C unit (its
//! __try/__except around the raising kernel routines) compiled by clang into the same image. Host builds get nothing.

use std::path::PathBuf;
use std::process::Command;

/// The C unit: clang for x86_64-pc-windows-msvc (its __try makes the scope tables __C_specific_handler reads),
/// freestanding, no headers (the file declares its few prototypes), no stack cookie (no C runtime to check it).
fn compile_probe() -> PathBuf {
    let source = "c/probe.c";
    println!("cargo:rerun-if-changed={source}");
    println!("cargo:rerun-if-env-changed=VHCA_CLANG");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("probe.obj");
    let clang = std::env::var("VHCA_CLANG").unwrap_or_else(|_| "clang".to_string());
    let status = Command::new(&clang)
        .args(["--target=x86_64-pc-windows-msvc", "-c", "-O2", "-ffreestanding", "-nostdinc", "-fno-stack-protector"])
        .args(["-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(source)
        .status()
        .unwrap_or_else(|e| {
            panic!("{clang} not found ({e}): ci/setup-host.sh installs clang, which vhca.sys's C unit needs")
        });
    assert!(status.success(), "{clang} failed on {source}");
    out
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("windows") {
        return;
    }
    println!("cargo:rustc-link-arg-bins={}", compile_probe().display());
    for arg in [
        "/NODEFAULTLIB",
        "/SUBSYSTEM:NATIVE",
        "/DRIVER:WDM",
        "/ENTRY:DriverEntry",
        "/DYNAMICBASE",
        "/NXCOMPAT",
        "/RELEASE",
        "/DEBUG",
    ] {
        println!("cargo:rustc-link-arg-bins={arg}");
    }
}
