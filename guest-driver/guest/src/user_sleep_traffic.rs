//! The user program of sleep-during-traffic (`vhca.user=sleep-during-traffic`): a user-mode verbs process whose RDMA
//! write is in flight (posted, held by the device) when the machine sleeps; after the resume it polls for it, exits.

use vhca_driver_core::ioctl_codec::*;
use vhca_loader::user_process::UserProcess;
use vhca_proto::status::WcStatus;
use vhca_proto::{Cqe, Sge, Wqe, WrOpcode, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, CQE_SIZE, WQE_SIZE, WR_SIGNALED};
use zerocopy::little_endian::U32;
use zerocopy::{FromBytes, IntoBytes};

use crate::report::progress;
use crate::user_program::call;

/// One page each way: the write's source and destination, in the process's own memory.
const LEN: usize = 4096;
const WR_ID: u64 = 0x5_1ee9;
/// The CQEs one poll after the resume may take.
const POLL_MAX: usize = 4;

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
/// the process exits.
fn write_in_flight_then(
    process: &mut UserProcess,
    what: &str,
    during: impl FnOnce() -> Result<bool, String>,
) -> Result<(), String> {
    let file = process.open_interface().map_err(|s| format!("CreateFile on the interface: {:#010x}", s as u32))?;
    let open = OpenContextIn { abi_version: USER_ABI_VERSION.into(), reserved: 0.into() };
    let _: OpenContextOut = call(process, file, "OPEN_CONTEXT", IOCTL_VHCA_OPEN_CONTEXT, open.as_bytes())?;
    let pd: HandleOut = call(process, file, "ALLOC_PD", IOCTL_VHCA_ALLOC_PD, &[])?;
    let cq_in = CreateCqIn { entries: 16.into(), reserved: 0.into() };
    let cq: CreateCqOut = call(process, file, "CREATE_CQ", IOCTL_VHCA_CREATE_CQ, cq_in.as_bytes())?;
    let qp_in = CreateQpIn {
        pd: pd.handle,
        send_cq: cq.cq,
        recv_cq: cq.cq,
        sq_entries: 16.into(),
        rq_entries: 16.into(),
        reserved: 0.into(),
    };
    let a: HandleOut = call(process, file, "CREATE_QP", IOCTL_VHCA_CREATE_QP, qp_in.as_bytes())?;
    let b: HandleOut = call(process, file, "CREATE_QP", IOCTL_VHCA_CREATE_QP, qp_in.as_bytes())?;
    for (qpn, dest) in [(a.handle, b.handle), (b.handle, a.handle)] {
        let connect = ConnectQpIn { qpn, dest_qpn: dest, access: ACCESS_REMOTE_WRITE.into(), reserved: 0.into() };
        call::<()>(process, file, "CONNECT_QP", IOCTL_VHCA_CONNECT_QP, connect.as_bytes())?;
    }
    let src = process.allocate(LEN, 0).ok_or("no user memory for the source")?;
    user_bytes(src, LEN).iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
    let dst = process.allocate(LEN, 0).ok_or("no user memory for the destination")?;
    let src_mr = register(process, file, pd.handle, src, 0)?;
    let dst_mr = register(process, file, pd.handle, dst, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE)?;

    let mut write = Wqe {
        wr_id: WR_ID.into(),
        opcode: (WrOpcode::RdmaWrite as u32).into(),
        flags: WR_SIGNALED.into(),
        remote_addr: dst_mr.addr,
        rkey: dst_mr.rkey,
        num_sge: 1.into(),
        ..Wqe::default()
    };
    write.sge[0] = Sge { addr: src_mr.addr, length: (LEN as u32).into(), lkey: src_mr.lkey };
    // The WQE at a process address: POST's METHOD_IN_DIRECT buffer is probed and locked from the caller's memory.
    let records = process.allocate(WQE_SIZE, 0).ok_or("no user memory for the WQE")?;
    user_bytes(records, WQE_SIZE).copy_from_slice(write.as_bytes());
    let post = PostIn { qpn: a.handle, count: 1.into() };
    let reply = process.device_control(file, IOCTL_VHCA_POST_SEND, post.as_bytes(), user_bytes(records, WQE_SIZE));
    if reply.status < 0 || reply.information != WQE_SIZE {
        return Err(format!("POST_SEND: status {:#010x}, {} bytes taken", reply.status as u32, reply.information));
    }
    // Still in flight, or the run would test nothing: the device holds the write, so the CQ has nothing yet. A
    // completion here means the hold missed it (hold_completion_wr counts the scenario's own sends first).
    let (status, early) = poll_cq(process, file, cq.cq)?;
    if status < 0 {
        return Err(format!("POLL_CQ before {what}: status {:#010x}", status as u32));
    }
    if let Some(c) = early.iter().find(|c| c.wr_id.get() == WR_ID) {
        // The MRs given back first, so the exit's locked-pages check cannot stand in for the bug this run was to
        // show (under BreakFix 1 the process's CLEANUP releases nothing either): the verdict is this failure.
        for mr in [&src_mr, &dst_mr] {
            let handle = HandleIn { handle: mr.lkey, reserved: 0.into() };
            call::<()>(process, file, "DEREG_MR", IOCTL_VHCA_DEREG_MR, handle.as_bytes())?;
        }
        return Err(format!(
            "RDMA write {WR_ID:#x} completed ({}) before {what}: the device did not hold it (hold_completion_ms, \
             hold_completion_wr)",
            WcStatus::from_u32(c.status.get()).map_or("UNKNOWN", WcStatus::name)
        ));
    }
    progress(format_args!("user process: RDMA write {WR_ID:#x} posted and not completed; {what} with it in flight"));
    let reset = during()?;

    let (status, polled) = poll_cq(process, file, cq.cq)?;
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

/// POLL_CQ of up to POLL_MAX completions into the process's memory: its status and the completions it wrote (none
/// when it failed: a refused handle is an answer, not an error of the program).
fn poll_cq(process: &mut UserProcess, file: usize, cq: U32) -> Result<(i32, Vec<Cqe>), String> {
    let cqes = process.allocate(CQE_SIZE * POLL_MAX, 0).ok_or("no user memory for the CQEs")?;
    let poll = PollCqIn { cq, max: (POLL_MAX as u32).into() };
    let reply =
        process.device_control(file, IOCTL_VHCA_POLL_CQ, poll.as_bytes(), user_bytes(cqes, CQE_SIZE * POLL_MAX));
    if reply.status < 0 {
        return Ok((reply.status, Vec::new()));
    }
    let polled = user_bytes(cqes, reply.information.min(CQE_SIZE * POLL_MAX))
        .chunks_exact(CQE_SIZE)
        .filter_map(|c| Cqe::read_from_bytes(c).ok())
        .collect();
    Ok((reply.status, polled))
}

/// REG_MR of `len` bytes at `addr` in the process's memory.
fn register(process: &UserProcess, file: usize, pd: U32, addr: usize, access: u32) -> Result<RegMrOut, String> {
    let reg = RegMrIn {
        addr: (addr as u64).into(),
        length: (LEN as u32).into(),
        pd,
        access: access.into(),
        reserved: 0.into(),
    };
    call(process, file, "REG_MR", IOCTL_VHCA_REG_MR, reg.as_bytes())
}

/// The process's own memory at `at` (an address `UserProcess::allocate` gave), as the program writes it.
fn user_bytes<'a>(at: usize, len: usize) -> &'a mut [u8] {
    // SAFETY: `at` came from this process's allocate with at least `len` bytes, mapped in this address space (the
    // loader's one address space) until the process exits, after the program returned.
    unsafe { std::slice::from_raw_parts_mut(at as *mut u8, len) }
}
