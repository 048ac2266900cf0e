//! A provider's completion channel over an overlapped handle: WAIT_CQ kept pending by the driver, one wait
//! cancelled, one answered by a real completion, one left waiting when the process exits. The Linux guest's loader
//! process runs it against vhca.sys (`vhca.user=wait-cancel`, the seed's user-wait-cancelled and
//! user-wait-cancel-race); vhca-verbs-test.exe runs it in a Windows guest (`vhca-verbs-test.exe wait-cancel`).

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use vhca_driver_core::ioctl_codec::{PollCqIn, IOCTL_VHCA_WAIT_CQ};
use vhca_proto::status::WcStatus;
use vhca_proto::{Cqe, ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, CQE_SIZE};
use zerocopy::{FromBytes, IntoBytes};

use crate::provider::{ConnectedPair, Provider};
use crate::{process_bytes, Overlapped, OverlappedProcess};

/// The write's bytes, one page each way.
const LEN: usize = 4096;
const WR_ID: u64 = 0x3a17;
/// The most CQEs a wait takes.
const WAIT_MAX: usize = 4;
/// ntstatus.h's STATUS_CANCELLED: what a cancelled request completes with (Windows' GetOverlappedResult gives
/// ERROR_OPERATION_ABORTED for it, which the Windows process reports as this status).
pub const STATUS_CANCELLED: i32 = 0xC000_0120_u32 as i32;
/// How long a wait is left pending before it is cancelled, and how long a completion may take to arrive.
const PENDING_FOR_MS: u32 = 30;
const ANSWER_WITHIN_MS: u32 = 10_000;

/// What a run that passed saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaitCancelSummary {
    /// Whether the driver's cancel routine ran at CancelIoEx (None: the process cannot tell, as on Windows). No
    /// routine is Windows' answer too while the driver holds the request outside its queue; the request must
    /// still complete cancelled.
    pub cancel_routine_ran: Option<bool>,
    /// The work request whose completion answered the second wait.
    pub answered_by: u64,
}

impl fmt::Display for WaitCancelSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let how = match self.cancel_routine_ran {
            Some(true) => " (its cancel routine ran)",
            Some(false) => " (the driver held it: no cancel routine set)",
            None => "",
        };
        write!(
            f,
            "a pending WAIT_CQ cancelled{how}, one answered by RDMA write {:#x}'s completion, one left pending at the exit",
            self.answered_by
        )
    }
}

/// Two connected QPs on one CQ, an MR on each side; then:
/// 1. WAIT_CQ on the empty CQ must stay pending; cancelled (CancelIoEx), it must complete STATUS_CANCELLED with
///    nothing written;
/// 2. WAIT_CQ again, then an RDMA write: the wait must complete with the write's CQE (success, its wr_id);
/// 3. WAIT_CQ a third time, left pending: the process exits with it, and its thread's exit cancels it, which must
///    complete it (a request that ignores its cancellation keeps the process from exiting).
pub fn wait_cancel<P: OverlappedProcess>(process: &mut P) -> Result<WaitCancelSummary, String> {
    let mut p = Provider::open(process)?;
    let file = p.file();
    let ConnectedPair { pd, cq, a, .. } = p.connected_pair()?;
    let src = p.allocate(LEN, 0, "the source")?;
    // SAFETY: `allocate` gave LEN bytes of the process's memory at `src`, mapped until the process exits.
    unsafe { process_bytes(src, LEN) }.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 253) as u8);
    let dst = p.allocate(LEN, 0, "the destination")?;
    let src_mr = p.register(pd, src, LEN, 0)?;
    let dst_mr = p.register(pd, dst, LEN, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE)?;
    let out_len = CQE_SIZE * WAIT_MAX;
    let out = p.allocate(out_len, 0, "the wait's CQEs")?;
    let request = PollCqIn { cq, max: (WAIT_MAX as u32).into() };
    let wait = |p: &mut Provider<'_, P>| -> Result<usize, String> {
        match p.process().device_control_overlapped(file, IOCTL_VHCA_WAIT_CQ, request.as_bytes(), out, out_len) {
            Overlapped::Pending(id) => Ok(id),
            Overlapped::Done(reply) => Err(format!(
                "WAIT_CQ on an empty CQ answered at once: {:#010x}, {} bytes",
                reply.status as u32, reply.information
            )),
        }
    };

    let first = wait(&mut p)?;
    p.process().log("user process: WAIT_CQ pending on the empty CQ");
    p.process().pause(PENDING_FOR_MS);
    if p.process().is_complete(first) {
        return Err("WAIT_CQ on an empty CQ completed without a completion".into());
    }
    // CancelIoEx only asks: IoCancelIrp finds no cancel routine while the driver holds the request outside its
    // queue (vhca.sys's poller takes each wait out to poll its CQ), and the driver then sees the request's Cancel
    // flag when it queues it again. Either way the request must complete STATUS_CANCELLED.
    let cancel_routine_ran = p.process().cancel(first);
    let reply = p
        .process()
        .wait(first, ANSWER_WITHIN_MS)
        .ok_or_else(|| String::from("the cancelled WAIT_CQ never completed"))?;
    if reply.status != STATUS_CANCELLED || reply.information != 0 {
        return Err(format!(
            "the cancelled WAIT_CQ completed with {:#010x} and {} bytes, not STATUS_CANCELLED and none",
            reply.status as u32, reply.information
        ));
    }
    p.process().log("user process: a pending WAIT_CQ cancelled: STATUS_CANCELLED");

    let second = wait(&mut p)?;
    p.process().log("user process: WAIT_CQ pending again; RDMA write posted");
    p.post_rdma_write(a, &src_mr, &dst_mr, LEN, WR_ID)?;
    let reply = p.process().wait(second, ANSWER_WITHIN_MS).ok_or_else(|| {
        format!("WAIT_CQ not answered {} s after RDMA write {WR_ID:#x} was posted", ANSWER_WITHIN_MS / 1000)
    })?;
    if reply.status < 0 || reply.information == 0 || reply.information % CQE_SIZE != 0 || reply.information > out_len {
        return Err(format!("WAIT_CQ answered {:#010x} with {} bytes", reply.status as u32, reply.information));
    }
    // SAFETY: `out` holds out_len bytes of the process's memory; the wait wrote `information` of them.
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
    p.process().log("user process: a pending WAIT_CQ answered by the RDMA write's completion");

    wait(&mut p)?;
    p.process().log("user process: exits with a WAIT_CQ pending");
    // Left to the process's exit: its thread's exit cancels it, then CLEANUP and CLOSE.
    Ok(WaitCancelSummary { cancel_routine_ran, answered_by: WR_ID })
}

