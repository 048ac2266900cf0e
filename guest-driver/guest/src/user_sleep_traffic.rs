//! The user program of sleep-during-traffic (`vhca.user=sleep-during-traffic`): a user-mode verbs process whose RDMA
//! write is in flight (posted, held by the device) when the machine sleeps; after the resume it polls for it, exits.

use vhca_driver_core::ioctl_codec::IOCTL_VHCA_DEREG_MR;
use vhca_loader::user_process::UserProcess;
use vhca_proto::status::WcStatus;
use vhca_proto::{ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};
use vhca_user_verbs::{process_bytes, ConnectedPair, Provider};

use crate::report::progress;
use crate::user_program::LoaderProcess;

/// One page each way: the write's source and destination, in the process's own memory.
const LEN: usize = 4096;
const WR_ID: u64 = 0x5_1ee9;

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

/// Two connected QPs, an MR on each side, one RDMA write posted and held by the device; then `during` (what the
/// system does to the device meanwhile; true when it reset the device), then a poll of the CQ made before it, then
/// the process exits. The steps are vhca-user-verbs' (the Windows test program's).
fn write_in_flight_then(
    process: &mut UserProcess,
    what: &str,
    during: impl FnOnce() -> Result<bool, String>,
) -> Result<(), String> {
    let mut process = LoaderProcess(process);
    let mut p = Provider::open(&mut process)?;
    let ConnectedPair { pd, cq, a, .. } = p.connected_pair()?;
    let src = p.allocate(LEN, 0, "the source")?;
    // SAFETY: `allocate` gave LEN bytes of the process's memory at `src`, mapped until the process exits.
    unsafe { process_bytes(src, LEN) }.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
    let dst = p.allocate(LEN, 0, "the destination")?;
    let src_mr = p.register(pd, src, LEN, 0)?;
    let dst_mr = p.register(pd, dst, LEN, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE)?;
    p.post_rdma_write(a, &src_mr, &dst_mr, LEN, WR_ID)?;
    // Still in flight, or the run would test nothing: the device holds the write, so the CQ has nothing yet. A
    // completion here means the hold missed it (hold_completion_wr counts the scenario's own sends first).
    let (status, early) = p.poll(cq)?;
    if status < 0 {
        return Err(format!("POLL_CQ before {what}: status {:#010x}", status as u32));
    }
    if let Some(c) = early.iter().find(|c| c.wr_id.get() == WR_ID) {
        // The MRs given back first, so the exit's locked-pages check cannot stand in for the bug this run was to
        // show (under BreakFix 1 the process's CLEANUP releases nothing either): the verdict is this failure.
        for mr in [&src_mr, &dst_mr] {
            p.destroy("DEREG_MR", IOCTL_VHCA_DEREG_MR, mr.lkey)?;
        }
        return Err(format!(
            "RDMA write {WR_ID:#x} completed ({}) before {what}: the device did not hold it (hold_completion_ms, \
             hold_completion_wr)",
            WcStatus::from_u32(c.status.get()).map_or("UNKNOWN", WcStatus::name)
        ));
    }
    progress(format_args!("user process: RDMA write {WR_ID:#x} posted and not completed; {what} with it in flight"));
    let reset = during()?;

    let (status, polled) = p.poll(cq)?;
    progress(format_args!(
        "user process: POLL_CQ after that: status {:#010x}, {} completion(s) {:?}",
        status as u32,
        polled.len(),
        polled
            .iter()
            .map(|c| (c.wr_id.get(), WcStatus::from_u32(c.status.get()).map_or("UNKNOWN", WcStatus::name)))
            .collect::<Vec<_>>()
    ));
    if reset && polled.iter().any(|c| c.wr_id.get() == WR_ID && c.status.get() == WcStatus::Success as u32) {
        return Err(format!("RDMA write {WR_ID:#x} from before the reset completed successfully after it"));
    }
    // The process exits here with everything still registered: its handles' CLEANUP is the driver's to release.
    Ok(())
}
