//! Bug check codes and their names as Windows gives them: the one table the NT model (to print a STOP) and the
//! runner (to name a STOP it read, or one QMP reported without a name) both use.
//! Source: Microsoft's "Bug Check Code Reference" (learn.microsoft.com/windows-hardware/drivers/debugger/
//! bug-check-code-reference2) and each code's own page, e.g. "Bug Check 0xE6: DRIVER_VERIFIER_DMA_VIOLATION".

pub const IRQL_NOT_LESS_OR_EQUAL: u32 = 0x0A;
pub const BAD_POOL_HEADER: u32 = 0x19;
pub const KMODE_EXCEPTION_NOT_HANDLED: u32 = 0x1E;
pub const SYSTEM_SERVICE_EXCEPTION: u32 = 0x3B;
pub const MULTIPLE_IRP_COMPLETE_REQUESTS: u32 = 0x44;
pub const PAGE_FAULT_IN_NONPAGED_AREA: u32 = 0x50;
/// A process exited with pages a driver locked in it (0xCB when they are tracked): bug-check-0x76--process-has-locked-
/// pages, bug-check-0xcb--driver-left-locked-pages-in-process.
pub const PROCESS_HAS_LOCKED_PAGES: u32 = 0x76;
pub const DRIVER_LEFT_LOCKED_PAGES_IN_PROCESS: u32 = 0xCB;
pub const SYSTEM_THREAD_EXCEPTION_NOT_HANDLED: u32 = 0x7E;
pub const DRIVER_POWER_STATE_FAILURE: u32 = 0x9F;
/// A wait that would block, made by a DPC routine: bug-check-0xb8--attempted-switch-from-dpc.
pub const ATTEMPTED_SWITCH_FROM_DPC: u32 = 0xB8;
pub const SPECIAL_POOL_DETECTED_MEMORY_CORRUPTION: u32 = 0xC1;
pub const BAD_POOL_CALLER: u32 = 0xC2;
pub const DRIVER_VERIFIER_DETECTED_VIOLATION: u32 = 0xC4;
pub const DRIVER_CORRUPTED_EXPOOL: u32 = 0xC5;
pub const DRIVER_VERIFIER_IOMANAGER_VIOLATION: u32 = 0xC9;
pub const DRIVER_IRQL_NOT_LESS_OR_EQUAL: u32 = 0xD1;
pub const DRIVER_PAGE_FAULT_IN_FREED_SPECIAL_POOL: u32 = 0xD5;
/// Special Pool's guard page touched by a driver (0xD6) or by the system on its behalf (0xCD); freed special pool
/// touched by the system (0xCC; 0xD5 when the driver's own code did): bug-check-0xd6--driver-page-fault-beyond-end-of-
/// allocation, bug-check-0xcd--page-fault-beyond-end-of-allocation, bug-check-0xcc--page-fault-in-freed-special-pool.
pub const DRIVER_PAGE_FAULT_BEYOND_END_OF_ALLOCATION: u32 = 0xD6;
pub const PAGE_FAULT_BEYOND_END_OF_ALLOCATION: u32 = 0xCD;
pub const PAGE_FAULT_IN_FREED_SPECIAL_POOL: u32 = 0xCC;
pub const DRIVER_VERIFIER_DMA_VIOLATION: u32 = 0xE6;
// The asynchronous paths' codes (interrupts, DPCs, timers, work items): bug-check-0xc7--timer-or-dpc-invalid,
// bug-check-0xce--driver-unloaded-without-cancelling-pending-operations, bug-check-0xe4--worker-invalid,
// bug-check-0x133-dpc-watchdog-violation.
pub const TIMER_OR_DPC_INVALID: u32 = 0xC7;
pub const DRIVER_UNLOADED_WITHOUT_CANCELLING_PENDING_OPERATIONS: u32 = 0xCE;
/// 0xCE's form at raised IRQL (a DPC or ISR of an unloaded driver), page
/// bug-check-0xd4--system-scan-at-raised-irql-caught-improper-driver-unlo.
pub const SYSTEM_SCAN_AT_RAISED_IRQL_CAUGHT_IMPROPER_DRIVER_UNLOAD: u32 = 0xD4;
pub const WORKER_INVALID: u32 = 0xE4;
pub const DPC_WATCHDOG_VIOLATION: u32 = 0x133;
/// A cancel routine returned holding the system's cancel spin lock: bug-check-0x11b---driver-returned-holding-cancel-
/// lock (P1 the IRP, P2 the cancel routine).
pub const DRIVER_RETURNED_HOLDING_CANCEL_LOCK: u32 = 0x11B;

