//! vhca.sys's scenario host (src/scenario_run.rs) running the shared scenarios (vhca-scenarios) over the NT model
//! and the in-process device model: the code the driver runs over the WDK shim, checked here where it can run.

#[path = "../../ntmodel/tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vhca_driver_core::{CompletionCounts, CqCompletions, CqReader};
use vhca_proto::{Cqe, Event};

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
    interrupts: Interrupts,
}

/// What `connect_completions` gives the host.
#[derive(Clone, Copy, PartialEq)]
enum Interrupts {
    /// No interrupt resources: the default, polling.
    None,
    /// A path that connected (`FixedPath`).
    Connected,
    /// A connection tried and refused, as vhca.sys's line-based fallback is.
    Refused,
}

/// The counts `FixedPath` reports at its disconnect.
const FIXED_COUNTS: CompletionCounts = CompletionCounts { isr_calls: 7, dpc_calls: 6, dpc_requeues: 1, cqes: 0 };

/// A connected path whose DPC is the caller: each take reads the watched CQ's ring itself. It shows what the host
/// makes of a connection (the result's completion fields), the part of the interrupt path vhca.sys's host adds over
/// the driver core (whose own path the NT model's tests cover).
struct FixedPath {
    kernel: Arc<NtModel>,
    watched: Mutex<BTreeMap<u32, CqReader>>,
}

impl CqCompletions for FixedPath {
    fn watch(&self, cq: u32, reader: CqReader) {
        self.watched.lock().unwrap().insert(cq, reader);
    }
    fn unwatch(&self, cq: u32) {
        self.watched.lock().unwrap().remove(&cq);
    }
    fn is_watched(&self, cq: u32) -> bool {
        self.watched.lock().unwrap().contains_key(&cq)
    }
    fn kick(&self, _cq: u32) {}
    fn take(&self, cq: u32, max: usize) -> Vec<Cqe> {
        self.watched.lock().unwrap().get(&cq).map_or_else(Vec::new, |r| r.poll(&*self.kernel, max))
    }
    fn wait(&self, _cq: u32, timeout: Duration) -> bool {
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
        false
    }
    fn take_event(&self) -> Option<Event> {
        None
    }
    fn counts(&self) -> CompletionCounts {
        FIXED_COUNTS
    }
    fn disconnect(self: Box<Self>) -> CompletionCounts {
        FIXED_COUNTS
    }
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
    fn connect_completions(&self) -> anyhow::Result<Option<Box<dyn CqCompletions>>> {
        match self.interrupts {
            Interrupts::None => Ok(None),
            Interrupts::Connected => {
                Ok(Some(Box::new(FixedPath { kernel: self.kernel.clone(), watched: Mutex::default() })))
            }
            Interrupts::Refused => anyhow::bail!("IoConnectInterruptEx connected line-based (the fallback)"),
        }
    }
    fn command_waits(&self) -> Option<(u64, u64)> {
        Some((2, 3))
    }
}

fn run_on_model(scenario: Scenario, flags: u32, options: &ScenarioOptions) -> (RunResult, Arc<ModelServices>) {
    run_with(scenario, flags, options, Interrupts::None)
}

fn run_with(
    scenario: Scenario,
    flags: u32,
    options: &ScenarioOptions,
    interrupts: Interrupts,
) -> (RunResult, Arc<ModelServices>) {
    let (kernel, backend) = machine(flags);
    let services = Arc::new(ModelServices {
        kernel: kernel.clone(),
        origin: Instant::now(),
        printed: Mutex::new(Vec::new()),
        interrupts,
    });
    let result = run(scenario, &*services, kernel, HcaChannel::new(backend), PDO, options);
    (result, services)
}

/// The host reports how the scenario completed as the Linux guest does: `interrupt` with the path's counts when it
/// connected, `poll` without resources, and `poll` after a refused connection, which is a detail and a progress
/// line, never the scenario's failure (the device still works polled).
#[test]
fn the_result_says_how_completions_came() {
    let (polled, _) = run_on_model(Scenario::Smoke, 0, &ScenarioOptions::default());
    assert_eq!((polled.error.as_deref(), polled.completion, polled.completion_path), (None, Some("poll"), None));
    assert!(polled.details.get("interrupt_path_refused").is_none());
    assert!(polled.details.get("command_waits").is_none(), "counted only when a path was disconnected");

    let (connected, services) = run_with(Scenario::Smoke, 0, &ScenarioOptions::default(), Interrupts::Connected);
    assert_eq!(connected.error, None, "{connected:?}");
    assert_eq!((connected.completion, connected.completion_path), (Some("interrupt"), Some(FIXED_COUNTS)));
    let line = connected.line();
    assert!(line.contains(r#""completion":"interrupt""#), "{line}");
    assert!(line.contains(r#""completion_path":{"cqes":0,"dpc_calls":6,"dpc_requeues":1,"isr_calls":7}"#), "{line}");
    assert_eq!(connected.details["command_waits"], serde_json::json!({"kevent": 2, "poll": 3}));
    let printed = services.printed.lock().unwrap().join("\n");
    assert!(printed.contains("interrupt path disconnected: 7 ISR calls, 6 DPC calls (1 re-queued)"), "{printed}");

    let (refused, services) = run_with(Scenario::Smoke, 0, &ScenarioOptions::default(), Interrupts::Refused);
    assert_eq!((refused.error.as_deref(), refused.completion), (None, Some("poll")), "{refused:?}");
    assert_eq!(refused.details["interrupt_path_refused"], "IoConnectInterruptEx connected line-based (the fallback)");
    assert!(services.printed.lock().unwrap().iter().any(|l| l.contains("completions are polled")));
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
