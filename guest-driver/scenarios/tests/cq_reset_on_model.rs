//! stale-completion-after-reset and reset-clears-cq through `vhca_scenarios::run` on the NT model and the in-process
//! device model, holding the first request after the reset (`hold_completion_wr=3`: the read before the reset and
//! the failing one come first). The host releases the hold when its time is up and plays the platform: the device's
//! refusal of an unmapped IOVA is the IOMMU fault it reports, so each verdict of the seed suite shows without QEMU.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::common::{machine_with, PDO};
use support::{model_config, HeldChannel, HeldDevice, ModelHost, Platform, STANDARD};
use vhca_hca::{EventSink, HcaEvent};
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, NtModel, VerifierFlags};
use vhca_scenarios::{run, Scenario, ScenarioOptions};

/// Past the CQ poll's first look, short enough to keep the test quick (the seed suite's device holds 500 ms).
const HOLD_MS: u64 = 300;
/// The read before the reset is the first send request the device starts, the failing one the second.
const FIRST_AFTER_RESET: u32 = 3;
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

struct HeldAfterReset {
    device: Arc<HeldDevice>,
    refusals: Arc<Refusals>,
}

impl Platform for HeldAfterReset {
    type Channel = HeldChannel;
    fn time_passed(&self, _: &NtModel) {
        self.device.release_if_due();
    }
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

fn run_on(scenario: Scenario, flags: u32, break_fix: bool) -> (Result<anyhow::Result<()>, Bugcheck>, Vec<u64>) {
    let (kernel, backend) = machine_with(model_config(flags, &[]));
    let refusals = Arc::new(Refusals::default());
    let device = HeldDevice::holding(backend, HOLD_MS, FIRST_AFTER_RESET, refusals.clone());
    let host = ModelHost::new(kernel.clone(), HeldAfterReset { device: device.clone(), refusals: refusals.clone() });
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
fn a_ring_kept_as_left_hands_out_the_old_completion_and_the_held_read_meets_the_iommu() {
    let (off, refused) = run_on(Scenario::StaleCompletionAfterReset, 0, false);
    let off = off.expect("no bugcheck without the verifier");
    assert!(off.is_ok(), "the scenario saw the stale completion and the late fault: {off:?}");
    assert_eq!(refused.len(), 1, "one late read refused: {refused:x?}");
    let (on, refused) = run_on(Scenario::StaleCompletionAfterReset, STANDARD, false);
    let on = on.unwrap_err();
    assert!(is_iommu_violation(&on, &refused), "{on:?} refused {refused:x?}");
}

#[test]
fn a_cleared_ring_waits_for_the_device_and_break_fix_keeps_it_as_left_again() {
    for flags in [0, STANDARD] {
        let (fixed, refused) = run_on(Scenario::ResetClearsCq, flags, false);
        let fixed = fixed.unwrap_or_else(|b| panic!("flags {flags:#x}: {b:?}"));
        assert!(fixed.is_ok(), "flags {flags:#x}: {fixed:?}");
        assert!(refused.is_empty(), "flags {flags:#x}: the device wrote into a freed buffer: {refused:x?}");
    }
    let (broken, refused) = run_on(Scenario::ResetClearsCq, STANDARD, true);
    let broken = broken.unwrap_err();
    assert!(is_iommu_violation(&broken, &refused), "{broken:?}");
}