/// Windows' symbolic name of a bug check code the model raises or a driver of this kind meets; None for others.
pub fn bugcheck_name(code: u32) -> Option<&'static str> {
    Some(match code {
        IRQL_NOT_LESS_OR_EQUAL => "IRQL_NOT_LESS_OR_EQUAL",
        BAD_POOL_HEADER => "BAD_POOL_HEADER",
        KMODE_EXCEPTION_NOT_HANDLED => "KMODE_EXCEPTION_NOT_HANDLED",
        SYSTEM_SERVICE_EXCEPTION => "SYSTEM_SERVICE_EXCEPTION",
        MULTIPLE_IRP_COMPLETE_REQUESTS => "MULTIPLE_IRP_COMPLETE_REQUESTS",
        PAGE_FAULT_IN_NONPAGED_AREA => "PAGE_FAULT_IN_NONPAGED_AREA",
        PROCESS_HAS_LOCKED_PAGES => "PROCESS_HAS_LOCKED_PAGES",
        DRIVER_LEFT_LOCKED_PAGES_IN_PROCESS => "DRIVER_LEFT_LOCKED_PAGES_IN_PROCESS",
        SYSTEM_THREAD_EXCEPTION_NOT_HANDLED => "SYSTEM_THREAD_EXCEPTION_NOT_HANDLED",
        DRIVER_POWER_STATE_FAILURE => "DRIVER_POWER_STATE_FAILURE",
        ATTEMPTED_SWITCH_FROM_DPC => "ATTEMPTED_SWITCH_FROM_DPC",
        SPECIAL_POOL_DETECTED_MEMORY_CORRUPTION => "SPECIAL_POOL_DETECTED_MEMORY_CORRUPTION",
        BAD_POOL_CALLER => "BAD_POOL_CALLER",
        DRIVER_VERIFIER_DETECTED_VIOLATION => "DRIVER_VERIFIER_DETECTED_VIOLATION",
        DRIVER_CORRUPTED_EXPOOL => "DRIVER_CORRUPTED_EXPOOL",
        DRIVER_VERIFIER_IOMANAGER_VIOLATION => "DRIVER_VERIFIER_IOMANAGER_VIOLATION",
        DRIVER_IRQL_NOT_LESS_OR_EQUAL => "DRIVER_IRQL_NOT_LESS_OR_EQUAL",
        DRIVER_PAGE_FAULT_IN_FREED_SPECIAL_POOL => "DRIVER_PAGE_FAULT_IN_FREED_SPECIAL_POOL",
        DRIVER_PAGE_FAULT_BEYOND_END_OF_ALLOCATION => "DRIVER_PAGE_FAULT_BEYOND_END_OF_ALLOCATION",
        PAGE_FAULT_BEYOND_END_OF_ALLOCATION => "PAGE_FAULT_BEYOND_END_OF_ALLOCATION",
        PAGE_FAULT_IN_FREED_SPECIAL_POOL => "PAGE_FAULT_IN_FREED_SPECIAL_POOL",
        DRIVER_VERIFIER_DMA_VIOLATION => "DRIVER_VERIFIER_DMA_VIOLATION",
        TIMER_OR_DPC_INVALID => "TIMER_OR_DPC_INVALID",
        DRIVER_UNLOADED_WITHOUT_CANCELLING_PENDING_OPERATIONS => {
            "DRIVER_UNLOADED_WITHOUT_CANCELLING_PENDING_OPERATIONS"
        }
        SYSTEM_SCAN_AT_RAISED_IRQL_CAUGHT_IMPROPER_DRIVER_UNLOAD => {
            "SYSTEM_SCAN_AT_RAISED_IRQL_CAUGHT_IMPROPER_DRIVER_UNLOAD"
        }
        WORKER_INVALID => "WORKER_INVALID",
        DPC_WATCHDOG_VIOLATION => "DPC_WATCHDOG_VIOLATION",
        DRIVER_RETURNED_HOLDING_CANCEL_LOCK => "DRIVER_RETURNED_HOLDING_CANCEL_LOCK",
        _ => return None,
    })
}
