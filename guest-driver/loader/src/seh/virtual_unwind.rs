//! One frame of an x64 unwind, as RtlVirtualUnwind does it: from a function's registers at a point in its body (or
//! prolog), the caller's registers at its return address, the function's establisher frame, and its handler.
//! Stack reads stay inside the bounds given (the driver's thread stack), so a corrupt frame ends a walk, not the run.

use super::unwind_info::{RuntimeFunction, UnwindInfo, UnwindInfoError, UnwindOp, UNW_FLAG_CHAININFO};

const RSP: usize = 4;

/// The registers an unwind reads and restores: the sixteen general registers in unwind-code order (RAX, RCX, RDX,
/// RBX, RSP, RBP, RSI, RDI, R8-R15, which is CONTEXT's order too), RIP, the XMM registers, and the flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Registers {
    pub gpr: [u64; 16],
    pub rip: u64,
    pub xmm: [u128; 16],
    pub eflags: u32,
    pub mxcsr: u32,
}

/// Where a walk may read: [low, high) of the thread's stack.
#[derive(Clone, Copy, Debug)]
pub struct StackBounds {
    pub low: u64,
    pub high: u64,
}

impl StackBounds {
    fn read<T: Copy>(&self, address: u64) -> Result<T, UnwindError> {
        let size = std::mem::size_of::<T>() as u64;
        let end = address.checked_add(size).ok_or(UnwindError::OffStack(address))?;
        if address < self.low || end > self.high || address % 8 != 0 {
            return Err(UnwindError::OffStack(address));
        }
        // SAFETY: an aligned (to 8: T is u64 or u128, read unaligned) value inside the thread's mapped stack.
        Ok(unsafe { (address as *const T).read_unaligned() })
    }
}

/// Why a frame cannot be unwound: the walk stops there, as a dispatch that finds no handler.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum UnwindError {
    #[error(transparent)]
    Info(#[from] UnwindInfoError),
    #[error("the unwind info at RVA {0:#x} is outside the image")]
    InfoOutsideImage(u32),
    #[error("a frame's stack slot {0:#x} is outside the thread's stack")]
    OffStack(u64),
    #[error("more than 32 chained unwind infos")]
    ChainTooLong,
}

/// What one frame's unwind found besides the caller's registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    /// The function's frame as its handlers see it (EstablisherFrame): RSP after the prolog's allocations, or the
    /// frame register less its offset once the prolog has set it.
    pub establisher: u64,
    /// The primary UNWIND_INFO's flags and handler (RVA, data RVA); chained infos carry no handler.
    pub flags: u8,
    pub handler: Option<(u32, u32)>,
}

/// Unwinds `registers` (at `registers.rip`, in `function` of the image at `base`, read by RVA through `image`) to
/// the caller: afterwards `registers` holds the caller's registers at its return address.
pub fn unwind_frame<'a>(
    base: u64,
    function: RuntimeFunction,
    image: &impl Fn(u32) -> Option<&'a [u8]>,
    stack: StackBounds,
    registers: &mut Registers,
) -> Result<Frame, UnwindError> {
    let pc_offset = registers.rip.wrapping_sub(base + u64::from(function.begin));
    let info = read_info(image, function.unwind_info)?;
    let establisher = establisher_frame(&info, pc_offset, registers);
    let frame = Frame { establisher, flags: info.flags, handler: info.handler };
    let (mut info, mut pc_offset, mut chain) = (info, pc_offset, 0);
    loop {
        // A machine frame restores RIP and RSP itself; no return address to pop then.
        if apply_ops(&info, pc_offset, establisher, stack, registers)? {
            return Ok(frame);
        }
        let Some(next) = info.chained.filter(|_| info.flags & UNW_FLAG_CHAININFO != 0) else { break };
        chain += 1;
        if chain > 32 {
            return Err(UnwindError::ChainTooLong);
        }
        info = read_info(image, next.unwind_info)?;
        // The primary part runs in the chained function's body: its whole prolog has run.
        pc_offset = u64::MAX;
    }
    registers.rip = stack.read(registers.gpr[RSP])?;
    registers.gpr[RSP] += 8;
    Ok(frame)
}

fn read_info<'a>(image: &impl Fn(u32) -> Option<&'a [u8]>, rva: u32) -> Result<UnwindInfo, UnwindError> {
    let bytes = image(rva).ok_or(UnwindError::InfoOutsideImage(rva))?;
    Ok(UnwindInfo::parse_at(bytes, rva)?)
}

