//! Which privileged instruction the driver executed where a general-protection trap stopped it: `mov` to or from
//! CR8 (the IRQL, which the loader emulates: `cr8_emulation`) with its register and length, or another one a
//! kernel driver may issue, named for its verdict. A decoder of those few encodings only, not of x86.
//!
//! Why so few: a driver runs at ring 0 on Windows, so any of these works there; in the loader's user process each
//! one raises #GP, which Linux delivers as SIGSEGV with si_code SI_KERNEL (checked on this host: `mov cr8, rax` in
//! user mode on Linux 6.18, AMD EPYC). CR8 is the only one a WDK-built WDM driver needs for its own logic (wdm.h's
//! x64 KeGetCurrentIrql is `__readcr8`, and KzRaiseIrql/KzLowerIrql are `__writecr8` where the WDK inlines them);
//! the rest have no meaning over the NT model and stop the run naming the instruction (docs/loader.md).

use std::fmt;

/// STATUS_PRIVILEGED_INSTRUCTION: what Windows raises for a privileged instruction where it is not allowed. The
/// loader stops a driver on an instruction it does not emulate as an unhandled exception of that code in a system
/// thread (0x7E, P1 the code, P2 the instruction): the model's choice, since on Windows the driver would be at ring
/// 0 and the instruction would run.
pub const STATUS_PRIVILEGED_INSTRUCTION: u64 = 0xC000_0096;

/// A general-purpose register by its x86 number (0 rax, 1 rcx, ... 4 rsp, ... 8 r8 ... 15 r15).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpr(pub u8);

/// A trapped `mov` to or from CR8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cr8Access {
    /// `mov r64, cr8`: the IRQL into `to` (zero-extended: the move is always 64 bits in long mode).
    Read { to: Gpr, length: u8 },
    /// `mov cr8, r64`: the IRQL from `from`.
    Write { from: Gpr, length: u8 },
}

impl Cr8Access {
    pub fn length(self) -> u8 {
        match self {
            Cr8Access::Read { length, .. } | Cr8Access::Write { length, .. } => length,
        }
    }
}

/// An instruction the loader does not emulate, named as a disassembler would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unemulated {
    /// `mov` to (`write`) or from a control register other than CR8.
    ControlRegister { number: u8, write: bool },
    /// `mov` to or from a debug register.
    DebugRegister { number: u8, write: bool },
    /// `int n` (NT_ASSERT's `int 0x2c`, __fastfail's `int 0x29`, ...): the IDT's gates refuse ring 3.
    Interrupt(u8),
    /// A privileged instruction without operands worth naming.
    Named(&'static str),
}

impl fmt::Display for Unemulated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Unemulated::ControlRegister { number, write: true } => write!(f, "mov cr{number}, reg"),
            Unemulated::ControlRegister { number, write: false } => write!(f, "mov reg, cr{number}"),
            Unemulated::DebugRegister { number, write: true } => write!(f, "mov dr{number}, reg"),
            Unemulated::DebugRegister { number, write: false } => write!(f, "mov reg, dr{number}"),
            Unemulated::Interrupt(vector) => write!(f, "int {vector:#x}"),
            Unemulated::Named(name) => f.write_str(name),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Privileged {
    Cr8(Cr8Access),
    Unemulated(Unemulated),
}

/// Decodes the instruction whose bytes `byte(i)` gives. Reads a byte only when the bytes before it say the
/// instruction goes on, so a caller that hands in a trapped instruction never reads past it (the processor fetched
/// all of it before it raised #GP). None: not one of the instructions below (the trap was something else, such as
/// a non-canonical address).
pub fn decode(byte: impl Fn(usize) -> u8) -> Option<Privileged> {
    let first = byte(0);
    // One REX prefix at most (compilers emit one; with several only the last counts, which this does not model).
    let (rex, at) = if (0x40..=0x4F).contains(&first) { (first, 1) } else { (0, 0) };
    let rex_r = (rex >> 2) & 1;
    let rex_b = rex & 1;
    let named = |name| Some(Privileged::Unemulated(Unemulated::Named(name)));
    match byte(at) {
        0xFA => named("cli"),
        0xFB => named("sti"),
        0xF4 => named("hlt"),
        0xE4..=0xE7 | 0xEC..=0xEF => named(if byte(at) & 0x2 == 0 { "in" } else { "out" }),
        0x6C | 0x6D => named("ins"),
        0x6E | 0x6F => named("outs"),
        0xCD => Some(Privileged::Unemulated(Unemulated::Interrupt(byte(at + 1)))),
        0x0F => match byte(at + 1) {
            opcode @ (0x20..=0x23) => {
                // The ModRM's mod bits are ignored for moves to and from control and debug registers (Intel SDM
                // vol. 2, MOV—Move to/from Control Registers): r/m is always a general register.
                let modrm = byte(at + 2);
                let number = ((modrm >> 3) & 7) | (rex_r << 3);
                let gpr = Gpr((modrm & 7) | (rex_b << 3));
                let write = opcode & 0x2 != 0;
                let length = at as u8 + 3;
                Some(match (opcode, number) {
                    (0x20, 8) => Privileged::Cr8(Cr8Access::Read { to: gpr, length }),
                    (0x22, 8) => Privileged::Cr8(Cr8Access::Write { from: gpr, length }),
                    (0x20 | 0x22, _) => Privileged::Unemulated(Unemulated::ControlRegister { number, write }),
                    _ => Privileged::Unemulated(Unemulated::DebugRegister { number, write }),
                })
            }
            0x30 => named("wrmsr"),
            0x32 => named("rdmsr"),
            0x33 => named("rdpmc"),
            0x06 => named("clts"),
            0x08 => named("invd"),
            0x09 => named("wbinvd"),
            0x00 => match (byte(at + 2) >> 3) & 7 {
                2 => named("lldt"),
                3 => named("ltr"),
                _ => None,
            },
            0x01 => {
                let modrm = byte(at + 2);
                match (modrm >> 6, (modrm >> 3) & 7, modrm & 7) {
                    (3, 7, 0) => named("swapgs"),
                    (3, 2, 1) => named("xsetbv"),
                    (3, _, _) => None,
                    (_, 2, _) => named("lgdt"),
                    (_, 3, _) => named("lidt"),
                    (_, 6, _) => named("lmsw"),
                    (_, 7, _) => named("invlpg"),
                    _ => None,
                }
            }
            _ => None,
        },
        _ => None,
    }
}

