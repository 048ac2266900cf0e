//! What the Rust compiler expects from a C runtime, provided for a kernel driver that links none: the panic
//! handler (a bugcheck), `__chkstk` (kernel flavour: probes pages, never reads the TEB), `_fltused`, and the
//! memory routines (bound to ntoskrnl.exe's exports in kernel_imports.rs).

use core::sync::atomic::{AtomicU32, Ordering};

use windows_sys::Wdk::System::SystemServices::KeBugCheckEx;

/// The bugcheck code vhca.sys stops with when its Rust code panics: a driver-defined code (bit 29, the customer
/// bit, as NTSTATUS has it), so a dump never confuses it with a Windows-defined STOP. P1 = source line, P2 = the
/// address of the file name, P3 = how many panics started (a nested panic shows as 2).
pub const VHCA_RUST_PANIC: u32 = 0x2000_0001;

static PANICS: AtomicU32 = AtomicU32::new(0);

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    let nth = PANICS.fetch_add(1, Ordering::SeqCst) + 1;
    let (line, file) = info.location().map_or((0, 0), |l| (l.line() as usize, l.file().as_ptr() as usize));
    // SAFETY: KeBugCheckEx may be called at any IRQL and does not return; a Rust panic has no way to continue.
    unsafe { KeBugCheckEx(VHCA_RUST_PANIC, line, file, nth as usize, 0) };
    #[allow(clippy::empty_loop)]
    loop {}
}

/// Referenced by the compiler whenever floating point appears (the MSVC convention); its value is not read.
#[no_mangle]
#[used]
pub static _fltused: i32 = 0;

/// The C++ frame handler the precompiled liballoc's unwind tables (.xdata) name: the standard library for this
/// target is built to unwind, this driver with panic=abort never does. An SEH exception dispatched through a Rust
/// frame (one the driver's C unit, c/probe.c, did not take; or an access violation in Rust code) gets
/// ExceptionContinueSearch (1), while searching and while unwinding alike: a Rust frame takes no exception and has
/// nothing to clean up, so the search goes on to the callers' handlers and, with none, ends in 0x7E.
#[no_mangle]
pub extern "C" fn __CxxFrameHandler3(_record: usize, _frame: usize, _context: usize, _dispatcher: usize) -> i32 {
    1
}

// __chkstk: called in the prologue of a function whose frame exceeds a page, with the frame size in RAX. It must
// preserve every register but R10/R11 and touch each page from the caller's RSP down to RSP - RAX, so a stack
// overflow faults on the guard page in order instead of skipping it. It does not move RSP (x64 convention).
// Kernel stacks are not grown on demand: the probe only turns an overflow into an orderly fault.
core::arch::global_asm!(
    ".globl __chkstk",
    "__chkstk:",
    "    lea r10, [rsp + 8]",
    "    mov r11, rax",
    "2:",
    "    cmp r11, 0x1000",
    "    jb 3f",
    "    sub r10, 0x1000",
    "    test byte ptr [r10], 0",
    "    sub r11, 0x1000",
    "    jmp 2b",
    "3:",
    "    sub r10, r11",
    "    test byte ptr [r10], 0",
    "    ret",
);
