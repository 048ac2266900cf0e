//! What the Rust compiler expects from a C runtime, for a program that links none: the panic handler (the message,
//! then exit code 3), `_fltused` (libcore names it), the frame handler the precompiled liballoc's unwind tables name
//! (vcruntime140.dll's is not on every Windows), and the memory routines, bound to ntdll.dll's exports (every
//! process has ntdll.dll mapped). No frame of this program exceeds a page, so nothing calls `__chkstk`: the link
//! would name it.

use core::ffi::c_void;

use windows_sys::Win32::System::Threading::ExitProcess;

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    super::console::line(&alloc::format!("{} panicked: {info}", vhca_verbs_test::RESULT_PREFIX));
    // SAFETY: ends the process; a panic has no way to continue.
    unsafe { ExitProcess(vhca_verbs_test::EXIT_PANIC) }
}

/// Referenced by code that uses floating point (the MSVC convention; libcore's formatting does); never read.
#[no_mangle]
#[used]
pub static _fltused: i32 = 0;

/// The frame handler liballoc's .xdata names (it is built to unwind; this program, panic=abort, never does): a Rust
/// frame takes no exception, so the search goes on (ExceptionContinueSearch).
#[no_mangle]
pub extern "C" fn __CxxFrameHandler3(_record: usize, _frame: usize, _context: usize, _dispatcher: usize) -> i32 {
    1
}

// The memory routines and strlen are called by compiler-generated code and liballoc, not by name: declaring them
// binds those calls to ntdll.dll's exports.
#[allow(dead_code)]
#[link(name = "ntdll.dll", kind = "raw-dylib", modifiers = "+verbatim")]
extern "C" {
    fn memcpy(dest: *mut c_void, src: *const c_void, n: usize) -> *mut c_void;
    fn memmove(dest: *mut c_void, src: *const c_void, n: usize) -> *mut c_void;
    fn memset(dest: *mut c_void, c: i32, n: usize) -> *mut c_void;
    fn memcmp(a: *const c_void, b: *const c_void, n: usize) -> i32;
    fn strlen(s: *const u8) -> usize;
}
