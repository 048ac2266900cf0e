//! A bugcheck: the code, its four parameters and its name, printed in Windows' `*** STOP:` form.
//! Raised through a `BugcheckHandler`: tests capture it and unwind, the guest prints it and powers off.

use std::fmt;

use vhca_ntapi::{
    bugcheck_name, ATTEMPTED_SWITCH_FROM_DPC, DRIVER_VERIFIER_DETECTED_VIOLATION, DRIVER_VERIFIER_DMA_VIOLATION,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bugcheck {
    pub code: u32,
    pub params: [u64; 4],
}

impl Bugcheck {
    pub fn new(code: u32, p1: u64, p2: u64, p3: u64, p4: u64) -> Bugcheck {
        Bugcheck { code, params: [p1, p2, p3, p4] }
    }

    /// 0xC4 with its subcode and three parameters.
    pub fn c4(subcode: u64, p2: u64, p3: u64, p4: u64) -> Bugcheck {
        Bugcheck::new(DRIVER_VERIFIER_DETECTED_VIOLATION, subcode, p2, p3, p4)
    }

    /// 0xE6 with its subcode and three parameters.
    pub fn e6(subcode: u64, p2: u64, p3: u64, p4: u64) -> Bugcheck {
        Bugcheck::new(DRIVER_VERIFIER_DMA_VIOLATION, subcode, p2, p3, p4)
    }

    /// 0xB8 ATTEMPTED_SWITCH_FROM_DPC: the original (waiting) thread, the thread the processor would switch to,
    /// the original thread's stack address; P4 is reserved and 0.
    pub fn switch_from_dpc(original: u64, new: u64, stack: u64) -> Bugcheck {
        Bugcheck::new(ATTEMPTED_SWITCH_FROM_DPC, original, new, stack, 0)
    }

    pub fn name(&self) -> &'static str {
        bugcheck_name(self.code).unwrap_or("UNKNOWN_BUGCHECK")
    }

    /// Parameter 1, the subcode of 0xC4 and 0xE6.
    pub fn subcode(&self) -> u64 {
        self.params[0]
    }
}

/// Two lines: `*** STOP: 0x000000E6 (0x0000000000000026,...)` and the name, as Windows prints them.
impl fmt::Display for Bugcheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [p1, p2, p3, p4] = self.params;
        write!(f, "*** STOP: 0x{:08X} (0x{p1:016X},0x{p2:016X},0x{p3:016X},0x{p4:016X})\n{}", self.code, self.name())
    }
}

/// What happens when the machine stops. Never returns: the guest powers off, a test unwinds to `run_guarded`.
pub trait BugcheckHandler: Send + Sync {
    fn bugcheck(&self, bugcheck: &Bugcheck) -> !;
}

/// The payload a capturing handler unwinds with; `NtModel::run_guarded` turns it back into a `Bugcheck`.
#[derive(Debug)]
pub struct BugcheckUnwind(pub Bugcheck);

/// For tests: unwinds (without the panic hook's noise) to the nearest `run_guarded`.
#[derive(Debug, Default)]
pub struct CaptureBugchecks;

impl BugcheckHandler for CaptureBugchecks {
    fn bugcheck(&self, bugcheck: &Bugcheck) -> ! {
        std::panic::resume_unwind(Box::new(BugcheckUnwind(*bugcheck)))
    }
}

/// For a program: print to stderr and exit; the guest supplies its own handler that powers the machine off.
#[derive(Debug, Default)]
pub struct PrintAndExit;

impl BugcheckHandler for PrintAndExit {
    fn bugcheck(&self, bugcheck: &Bugcheck) -> ! {
        eprintln!("{bugcheck}");
        std::process::exit(0xE6)
    }
}
