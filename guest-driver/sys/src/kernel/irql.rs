//! The IRQL as wdm.h's x64 inline routines move it: KeGetCurrentIrql reads CR8, KzRaiseIrql reads then writes it,
//! KzLowerIrql writes it (WDK 10 km/wdm.h: `(KIRQL)ReadCR8()`, `WriteCR8(NewIrql)`, ReadCR8/WriteCR8 being
//! `__readcr8`/`__writecr8`), so vhca.sys imports no IRQL routine and runs wherever a WDK-built driver does.
//!
//! Why inline and not the exports: wdm.h makes KeGetCurrentIrql inline on x64 in every build; KfRaiseIrql and
//! KeLowerIrql are ntoskrnl.exe exports for a Windows 8 or later target and these same CR8 inlines for an earlier
//! one or with NT_INLINE_IRQL, so this is the form every WDK build can take. In the Linux guest the loader traps and
//! emulates these instructions over the NT model (docs/loader.md).
//!
//! Each access is a compiler barrier (no `nomem`): memory touched under a raised IRQL must not move across the
//! change, as MSVC's intrinsics do not let it.

use core::arch::asm;

/// The current IRQL (wdm.h's KeGetCurrentIrql). Any IRQL.
pub fn current() -> u8 {
    let irql: u64;
    // SAFETY: reading CR8 has no effect on the machine; ring 0 (or the loader's emulation) allows it.
    unsafe { asm!("mov {}, cr8", out(reg) irql, options(nostack, preserves_flags)) };
    irql as u8
}

/// Raises to `new` (>= the current IRQL) and returns the IRQL raised from (wdm.h's KzRaiseIrql).
///
/// # Safety
/// As KeRaiseIrql: `new` is not below the current IRQL, and the caller lowers back with `lower`.
pub unsafe fn raise(new: u8) -> u8 {
    let old = current();
    // SAFETY: the caller's contract; CR8 takes the IRQL in its low four bits (x64 IRQLs are 0-15).
    unsafe { asm!("mov cr8, {}", in(reg) u64::from(new), options(nostack, preserves_flags)) };
    old
}

/// Lowers to `new` (<= the current IRQL), as wdm.h's KzLowerIrql.
///
/// # Safety
/// As KeLowerIrql: `new` is the IRQL the matching raise returned.
pub unsafe fn lower(new: u8) {
    // SAFETY: the caller's contract.
    unsafe { asm!("mov cr8, {}", in(reg) u64::from(new), options(nostack, preserves_flags)) };
}