#[cfg(test)]
mod tests {
    extern crate std;

    use std::boxed::Box;
    use std::vec;

    use vhca_driver_core::ioctl_codec::{
        RegMrIn, RegMrOut, IOCTL_VHCA_OPEN_CONTEXT, IOCTL_VHCA_REG_MR, USER_ABI_VERSION,
    };

    use super::*;
    use crate::{Reply, VerbsProcess};

    /// A driver that answers the set-up as vhca.sys does, keeps every WAIT_CQ pending, completes the first with
    /// `cancelled_with` once cancelled and the second with the write's CQE.
    struct Fake {
        at_once: bool,
        cancelled_with: i32,
        cancels: u32,
        /// The pending requests' output buffers, by number.
        waits: Vec<(usize, usize)>,
    }

    impl VerbsProcess for Fake {
        fn open_interface(&mut self) -> Result<usize, i32> {
            Ok(0)
        }
        fn device_control(&mut self, _file: usize, code: u32, input: &[u8], output: &mut [u8]) -> Reply {
            if code == IOCTL_VHCA_OPEN_CONTEXT {
                output[..4].copy_from_slice(&USER_ABI_VERSION.to_le_bytes());
            }
            if code == IOCTL_VHCA_REG_MR {
                let req = RegMrIn::read_from_bytes(input).unwrap();
                let out = RegMrOut { addr: req.addr, length: req.length, ..RegMrOut::default() };
                output.copy_from_slice(out.as_bytes());
            }
            Reply { status: 0, information: output.len() }
        }
        fn allocate(&mut self, bytes: usize, _in_page_offset: usize) -> Option<usize> {
            Some(Box::leak(vec![0u8; bytes].into_boxed_slice()).as_mut_ptr() as usize)
        }
        fn pause(&mut self, _ms: u32) {}
        fn log(&mut self, _line: &str) {}
    }

    impl OverlappedProcess for Fake {
        fn device_control_overlapped(&mut self, _: usize, code: u32, _: &[u8], at: usize, len: usize) -> Overlapped {
            assert_eq!(code, IOCTL_VHCA_WAIT_CQ);
            if self.at_once {
                return Overlapped::Done(Reply { status: 0, information: 0 });
            }
            self.waits.push((at, len));
            Overlapped::Pending(self.waits.len() - 1)
        }
        fn is_complete(&mut self, _request: usize) -> bool {
            false
        }
        fn cancel(&mut self, _request: usize) -> Option<bool> {
            self.cancels += 1;
            Some(false)
        }
        fn wait(&mut self, request: usize, _ms: u32) -> Option<Reply> {
            match request {
                0 => Some(Reply { status: self.cancelled_with, information: 0 }),
                1 => {
                    let cqe = Cqe { wr_id: WR_ID.into(), status: (WcStatus::Success as u32).into(), ..Cqe::default() };
                    let (at, _) = self.waits[1];
                    // SAFETY: `at` is a buffer `allocate` leaked, CQE_SIZE * WAIT_MAX bytes.
                    unsafe { process_bytes(at, CQE_SIZE) }.copy_from_slice(cqe.as_bytes());
                    Some(Reply { status: 0, information: CQE_SIZE })
                }
                _ => None,
            }
        }
    }

    fn fake(at_once: bool, cancelled_with: i32) -> Fake {
        Fake { at_once, cancelled_with, cancels: 0, waits: Vec::new() }
    }

    #[test]
    fn a_cancelled_wait_must_end_cancelled_and_an_answered_one_with_the_write() {
        let mut f = fake(false, STATUS_CANCELLED);
        let summary = wait_cancel(&mut f).expect("the life passes");
        assert_eq!(summary, WaitCancelSummary { cancel_routine_ran: Some(false), answered_by: WR_ID });
        assert_eq!((f.cancels, f.waits.len()), (1, 3), "one cancelled, the third left pending");
    }

    #[test]
    fn a_cancelled_wait_that_succeeds_or_a_wait_answered_at_once_fails_the_life() {
        let why = wait_cancel(&mut fake(false, 0)).unwrap_err();
        assert!(why.contains("not STATUS_CANCELLED"), "{why}");
        let why = wait_cancel(&mut fake(true, STATUS_CANCELLED)).unwrap_err();
        assert!(why.contains("answered at once"), "{why}");
    }
}
