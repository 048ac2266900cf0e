//! The interrupt-path scenarios (dpc-grows-cq, dpc-reads-paged-context, isr-takes-spin-lock, dpc-waits-for-device,
//! dpc-spins-on-completion and their fixes) through `vhca_scenarios::run` on the NT model, with the driver core's
//! interrupt path connected over the in-process device model: an interrupt thread delivers the device's message
//! every millisecond (an ISR may be called when its device did not interrupt) and releases the device's held request
//! when due, a clock thread ticks. Each bug's stop shows with its rule, and goes with it; each fix runs clean.
//!
//! The model's DPC allotment is 8 ticks (125 ms) here and the device's hold 400 ms, so the watchdog runs stay short.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use support::common::PDO;
use support::{model_config, HeldChannel, HeldDevice, ModelHost, NoEvents, Platform, STANDARD};
use vhca_driver_core::{CompletionWaits, CqCompletions, PathDevices, DEFAULT_CQE_BUDGET};
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, InterruptResources, NtModel, TimingConfig, VerifierFlags};
use vhca_scenarios::{run, Scenario, ScenarioOptions};

const ALLOTMENT: u64 = 8;
const HOLD_MS: u64 = 400;

/// The interrupt path connected over the held device, whose release is the device thread's (not the host's sleeps);
/// the platform checks for IOMMU faults and finds none.
struct Interrupting(Arc<HeldDevice>);

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

/// Runs `scenario` with the interrupt path: the first bugcheck raised on any thread, else the scenario's result. A
/// bugcheck stops the machine: the scenario's thread is left where it is (it may wait on a lock the stopped
/// processor held), as nothing of a stopped machine runs on.
fn run_on(scenario: Scenario, flags: u32, disabled: &[&str], break_fix: bool) -> Result<anyhow::Result<()>, Bugcheck> {
    let timing = TimingConfig { dpc_time_limit: ALLOTMENT, ..TimingConfig::default() };
    let (kernel, backend) = NtModel::for_tests_with_timing(model_config(flags, disabled), timing);
    kernel.assign_interrupts(PDO, InterruptResources::Messages(1));
    let device = HeldDevice::new(backend, HOLD_MS, Arc::new(NoEvents));
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
        return Err(*b);
    }
    let _ = interrupts.join();
    scenario_thread.join().expect("the scenario thread panicked")
}

fn stop_of(scenario: Scenario, flags: u32, disabled: &[&str], break_fix: bool) -> Bugcheck {
    match run_on(scenario, flags, disabled, break_fix) {
        Err(b) => b,
        Ok(r) => panic!("{scenario:?} flags {flags:#x} disabled {disabled:?}: no bugcheck, {r:?}"),
    }
}

fn clean(scenario: Scenario, flags: u32, disabled: &[&str]) {
    match run_on(scenario, flags, disabled, false) {
        Ok(Ok(())) => {}
        other => panic!("{scenario:?} flags {flags:#x} disabled {disabled:?}: {other:?}"),
    }
}

#[test]
fn growing_the_cq_in_the_dpc_is_e6_13_at_dispatch_and_a_work_item_fixes_it() {
    clean(Scenario::DpcGrowsCq, 0, &[]);
    assert_eq!(stop_of(Scenario::DpcGrowsCq, STANDARD, &[], false), Bugcheck::e6(0x13, 1, 0, 2));
    clean(Scenario::DpcGrowsCq, STANDARD, &["0xE6/0x13"]);
    clean(Scenario::WorkItemGrowsCq, STANDARD, &[]);
    assert_eq!(stop_of(Scenario::WorkItemGrowsCq, STANDARD, &[], true), Bugcheck::e6(0x13, 1, 0, 2));
}

#[test]
fn a_paged_context_read_in_the_dpc_is_d1_and_nonpaged_pool_fixes_it() {
    clean(Scenario::DpcReadsPagedContext, 0, &[]);
    let b = stop_of(Scenario::DpcReadsPagedContext, STANDARD, &[], false);
    assert_eq!((b.code, b.params[1], b.params[2], b.params[3]), (DRIVER_IRQL_NOT_LESS_OR_EQUAL, 2, 0, 0), "{b:?}");
    clean(Scenario::DpcReadsPagedContext, STANDARD, &["0xD1"]);
    clean(Scenario::DpcReadsNonpagedContext, STANDARD, &[]);
}

#[test]
fn a_spin_lock_in_the_isr_is_c4_42_at_dirql_and_the_interrupt_spin_lock_fixes_it() {
    clean(Scenario::IsrTakesSpinLock, 0, &[]);
    let b = stop_of(Scenario::IsrTakesSpinLock, STANDARD, &[], false);
    assert_eq!((b.code, b.params[0], b.params[1], b.params[3]), (0xC4, 0x42, 5, 0), "{b:?}");
    // Without 0x42 the release at DIRQL is the next rule in line.
    assert_eq!(stop_of(Scenario::IsrTakesSpinLock, STANDARD, &["0xC4/0x42"], false).params[0], 0x32);
    clean(Scenario::IsrSynchronizesState, 0, &[]);
    clean(Scenario::IsrSynchronizesState, STANDARD, &[]);
}

#[test]
fn waiting_or_spinning_in_the_dpc_stops_the_machine_and_a_bounded_batch_does_not() {
    let b = stop_of(Scenario::DpcWaitsForDevice, STANDARD, &[], false);
    assert_eq!((b.code, b.params[0], b.params[1], b.params[3]), (0xC4, 0x122, 2, (-20_000_000i64) as u64), "{b:?}");
    // Unchecked the kernel's wait refuses to block the DPC: 0xB8 at the wait, P4 0 (P1-P3 threads and a stack).
    let b = stop_of(Scenario::DpcWaitsForDevice, 0, &[], false);
    assert_eq!((b.code, b.params[3]), (ATTEMPTED_SWITCH_FROM_DPC, 0), "{b:?}");
    // Without IRQL checking's rule the kernel's own stop is what is left.
    let b = stop_of(Scenario::DpcWaitsForDevice, STANDARD, &["0xC4/0x122"], false);
    assert_eq!(b.code, ATTEMPTED_SWITCH_FROM_DPC, "{b:?}");
    let b = stop_of(Scenario::DpcSpinsOnCompletion, STANDARD, &[], false);
    assert_eq!((b.code, b.params[0], b.params[2], b.params[3]), (DPC_WATCHDOG_VIOLATION, 0, ALLOTMENT, 0), "{b:?}");
    clean(Scenario::DpcSpinsOnCompletion, STANDARD, &["0x133"]);
    clean(Scenario::DpcBoundedBatch, 0, &[]);
    clean(Scenario::DpcBoundedBatch, STANDARD, &[]);
}
