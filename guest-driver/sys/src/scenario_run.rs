//! How vhca.sys runs a scenario: the seed scenarios are vhca-scenarios (the same code the Linux guest program runs);
//! this is their host in the driver, collecting details into the result line. What needs the kernel (debugger
//! output, the clock, user buffers, the interrupt path) is `DriverServices`, implemented over ntoskrnl.exe in
//! src/kernel and over the NT model in this crate's tests.

use alloc::boxed::Box;
use alloc::format;
use alloc::string::ToString;
use alloc::sync::Arc;
use core::cell::RefCell;
use core::fmt;
use core::time::Duration;

use serde_json::Value;
use vhca_driver_core::{CommandTransport, CompletionCounts, CqCompletions};
use vhca_ntapi::{NtAsyncKernel, PDEVICE_OBJECT, PVOID};
use vhca_scenarios::{Scenario, ScenarioHost, ScenarioOptions};

use crate::result_line::RunResult;

/// How long a scenario waits for completions and events (the Linux guest's default `vhca.timeout_ms`).
const SCENARIO_TIMEOUT: Duration = Duration::from_secs(5);

/// The kernel services a scenario's host needs beyond `NtKernel`.
pub trait DriverServices {
    type Kernel: NtAsyncKernel + 'static;
    type Channel: CommandTransport;
    /// One progress line to the kernel debugger.
    fn print(&self, line: &str);
    /// A monotonic clock.
    fn now(&self) -> Duration;
    /// Waits about `duration`; PASSIVE_LEVEL.
    fn sleep(&self, duration: Duration);
    /// Pageable memory in the current process's user address space, `in_page_offset` bytes into its first page.
    fn alloc_user_buffer(&self, len: u32, in_page_offset: u64) -> PVOID;
    fn free_user_buffer(&self, va: PVOID);
    /// Whether the kernel refused the driver a resource so far (an allocation returned NULL, a routine returned
    /// STATUS_INSUFFICIENT_RESOURCES).
    fn resources_refused(&self) -> bool;
    /// The interrupt-driven completion path, connected (PASSIVE_LEVEL). Ok(None): the device has no interrupt, so
    /// the scenario polls; an error: a connection was tried and not kept, which the host reports and polls after.
    fn connect_completions(&self) -> anyhow::Result<Option<Box<dyn CqCompletions>>> {
        Ok(None)
    }
    /// (commands that waited on the DPC's KEVENT, commands that polled) so far, where the channel counts them.
    fn command_waits(&self) -> Option<(u64, u64)> {
        None
    }
    /// vhca.sys's own device object (its FDO), for the routines that want one of the caller's (IoAllocateWorkItem).
    fn own_device(&self) -> Option<PDEVICE_OBJECT> {
        None
    }
}

/// The scenario's host in vhca.sys: details and the lock go into the run's result as they come, progress to the
/// debugger. IOMMU faults and the verifier are Windows' own, which the driver neither sees nor queries.
struct DriverHost<'a, S: DriverServices> {
    services: &'a S,
    result: RefCell<RunResult>,
}

impl<S: DriverServices> ScenarioHost for DriverHost<'_, S> {
    type Kernel = S::Kernel;
    type Channel = S::Channel;

    fn say(&self, message: fmt::Arguments<'_>) {
        self.services.print(&format!("vhca: {message}"));
    }

    fn detail(&self, key: &str, value: Value) {
        self.result.borrow_mut().details.insert(key.to_string(), value);
    }

    fn lock_chosen(&self, name: &'static str) {
        self.result.borrow_mut().lock = Some(name);
    }

    fn now(&self) -> Duration {
        self.services.now()
    }

    fn sleep(&self, duration: Duration) {
        self.services.sleep(duration)
    }

    fn alloc_user_buffer(&self, len: u32, in_page_offset: u64) -> PVOID {
        self.services.alloc_user_buffer(len, in_page_offset)
    }

    fn free_user_buffer(&self, va: PVOID) {
        self.services.free_user_buffer(va)
    }

    /// Under DMA remapping Windows reports an IOMMU fault to itself (with Driver Verifier's DMA checking, 0xE6 stops
    /// the machine); the driver is not told.
    fn report_platform_iommu_faults(&self, _wait: Duration) -> Option<usize> {
        None
    }

    fn dma_checking(&self) -> Option<bool> {
        None
    }

    /// A scenario the kernel refused resources to (an allocation that returned NULL, a routine that returned
    /// STATUS_INSUFFICIENT_RESOURCES: what Windows gives under low memory and Driver Verifier's low resources
    /// simulation) stopped on the driver's error path, which must come out clean: what the scenario held goes back,
    /// the HCA closes, and the unload is what the run is judged on. Any other failure leaves the driver open as
    /// evidence (vhca_scenarios::run). The driver knows only what its kernel calls returned, as on Windows.
    fn error_path(&self, _error: &anyhow::Error) -> bool {
        self.services.resources_refused()
    }

    /// The scenario's waits sleep on the path's KEVENTs when it connected, and poll otherwise: a refused or
    /// unusable connection is not the scenario's failure (the device still works polled), so it becomes a detail
    /// and a progress line, and the result says which way the run completed (`completion`, as the Linux guest).
    fn own_device(&self) -> Option<PDEVICE_OBJECT> {
        self.services.own_device()
    }

    fn connect_completions(&self) -> anyhow::Result<Option<Box<dyn CqCompletions>>> {
        let connected = self.services.connect_completions().unwrap_or_else(|e| {
            self.say(format_args!("interrupt path not connected ({e:#}); completions are polled"));
            self.detail("interrupt_path_refused", Value::String(format!("{e:#}")));
            None
        });
        self.result.borrow_mut().completion = Some(if connected.is_some() { "interrupt" } else { "poll" });
        Ok(connected)
    }

    fn completion_counts(&self, counts: CompletionCounts) {
        self.say(format_args!(
            "interrupt path disconnected: {} ISR calls, {} DPC calls ({} re-queued), {} CQEs",
            counts.isr_calls, counts.dpc_calls, counts.dpc_requeues, counts.cqes
        ));
        if let Some((kevent, poll)) = self.services.command_waits() {
            // The scenarios connect before Hca::open's first command and disconnect after the close's last, so every
            // command sleeps on the DPC's KEVENT; one that polled would show here. The Linux guest's detail, by the
            // same name.
            self.say(format_args!("commands: {kevent} waited on the DPC's KEVENT, {poll} polled"));
            self.detail("command_waits", serde_json::json!({"kevent": kevent, "poll": poll}));
        }
        self.result.borrow_mut().completion_path = Some(counts);
    }
}

/// Opens the HCA on `pdo`, runs `scenario` (vhca-scenarios), and returns its result. PASSIVE_LEVEL, no lock held.
pub fn run<S: DriverServices>(
    scenario: Scenario,
    services: &S,
    kernel: Arc<S::Kernel>,
    channel: S::Channel,
    pdo: PDEVICE_OBJECT,
    options: &ScenarioOptions,
) -> RunResult {
    let host = DriverHost { services, result: RefCell::new(RunResult::new(scenario.name())) };
    let outcome = vhca_scenarios::run(scenario, &host, kernel, channel, pdo, options, SCENARIO_TIMEOUT);
    let mut result = host.result.into_inner();
    if let Err(e) = outcome {
        result.fail(format!("{e:#}"));
    }
    result
}
