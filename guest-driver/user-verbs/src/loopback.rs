//! The provider's whole life once: open, query, a PD, a CQ, two QPs connected to each other, an MR on each side over
//! the process's own unaligned memory, one RDMA write between them polled to its completion and checked byte for
//! byte, a request the driver must refuse, then every object destroyed in dependency order.

use alloc::format;
use alloc::string::String;

use vhca_driver_core::ioctl_codec::*;
use vhca_proto::status::WcStatus;
use vhca_proto::{ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE};
use zerocopy::little_endian::U32;

use crate::provider::{ConnectedPair, Provider};
use crate::{process_bytes, VerbsProcess};

/// The write's length: over two pages, so the MRs span three pages each.
pub const LOOPBACK_BYTES: usize = 2 * 4096 + 300;
/// Where each buffer starts in its first page: a user buffer seldom starts a page.
const IN_PAGE_OFFSET: usize = 0x1a0;
const WR_ID: u64 = 0x7e57_0001;
/// How long the completion may take: polls, each after a pause of POLL_PAUSE_MS (5 s under TCG is ample).
const POLLS: u32 = 5000;
const POLL_PAUSE_MS: u32 = 1;

/// What a run that passed saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopbackSummary {
    pub bytes: usize,
    /// Whether the destination held the bytes already at the completion (not under DMA checking's double buffer).
    pub matched_before_dereg: bool,
    /// POLL_CQ calls until the write's completion came.
    pub polls: u32,
    /// What the driver answered the request it had to refuse (a CQ this file does not hold).
    pub refused_with: i32,
}

impl core::fmt::Display for LoopbackSummary {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "RDMA write of {} bytes after {} poll(s), matched before DEREG_MR: {}, foreign CQ refused with {:#010x}",
            self.bytes, self.polls, self.matched_before_dereg, self.refused_with as u32
        )
    }
}

/// Runs the life; Err names the step that went wrong and what the driver answered.
pub fn rdma_write_loopback(process: &mut impl VerbsProcess) -> Result<LoopbackSummary, String> {
    let mut p = Provider::open(process)?;
    let mut attributes = [0u8; 256];
    let reply = p.control(IOCTL_VHCA_QUERY_DEVICE, &[], &mut attributes);
    if reply.status < 0 || reply.information == 0 {
        return Err(format!("QUERY_DEVICE: status {:#010x}, {} bytes", reply.status as u32, reply.information));
    }
    let ConnectedPair { pd, cq, a, b } = p.connected_pair()?;

    // A handle this file never made must be refused, not looked up on the HCA (the IOCTL is a security boundary).
    let foreign = U32::new(cq.get().wrapping_add(1000));
    let (refused_with, _) = p.poll(foreign)?;
    if refused_with >= 0 {
        return Err(format!("POLL_CQ of CQ {} this file does not hold answered {refused_with:#010x}", foreign.get()));
    }

    let src = p.allocate(LOOPBACK_BYTES, IN_PAGE_OFFSET, "the source")?;
    let dst = p.allocate(LOOPBACK_BYTES, IN_PAGE_OFFSET, "the destination")?;
    // SAFETY: `allocate` gave LOOPBACK_BYTES of the process's memory at each, mapped until the process exits.
    let (source, destination) = unsafe { (process_bytes(src, LOOPBACK_BYTES), process_bytes(dst, LOOPBACK_BYTES)) };
    source.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8 ^ 0x5a);
    destination.fill(0);
    let src_mr = p.register(pd, src, LOOPBACK_BYTES, 0)?;
    let dst_mr = p.register(pd, dst, LOOPBACK_BYTES, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE)?;
    p.post_rdma_write(a, &src_mr, &dst_mr, LOOPBACK_BYTES, WR_ID)?;

    let mut polls = 0;
    let completion = loop {
        polls += 1;
        let (status, cqes) = p.poll(cq)?;
        if status < 0 {
            return Err(format!("POLL_CQ: status {:#010x}", status as u32));
        }
        if let Some(c) = cqes.first() {
            break *c;
        }
        if polls == POLLS {
            return Err(format!("RDMA write {WR_ID:#x}: no completion after {POLLS} polls"));
        }
        p.process().pause(POLL_PAUSE_MS);
    };
    if completion.wr_id.get() != WR_ID || completion.status.get() != WcStatus::Success as u32 {
        return Err(format!(
            "RDMA write {WR_ID:#x}: completion for {:#x} with {}",
            completion.wr_id.get(),
            WcStatus::from_u32(completion.status.get()).map_or("UNKNOWN", WcStatus::name)
        ));
    }
    // The bytes are compared after DEREG_MR, not at the completion: the MR is an S/G mapping held for its life, and
    // under Driver Verifier's DMA checking (0x80) Windows double-buffers it, so the device's write lands in the
    // verifier's shadow and reaches the process's pages only when the list is put back at deregistration (the
    // seed's shared-buffer-sg shows the same with a kernel buffer). What the pages held at the completion is logged.
    // SAFETY: as above; the device is done with both buffers (the write completed).
    let early = unsafe { process_bytes(src, LOOPBACK_BYTES) == process_bytes(dst, LOOPBACK_BYTES) };
    p.process().log(&format!(
        "vhca-verbs: RDMA write of {LOOPBACK_BYTES} bytes completed after {polls} poll(s); the destination {} before \
         DEREG_MR",
        if early { "matched" } else { "did not match yet (a double-buffered mapping)" }
    ));
    for mr in [&src_mr, &dst_mr] {
        p.destroy("DEREG_MR", IOCTL_VHCA_DEREG_MR, mr.lkey)?;
    }
    // SAFETY: as above; both MRs are gone, so the pages are the process's alone.
    let (source, destination) = unsafe { (process_bytes(src, LOOPBACK_BYTES), process_bytes(dst, LOOPBACK_BYTES)) };
    if let Some(first) = source.iter().zip(destination.iter()).position(|(s, d)| s != d) {
        return Err(format!("RDMA write {WR_ID:#x}: the destination differs from byte {first} on after DEREG_MR"));
    }
    for qp in [a, b] {
        p.destroy("DESTROY_QP", IOCTL_VHCA_DESTROY_QP, qp)?;
    }
    p.destroy("DESTROY_CQ", IOCTL_VHCA_DESTROY_CQ, cq)?;
    p.destroy("DEALLOC_PD", IOCTL_VHCA_DEALLOC_PD, pd)?;
    Ok(LoopbackSummary { bytes: LOOPBACK_BYTES, matched_before_dereg: early, polls, refused_with })
}
