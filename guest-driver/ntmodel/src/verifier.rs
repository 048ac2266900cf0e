//! Driver Verifier settings (Windows' flag values) and the subcodes of every rule the model checks.
//! docs/verifier.md lists each rule with its parameters and the Microsoft page it comes from.

/// Verifier option flags, with the values `verifier /flags` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct VerifierFlags(pub u32);

impl VerifierFlags {
    pub const NONE: VerifierFlags = VerifierFlags(0);
    pub const SPECIAL_POOL: VerifierFlags = VerifierFlags(0x1);
    pub const IRQL_CHECKING: VerifierFlags = VerifierFlags(0x2);
    /// Low Resources Simulation ("Randomized low resources simulation" from Windows 8.1): bit 2.
    pub const LOW_RESOURCES: VerifierFlags = VerifierFlags(0x4);
    pub const POOL_TRACKING: VerifierFlags = VerifierFlags(0x8);
    pub const IO_VERIFICATION: VerifierFlags = VerifierFlags(0x10);
    pub const DEADLOCK_DETECTION: VerifierFlags = VerifierFlags(0x20);
    pub const DMA_CHECKING: VerifierFlags = VerifierFlags(0x80);
    pub const SECURITY_CHECKS: VerifierFlags = VerifierFlags(0x100);
    pub const MISC_CHECKS: VerifierFlags = VerifierFlags(0x800);
    /// DDI compliance checking: the DDI rules (IrqlIoPassive5, ...), part of /standard.
    pub const DDI_COMPLIANCE: VerifierFlags = VerifierFlags(0x20000);
    /// Systematic Low Resource Simulation: bit 18 (Windows 10 and earlier spell it `/flags 0x40000`).
    pub const SYSTEMATIC_LOW_RESOURCES: VerifierFlags = VerifierFlags(0x40000);
    /// Code integrity checks: bit 25, memory integrity's (HVCI's) rules, executable pool among them
    /// (https://learn.microsoft.com/windows-hardware/drivers/devtest/code-integrity-checking).
    pub const CODE_INTEGRITY: VerifierFlags = VerifierFlags(0x2000000);
    /// `verifier /standard`: 0x209BB (special pool, IRQL, pool tracking, I/O, deadlock, DMA, security, misc, ...).
    pub const STANDARD: VerifierFlags = VerifierFlags(0x209BB);

    pub fn contains(self, other: VerifierFlags) -> bool {
        other.0 != 0 && self.0 & other.0 == other.0
    }

    /// The verifier watches the driver at all: its automatic checks (MDL misuse, zero-byte pool) are on.
    pub fn enabled(self) -> bool {
        self.0 != 0
    }

    /// Parses `0x80`, `128`, `standard` or `none`.
    pub fn parse(text: &str) -> Option<VerifierFlags> {
        let t = text.trim();
        match t.to_ascii_lowercase().as_str() {
            "standard" | "/standard" => return Some(VerifierFlags::STANDARD),
            "none" | "off" | "0" => return Some(VerifierFlags::NONE),
            _ => {}
        }
        let v = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
            Some(hex) => u32::from_str_radix(hex, 16).ok()?,
            None => t.parse().ok()?,
        };
        Some(VerifierFlags(v))
    }
}

impl std::ops::BitOr for VerifierFlags {
    type Output = VerifierFlags;
    fn bitor(self, rhs: VerifierFlags) -> VerifierFlags {
        VerifierFlags(self.0 | rhs.0)
    }
}

/// Special Pool's alignment, Windows' system-wide Verify Start / Verify End setting (GFlags; Microsoft, "Detecting
/// Overruns and Underruns"): which misuse faults at once (`memory/special_pool.rs` places the blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpecialPoolAlignment {
    /// The end touches the guard page after it: an overrun faults (0xD6), an underrun is found at free (0xC1).
    #[default]
    VerifyEnd,
    /// The start is the first byte after the guard page before it: an underrun faults, an overrun is found at free.
    VerifyStart,
}

impl SpecialPoolAlignment {
    /// `verify_end` / `end` or `verify_start` / `start` (GFlags' names).
    pub fn parse(text: &str) -> Option<SpecialPoolAlignment> {
        match text.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "verify_end" | "end" => Some(SpecialPoolAlignment::VerifyEnd),
            "verify_start" | "start" => Some(SpecialPoolAlignment::VerifyStart),
            _ => None,
        }
    }
}

