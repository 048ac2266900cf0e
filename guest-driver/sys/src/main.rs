//! vhca.sys's entry point. The driver itself is the library (`vhca_sys`); this file only gives the linker the
//! DriverEntry symbol /ENTRY names. Built for any other target it is a program that says what it is and fails.
#![cfg_attr(target_os = "windows", no_std, no_main)]

#[cfg(target_os = "windows")]
use windows_sys::Wdk::Foundation::DRIVER_OBJECT;
#[cfg(target_os = "windows")]
use windows_sys::Win32::Foundation::{NTSTATUS, UNICODE_STRING};

/// Called by the I/O manager at PASSIVE_LEVEL in the System process when the driver image is loaded.
///
/// # Safety
/// Windows passes a valid driver object and the driver's service key path, as DriverEntry's contract says.
#[cfg(target_os = "windows")]
#[no_mangle]
pub unsafe extern "system" fn DriverEntry(
    driver: *mut DRIVER_OBJECT,
    registry_path: *const UNICODE_STRING,
) -> NTSTATUS {
    // SAFETY: the pointers are the I/O manager's, passed on unchanged; driver_entry's contract is DriverEntry's.
    unsafe { vhca_sys::driver_entry(driver, registry_path) }
}

#[cfg(not(target_os = "windows"))]
fn main() {
    eprintln!("vhca.sys is a Windows kernel driver: build it with ci/build-windows.sh (x86_64-pc-windows-msvc)");
    std::process::exit(2);
}
