//! __C_specific_handler, the language handler MSVC and clang name for a C function with __try: its data is a
//! scope table, one record per __try (innermost first) with its code range, its filter (or the constant 1,
//! EXCEPTION_EXECUTE_HANDLER) or __finally, and the __except block's address (0 for a __finally).

use windows_sys::Win32::System::Diagnostics::Debug::{
    CONTEXT, DISPATCHER_CONTEXT, EXCEPTION_POINTERS, EXCEPTION_RECORD,
};

use super::context_record::{EXCEPTION_TARGET_UNWIND, EXCEPTION_UNWINDING};
use super::dispatch::{self, EXCEPTION_CONTINUE_EXECUTION, EXCEPTION_CONTINUE_SEARCH};

/// SCOPE_TABLE_AMD64's record: RVAs of the __try range [begin, end), the filter or __finally, the __except block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScopeRecord {
    pub begin: u32,
    pub end: u32,
    pub handler: u32,
    pub jump_target: u32,
}

/// A filter's answers (EXCEPTION_EXECUTE_HANDLER, EXCEPTION_CONTINUE_SEARCH, EXCEPTION_CONTINUE_EXECUTION).
const EXECUTE_HANDLER: i32 = 1;

/// The scope records at `data` (the handler data of a frame's unwind info).
///
/// # Safety
/// `data` points at a scope table in a mapped image.
unsafe fn scope_table(data: *const u32) -> impl Iterator<Item = ScopeRecord> {
    // SAFETY: the caller's contract: a count, then that many four-RVA records.
    let count = unsafe { data.read_unaligned() } as usize;
    (0..count.min(4096)).map(move |i| {
        // SAFETY: as above.
        let at = |field: usize| unsafe { data.add(1 + 4 * i + field).read_unaligned() };
        ScopeRecord { begin: at(0), end: at(1), handler: at(2), jump_target: at(3) }
    })
}

/// What the handler does for one frame, decided from its scopes; the calls into the driver are the caller's.
#[derive(Debug, PartialEq, Eq)]
pub enum ScopeAction {
    /// Evaluate this scope's filter (or take it: `handler` 1) during the search.
    Filter(usize),
    /// Run this scope's __finally while unwinding.
    Finally(usize),
    /// The unwind reached the __except it is going to: nothing further in this frame runs.
    Stop,
}

/// The scopes of one call of the handler, from `first` (DISPATCHER_CONTEXT's ScopeIndex), that contain the
/// frame's PC: each __except's filter while searching; while unwinding each __finally, until the __except being
/// unwound to (its jump target is TargetIp).
pub fn actions(
    scopes: &[ScopeRecord],
    first: usize,
    pc_rva: u32,
    unwinding: bool,
    target_rva: Option<u32>,
) -> Vec<ScopeAction> {
    let mut actions = Vec::new();
    for (i, scope) in scopes.iter().enumerate().skip(first) {
        if pc_rva < scope.begin || pc_rva >= scope.end {
            continue;
        }
        if !unwinding {
            if scope.jump_target != 0 {
                actions.push(ScopeAction::Filter(i));
            }
            continue;
        }
        if target_rva.is_some_and(|t| scope.jump_target == t) {
            actions.push(ScopeAction::Stop);
            break;
        }
        if scope.jump_target == 0 {
            actions.push(ScopeAction::Finally(i));
        }
    }
    actions
}

