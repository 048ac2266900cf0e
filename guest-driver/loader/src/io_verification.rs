//! Driver Verifier's I/O Verification (flag 0x10, and 0x40, Enhanced I/O Verification, which Windows Vista and later
//! fold into it) over the IRPs `irp_dispatch` moves, with Windows' own IRP check that holds in every mode (0x44).
//! The ledger of IRPs in flight (dispatch routines running, IRPs freed) is here; the moves stay in `irp_dispatch`.
//!
//! Codes and parameters are Microsoft's "Bug Check 0xC9: DRIVER_VERIFIER_IOMANAGER_VIOLATION" page (the rows quoted
//! in docs/verifier.md) and "Bug Check 0x44: MULTIPLE_IRP_COMPLETE_REQUESTS". The page's I/O error codes (0x200 and
//! up) are reported as a crash dump shows them: P1 the code, P2 the address in the driver's code where the error was
//! found (the dispatch routine's), P3 the IRP, P4 the device object.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::thread::ThreadId;

use vhca_ntapi::{NtKernel, DISPATCH_LEVEL, DRIVER_VERIFIER_IOMANAGER_VIOLATION, KIRQL};
use vhca_ntmodel::{Bugcheck, NtModel, VerifierFlags};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_PENDING};

/// Enhanced I/O Verification's flag; since Windows Vista its checks are I/O Verification's, and selecting it
/// selects I/O Verification too, so either flag turns every check here on.
const ENHANCED_IO_VERIFICATION: VerifierFlags = VerifierFlags(0x40);

/// MULTIPLE_IRP_COMPLETE_REQUESTS: IoCompleteRequest on an IRP already completed (P1 the IRP, the rest reserved).
/// IofCompleteRequest checks this itself, with or without Driver Verifier.
pub const MULTIPLE_IRP_COMPLETE_REQUESTS: u32 = 0x44;

/// Parameter 1 values of 0xC9 the loader raises.
pub mod c9 {
    /// IoCallDriver with an IRP whose Type is not IO_TYPE_IRP (P2 the IRP): one the I/O manager completed and
    /// took back.
    pub const CALL_WITH_NON_IRP: u64 = 0x03;
    /// IoCallDriver with an invalid device object (P2 the device).
    pub const CALL_WITH_INVALID_DEVICE: u64 = 0x04;
    /// The dispatch routine returned at another IRQL (P2 the device, P3 the IRQL before, P4 after).
    pub const DISPATCH_CHANGED_IRQL: u64 = 0x05;
    /// IoCompleteRequest with STATUS_PENDING or -1 (P2 the status, P3 the IRP).
    pub const COMPLETE_WITH_PENDING: u64 = 0x06;
    /// IoCompleteRequest with the IRP's cancel routine still set (P2 the routine, P3 the IRP).
    pub const COMPLETE_WITH_CANCEL_ROUTINE: u64 = 0x07;
    /// IoCompleteRequest above DISPATCH_LEVEL (P2 the IRQL, P3 the IRP).
    pub const COMPLETE_ABOVE_DISPATCH: u64 = 0x0E;
    /// IoCallDriver above DISPATCH_LEVEL (P2 the IRQL).
    pub const CALL_ABOVE_DISPATCH: u64 = 0x10;
    /// IoCallDriver with the IRP's cancel routine still set.
    pub const FORWARD_WITH_CANCEL_ROUTINE: u64 = 0x203;
    /// IoCallDriver with an IRP the caller sent down and a lower driver still holds pending.
    pub const FORWARD_HELD_BELOW: u64 = 0x205;
    /// IoCompleteRequest on an IRP the caller sent down and a lower driver still holds pending.
    pub const COMPLETE_HELD_BELOW: u64 = 0x209;
    /// STATUS_PENDING returned without IoMarkIrpPending.
    pub const PENDING_NOT_MARKED: u64 = 0x23D;
    /// IoMarkIrpPending without STATUS_PENDING returned.
    pub const MARKED_NOT_PENDING: u64 = 0x23E;
}

/// How many freed IRP addresses are remembered: enough for every IRP a run builds, bounded all the same.
const FREED_REMEMBERED: usize = 4096;

/// One dispatch routine running with an IRP: what its return is checked against.
#[derive(Debug, Clone, Copy)]
struct Dispatch {
    irp: usize,
    /// The IRP's CurrentLocation the routine was called with (its own stack location).
    location: i8,
    thread: ThreadId,
    irql: KIRQL,
    routine: usize,
    device: usize,
    /// Whether its stack location had SL_PENDING_RETURNED when completion passed it (None: not completed yet).
    marked_at_completion: Option<bool>,
}