/// Parameter 1 values of bugcheck 0xC4 DRIVER_VERIFIER_DETECTED_VIOLATION the model raises.
pub mod c4 {
    pub const ZERO_BYTE_ALLOCATION: u64 = 0x00;
    pub const PAGED_ALLOC_ABOVE_APC: u64 = 0x01;
    pub const NONPAGED_ALLOC_ABOVE_DISPATCH: u64 = 0x02;
    pub const FREE_BAD_ADDRESS: u64 = 0x10;
    pub const FREE_PAGED_ABOVE_APC: u64 = 0x11;
    pub const FREE_NONPAGED_ABOVE_DISPATCH: u64 = 0x12;
    pub const FREE_ALREADY_FREED: u64 = 0x13;
    pub const RAISE_IRQL_INVALID: u64 = 0x30;
    pub const LOWER_IRQL_INVALID: u64 = 0x31;
    pub const RELEASE_SPIN_LOCK_NOT_DISPATCH: u64 = 0x32;
    pub const ACQUIRE_FAST_MUTEX_ABOVE_APC: u64 = 0x33;
    pub const RELEASE_FAST_MUTEX_NOT_APC: u64 = 0x34;
    pub const ACQUIRE_RESOURCE_APCS_ENABLED: u64 = 0x37;
    pub const RELEASE_RESOURCE_APCS_ENABLED: u64 = 0x38;
    pub const LEAVE_CRITICAL_REGION_NOT_IN_ONE: u64 = 0x3E;
    pub const ACQUIRE_SPIN_LOCK_AT_DPC_BELOW_DISPATCH: u64 = 0x40;
    pub const RELEASE_SPIN_LOCK_FROM_DPC_BELOW_DISPATCH: u64 = 0x41;
    pub const ACQUIRE_SPIN_LOCK_ABOVE_DISPATCH: u64 = 0x42;
    pub const UNLOAD_WITH_POOL_ALLOCATIONS: u64 = 0x60;
    pub const PROBE_AND_LOCK_ABOVE_DISPATCH: u64 = 0x70;
    pub const UNLOCK_PAGES_ABOVE_DISPATCH: u64 = 0x78;
    pub const UNLOCK_PAGES_NEVER_LOCKED: u64 = 0x7C;
    pub const UNLOCK_PAGES_NONPAGED_POOL: u64 = 0x7D;
    pub const BUILD_MDL_FOR_PAGED_POOL: u64 = 0x7F;
    pub const SET_EVENT_ABOVE_DISPATCH: u64 = 0x80;
    pub const PROBE_AND_LOCK_NONPAGED_MDL: u64 = 0xB0;
    pub const KERNEL_API_WRONG_IRQL: u64 = 0xE5;
    pub const WAIT_ABOVE_DISPATCH: u64 = 0x120;
    pub const WAIT_AT_DISPATCH_NO_TIMEOUT: u64 = 0x121;
    pub const WAIT_AT_DISPATCH_NONZERO_TIMEOUT: u64 = 0x122;
    /// The ISR returned at another IRQL than it was called at: P2 the ISR, P3 the IRQL before, P4 after.
    pub const ISR_CHANGED_IRQL: u64 = 0x111;
    pub const ENTER_CRITICAL_REGION_ABOVE_APC: u64 = 0x11A;
    pub const LEAVE_CRITICAL_REGION_ABOVE_APC: u64 = 0x11B;
    pub const SELF_DEADLOCK: u64 = 0x1000;
    pub const LOCK_HIERARCHY_VIOLATION: u64 = 0x1001;
    pub const WRONG_THREAD_RELEASE: u64 = 0x1004;
    pub const RELEASE_UNACQUIRED: u64 = 0x1007;
    /// DDI compliance rule IrqlIoPassive5 (IoGetDmaAdapter at IRQL = PASSIVE_LEVEL only).
    pub const RULE_IRQL_IO_PASSIVE5: u64 = 0x0002_000E;
}

/// Parameter 1 values of bugcheck 0xC7 TIMER_OR_DPC_INVALID: what was found in memory that may not hold it.
pub mod c7 {
    pub const TIMER: u64 = 0x0;
    pub const DPC_OBJECT: u64 = 0x1;
    pub const DPC_ROUTINE: u64 = 0x2;
}

