//! What the scenario tests on the NT model share: the host a scenario runs under there, the in-process device that
//! holds a request until its time is up, and the model's config from a run's flags and disabled rules.
//!
//! Why one module: each test's host differs only in what passing time does, what the platform reports and whether
//! the interrupt path is connected (its `Platform`); the rest of a host (a quiet console, a clock from its start, no
//! user memory, the driver unloaded on close) and the held device were written once per test before.
#![allow(dead_code)]

#[path = "../../../ntmodel/tests/common/mod.rs"]
pub mod common;
pub mod interrupting;
pub mod late_dma;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::BackendDma;
use serde_json::Value;
use vhca_driver_core::{CommandTransport, CommandTransportError, CqCompletions};
use vhca_hca::{EventSink, FaultInjection, HcaConfig, HcaEvent};
use vhca_ntapi::PVOID;
use vhca_ntmodel::{HostDmaBackend, NtModel, NtModelConfig, RuleId, VerifierFlags};
use vhca_proto::Event;
use vhca_scenarios::ScenarioHost;

/// The seed suite's verifier-on flags: DMA checking, IRQL checking, pool tracking, deadlock detection.
pub const STANDARD: u32 = 0xAA;

/// The model's config for a run with verifier `flags` and the rules named in `disabled` (as the suite names them).
pub fn model_config(flags: u32, disabled: &[&str]) -> NtModelConfig {
    NtModelConfig {
        verifier: VerifierFlags(flags),
        disabled_rules: disabled.iter().map(|r| RuleId::parse(r).unwrap()).collect(),
        ..NtModelConfig::default()
    }
}

/// What one test's machine does that the others' do not; each hook gives the quiet answer unless a test says more.
pub trait Platform {
    type Channel: CommandTransport;
    /// Time passed on the scenario's thread: what fell due then happens (a held request's release, a clock tick).
    fn time_passed(&self, _kernel: &NtModel) {}
    /// `ScenarioHost::report_platform_iommu_faults`: None, the driver sees no report.
    fn report_iommu_faults(&self, _kernel: &NtModel, _wait: Duration) -> Option<usize> {
        None
    }
    /// `ScenarioHost::dma_checking`: None, the driver cannot know.
    fn dma_checking(&self, _kernel: &NtModel) -> Option<bool> {
        None
    }
    /// `ScenarioHost::connect_completions`: None, the scenario's completion waits poll.
    fn connect_completions(&self, _kernel: &Arc<NtModel>) -> anyhow::Result<Option<Box<dyn CqCompletions>>> {
        Ok(None)
    }
}

/// A scenario's host on the NT model: prints and records nothing (the tests judge the result and the bugcheck), has
/// no user memory, and unloads the driver on close so that the verifier's unload checks run.
pub struct ModelHost<P> {
    pub kernel: Arc<NtModel>,
    pub platform: P,
    origin: Instant,
}

impl<P: Platform> ModelHost<P> {
    pub fn new(kernel: Arc<NtModel>, platform: P) -> ModelHost<P> {
        ModelHost { kernel, platform, origin: Instant::now() }
    }
}

impl<P: Platform> ScenarioHost for ModelHost<P> {
    type Kernel = NtModel;
    type Channel = P::Channel;
    fn say(&self, _: std::fmt::Arguments<'_>) {}
    fn detail(&self, _: &str, _: Value) {}
    fn lock_chosen(&self, _: &'static str) {}
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
    fn sleep(&self, duration: Duration) {
        std::thread::sleep(duration);
        self.platform.time_passed(&self.kernel);
    }
    fn alloc_user_buffer(&self, len: u32, in_page_offset: u64) -> PVOID {
        self.kernel.alloc_user_buffer(len as u64, in_page_offset)
    }
    fn free_user_buffer(&self, va: PVOID) {
        self.kernel.free_user_buffer(va);
    }
    fn report_platform_iommu_faults(&self, wait: Duration) -> Option<usize> {
        self.platform.report_iommu_faults(&self.kernel, wait)
    }
    fn dma_checking(&self) -> Option<bool> {
        self.platform.dma_checking(&self.kernel)
    }
    fn connect_completions(&self) -> anyhow::Result<Option<Box<dyn CqCompletions>>> {
        self.platform.connect_completions(&self.kernel)
    }
    fn driver_closed(&self) -> anyhow::Result<()> {
        self.kernel.unload_driver();
        Ok(())
    }
}

/// The device's event log, unread.
pub struct NoEvents;

impl EventSink for NoEvents {
    fn emit(&self, _: HcaEvent) {}
}

/// The in-process device model with its hold_completion knob, and what its transport keeps: when the held request
/// is due. Nothing releases it but `release_if_due`, as on the guest only the transport's deadline does.
pub struct HeldDevice {
    hca: Mutex<vhca_hca::Hca>,
    dma: BackendDma,
    release_at: Mutex<Option<Instant>>,
}

impl HeldDevice {
    /// A device over `backend` that holds its first send request `hold_ms` (0: none), its events going to `events`.
    pub fn new(backend: Arc<HostDmaBackend>, hold_ms: u64, events: Arc<dyn EventSink>) -> Arc<HeldDevice> {
        HeldDevice::holding(backend, hold_ms, 1, events)
    }

    /// The same, holding the `wr`th send request the device starts (`hold_completion_wr`).
    pub fn holding(backend: Arc<HostDmaBackend>, hold_ms: u64, wr: u32, events: Arc<dyn EventSink>) -> Arc<HeldDevice> {
        let mut injection = FaultInjection::default();
        if hold_ms > 0 {
            injection.parse_kv(&format!("hold_completion_ms={hold_ms}")).unwrap();
            injection.parse_kv(&format!("hold_completion_wr={wr}")).unwrap();
        }
        let hca = vhca_hca::Hca::new(HcaConfig { injection, ..HcaConfig::default() }, events);
        Arc::new(HeldDevice { hca: Mutex::new(hca), dma: BackendDma(backend), release_at: Mutex::new(None) })
    }

    fn note_hold(&self, hca: &mut vhca_hca::Hca) {
        if let Some(hold) = hca.take_new_hold() {
            *self.release_at.lock().unwrap() = Some(Instant::now() + hold);
        }
    }

    /// The transport's deadline: the held request runs once its time is up.
    pub fn release_if_due(&self) {
        let due = self.release_at.lock().unwrap().is_some_and(|at| Instant::now() >= at);
        if due {
            *self.release_at.lock().unwrap() = None;
            self.hca.lock().unwrap().release_held_work(&self.dma);
        }
    }
}

/// The driver core's channel to a `HeldDevice`: each command and doorbell may start a hold.
#[derive(Clone)]
pub struct HeldChannel(pub Arc<HeldDevice>);

impl CommandTransport for HeldChannel {
    fn execute(&self, request: &[u8], _capacity: usize) -> Result<Vec<u8>, CommandTransportError> {
        let mut hca = self.0.hca.lock().unwrap();
        let response = hca.execute(&self.0.dma, request);
        self.0.note_hold(&mut hca);
        Ok(response)
    }
    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError> {
        let mut hca = self.0.hca.lock().unwrap();
        hca.doorbell(&self.0.dma, records);
        self.0.note_hold(&mut hca);
        Ok(())
    }
    fn poll_event(&self) -> Option<Event> {
        self.0.hca.lock().unwrap().pop_async_event()
    }
}
