//! RtlDispatchException and RtlUnwindEx for the driver's frames: the search walks from the raise point calling
//! each frame's exception handler; a handler that takes the exception unwinds to its frame (termination handlers
//! run on the way) and the driver resumes at its handler with RAX = the code. No taker: 0x7E, as an unhandled
//! exception in a system thread is on Windows.

use std::cell::RefCell;

use windows_sys::Win32::System::Diagnostics::Debug::{CONTEXT, DISPATCHER_CONTEXT, EXCEPTION_RECORD};

use super::context_record::{
    from_context, to_context, EXCEPTION_NONCONTINUABLE, EXCEPTION_TARGET_UNWIND, EXCEPTION_UNWINDING,
};
use super::frame_walk::{self, WalkedFrame};
use super::resume::resume;
use super::unwind_info::{UNW_FLAG_EHANDLER, UNW_FLAG_UHANDLER};
use super::virtual_unwind::{Registers, StackBounds};
use crate::driver_fault::SYSTEM_THREAD_EXCEPTION_NOT_HANDLED;

/// A language-specific handler as the image's .xdata names it (__C_specific_handler's signature), Windows x64
/// convention.
pub type LanguageHandler =
    unsafe extern "win64" fn(*mut EXCEPTION_RECORD, u64, *mut CONTEXT, *mut DISPATCHER_CONTEXT) -> i32;

/// EXCEPTION_DISPOSITION.
pub const EXCEPTION_CONTINUE_EXECUTION: i32 = 0;
pub const EXCEPTION_CONTINUE_SEARCH: i32 = 1;
const STATUS_NONCONTINUABLE_EXCEPTION: u32 = 0xC000_0025;
const STATUS_INVALID_DISPOSITION: u32 = 0xC000_0026;
const STATUS_INVALID_UNWIND_TARGET: u32 = 0xC000_0029;
const RAX: usize = 0;
const RSP: usize = 4;

/// The raise a dispatch is for, kept while its handlers run: RtlUnwindEx walks again from here (on Windows it
/// captures its own context and walks through the kernel's frames; the loader's frames have no unwind data).
struct Raise {
    registers: Registers,
    stack: StackBounds,
}

thread_local! {
    /// The raises being dispatched on this thread, innermost last (a filter may raise again).
    static RAISES: RefCell<Vec<Raise>> = const { RefCell::new(Vec::new()) };
}

/// Dispatches `record`, raised with the driver's registers `at` (its PC the raise point), through the driver's
/// frames. Returns only when no frame takes it, with the bugcheck's code to stop with (the caller prints its own
/// line first, or not). A handler that takes it resumes the driver and never comes back here.
pub fn dispatch(record: &mut EXCEPTION_RECORD, at: Registers) -> u32 {
    let stack = frame_walk::stack_from(at.gpr[RSP]);
    RAISES.with(|r| r.borrow_mut().push(Raise { registers: at, stack }));
    let code = search(record, at, stack);
    RAISES.with(|r| r.borrow_mut().pop());
    code
}

/// Dispatches and, with no taker, stops the machine with 0x7E: P1 the code, P2 where it was raised.
pub fn dispatch_or_stop(record: &mut EXCEPTION_RECORD, at: Registers) -> ! {
    let code = dispatch(record, at);
    println!(
        "VHCA-LOADER: exception {code:#x} raised at {:#x} in the driver: no handler took it",
        record.ExceptionAddress as u64
    );
    crate::kernel_context::bugcheck(
        SYSTEM_THREAD_EXCEPTION_NOT_HANDLED,
        u64::from(code),
        record.ExceptionAddress as u64,
        0,
        0,
    )
}

fn search(record: &mut EXCEPTION_RECORD, at: Registers, stack: StackBounds) -> u32 {
    let mut original = to_context(&at);
    let mut registers = at;
    loop {
        let Some(Ok(walked)) = frame_walk::step(&mut registers, stack) else { return record.ExceptionCode as u32 };
        if walked.frame.flags & UNW_FLAG_EHANDLER != 0 {
            let mut unwound = to_context(&registers);
            let disposition = call_handler(&walked, record, &mut original, &mut unwound, 0);
            match disposition {
                Some(EXCEPTION_CONTINUE_SEARCH) => {}
                Some(EXCEPTION_CONTINUE_EXECUTION) if record.ExceptionFlags & EXCEPTION_NONCONTINUABLE == 0 => {
                    RAISES.with(|r| r.borrow_mut().pop());
                    resume(&from_context(&original))
                }
                Some(EXCEPTION_CONTINUE_EXECUTION) => return STATUS_NONCONTINUABLE_EXCEPTION,
                _ => return STATUS_INVALID_DISPOSITION,
            }
        }
        // A frame that does not move the stack up would walk forever.
        if registers.gpr[RSP] <= walked.at.gpr[RSP] {
            return record.ExceptionCode as u32;
        }
    }
}

