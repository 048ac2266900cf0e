//! The x64 unwind data of a PE image as Microsoft's "x64 exception handling" page lays it out: .pdata's
//! RUNTIME_FUNCTION entries, sorted by address, and each one's UNWIND_INFO in .xdata (its unwind codes, a chained
//! entry or the language handler with its data). Read by RVA from the mapped image; nothing here trusts a length.

/// UNWIND_INFO flags: the function has an exception handler (called while dispatching), a termination handler
/// (called while unwinding), or its info continues in a chained RUNTIME_FUNCTION.
pub const UNW_FLAG_EHANDLER: u8 = 1;
pub const UNW_FLAG_UHANDLER: u8 = 2;
pub const UNW_FLAG_CHAININFO: u8 = 4;

/// One RUNTIME_FUNCTION: the function's [begin, end) RVAs and its UNWIND_INFO's RVA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeFunction {
    pub begin: u32,
    pub end: u32,
    pub unwind_info: u32,
}

/// RUNTIME_FUNCTION's size in .pdata.
pub const RUNTIME_FUNCTION_SIZE: usize = 12;

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

impl RuntimeFunction {
    fn parse(bytes: &[u8], at: usize) -> Option<RuntimeFunction> {
        Some(RuntimeFunction {
            begin: u32_at(bytes, at)?,
            end: u32_at(bytes, at + 4)?,
            unwind_info: u32_at(bytes, at + 8)?,
        })
    }

    /// The entry of `pdata` (an image's exception directory) whose range holds `rva`, by binary search as
    /// RtlLookupFunctionEntry does; None for a leaf function (one with no entry: no frame, RSP at its return address).
    pub fn lookup(pdata: &[u8], rva: u32) -> Option<RuntimeFunction> {
        let count = pdata.len() / RUNTIME_FUNCTION_SIZE;
        let (mut low, mut high) = (0usize, count);
        while low < high {
            let middle = (low + high) / 2;
            let entry = RuntimeFunction::parse(pdata, middle * RUNTIME_FUNCTION_SIZE)?;
            if rva < entry.begin {
                high = middle;
            } else if rva >= entry.end {
                low = middle + 1;
            } else {
                return Some(entry);
            }
        }
        None
    }
}

/// The unwind operations (UWOP_*), each with the prolog offset after which it has taken effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnwindOp {
    /// `push reg`.
    PushNonvolatile(u8),
    /// `sub rsp, n` (UWOP_ALLOC_SMALL and UWOP_ALLOC_LARGE).
    Alloc(u32),
    /// `lea frame_register, [rsp + 16 * offset]`.
    SetFramePointer,
    /// `mov [frame + offset], reg` (UWOP_SAVE_NONVOL and its _FAR form; the offset in bytes).
    SaveNonvolatile(u8, u32),
    /// `movaps [frame + offset], xmmN` (UWOP_SAVE_XMM128 and its _FAR form).
    SaveXmm(u8, u32),
    /// The processor pushed a machine frame (an interrupt or exception entry), with an error code or not.
    PushMachineFrame { error_code: bool },
    /// Version 2's epilog descriptions, which an unwind from the body does not need.
    Epilog,
}

/// A parsed UNWIND_INFO.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnwindInfo {
    pub flags: u8,
    pub prolog_size: u8,
    /// 0: no frame register.
    pub frame_register: u8,
    /// Scaled by 16, as UNWIND_INFO keeps it.
    pub frame_offset: u8,
    /// Innermost first (the reverse of the prolog's order), each with its prolog offset.
    pub ops: Vec<(u8, UnwindOp)>,
    /// UNW_FLAG_EHANDLER or UHANDLER: the handler's RVA and the RVA of its data (a scope table for
    /// __C_specific_handler).
    pub handler: Option<(u32, u32)>,
    /// UNW_FLAG_CHAININFO: the entry whose info continues this one's.
    pub chained: Option<RuntimeFunction>,
}

/// Why an UNWIND_INFO cannot be used: the dispatch treats it as the end of the walk.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum UnwindInfoError {
    #[error("UNWIND_INFO version {0} (1 and 2 are defined)")]
    Version(u8),
    #[error("UNWIND_INFO truncated")]
    Truncated,
    #[error("unwind code {0} is not defined")]
    UnknownCode(u8),
}

