//! Link arguments for vhca-verbs-test.exe when the target is Windows: a console program entered at mainCRTStartup
//! with no C runtime (none is on this Linux host; the program binds what the compiler calls to ntdll.dll's exports),
//! relocatable and NX, with a PDB. Host builds get nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("windows") {
        return;
    }
    for arg in ["/NODEFAULTLIB", "/SUBSYSTEM:CONSOLE", "/ENTRY:mainCRTStartup", "/DYNAMICBASE", "/NXCOMPAT", "/DEBUG"] {
        println!("cargo:rustc-link-arg-bins={arg}");
    }
}
