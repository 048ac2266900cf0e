//! A user process with an RDMA write in flight while the system does something to the device: the write posted
//! (the device holds it: `hold_completion_ms`), then what the caller does meanwhile (a sleep/resume cycle, a
//! rebalance, a hot-unplug), then a poll of the CQ made before it, then the exit with everything still registered,
//! so the process's CLEANUP is the driver's to release. The Linux guest's loader process runs it against vhca.sys
//! (the seed's sleep-, rebalance- and surprise-removal-during-traffic entries); vhca-verbs-test.exe's `held-write`
//! mode runs it in a Windows guest, the agent sleeping the machine meanwhile.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use vhca_driver_core::ioctl_codec::IOCTL_VHCA_DEREG_MR;
use vhca_proto::status::WcStatus;
use vhca_proto::{ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};

use crate::provider::{ConnectedPair, Provider};
use crate::{process_bytes, VerbsProcess};

/// One page each way: the write's source and destination, in the process's own memory.
const LEN: usize = 4096;
/// The held write's work request id.
pub const HELD_WR_ID: u64 = 0x5_1ee9;

/// The named events vhca-verbs-test.exe's `held-write` mode and the Windows guest agent (runner/src/windows_guest)
/// meet on, in the global namespace (the agent runs as SYSTEM and starts the program; both hold
/// SeCreateGlobalPrivilege): the program sets the first once its write is in flight, the agent the second once the
/// machine resumed. Manual-reset, so neither side can miss the other's signal.
pub const IN_FLIGHT_EVENT: &str = r"Global\vhca-verbs-test-write-in-flight";
pub const RESUMED_EVENT: &str = r"Global\vhca-verbs-test-resumed";

/// What the poll after the event saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldWriteSummary {
    /// POLL_CQ's status after the event (a file of the device's earlier START is refused: STATUS_INVALID_HANDLE).
    pub status_after: i32,
    /// The completions it returned: (wr_id, status).
    pub completions_after: Vec<(u64, u32)>,
}

impl fmt::Display for HeldWriteSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RDMA write {HELD_WR_ID:#x} in flight across the event; POLL_CQ after it: status {:#010x}, {} completion(s)",
            self.status_after as u32,
            self.completions_after.len()
        )?;
        for (wr_id, status) in &self.completions_after {
            write!(f, " {wr_id:#x} {}", WcStatus::from_u32(*status).map_or("UNKNOWN", WcStatus::name))?;
        }
        Ok(())
    }
}

fn status_name(status: u32) -> &'static str {
    WcStatus::from_u32(status).map_or("UNKNOWN", WcStatus::name)
}

