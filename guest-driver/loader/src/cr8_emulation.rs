//! The IRQL behind the driver's own CR8 accesses (wdm.h's x64 KeGetCurrentIrql is `__readcr8`; KzRaiseIrql and
//! KzLowerIrql, which KfRaiseIrql/KeLowerIrql become where the WDK inlines them, are `__writecr8`): a read gives the
//! NT model's IRQL of the calling thread, a write moves it through the model exactly as the KfRaiseIrql/KeLowerIrql
//! thunks do, so the verifier's IRQL rules, IRQL checking's trim and the lock checks see it alike.
//!
//! Why a write leaves the signal handler first: lowering below DISPATCH_LEVEL runs the processor's queued DPCs
//! (driver code that traps again) and a rule may stop the machine; neither belongs inside a SIGSEGV handler, where
//! SIGSEGV is blocked and the stack is the 64 KiB alternate one. So the handler only redirects the thread into
//! `write_trampoline`, which runs the change on the driver's own stack, as a call of the import would, and returns
//! to the instruction after the `mov`. A read changes nothing and is answered in the handler.

use vhca_ntapi::{NtKernel, DISPATCH_LEVEL, HIGH_LEVEL};

use crate::privileged_instructions::{Cr8Access, Gpr};

/// The `ucontext_t` general register slot of x86 register `gpr`.
fn slot(gpr: Gpr) -> usize {
    let index = match gpr.0 {
        0 => libc::REG_RAX,
        1 => libc::REG_RCX,
        2 => libc::REG_RDX,
        3 => libc::REG_RBX,
        4 => libc::REG_RSP,
        5 => libc::REG_RBP,
        6 => libc::REG_RSI,
        7 => libc::REG_RDI,
        8 => libc::REG_R8,
        9 => libc::REG_R9,
        10 => libc::REG_R10,
        11 => libc::REG_R11,
        12 => libc::REG_R12,
        13 => libc::REG_R13,
        14 => libc::REG_R14,
        _ => libc::REG_R15,
    };
    index as usize
}

/// Why a CR8 access was not emulated: the caller gives it the verdict of an unemulated instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotEmulated {
    /// No kernel is installed: there is no IRQL to read or move.
    NoKernel,
    /// A write with bits above the TPR's four set, which #GP on the processor too (CR8 bits 63:4 are reserved).
    ReservedBits(u64),
}

/// Emulates `access`, trapped in driver code, on the interrupted context: a read writes the IRQL into its register
/// and steps past the instruction; a write sends the thread through `write_trampoline` with the new IRQL.
///
/// # Safety
/// `context` is the ucontext of a SIGSEGV raised by `access` at its RIP in driver code (Windows x64 code, which
/// keeps nothing below its stack pointer, so the two words pushed there are free).
pub unsafe fn emulate(access: Cr8Access, context: &mut libc::ucontext_t) -> Result<(), NotEmulated> {
    let Some(k) = crate::kernel_context::installed() else { return Err(NotEmulated::NoKernel) };
    let gregs = &mut context.uc_mcontext.gregs;
    let rip = gregs[libc::REG_RIP as usize] as u64;
    let next = rip + u64::from(access.length());
    match access {
        Cr8Access::Read { to, .. } => {
            gregs[slot(to)] = i64::from(k.model.KeGetCurrentIrql());
            gregs[libc::REG_RIP as usize] = next as i64;
        }
        Cr8Access::Write { from, .. } => {
            let value = gregs[slot(from)] as u64;
            if value > u64::from(HIGH_LEVEL) {
                return Err(NotEmulated::ReservedBits(value));
            }
            let rsp = gregs[libc::REG_RSP as usize] as u64;
            let frame = (rsp - 16) as *mut u64;
            // SAFETY: the driver's stack below its stack pointer (the caller's contract): [rsp-8] the address to
            // return to, [rsp-16] the new IRQL, as write_trampoline expects them.
            unsafe {
                frame.add(1).write(next);
                frame.write(value);
            }
            gregs[libc::REG_RSP as usize] = frame as i64;
            gregs[libc::REG_RIP as usize] = write_trampoline as *const () as usize as i64;
        }
    }
    Ok(())
}

/// The IRQL change of a `mov cr8`, run on the driver's thread and stack: up (or to the same level) as KfRaiseIrql's
/// thunk does it, with IRQL checking's trim at DISPATCH_LEVEL or above, down as KeLowerIrql's. wdm.h's inline
/// routines do not say which one they are (KzRaiseIrql and KzLowerIrql both end in `__writecr8`), so the direction
/// is read from the model's IRQL; a write of the current level trims again at DISPATCH_LEVEL or above, as a raise
/// to it would.
extern "C" fn write_irql(new: u64) {
    let k = crate::kernel_context::kernel();
    let new = new as u8;
    if new >= k.model.KeGetCurrentIrql() {
        k.model.KeRaiseIrql(new);
        if new >= DISPATCH_LEVEL {
            k.raised();
        }
    } else {
        k.model.KeLowerIrql(new);
    }
}

// Entered in place of the instruction after a trapped `mov cr8, reg` with [rsp] = the new IRQL and [rsp+8] = the
// address after the `mov`: the driver expects one instruction that changes no register or flag
// (register_saving.rs). The IRQL word is eleven pushes above rbp; it is dropped without touching the flags before
// the return past the `mov`.
crate::register_saving::saving_trampoline!(
    write_trampoline => write_irql,
    argument: ["mov rdi, [rbp + 88]"],
    ret: ["lea rsp, [rsp + 8]", "ret"]
);
