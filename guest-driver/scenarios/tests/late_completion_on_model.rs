//! timeout-frees-buffer and timeout-flushes-qp through `vhca_scenarios::run` on the NT model and the in-process device
//! model with its hold_completion knob: the host plays the device's transport (it releases the held request when
//! its time is up, whenever the driver sleeps) and the platform (the device's refusal of an unmapped IOVA is the
//! IOMMU fault it reports), so each verdict of the seed suite shows without QEMU.

#[path = "../../ntmodel/tests/common/mod.rs"]
mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{machine_with, BackendDma, PDO};
use serde_json::Value;
use vhca_driver_core::{CommandTransport, CommandTransportError};
use vhca_hca::{EventSink, FaultInjection, HcaConfig, HcaEvent};
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, NtModel, NtModelConfig, RuleId, VerifierFlags};
use vhca_proto::Event;
use vhca_scenarios::{run, Scenario, ScenarioHost, ScenarioOptions};

/// The hold the seed suite's device gets is 1 s; a shorter one (still past the driver's 200 ms timeout) keeps the
/// test quick.
const HOLD: &str = "hold_completion_ms=400";
/// VT-d's fault reason for a write the IOMMU does not permit, as the guest's DMAR record gives it.
const WRITE_NOT_PERMITTED: u64 = 5;

/// The IOVAs the device was refused because nothing maps them: what the platform's IOMMU would report.
#[derive(Default)]
struct Refusals(Mutex<Vec<u64>>);

impl EventSink for Refusals {
    fn emit(&self, event: HcaEvent) {
        if let HcaEvent::Fault(f) = event {
            if f.cause == "iommu_unmapped" {
                self.0.lock().unwrap().extend(f.iova);
            }
        }
    }
}

/// The device and what its transport keeps: when the held request is due.
struct Device {
    hca: Mutex<vhca_hca::Hca>,
    dma: BackendDma,
    release_at: Mutex<Option<Instant>>,
    refusals: Arc<Refusals>,
}

impl Device {
    fn note_hold(&self, hca: &mut vhca_hca::Hca) {
        if let Some(hold) = hca.take_new_hold() {
            *self.release_at.lock().unwrap() = Some(Instant::now() + hold);
        }
    }

    /// The transport's deadline: the held request runs once its time is up.
    fn release_if_due(&self) {
        let due = self.release_at.lock().unwrap().is_some_and(|at| Instant::now() >= at);
        if due {
            *self.release_at.lock().unwrap() = None;
            self.hca.lock().unwrap().release_held_work(&self.dma);
        }
    }
}

struct Channel(Arc<Device>);