/// Two connected QPs, an MR on each side, one RDMA write posted and held by the device; then `during` (`what` names
/// it; Ok(true) when it reset the device), then a poll of the CQ made before it. The process exits after, with
/// everything registered. A success for the write after a reset is a completion from before it, and fails the life;
/// a write that completed before `during` (the hold missed it) fails it too, its MRs given back first so the exit's
/// locked-pages check cannot stand in for the bug the run was to show.
pub fn write_in_flight_then<P: VerbsProcess>(
    process: &mut P,
    what: &str,
    during: impl FnOnce(&mut P) -> Result<bool, String>,
) -> Result<HeldWriteSummary, String> {
    let mut p = Provider::open(process)?;
    let ConnectedPair { pd, cq, a, .. } = p.connected_pair()?;
    let src = p.allocate(LEN, 0, "the source")?;
    // SAFETY: `allocate` gave LEN bytes of the process's memory at `src`, mapped until the process exits.
    unsafe { process_bytes(src, LEN) }.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8);
    let dst = p.allocate(LEN, 0, "the destination")?;
    let src_mr = p.register(pd, src, LEN, 0)?;
    let dst_mr = p.register(pd, dst, LEN, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE)?;
    p.post_rdma_write(a, &src_mr, &dst_mr, LEN, HELD_WR_ID)?;
    // Still in flight, or the run would test nothing: the device holds the write, so the CQ has nothing yet.
    let (status, early) = p.poll(cq)?;
    if status < 0 {
        return Err(format!("POLL_CQ before {what}: status {:#010x}", status as u32));
    }
    if let Some(c) = early.iter().find(|c| c.wr_id.get() == HELD_WR_ID) {
        for mr in [&src_mr, &dst_mr] {
            p.destroy("DEREG_MR", IOCTL_VHCA_DEREG_MR, mr.lkey)?;
        }
        return Err(format!(
            "RDMA write {HELD_WR_ID:#x} completed ({}) before {what}: the device did not hold it (hold_completion_ms, \
             hold_completion_wr)",
            status_name(c.status.get())
        ));
    }
    p.process()
        .log(&format!("user process: RDMA write {HELD_WR_ID:#x} posted and not completed; {what} with it in flight"));
    let reset = during(p.process())?;

    let (status, polled) = p.poll(cq)?;
    let summary = HeldWriteSummary {
        status_after: status,
        completions_after: polled.iter().map(|c| (c.wr_id.get(), c.status.get())).collect(),
    };
    let listed: Vec<String> =
        summary.completions_after.iter().map(|(id, s)| format!("({id:#x}, {})", status_name(*s))).collect();
    p.process().log(&format!(
        "user process: POLL_CQ after that: status {:#010x}, {} completion(s) [{}]",
        status as u32,
        polled.len(),
        listed.join(", ")
    ));
    if reset && polled.iter().any(|c| c.wr_id.get() == HELD_WR_ID && c.status.get() == WcStatus::Success as u32) {
        return Err(format!("RDMA write {HELD_WR_ID:#x} from before the reset completed successfully after it"));
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    extern crate std;

    use std::boxed::Box;
    use std::string::ToString;
    use std::vec;

    use vhca_driver_core::ioctl_codec::{
        RegMrIn, RegMrOut, IOCTL_VHCA_OPEN_CONTEXT, IOCTL_VHCA_POLL_CQ, IOCTL_VHCA_REG_MR, USER_ABI_VERSION,
    };
    use vhca_proto::{Cqe, CQE_SIZE};
    use zerocopy::{FromBytes, IntoBytes};

    use super::*;
    use crate::Reply;

    /// A driver that answers the set-up as vhca.sys does and each POLL_CQ from `polls` in turn (a status and the
    /// CQEs it returns: (wr_id, status)).
    struct Fake {
        polls: Vec<(i32, Vec<(u64, u32)>)>,
        deregs: u32,
    }

    impl VerbsProcess for Fake {
        fn open_interface(&mut self) -> Result<usize, i32> {
            Ok(0)
        }
        fn device_control(&mut self, _file: usize, code: u32, input: &[u8], output: &mut [u8]) -> Reply {
            match code {
                IOCTL_VHCA_OPEN_CONTEXT => output[..4].copy_from_slice(&USER_ABI_VERSION.to_le_bytes()),
                IOCTL_VHCA_REG_MR => {
                    let req = RegMrIn::read_from_bytes(input).unwrap();
                    let out = RegMrOut { addr: req.addr, length: req.length, ..RegMrOut::default() };
                    output.copy_from_slice(out.as_bytes());
                }
                IOCTL_VHCA_DEREG_MR => self.deregs += 1,
                IOCTL_VHCA_POLL_CQ => {
                    let (status, cqes) = self.polls.remove(0);
                    for (slot, (wr_id, s)) in output.chunks_exact_mut(CQE_SIZE).zip(&cqes) {
                        let cqe = Cqe { wr_id: (*wr_id).into(), status: (*s).into(), ..Cqe::default() };
                        slot.copy_from_slice(cqe.as_bytes());
                    }
                    return Reply { status, information: cqes.len() * CQE_SIZE };
                }
                _ => {}
            }
            Reply { status: 0, information: output.len() }
        }
        fn allocate(&mut self, bytes: usize, _in_page_offset: usize) -> Option<usize> {
            Some(Box::leak(vec![0u8; bytes].into_boxed_slice()).as_mut_ptr() as usize)
        }
        fn pause(&mut self, _ms: u32) {}
        fn log(&mut self, _line: &str) {}
    }

    const SUCCESS: u32 = WcStatus::Success as u32;
    const INVALID_HANDLE: i32 = 0xC000_0008_u32 as i32;

    fn life(polls: Vec<(i32, Vec<(u64, u32)>)>, reset: bool) -> (Result<HeldWriteSummary, String>, Fake, bool) {
        let mut fake = Fake { polls, deregs: 0 };
        let mut ran = false;
        let outcome = write_in_flight_then(&mut fake, "the machine sleeps", |_| {
            ran = true;
            Ok(reset)
        });
        (outcome, fake, ran)
    }

    #[test]
    fn the_write_in_flight_across_the_event_is_polled_after_it() {
        let (outcome, fake, ran) = life(vec![(0, vec![]), (INVALID_HANDLE, vec![])], true);
        let summary = outcome.expect("the life passes");
        assert!(ran);
        assert_eq!(summary, HeldWriteSummary { status_after: INVALID_HANDLE, completions_after: vec![] });
        assert_eq!(
            summary.to_string(),
            "RDMA write 0x51ee9 in flight across the event; POLL_CQ after it: status 0xc0000008, 0 completion(s)"
        );
        assert_eq!(fake.deregs, 0, "everything is left registered for the exit");
    }

    #[test]
    fn a_write_the_device_did_not_hold_fails_before_the_event_with_its_mrs_given_back() {
        let (outcome, fake, ran) = life(vec![(0, vec![(HELD_WR_ID, SUCCESS)])], true);
        assert!(outcome.unwrap_err().contains("did not hold it"));
        assert!(!ran, "nothing to show: the event is not run");
        assert_eq!(fake.deregs, 2);
    }

    #[test]
    fn a_success_from_before_a_reset_fails_the_life_but_not_without_a_reset() {
        let stale = || vec![(0, vec![]), (0, vec![(HELD_WR_ID, SUCCESS)])];
        let (outcome, _, _) = life(stale(), true);
        assert!(outcome.unwrap_err().contains("from before the reset completed successfully"));
        let (outcome, _, _) = life(stale(), false);
        assert!(outcome.unwrap().to_string().ends_with("1 completion(s) 0x51ee9 SUCCESS"));
    }
}
