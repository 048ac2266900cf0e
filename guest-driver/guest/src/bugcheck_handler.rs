//! The guest's bugcheck handler: the machine stops as Windows' does. The STOP lines exactly as the NT model formats
//! them, then the `VHCA-RESULT` line (with the details gathered so far and "bugcheck"), then power-off.
//! Under an interleaving mode that line carries the race reports found so far: a race often ends in the bugcheck.

use std::io::Write;
use std::sync::{Arc, Mutex, TryLockError};

use vhca_ntmodel::{Bugcheck, BugcheckHandler};

use crate::interleaving::BugcheckWitness;
use crate::report::{BugcheckView, Report};
use crate::shutdown;

/// Prints and powers off. Holds the run's report as far as it got, which the scenario keeps filling in.
pub struct ConsoleBugcheck {
    report: Arc<Mutex<Report>>,
    poweroff: bool,
    witness: BugcheckWitness,
}

impl ConsoleBugcheck {
    pub fn new(report: Arc<Mutex<Report>>, poweroff: bool) -> ConsoleBugcheck {
        ConsoleBugcheck { report, poweroff, witness: BugcheckWitness::default() }
    }

    /// Where the run attaches its model once made, so a bugcheck can list the races the detector reported.
    pub fn witness(&self) -> &BugcheckWitness {
        &self.witness
    }
}

impl BugcheckHandler for ConsoleBugcheck {
    fn bugcheck(&self, bugcheck: &Bugcheck) -> ! {
        let stop = format!("{bugcheck}\n");
        {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(stop.as_bytes());
            let _ = out.flush();
        }
        // A scenario never holds the report while calling the kernel; if one did, the result still goes out.
        let mut report = match self.report.try_lock() {
            Ok(r) => r.clone(),
            Err(TryLockError::Poisoned(p)) => p.into_inner().clone(),
            Err(TryLockError::WouldBlock) => Report::default(),
        };
        let view = BugcheckView::from(bugcheck);
        report.details.extend(self.witness.details());
        report.ok = false;
        report.error = Some(format!("bugcheck {} ({}) {}", view.code, view.params.join(", "), view.name));
        report.bugcheck = Some(view);
        report.uptime_ms = crate::report::uptime_ms();
        report.print();
        shutdown::finish(self.poweroff, false)
    }
}