/// Parameter 1 values of bugcheck 0xE4 WORKER_INVALID.
pub mod e4 {
    /// An active (queued) work item was queued again: P2 the item, P3 the queue number.
    pub const ACTIVE_ITEM_QUEUED: u64 = 0x1;
    /// A queued I/O work item was freed: P2 the item, P3 its worker routine.
    pub const QUEUED_ITEM_FREED: u64 = 0x2;
}

/// Parameter 1 values of bugcheck 0xE6 DRIVER_VERIFIER_DMA_VIOLATION the model raises.
pub mod e6 {
    pub const MISC: u64 = 0x00;
    /// Parameter 2 of MISC: Windows ran out of contiguous map registers.
    pub const MISC_OUT_OF_CONTIGUOUS_MAP_REGISTERS: u64 = 0x2;
    pub const TOO_MANY_COMMON_BUFFERS_FREED: u64 = 0x03;
    pub const TOO_MANY_ADAPTER_CHANNELS_FREED: u64 = 0x04;
    pub const TOO_MANY_MAP_REGISTERS_FREED: u64 = 0x05;
    pub const TOO_MANY_SG_LISTS_FREED: u64 = 0x06;
    pub const OUTSTANDING_COMMON_BUFFERS: u64 = 0x07;
    pub const OUTSTANDING_ADAPTER_CHANNELS: u64 = 0x08;
    pub const OUTSTANDING_MAP_REGISTERS: u64 = 0x09;
    pub const OUTSTANDING_SG_LISTS: u64 = 0x0A;
    pub const TOO_MANY_ADAPTER_CHANNELS: u64 = 0x0B;
    pub const TOO_MANY_MAP_REGISTERS_AT_ONCE: u64 = 0x0C;
    pub const NOT_FLUSHED: u64 = 0x0D;
    pub const PAGED_MEMORY: u64 = 0x0E;
    pub const OVERRUN: u64 = 0x0F;
    /// Parameter 2 of OVERRUN: the padding before / after the buffer was modified.
    pub const OVERRUN_PADDING_BEFORE: u64 = 0x04;
    pub const OVERRUN_PADDING_AFTER: u64 = 0x05;
    pub const FREED_WHILE_MAPPED: u64 = 0x10;
    pub const IMPROPER_IRQL: u64 = 0x13;
    /// Parameter 2 of IMPROPER_IRQL: IRQL differs from the one required / is above the maximum.
    pub const IRQL_NOT_EXPECTED: u64 = 0x01;
    pub const IRQL_ABOVE_MAXIMUM: u64 = 0x02;
    pub const IMPROPER_IRQL_OTHER: u64 = 0x14;
    pub const TOO_MANY_MAP_REGISTERS: u64 = 0x15;
    pub const FLUSH_NOT_MAPPED: u64 = 0x16;
    pub const ADAPTER_ALREADY_RELEASED: u64 = 0x18;
    pub const ALREADY_MAPPED: u64 = 0x1D;
    pub const ZERO_LENGTH_MAP: u64 = 0x21;
    pub const IOMMU_VIOLATION: u64 = 0x26;
}

/// One verifier rule: a bugcheck code and, for 0xC4 and 0xE6, the subcode in parameter 1. A run may turn single
/// rules off (`NtModelConfig::disabled_rules`), as `verifier /ruleclasses` does for classes; the runner uses it to
/// prove that a suite fails when the rule its expectation depends on is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RuleId {
    pub code: u32,
    /// None: every rule under the code.
    pub subcode: Option<u64>,
}

impl RuleId {
    /// Parses `0xE6`, `0xE6/0x26` or `0xC4/0xE5` (hex with or without `0x`).
    pub fn parse(text: &str) -> Option<RuleId> {
        fn hex(t: &str) -> Option<u64> {
            let t = t.trim();
            let digits = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
            u64::from_str_radix(digits, 16).ok()
        }
        let (code, subcode) = match text.split_once('/') {
            Some((c, s)) => (c, Some(hex(s)?)),
            None => (text, None),
        };
        Some(RuleId { code: u32::try_from(hex(code)?).ok()?, subcode })
    }

    /// Whether a bugcheck is this rule's: same code, and parameter 1 equal to the subcode when one is named.
    pub fn matches(&self, bugcheck: &crate::Bugcheck) -> bool {
        bugcheck.code == self.code && self.subcode.is_none_or(|s| bugcheck.params[0] == s)
    }
}

impl std::fmt::Display for RuleId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.subcode {
            Some(s) => write!(f, "{:#X}/{s:#X}", self.code),
            None => write!(f, "{:#X}", self.code),
        }
    }
}
