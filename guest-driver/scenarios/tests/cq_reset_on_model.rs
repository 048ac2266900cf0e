//! stale-completion-after-reset and reset-clears-cq through `vhca_scenarios::run` on the NT model and the in-process
//! device model, holding the first request after the reset (`hold_completion_wr=3`: the read before the reset and
//! the failing one come first). The host releases the hold when its time is up and plays the platform: the device's
//! refusal of an unmapped IOVA is the IOMMU fault it reports, so each verdict of the seed suite shows without QEMU.

mod support;

use support::common::PDO;
use support::late_dma::{is_iommu_violation, run_late_dma};
use support::{model_config, STANDARD};
use vhca_ntmodel::Bugcheck;
use vhca_scenarios::Scenario;

/// Past the CQ poll's first look, short enough to keep the test quick (the seed suite's device holds 500 ms).
const HOLD_MS: u64 = 300;
/// The read before the reset is the first send request the device starts, the failing one the second.
const FIRST_AFTER_RESET: u32 = 3;

fn run_on(scenario: Scenario, flags: u32, break_fix: bool) -> (Result<anyhow::Result<()>, Bugcheck>, Vec<u64>) {
    run_late_dma(scenario, model_config(flags, &[]), (HOLD_MS, FIRST_AFTER_RESET), break_fix)
}

#[test]
fn a_ring_kept_as_left_hands_out_the_old_completion_and_the_held_read_meets_the_iommu() {
    let (off, refused) = run_on(Scenario::StaleCompletionAfterReset, 0, false);
    let off = off.expect("no bugcheck without the verifier");
    assert!(off.is_ok(), "the scenario saw the stale completion and the late fault: {off:?}");
    assert_eq!(refused.len(), 1, "one late read refused: {refused:x?}");
    let (on, refused) = run_on(Scenario::StaleCompletionAfterReset, STANDARD, false);
    let on = on.unwrap_err();
    assert!(is_iommu_violation(&on, PDO, &refused), "{on:?} refused {refused:x?}");
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
    assert!(is_iommu_violation(&broken, PDO, &refused), "{broken:?}");
}
