//! The machine of the late-DMA tests (a held request, then the driver's buffer unmapped under it): the held device,
//! released whenever the driver sleeps, and the platform whose IOMMU refused its unmapped writes, which it reports
//! to the kernel as the guest's DMAR records are reported (0xE6/0x26 with DMA checking).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vhca_hca::{EventSink, HcaEvent};
use vhca_ntapi::{DRIVER_VERIFIER_DMA_VIOLATION, PDEVICE_OBJECT};
use vhca_ntmodel::{Bugcheck, NtModel, NtModelConfig, VerifierFlags};
use vhca_scenarios::{run, Scenario, ScenarioOptions};

use super::common::{machine_with, PDO};
use super::{HeldChannel, HeldDevice, ModelHost, Platform};

/// VT-d's fault reason for a write the IOMMU does not permit, as the guest's DMAR record gives it.
pub const WRITE_NOT_PERMITTED: u64 = 5;

/// The IOVAs the device was refused because nothing maps them: what the platform's IOMMU would report.
#[derive(Default)]
pub struct Refusals(pub Mutex<Vec<u64>>);

impl Refusals {
    pub fn seen(&self) -> Vec<u64> {
        self.0.lock().unwrap().clone()
    }
}

impl EventSink for Refusals {
    fn emit(&self, event: HcaEvent) {
        if let HcaEvent::Fault(f) = event {
            if f.cause == "iommu_unmapped" {
                self.0.lock().unwrap().extend(f.iova);
            }
        }
    }
}

pub struct LateDma {
    pub device: Arc<HeldDevice>,
    pub refusals: Arc<Refusals>,
    /// The device the platform names in its reports (the HCA's PDO).
    pub pdo: PDEVICE_OBJECT,
}

impl Platform for LateDma {
    type Channel = HeldChannel;
    fn time_passed(&self, _: &NtModel) {
        self.device.release_if_due();
    }
    /// Waits as the guest does for DMAR records, then hands the kernel each refusal.
    fn report_iommu_faults(&self, kernel: &NtModel, wait: Duration) -> Option<usize> {
        let deadline = Instant::now() + wait;
        while self.refusals.0.lock().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            self.time_passed(kernel);
        }
        let refused = self.refusals.seen();
        for iova in &refused {
            kernel.report_iommu_fault(self.pdo, *iova, WRITE_NOT_PERMITTED);
        }
        Some(refused.len())
    }
    fn dma_checking(&self, kernel: &NtModel) -> Option<bool> {
        Some(kernel.verifier().contains(VerifierFlags::DMA_CHECKING))
    }
}

/// 0xE6/0x26 for one of the refused IOVAs: P2 the device, P3 the address, P4 write not permitted.
pub fn is_iommu_violation(b: &Bugcheck, pdo: PDEVICE_OBJECT, refused: &[u64]) -> bool {
    b.code == DRIVER_VERIFIER_DMA_VIOLATION
        && b.params[0] == 0x26
        && b.params[1] == pdo.0
        && refused.contains(&b.params[2])
        && b.params[3] == WRITE_NOT_PERMITTED
}

/// Runs `scenario` on a model with `config` against a device that holds its `wr`th send request `hold_ms`: the
/// scenario's result or the bugcheck, and the IOVAs the device was refused.
pub fn run_late_dma(
    scenario: Scenario,
    config: NtModelConfig,
    (hold_ms, wr): (u64, u32),
    break_fix: bool,
) -> (Result<anyhow::Result<()>, Bugcheck>, Vec<u64>) {
    let (kernel, backend) = machine_with(config);
    let refusals = Arc::new(Refusals::default());
    let device = HeldDevice::holding(backend, hold_ms, wr, refusals.clone());
    let host = ModelHost::new(kernel.clone(), LateDma { device: device.clone(), refusals: refusals.clone(), pdo: PDO });
    let options = ScenarioOptions { break_fix, ..ScenarioOptions::default() };
    let result = NtModel::run_guarded(|| {
        run(scenario, &host, kernel.clone(), HeldChannel(device.clone()), PDO, &options, Duration::from_secs(5))
    });
    (result, refusals.seen())
}
