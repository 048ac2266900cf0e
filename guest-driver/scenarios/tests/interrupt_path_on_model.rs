//! The interrupt-path scenarios (dpc-grows-cq, dpc-reads-paged-context, isr-takes-spin-lock, dpc-waits-for-device,
//! dpc-spins-on-completion and their fixes) through `vhca_scenarios::run` on the NT model, with the driver core's
//! interrupt path connected over the in-process device model: an interrupt thread delivers the device's message
//! every millisecond (an ISR may be called when its device did not interrupt) and releases the device's held request
//! when due, a clock thread ticks. Each bug's stop shows with its rule, and goes with it; each fix runs clean.
//!
//! The model's DPC allotment is 8 ticks (125 ms) here and the device's hold 400 ms, so the watchdog runs stay short.

mod support;

use support::interrupting::{run_interrupting, Machine};
use support::{model_config, STANDARD};
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, TimingConfig};
use vhca_scenarios::Scenario;

const ALLOTMENT: u64 = 8;
const HOLD_MS: u64 = 400;

/// Runs `scenario` with the interrupt path: the first bugcheck raised on any thread, else the scenario's result.
fn run_on(scenario: Scenario, flags: u32, disabled: &[&str], break_fix: bool) -> Result<anyhow::Result<()>, Bugcheck> {
    let timing = TimingConfig { dpc_time_limit: ALLOTMENT, ..TimingConfig::default() };
    let machine = Machine { config: model_config(flags, disabled), timing, hold_ms: HOLD_MS };
    run_interrupting(scenario, machine, break_fix).outcome
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
