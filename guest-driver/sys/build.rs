//! Link arguments for vhca.sys when the target is Windows: a native-subsystem WDM driver entered at DriverEntry,
//! with no C runtime, relocatable and NX, with a checksum (/RELEASE) and a PDB (/DEBUG). Host builds get nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("windows") {
        return;
    }
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
