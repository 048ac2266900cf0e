//! The registry a driver reads its parameters from and writes results to (ZwOpenKey, ZwQueryValueKey,
//! ZwSetValueKey, ZwClose), as a table of keys the run sets up: the service's Parameters key with the run's
//! `Scenario`, as the INF and the runner set it on Windows (the keys and open handles are `registry_table`'s).
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use windows_sys::Wdk::Foundation::OBJECT_ATTRIBUTES;
use windows_sys::Wdk::System::SystemServices::KEY_VALUE_PARTIAL_INFORMATION;
use windows_sys::Win32::Foundation::{
    HANDLE, NTSTATUS, STATUS_BUFFER_OVERFLOW, STATUS_BUFFER_TOO_SMALL, STATUS_INVALID_HANDLE, STATUS_INVALID_PARAMETER,
    STATUS_OBJECT_NAME_NOT_FOUND, STATUS_SUCCESS, UNICODE_STRING,
};

use crate::kernel_context::kernel;

/// KEY_VALUE_INFORMATION_CLASS KeyValuePartialInformation: the only class drivers here ask for.
const KEY_VALUE_PARTIAL_INFORMATION_CLASS: u32 = 2;
/// Bytes of KEY_VALUE_PARTIAL_INFORMATION before Data.
const PARTIAL_HEADER: usize = 12;

/// The text of a UNICODE_STRING (Length in bytes, no NUL needed).
///
/// # Safety
/// `s` is null or a valid UNICODE_STRING whose Buffer holds Length bytes.
unsafe fn text(s: *const UNICODE_STRING) -> Option<String> {
    // SAFETY: the caller's contract.
    unsafe {
        if s.is_null() || (*s).Buffer.is_null() {
            return None;
        }
        let units = std::slice::from_raw_parts((*s).Buffer, (*s).Length as usize / 2);
        Some(String::from_utf16_lossy(units))
    }
}

unsafe extern "win64" fn ZwOpenKey(out: *mut HANDLE, _access: u32, attributes: *const OBJECT_ATTRIBUTES) -> NTSTATUS {
    if out.is_null() || attributes.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    // SAFETY: the driver's OBJECT_ATTRIBUTES (InitializeObjectAttributes) with its name.
    let Some(name) = (unsafe { text((*attributes).ObjectName) }) else {
        return STATUS_INVALID_PARAMETER;
    };
    let Some(handle) = kernel().registry.open(&name) else {
        return STATUS_OBJECT_NAME_NOT_FOUND;
    };
    // SAFETY: the driver's out pointer.
    unsafe { *out = handle as HANDLE };
    STATUS_SUCCESS
}

unsafe extern "win64" fn ZwQueryValueKey(
    key: HANDLE,
    name: *const UNICODE_STRING,
    class: u32,
    buffer: *mut u8,
    length: u32,
    result_length: *mut u32,
) -> NTSTATUS {
    let r = &kernel().registry;
    let Some(path) = r.key_of(key as usize) else { return STATUS_INVALID_HANDLE };
    // SAFETY: the driver's value name.
    let Some(value) = (unsafe { text(name) }) else { return STATUS_INVALID_PARAMETER };
    if class != KEY_VALUE_PARTIAL_INFORMATION_CLASS || result_length.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    let Some((kind, data)) = r.value(&path, &value) else {
        return STATUS_OBJECT_NAME_NOT_FOUND;
    };
    let needed = PARTIAL_HEADER + data.len();
    // SAFETY: the driver's out pointer.
    unsafe { *result_length = needed as u32 };
    if (length as usize) < PARTIAL_HEADER {
        return STATUS_BUFFER_TOO_SMALL;
    }
    // SAFETY: the driver's buffer of `length` bytes, at least the header's.
    unsafe {
        let info = buffer as *mut KEY_VALUE_PARTIAL_INFORMATION;
        (*info).TitleIndex = 0;
        (*info).Type = kind;
        (*info).DataLength = data.len() as u32;
        let room = (length as usize - PARTIAL_HEADER).min(data.len());
        std::ptr::copy_nonoverlapping(data.as_ptr(), buffer.add(PARTIAL_HEADER), room);
    }
    if (length as usize) < needed {
        STATUS_BUFFER_OVERFLOW
    } else {
        STATUS_SUCCESS
    }
}

unsafe extern "win64" fn ZwSetValueKey(
    key: HANDLE,
    name: *const UNICODE_STRING,
    _title_index: u32,
    kind: u32,
    data: *const u8,
    size: u32,
) -> NTSTATUS {
    let r = &kernel().registry;
    let Some(path) = r.key_of(key as usize) else { return STATUS_INVALID_HANDLE };
    // SAFETY: the driver's value name.
    let Some(value) = (unsafe { text(name) }) else { return STATUS_INVALID_PARAMETER };
    let bytes = if size == 0 {
        Vec::new()
    } else {
        // SAFETY: the driver's data of `size` bytes.
        unsafe { std::slice::from_raw_parts(data, size as usize) }.to_vec()
    };
    r.set(&path, &value, kind, bytes);
    STATUS_SUCCESS
}

unsafe extern "win64" fn ZwClose(handle: HANDLE) -> NTSTATUS {
    if kernel().registry.close(handle as usize) {
        STATUS_SUCCESS
    } else {
        STATUS_INVALID_HANDLE
    }
}

pub fn registry_thunks() -> [(&'static str, usize); 4] {
    [
        ("ZwOpenKey", ZwOpenKey as *const () as usize),
        ("ZwQueryValueKey", ZwQueryValueKey as *const () as usize),
        ("ZwSetValueKey", ZwSetValueKey as *const () as usize),
        ("ZwClose", ZwClose as *const () as usize),
    ]
}
