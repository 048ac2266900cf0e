//! Where exceptions start: a thunk that raises (MmProbeAndLockPages' failure, ExRaiseStatus, RtlRaiseStatus)
//! through an entry stub that keeps the driver's registers at its call, and an access violation in driver code,
//! which the fault handler hands over with the signal's registers. Both then dispatch on the driver's stack.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::cell::RefCell;

use windows_sys::Win32::System::Diagnostics::Debug::EXCEPTION_RECORD;

use super::context_record::{exception_record, EXCEPTION_NONCONTINUABLE, STATUS_ACCESS_VIOLATION};
use super::dispatch;
use super::virtual_unwind::Registers;
use crate::driver_stack::EntryRegisters;

/// What a raising entry stub saved: the driver's XMM6-15 (nonvolatile, and a Rust thunk may have used them before
/// it raises), then the registers `site_entry` saves.
#[repr(C)]
pub struct RaiseFrame {
    xmm: [u128; 10],
    _pad: u64,
    entry: EntryRegisters,
}

/// Defines `$entry` for a thunk that may raise: as `site_entry!` it records the driver's call site, then calls
/// `$thunk` (which returns the status to raise, 0 for none) and returns to the driver, or raises with the
/// driver's registers as they were at its call (the raise point is the return address, as RtlRaiseException's
/// caller is).
macro_rules! raising_entry {
    ($entry:ident => $thunk:path) => {
        #[unsafe(naked)]
        pub(crate) unsafe extern "win64" fn $entry() {
            core::arch::naked_asm!(
                // At entry rsp = 8 (mod 16), [rsp] = the driver's return address.
                "push rcx", "push rdx", "push r8", "push r9",
                "push r15", "push r14", "push r13", "push r12", "push rdi", "push rsi", "push rbp", "push rbx",
                // XMM6-15 and an alignment word below the EntryRegisters: rsp = 0 (mod 16).
                "sub rsp, 0xA8",
                "movaps [rsp + 0x00], xmm6", "movaps [rsp + 0x10], xmm7", "movaps [rsp + 0x20], xmm8",
                "movaps [rsp + 0x30], xmm9", "movaps [rsp + 0x40], xmm10", "movaps [rsp + 0x50], xmm11",
                "movaps [rsp + 0x60], xmm12", "movaps [rsp + 0x70], xmm13", "movaps [rsp + 0x80], xmm14",
                "movaps [rsp + 0x90], xmm15",
                "sub rsp, 0x20",
                "lea rcx, [rsp + 0xC8]",
                "call {capture}",
                "mov r9, [rsp + 0xC8 + 64]", "mov r8, [rsp + 0xC8 + 72]",
                "mov rdx, [rsp + 0xC8 + 80]", "mov rcx, [rsp + 0xC8 + 88]",
                "call {thunk}",
                "test eax, eax",
                "jnz 2f",
                // The thunk is win64: the nonvolatile registers are the driver's still.
                "add rsp, 0x20 + 0xA8 + 12 * 8",
                "ret",
                "2:",
                "mov ecx, eax",
                "lea rdx, [rsp + 0x20]",
                "call {raise}",
                "ud2",
                capture = sym $crate::driver_stack::capture,
                thunk = sym $thunk,
                raise = sym $crate::seh::raise::raise_from_entry,
            )
        }
    };
}
pub(crate) use raising_entry;

/// Raises `status` (noncontinuable, as RtlRaiseStatus does) with the driver's registers `frame` kept at its call.
///
/// # Safety
/// `frame` is the block a raising entry stub saved on this thread's stack.
pub unsafe extern "win64" fn raise_from_entry(status: u32, frame: *const RaiseFrame) -> ! {
    // SAFETY: the caller's contract.
    let frame = unsafe { &*frame };
    let e = &frame.entry;
    let mut at = Registers { rip: e.return_address, eflags: 0x202, mxcsr: 0x1F80, ..Default::default() };
    for (index, value) in
        [(3, e.rbx), (5, e.rbp), (6, e.rsi), (7, e.rdi), (12, e.r12), (13, e.r13), (14, e.r14), (15, e.r15)]
    {
        at.gpr[index] = value;
    }
    // The driver's RSP after its call returns: one word above the return address.
    at.gpr[4] = std::ptr::addr_of!(e.return_address) as u64 + 8;
    at.xmm[6..].copy_from_slice(&frame.xmm);
    let mut record = exception_record(status, EXCEPTION_NONCONTINUABLE, e.return_address, &[]);
    dispatch::dispatch_or_stop(&mut record, at)
}

