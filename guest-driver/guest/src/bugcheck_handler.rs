//! The guest's bugcheck handler: the machine stops as Windows' does. The STOP lines exactly as the NT model formats
//! them, then the `VHCA-RESULT` line (with the details gathered so far and "bugcheck"), then power-off.

use std::io::Write;
use std::sync::{Arc, Mutex, TryLockError};

use vhca_ntmodel::{Bugcheck, BugcheckHandler};

use crate::report::{BugcheckView, Report};
use crate::shutdown;

/// Prints and powers off. Holds the run's report as far as it got, which the scenario keeps filling in.
pub struct ConsoleBugcheck {
    report: Arc<Mutex<Report>>,
    poweroff: bool,
}

impl ConsoleBugcheck {
    pub fn new(report: Arc<Mutex<Report>>, poweroff: bool) -> ConsoleBugcheck {
        ConsoleBugcheck { report, poweroff }
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
        report.ok = false;
        report.error = Some(format!("bugcheck {} ({}) {}", view.code, view.params.join(", "), view.name));
        report.bugcheck = Some(view);
        report.uptime_ms = crate::report::uptime_ms();
        report.print();
        shutdown::finish(self.poweroff, false)
    }
}
