//! What a bugcheck's four parameters mean, so a report can name them: Windows' documented meaning per code and, for
//! codes whose P1 selects the check that fired (0xC4, 0xE6, 0xC9 by subcode; 0x133, 0xC7, 0xE4 by form), per check.
//! Every code and subcode the rig raises is here, each with its Microsoft page's parameter table: the NT model's
//! (docs/verifier.md lists them with their pages), the loader's I/O manager (0xC9, 0x44, 0x35) and its 0x7E/0x50 for
//! a fault in the driver; tests/bugcheck_params_seed.rs holds the seed suite's expectations to that. Where the model
//! fills a parameter otherwise than Windows, the text says so. Any other code or subcode gets its name only. The
//! codes and subcodes are vhca-ntapi's and vhca-ntmodel's constants where those are public; the rest are literals
//! that name their source.

use vhca_ntapi::{
    ATTEMPTED_SWITCH_FROM_DPC, DPC_WATCHDOG_VIOLATION, DRIVER_IRQL_NOT_LESS_OR_EQUAL,
    DRIVER_LEFT_LOCKED_PAGES_IN_PROCESS, DRIVER_PAGE_FAULT_BEYOND_END_OF_ALLOCATION,
    DRIVER_PAGE_FAULT_IN_FREED_SPECIAL_POOL, DRIVER_VERIFIER_DETECTED_VIOLATION, DRIVER_VERIFIER_DMA_VIOLATION,
    DRIVER_VERIFIER_IOMANAGER_VIOLATION, IRQL_NOT_LESS_OR_EQUAL, MULTIPLE_IRP_COMPLETE_REQUESTS,
    PAGE_FAULT_BEYOND_END_OF_ALLOCATION, PAGE_FAULT_IN_FREED_SPECIAL_POOL, PAGE_FAULT_IN_NONPAGED_AREA,
    PROCESS_HAS_LOCKED_PAGES, SPECIAL_POOL_DETECTED_MEMORY_CORRUPTION,
    SYSTEM_SCAN_AT_RAISED_IRQL_CAUGHT_IMPROPER_DRIVER_UNLOAD, SYSTEM_THREAD_EXCEPTION_NOT_HANDLED,
    TIMER_OR_DPC_INVALID, WORKER_INVALID,
};
use vhca_ntmodel::pool_types::C4_EXECUTABLE_POOL;
use vhca_ntmodel::verifier::{c4, c7, e4, e6};

/// What one bugcheck's parameters mean, as far as the rig knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BugcheckMeaning {
    /// The check P1 selects (a verifier rule, or one form of a kernel check), for codes whose P1 selects one.
    pub rule: Option<&'static str>,
    /// P1..P4; `None` where the parameter is unused or its meaning is not known here.
    pub params: [Option<&'static str>; 4],
}

const SUBCODE: Option<&str> = Some("subcode: the rule that was broken");

/// The loader raises 0x35 by number (vhca-loader's irp_dispatch.rs); vhca-ntapi has no constant for it and the suite
/// does not depend on the loader.
const NO_MORE_IRP_STACK_LOCATIONS: u32 = 0x35;

/// The meaning of the parameters of bugcheck `code` whose P1 is `p1`.
pub fn bugcheck_meaning(code: u32, p1: Option<u64>) -> BugcheckMeaning {
    let Some(table) = RULE_TABLES.iter().find(|t| t.code == code) else {
        let params = CODES.iter().find(|(c, _)| *c == code).map_or([None; 4], |(_, p)| p.map(used));
        return BugcheckMeaning { rule: None, params };
    };
    match p1.and_then(|p1| table.rules.iter().find(|r| r.subcode == p1)) {
        Some(r) => {
            let [p2, p3, p4] = r.params();
            BugcheckMeaning { rule: Some(r.what), params: [table.p1, p2, p3, p4] }
        }
        None => BugcheckMeaning { rule: None, params: [table.p1, None, None, None] },
    }
}

