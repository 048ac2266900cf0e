//! The user program of sleep-during-traffic (`vhca.user=sleep-during-traffic`): a user-mode verbs process whose RDMA
//! write is in flight (posted, held by the device) when the machine sleeps; after the resume it polls for it, exits.

use vhca_loader::user_process::UserProcess;

use crate::report::progress;
use crate::user_program::LoaderProcess;

/// Two connected QPs, an MR on each side, one RDMA write posted (the seed's device holds it, `hold_completion_ms`),
/// then one S0→S3→S0 cycle with the write in flight, then a poll of the CQ made before the sleep. The process
/// exits after (its handles' CLEANUP, then the memory manager's check for pages left locked). What the driver must
/// do at D3 with the write in flight is docs/scenarios.md's "Sleep and resume during traffic"; what the poll shows is
/// logged and put in no verdict of its own: a success for the write would be a completion from before D3, which the
/// run fails on.
pub fn sleep_during_traffic(process: &mut UserProcess) -> Result<(), String> {
    write_in_flight_then(process, "the machine sleeps", || {
        vhca_loader::power_life::sleep_and_resume_now()
            .map(|()| true)
            .map_err(|why| format!("sleep/resume with a write in flight: {why}"))
    })
}

/// The process of rebalance-during-traffic (`vhca.pnp=rebalance-during-traffic`): the same write in flight, then the
/// PnP manager rebalances the device (QUERY_STOP, then STOP and START, or CANCEL_STOP when vhca.sys refuses).
pub fn rebalance_during_traffic(process: &mut UserProcess) -> Result<(), String> {
    write_in_flight_then(process, "the device is rebalanced", || {
        let stopped =
            vhca_loader::pnp_life::rebalance_now().map_err(|why| format!("rebalance with a write in flight: {why}"))?;
        progress(format_args!(
            "user process: the rebalance {}",
            if stopped { "stopped the device" } else { "was refused" }
        ));
        Ok(stopped)
    })
}

/// The process of surprise-removal-during-traffic (`vhca.pnp=hot-unplug-during-traffic`): the same write in flight,
/// then a real hot-unplug: the PnP manager waits for the platform's removal request and sends
/// IRP_MN_SURPRISE_REMOVAL; REMOVE follows once the process exited.
pub fn surprise_removal_during_traffic(process: &mut UserProcess) -> Result<(), String> {
    write_in_flight_then(process, "the HCA is hot-unplugged", || {
        vhca_loader::pnp_life::surprise_removal_now()
            .map(|()| true)
            .map_err(|why| format!("hot-unplug with a write in flight: {why}"))
    })
}

/// The shared life (vhca-user-verbs' `write_in_flight_then`, vhca-verbs-test.exe's `held-write` on Windows) in the
/// loader's user process; `during` is what the system does to the device meanwhile (true when it reset the device).
fn write_in_flight_then(
    process: &mut UserProcess,
    what: &str,
    during: impl FnOnce() -> Result<bool, String>,
) -> Result<(), String> {
    vhca_user_verbs::write_in_flight_then(&mut LoaderProcess(process), what, |_| during()).map(|_| ())
}
