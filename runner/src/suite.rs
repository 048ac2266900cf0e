//! Suites: the built-in one (for now the smoke run) and running a list of run specs into a report. The one place the
//! expected verdict of each built-in run is written down.

use std::time::Duration;

use serde::Serialize;

use crate::accel::AccelChoice;
use crate::image::Image;
use crate::outcome::RunOutcome;
use crate::qemu_cmd::{Accel, Carrier};
use crate::run::{execute, Progress, RunContext, RunError, RunSpec};
use crate::verdict::{judge, Expectation, Verdict};

/// Hard timeout of one run when none is given: TCG boots in seconds here, but a loaded CI host is slower.
pub fn default_timeout(accel: Accel) -> Duration {
    match accel {
        Accel::Tcg => Duration::from_secs(120),
        Accel::Kvm => Duration::from_secs(60),
    }
}

/// The smoke run: QUERY_DEVICE over VFIO through the vIOMMU, proven by the device's IOTLB log.
pub fn smoke(timeout: Duration) -> RunSpec {
    RunSpec {
        name: "smoke".into(),
        scenario: "smoke".into(),
        append: Vec::new(),
        map_registers: None,
        device_args: Vec::new(),
        timeout,
        expect: Expectation::GuestOk { iova_check: true },
    }
}

pub fn builtin(timeout: Duration) -> Vec<RunSpec> {
    vec![smoke(timeout)]
}

#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub outcome: RunOutcome,
    pub verdict: Verdict,
    pub expect: Expectation,
}

#[derive(Debug, Clone, Serialize)]
pub struct SuiteReport {
    pub accel: AccelChoice,
    pub carrier: Carrier,
    pub image: Image,
    pub runs: Vec<RunReport>,
}

impl SuiteReport {
    pub fn all_passed(&self) -> bool {
        !self.runs.is_empty() && self.runs.iter().all(|r| r.verdict.pass())
    }
}

pub fn run_suite(
    ctx: &RunContext,
    accel: AccelChoice,
    specs: &[RunSpec],
    on: &mut dyn FnMut(Progress),
) -> Result<SuiteReport, RunError> {
    let mut runs = Vec::new();
    for spec in specs {
        let outcome = execute(ctx, spec, on)?;
        let verdict = judge(&spec.expect, &outcome);
        runs.push(RunReport { outcome, verdict, expect: spec.expect.clone() });
    }
    Ok(SuiteReport { accel, carrier: ctx.carrier, image: ctx.image.clone(), runs })
}
