//! Copies of trapped instructions that run through a watched block's alias without the trap flag: one signal per
//! watched access (the fault) instead of three (the fault, the second fault, the single-step trap). A copy is
//!
//! ```text
//! lea r, [r + distance]      ; for each register `redirect.rs` moves (lea leaves the flags alone)
//! <the instruction>          ; now addressing the alias
//! lea r, [r - distance]      ; for each moved register the instruction did not overwrite
//! jmp [rip + 0]; dq next     ; back to the instruction after the original
//! ```
//!
//! and the hook's trampoline returns into it (its return slot rewritten) with every register as the fault left
//! them. Only instructions whose meaning does not depend on where they run are copied: no RIP-relative operand, no
//! control transfer, no implicit stack use, no string instruction, no conditional write (redirect.rs decides), and
//! only moves that fit lea's 32-bit displacement. Copies are kept per (instruction, moves), in executable pages
//! of their own that are written once and never freed: a copy may be running on another thread, and the same
//! instruction on the same block wants the same copy next time (rewriting code costs a retranslation under TCG).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use super::redirect::Shifts;

/// Bytes a copy may take: two leas (8 each), the instruction (15), two leas, the jump (6) and its target (8).
const SLOT: usize = 64;
/// Executable bytes mapped at a time for copies.
const CHUNK: usize = 64 * 1024;

struct Copies {
    by_instruction: HashMap<(usize, Shifts), usize>,
    /// The other way: each copy's first byte to the instruction it copies and its moves, for a fault inside it.
    by_copy: BTreeMap<usize, (usize, Shifts)>,
    /// Where the next copy goes, and where the current chunk ends.
    next: usize,
    end: usize,
}

static COPIES: Mutex<Option<Copies>> = Mutex::new(None);

/// The address of a copy of the instruction at `rip` (`code`, its bytes) with `shifts` applied around it, made now
/// if this is its first time; None when a move does not fit a displacement or no executable page can be had.
pub(crate) fn copy_of(rip: usize, code: &[u8], shifts: Shifts) -> Option<usize> {
    let mut copies = crate::lock(&COPIES);
    let copies = copies.get_or_insert_with(|| Copies {
        by_instruction: HashMap::new(),
        by_copy: BTreeMap::new(),
        next: 0,
        end: 0,
    });
    if let Some(at) = copies.by_instruction.get(&(rip, shifts)) {
        return Some(*at);
    }
    let bytes = encode(code, shifts, (rip + code.len()) as u64)?;
    if copies.next + SLOT > copies.end {
        // SAFETY: a fresh private anonymous mapping the kernel places; nothing else is affected.
        let chunk = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                CHUNK,
                libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if chunk == libc::MAP_FAILED {
            return None;
        }
        copies.next = chunk as usize;
        copies.end = chunk as usize + CHUNK;
    }
    let at = copies.next;
    // SAFETY: a slot of our own chunk that no copy uses yet (slots are handed out once).
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), at as *mut u8, bytes.len()) };
    copies.next += SLOT;
    copies.by_instruction.insert((rip, shifts), at);
    copies.by_copy.insert(at, (rip, shifts));
    Some(at)
}

/// The instruction a copy holding `address` runs, and the moves it makes before it: None when `address` is in no
/// copy. A fault's address inside a copy is its instruction's (its leas and its jump touch no memory), so the
/// registers at the fault are the instruction's own plus those moves. Called from the SIGSEGV handler: a lookup,
/// no allocation; the lock is never held by the faulting thread (it was running the copy).
pub(crate) fn original_of(address: usize) -> Option<(usize, Shifts)> {
    let copies = crate::lock(&COPIES);
    let (at, found) = copies.as_ref()?.by_copy.range(..=address).next_back()?;
    (address - at < SLOT).then_some(*found)
}