/// The IRPs in flight as I/O Verification tracks them.
#[derive(Default)]
pub struct IrpLedger {
    dispatches: Mutex<Vec<Dispatch>>,
    /// IRPs the I/O manager freed, newest last; an address IoAllocateIrp hands out again leaves the list.
    freed: Mutex<VecDeque<usize>>,
    /// Live IRPs whose completion reached the top: the I/O manager's again (a fresh IRP's CurrentLocation is past
    /// its last location too, so the location alone cannot tell).
    completed: Mutex<HashSet<usize>>,
}

/// A dispatch routine's call in progress, from `IrpLedger::enter` to `IrpLedger::leave`.
#[derive(Debug)]
pub struct DispatchCall {
    irp: usize,
    location: i8,
    irql: KIRQL,
}

impl IrpLedger {
    pub fn allocated(&self, irp: usize) {
        crate::lock(&self.freed).retain(|&f| f != irp);
        crate::lock(&self.completed).remove(&irp);
    }

    /// Completion of `irp` reached its top: no driver holds it any more.
    pub fn completed_to_top(&self, irp: usize) {
        crate::lock(&self.completed).insert(irp);
    }

    /// Whether `irp` was completed to its top, or freed after: no driver may send or complete it again.
    pub fn is_done(&self, irp: usize) -> bool {
        crate::lock(&self.completed).contains(&irp) || self.is_freed(irp)
    }

    pub fn freed(&self, irp: usize) {
        crate::lock(&self.completed).remove(&irp);
        let mut freed = crate::lock(&self.freed);
        if freed.len() == FREED_REMEMBERED {
            freed.pop_front();
        }
        freed.push_back(irp);
    }

    /// Whether `irp` is an IRP the I/O manager completed and freed (its memory is not to be read).
    pub fn is_freed(&self, irp: usize) -> bool {
        crate::lock(&self.freed).contains(&irp)
    }

    /// The dispatch routine `routine` of `device` is about to get `irp` at `location`, at `irql`.
    pub fn enter(&self, irp: usize, location: i8, irql: KIRQL, routine: usize, device: usize) -> DispatchCall {
        let thread = std::thread::current().id();
        let d = Dispatch { irp, location, thread, irql, routine, device, marked_at_completion: None };
        crate::lock(&self.dispatches).push(d);
        DispatchCall { irp, location, irql }
    }

    /// The innermost dispatch routine of this thread holding `irp` (its address and device), if any.
    pub fn caller(&self, irp: usize) -> Option<(usize, usize)> {
        let thread = std::thread::current().id();
        let dispatches = crate::lock(&self.dispatches);
        dispatches.iter().rev().find(|d| d.irp == irp && d.thread == thread).map(|d| (d.routine, d.device))
    }

    /// The dispatch routine (its address and device) that calls now with `irp` while the IRP sits at `location`
    /// below it: the innermost routine of this thread holding the IRP, called at this `irql` (a DPC or an ISR that
    /// borrows the thread runs at another), whose own location is above `location`. A lower driver's routine that
    /// still runs is innermost itself, at `location`, and gives None.
    pub fn held_below(&self, irp: usize, location: i8, irql: KIRQL) -> Option<(usize, usize)> {
        let thread = std::thread::current().id();
        let dispatches = crate::lock(&self.dispatches);
        let caller = dispatches.iter().rev().find(|d| d.irp == irp && d.thread == thread)?;
        (caller.location > location && caller.irql == irql).then_some((caller.routine, caller.device))
    }

    /// Completion passed `location` of `irp`, whose Control had SL_PENDING_RETURNED or not: kept for the routines
    /// that were called with that location, since the IRP may be freed before they return.
    pub fn completed_past(&self, irp: usize, location: i8, marked: bool) {
        for d in crate::lock(&self.dispatches).iter_mut().filter(|d| d.irp == irp && d.location == location) {
            d.marked_at_completion.get_or_insert(marked);
        }
    }

    /// The routine of `call` returned: whether its location was marked pending, when completion recorded it
    /// (None: the IRP has not come back past it, and its stack location says).
    pub fn leave(&self, call: &DispatchCall) -> Option<bool> {
        let mut dispatches = crate::lock(&self.dispatches);
        let at = dispatches.iter().rposition(|d| d.irp == call.irp && d.location == call.location)?;
        dispatches.remove(at).marked_at_completion
    }
}

impl DispatchCall {
    pub fn irql(&self) -> KIRQL {
        self.irql
    }

    /// The stack location the routine was called with.
    pub fn location(&self) -> i8 {
        self.location
    }
}

/// The rules, on the model's verifier settings: each check raises through the model's bugcheck path unless the
/// rule is in `disabled_rules`, and then the caller carries on as if unchecked.
pub struct IoRules<'a> {
    model: &'a NtModel,
}