/// EstablisherFrame as RtlVirtualUnwind returns it: the frame register less 16 * its offset once the prolog's
/// UWOP_SET_FPREG has run, RSP otherwise.
fn establisher_frame(info: &UnwindInfo, pc_offset: u64, registers: &Registers) -> u64 {
    let frame_set = info.frame_register != 0
        && info.ops.iter().any(|(at, op)| *op == UnwindOp::SetFramePointer && u64::from(*at) <= pc_offset);
    if frame_set {
        registers.gpr[info.frame_register as usize].wrapping_sub(16 * u64::from(info.frame_offset))
    } else {
        registers.gpr[RSP]
    }
}

/// Undoes the prolog operations of `info` that have run at `pc_offset`, innermost first; true when a machine frame
/// restored RIP and RSP.
fn apply_ops(
    info: &UnwindInfo,
    pc_offset: u64,
    establisher: u64,
    stack: StackBounds,
    registers: &mut Registers,
) -> Result<bool, UnwindError> {
    for &(at, op) in &info.ops {
        // An operation takes effect once the instruction ending at its offset has run.
        if pc_offset < u64::from(at) && pc_offset < u64::from(info.prolog_size) {
            continue;
        }
        let rsp = registers.gpr[RSP];
        match op {
            UnwindOp::PushNonvolatile(register) => {
                registers.gpr[register as usize] = stack.read(rsp)?;
                registers.gpr[RSP] = rsp + 8;
            }
            UnwindOp::Alloc(bytes) => registers.gpr[RSP] = rsp + u64::from(bytes),
            UnwindOp::SetFramePointer => {
                registers.gpr[RSP] =
                    registers.gpr[info.frame_register as usize].wrapping_sub(16 * u64::from(info.frame_offset));
            }
            UnwindOp::SaveNonvolatile(register, offset) => {
                registers.gpr[register as usize] = stack.read(establisher + u64::from(offset))?;
            }
            UnwindOp::SaveXmm(register, offset) => {
                registers.xmm[register as usize] = stack.read(establisher + u64::from(offset))?;
            }
            UnwindOp::PushMachineFrame { error_code } => {
                let frame = rsp + if error_code { 8 } else { 0 };
                registers.rip = stack.read(frame)?;
                registers.gpr[RSP] = stack.read(frame + 24)?;
                return Ok(true);
            }
            UnwindOp::Epilog => {}
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0x1_4000_0000;

    /// A fake stack of words at real addresses, and its bounds.
    fn stack(words: &[u64]) -> (Box<[u64]>, StackBounds) {
        let stack: Box<[u64]> = words.into();
        let low = stack.as_ptr() as u64;
        (stack, StackBounds { low, high: low + 8 * words.len() as u64 })
    }

    fn image(infos: &'static [(u32, &'static [u8])]) -> impl Fn(u32) -> Option<&'static [u8]> {
        move |rva| infos.iter().find(|(at, _)| *at == rva).map(|(_, bytes)| *bytes)
    }

    // push rbp (1); push rsi (2); sub rsp,0x20 (6); lea rbp,[rsp+0x10] (11); frame RBP offset 1; EHANDLER 0x1500.
    const FRAMED: &[u8] =
        &[0x09, 0x0B, 0x04, 0x15, 0x0B, 0x03, 0x06, 0x32, 0x02, 0x60, 0x01, 0x50, 0x00, 0x15, 0x00, 0x00];

    #[test]
    fn a_framed_function_in_its_body_unwinds_through_its_frame_register() {
        // The frame at body: [rsp..+0x20) locals, then saved rsi, saved rbp, return address.
        let (s, bounds) = stack(&[0, 0, 0, 0, 0x5151, 0xBBBB, BASE + 0x2222, 0]);
        let rsp = bounds.low;
        let mut r = Registers { rip: BASE + 0x1020, ..Default::default() };
        r.gpr[RSP] = rsp;
        r.gpr[5] = rsp + 0x10; // rbp
        let function = RuntimeFunction { begin: 0x1000, end: 0x1040, unwind_info: 0x3000 };
        let frame = unwind_frame(BASE, function, &image(&[(0x3000, FRAMED)]), bounds, &mut r).unwrap();
        assert_eq!(frame.establisher, rsp, "rbp - 16 * 1");
        assert_eq!(frame.handler, Some((0x1500, 0x3000 + 16)));
        assert_eq!((r.gpr[6], r.gpr[5], r.rip, r.gpr[RSP]), (0x5151, 0xBBBB, BASE + 0x2222, rsp + 0x38));
        drop(s);
    }

    #[test]
    fn in_the_prolog_only_the_operations_that_ran_are_undone() {
        // After push rbp; push rsi (offset 2): the stack holds rsi, rbp, the return address.
        let (s, bounds) = stack(&[0x5151, 0xBBBB, BASE + 0x2222]);
        let mut r = Registers { rip: BASE + 0x1002, ..Default::default() };
        r.gpr[RSP] = bounds.low;
        let function = RuntimeFunction { begin: 0x1000, end: 0x1040, unwind_info: 0x3000 };
        let frame = unwind_frame(BASE, function, &image(&[(0x3000, FRAMED)]), bounds, &mut r).unwrap();
        assert_eq!(frame.establisher, bounds.low, "no frame register yet: RSP");
        assert_eq!((r.gpr[6], r.gpr[5], r.rip, r.gpr[RSP]), (0x5151, 0xBBBB, BASE + 0x2222, bounds.low + 24));
        drop(s);
    }

    #[test]
    fn a_chained_info_unwinds_its_parent_prolog_too() {
        // Child: sub rsp,0x10 at 4, chained to a parent whose prolog pushed rbx.
        const CHILD: &[u8] =
            &[0x21, 0x04, 0x01, 0x00, 0x04, 0x12, 0, 0, 0x00, 0x10, 0, 0, 0x40, 0x10, 0, 0, 0x10, 0x30, 0, 0];
        const PARENT: &[u8] = &[0x01, 0x01, 0x01, 0x00, 0x01, 0x30, 0, 0];
        let (s, bounds) = stack(&[0, 0, 0xB0B0, BASE + 0x2222]);
        let mut r = Registers { rip: BASE + 0x1060, ..Default::default() };
        r.gpr[RSP] = bounds.low;
        let function = RuntimeFunction { begin: 0x1050, end: 0x1080, unwind_info: 0x3020 };
        let frame = unwind_frame(BASE, function, &image(&[(0x3020, CHILD), (0x3010, PARENT)]), bounds, &mut r);
        assert!(frame.unwrap().handler.is_none());
        assert_eq!((r.gpr[3], r.rip, r.gpr[RSP]), (0xB0B0, BASE + 0x2222, bounds.low + 32));
        drop(s);
    }

    #[test]
    fn saved_registers_and_xmm_are_read_from_the_establisher_frame() {
        // sub rsp,0x40 (4); mov [rsp+0x20],rdi (9); movaps [rsp+0x30],xmm6 (14).
        const SAVES: &[u8] =
            &[0x01, 0x0E, 0x05, 0x00, 0x0E, 0x68, 0x03, 0x00, 0x09, 0x74, 0x04, 0x00, 0x04, 0x72, 0, 0];
        let mut words = vec![0u64; 9];
        words[4] = 0xD1D1;
        words[6] = 0x6666;
        words[7] = 0x6767;
        words[8] = BASE + 0x2222;
        let (s, bounds) = stack(&words);
        let mut r = Registers { rip: BASE + 0x1020, ..Default::default() };
        r.gpr[RSP] = bounds.low;
        let function = RuntimeFunction { begin: 0x1000, end: 0x1040, unwind_info: 0x3000 };
        unwind_frame(BASE, function, &image(&[(0x3000, SAVES)]), bounds, &mut r).unwrap();
        assert_eq!(r.gpr[7], 0xD1D1);
        assert_eq!(r.xmm[6], 0x6767_u128 << 64 | 0x6666);
        assert_eq!((r.rip, r.gpr[RSP]), (BASE + 0x2222, bounds.low + 0x48));
        drop(s);
    }

    #[test]
    fn a_frame_pointing_off_the_stack_ends_the_walk() {
        let (s, bounds) = stack(&[0, 0]);
        let mut r = Registers { rip: BASE + 0x1020, ..Default::default() };
        r.gpr[RSP] = bounds.low;
        r.gpr[5] = bounds.low + 0x10;
        let function = RuntimeFunction { begin: 0x1000, end: 0x1040, unwind_info: 0x3000 };
        let e = unwind_frame(BASE, function, &image(&[(0x3000, FRAMED)]), bounds, &mut r).unwrap_err();
        assert!(matches!(e, UnwindError::OffStack(_)), "{e}");
        drop(s);
    }
}
