//! vhca.sys's scenario host (src/scenario_run.rs) running the shared scenarios (vhca-scenarios) over the NT model
//! and the in-process device model: the code the driver runs over the WDK shim, checked here where it can run.

#[path = "../../ntmodel/tests/common/mod.rs"]
mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{machine, HcaChannel, PDO};
use vhca_ntapi::PVOID;
use vhca_ntmodel::{NtModel, VerifierFlags};
use vhca_scenarios::{Scenario, ScenarioOptions};
use vhca_sys::result_line::RunResult;
use vhca_sys::scenario_run::{run, DriverServices};

/// The kernel services over the NT model, printing into a log the test reads.
struct ModelServices {
    kernel: Arc<NtModel>,
    origin: Instant,
    printed: Mutex<Vec<String>>,
}

impl DriverServices for ModelServices {
    type Kernel = NtModel;
    type Channel = HcaChannel;
    fn print(&self, line: &str) {
        self.printed.lock().unwrap().push(line.to_string());
    }
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
    fn sleep(&self, duration: Duration) {
        std::thread::sleep(duration)
    }
    fn alloc_user_buffer(&self, len: u32, in_page_offset: u64) -> PVOID {
        self.kernel.alloc_user_buffer(len as u64, in_page_offset)
    }
    fn free_user_buffer(&self, va: PVOID) {
        self.kernel.free_user_buffer(va)
    }
    fn resources_refused(&self) -> bool {
        !self.kernel.injected_faults().is_empty()
    }
}

fn run_on_model(scenario: Scenario, flags: u32, options: &ScenarioOptions) -> (RunResult, Arc<ModelServices>) {
    let (kernel, backend) = machine(flags);
    let services =
        Arc::new(ModelServices { kernel: kernel.clone(), origin: Instant::now(), printed: Mutex::new(Vec::new()) });
    let result = run(scenario, &*services, kernel, HcaChannel::new(backend), PDO, options);
    (result, services)
}

/// The scenarios whose device needs nothing the in-process model lacks (a small map-register pool, a fragmented
/// machine, the vIOMMU's fault reports) pass without the verifier, each with its result line's details.
#[test]
fn the_shared_scenarios_pass_on_the_model() {
    let passing = [
        Scenario::Smoke,
        Scenario::VerbsLoopback,
        Scenario::FastMutexCreateCq,
        Scenario::FixedLockCreateCq,
        Scenario::SharedBufferSg,
        Scenario::SharedBufferCommon,
        Scenario::UserBufferProbeLock,
        Scenario::UserBufferNoLock,
    ];
    for scenario in passing {
        let (result, services) = run_on_model(scenario, 0, &ScenarioOptions::default());
        assert_eq!(result.error, None, "{}: {result:?}", scenario.name());
        assert!(services.kernel.bugchecks().is_empty(), "{}", scenario.name());
        assert!(!services.printed.lock().unwrap().is_empty(), "{}: no progress printed", scenario.name());
    }
    let (lock, _) = run_on_model(Scenario::FixedLockCreateCq, 0, &ScenarioOptions::default());
    assert_eq!(lock.lock, Some("kmutex"));
    assert!(lock.line().contains(r#""lock":"kmutex""#), "{}", lock.line());
    assert_eq!(lock.details["irql_under_lock"], 0);
}

/// A scenario's own check reaches the result line: a write into an unmapped buffer is refused by the device
/// model, and the scenario says so (on Windows the IOMMU report is Windows' own, so only the device's side counts).
#[test]
fn a_failing_check_is_the_result_lines_error() {
    let (result, _) = run_on_model(Scenario::MapRegisterExhaustion, 0, &ScenarioOptions::default());
    let error = result.error.clone().expect("the in-process device's pool outlasts the scenario's 64 CQs");
    assert!(error.contains("map registers") || error.contains("CQs"), "{error}");
    assert!(result.line().contains(r#""ok":false"#));
}

/// The seed's bug shows where the rules are checked: create_cq under a FAST_MUTEX calls AllocateCommonBuffer at
/// APC_LEVEL; the KMUTEX leaves it at PASSIVE_LEVEL and passes under the same checks. `break_fix` takes the fix
/// away again.
#[test]
fn the_fast_mutex_stops_the_machine_and_the_kmutex_does_not() {
    let flags = VerifierFlags::IRQL_CHECKING.0 | VerifierFlags::DMA_CHECKING.0;
    let stopped =
        NtModel::run_guarded(|| run_on_model(Scenario::FastMutexCreateCq, flags, &ScenarioOptions::default()).0);
    let bugcheck = stopped.expect_err("AllocateCommonBuffer at APC_LEVEL under DMA checking");
    assert_eq!(bugcheck.code, 0xE6, "{bugcheck:?}");

    let fixed =
        NtModel::run_guarded(|| run_on_model(Scenario::FixedLockCreateCq, flags, &ScenarioOptions::default()).0)
            .expect("no bugcheck under a KMUTEX");
    assert_eq!(fixed.error, None);

    let broken = ScenarioOptions { break_fix: true, ..ScenarioOptions::default() };
    let stopped = NtModel::run_guarded(|| run_on_model(Scenario::FixedLockCreateCq, flags, &broken).0);
    assert_eq!(stopped.expect_err("break_fix takes the FAST_MUTEX again").code, 0xE6);
}
