//! The Windows records a language handler reads: CONTEXT from the unwinder's registers and back, and the
//! EXCEPTION_RECORD of a raised status or an access violation (windows-sys's layouts, Windows x64's offsets).

use windows_sys::Win32::System::Diagnostics::Debug::{CONTEXT, EXCEPTION_RECORD};

use super::virtual_unwind::Registers;

/// CONTEXT_AMD64 | CONTROL | INTEGER | FLOATING_POINT (CONTEXT_FULL): what every record here holds.
const CONTEXT_FULL: u32 = 0x0010_000B;
/// EXCEPTION_NONCONTINUABLE: RtlRaiseStatus's exceptions cannot be continued.
pub const EXCEPTION_NONCONTINUABLE: u32 = 1;
/// The ExceptionFlags of an unwind (RtlUnwindEx sets them for the handlers it calls).
pub const EXCEPTION_UNWINDING: u32 = 2;
pub const EXCEPTION_TARGET_UNWIND: u32 = 0x20;
pub const STATUS_ACCESS_VIOLATION: u32 = 0xC000_0005;

/// Where CONTEXT keeps XMM0 (CONTEXT_0's XMM_SAVE_AREA32 view: 32 bytes of header, 128 of legacy registers).
const XMM0: usize = std::mem::offset_of!(CONTEXT, Anonymous) + 0xA0;
// Windows x64's CONTEXT: RAX at 0x78, RIP at 0xF8, XMM0 at 0x1A0, 1232 bytes.
const _: () = assert!(std::mem::offset_of!(CONTEXT, Rax) == 0x78 && std::mem::offset_of!(CONTEXT, Rip) == 0xF8);
const _: () = assert!(XMM0 == 0x1A0 && std::mem::size_of::<CONTEXT>() == 1232);

pub fn to_context(registers: &Registers) -> CONTEXT {
    // SAFETY: CONTEXT is plain data; all-zero is a valid value.
    let mut context: CONTEXT = unsafe { std::mem::zeroed() };
    context.ContextFlags = CONTEXT_FULL;
    context.EFlags = registers.eflags;
    context.MxCsr = registers.mxcsr;
    context.Rip = registers.rip;
    let gpr = [
        &mut context.Rax,
        &mut context.Rcx,
        &mut context.Rdx,
        &mut context.Rbx,
        &mut context.Rsp,
        &mut context.Rbp,
        &mut context.Rsi,
        &mut context.Rdi,
        &mut context.R8,
        &mut context.R9,
        &mut context.R10,
        &mut context.R11,
        &mut context.R12,
        &mut context.R13,
        &mut context.R14,
        &mut context.R15,
    ];
    for (slot, value) in gpr.into_iter().zip(registers.gpr) {
        *slot = value;
    }
    let base = &mut context as *mut CONTEXT as *mut u8;
    for (i, value) in registers.xmm.iter().enumerate() {
        // SAFETY: the sixteen 16-byte XMM slots from offset XMM0 lie inside CONTEXT (1232 bytes).
        unsafe { (base.add(XMM0 + 16 * i) as *mut u128).write_unaligned(*value) };
    }
    context
}

pub fn from_context(context: &CONTEXT) -> Registers {
    let gpr = [
        context.Rax,
        context.Rcx,
        context.Rdx,
        context.Rbx,
        context.Rsp,
        context.Rbp,
        context.Rsi,
        context.Rdi,
        context.R8,
        context.R9,
        context.R10,
        context.R11,
        context.R12,
        context.R13,
        context.R14,
        context.R15,
    ];
    let base = context as *const CONTEXT as *const u8;
    // SAFETY: as in to_context.
    let xmm = std::array::from_fn(|i| unsafe { (base.add(XMM0 + 16 * i) as *const u128).read_unaligned() });
    Registers { gpr, rip: context.Rip, xmm, eflags: context.EFlags, mxcsr: context.MxCsr }
}

/// The record of an exception raised with `code` at `address` (RtlRaiseStatus: noncontinuable, no parameters;
/// an access violation: continuable, with Windows' two parameters, 0 read / 1 write / 8 execute and the address).
pub fn exception_record(code: u32, flags: u32, address: u64, parameters: &[u64]) -> EXCEPTION_RECORD {
    // SAFETY: plain data; all-zero is a valid value.
    let mut record: EXCEPTION_RECORD = unsafe { std::mem::zeroed() };
    record.ExceptionCode = code as i32;
    record.ExceptionFlags = flags;
    record.ExceptionAddress = address as *mut core::ffi::c_void;
    record.NumberParameters = parameters.len().min(15) as u32;
    for (slot, value) in record.ExceptionInformation.iter_mut().zip(parameters) {
        *slot = *value as usize;
    }
    record
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_round_trip_through_context_at_windows_offsets() {
        let mut r = Registers { rip: 0x1234, eflags: 0x246, mxcsr: 0x1F80, ..Default::default() };
        for (i, g) in r.gpr.iter_mut().enumerate() {
            *g = 0x100 + i as u64;
        }
        r.xmm[6] = 0xAAAA_u128 << 64 | 0x5555;
        let context = to_context(&r);
        assert_eq!((context.Rbx, context.Rsp, context.R15), (0x103, 0x104, 0x10F));
        // SAFETY: reading the 16 bytes at Windows' offset of XMM6 in the record.
        let xmm6 =
            unsafe { ((&context as *const CONTEXT as *const u8).add(0x1A0 + 6 * 16) as *const u128).read_unaligned() };
        assert_eq!(xmm6, r.xmm[6]);
        assert_eq!(from_context(&context), r);
    }
}