/// The copy's bytes: see the module's note.
fn encode(code: &[u8], shifts: Shifts, next: u64) -> Option<Vec<u8>> {
    let mut bytes = Vec::with_capacity(SLOT);
    for s in shifts.iter().flatten() {
        lea(&mut bytes, s.number, i32::try_from(s.amount as i64).ok()?);
    }
    bytes.extend_from_slice(code);
    for s in shifts.iter().flatten().filter(|s| s.restore) {
        lea(&mut bytes, s.number, i32::try_from((s.amount as i64).wrapping_neg()).ok()?);
    }
    bytes.extend_from_slice(&[0xFF, 0x25, 0, 0, 0, 0]);
    bytes.extend_from_slice(&next.to_le_bytes());
    (bytes.len() <= SLOT).then_some(bytes)
}

/// `lea r64, [r64 + disp32]` for hardware register `number` (0 rax ... 15 r15; never rsp).
fn lea(bytes: &mut Vec<u8>, number: u8, displacement: i32) {
    let high = number >> 3;
    bytes.extend_from_slice(&[0x48 | (high << 2) | high, 0x8D, 0x80 | ((number & 7) << 3) | (number & 7)]);
    if number & 7 == 4 {
        // r12 as a base needs a SIB byte: base r12, no index.
        bytes.push(0x24);
    }
    bytes.extend_from_slice(&displacement.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::super::redirect::Shift;
    use super::*;
    use iced_x86::{Decoder, DecoderOptions, Formatter, IntelFormatter};

    fn text(bytes: &[u8]) -> Vec<String> {
        let mut decoder = Decoder::with_ip(64, bytes, 0x1000, DecoderOptions::NONE);
        let mut formatter = IntelFormatter::new();
        let mut out = Vec::new();
        while decoder.can_decode() {
            let mut line = String::new();
            formatter.format(&decoder.decode(), &mut line);
            out.push(line);
        }
        out
    }

    fn shift(greg: i32, number: u8, amount: i64, restore: bool) -> Option<Shift> {
        Some(Shift { greg: greg as usize, number, amount: amount as u64, restore })
    }

    #[test]
    fn a_copy_moves_the_registers_runs_the_instruction_moves_them_back_and_jumps_home() {
        // mov rax, [rcx+8] through rcx, and r12's move for a second operand, not moved back.
        let shifts = [shift(libc::REG_RCX, 1, 0x1000, true), shift(libc::REG_R12, 12, -0x2000, false)];
        let bytes = encode(&[0x48, 0x8B, 0x41, 0x08], shifts, 0x1234_5678_9abc).expect("fits");
        assert_eq!(&bytes[bytes.len() - 8..], &0x1234_5678_9abcu64.to_le_bytes());
        let code = text(&bytes[..bytes.len() - 8]);
        assert_eq!(
            code,
            [
                "lea rcx,[rcx+1000h]",
                "lea r12,[r12-2000h]",
                "mov rax,[rcx+8]",
                "lea rcx,[rcx-1000h]",
                // Its target is the word right after it (the copy starts at 0x1000 here).
                "jmp qword ptr [1020h]",
            ]
        );
    }

    #[test]
    fn a_copy_leads_back_to_its_instruction_and_its_moves() {
        let shifts = [shift(libc::REG_RCX, 1, 0x1000, true), None];
        // mov rax, [rcx+8] at a made-up instruction address (the copy is never run here).
        let at = copy_of(0x5555_0000, &[0x48, 0x8B, 0x41, 0x08], shifts).expect("a copy");
        assert_eq!(original_of(at + 7), Some((0x5555_0000, shifts)), "its instruction, after one lea");
        assert_eq!(original_of(at), Some((0x5555_0000, shifts)));
        assert_eq!(original_of(at + SLOT), None, "past its slot (no second copy yet)");
        assert_eq!(original_of(at - 1), None, "before the first copy");
    }

    #[test]
    fn a_move_beyond_a_displacement_has_no_copy() {
        assert_eq!(encode(&[0x90], [shift(libc::REG_RAX, 0, 1 << 33, true), None], 0), None);
    }
}
