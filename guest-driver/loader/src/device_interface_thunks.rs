//! IoRegisterDeviceInterface, IoSetDeviceInterfaceState and RtlFreeUnicodeString (the link's buffer) over the I/O
//! manager's interface table (device_interfaces.rs); the link's UNICODE_STRING buffers are the caller's to free.

#![allow(non_snake_case)] // the thunks carry the exports' names

use std::sync::Mutex;

use windows_sys::core::GUID;
use windows_sys::Wdk::Foundation::DEVICE_OBJECT;
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_INVALID_PARAMETER, STATUS_SUCCESS, UNICODE_STRING};

use crate::device_interfaces::{self, StateChange};
use crate::kernel_context::kernel;

/// ntstatus.h: enabling an enabled interface, disabling a disabled one (IoSetDeviceInterfaceState's reference page).
const STATUS_OBJECT_NAME_EXISTS: NTSTATUS = 0x4000_0000;
const STATUS_OBJECT_NAME_NOT_FOUND: NTSTATUS = 0xC000_0034_u32 as i32;

/// Buffers handed out in a link's UNICODE_STRING (address, length in u16s), freed by RtlFreeUnicodeString.
static LINK_BUFFERS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

fn guid_value(g: &GUID) -> u128 {
    let tail = u64::from_be_bytes(g.data4);
    (u128::from(g.data1) << 96) | (u128::from(g.data2) << 80) | (u128::from(g.data3) << 64) | u128::from(tail)
}

/// IoRegisterDeviceInterface(PhysicalDeviceObject, InterfaceClassGuid, ReferenceString, SymbolicLinkName): only
/// the device's PDO may carry an interface (Windows refuses a device that is not a PnP PDO); no reference string is
/// modelled. PASSIVE_LEVEL.
unsafe extern "win64" fn IoRegisterDeviceInterface(
    pdo: *mut DEVICE_OBJECT,
    class: *const GUID,
    reference: *const UNICODE_STRING,
    link: *mut UNICODE_STRING,
) -> NTSTATUS {
    if class.is_null() || link.is_null() || !reference.is_null() || kernel().io.pdo() != Some(pdo as usize) {
        return STATUS_INVALID_PARAMETER;
    }
    // SAFETY: the driver's GUID and its output string, live for the call.
    unsafe {
        let text = device_interfaces::register(pdo as usize, guid_value(&*class));
        let wide: Box<[u16]> = text.encode_utf16().chain([0]).collect();
        let chars = wide.len();
        let buffer = Box::into_raw(wide) as *mut u16;
        crate::lock(&LINK_BUFFERS).push((buffer as usize, chars));
        *link = UNICODE_STRING { Length: ((chars - 1) * 2) as u16, MaximumLength: (chars * 2) as u16, Buffer: buffer };
    }
    STATUS_SUCCESS
}

/// IoSetDeviceInterfaceState(SymbolicLinkName, Enable). PASSIVE_LEVEL.
unsafe extern "win64" fn IoSetDeviceInterfaceState(link: *const UNICODE_STRING, enable: u8) -> NTSTATUS {
    // SAFETY: the driver's string, as IoRegisterDeviceInterface gave it.
    let Some(text) = (unsafe { link_text(link) }) else { return STATUS_INVALID_PARAMETER };
    match (device_interfaces::set_state(&text, enable != 0), enable != 0) {
        (StateChange::Changed, _) => STATUS_SUCCESS,
        (StateChange::Unchanged, true) => STATUS_OBJECT_NAME_EXISTS,
        (StateChange::Unchanged, false) | (StateChange::NoSuchLink, _) => STATUS_OBJECT_NAME_NOT_FOUND,
    }
}

/// RtlFreeUnicodeString: a buffer this model handed out is freed once; any other is left alone (the model
/// allocated nothing else a driver may free this way).
unsafe extern "win64" fn RtlFreeUnicodeString(string: *mut UNICODE_STRING) {
    if string.is_null() {
        return;
    }
    // SAFETY: the driver's string; a buffer found in the table is a Box<[u16]> of the recorded length.
    unsafe {
        let buffer = (*string).Buffer as usize;
        let mut buffers = crate::lock(&LINK_BUFFERS);
        if let Some(at) = buffers.iter().position(|(b, _)| *b == buffer) {
            let (_, chars) = buffers.remove(at);
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(buffer as *mut u16, chars)));
            (*string).Buffer = std::ptr::null_mut();
            (*string).Length = 0;
            (*string).MaximumLength = 0;
        }
    }
}

/// # Safety
/// NULL or a UNICODE_STRING whose buffer holds Length bytes.
unsafe fn link_text(s: *const UNICODE_STRING) -> Option<String> {
    // SAFETY: the caller's contract.
    unsafe {
        let s = s.as_ref()?;
        if s.Buffer.is_null() {
            return None;
        }
        Some(String::from_utf16_lossy(std::slice::from_raw_parts(s.Buffer, s.Length as usize / 2)))
    }
}

pub fn device_interface_thunks() -> [(&'static str, usize); 3] {
    [
        ("IoRegisterDeviceInterface", IoRegisterDeviceInterface as *const () as usize),
        ("IoSetDeviceInterfaceState", IoSetDeviceInterfaceState as *const () as usize),
        ("RtlFreeUnicodeString", RtlFreeUnicodeString as *const () as usize),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guid_reads_data1_first() {
        let g = GUID {
            data1: 0x5648_4341,
            data2: 0x7665,
            data3: 0x7262,
            data4: [0xa5, 0xc3, 0x1d, 0x2e, 0x8f, 0x40, 0x9b, 0x76],
        };
        assert_eq!(guid_value(&g), 0x5648_4341_7665_7262_a5c3_1d2e_8f40_9b76);
    }
}
