//! timeout-frees-buffer and timeout-flushes-qp through `vhca_scenarios::run` on the NT model and the in-process device
//! model with its hold_completion knob: the host plays the device's transport (it releases the held request when
//! its time is up, whenever the driver sleeps) and the platform (the device's refusal of an unmapped IOVA is the
//! IOMMU fault it reports), so each verdict of the seed suite shows without QEMU.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::common::{machine_with, PDO};
use support::{model_config, HeldChannel, HeldDevice, ModelHost, Platform, STANDARD};
use vhca_hca::{EventSink, HcaEvent};
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, NtModel, VerifierFlags};
use vhca_scenarios::{run, Scenario, ScenarioOptions};

/// The hold the seed suite's device gets is 1 s; a shorter one (still past the driver's 200 ms timeout) keeps the
/// test quick.
const HOLD_MS: u64 = 400;
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

/// The held device, released whenever the driver sleeps, and the platform whose IOMMU refused its unmapped writes.
struct TimedOut {
    device: Arc<HeldDevice>,
    refusals: Arc<Refusals>,
}

impl Platform for TimedOut {
    type Channel = HeldChannel;
    fn time_passed(&self, _: &NtModel) {
        self.device.release_if_due();
    }
    /// Waits as the guest does for DMAR records, then hands the kernel each refusal (0xE6/0x26 with DMA checking).
    fn report_iommu_faults(&self, kernel: &NtModel, wait: Duration) -> Option<usize> {
        let deadline = Instant::now() + wait;
        while self.refusals.0.lock().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            self.time_passed(kernel);
        }
        let refused = self.refusals.0.lock().unwrap().clone();
        for iova in &refused {
            kernel.report_iommu_fault(PDO, *iova, WRITE_NOT_PERMITTED);
        }
        Some(refused.len())
    }
    fn dma_checking(&self, kernel: &NtModel) -> Option<bool> {
        Some(kernel.verifier().contains(VerifierFlags::DMA_CHECKING))
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
    let (kernel, backend) = machine_with(model_config(flags, disabled));
    let refusals = Arc::new(Refusals::default());
    let device = HeldDevice::new(backend, HOLD_MS, refusals.clone());
    let host = ModelHost::new(kernel.clone(), TimedOut { device: device.clone(), refusals: refusals.clone() });
    let options = ScenarioOptions { break_fix, ..ScenarioOptions::default() };
    let result = NtModel::run_guarded(|| {
        run(scenario, &host, kernel.clone(), HeldChannel(device.clone()), PDO, &options, Duration::from_secs(5))
    });
    let refused = refusals.0.lock().unwrap().clone();
    (result, refused)
}

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
