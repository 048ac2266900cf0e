//! Two requests on one CQ: a WAIT_CQ the driver keeps pending on it, and DESTROY_CQ of it from the same process
//! (its overlapped handle lets the one be sent while the other waits). The driver must end the wait when the CQ
//! goes, before anything of the CQ is freed under it. The Linux guest's loader process runs it against vhca.sys
//! (`vhca.user=wait-destroy`, the seed's user-wait-on-destroyed-cq and user-wait-destroyed-cq-drained).

use alloc::format;
use alloc::string::String;

use vhca_driver_core::ioctl_codec::{
    CreateCqIn, CreateCqOut, PollCqIn, IOCTL_VHCA_CREATE_CQ, IOCTL_VHCA_DESTROY_CQ, IOCTL_VHCA_WAIT_CQ,
};
use vhca_proto::CQE_SIZE;
use zerocopy::IntoBytes;

use crate::provider::Provider;
use crate::wait_cancel::STATUS_CANCELLED;
use crate::{Overlapped, OverlappedProcess};

/// The most CQEs the wait takes.
const WAIT_MAX: usize = 4;
/// How long the wait is left pending before its CQ is destroyed, how long the driver may take to end it, and how
/// long the process stays after (a driver still polling the freed CQ meets it meanwhile: its poller looks every
/// millisecond).
const PENDING_FOR_MS: u32 = 30;
const ENDED_WITHIN_MS: u32 = 2_000;
const STAYS_MS: u32 = 50;

/// A CQ, a WAIT_CQ on it that must stay pending, DESTROY_CQ of it, which must succeed, and then the wait, which must
/// complete STATUS_CANCELLED with nothing written.
pub fn wait_on_destroyed_cq<P: OverlappedProcess>(process: &mut P) -> Result<(), String> {
    let mut p = Provider::open(process)?;
    let file = p.file();
    let cq_in = CreateCqIn { entries: 16.into(), reserved: 0.into() };
    let cq: CreateCqOut = p.call("CREATE_CQ", IOCTL_VHCA_CREATE_CQ, cq_in.as_bytes())?;
    let out_len = CQE_SIZE * WAIT_MAX;
    let out = p.allocate(out_len, 0, "the wait's CQEs")?;
    let request = PollCqIn { cq: cq.cq, max: (WAIT_MAX as u32).into() };
    let wait = match p.process().device_control_overlapped(file, IOCTL_VHCA_WAIT_CQ, request.as_bytes(), out, out_len) {
        Overlapped::Pending(id) => id,
        Overlapped::Done(reply) => {
            return Err(format!("WAIT_CQ on an empty CQ answered at once: {:#010x}", reply.status as u32));
        }
    };
    p.process().pause(PENDING_FOR_MS);
    if p.process().is_complete(wait) {
        return Err("WAIT_CQ on an empty CQ completed without a completion".into());
    }
    p.process().log("user process: WAIT_CQ pending; DESTROY_CQ of its CQ");
    p.destroy("DESTROY_CQ", IOCTL_VHCA_DESTROY_CQ, cq.cq)?;
    let reply = p.process().wait(wait, ENDED_WITHIN_MS).ok_or_else(|| {
        format!("the WAIT_CQ on the destroyed CQ was still pending {} s after DESTROY_CQ", ENDED_WITHIN_MS / 1000)
    })?;
    if reply.status != STATUS_CANCELLED || reply.information != 0 {
        return Err(format!(
            "the WAIT_CQ on the destroyed CQ completed with {:#010x} and {} bytes, not STATUS_CANCELLED and none",
            reply.status as u32, reply.information
        ));
    }
    p.process().log("user process: the WAIT_CQ ended with its CQ: STATUS_CANCELLED");
    p.process().pause(STAYS_MS);
    Ok(())
}
