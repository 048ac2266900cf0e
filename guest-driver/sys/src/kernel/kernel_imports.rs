//! Kernel routines declared here rather than taken from windows-sys: those windows-sys attributes to ntdll.dll
//! (a kernel driver importing from ntdll.dll does not load: the kernel binds a driver's imports only against
//! kernel-mode images, and ntdll.dll is a user-mode one), those its metadata lacks because
//! the WDK header makes them inline or macros on x64 while ntoskrnl.exe still exports them, and the C memory
//! routines the compiler calls, bound to ntoskrnl.exe's exports. Every name here is on the import list
//! (guest-driver/sys/imports.txt) the PE check enforces.

use core::ffi::c_void;

use windows_sys::Wdk::Foundation::OBJECT_ATTRIBUTES;
use windows_sys::Win32::Foundation::{HANDLE, NTSTATUS, UNICODE_STRING};

// The memory routines and strlen are called by compiler-generated code and the precompiled liballoc, not by
// name from Rust: declaring them here is what binds those calls to ntoskrnl.exe's exports.
#[allow(dead_code)]
#[link(name = "ntoskrnl.exe", kind = "raw-dylib", modifiers = "+verbatim")]
extern "C" {
    /// Prints to the kernel debugger (ntoskrnl.exe exports it; windows-sys says ntdll.dll).
    pub fn DbgPrintEx(component_id: u32, level: u32, format: *const u8, ...) -> u32;
    pub fn memcpy(dest: *mut c_void, src: *const c_void, n: usize) -> *mut c_void;
    pub fn memmove(dest: *mut c_void, src: *const c_void, n: usize) -> *mut c_void;
    pub fn memset(dest: *mut c_void, c: i32, n: usize) -> *mut c_void;
    pub fn memcmp(a: *const c_void, b: *const c_void, n: usize) -> i32;
    /// The precompiled liballoc calls it (CString::from_raw).
    pub fn strlen(s: *const u8) -> usize;
}

#[link(name = "ntoskrnl.exe", kind = "raw-dylib", modifiers = "+verbatim")]
extern "system" {
    /// Raises to DISPATCH_LEVEL and takes the lock; returns the previous IRQL (KeAcquireSpinLock on x64).
    pub fn KeAcquireSpinLockRaiseToDpc(lock: *mut usize) -> u8;
    pub fn KeReleaseSpinLock(lock: *mut usize, new_irql: u8);
    /// Takes the lock at DISPATCH_LEVEL or above without touching the IRQL (a DPC's spin lock). Functions on x64
    /// (wdm.h declares them NTKERNELAPI; the x86 macros over KefAcquireSpinLockAtDpcLevel do not apply), absent
    /// from windows-sys's metadata.
    pub fn KeAcquireSpinLockAtDpcLevel(lock: *mut usize);
    pub fn KeReleaseSpinLockFromDpcLevel(lock: *mut usize);
    pub fn ZwOpenKey(key: *mut HANDLE, desired_access: u32, attributes: *const OBJECT_ATTRIBUTES) -> NTSTATUS;
    pub fn ZwQueryValueKey(
        key: HANDLE,
        value_name: *const UNICODE_STRING,
        class: i32,
        information: *mut c_void,
        length: u32,
        result_length: *mut u32,
    ) -> NTSTATUS;
    pub fn ZwSetValueKey(
        key: HANDLE,
        value_name: *const UNICODE_STRING,
        title_index: u32,
        value_type: u32,
        data: *const c_void,
        size: u32,
    ) -> NTSTATUS;
    pub fn ZwClose(handle: HANDLE) -> NTSTATUS;
    /// Frees the symbolic link IoRegisterDeviceInterface gave (wdm.h; windows-sys says ntdll.dll).
    pub fn RtlFreeUnicodeString(string: *mut UNICODE_STRING);
    /// User buffers for the scenarios (ntifs.h; windows-sys says ntdll.dll).
    pub fn ZwAllocateVirtualMemory(
        process: HANDLE,
        base_address: *mut *mut c_void,
        zero_bits: usize,
        region_size: *mut usize,
        allocation_type: u32,
        protect: u32,
    ) -> NTSTATUS;
    pub fn ZwFreeVirtualMemory(
        process: HANDLE,
        base_address: *mut *mut c_void,
        region_size: *mut usize,
        free_type: u32,
    ) -> NTSTATUS;
}