/// A parameter's text, `None` for an empty one (unused, reserved or 0 on Windows).
fn used(text: &'static str) -> Option<&'static str> {
    (!text.is_empty()).then_some(text)
}

/// Codes whose four parameters mean the same whatever P1 is; "" where Windows leaves one unused or reserved.
const CODES: &[(u32, [&str; 4])] = &[
    (
        IRQL_NOT_LESS_OR_EQUAL,
        [
            "address referenced",
            "IRQL at the reference",
            "access: 0 read, 1 write",
            "address of the instruction (the model: 0)",
        ],
    ),
    (
        DRIVER_IRQL_NOT_LESS_OR_EQUAL,
        [
            "address referenced",
            "IRQL at the reference",
            "access: 0 read, 1 write",
            "address of the instruction (the model: 0)",
        ],
    ),
    (
        PAGE_FAULT_IN_NONPAGED_AREA,
        [
            "address referenced",
            "access: 0 read, 1 or 2 write, 0x10 execute",
            "address of the instruction",
            "type of fault",
        ],
    ),
    (
        SYSTEM_THREAD_EXCEPTION_NOT_HANDLED,
        ["exception code", "address of the instruction", "exception record", "context record"],
    ),
    // bug-check-0x35--no-more-irp-stack-locations: IoCallDriver with no stack location left for the lower driver.
    (NO_MORE_IRP_STACK_LOCATIONS, ["address of the IRP", "", "", ""]),
    // bug-check-0x44--multiple-irp-complete-requests: IofCompleteRequest's own check, in every mode.
    (MULTIPLE_IRP_COMPLETE_REQUESTS, ["address of the IRP", "", "", ""]),
    // bug-check-0xb8--attempted-switch-from-dpc: a wait or yield from a DPC routine or an ISR.
    (
        ATTEMPTED_SWITCH_FROM_DPC,
        [
            "the original thread, the cause of the failure (the model: the borrowed thread's ETHREAD stand-in)",
            "the new thread (the model: the processor's idle-thread stand-in)",
            "the original thread's stack address (the model: its wait or delay frame)",
            "",
        ],
    ),
    // A process's exit with pages a driver left locked: bug-check-0x76--process-has-locked-pages (without
    // TrackLockedPages, Windows' default, the form whose P1 is 0) and, under Driver Verifier's Pool Tracking,
    // bug-check-0xcb--driver-left-locked-pages-in-process (docs/verifier.md, "A user process").
    (
        PROCESS_HAS_LOCKED_PAGES,
        [
            "0: locked pages were found in the process being ended",
            "the process (the model's stand-in for its EPROCESS)",
            "the number of locked pages",
            "the driver stacks, with TrackLockedPages set (the model: 0)",
        ],
    ),
    (
        DRIVER_LEFT_LOCKED_PAGES_IN_PROCESS,
        [
            "the address in the driver that locked the pages (the model keeps no call site: the MDL)",
            "the caller of that address (the model: 0)",
            "the MDL holding the locked pages",
            "the number of locked pages",
        ],
    ),
    // Special Pool's faults: bug-check-0xd6--driver-page-fault-beyond-end-of-allocation,
    // bug-check-0xcd--page-fault-beyond-end-of-allocation, bug-check-0xd5--driver-page-fault-in-freed-special-pool,
    // bug-check-0xcc--page-fault-in-freed-special-pool. The D-codes when the driver's own code touched the page,
    // the C-codes when a routine outside its image did (docs/verifier.md, "Special Pool").
    (
        DRIVER_PAGE_FAULT_BEYOND_END_OF_ALLOCATION,
        [
            "memory referenced (the guard page past the block, or before it under Verify Start)",
            "access: 0 read, 1 write",
            "address that referenced the memory (the model's own check: 0)",
            "",
        ],
    ),
    (
        PAGE_FAULT_BEYOND_END_OF_ALLOCATION,
        ["memory referenced (a guard page)", "access: 0 read, 1 write", "address that referenced the memory", ""],
    ),
    (
        DRIVER_PAGE_FAULT_IN_FREED_SPECIAL_POOL,
        [
            "memory referenced (a freed special pool block)",
            "access: 0 read, 1 write",
            "address that referenced the memory (the model's own check: 0)",
            "",
        ],
    ),
    (
        PAGE_FAULT_IN_FREED_SPECIAL_POOL,
        [
            "memory referenced (a freed special pool block)",
            "access: 0 read, 1 write",
            "address that referenced the memory",
            "",
        ],
    ),
    // bug-check-0xc1--special-pool-detected-memory-corruption: found at the free; P4, not P1, is the subclass
    // (0x23 bytes before the block changed, 0x24 bytes after its end).
    (
        SPECIAL_POOL_DETECTED_MEMORY_CORRUPTION,
        [
            "address the driver freed",
            "reserved (the model: the first pattern byte found changed)",
            "0 or the address of the corruption (the model: 0)",
            "subclass: 0x23 underrun, 0x24 overrun short of the guard page",
        ],
    ),
    // bug-check-0xd4--system-scan-at-raised-irql-caught-improper-driver-unlo: the kernel calls a DPC or ISR of a
    // driver that has unloaded.
    (
        SYSTEM_SCAN_AT_RAISED_IRQL_CAUGHT_IMPROPER_DRIVER_UNLOAD,
        [
            "memory referenced (the model: the unloaded routine's address)",
            "IRQL at the reference",
            "access: 0 read, 1 write (the model: 0, the fetch of the routine's first instruction)",
            "address that referenced the memory (the model: the routine itself)",
        ],
    ),
];

/// A code whose P1 selects the check that fired, each check with its own P2..P4.
struct RuleTable {
    code: u32,
    /// What P1 is.
    p1: Option<&'static str>,
    rules: &'static [Rule],
}

const RULE_TABLES: &[RuleTable] = &[
    RuleTable { code: DRIVER_VERIFIER_DMA_VIOLATION, p1: SUBCODE, rules: E6_RULES },
    RuleTable { code: DRIVER_VERIFIER_DETECTED_VIOLATION, p1: SUBCODE, rules: C4_RULES },
    RuleTable { code: DRIVER_VERIFIER_IOMANAGER_VIOLATION, p1: SUBCODE, rules: C9_RULES },
    RuleTable {
        code: DPC_WATCHDOG_VIOLATION,
        p1: Some("which watchdog: 0 one DPC or ISR, 1 the time at DISPATCH_LEVEL or above"),
        rules: WATCHDOG_RULES,
    },
    RuleTable {
        code: TIMER_OR_DPC_INVALID,
        p1: Some("what was found where it is not permitted: 0 timer, 1 DPC object, 2 DPC routine"),
        rules: C7_RULES,
    },
    RuleTable { code: WORKER_INVALID, p1: Some("type of violation"), rules: E4_RULES },
];

/// One rule under a `RuleTable`: its P1, what it means, and P2..P4 as `P2 | P3 | P4` (empty: unused), the
/// columns of docs/verifier.md's tables.
struct Rule {
    subcode: u64,
    what: &'static str,
    params: &'static str,
}

const fn rule(subcode: u64, what: &'static str, params: &'static str) -> Rule {
    Rule { subcode, what, params }
}

impl Rule {
    fn params(&self) -> [Option<&'static str>; 3] {
        let mut out = [None; 3];
        for (slot, text) in out.iter_mut().zip(self.params.split('|').map(str::trim)) {
            *slot = used(text);
        }
        out
    }
}

const E6_RULES: &[Rule] = &[
    rule(e6::MISC, "miscellaneous (P2 says which: 0x2 out of contiguous map registers)", "which check |  | "),
    rule(
        e6::TOO_MANY_COMMON_BUFFERS_FREED,
        "more common buffers freed than allocated",
        "extra common buffers freed |  | ",
    ),
    rule(
        e6::TOO_MANY_ADAPTER_CHANNELS_FREED,
        "more adapter channels freed than allocated",
        "extra adapter channels freed |  | ",
    ),
    rule(
        e6::TOO_MANY_MAP_REGISTERS_FREED,
        "more map registers freed than allocated",
        "extra map registers freed |  | ",
    ),
    rule(
        e6::TOO_MANY_SG_LISTS_FREED,
        "more scatter/gather lists freed than allocated",
        "S/G lists allocated | S/G lists freed | ",
    ),
    rule(
        e6::OUTSTANDING_COMMON_BUFFERS,
        "adapter put back with common buffers outstanding",
        "DMA adapter | outstanding common buffers | ",
    ),
    rule(
        e6::OUTSTANDING_ADAPTER_CHANNELS,
        "adapter put back with adapter channels outstanding",
        "DMA adapter | outstanding adapter channels | ",
    ),
    rule(
        e6::OUTSTANDING_MAP_REGISTERS,
        "adapter put back with map registers outstanding",
        "DMA adapter | outstanding map registers | ",
    ),
    rule(
        e6::OUTSTANDING_SG_LISTS,
        "adapter put back with scatter/gather lists outstanding",
        "DMA adapter | outstanding S/G lists | ",
    ),
    rule(
        e6::TOO_MANY_ADAPTER_CHANNELS,
        "a second adapter channel while one is held",
        "outstanding adapter channels |  | ",
    ),
    rule(
        e6::TOO_MANY_MAP_REGISTERS_AT_ONCE,
        "more map registers asked for than IoGetDmaAdapter granted",
        "map registers asked for | most granted (NumberOfMapRegisters) | ",
    ),
    rule(
        e6::NOT_FLUSHED,
        "a new transfer mapped before the previous one was flushed",
        "bytes mapped | bytes mappable at once | ",
    ),
    rule(e6::PAGED_MEMORY, "DMA on memory neither locked nor non-paged", "MDL |  | "),
    rule(
        e6::OVERRUN,
        "the device wrote past the buffer (the verifier's padding changed)",
        "0x4 padding before, 0x5 padding after | buffer start | address of the corruption",
    ),
    rule(e6::FREED_WHILE_MAPPED, "map registers freed with transfers not flushed", "map registers still mapped |  | "),
    rule(
        e6::IMPROPER_IRQL,
        "a DMA routine called at an improper IRQL",
        "0x1 not the IRQL required, 0x2 above the maximum | IRQL required (P2 0x1) or maximum (P2 0x2) | current IRQL",
    ),
    rule(e6::IMPROPER_IRQL_OTHER, "a DMA routine called at an improper IRQL (PutDmaAdapter)", " |  | "),
    rule(
        e6::TOO_MANY_MAP_REGISTERS,
        "a transfer beyond the map registers allocated",
        "map registers the transfer needs | map registers held | ",
    ),
    rule(e6::FLUSH_NOT_MAPPED, "a buffer flushed that is not mapped", "map-register base |  | "),
    rule(e6::ADAPTER_ALREADY_RELEASED, "a DMA routine on an adapter already put back", "DMA adapter |  | "),
    rule(
        e6::ALREADY_MAPPED,
        "a range mapped that overlaps a mapping still out",
        "start | end | first address already mapped",
    ),
    rule(e6::ZERO_LENGTH_MAP, "a zero-length buffer mapped", " |  | "),
    // vhca-ntmodel's dma_adapter::dma_v3::UNKNOWN_DEVICE_DESCRIPTION_VERSION, private to the DMA adapter.
    rule(0x25, "IoGetDmaAdapter with an unknown DEVICE_DESCRIPTION version (the model: Version past 3)", " |  | "),
    rule(
        e6::IOMMU_VIOLATION,
        "the IOMMU refused the device's access",
        "device object | faulting device address | fault type (VT-d fault reason)",
    ),
];

const C4_RULES: &[Rule] = &[
    rule(c4::ZERO_BYTE_ALLOCATION, "zero-byte pool allocation", "current IRQL | pool type | "),
    rule(c4::PAGED_ALLOC_ABOVE_APC, "paged pool allocated above APC_LEVEL", "current IRQL | pool type | bytes"),
    rule(
        c4::NONPAGED_ALLOC_ABOVE_DISPATCH,
        "non-paged pool allocated above DISPATCH_LEVEL",
        "current IRQL | pool type | bytes",
    ),
    rule(c4::FREE_BAD_ADDRESS, "freeing an address no allocation returned", "address |  | "),
    rule(c4::FREE_PAGED_ABOVE_APC, "paged pool freed above APC_LEVEL", "current IRQL | pool type | address"),
    rule(
        c4::FREE_NONPAGED_ABOVE_DISPATCH,
        "non-paged pool freed above DISPATCH_LEVEL",
        "current IRQL | pool type | address",
    ),
    rule(c4::FREE_ALREADY_FREED, "pool freed a second time", " | address | "),
    rule(c4::RAISE_IRQL_INVALID, "KeRaiseIrql to a lower IRQL", "current IRQL | IRQL requested | "),
    rule(c4::LOWER_IRQL_INVALID, "KeLowerIrql to a higher IRQL", "current IRQL | IRQL requested | "),
    rule(c4::RELEASE_SPIN_LOCK_NOT_DISPATCH, "spin lock released not at DISPATCH_LEVEL", "current IRQL | spin lock | "),
    rule(c4::ACQUIRE_FAST_MUTEX_ABOVE_APC, "fast mutex acquired above APC_LEVEL", "current IRQL | fast mutex | "),
    rule(c4::RELEASE_FAST_MUTEX_NOT_APC, "fast mutex released not at APC_LEVEL", "current IRQL | fast mutex | "),
    rule(
        c4::ACQUIRE_RESOURCE_APCS_ENABLED,
        "resource acquired with APCs enabled",
        "current IRQL | APC disable count | resource",
    ),
    rule(
        c4::RELEASE_RESOURCE_APCS_ENABLED,
        "resource released with APCs enabled",
        "current IRQL | APC disable count | resource",
    ),
    rule(c4::LEAVE_CRITICAL_REGION_NOT_IN_ONE, "KeLeaveCriticalRegion outside a critical region", " |  | "),
    rule(
        c4::ACQUIRE_SPIN_LOCK_AT_DPC_BELOW_DISPATCH,
        "KeAcquireSpinLockAtDpcLevel below DISPATCH_LEVEL",
        "current IRQL | spin lock | ",
    ),
    rule(
        c4::RELEASE_SPIN_LOCK_FROM_DPC_BELOW_DISPATCH,
        "KeReleaseSpinLockFromDpcLevel below DISPATCH_LEVEL",
        "current IRQL | spin lock | ",
    ),
    rule(
        c4::ACQUIRE_SPIN_LOCK_ABOVE_DISPATCH,
        "spin lock acquired above DISPATCH_LEVEL",
        "current IRQL | spin lock | ",
    ),
    rule(
        c4::UNLOAD_WITH_POOL_ALLOCATIONS,
        "driver unloaded with pool still allocated",
        "paged bytes | non-paged bytes | allocations",
    ),
    rule(
        c4::PROBE_AND_LOCK_ABOVE_DISPATCH,
        "MmProbeAndLockPages above DISPATCH_LEVEL",
        "current IRQL | MDL | access mode",
    ),
    rule(c4::UNLOCK_PAGES_ABOVE_DISPATCH, "MmUnlockPages above DISPATCH_LEVEL", "current IRQL | MDL | "),
    rule(c4::UNLOCK_PAGES_NEVER_LOCKED, "MmUnlockPages of an MDL never locked", "MDL | MDL flags | "),
    rule(c4::UNLOCK_PAGES_NONPAGED_POOL, "MmUnlockPages of an MDL built for non-paged pool", "MDL | MDL flags | "),
    rule(
        c4::BUILD_MDL_FOR_PAGED_POOL,
        "MmBuildMdlForNonPagedPool on pageable memory",
        "current IRQL | MDL | MDL flags",
    ),
    rule(c4::SET_EVENT_ABOVE_DISPATCH, "KeSetEvent above DISPATCH_LEVEL", "current IRQL | event | "),
    rule(
        c4::PROBE_AND_LOCK_NONPAGED_MDL,
        "MmProbeAndLockPages on an MDL built for non-paged pool",
        "MDL | MDL flags | the flag at fault",
    ),
    rule(c4::KERNEL_API_WRONG_IRQL, "a kernel routine called at the wrong IRQL", "current IRQL |  | "),
    rule(
        c4::ISR_CHANGED_IRQL,
        "the ISR returned at another IRQL than it was called at",
        "ISR (the model: its stand-in address) | IRQL before the ISR | IRQL after it",
    ),
    rule(c4::ENTER_CRITICAL_REGION_ABOVE_APC, "KeEnterCriticalRegion above APC_LEVEL", "current IRQL |  | "),
    rule(c4::LEAVE_CRITICAL_REGION_ABOVE_APC, "KeLeaveCriticalRegion above APC_LEVEL", "current IRQL |  | "),
    rule(
        c4::WAIT_ABOVE_DISPATCH,
        "a wait (KeWaitForSingleObject, a mutex wait) above DISPATCH_LEVEL",
        "address of the IRQL (the model: the IRQL) | object waited on | address of the timeout (the model: the \
         timeout, 0 for none)",
    ),
    rule(
        c4::WAIT_AT_DISPATCH_NO_TIMEOUT,
        "a wait at DISPATCH_LEVEL with no timeout",
        "address of the IRQL (the model: the IRQL) | object waited on | address of the timeout: NULL (the model: 0)",
    ),
    rule(
        c4::WAIT_AT_DISPATCH_NONZERO_TIMEOUT,
        "a wait at DISPATCH_LEVEL with a non-zero timeout",
        "address of the IRQL (the model: the IRQL) | object waited on | address of the timeout (the model: the \
         timeout)",
    ),
    rule(c4::SELF_DEADLOCK, "a non-recursive lock re-acquired by its holder", "lock |  | "),
    rule(c4::LOCK_HIERARCHY_VIOLATION, "locks taken in an order that closes a cycle", "lock |  | "),
    // The NT model raises 0x1002 by number (locks.rs, lib.rs never_initialised).
    rule(
        0x1002,
        "a resource acquired without being initialised (the model: any lock, DPC, timer, event, interrupt or work \
         item never initialised)",
        "resource (the model: the object's address) |  | ",
    ),
    rule(
        c4::WRONG_THREAD_RELEASE,
        "a lock released by a thread that does not hold it",
        "lock | owner thread | releasing thread",
    ),
    rule(c4::RELEASE_UNACQUIRED, "a lock released while nobody holds it", "lock |  | "),
    // Code integrity checks' row (code-integrity-checking); the 0xC4 page's own 0x2000 row is Storport's.
    rule(
        C4_EXECUTABLE_POOL,
        "an executable pool type requested (Code integrity checks; expected: NonPagedPoolNx)",
        "address in the driver's code | pool type | pool tag",
    ),
    rule(c4::RULE_IRQL_IO_PASSIVE5, "DDI rule IrqlIoPassive5: IoGetDmaAdapter not at PASSIVE_LEVEL", " |  | "),
];

// vhca-loader's io_verification::c9, which the suite does not depend on; rows as the 0xC9 page gives them. For the
// I/O error codes (0x200 and up) the page gives the crash dump's form: P2 the address in the driver's code where the
// error was found, P3 the IRP, P4 the device object.
const C9_RULES: &[Rule] = &[
    rule(
        0x03,
        "IoCallDriver with an IRP whose Type is not IO_TYPE_IRP (the model: one completed to its top, or freed)",
        "IRP being sent |  | ",
    ),
    rule(0x04, "IoCallDriver with an invalid device object", "device object |  | "),
    rule(
        0x05,
        "the IRQL changed during a call to the driver's dispatch routine",
        "device object of the driver | IRQL before IoCallDriver | IRQL after it",
    ),
    rule(0x06, "IoCompleteRequest with a status marked pending (or -1)", "IRP status | IRP being completed | "),
    rule(0x07, "IoCompleteRequest with the IRP's cancel routine still set", "cancel routine | IRP being completed | "),
    rule(0x0E, "IoCompleteRequest above DISPATCH_LEVEL", "current IRQL | IRP | "),
    rule(0x10, "IoCallDriver above DISPATCH_LEVEL", "current IRQL |  | "),
    rule(
        0x203,
        "IoCallDriver with the IRP's cancel routine still set",
        "address in the driver's code (the model: the caller's dispatch routine, 0 for none) | IRP | device object",
    ),
    rule(
        0x205,
        "an IRP forwarded that is still queued beneath its caller (a lower driver holds it pending)",
        "address in the driver's code (the model: its dispatch routine) | IRP | device object",
    ),
    rule(
        0x209,
        "an IRP completed that is still queued beneath its caller (a lower driver holds it pending)",
        "address in the driver's code (the model: its dispatch routine) | IRP | device object",
    ),
    rule(
        0x23D,
        "STATUS_PENDING returned without IoMarkIrpPending",
        "address in the driver's code (the model: its dispatch routine) | IRP | device object",
    ),
    rule(
        0x23E,
        "IoMarkIrpPending without STATUS_PENDING returned",
        "address in the driver's code (the model: its dispatch routine) | IRP | device object",
    ),
];

// bug-check-0x133-dpc-watchdog-violation. P1 is vhca-ntmodel's watchdog::p1, private to the model's watchdog.
const WATCHDOG_RULES: &[Rule] = &[
    rule(
        0x0,
        "a single DPC or ISR exceeded its time allotment",
        "DPC time count, in ticks (the model: the count where it looked) | DPC time allotment, in ticks | \
         DPC_WATCHDOG_GLOBAL_TRIAGE_BLOCK (the model: 0)",
    ),
    rule(
        0x1,
        "the system cumulatively spent too long at DISPATCH_LEVEL or above",
        "watchdog period, in ticks | DPC_WATCHDOG_GLOBAL_TRIAGE_BLOCK (the model: 0) | ",
    ),
];

// bug-check-0xc7--timer-or-dpc-invalid; the model checks at unload, its ranges are stand-ins (docs/verifier.md).
const C7_RULES: &[Rule] = &[
    rule(
        c7::TIMER,
        "a timer object where none is permitted (the model: a timer still set at unload)",
        "timer object | start of the range checked (the model: the driver's objects) | end of the range checked",
    ),
    rule(
        c7::DPC_OBJECT,
        "a DPC object where none is permitted (the model: a DPC still queued at unload)",
        "DPC object | start of the range checked (the model: the driver's objects) | end of the range checked",
    ),
    rule(
        c7::DPC_ROUTINE,
        "a DPC routine where none is permitted (the model: an interrupt still connected at unload)",
        "DPC routine (the model: the ISR's stand-in address) | start of the range checked (the model: the driver's \
         image) | end of the range checked",
    ),
];

// bug-check-0xe4--worker-invalid.
const E4_RULES: &[Rule] = &[
    rule(e4::ACTIVE_ITEM_QUEUED, "an active work item was queued", "work item | queue number | "),
    rule(
        e4::QUEUED_ITEM_FREED,
        "a queued I/O work item was freed",
        "work item | I/O worker routine (the model: its stand-in address) | ",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verifier_rule_names_p1_and_its_own_parameters() {
        let m = bugcheck_meaning(0xE6, Some(0x13));
        assert_eq!(m.rule, Some("a DMA routine called at an improper IRQL"));
        assert_eq!(m.params[0], SUBCODE);
        assert_eq!(m.params[3], Some("current IRQL"));
        let m = bugcheck_meaning(0xC4, Some(0x1004));
        assert_eq!(m.params[2], Some("owner thread"));
    }

    #[test]
    fn unknown_subcodes_and_codes_keep_only_what_is_known() {
        let m = bugcheck_meaning(0xE6, Some(0xFFFF));
        assert_eq!((m.rule, m.params), (None, [SUBCODE, None, None, None]));
        assert_eq!(bugcheck_meaning(0xE6, None).rule, None);
        assert_eq!(bugcheck_meaning(0xABCD, Some(1)), BugcheckMeaning { rule: None, params: [None; 4] });
        assert_eq!(bugcheck_meaning(0x7E, Some(0xC000_0005)).params[0], Some("exception code"));
    }

    #[test]
    fn a_kernel_check_names_its_form_and_reserved_parameters_stay_unnamed() {
        let m = bugcheck_meaning(0x133, Some(1));
        assert_eq!(m.rule, Some("the system cumulatively spent too long at DISPATCH_LEVEL or above"));
        assert!(m.params[0].is_some_and(|p1| p1.starts_with("which watchdog")));
        assert_eq!((m.params[1], m.params[3]), (Some("watchdog period, in ticks"), None));
        let m = bugcheck_meaning(0x44, None);
        assert_eq!((m.rule, m.params), (None, [Some("address of the IRP"), None, None, None]));
    }

    #[test]
    fn every_subcode_appears_once_with_three_columns() {
        for table in RULE_TABLES.iter().map(|t| t.rules) {
            for (i, r) in table.iter().enumerate() {
                assert!(table[i + 1..].iter().all(|o| o.subcode != r.subcode), "subcode {:#X} twice", r.subcode);
                assert_eq!(r.params.split('|').count(), 3, "subcode {:#X}: {}", r.subcode, r.params);
            }
        }
    }
}
