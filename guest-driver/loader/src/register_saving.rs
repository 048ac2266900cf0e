//! Two small stubs the loader puts between the binary and Rust code, shared by the places that need them.
//!
//! - `return_address_in_r9!`: an import address that puts the driver's return address (its call site) into the
//!   fourth argument register and jumps on, for routines that take three arguments and want to know who called
//!   (the pool routines' Code integrity P2, the CRT routines' race-watch sites). r9 is volatile in the Windows x64
//!   convention, so the driver expects nothing of it.
//! - `saving_trampoline!`: a routine entered in place of a trapped instruction (a CR8 write, a watched access),
//!   outside the signal handler that redirected to it, which calls a System V hook and returns with every register
//!   and flag as the interrupted code left them. It saves what the hook may change: the volatile general registers,
//!   the flags, and the x87/SSE state with fxsave (the loader is built for baseline x86-64 and a kernel driver uses
//!   no AVX state without saving it itself, so the upper halves of the vector registers are not saved). Each use
//!   says how the hook's argument is found (instructions run with rbp = the saved registers' base, eleven words
//!   below the word the redirect pushed) and how it returns (`ret` past its pushed words).

/// `return_address_in_r9!(import => entry)`: see the module's note.
macro_rules! return_address_in_r9 {
    ($import:ident => $entry:path) => {
        #[unsafe(naked)]
        unsafe extern "win64" fn $import() {
            core::arch::naked_asm!("mov r9, [rsp]", "jmp {entry}", entry = sym $entry);
        }
    };
}
pub(crate) use return_address_in_r9;

/// `saving_trampoline!(name => hook, argument: [instructions], ret: [instructions])`: see the module's note.
macro_rules! saving_trampoline {
    ($name:ident => $hook:path, argument: [$($argument:literal),*], ret: [$($ret:literal),+]) => {
        #[unsafe(naked)]
        unsafe extern "C" fn $name() {
            core::arch::naked_asm!(
                "pushfq",
                "push rax",
                "push rcx",
                "push rdx",
                "push rsi",
                "push rdi",
                "push r8",
                "push r9",
                "push r10",
                "push r11",
                "push rbp",
                "mov rbp, rsp",
                // SysV wants the direction flag clear at a call; the interrupted code's own is restored with the
                // flags.
                "cld",
                $($argument,)*
                "and rsp, -16",
                "sub rsp, 512",
                "fxsave64 [rsp]",
                "call {hook}",
                "fxrstor64 [rsp]",
                "mov rsp, rbp",
                "pop rbp",
                "pop r11",
                "pop r10",
                "pop r9",
                "pop r8",
                "pop rdi",
                "pop rsi",
                "pop rdx",
                "pop rcx",
                "pop rax",
                "popfq",
                $($ret),+,
                hook = sym $hook,
            )
        }
    };
}
pub(crate) use saving_trampoline;
