//! Lines to the console (standard output), without the C runtime's stdio.

use windows_sys::Win32::Storage::FileSystem::WriteFile;
use windows_sys::Win32::System::Console::{GetStdHandle, STD_OUTPUT_HANDLE};

/// Writes `text` and a CRLF to standard output; a console that is gone loses the line (there is no one to tell).
pub fn line(text: &str) {
    // SAFETY: GetStdHandle has no preconditions; WriteFile is given buffers that outlive the calls.
    unsafe {
        let out = GetStdHandle(STD_OUTPUT_HANDLE);
        for bytes in [text.as_bytes(), b"\r\n"] {
            let mut written = 0u32;
            WriteFile(out, bytes.as_ptr(), bytes.len() as u32, &mut written, core::ptr::null_mut());
        }
    }
}