impl<'a> IoRules<'a> {
    pub fn new(model: &'a NtModel) -> IoRules<'a> {
        IoRules { model }
    }

    fn verifying(&self) -> bool {
        let flags = self.model.verifier();
        flags.contains(VerifierFlags::IO_VERIFICATION) || flags.contains(ENHANCED_IO_VERIFICATION)
    }

    fn raise(&self, bugcheck: Bugcheck) {
        if !self.model.config().disabled_rules.iter().any(|r| r.matches(&bugcheck)) {
            let [p1, p2, p3, p4] = bugcheck.params;
            self.model.KeBugCheckEx(bugcheck.code, p1, p2, p3, p4)
        }
    }

    fn c9(&self, p1: u64, p2: u64, p3: u64, p4: u64) {
        if self.verifying() {
            self.raise(Bugcheck::new(DRIVER_VERIFIER_IOMANAGER_VIOLATION, p1, p2, p3, p4));
        }
    }

    pub fn irql(&self) -> KIRQL {
        self.model.KeGetCurrentIrql()
    }

    /// IoCompleteRequest on an IRP that was completed already: every mode.
    pub fn completed_twice(&self, irp: usize) {
        self.raise(Bugcheck::new(MULTIPLE_IRP_COMPLETE_REQUESTS, irp as u64, 0, 0, 0));
    }

    /// A dispatch routine touches an IRP a lower driver holds pending (IoCompleteRequest, or IoCallDriver when
    /// `forwarding`): `held` is the routine and its device (`IrpLedger::held_below`).
    pub fn touched_while_held_below(&self, irp: usize, held: Option<(usize, usize)>, forwarding: bool) {
        if let Some((routine, device)) = held {
            let code = if forwarding { c9::FORWARD_HELD_BELOW } else { c9::COMPLETE_HELD_BELOW };
            self.c9(code, routine as u64, irp as u64, device as u64);
        }
    }

    /// A cancel routine (its address, 0 for none) left in the IRP by the driver that completes it or sends it
    /// down (`forwarding`, with the caller's dispatch routine and device when known): whoever gets the IRP next
    /// could have it cancelled by a routine that no longer owns it.
    pub fn cancel_routine_left(&self, irp: usize, cancel_routine: usize, forwarding: Option<(usize, usize)>) {
        if cancel_routine == 0 {
            return;
        }
        match forwarding {
            None => self.c9(c9::COMPLETE_WITH_CANCEL_ROUTINE, cancel_routine as u64, irp as u64, 0),
            Some((routine, device)) => {
                self.c9(c9::FORWARD_WITH_CANCEL_ROUTINE, routine as u64, irp as u64, device as u64)
            }
        }
    }

    /// IoCompleteRequest's checks on its caller: IRQL at most DISPATCH_LEVEL, a final status.
    pub fn completing(&self, irp: usize, status: NTSTATUS) {
        let irql = self.irql();
        if irql > DISPATCH_LEVEL {
            self.c9(c9::COMPLETE_ABOVE_DISPATCH, irql as u64, irp as u64, 0);
        }
        if status == STATUS_PENDING || status == -1 {
            self.c9(c9::COMPLETE_WITH_PENDING, status as u32 as u64, irp as u64, 0);
        }
    }

    /// IoCallDriver's checks on its caller: a live device, an IRP the I/O manager has not taken back, IRQL at most
    /// DISPATCH_LEVEL. `completed`: the IRP was completed to its top (or freed).
    pub fn calling(&self, device: usize, device_is_live: bool, irp: usize, completed: bool) {
        if !device_is_live {
            self.c9(c9::CALL_WITH_INVALID_DEVICE, device as u64, 0, 0);
        }
        if completed {
            self.c9(c9::CALL_WITH_NON_IRP, irp as u64, 0, 0);
        }
        let irql = self.irql();
        if irql > DISPATCH_LEVEL {
            self.c9(c9::CALL_ABOVE_DISPATCH, irql as u64, 0, 0);
        }
    }

    /// The dispatch routine `routine` of `device` returned `status` for the call `call`, its stack location marked
    /// pending or not: the IRQL it was called at, and STATUS_PENDING if and only if IoMarkIrpPending. STATUS_PENDING
    /// passed up from a lower driver that holds the IRP (`pending_below`) is the lower driver's mark, which
    /// IoCompleteRequest hands up to this location when it completes.
    pub fn returned(
        &self,
        call: &DispatchCall,
        routine: usize,
        device: usize,
        status: NTSTATUS,
        marked: bool,
        pending_below: bool,
    ) {
        let after = self.irql();
        if after != call.irql() {
            self.c9(c9::DISPATCH_CHANGED_IRQL, device as u64, call.irql() as u64, after as u64);
        }
        let pending = status == STATUS_PENDING;
        if pending && !marked && !pending_below {
            self.c9(c9::PENDING_NOT_MARKED, routine as u64, call.irp as u64, device as u64);
        }
        if marked && !pending {
            self.c9(c9::MARKED_NOT_PENDING, routine as u64, call.irp as u64, device as u64);
        }
    }
}
