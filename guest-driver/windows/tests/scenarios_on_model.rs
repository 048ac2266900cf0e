//! vhca.sys's scenarios (src/scenario_run.rs) over the NT model and the in-process device model: the same code
//! the driver runs over the WDK shim, checked here where it can run.

#[path = "../../ntmodel/tests/common/mod.rs"]
mod common;

use std::sync::Arc;

use common::{machine, HcaChannel, PDO};
use vhca_ntmodel::{NtModel, VerifierFlags};
use vhca_windows::scenario_choice::WindowsScenario;
use vhca_windows::scenario_run::run;

#[test]
fn every_scenario_passes_without_the_verifier() {
    for scenario in WindowsScenario::ALL {
        let (kernel, backend) = machine(0);
        let result = run(scenario, kernel.clone(), HcaChannel::new(backend), PDO);
        assert_eq!(result.error, None, "{}: {result:?}", scenario.name());
        assert!(result.details.contains_key("adapter_map_registers"));
        assert!(kernel.bugchecks().is_empty());
    }
}

/// The seed's bug shows where the rules are checked: create_cq under a FAST_MUTEX calls AllocateCommonBuffer at
/// APC_LEVEL; the KMUTEX leaves it at PASSIVE_LEVEL and passes under the same checks.
#[test]
fn the_fast_mutex_stops_the_machine_and_the_kmutex_does_not() {
    let flags = VerifierFlags::IRQL_CHECKING.0 | VerifierFlags::DMA_CHECKING.0;
    let (kernel, backend) = machine(flags);
    let stopped =
        NtModel::run_guarded(|| run(WindowsScenario::FastMutexCreateCq, kernel.clone(), HcaChannel::new(backend), PDO));
    let bugcheck = stopped.expect_err("AllocateCommonBuffer at APC_LEVEL under DMA checking");
    assert_eq!(bugcheck.code, 0xE6, "{bugcheck:?}");

    let (kernel, backend) = machine(flags);
    let fixed =
        NtModel::run_guarded(|| run(WindowsScenario::FixedLockCreateCq, kernel.clone(), HcaChannel::new(backend), PDO))
            .expect("no bugcheck under a KMUTEX");
    assert_eq!(fixed.error, None);
    assert_eq!(fixed.details["irql_under_lock"], 0);
    let _: Arc<NtModel> = kernel;
}