impl UnwindInfo {
    /// Parses the UNWIND_INFO at the start of `bytes` (the image from its RVA on).
    pub fn parse(bytes: &[u8]) -> Result<UnwindInfo, UnwindInfoError> {
        let header = bytes.get(..4).ok_or(UnwindInfoError::Truncated)?;
        let version = header[0] & 7;
        if !(1..=2).contains(&version) {
            return Err(UnwindInfoError::Version(version));
        }
        let flags = header[0] >> 3;
        let count = header[2] as usize;
        let slot = |i: usize| u16_at(bytes, 4 + 2 * i).ok_or(UnwindInfoError::Truncated);
        let mut ops = Vec::new();
        let mut i = 0;
        while i < count {
            let code = slot(i)?;
            let (offset, op, info) = (code as u8, ((code >> 8) & 0xF) as u8, (code >> 12) as u8);
            let (parsed, slots) = match op {
                0 => (UnwindOp::PushNonvolatile(info), 1),
                1 if info == 0 => (UnwindOp::Alloc(u32::from(slot(i + 1)?) * 8), 2),
                1 => (UnwindOp::Alloc(u32::from(slot(i + 1)?) | u32::from(slot(i + 2)?) << 16), 3),
                2 => (UnwindOp::Alloc(u32::from(info) * 8 + 8), 1),
                3 => (UnwindOp::SetFramePointer, 1),
                4 => (UnwindOp::SaveNonvolatile(info, u32::from(slot(i + 1)?) * 8), 2),
                5 => (UnwindOp::SaveNonvolatile(info, u32::from(slot(i + 1)?) | u32::from(slot(i + 2)?) << 16), 3),
                6 if version == 2 => (UnwindOp::Epilog, 2),
                8 => (UnwindOp::SaveXmm(info, u32::from(slot(i + 1)?) * 16), 2),
                9 => (UnwindOp::SaveXmm(info, u32::from(slot(i + 1)?) | u32::from(slot(i + 2)?) << 16), 3),
                10 => (UnwindOp::PushMachineFrame { error_code: info != 0 }, 1),
                other => return Err(UnwindInfoError::UnknownCode(other)),
            };
            if i + slots > count {
                return Err(UnwindInfoError::Truncated);
            }
            ops.push((offset, parsed));
            i += slots;
        }
        // What follows the codes starts at an even slot count.
        let tail = 4 + 2 * (count + (count & 1));
        let (mut handler, mut chained) = (None, None);
        if flags & UNW_FLAG_CHAININFO != 0 {
            chained = Some(RuntimeFunction::parse(bytes, tail).ok_or(UnwindInfoError::Truncated)?);
        } else if flags & (UNW_FLAG_EHANDLER | UNW_FLAG_UHANDLER) != 0 {
            let rva = u32_at(bytes, tail).ok_or(UnwindInfoError::Truncated)?;
            handler = Some((rva, 0));
        }
        Ok(UnwindInfo {
            flags,
            prolog_size: header[1],
            frame_register: header[3] & 0xF,
            frame_offset: header[3] >> 4,
            ops,
            handler,
            chained,
        })
    }

    /// As `parse`, with the handler data's RVA filled in from the info's own RVA (the data follows the handler's).
    pub fn parse_at(bytes: &[u8], rva: u32) -> Result<UnwindInfo, UnwindInfoError> {
        let mut info = UnwindInfo::parse(bytes)?;
        let count = bytes[2] as u32;
        if let Some((handler, _)) = info.handler {
            info.handler = Some((handler, rva + 4 + 2 * (count + (count & 1)) + 4));
        }
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_chain_and_handler_are_read_as_laid_out() {
        // prolog 0x0C, 5 slots: at 0x0C SET_FPREG; at 8 ALLOC_LARGE 16-bit (0x130/8 = 0x26); at 4 SAVE_NONVOL RSI
        // at 0x18*8... then PUSH_NONVOL RBP at 1; frame RBP (5), offset 2 (32 bytes); EHANDLER at 0x1234.
        let bytes = [
            0x09, 0x0C, 0x06, 0x25, //
            0x0C, 0x03, 0x08, 0x01, 0x26, 0x00, 0x04, 0x64, 0x03, 0x00, 0x01, 0x50, //
            0x34, 0x12, 0x00, 0x00, 0xAA, 0xBB, 0xCC, 0xDD,
        ];
        let info = UnwindInfo::parse_at(&bytes, 0x3000).unwrap();
        assert_eq!(info.flags, UNW_FLAG_EHANDLER);
        assert_eq!((info.frame_register, info.frame_offset), (5, 2));
        assert_eq!(
            info.ops,
            vec![
                (0x0C, UnwindOp::SetFramePointer),
                (0x08, UnwindOp::Alloc(0x130)),
                (0x04, UnwindOp::SaveNonvolatile(6, 0x18)),
                (0x01, UnwindOp::PushNonvolatile(5)),
            ]
        );
        // 6 slots rounded to even stay 6: handler at 4 + 12, data right after it.
        assert_eq!(info.handler, Some((0x1234, 0x3000 + 16 + 4)));
    }

    #[test]
    fn a_chained_entry_follows_an_odd_count_padded_to_even() {
        let bytes =
            [0x21, 0x04, 0x01, 0x00, 0x04, 0x42, 0x00, 0x00, 0x00, 0x10, 0, 0, 0x40, 0x10, 0, 0, 0x80, 0x20, 0, 0];
        let info = UnwindInfo::parse(&bytes).unwrap();
        assert_eq!(info.ops, vec![(4, UnwindOp::Alloc(0x28))]);
        assert_eq!(info.chained, Some(RuntimeFunction { begin: 0x1000, end: 0x1040, unwind_info: 0x2080 }));
        assert_eq!(info.handler, None);
    }

    #[test]
    fn bad_infos_are_refused() {
        assert_eq!(UnwindInfo::parse(&[0x03, 0, 0, 0]), Err(UnwindInfoError::Version(3)));
        assert_eq!(UnwindInfo::parse(&[0x01, 4, 2, 0, 0x04, 0x01]), Err(UnwindInfoError::Truncated));
        assert_eq!(UnwindInfo::parse(&[0x01, 4, 1, 0, 0x04, 0x07]), Err(UnwindInfoError::UnknownCode(7)));
    }

    #[test]
    fn lookup_is_by_range_and_a_gap_is_a_leaf() {
        let mut pdata = Vec::new();
        for (b, e, u) in [(0x1000u32, 0x1010u32, 0x2000u32), (0x1020, 0x1040, 0x2010), (0x1040, 0x1100, 0x2020)] {
            pdata.extend(b.to_le_bytes());
            pdata.extend(e.to_le_bytes());
            pdata.extend(u.to_le_bytes());
        }
        assert_eq!(RuntimeFunction::lookup(&pdata, 0x1030).map(|f| f.unwind_info), Some(0x2010));
        assert_eq!(RuntimeFunction::lookup(&pdata, 0x1040).map(|f| f.unwind_info), Some(0x2020));
        assert_eq!(RuntimeFunction::lookup(&pdata, 0x1015), None);
        assert_eq!(RuntimeFunction::lookup(&pdata, 0x0FFF), None);
    }
}
