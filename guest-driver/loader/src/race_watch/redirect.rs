//! Running one trapped instruction through a watched block's second mapping (its alias) instead of opening the
//! block: the registers the instruction addresses the block through are moved by the distance between the two
//! mappings for that one instruction and moved back after it. The block's own pages stay inaccessible throughout,
//! so another processor's access to it in the same moment still traps (with the pages opened instead, it would be
//! missed; docs/verifier.md, "What a race report cannot see").
//!
//! Two halves, on either side of the first fault's hook:
//! - `decode` (in the hook, out of the signal handler: it allocates) reads the instruction with iced-x86 and keeps,
//!   for each memory operand, its addressing and which of its registers may be moved: one the instruction uses
//!   for nothing but addresses, or one it overwrites whole with a load (`mov rax, [rax]`: moved, not moved back).
//! - `Plan::shifts` (in the handler of the second fault, with the registers at hand) computes every operand's
//!   address, finds the ones in watched blocks and checks that the moves put exactly those operands in their
//!   aliases and leave every other operand where it was. An instruction that fails any of this is stepped with its
//!   block open, as before.

use iced_x86::{
    CodeSize, Decoder, DecoderOptions, Instruction, InstructionInfo, InstructionInfoFactory, OpAccess, OpKind, Register,
};

/// Memory operands one plan keeps (`push [mem]` has two: the operand and the stack; nothing has more than three).
const MAX_OPERANDS: usize = 3;
/// The longest x86 instruction.
pub(crate) const MAX_INSTRUCTION: usize = 15;

/// A general register by its index in the signal context's `gregs`.
pub(crate) type Greg = usize;

/// One memory operand: `base + index * scale + displacement`, `bytes` wide, and the register of it that may be
/// moved (with the divisor a move of it takes: the scale for an index) and whether it is moved back after.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Operand {
    base: Option<Greg>,
    index: Option<Greg>,
    scale: u64,
    displacement: u64,
    bytes: u64,
    movable: Option<Movable>,
    access: Access,
}

/// What an instruction does to one memory operand, as far as the race watch reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Access {
    #[default]
    Read,
    Write,
    /// A read then a write, with nothing between (`inc qword [rax]`).
    ReadWrite,
    /// A write that may not happen (cmpxchg's), or a read that may not: told only by running it.
    Conditional,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Movable {
    greg: Greg,
    number: u8,
    divisor: u64,
    restore: bool,
}

/// What `decode` found of one instruction: where it is and its memory operands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub rip: usize,
    operands: [Operand; MAX_OPERANDS],
    count: usize,
    /// The instruction's bytes (`len` of them).
    code: [u8; MAX_INSTRUCTION],
    len: usize,
    /// Whether a copy of it elsewhere means the same (out_of_line.rs): no RIP-relative operand, no control
    /// transfer, no implicit stack use, no string instruction, no conditional access.
    relocatable: bool,
}

impl Operand {
    /// Its address, given the registers and the moves made to them.
    fn address(&self, gregs: &[i64], moved: &Shifts) -> u64 {
        let value = |g: Option<Greg>| g.and_then(|g| gregs.get(g)).map_or(0, |v| *v as u64);
        let moved_by = |g: Option<Greg>| moved.iter().flatten().find(|s| Some(s.greg) == g).map_or(0, |s| s.amount);
        let base = value(self.base).wrapping_add(moved_by(self.base));
        let index = value(self.index).wrapping_add(moved_by(self.index));
        base.wrapping_add(index.wrapping_mul(self.scale)).wrapping_add(self.displacement)
    }

    const EMPTY: Operand =
        Operand { base: None, index: None, scale: 1, displacement: 0, bytes: 0, movable: None, access: Access::Read };
}

/// One register move for one stepped instruction: `amount` is added before it and, when `restore`, taken away
/// after it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(crate) struct Shift {
    pub greg: Greg,
    /// The register's hardware number (0 rax ... 15 r15), for a copy's lea.
    pub number: u8,
    pub amount: u64,
    pub restore: bool,
}

/// At most two registers move (`movs` addresses two blocks, through rsi and rdi).
pub(crate) type Shifts = [Option<Shift>; 2];

/// Where a watched block is, for `Plan::shifts`: the block holding `address` as (its first byte, its bytes, its
/// alias's first byte, 0 when it has none).
pub(crate) trait Aliases {
    fn alias_of(&self, address: u64) -> Option<(u64, u64, u64)>;
}

impl Plan {
    /// No instruction.
    pub const EMPTY: Plan = Plan {
        rip: 0,
        operands: [Operand::EMPTY; MAX_OPERANDS],
        count: 0,
        code: [0; MAX_INSTRUCTION],
        len: 0,
        relocatable: false,
    };