impl CommandTransport for Channel {
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

struct Host {
    kernel: Arc<NtModel>,
    device: Arc<Device>,
    origin: Instant,
}

impl ScenarioHost for Host {
    type Kernel = NtModel;
    type Channel = Channel;
    fn say(&self, _: std::fmt::Arguments<'_>) {}
    fn detail(&self, _: &str, _: Value) {}
    fn lock_chosen(&self, _: &'static str) {}
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
    fn sleep(&self, duration: Duration) {
        std::thread::sleep(duration);
        self.device.release_if_due();
    }
    fn alloc_user_buffer(&self, _: u32, _: u64) -> PVOID {
        PVOID::NULL
    }
    fn free_user_buffer(&self, _: PVOID) {}
    /// Waits as the guest does for DMAR records, then hands the kernel each refusal (0xE6/0x26 with DMA checking).
    fn report_platform_iommu_faults(&self, wait: Duration) -> Option<usize> {
        let deadline = Instant::now() + wait;
        while self.device.refusals.0.lock().unwrap().is_empty() && Instant::now() < deadline {
            self.sleep(Duration::from_millis(5));
        }
        let refused = self.device.refusals.0.lock().unwrap().clone();
        for iova in &refused {
            self.kernel.report_iommu_fault(PDO, *iova, WRITE_NOT_PERMITTED);
        }
        Some(refused.len())
    }
    fn dma_checking(&self) -> Option<bool> {
        Some(self.kernel.verifier().contains(VerifierFlags::DMA_CHECKING))
    }
    fn driver_closed(&self) -> anyhow::Result<()> {
        self.kernel.unload_driver();
        Ok(())
    }
}

/// Runs `scenario` against a device holding its first send request: the scenario's result or the bugcheck, and the
/// IOVAs the device was refused.
fn run_on(
    scenario: Scenario,
    flags: u32,
    disabled: &[&str],
    break_fix: bool,
) -> (Result<anyhow::Result<()>, Bugcheck>, Vec<u64>) {
    let config = NtModelConfig {
        verifier: VerifierFlags(flags),
        disabled_rules: disabled.iter().map(|r| RuleId::parse(r).unwrap()).collect(),
        ..NtModelConfig::default()
    };
    let (kernel, backend) = machine_with(config);
    let mut injection = FaultInjection::default();
    injection.parse_kv(HOLD).unwrap();
    let refusals = Arc::new(Refusals::default());
    let hca = vhca_hca::Hca::new(HcaConfig { injection, ..HcaConfig::default() }, refusals.clone());
    let device = Arc::new(Device {
        hca: Mutex::new(hca),
        dma: BackendDma(backend),
        release_at: Mutex::new(None),
        refusals: refusals.clone(),
    });
    let host = Host { kernel: kernel.clone(), device: device.clone(), origin: Instant::now() };
    let options = ScenarioOptions { break_fix, ..ScenarioOptions::default() };
    let result = NtModel::run_guarded(|| {
        run(scenario, &host, kernel.clone(), Channel(device.clone()), PDO, &options, Duration::from_secs(5))
    });
    let refused = refusals.0.lock().unwrap().clone();
    (result, refused)
}

const STANDARD: u32 = 0xAA;

fn is_iommu_violation(b: &Bugcheck, refused: &[u64]) -> bool {
    b.code == DRIVER_VERIFIER_DMA_VIOLATION
        && b.params[0] == 0x26
        && b.params[1] == PDO.0
        && refused.contains(&b.params[2])
        && b.params[3] == WRITE_NOT_PERMITTED
}

#[test]
fn freeing_the_buffer_on_the_timeout_lets_the_late_write_meet_the_iommu() {
    let (off, refused) = run_on(Scenario::TimeoutFreesBuffer, 0, &[], false);
    assert!(off.expect("no bugcheck without the verifier").is_ok(), "the scenario saw the late fault");
    assert_eq!(refused.len(), 1, "one late write refused: {refused:x?}");
    let (on, refused) = run_on(Scenario::TimeoutFreesBuffer, STANDARD, &[], false);
    let on = on.unwrap_err();
    assert!(is_iommu_violation(&on, &refused), "{on:?} refused {refused:x?}");
    // Without its rule the verifier only records the platform's report; the run goes on as without it.
    let (unchecked, refused) = run_on(Scenario::TimeoutFreesBuffer, STANDARD, &["0xE6/0x26"], false);
    assert!(unchecked.expect("no bugcheck with 0xE6/0x26 disabled").is_ok());
    assert_eq!(refused.len(), 1);
}

#[test]
fn flushing_the_qp_first_drops_the_held_request_and_break_fix_frees_first_again() {
    for flags in [0, STANDARD] {
        let (fixed, refused) = run_on(Scenario::TimeoutFlushesQp, flags, &[], false);
        let fixed = fixed.unwrap_or_else(|b| panic!("flags {flags:#x}: {b:?}"));
        assert!(fixed.is_ok(), "flags {flags:#x}: {fixed:?}");
        assert!(refused.is_empty(), "flags {flags:#x}: the device still wrote: {refused:x?}");
    }
    let (broken, refused) = run_on(Scenario::TimeoutFlushesQp, STANDARD, &[], true);
    let broken = broken.unwrap_err();
    assert!(is_iommu_violation(&broken, &refused), "{broken:?}");
}
