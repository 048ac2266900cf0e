//! Lines to the kernel debugger (DbgPrintEx, shown by WinDbg/KDNET or DebugView), e.g. the VHCA-RESULT line.

use alloc::vec::Vec;

use super::kernel_imports::DbgPrintEx;

/// DPFLTR_IHVDRIVER_ID and DPFLTR_ERROR_LEVEL (dpfilter.h): the component and level that print by default.
const DPFLTR_IHVDRIVER_ID: u32 = 77;
const DPFLTR_ERROR_LEVEL: u32 = 0;

/// Prints one line. DbgPrintEx cuts a message at 512 bytes; result lines stay well below.
pub fn print_line(line: &str) {
    let mut text: Vec<u8> = line.bytes().filter(|&b| b != 0).collect();
    text.push(0);
    // SAFETY: IRQL <= DIRQL; "%s\n" with one NUL-terminated string argument.
    unsafe { DbgPrintEx(DPFLTR_IHVDRIVER_ID, DPFLTR_ERROR_LEVEL, c"%s\n".as_ptr().cast(), text.as_ptr()) };
}
