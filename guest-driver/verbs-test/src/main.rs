//! vhca-verbs-test.exe: opens vhca.sys's device interface in a Windows guest and runs a user-mode verbs provider's
//! whole life through DeviceIoControl (vhca-user-verbs, the code the seed suite's user-verbs-loopback runs against
//! vhca.sys in the Linux guest), then prints one `VHCA-VERBS-TEST` line and exits 0 (passed), 1 (failed), 2 (no
//! vhca interface) or 3 (a panic). Run it elevated: the interface admits SYSTEM and Administrators only
//! (docs/windows.md). Built for any other target it is a program that says what it is and fails.
#![cfg_attr(target_os = "windows", no_std, no_main)]

#[cfg(target_os = "windows")]
extern crate alloc;

#[cfg(target_os = "windows")]
mod win32;

#[cfg(not(target_os = "windows"))]
fn main() {
    eprintln!("vhca-verbs-test is a Windows program: build it with ci/build-windows.sh (x86_64-pc-windows-msvc)");
    std::process::exit(2);
}
