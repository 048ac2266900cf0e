//! A scenario run through `vhca_scenarios::run` with the driver core's interrupt path connected over the
//! in-process device model: an interrupt thread delivers the device's message every millisecond (an ISR may be
//! called when its device did not interrupt) and the device thread releases a held request when due, a clock
//! thread ticks. The run's outcome is the first bugcheck raised on any thread, else the scenario's result; the
//! model stays for what it recorded (race reports, schedule points).
//!
//! Why here: the interrupt-path tests and the processor tests run scenarios alike and differ only in the model's
//! config (verifier, processors, interleaving mode); one harness keeps their machines the same.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vhca_driver_core::{CompletionWaits, CqCompletions, PathDevices, DEFAULT_CQE_BUDGET};
use vhca_ntmodel::{Bugcheck, InterruptResources, NtModel, NtModelConfig, TimingConfig, VerifierFlags};
use vhca_scenarios::{run, Scenario, ScenarioOptions};

use super::common::PDO;
use super::{HeldChannel, HeldDevice, ModelHost, NoEvents, Platform};

/// The interrupt path connected over the held device, whose release is the device thread's (not the host's sleeps);
/// the platform checks for IOMMU faults and finds none.
pub struct Interrupting(pub Arc<HeldDevice>);

impl Platform for Interrupting {
    type Channel = HeldChannel;
    fn report_iommu_faults(&self, _: &NtModel, _: Duration) -> Option<usize> {
        Some(0)
    }
    fn dma_checking(&self, kernel: &NtModel) -> Option<bool> {
        Some(kernel.verifier().contains(VerifierFlags::DMA_CHECKING))
    }
    fn connect_completions(&self, kernel: &Arc<NtModel>) -> anyhow::Result<Option<Box<dyn CqCompletions>>> {
        let channel = Arc::new(HeldChannel(self.0.clone()));
        let waits =
            CompletionWaits::connect(kernel.clone(), channel, PathDevices::pdo_only(PDO), DEFAULT_CQE_BUDGET, None)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Some(Box::new(waits)))
    }
}

/// A thread that calls `tick` every `period` until stopped or until a bugcheck unwinds it (the machine stopped).
fn ticker(period: Duration, stop: Arc<AtomicBool>, tick: impl Fn() + Send + 'static) -> JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Acquire) {
            if NtModel::run_guarded(&tick).is_err() {
                return;
            }
            std::thread::sleep(period);
        }
    })
}

/// What one run left: the model (its reports) and the first bugcheck, else the scenario's result.
pub struct InterruptingRun {
    pub kernel: Arc<NtModel>,
    pub outcome: Result<anyhow::Result<()>, Bugcheck>,
}

/// The machine a run gets.
pub struct Machine {
    pub config: NtModelConfig,
    pub timing: TimingConfig,
    /// How long the device holds its first send request.
    pub hold_ms: u64,
}

/// Runs `scenario` on `machine`. A bugcheck stops the machine: the scenario's thread is left where it is (it may
/// wait on a lock the stopped processor held), as nothing of a stopped machine runs on.
pub fn run_interrupting(scenario: Scenario, machine: Machine, break_fix: bool) -> InterruptingRun {
    let (kernel, backend) = NtModel::for_tests_with_timing(machine.config, machine.timing);
    kernel.assign_interrupts(PDO, InterruptResources::Messages(1));
    let device = HeldDevice::new(backend, machine.hold_ms, Arc::new(NoEvents));
    let stop = Arc::new(AtomicBool::new(false));
    // The device runs apart from the processor its interrupts are taken on, as a real one does.
    let d = device.clone();
    let device_thread = ticker(Duration::from_millis(1), stop.clone(), move || d.release_if_due());
    let k = kernel.clone();
    let interrupts = ticker(Duration::from_millis(1), stop.clone(), move || {
        k.deliver(PDO, 0);
    });
    let k = kernel.clone();
    let clock = ticker(Duration::from_micros(15_625), stop.clone(), move || k.clock_interrupt());
    let (k, d) = (kernel.clone(), device.clone());
    let scenario_thread = std::thread::spawn(move || {
        let host = ModelHost::new(k.clone(), Interrupting(d.clone()));
        let options = ScenarioOptions { break_fix, ..ScenarioOptions::default() };
        NtModel::run_guarded(|| {
            run(scenario, &host, k.clone(), HeldChannel(d.clone()), PDO, &options, Duration::from_secs(2))
        })
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while kernel.bugchecks().is_empty() && !scenario_thread.is_finished() {
        assert!(Instant::now() < deadline, "{scenario:?}: neither a result nor a bugcheck in 20 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::Release);
    let _ = (device_thread.join(), clock.join());
    if let Some(b) = kernel.bugchecks().first() {
        return InterruptingRun { outcome: Err(*b), kernel };
    }
    let _ = interrupts.join();
    let outcome = scenario_thread.join().expect("the scenario thread panicked");
    InterruptingRun { kernel, outcome }
}
