//! The run's registry values under the service's Parameters key: `Scenario` (REG_SZ, set by the INF to smoke, by
//! the runner's guest script to the run's scenario) in, `Result` (REG_SZ, the VHCA-RESULT line) out.

use alloc::vec::Vec;
use core::ffi::c_void;

use windows_sys::Wdk::Foundation::OBJECT_ATTRIBUTES;
use windows_sys::Wdk::System::Registry::KeyValuePartialInformation;
use windows_sys::Wdk::System::SystemServices::KEY_VALUE_PARTIAL_INFORMATION;
use windows_sys::Win32::Foundation::{HANDLE, NTSTATUS, OBJ_CASE_INSENSITIVE, OBJ_KERNEL_HANDLE, UNICODE_STRING};
use windows_sys::Win32::System::Registry::{KEY_QUERY_VALUE, KEY_SET_VALUE, REG_SZ};

use super::kernel_imports::{ZwClose, ZwOpenKey, ZwQueryValueKey, ZwSetValueKey};

/// ASCII text as UTF-16, at compile time (UNICODE_STRING wants UTF-16; the names here are ASCII).
const fn utf16<const N: usize>(text: &str) -> [u16; N] {
    let bytes = text.as_bytes();
    let mut out = [0u16; N];
    let mut i = 0;
    while i < N {
        out[i] = bytes[i] as u16;
        i += 1;
    }
    out
}

const KEY_TEXT: &str = "\\Registry\\Machine\\System\\CurrentControlSet\\Services\\vhca\\Parameters";
static PARAMETERS_KEY: [u16; KEY_TEXT.len()] = utf16(KEY_TEXT);
pub static SCENARIO: [u16; 8] = utf16("Scenario");
pub static LOCK: [u16; 4] = utf16("Lock");
pub static BREAK_FIX: [u16; 8] = utf16("BreakFix");
static RESULT: [u16; 6] = utf16("Result");

fn unicode(text: &[u16]) -> UNICODE_STRING {
    let bytes = (text.len() * 2) as u16;
    UNICODE_STRING { Length: bytes, MaximumLength: bytes, Buffer: text.as_ptr() as *mut u16 }
}

/// The Parameters key, open for `access`; closed on drop. PASSIVE_LEVEL.
struct Key(HANDLE);

impl Key {
    fn open(access: u32) -> Result<Key, NTSTATUS> {
        let name = unicode(&PARAMETERS_KEY);
        // InitializeObjectAttributes (a wdm.h macro): a kernel handle, names compared without case.
        // SAFETY: all-zero is a valid OBJECT_ATTRIBUTES before the fields below are set.
        let mut attributes: OBJECT_ATTRIBUTES = unsafe { core::mem::zeroed() };
        attributes.Length = core::mem::size_of::<OBJECT_ATTRIBUTES>() as u32;
        attributes.ObjectName = &name;
        attributes.Attributes = OBJ_KERNEL_HANDLE | OBJ_CASE_INSENSITIVE;
        let mut handle: HANDLE = core::ptr::null_mut();
        // SAFETY: PASSIVE_LEVEL; the name and attributes live across the call.
        let status = unsafe { ZwOpenKey(&mut handle, access, &attributes) };
        if status < 0 {
            Err(status)
        } else {
            Ok(Key(handle))
        }
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        // SAFETY: PASSIVE_LEVEL; a kernel handle from ZwOpenKey, closed once.
        unsafe { ZwClose(self.0) };
    }
}

/// A REG_SZ value's UTF-16 text (`SCENARIO`, `LOCK`, `BREAK_FIX`), None when the key or value is missing.
/// PASSIVE_LEVEL.
pub fn read_text(value: &[u16]) -> Option<Vec<u16>> {
    let key = Key::open(KEY_QUERY_VALUE).ok()?;
    let name = unicode(value);
    // Room for a 255-character name: more than any scenario needs; a longer value is refused (buffer overflow).
    let mut buffer = [0u64; 80];
    let mut written = 0u32;
    // SAFETY: PASSIVE_LEVEL; the buffer is 8-aligned and its length is passed.
    let status = unsafe {
        ZwQueryValueKey(
            key.0,
            &name,
            KeyValuePartialInformation,
            buffer.as_mut_ptr().cast::<c_void>(),
            core::mem::size_of_val(&buffer) as u32,
            &mut written,
        )
    };
    if status < 0 {
        return None;
    }
    // SAFETY: on success the buffer starts with a KEY_VALUE_PARTIAL_INFORMATION.
    let info = unsafe { &*(buffer.as_ptr().cast::<KEY_VALUE_PARTIAL_INFORMATION>()) };
    if info.Type != REG_SZ {
        return None;
    }
    let offset = core::mem::offset_of!(KEY_VALUE_PARTIAL_INFORMATION, Data);
    let length = (info.DataLength as usize).min(core::mem::size_of_val(&buffer) - offset);
    // SAFETY: `length` bytes of data follow the header inside the buffer (bounded just above).
    let data = unsafe { core::slice::from_raw_parts(buffer.as_ptr().cast::<u8>().add(offset), length) };
    Some(data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
}

/// Stores the result line as the Result value (REG_SZ, NUL-terminated). PASSIVE_LEVEL.
pub fn write_result(line: &str) -> Result<(), NTSTATUS> {
    let key = Key::open(KEY_SET_VALUE)?;
    let name = unicode(&RESULT);
    let mut text: Vec<u16> = line.encode_utf16().collect();
    text.push(0);
    // SAFETY: PASSIVE_LEVEL; the data lives across the call.
    let status =
        unsafe { ZwSetValueKey(key.0, &name, 0, REG_SZ, text.as_ptr().cast::<c_void>(), (text.len() * 2) as u32) };
    if status < 0 {
        Err(status)
    } else {
        Ok(())
    }
}