/// The bugcheck for an instruction the loader does not emulate at `rip`: 0x7E with STATUS_PRIVILEGED_INSTRUCTION.
pub fn unemulated_bugcheck(rip: u64) -> (u32, [u64; 4]) {
    (crate::driver_fault::SYSTEM_THREAD_EXCEPTION_NOT_HANDLED, [STATUS_PRIVILEGED_INSTRUCTION, rip, 0, 0])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_bytes(bytes: &[u8]) -> Option<Privileged> {
        // Reading past the bytes given is a decoder bug (it would read past a trapped instruction).
        decode(|i| *bytes.get(i).unwrap_or_else(|| panic!("read byte {i} past {bytes:02x?}")))
    }

    #[test]
    fn every_register_form_of_mov_cr8_the_compiler_emits() {
        // mov rax, cr8 / mov cr8, rax: REX.R names CR8.
        assert_eq!(
            decode_bytes(&[0x44, 0x0F, 0x20, 0xC0]),
            Some(Privileged::Cr8(Cr8Access::Read { to: Gpr(0), length: 4 }))
        );
        assert_eq!(
            decode_bytes(&[0x44, 0x0F, 0x22, 0xC1]),
            Some(Privileged::Cr8(Cr8Access::Write { from: Gpr(1), length: 4 }))
        );
        // REX.B for r8-r15, REX.W (which LLVM may set) ignored.
        assert_eq!(
            decode_bytes(&[0x45, 0x0F, 0x22, 0xC7]),
            Some(Privileged::Cr8(Cr8Access::Write { from: Gpr(15), length: 4 }))
        );
        assert_eq!(
            decode_bytes(&[0x4D, 0x0F, 0x20, 0xC1]),
            Some(Privileged::Cr8(Cr8Access::Read { to: Gpr(9), length: 4 }))
        );
        for register in 0..16u8 {
            let rex = 0x44 | (register >> 3);
            let modrm = 0xC0 | (register & 7);
            assert_eq!(
                decode_bytes(&[rex, 0x0F, 0x22, modrm]),
                Some(Privileged::Cr8(Cr8Access::Write { from: Gpr(register), length: 4 }))
            );
        }
    }

    #[test]
    fn other_control_registers_and_privileged_instructions_are_named_not_emulated() {
        let name = |bytes: &[u8]| match decode_bytes(bytes) {
            Some(Privileged::Unemulated(u)) => u.to_string(),
            other => panic!("{bytes:02x?}: {other:?}"),
        };
        assert_eq!(name(&[0x0F, 0x22, 0xD8]), "mov cr3, reg");
        assert_eq!(name(&[0x0F, 0x20, 0xC0]), "mov reg, cr0", "CR0 without REX.R, not CR8");
        assert_eq!(name(&[0x0F, 0x23, 0xF8]), "mov dr7, reg");
        assert_eq!(name(&[0xFA]), "cli");
        assert_eq!(name(&[0xFB]), "sti");
        assert_eq!(name(&[0x0F, 0x32]), "rdmsr");
        assert_eq!(name(&[0x0F, 0x30]), "wrmsr");
        assert_eq!(name(&[0xEE]), "out");
        assert_eq!(name(&[0xEC]), "in");
        assert_eq!(name(&[0xCD, 0x2C]), "int 0x2c");
        assert_eq!(name(&[0x0F, 0x01, 0xF8]), "swapgs");
        assert_eq!(name(&[0x0F, 0x01, 0x38]), "invlpg");
        assert_eq!(name(&[0xF4]), "hlt");
    }

    #[test]
    fn ordinary_instructions_are_not_privileged() {
        // mov rax, [rcx] (a non-canonical address also traps with SI_KERNEL), ret, cpuid.
        assert_eq!(decode_bytes(&[0x48, 0x8B, 0x01]), None);
        assert_eq!(decode_bytes(&[0xC3]), None);
        assert_eq!(decode_bytes(&[0x0F, 0xA2]), None);
    }
}
