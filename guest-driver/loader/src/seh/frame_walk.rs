//! The walk over the driver's frames that a dispatch and an unwind share: the image a PC is in (from the table
//! of loaded images), its function entry, and one frame's unwind, a leaf function's too.

use windows_sys::Win32::System::Diagnostics::Debug::IMAGE_RUNTIME_FUNCTION_ENTRY;

use super::unwind_info::RuntimeFunction;
use super::virtual_unwind::{self, Frame, Registers, StackBounds, UnwindError};
use crate::loaded_images;

const RSP: usize = 4;

/// One frame of the walk: the frame's own registers (at its PC), what its unwind found, and where.
pub struct WalkedFrame {
    pub at: Registers,
    pub frame: Frame,
    pub image_base: u64,
    /// The .pdata entry in the mapped image (DISPATCHER_CONTEXT's FunctionEntry); null for a leaf.
    pub function_entry: *mut IMAGE_RUNTIME_FUNCTION_ENTRY,
}

/// Unwinds `registers` one frame when their PC is in a loaded image: Some(the frame) with `registers` now the
/// caller's; None when the PC is outside every image (the driver's part of the stack has ended: the loader's or
/// the model's code called it). The table is not held past the call, so a handler may run (and never return).
pub fn step(registers: &mut Registers, stack: StackBounds) -> Option<Result<WalkedFrame, UnwindError>> {
    let pc = registers.rip;
    let (image_base, sections, pdata) = loaded_images::with_image_at(pc, |image| {
        (
            image.base as u64,
            image.sections.clone(),
            image.at_rva(image.pdata.0).map(|b| &b[..b.len().min(image.pdata.1 as usize)]),
        )
    })?;
    let at_rva = |rva: u32| -> Option<&'static [u8]> {
        let (start, len) = sections.iter().copied().find(|(s, len)| rva >= *s && rva - *s < *len)?;
        // SAFETY: inside one section of an image still mapped (a dispatch runs on the image's own thread, in one
        // of its calls: the image is not unloaded under its own code).
        Some(unsafe {
            std::slice::from_raw_parts((image_base + u64::from(rva)) as *const u8, (start + len - rva) as usize)
        })
    };
    let at = *registers;
    let rva = (pc - image_base) as u32;
    let function = pdata.and_then(|p| RuntimeFunction::lookup(p, rva).map(|f| (f, p)));
    let Some((function, pdata)) = function else {
        // A leaf: no prolog, no handler; its return address is at RSP.
        let rsp = registers.gpr[RSP];
        let frame = Frame { establisher: rsp, flags: 0, handler: None };
        return Some(match read_return(stack, rsp) {
            Ok(rip) => {
                registers.rip = rip;
                registers.gpr[RSP] = rsp + 8;
                Ok(WalkedFrame { at, frame, image_base, function_entry: std::ptr::null_mut() })
            }
            Err(e) => Err(e),
        });
    };
    let entry = entry_address(pdata, function);
    Some(virtual_unwind::unwind_frame(image_base, function, &at_rva, stack, registers).map(|frame| WalkedFrame {
        at,
        frame,
        image_base,
        function_entry: entry,
    }))
}

fn read_return(stack: StackBounds, rsp: u64) -> Result<u64, UnwindError> {
    if rsp < stack.low || rsp + 8 > stack.high {
        return Err(UnwindError::OffStack(rsp));
    }
    // SAFETY: a word inside the thread's stack.
    Ok(unsafe { (rsp as *const u64).read_unaligned() })
}

/// The address of `function`'s entry in `pdata`.
fn entry_address(pdata: &'static [u8], function: RuntimeFunction) -> *mut IMAGE_RUNTIME_FUNCTION_ENTRY {
    let index = pdata.chunks_exact(12).position(|e| e[..4] == function.begin.to_le_bytes()).unwrap_or(0);
    pdata[index * 12..].as_ptr() as *mut IMAGE_RUNTIME_FUNCTION_ENTRY
}

/// The calling thread's stack from `low` (the raise point's RSP: every frame of the walk is above it) to its top.
pub fn stack_from(low: u64) -> StackBounds {
    // SAFETY: pthread_getattr_np fills `attr` for the calling thread, read and destroyed here.
    let high = unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        let mut high = low;
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) == 0 {
            let (mut stack, mut size) = (std::ptr::null_mut(), 0usize);
            if libc::pthread_attr_getstack(&attr, &mut stack, &mut size) == 0 {
                high = stack as u64 + size as u64;
            }
            libc::pthread_attr_destroy(&mut attr);
        }
        high
    };
    StackBounds { low, high }
}