    /// The instruction's bytes, when a copy of it elsewhere means the same.
    pub fn relocatable_code(&self) -> Option<&[u8]> {
        self.relocatable.then(|| &self.code[..self.len])
    }

    /// What the instruction does at `address` (given its registers): the access of the operand whose bytes hold
    /// it, or None when none does.
    pub fn access_at(&self, gregs: &[i64], address: u64) -> Option<Access> {
        self.operands[..self.count]
            .iter()
            .find(|o| address.wrapping_sub(o.address(gregs, &[None; 2])) < o.bytes.max(1))
            .map(|o| o.access)
    }

    /// The moves that run this instruction through its blocks' aliases, given its registers (`gregs`); None when
    /// no operand is in an aliased block or the moves cannot be made exact.
    pub fn shifts(&self, gregs: &[i64], aliases: &impl Aliases) -> Option<Shifts> {
        let address = |o: &Operand, moved: &Shifts| o.address(gregs, moved);
        let operands = &self.operands[..self.count];
        let mut shifts: Shifts = [None; 2];
        // Where each operand must end up: its alias address, or where it is.
        let mut wanted = [0u64; MAX_OPERANDS];
        for (o, wanted) in operands.iter().zip(wanted.iter_mut()) {
            let at = address(o, &[None; 2]);
            *wanted = at;
            let Some((first, bytes, alias)) = aliases.alias_of(at) else { continue };
            if alias == 0 {
                // A watched block without an alias: this instruction steps with it open.
                return None;
            }
            if at.checked_add(o.bytes)? > first + bytes {
                return None;
            }
            let movable = o.movable?;
            let distance = alias.wrapping_sub(first);
            if distance % movable.divisor != 0 {
                return None;
            }
            let amount = distance / movable.divisor;
            let shift = Shift { greg: movable.greg, number: movable.number, amount, restore: movable.restore };
            *wanted = alias + (at - first);
            match shifts.iter().flatten().find(|s| s.greg == shift.greg) {
                Some(s) if *s == shift => {}
                Some(_) => return None,
                None => *shifts.iter_mut().find(|s| s.is_none())? = Some(shift),
            }
        }
        shifts[0]?;
        operands.iter().zip(wanted).all(|(o, wanted)| address(o, &shifts) == wanted).then_some(shifts)
    }
}

/// Reads the instruction at `rip` (`code`: its bytes, up to 15) into a plan; None for what the plan cannot
/// describe (an undecodable instruction, more operands than it keeps).
pub(crate) fn decode(rip: usize, code: &[u8], info: &mut InstructionInfoFactory) -> Option<Plan> {
    let mut decoder = Decoder::with_ip(64, &code[..code.len().min(MAX_INSTRUCTION)], rip as u64, DecoderOptions::NONE);
    let instruction = decoder.decode();
    if instruction.is_invalid() {
        return None;
    }
    let info = info.info(&instruction);
    let memory = info.used_memory();
    if memory.len() > MAX_OPERANDS {
        return None;
    }
    let mut plan = Plan { rip, count: memory.len(), len: instruction.len(), ..Plan::default() };
    plan.code[..instruction.len()].copy_from_slice(&code[..instruction.len()]);
    let stack = info.used_registers().iter().any(|u| matches!(u.register().full_register(), Register::RSP));
    let conditional =
        memory.iter().any(|m| matches!(m.access(), OpAccess::CondRead | OpAccess::CondWrite | OpAccess::ReadCondWrite));
    plan.relocatable = instruction.flow_control() == iced_x86::FlowControl::Next
        && !instruction.is_ip_rel_memory_operand()
        && !instruction.is_string_instruction()
        && !stack
        && !conditional;
    for (m, o) in memory.iter().zip(plan.operands.iter_mut()) {
        let plain = m.address_size() == CodeSize::Code64
            && m.vsib_size() == 0
            && !matches!(m.segment(), Register::FS | Register::GS);
        *o = Operand {
            base: greg(m.base()).map(|g| g.0),
            index: greg(m.index()).map(|g| g.0),
            scale: u64::from(m.scale().max(1)),
            displacement: m.displacement(),
            // A repeated string instruction's operands have no size of their own; each step moves one element.
            bytes: match m.memory_size().size() {
                0 => instruction.memory_size().size().max(1) as u64,
                n => n as u64,
            },
            movable: None,
            access: match m.access() {
                OpAccess::Read => Access::Read,
                OpAccess::Write => Access::Write,
                OpAccess::ReadWrite => Access::ReadWrite,
                _ => Access::Conditional,
            },
        };
        if !plain {
            // Its address cannot be computed from the general registers: never moved, and `shifts` fails if it
            // is the watched one (it is never in a block, which no segment or VSIB addressing reaches here).
            o.base = None;
            o.index = None;
            o.displacement = u64::MAX;
            continue;
        }
        let uses = |g: Register| memory.iter().filter(|m| m.base() == g || m.index() == g).count();
        o.movable = [(m.base(), 1), (m.index(), u64::from(m.scale().max(1)))].into_iter().find_map(|(r, divisor)| {
            let (greg, number) = greg(r)?;
            movable(&instruction, info, r, uses(r)).map(|restore| Movable { greg, number, divisor, restore })
        });
    }
    Some(plan)
}