/// ExRaiseStatus(Status) and RtlRaiseStatus(Status): the status raised as a noncontinuable exception.
extern "win64" fn raise_status(status: i32) -> u32 {
    status as u32
}

raising_entry!(ExRaiseStatus_entry => raise_status);

/// An access violation in driver code, handed over by the fault handler: what to dispatch, and what to stop with
/// (its line and 0x7E's parameters, as before there was a dispatch) when no frame takes it.
struct HandedOver {
    record: EXCEPTION_RECORD,
    at: Registers,
    line: String,
    bugcheck: (u32, [u64; 4]),
}

thread_local! {
    static HANDED_OVER: RefCell<Option<HandedOver>> = const { RefCell::new(None) };
}

/// Turns the access violation this signal reports (at `address`, a write if `write`) into an exception the
/// driver's frames can take: the signal returns into `dispatch_handed_over` on the driver's stack below the
/// faulting frame, so the dispatch and any handler run outside the signal handler, with the signal mask restored.
///
/// # Safety
/// `context` is this SIGSEGV's, its RIP in the driver's image.
pub unsafe fn hand_over_fault(
    context: &mut libc::ucontext_t,
    address: u64,
    write: bool,
    line: String,
    bugcheck: (u32, [u64; 4]),
) {
    let g = &context.uc_mcontext.gregs;
    let gpr = [
        libc::REG_RAX,
        libc::REG_RCX,
        libc::REG_RDX,
        libc::REG_RBX,
        libc::REG_RSP,
        libc::REG_RBP,
        libc::REG_RSI,
        libc::REG_RDI,
        libc::REG_R8,
        libc::REG_R9,
        libc::REG_R10,
        libc::REG_R11,
        libc::REG_R12,
        libc::REG_R13,
        libc::REG_R14,
        libc::REG_R15,
    ]
    .map(|r| g[r as usize] as u64);
    let rip = g[libc::REG_RIP as usize] as u64;
    let mut at = Registers { gpr, rip, eflags: g[libc::REG_EFL as usize] as u32, mxcsr: 0x1F80, ..Default::default() };
    // SAFETY: the kernel's saved FPU state of this signal, when it gave one.
    if let Some(fp) = unsafe { context.uc_mcontext.fpregs.as_ref() } {
        at.mxcsr = fp.mxcsr;
        for (slot, xmm) in at.xmm.iter_mut().zip(fp._xmm.iter()) {
            let e = xmm.element;
            *slot = u128::from(e[0]) | u128::from(e[1]) << 32 | u128::from(e[2]) << 64 | u128::from(e[3]) << 96;
        }
    }
    let record = exception_record(STATUS_ACCESS_VIOLATION, 0, rip, &[u64::from(write), address]);
    HANDED_OVER.with(|h| *h.borrow_mut() = Some(HandedOver { record, at, line, bugcheck }));
    // Below the faulting frame, 16-aligned as at a call's target minus the return address.
    let rsp = (gpr[4] - 0x100) & !0xF;
    context.uc_mcontext.gregs[libc::REG_RSP as usize] = rsp as i64;
    context.uc_mcontext.gregs[libc::REG_RIP as usize] = dispatch_entry as *const () as usize as i64;
}

#[unsafe(naked)]
unsafe extern "sysv64" fn dispatch_entry() -> ! {
    core::arch::naked_asm!("call {dispatch}", "ud2", dispatch = sym dispatch_handed_over)
}

extern "sysv64" fn dispatch_handed_over() -> ! {
    let Some(mut fault) = HANDED_OVER.with(|h| h.borrow_mut().take()) else {
        crate::kernel_context::bugcheck(crate::driver_fault::SYSTEM_THREAD_EXCEPTION_NOT_HANDLED, 0, 0, 0, 0)
    };
    dispatch::dispatch(&mut fault.record, fault.at);
    println!("{}", fault.line);
    let (code, [p1, p2, p3, p4]) = fault.bugcheck;
    crate::kernel_context::bugcheck(code, p1, p2, p3, p4)
}

/// The exception routines' import addresses (ntoskrnl.exe).
pub fn seh_thunks() -> [(&'static str, usize); 3] {
    [
        ("ExRaiseStatus", ExRaiseStatus_entry as *const () as usize),
        ("RtlRaiseStatus", ExRaiseStatus_entry as *const () as usize),
        ("__C_specific_handler", super::c_specific_handler::__C_specific_handler as *const () as usize),
    ]
}
