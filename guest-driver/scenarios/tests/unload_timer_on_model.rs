//! unload-timer-set and unload-timer-cancelled through `vhca_scenarios::run` on the NT model and the in-process
//! device model, with a host that unloads the driver and, while the system runs on, ticks the model's clock as the
//! guest's clock thread does: each verdict of the seed suite, and that it goes when the rule behind it is disabled.

#[path = "../../ntmodel/tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{machine_with, HcaChannel, PDO};
use serde_json::Value;
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, NtModel, NtModelConfig, RuleId, VerifierFlags};
use vhca_scenarios::{run, Scenario, ScenarioHost, ScenarioOptions};

struct UnloadingHost {
    kernel: Arc<NtModel>,
    origin: Instant,
}

impl ScenarioHost for UnloadingHost {
    type Kernel = NtModel;
    type Channel = HcaChannel;
    fn say(&self, _: std::fmt::Arguments<'_>) {}
    fn detail(&self, _: &str, _: Value) {}
    fn lock_chosen(&self, _: &'static str) {}
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
    /// Time passes and the clock interrupts, as on the guest's clock thread: a timer that fell due expires.
    fn sleep(&self, duration: Duration) {
        std::thread::sleep(duration);
        self.kernel.clock_interrupt();
    }
    fn alloc_user_buffer(&self, _: u32, _: u64) -> PVOID {
        PVOID::NULL
    }
    fn free_user_buffer(&self, _: PVOID) {}
    fn report_platform_iommu_faults(&self, _: Duration) -> Option<usize> {
        None
    }
    fn dma_checking(&self) -> Option<bool> {
        None
    }
    fn driver_closed(&self) -> anyhow::Result<()> {
        self.kernel.unload_driver();
        Ok(())
    }
}

/// Runs `scenario` on a fresh model: Ok(scenario result) or the bugcheck that stopped it.
fn run_on(scenario: Scenario, flags: u32, disabled: &[&str], break_fix: bool) -> Result<anyhow::Result<()>, Bugcheck> {
    let config = NtModelConfig {
        verifier: VerifierFlags(flags),
        disabled_rules: disabled.iter().map(|r| RuleId::parse(r).unwrap()).collect(),
        ..NtModelConfig::default()
    };
    let (kernel, backend) = machine_with(config);
    let host = UnloadingHost { kernel: kernel.clone(), origin: Instant::now() };
    let options = ScenarioOptions { break_fix, ..ScenarioOptions::default() };
    NtModel::run_guarded(|| {
        run(scenario, &host, kernel.clone(), HcaChannel::new(backend), PDO, &options, Duration::from_secs(5))
    })
}

const STANDARD: u32 = 0xAA;
/// The model's object range, P3 and P4 of 0xC7 (docs/verifier.md), as the seed suite names them.
const OBJECTS: (u64, u64) = (0xFFFF_A000_0000_0000, 0xFFFF_B000_0000_0000);

fn is_c7_timer(b: &Bugcheck) -> bool {
    b.code == TIMER_OR_DPC_INVALID && b.params[0] == 0 && (b.params[2], b.params[3]) == OBJECTS
}

fn is_d4_at_dispatch(b: &Bugcheck) -> bool {
    let routine = b.params[0];
    b.code == SYSTEM_SCAN_AT_RAISED_IRQL_CAUGHT_IMPROPER_DRIVER_UNLOAD
        && b.params[1..] == [DISPATCH_LEVEL as u64, 0, routine]
        && routine != 0
}

#[test]
fn a_watchdog_left_set_is_c7_at_unload_with_the_verifier_and_d4_from_its_next_expiry_without() {
    let on = run_on(Scenario::UnloadTimerSet, STANDARD, &[], false).unwrap_err();
    assert!(is_c7_timer(&on), "{on:?}");
    assert!((OBJECTS.0..OBJECTS.1).contains(&on.params[1]), "P2 is the timer, in the range checked: {on:?}");
    let off = run_on(Scenario::UnloadTimerSet, 0, &[], false).unwrap_err();
    assert!(is_d4_at_dispatch(&off), "{off:?}");
}

#[test]
fn without_its_rule_each_verdict_goes() {
    // No 0xC7: the verifier lets the unload through, and the timer's expiry meets the kernel's own stop.
    let on = run_on(Scenario::UnloadTimerSet, STANDARD, &["0xC7"], false).unwrap_err();
    assert!(is_d4_at_dispatch(&on), "{on:?}");
    // No 0xD4 either: the DPC of the unloaded driver runs, and nothing stops the machine.
    let off = run_on(Scenario::UnloadTimerSet, 0, &["0xD4"], false).expect("no bugcheck");
    assert!(off.is_ok(), "{off:?}");
}

#[test]
fn stopping_the_watchdog_before_unload_passes_in_both_modes_and_break_fix_brings_the_bug_back() {
    for flags in [0, STANDARD] {
        let fixed = run_on(Scenario::UnloadTimerCancelled, flags, &[], false).expect("no bugcheck");
        assert!(fixed.is_ok(), "flags {flags:#x}: {fixed:?}");
    }
    let broken = run_on(Scenario::UnloadTimerCancelled, STANDARD, &[], true).unwrap_err();
    assert!(is_c7_timer(&broken), "{broken:?}");
}