/// __C_specific_handler(ExceptionRecord, EstablisherFrame, ContextRecord, DispatcherContext), bound to the
/// ntoskrnl.exe export of that name. Searching: the first filter that answers EXECUTE_HANDLER unwinds to its
/// __except (RtlUnwindEx, with the code as the return value), CONTINUE_EXECUTION resumes, CONTINUE_SEARCH goes on.
/// Unwinding: each __finally runs with AbnormalTermination TRUE.
#[allow(non_snake_case)] // the export's name, as the image's unwind info binds it
pub unsafe extern "win64" fn __C_specific_handler(
    record: *mut EXCEPTION_RECORD,
    frame: u64,
    context: *mut CONTEXT,
    dispatcher: *mut DISPATCHER_CONTEXT,
) -> i32 {
    type Filter = unsafe extern "win64" fn(*mut EXCEPTION_POINTERS, u64) -> i32;
    type Finally = unsafe extern "win64" fn(u8, u64);
    // SAFETY: the dispatcher's records, live for this call; the scope table is the frame's handler data.
    let (d, flags) = unsafe { (&mut *dispatcher, (*record).ExceptionFlags) };
    let scopes: Vec<ScopeRecord> = unsafe { scope_table(d.HandlerData as *const u32) }.collect();
    let base = d.ImageBase;
    let pc_rva = (d.ControlPc - base) as u32;
    let unwinding = flags & EXCEPTION_UNWINDING != 0;
    let target = (flags & EXCEPTION_TARGET_UNWIND != 0).then(|| (d.TargetIp - base) as u32);
    for action in actions(&scopes, d.ScopeIndex as usize, pc_rva, unwinding, target) {
        match action {
            ScopeAction::Stop => break,
            ScopeAction::Finally(i) => {
                // Past this scope before its __finally runs: an unwind that collides with this one resumes after it.
                d.ScopeIndex = i as u32 + 1;
                // SAFETY: the image's outlined __finally, (AbnormalTermination, EstablisherFrame), x64 convention.
                unsafe { std::mem::transmute::<u64, Finally>(base + u64::from(scopes[i].handler))(1, frame) };
            }
            ScopeAction::Filter(i) => {
                let answer = if scopes[i].handler == EXECUTE_HANDLER as u32 {
                    EXECUTE_HANDLER
                } else {
                    let mut pointers = EXCEPTION_POINTERS { ExceptionRecord: record, ContextRecord: context };
                    // SAFETY: the image's filter expression, (EXCEPTION_POINTERS*, EstablisherFrame).
                    unsafe {
                        std::mem::transmute::<u64, Filter>(base + u64::from(scopes[i].handler))(&mut pointers, frame)
                    }
                };
                if answer < 0 {
                    return EXCEPTION_CONTINUE_EXECUTION;
                }
                if answer > 0 {
                    // SAFETY: the record is live; the code is what __except's GetExceptionCode reads from RAX.
                    let code = unsafe { (*record).ExceptionCode } as u32;
                    dispatch::unwind(frame, base + u64::from(scopes[i].jump_target), record, u64::from(code))
                }
            }
        }
    }
    EXCEPTION_CONTINUE_SEARCH
}

#[cfg(test)]
mod tests {
    use super::*;

    // An outer __try/__except around an inner __try/__finally, and a second __except elsewhere.
    const SCOPES: [ScopeRecord; 3] = [
        ScopeRecord { begin: 0x1010, end: 0x1020, handler: 0x1100, jump_target: 0 },
        ScopeRecord { begin: 0x1008, end: 0x1030, handler: 1, jump_target: 0x1040 },
        ScopeRecord { begin: 0x1050, end: 0x1060, handler: 0x1200, jump_target: 0x1070 },
    ];

    #[test]
    fn a_search_evaluates_the_excepts_around_the_pc_only() {
        assert_eq!(actions(&SCOPES, 0, 0x1018, false, None), vec![ScopeAction::Filter(1)]);
        assert_eq!(actions(&SCOPES, 0, 0x1058, false, None), vec![ScopeAction::Filter(2)]);
        assert!(actions(&SCOPES, 0, 0x1030, false, None).is_empty(), "end is exclusive");
    }

    #[test]
    fn an_unwind_runs_the_finallys_inside_its_target_and_stops_there() {
        assert_eq!(actions(&SCOPES, 0, 0x1018, true, Some(0x1040)), vec![ScopeAction::Finally(0), ScopeAction::Stop]);
        // Passing through the frame (not its target): every __finally around the PC.
        assert_eq!(actions(&SCOPES, 0, 0x1018, true, None), vec![ScopeAction::Finally(0)]);
        // A collided unwind resumes past the scope already run.
        assert_eq!(actions(&SCOPES, 1, 0x1018, true, None), vec![]);
    }
}