/// Whether `register` (an address register of `address_uses` memory operands) may be moved for one instruction,
/// and if so whether it is moved back after (false: the instruction overwrites it whole).
fn movable(instruction: &Instruction, info: &InstructionInfo, register: Register, address_uses: usize) -> Option<bool> {
    if instruction.has_rep_prefix() || instruction.has_repne_prefix() {
        // A repeated string instruction may run on past the block's end in one step: stepped with the block open.
        return None;
    }
    if instruction.is_string_instruction() && matches!(register, Register::RSI | Register::RDI) {
        // movs/stos/lods/cmps/scas step rsi and rdi by the element: a moved one steps from the alias and is moved
        // back with its step, which does not depend on where it points.
        return Some(true);
    }
    let mut restore = true;
    let mut explicit = (0..instruction.op_count())
        .filter(|k| instruction.op_kind(*k) == OpKind::Register)
        .map(|k| (instruction.op_register(k), info.op_access(k)))
        .filter(|(r, _)| r.full_register() == register);
    match (explicit.next(), explicit.next()) {
        (None, _) => {}
        // A load into the whole register (a 32-bit write clears the upper half): what it held no longer matters.
        (Some((r, OpAccess::Write)), None) if r.size() >= 4 => restore = false,
        _ => return None,
    }
    let entries = || info.used_registers().iter().filter(|u| u.register().full_register() == register);
    let reads = entries().filter(|u| u.access() == OpAccess::Read).count();
    let writes = entries().filter(|u| u.access() == OpAccess::Write).count();
    let others = entries().count() - reads - writes;
    // Every read of it is an address's, and nothing uses it implicitly (cmpxchg's rax, cmpxchg16b's rbx).
    (reads == address_uses && writes == usize::from(!restore) && others == 0).then_some(restore)
}

