//! The user program of user-wait-cancelled and user-wait-cancel-race (`vhca.user=wait-cancel`): a user-mode verbs
//! process that waits for completions with WAIT_CQ on an overlapped handle, as a provider's completion channel does,
//! cancels one wait, has another answered by a real completion, and exits with a third still waiting.

use std::time::Duration;

use vhca_driver_core::ioctl_codec::{PollCqIn, IOCTL_VHCA_WAIT_CQ};
use vhca_loader::user_process::UserProcess;
use vhca_loader::user_requests::{Pending, Sent};
use vhca_proto::status::WcStatus;
use vhca_proto::{Cqe, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, CQE_SIZE};
use vhca_user_verbs::{process_bytes, ConnectedPair, Provider};
use zerocopy::{FromBytes, IntoBytes};

use crate::report::progress;
use crate::user_program::LoaderProcess;

/// The write's bytes, one page each way.
const LEN: usize = 4096;
const WR_ID: u64 = 0x3a17;
/// The most CQEs a wait takes.
const WAIT_MAX: usize = 4;
/// ntstatus.h's STATUS_CANCELLED: what a cancelled request completes with.
const STATUS_CANCELLED: i32 = 0xC000_0120_u32 as i32;
/// How long a wait is left pending before it is cancelled, and how long a completion may take to arrive.
const PENDING_FOR: Duration = Duration::from_millis(30);
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// Two connected QPs on one CQ, an MR on each side; then:
/// 1. WAIT_CQ on the empty CQ must stay pending; cancelled (CancelIoEx), it must complete STATUS_CANCELLED with
///    nothing written;
/// 2. WAIT_CQ again, then an RDMA write: the wait must complete with the write's CQE (success, its wr_id);
/// 3. WAIT_CQ a third time, left pending: the process exits with it, and its thread's exit cancels it, which must
///    complete it (a request that ignores its cancellation keeps the process from exiting: the loader's outcome).
pub fn wait_cancel(process: &mut UserProcess) -> Result<(), String> {
    let mut process = LoaderProcess(process);
    let mut p = Provider::open(&mut process)?;
    let file = p.file();
    let ConnectedPair { pd, cq, a, .. } = p.connected_pair()?;
    let src = p.allocate(LEN, 0, "the source")?;
    // SAFETY: `allocate` gave LEN bytes of the process's memory at `src`, mapped until the process exits.
    unsafe { process_bytes(src, LEN) }.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 253) as u8);
    let dst = p.allocate(LEN, 0, "the destination")?;
    let src_mr = p.register(pd, src, LEN, 0)?;
    let dst_mr = p.register(pd, dst, LEN, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE)?;
    let out = p.allocate(CQE_SIZE * WAIT_MAX, 0, "the wait's CQEs")?;
    let request = PollCqIn { cq, max: (WAIT_MAX as u32).into() };

    // SAFETY (each wait's buffer): `out` holds CQE_SIZE * WAIT_MAX bytes of the process's memory, mapped until it
    // exits, and one wait at a time writes them.
    let first = pending(p.process().0, file, request.as_bytes(), unsafe { process_bytes(out, CQE_SIZE * WAIT_MAX) })?;
    progress(format_args!("user process: WAIT_CQ pending on the empty CQ (IRP {:#x})", first.irp() as usize));
    std::thread::sleep(PENDING_FOR);
    if first.is_complete() {
        return Err("WAIT_CQ on an empty CQ completed without a completion".into());
    }
    // CancelIoEx only asks: IoCancelIrp finds no cancel routine while the driver holds the request outside its
    // queue (vhca.sys's poller takes each wait out to poll its CQ), and the driver then sees the request's Cancel
    // flag when it queues it again. Either way the request must complete STATUS_CANCELLED. Requiring the routine
    // here failed 2 of 4 preempted runs of the fix (`interleavings = "preempt1"`, docs/scenarios.md).
    let routine_ran = first.cancel();
    progress(format_args!(
        "user process: CancelIoEx on the pending WAIT_CQ: {}",
        if routine_ran { "its cancel routine ran" } else { "the driver held it (no cancel routine set)" }
    ));
    let reply = first.wait(Some(ANSWER_WITHIN)).map_err(|_| "the cancelled WAIT_CQ never completed".to_string())?;
    if reply.status != STATUS_CANCELLED || reply.information != 0 {
        return Err(format!(
            "the cancelled WAIT_CQ completed with {:#010x} and {} bytes, not STATUS_CANCELLED and none",
            reply.status as u32, reply.information
        ));
    }
    progress(format_args!("user process: a pending WAIT_CQ cancelled: STATUS_CANCELLED"));

    // SAFETY: as above; the first wait is done with the buffer.
    let second = pending(p.process().0, file, request.as_bytes(), unsafe { process_bytes(out, CQE_SIZE * WAIT_MAX) })?;
    progress(format_args!("user process: WAIT_CQ pending again (IRP {:#x}); RDMA write posted", second.irp() as usize));
    p.post_rdma_write(a, &src_mr, &dst_mr, LEN, WR_ID)?;
    let reply = second.wait(Some(ANSWER_WITHIN)).map_err(|_| {
        format!("WAIT_CQ not answered {} s after RDMA write {WR_ID:#x} was posted", ANSWER_WITHIN.as_secs())
    })?;
    if reply.status < 0 || reply.information == 0 || reply.information % CQE_SIZE != 0 {
        return Err(format!("WAIT_CQ answered {:#010x} with {} bytes", reply.status as u32, reply.information));
    }
    // SAFETY: as above; the wait wrote `information` bytes there.
    let cqes: Vec<Cqe> = unsafe { process_bytes(out, reply.information) }
        .chunks_exact(CQE_SIZE)
        .filter_map(|c| Cqe::read_from_bytes(c).ok())
        .collect();
    let Some(done) = cqes.iter().find(|c| c.wr_id.get() == WR_ID) else {
        return Err(format!("WAIT_CQ answered without RDMA write {WR_ID:#x}'s completion: {cqes:?}"));
    };
    if done.status.get() != WcStatus::Success as u32 {
        let name = WcStatus::from_u32(done.status.get()).map_or("UNKNOWN", WcStatus::name);
        return Err(format!("RDMA write {WR_ID:#x} completed {name}"));
    }
    progress(format_args!("user process: a pending WAIT_CQ answered by RDMA write {WR_ID:#x}'s completion"));

    // SAFETY: as above; the second wait is done with the buffer.
    let third = pending(p.process().0, file, request.as_bytes(), unsafe { process_bytes(out, CQE_SIZE * WAIT_MAX) })?;
    progress(format_args!("user process: exits with a WAIT_CQ pending"));
    // Dropped with the program: the exit of its thread cancels it (the loader's Pending), then CLEANUP and CLOSE.
    drop(third);
    Ok(())
}

/// WAIT_CQ on an overlapped handle, which must be left pending (the CQ is empty).
fn pending<'a>(process: &UserProcess, file: usize, input: &[u8], output: &'a mut [u8]) -> Result<Pending<'a>, String> {
    match process.device_control_overlapped(file, IOCTL_VHCA_WAIT_CQ, input, output) {
        Sent::Pending(pending) => Ok(pending),
        Sent::Done(reply) => Err(format!(
            "WAIT_CQ on an empty CQ answered at once: {:#010x}, {} bytes",
            reply.status as u32, reply.information
        )),
    }
}
