//! What a bugcheck's four parameters mean, so a report can name them: Windows' documented meaning per code and, for
//! 0xC4 and 0xE6, per rule (the subcode in P1). The codes are vhca-ntapi's and the subcodes vhca-ntmodel's constants.
//! Only what the rig raises is here: the NT model's verifier rules (docs/verifier.md lists each with its Microsoft
//! page) and the loader's 0x7E/0x50 for a fault in the driver. Any other code or subcode gets its name only.

use vhca_ntapi::{
    DRIVER_IRQL_NOT_LESS_OR_EQUAL, DRIVER_VERIFIER_DETECTED_VIOLATION, DRIVER_VERIFIER_DMA_VIOLATION,
    IRQL_NOT_LESS_OR_EQUAL, PAGE_FAULT_IN_NONPAGED_AREA, SYSTEM_THREAD_EXCEPTION_NOT_HANDLED,
};
use vhca_ntmodel::verifier::{c4, e6};

/// What one bugcheck's parameters mean, as far as the rig knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BugcheckMeaning {
    /// The verifier rule P1 selects, for codes whose P1 is a subcode.
    pub rule: Option<&'static str>,
    /// P1..P4; `None` where the parameter is unused or its meaning is not known here.
    pub params: [Option<&'static str>; 4],
}

const SUBCODE: Option<&str> = Some("subcode: the rule that was broken");

/// The meaning of the parameters of bugcheck `code` whose P1 is `p1`.
pub fn bugcheck_meaning(code: u32, p1: Option<u64>) -> BugcheckMeaning {
    let rule_table = match code {
        DRIVER_VERIFIER_DMA_VIOLATION => E6_RULES,
        DRIVER_VERIFIER_DETECTED_VIOLATION => C4_RULES,
        _ => {
            let params = CODES.iter().find(|(c, _)| *c == code).map_or([None; 4], |(_, p)| p.map(Some));
            return BugcheckMeaning { rule: None, params };
        }
    };
    match p1.and_then(|p1| rule_table.iter().find(|r| r.subcode == p1)) {
        Some(r) => {
            let [p2, p3, p4] = r.params();
            BugcheckMeaning { rule: Some(r.what), params: [SUBCODE, p2, p3, p4] }
        }
        None => BugcheckMeaning { rule: None, params: [SUBCODE, None, None, None] },
    }
}

/// Codes whose four parameters mean the same whatever P1 is.
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
];

/// One rule under 0xC4 or 0xE6: its subcode, what it means, and P2..P4 as `P2 | P3 | P4` (empty: unused), the
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
            *slot = (!text.is_empty()).then_some(text);
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
    rule(
        c4::PROBE_AND_LOCK_NONPAGED_MDL,
        "MmProbeAndLockPages on an MDL built for non-paged pool",
        "MDL | MDL flags | the flag at fault",
    ),
    rule(c4::KERNEL_API_WRONG_IRQL, "a kernel routine called at the wrong IRQL", "current IRQL |  | "),
    rule(c4::WAIT_ABOVE_DISPATCH, "waiting on a mutex above DISPATCH_LEVEL", "current IRQL | mutex | "),
    rule(
        c4::WAIT_AT_DISPATCH_NO_TIMEOUT,
        "waiting on a mutex at DISPATCH_LEVEL without a timeout",
        "current IRQL | mutex | ",
    ),
    rule(c4::ENTER_CRITICAL_REGION_ABOVE_APC, "KeEnterCriticalRegion above APC_LEVEL", "current IRQL |  | "),
    rule(c4::LEAVE_CRITICAL_REGION_ABOVE_APC, "KeLeaveCriticalRegion above APC_LEVEL", "current IRQL |  | "),
    rule(c4::SELF_DEADLOCK, "a non-recursive lock re-acquired by its holder", "lock |  | "),
    rule(c4::LOCK_HIERARCHY_VIOLATION, "locks taken in an order that closes a cycle", "lock |  | "),
    rule(
        c4::WRONG_THREAD_RELEASE,
        "a lock released by a thread that does not hold it",
        "lock | owner thread | releasing thread",
    ),
    rule(c4::RELEASE_UNACQUIRED, "a lock released while nobody holds it", "lock |  | "),
    rule(c4::RULE_IRQL_IO_PASSIVE5, "DDI rule IrqlIoPassive5: IoGetDmaAdapter not at PASSIVE_LEVEL", " |  | "),
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
    fn every_subcode_appears_once_with_three_columns() {
        for table in [E6_RULES, C4_RULES] {
            for (i, r) in table.iter().enumerate() {
                assert!(table[i + 1..].iter().all(|o| o.subcode != r.subcode), "subcode {:#X} twice", r.subcode);
                assert_eq!(r.params.split('|').count(), 3, "subcode {:#X}: {}", r.subcode, r.params);
            }
        }
    }
}