/// A 64-bit general register's index in the signal context's `gregs` and its hardware number (rsp and rip are
/// never moved).
fn greg(register: Register) -> Option<(Greg, u8)> {
    let (index, number) = match register {
        Register::RAX => (libc::REG_RAX, 0),
        Register::RCX => (libc::REG_RCX, 1),
        Register::RDX => (libc::REG_RDX, 2),
        Register::RBX => (libc::REG_RBX, 3),
        Register::RBP => (libc::REG_RBP, 5),
        Register::RSI => (libc::REG_RSI, 6),
        Register::RDI => (libc::REG_RDI, 7),
        Register::R8 => (libc::REG_R8, 8),
        Register::R9 => (libc::REG_R9, 9),
        Register::R10 => (libc::REG_R10, 10),
        Register::R11 => (libc::REG_R11, 11),
        Register::R12 => (libc::REG_R12, 12),
        Register::R13 => (libc::REG_R13, 13),
        Register::R14 => (libc::REG_R14, 14),
        Register::R15 => (libc::REG_R15, 15),
        _ => return None,
    };
    Some((index as Greg, number))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two watched blocks: 0x10000 (two pages, alias 0x7000_0000) and 0x40000 (one page, alias 0x9000_0000).
    struct TwoBlocks;

    impl Aliases for TwoBlocks {
        fn alias_of(&self, address: u64) -> Option<(u64, u64, u64)> {
            [(0x10000, 0x2000, 0x7000_0000), (0x40000, 0x1000, 0x9000_0000)]
                .into_iter()
                .find(|(first, bytes, _)| (*first..first + bytes).contains(&address))
        }
    }

    fn regs(values: &[(i32, u64)]) -> Vec<i64> {
        let mut gregs = vec![0i64; 23];
        for (r, v) in values {
            gregs[*r as usize] = *v as i64;
        }
        gregs
    }

    fn plan(code: &[u8]) -> Plan {
        decode(0x1000, code, &mut InstructionInfoFactory::new()).expect("decodes")
    }

    fn shift(r: i32, amount: u64, restore: bool) -> Option<Shift> {
        let number = match r {
            libc::REG_RAX => 0,
            libc::REG_RCX => 1,
            libc::REG_RBX => 3,
            libc::REG_RSI => 6,
            libc::REG_RDI => 7,
            _ => panic!("no number for {r}"),
        };
        Some(Shift { greg: r as Greg, number, amount, restore })
    }

    const TO_FIRST: u64 = 0x7000_0000 - 0x10000;
    const TO_SECOND: u64 = 0x9000_0000 - 0x40000;

    #[test]
    fn an_address_register_moves_and_moves_back() {
        // mov [rcx], rdx
        let p = plan(&[0x48, 0x89, 0x11]);
        let gregs = regs(&[(libc::REG_RCX, 0x10008), (libc::REG_RDX, 0x10008)]);
        assert_eq!(p.shifts(&gregs, &TwoBlocks), Some([shift(libc::REG_RCX, TO_FIRST, true), None]));
        // Outside every block: nothing to move.
        let outside = regs(&[(libc::REG_RCX, 0x30000)]);
        assert_eq!(p.shifts(&outside, &TwoBlocks), None);
    }

    #[test]
    fn a_load_over_its_own_address_register_is_not_moved_back() {
        // mov rax, [rax]; mov eax, [rax]
        for code in [&[0x48, 0x8b, 0x00][..], &[0x8b, 0x00]] {
            let gregs = regs(&[(libc::REG_RAX, 0x11ff0)]);
            assert_eq!(plan(code).shifts(&gregs, &TwoBlocks), Some([shift(libc::REG_RAX, TO_FIRST, false), None]));
        }
    }

    #[test]
    fn a_register_the_instruction_also_reads_or_merges_stays() {
        for (name, code) in [
            ("mov [rax], rax", &[0x48, 0x89, 0x00][..]),
            ("add rax, [rax]", &[0x48, 0x03, 0x00]),
            ("mov al, [rax]", &[0x8a, 0x00]),
            ("lock cmpxchg [rax], rcx", &[0xf0, 0x48, 0x0f, 0xb1, 0x08]),
            ("rep movsb", &[0xf3, 0xa4]),
        ] {
            let gregs = regs(&[(libc::REG_RAX, 0x10010), (libc::REG_RSI, 0x10010), (libc::REG_RDI, 0x40010)]);
            assert_eq!(plan(code).shifts(&gregs, &TwoBlocks), None, "{name}");
        }
        // cmpxchg16b [rbx] compares with rcx:rbx: rbx is data too.
        let gregs = regs(&[(libc::REG_RBX, 0x10010)]);
        assert_eq!(plan(&[0x48, 0x0f, 0xc7, 0x0b]).shifts(&gregs, &TwoBlocks), None);
    }

    #[test]
    fn an_indexed_operand_moves_its_base_and_keeps_its_index() {
        // mov eax, [rbx+rcx*8+0x10]
        let gregs = regs(&[(libc::REG_RBX, 0x40000), (libc::REG_RCX, 2)]);
        let p = plan(&[0x8b, 0x44, 0xcb, 0x10]);
        assert_eq!(p.shifts(&gregs, &TwoBlocks), Some([shift(libc::REG_RBX, TO_SECOND, true), None]));
    }

    #[test]
    fn a_stack_operand_beside_it_stays_where_it_is() {
        // push qword [rax]
        let gregs = regs(&[(libc::REG_RAX, 0x10100), (libc::REG_RSP, 0x7fff_0000)]);
        assert_eq!(plan(&[0xff, 0x30]).shifts(&gregs, &TwoBlocks), Some([shift(libc::REG_RAX, TO_FIRST, true), None]));
    }

    #[test]
    fn a_string_move_between_two_blocks_moves_both_pointers() {
        // movsb: rsi in the first block, rdi in the second.
        let gregs = regs(&[(libc::REG_RSI, 0x10010), (libc::REG_RDI, 0x40010)]);
        let shifts = plan(&[0xa4]).shifts(&gregs, &TwoBlocks).expect("moves");
        let mut moved: Vec<Shift> = shifts.into_iter().flatten().collect();
        moved.sort_by_key(|s| s.greg);
        let mut expected =
            vec![shift(libc::REG_RSI, TO_FIRST, true).unwrap(), shift(libc::REG_RDI, TO_SECOND, true).unwrap()];
        expected.sort_by_key(|s| s.greg);
        assert_eq!(moved, expected);
    }

    #[test]
    fn an_access_past_its_blocks_end_is_not_moved() {
        // mov rax, [rax] with its last bytes past the one-page block at 0x40000.
        let gregs = regs(&[(libc::REG_RAX, 0x40ffc)]);
        assert_eq!(plan(&[0x48, 0x8b, 0x00]).shifts(&gregs, &TwoBlocks), None);
    }

    #[test]
    fn segment_relative_and_undecodable_code_are_left_alone() {
        // mov rax, gs:[0x20]: no general register to move, and no block reached.
        assert_eq!(plan(&[0x65, 0x48, 0x8b, 0x04, 0x25, 0x20, 0, 0, 0]).shifts(&regs(&[]), &TwoBlocks), None);
        assert_eq!(decode(0x1000, &[0x0f, 0xff], &mut InstructionInfoFactory::new()), None);
        assert_eq!(decode(0x1000, &[], &mut InstructionInfoFactory::new()), None);
    }
}
