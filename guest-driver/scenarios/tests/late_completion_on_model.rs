//! timeout-frees-buffer and timeout-flushes-qp through `vhca_scenarios::run` on the NT model and the in-process device
//! model with its hold_completion knob: the host plays the device's transport (it releases the held request when
//! its time is up, whenever the driver sleeps) and the platform (the device's refusal of an unmapped IOVA is the
//! IOMMU fault it reports), so each verdict of the seed suite shows without QEMU.

mod support;

use support::common::PDO;
use support::late_dma::{is_iommu_violation, run_late_dma};
use support::{model_config, STANDARD};
use vhca_ntmodel::Bugcheck;
use vhca_scenarios::Scenario;

/// The hold the seed suite's device gets is 1 s; a shorter one (still past the driver's 200 ms timeout) keeps the
/// test quick.
const HOLD_MS: u64 = 400;

/// Runs `scenario` against a device holding its first send request: the scenario's result or the bugcheck, and the
/// IOVAs the device was refused.
fn run_on(
    scenario: Scenario,
    flags: u32,
    disabled: &[&str],
    break_fix: bool,
) -> (Result<anyhow::Result<()>, Bugcheck>, Vec<u64>) {
    run_late_dma(scenario, model_config(flags, disabled), (HOLD_MS, 1), break_fix)
}

#[test]
fn freeing_the_buffer_on_the_timeout_lets_the_late_write_meet_the_iommu() {
    let (off, refused) = run_on(Scenario::TimeoutFreesBuffer, 0, &[], false);
    assert!(off.expect("no bugcheck without the verifier").is_ok(), "the scenario saw the late fault");
    assert_eq!(refused.len(), 1, "one late write refused: {refused:x?}");
    let (on, refused) = run_on(Scenario::TimeoutFreesBuffer, STANDARD, &[], false);
    let on = on.unwrap_err();
    assert!(is_iommu_violation(&on, PDO, &refused), "{on:?} refused {refused:x?}");
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
    assert!(is_iommu_violation(&broken, PDO, &refused), "{broken:?}");
}