/// Calls `walked`'s language handler as RtlDispatchException and RtlUnwindEx do: the record, the establisher
/// frame, a context, and a DISPATCHER_CONTEXT whose ContextRecord is the frame's caller's (already unwound) context.
/// None: the frame names no handler.
fn call_handler(
    walked: &WalkedFrame,
    record: &mut EXCEPTION_RECORD,
    context: &mut CONTEXT,
    unwound: &mut CONTEXT,
    target_ip: u64,
) -> Option<i32> {
    let (handler_rva, data_rva) = walked.frame.handler?;
    let handler = walked.image_base + u64::from(handler_rva);
    // SAFETY: DISPATCHER_CONTEXT is plain data; LanguageHandler is filled with the handler's address below (its
    // Rust type, an "system" fn, is only this record's layout here: the call goes through `LanguageHandler`).
    let mut dispatcher: DISPATCHER_CONTEXT = unsafe { std::mem::zeroed() };
    dispatcher.ControlPc = walked.at.rip;
    dispatcher.ImageBase = walked.image_base;
    dispatcher.FunctionEntry = walked.function_entry;
    dispatcher.EstablisherFrame = walked.frame.establisher;
    dispatcher.TargetIp = target_ip;
    dispatcher.ContextRecord = unwound;
    dispatcher.HandlerData = (walked.image_base + u64::from(data_rva)) as *mut core::ffi::c_void;
    // SAFETY: the field is one code pointer wide, as the handler's address is.
    unsafe { std::ptr::write(std::ptr::addr_of_mut!(dispatcher.LanguageHandler) as *mut u64, handler) };
    // SAFETY: the image's own handler, named by its unwind info, called with the Windows x64 convention and the
    // records Windows passes; it runs on this (the driver's) thread below the raise point.
    let handler: LanguageHandler = unsafe { std::mem::transmute::<u64, LanguageHandler>(handler) };
    Some(unsafe { handler(record, walked.frame.establisher, context, &mut dispatcher) })
}

/// RtlUnwindEx(TargetFrame, TargetIp, ExceptionRecord, ReturnValue, ContextRecord, HistoryTable) for the raise
/// being dispatched on this thread: walks from its raise point to the frame whose establisher is `target_frame`,
/// calling each termination handler with EXCEPTION_UNWINDING (and EXCEPTION_TARGET_UNWIND at the target), then
/// resumes in the target frame at `target_ip` with RAX = `return_value`. A target not on the stack is 0x7E.
pub fn unwind(target_frame: u64, target_ip: u64, record: *mut EXCEPTION_RECORD, return_value: u64) -> ! {
    let Some((at, stack)) = RAISES.with(|r| r.borrow().last().map(|raise| (raise.registers, raise.stack))) else {
        crate::kernel_context::bugcheck(
            SYSTEM_THREAD_EXCEPTION_NOT_HANDLED,
            u64::from(STATUS_INVALID_UNWIND_TARGET),
            target_ip,
            0,
            0,
        )
    };
    // SAFETY: a record of the unwind's caller (the dispatch's own, or the driver's for an unwind it asked for);
    // an unwind without one gets an STATUS_UNWIND record of its own.
    let mut own = super::context_record::exception_record(0xC000_0027, 0, target_ip, &[]);
    let record = if record.is_null() { &mut own } else { unsafe { &mut *record } };
    record.ExceptionFlags |= EXCEPTION_UNWINDING;
    let mut registers = at;
    loop {
        let Some(Ok(walked)) = frame_walk::step(&mut registers, stack) else { break };
        if walked.frame.establisher > target_frame {
            break;
        }
        let target = walked.frame.establisher == target_frame;
        if target {
            record.ExceptionFlags |= EXCEPTION_TARGET_UNWIND;
        }
        if walked.frame.flags & UNW_FLAG_UHANDLER != 0 {
            let mut context = to_context(&registers);
            let mut unwound = context;
            match call_handler(&walked, record, &mut context, &mut unwound, target_ip) {
                None | Some(EXCEPTION_CONTINUE_SEARCH) => {}
                Some(_) => break,
            }
        }
        if target {
            let mut resumed = walked.at;
            resumed.rip = target_ip;
            resumed.gpr[RAX] = return_value;
            RAISES.with(|r| r.borrow_mut().pop());
            resume(&resumed)
        }
    }
    println!("VHCA-LOADER: an unwind to frame {target_frame:#x} (at {target_ip:#x}) found no such frame");
    crate::kernel_context::bugcheck(
        SYSTEM_THREAD_EXCEPTION_NOT_HANDLED,
        u64::from(STATUS_INVALID_UNWIND_TARGET),
        target_ip,
        0,
        0,
    )
}
