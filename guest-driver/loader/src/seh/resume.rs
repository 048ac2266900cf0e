//! RtlRestoreContext's job for the dispatch: the driver's thread continues with exactly the registers given (its
//! handler's frame, or the faulting instruction again after a filter's CONTINUE_EXECUTION). The loader's frames
//! between the raise and that point are dropped without running destructors; they hold no lock (the dispatch
//! takes none across a handler call), and what they own is a few small records.

use std::cell::UnsafeCell;

use super::virtual_unwind::Registers;

/// The registers to resume with, in the order the restore reads them: gpr[16], rip, eflags (as a word), then
/// xmm0-15. Thread-local and off the stack: the restore writes below the target RSP, which may be where this
/// thread's current frames are.
#[repr(C, align(16))]
struct ResumeBlock {
    gpr: [u64; 16],
    rip: u64,
    eflags: u64,
    xmm: [u128; 16],
}

thread_local! {
    static BLOCK: UnsafeCell<ResumeBlock> = const {
        UnsafeCell::new(ResumeBlock { gpr: [0; 16], rip: 0, eflags: 0, xmm: [0; 16] })
    };
}

/// Continues the calling thread with `registers`. Never returns.
pub fn resume(registers: &Registers) -> ! {
    let block = BLOCK.with(|b| b.get());
    // SAFETY: this thread's own block, written before the restore reads it, with nothing else holding it.
    unsafe {
        (*block).gpr = registers.gpr;
        (*block).rip = registers.rip;
        // Only the status flags and DF are the driver's to set; IF and the rest stay as user mode has them.
        (*block).eflags = u64::from(registers.eflags & 0x0CD5) | 0x202;
        (*block).xmm = registers.xmm;
        restore(block)
    }
}

/// Loads every register from `block` and jumps to its RIP with its RSP: RIP and the flags are first stored just
/// below the target RSP (free stack in the Windows x64 convention, which has no red zone) and popped from there.
#[unsafe(naked)]
unsafe extern "sysv64" fn restore(block: *const ResumeBlock) -> ! {
    core::arch::naked_asm!(
        "mov rax, [rdi + 4*8]",
        "sub rax, 16",
        "mov rdx, [rdi + 16*8]",
        "mov [rax + 8], rdx",
        "mov rdx, [rdi + 17*8]",
        "mov [rax], rdx",
        "movaps xmm0, [rdi + 18*8 + 0*16]",
        "movaps xmm1, [rdi + 18*8 + 1*16]",
        "movaps xmm2, [rdi + 18*8 + 2*16]",
        "movaps xmm3, [rdi + 18*8 + 3*16]",
        "movaps xmm4, [rdi + 18*8 + 4*16]",
        "movaps xmm5, [rdi + 18*8 + 5*16]",
        "movaps xmm6, [rdi + 18*8 + 6*16]",
        "movaps xmm7, [rdi + 18*8 + 7*16]",
        "movaps xmm8, [rdi + 18*8 + 8*16]",
        "movaps xmm9, [rdi + 18*8 + 9*16]",
        "movaps xmm10, [rdi + 18*8 + 10*16]",
        "movaps xmm11, [rdi + 18*8 + 11*16]",
        "movaps xmm12, [rdi + 18*8 + 12*16]",
        "movaps xmm13, [rdi + 18*8 + 13*16]",
        "movaps xmm14, [rdi + 18*8 + 14*16]",
        "movaps xmm15, [rdi + 18*8 + 15*16]",
        "mov rcx, [rdi + 1*8]",
        "mov rdx, [rdi + 2*8]",
        "mov rbx, [rdi + 3*8]",
        "mov rbp, [rdi + 5*8]",
        "mov rsi, [rdi + 6*8]",
        "mov r8, [rdi + 8*8]",
        "mov r9, [rdi + 9*8]",
        "mov r10, [rdi + 10*8]",
        "mov r11, [rdi + 11*8]",
        "mov r12, [rdi + 12*8]",
        "mov r13, [rdi + 13*8]",
        "mov r14, [rdi + 14*8]",
        "mov r15, [rdi + 15*8]",
        "mov rsp, rax",
        "mov rax, [rdi + 0*8]",
        "mov rdi, [rdi + 7*8]",
        "popfq",
        "ret",
    )
}
