//! unload-timer-set and unload-timer-cancelled through `vhca_scenarios::run` on the NT model and the in-process
//! device model, with a host that unloads the driver and, while the system runs on, ticks the model's clock as the
//! guest's clock thread does: each verdict of the seed suite, and that it goes when the rule behind it is disabled.

mod support;

use std::time::Duration;

use support::common::{machine_with, HcaChannel, PDO};
use support::{model_config, ModelHost, Platform, STANDARD};
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, NtModel};
use vhca_scenarios::{run, Scenario, ScenarioOptions};

/// The device model straight in process, and time that passes as on the guest's clock thread: the clock
/// interrupts, and a timer that fell due expires.
struct Unloading;

impl Platform for Unloading {
    type Channel = HcaChannel;
    fn time_passed(&self, kernel: &NtModel) {
        kernel.clock_interrupt();
    }
}

/// Runs `scenario` on a fresh model: Ok(scenario result) or the bugcheck that stopped it.
fn run_on(scenario: Scenario, flags: u32, disabled: &[&str], break_fix: bool) -> Result<anyhow::Result<()>, Bugcheck> {
    let (kernel, backend) = machine_with(model_config(flags, disabled));
    let host = ModelHost::new(kernel.clone(), Unloading);
    let options = ScenarioOptions { break_fix, ..ScenarioOptions::default() };
    NtModel::run_guarded(|| {
        run(scenario, &host, kernel.clone(), HcaChannel::new(backend), PDO, &options, Duration::from_secs(5))
    })
}

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
