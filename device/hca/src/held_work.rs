//! The hold_completion knob's held send work request: which QP's SQ waits, and how a hold ends (its time ran out, or
//! the QP was flushed, reset or destroyed first). The HCA has no clock: the transport times the hold and releases it.

use std::time::Duration;

use crate::event_records::HcaEvent;
use crate::{Dma, Hca};

/// A send work request the device has not started: the WQE stays at its SQ's consumer index (unread), so a flush,
/// a reset or a destroy treats it as any outstanding request, and the release executes it as if it had just been
/// rung.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HeldWork {
    pub qpn: u32,
    /// The SQ index of the held WQE (its consumer index when the hold began).
    pub sq_index: u32,
    /// The request's ordinal among the send work requests started (`hold_completion_wr`).
    pub n: u64,
}

/// Why a hold ended; the `reason` of its `hold_released` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldEnd {
    /// The transport's timer ran out: the request executes now.
    Timer,
    /// The QP went to ERR: the request completes with WR_FLUSH_ERR, without its DMA.
    Flushed,
    /// The QP went to RESET: the request is discarded without a completion.
    Reset,
    /// The QP was destroyed: likewise.
    Destroyed,
}

impl HoldEnd {
    fn name(self) -> &'static str {
        match self {
            HoldEnd::Timer => "timer",
            HoldEnd::Flushed => "qp_flushed",
            HoldEnd::Reset => "qp_reset",
            HoldEnd::Destroyed => "qp_destroyed",
        }
    }
}

impl Hca {
    /// True while `qpn`'s SQ waits behind a held request: RC executes a QP's requests in order, so the later ones
    /// wait too; other QPs, the command queue and doorbells go on.
    pub(crate) fn send_queue_held(&self, qpn: u32) -> bool {
        self.held.is_some_and(|h| h.qpn == qpn)
    }

    /// Asks the knob whether the request at `qpn`'s SQ consumer index is the one to hold; holds it if so.
    pub(crate) fn hold_if_chosen(&mut self, qpn: u32) -> bool {
        let Some(sq_index) = self.qps.get(&qpn).map(|qp| qp.sq.consumer) else { return false };
        let Some((n, ms)) = self.engine.injector.hold_next_send_wr() else { return false };
        self.held = Some(HeldWork { qpn, sq_index, n });
        self.new_hold = Some(Duration::from_millis(ms));
        self.out.emit(HcaEvent::Injected {
            what: "hold_completion",
            n,
            detail: format!("qpn {qpn} sq index {sq_index} held for {ms} ms"),
        });
        true
    }

    /// Ends the hold on `qpn`, if there is one, for `end` (the caller then flushes, resets or destroys the QP).
    pub(crate) fn end_hold(&mut self, qpn: u32, end: HoldEnd) -> Option<HeldWork> {
        let held = self.held.filter(|h| h.qpn == qpn)?;
        self.held = None;
        self.out.emit(HcaEvent::HoldReleased { qpn, sq_index: held.sq_index, n: held.n, reason: end.name() });
        Some(held)
    }

    /// A hold that began since the last call, and how long the transport must hold it before `release_held_work`;
    /// `None` when none began. Each hold is told once.
    pub fn take_new_hold(&mut self) -> Option<Duration> {
        self.new_hold.take()
    }

    /// The hold's time is up: the held request executes now (its DMA goes through `dma`'s translation as of now, so
    /// memory the driver unmapped meanwhile meets the IOMMU), then the requests queued behind it. Nothing happens
    /// when the hold already ended with its QP.
    pub fn release_held_work(&mut self, dma: &dyn Dma) {
        let Some(qpn) = self.held.map(|h| h.qpn) else { return };
        self.out.request_started();
        if self.end_hold(qpn, HoldEnd::Timer).is_some() {
            self.process_send_queue(dma, qpn);
        }
    }

    /// Whether a request is held now (for tests and diagnostics).
    pub fn holding(&self) -> bool {
        self.held.is_some()
    }
}
