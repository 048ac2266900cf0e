//! sg-queued-freed-mdl, sg-fragmented and io-map-common-buffer-unchecked with their fixes through `vhca_scenarios::run` on the NT model and the
//! in-process device model: each seed verdict, the bug's going when its rule is disabled, and break_fix bringing the
//! bug back into the fix. (dma32-above-4g and physical-address-to-device need the real intel-iommu's refusal: the
//! seed suite's guest runs judge them.)

mod support;

use std::time::Duration;

use support::common::{machine_with, HcaChannel, PDO};
use support::{model_config, ModelHost, Platform, STANDARD};
use vhca_ntmodel::{Bugcheck, NtModel, NtModelConfig};
use vhca_scenarios::{run, Scenario, ScenarioOptions};

struct InProcess;

impl Platform for InProcess {
    type Channel = HcaChannel;
}

fn run_with(scenario: Scenario, config: NtModelConfig, break_fix: bool) -> Result<anyhow::Result<()>, Bugcheck> {
    run_remapped(scenario, config, break_fix, true)
}

/// As run_with, with the platform's DMA remapping on or off (the guest's `vhca.dma_remapping`).
fn run_remapped(
    scenario: Scenario,
    config: NtModelConfig,
    break_fix: bool,
    remapping: bool,
) -> Result<anyhow::Result<()>, Bugcheck> {
    let (kernel, backend) = machine_with(config);
    kernel.set_dma_remapping(remapping);
    let host = ModelHost::new(kernel.clone(), InProcess);
    let options = ScenarioOptions { break_fix, ..ScenarioOptions::default() };
    NtModel::run_guarded(|| {
        run(scenario, &host, kernel.clone(), HcaChannel::new(backend), PDO, &options, Duration::from_secs(5))
    })
}

fn run_on(scenario: Scenario, flags: u32, disabled: &[&str], break_fix: bool) -> Result<anyhow::Result<()>, Bugcheck> {
    run_with(scenario, model_config(flags, disabled), break_fix)
}

/// The seed's fragmentation for sg-fragmented: runs of four pages.
fn fragmented(flags: u32) -> NtModelConfig {
    NtModelConfig { max_contiguous_pages: Some(4), ..model_config(flags, &[]) }
}

fn is_freed_queued_mdl(b: &Bugcheck) -> bool {
    b.code == 0xE6 && b.params[0] == 0x0E && b.params[1] != 0 && b.params[2..] == [0, 0]
}

#[test]
fn a_queued_list_over_a_freed_mdl_is_e6_0e_under_dma_checking_and_passes_without() {
    let on = run_on(Scenario::SgQueuedFreedMdl, STANDARD, &[], false).unwrap_err();
    assert!(is_freed_queued_mdl(&on), "{on:?}");
    let off = run_on(Scenario::SgQueuedFreedMdl, 0, &[], false).expect("no bugcheck");
    assert!(off.is_ok(), "{off:?}");
    let disabled = run_on(Scenario::SgQueuedFreedMdl, STANDARD, &["0xE6/0x0E"], false).expect("no bugcheck");
    assert!(disabled.is_ok(), "{disabled:?}");
}

#[test]
fn keeping_the_mdl_passes_in_both_modes_and_break_fix_frees_it_again() {
    for flags in [0, STANDARD] {
        let fixed = run_on(Scenario::SgQueuedMdlKept, flags, &[], false).expect("no bugcheck");
        assert!(fixed.is_ok(), "flags {flags:#x}: {fixed:?}");
    }
    let broken = run_on(Scenario::SgQueuedMdlKept, STANDARD, &[], true).unwrap_err();
    assert!(is_freed_queued_mdl(&broken), "{broken:?}");
}

#[test]
fn the_first_element_alone_is_a_short_transfer_and_every_element_is_the_whole_buffer() {
    let bug = run_with(Scenario::SgFragmented, fragmented(0), false).expect("no bugcheck");
    let why = format!("{:#}", bug.expect_err("the first element alone passed"));
    assert!(why.contains("programmed 1 of the list's 2 elements"), "{why}");
    let fixed = run_with(Scenario::SgFragmentedFixed, fragmented(0), false).expect("no bugcheck");
    assert!(fixed.is_ok(), "{fixed:?}");
    let broken = run_with(Scenario::SgFragmentedFixed, fragmented(0), true).expect("no bugcheck");
    assert!(broken.is_err(), "break_fix passed");
    // Without fragmentation the list is one element and the bug cannot show: the check needs the knob.
    let contiguous = run_on(Scenario::SgFragmented, 0, &[], false).expect("no bugcheck");
    assert!(contiguous.is_ok(), "{contiguous:?}");
}

#[test]
fn without_remapping_io_map_common_buffer_refuses_a_fragmented_user_buffer_and_the_fix_falls_back() {
    for flags in [0, STANDARD] {
        let bug = run_remapped(Scenario::IoMapCommonBufferUnchecked, fragmented(flags), false, false);
        let why = format!("{:#}", bug.expect("no bugcheck").expect_err("the refusal was not met"));
        assert!(why.contains("IoMapCommonBuffer failed with status 0xc000000d"), "flags {flags:#x}: {why}");
        let fixed = run_remapped(Scenario::IoMapCommonBuffer, fragmented(flags), false, false);
        let fixed = fixed.expect("no bugcheck");
        assert!(fixed.is_ok(), "flags {flags:#x}: {fixed:?}");
        // Under remapping the same fragmented buffer is one logical range: the bug passes where it is tested.
        let remapped = run_remapped(Scenario::IoMapCommonBufferUnchecked, fragmented(flags), false, true);
        let remapped = remapped.expect("no bugcheck");
        assert!(remapped.is_ok(), "flags {flags:#x}: {remapped:?}");
    }
    // Without fragmentation the buffer is one run: no refusal to meet, even without remapping.
    let contiguous = run_remapped(Scenario::IoMapCommonBufferUnchecked, model_config(0, &[]), false, false);
    let contiguous = contiguous.expect("no bugcheck");
    assert!(contiguous.is_ok(), "{contiguous:?}");
}
