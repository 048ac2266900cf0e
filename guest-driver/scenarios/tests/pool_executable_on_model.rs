//! pool-executable and pool-non-executable through `vhca_scenarios::run` on the NT model and the in-process device
//! model: each verdict of the seed suite, that the bug's goes when its rule is disabled, and that the scenarios'
//! other pool (smoke's and the verbs scenarios' buffers) passes Code integrity checks too.

mod support;

use std::time::Duration;

use support::common::{machine_with, HcaChannel, PDO};
use support::{model_config, ModelHost, Platform, STANDARD};
use vhca_ntmodel::{Bugcheck, NtModel, VerifierFlags};
use vhca_scenarios::{run, Scenario, ScenarioOptions};

/// The seed entries' verifier-on flags: the defaults' and Code integrity checks.
const CODE_INTEGRITY: u32 = STANDARD | VerifierFlags::CODE_INTEGRITY.0;
const TAG: u64 = u32::from_le_bytes(*b"VhCi") as u64;

struct InProcess;

impl Platform for InProcess {
    type Channel = HcaChannel;
}

fn run_on(scenario: Scenario, flags: u32, disabled: &[&str], break_fix: bool) -> Result<anyhow::Result<()>, Bugcheck> {
    let (kernel, backend) = machine_with(model_config(flags, disabled));
    let host = ModelHost::new(kernel.clone(), InProcess);
    let options = ScenarioOptions { break_fix, ..ScenarioOptions::default() };
    NtModel::run_guarded(|| {
        run(scenario, &host, kernel.clone(), HcaChannel::new(backend), PDO, &options, Duration::from_secs(5))
    })
}

fn is_executable_pool(b: &Bugcheck) -> bool {
    b.code == 0xC4 && b.params[0] == 0x2000 && b.params[1] != 0 && b.params[2..] == [0, TAG]
}

#[test]
fn executable_context_is_c4_2000_under_code_integrity_checks_and_passes_without() {
    let on = run_on(Scenario::PoolExecutable, CODE_INTEGRITY, &[], false).unwrap_err();
    assert!(is_executable_pool(&on), "{on:?}");
    for flags in [0, STANDARD] {
        let off = run_on(Scenario::PoolExecutable, flags, &[], false).expect("no bugcheck");
        assert!(off.is_ok(), "flags {flags:#x}: {off:?}");
    }
}

#[test]
fn without_its_rule_the_executable_context_passes() {
    let on = run_on(Scenario::PoolExecutable, CODE_INTEGRITY, &["0xC4/0x2000"], false).expect("no bugcheck");
    assert!(on.is_ok(), "{on:?}");
}

#[test]
fn an_nx_context_passes_in_both_modes_and_break_fix_brings_the_bug_back() {
    for flags in [0, CODE_INTEGRITY] {
        let fixed = run_on(Scenario::PoolNonExecutable, flags, &[], false).expect("no bugcheck");
        assert!(fixed.is_ok(), "flags {flags:#x}: {fixed:?}");
    }
    let broken = run_on(Scenario::PoolNonExecutable, CODE_INTEGRITY, &[], true).unwrap_err();
    assert!(is_executable_pool(&broken), "{broken:?}");
}

#[test]
fn the_other_scenarios_pool_is_nx() {
    for scenario in [Scenario::Smoke, Scenario::VerbsLoopback] {
        let r = run_on(scenario, CODE_INTEGRITY, &[], false);
        assert!(matches!(r, Ok(Ok(()))), "{}: {r:?}", scenario.name());
    }
}
