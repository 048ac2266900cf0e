//! Adaptive busy-polling with kick suppression: after serving work the queue worker keeps polling the request
//! queues' avail rings for a bounded window, and meanwhile sets VRING_USED_F_NO_NOTIFY in their used rings so the
//! driver skips the kick (virtio 1.2, 2.7.10: without VIRTIO_F_EVENT_IDX the device "MAY set flags to 1 to advise
//! the driver that notifications are not needed"). A kick is an MMIO exit to QEMU and an eventfd wake-up of this
//! thread; a request published while polling costs neither. When the window ends the flag is cleared and the avail
//! index read once more after a full barrier (`virtio_queue::QueueT::enable_notification`): a driver that read the
//! flag as set just before it was cleared skipped its kick, and its chain is served now rather than never.
//! docs/protocol.md "Kicks and polling" has the protocol; docs/bench.md section 5 what it buys and costs.

use std::time::{Duration, Instant};

use virtio_queue::QueueT;

use crate::memory::GuestMem;
use crate::vring::VringState;

/// Longest window the command line accepts: beyond a few milliseconds polling only burns a core.
pub const MAX_POLL_WINDOW: Duration = Duration::from_millis(10);

/// The rings whose kicks can be suppressed, as the window sees them (the worker's request queues; a fake in tests).
pub trait KickSuppression {
    /// Sets VRING_USED_F_NO_NOTIFY on every ring that serves requests.
    fn suppress(&mut self);
    /// Clears it again; true when a ring holds a chain the device has not taken, which may have come without a kick.
    fn allow(&mut self) -> bool;
}

/// What the worker does after a pass over the queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Poll again at once: the window is open and kicks are suppressed.
    Poll,
    /// Serve once more without waiting: a chain came in as the window closed.
    Serve,
    /// Sleep until a kick, a wake-up or a parked chain's deadline: kicks are allowed.
    Sleep,
}

/// The polling window of one worker: open from the last pass that served work until `window` later.
#[derive(Debug)]
pub struct PollWindow {
    window: Duration,
    until: Option<Instant>,
}

impl PollWindow {
    /// `window` zero: no polling, kicks never suppressed (the worker as it was before polling existed).
    pub fn new(window: Duration) -> PollWindow {
        PollWindow { window: window.min(MAX_POLL_WINDOW), until: None }
    }

    pub fn is_open(&self) -> bool {
        self.until.is_some()
    }

    /// Decides after a pass over the queues that served work (`served`) or not, at `now`.
    pub fn after_pass(&mut self, served: bool, now: Instant, rings: &mut dyn KickSuppression) -> Next {
        if self.window.is_zero() {
            return Next::Sleep;
        }
        if served {
            if self.until.is_none() {
                rings.suppress();
            }
            self.until = Some(now + self.window);
            return Next::Poll;
        }
        match self.until {
            Some(until) if now < until => Next::Poll,
            Some(_) => {
                self.until = None;
                if rings.allow() {
                    Next::Serve
                } else {
                    Next::Sleep
                }
            }
            None => Next::Sleep,
        }
    }

    /// Closes the window without a pass (the rings changed under it). True when a chain waits untaken: published
    /// under the flag, it has no kick coming, so the caller must serve it without waiting for one.
    pub fn close(&mut self, rings: &mut dyn KickSuppression) -> bool {
        self.until = None;
        rings.allow()
    }
}

/// Sets VRING_USED_F_NO_NOTIFY on a running ring that does not have it yet. A used ring that does not translate
/// keeps its flag clear: the driver goes on kicking, which costs time but loses nothing.
pub fn suppress_kicks(queue: u16, vring: &mut VringState, mem: &GuestMem) {
    if vring.kicks_suppressed || !vring.runnable() {
        return;
    }
    match vring.queue.disable_notification(mem) {
        Ok(()) => vring.kicks_suppressed = true,
        Err(err) => tracing::debug!("queue {queue}: cannot suppress kicks: {err}"),
    }
}

/// Clears the flag this device set on a running ring, then reads the avail index again after a full barrier (the
/// order a device must keep so a chain published in between is seen). True when a chain waits untaken. A ring that
/// stopped with the flag set keeps `kicks_suppressed` and is cleared once it runs again.
pub fn allow_kicks(queue: u16, vring: &mut VringState, mem: &GuestMem) -> bool {
    if !vring.kicks_suppressed || !vring.runnable() {
        return false;
    }
    match vring.queue.enable_notification(mem) {
        Ok(pending) => {
            vring.kicks_suppressed = false;
            pending
        }
        Err(err) => {
            // The used ring stopped translating: the flag may still read 1 to the driver. Serve once more and try
            // again at the next wake-up (an IOTLB update wakes the worker).
            tracing::warn!("queue {queue}: cannot clear the no-notify flag: {err}");
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring as the window sees it: the flag, and a chain the driver may publish without a kick while it is set.
    #[derive(Default)]
    struct FakeRing {
        flag: bool,
        suppress_calls: u32,
        /// Chains published and not taken.
        pending: u32,
        /// A chain the driver publishes at the moment the flag is cleared (it read the flag just before).
        publish_during_allow: bool,
    }

    impl KickSuppression for FakeRing {
        fn suppress(&mut self) {
            self.flag = true;
            self.suppress_calls += 1;
        }
        fn allow(&mut self) -> bool {
            if self.publish_during_allow {
                self.pending += 1;
                self.publish_during_allow = false;
            }
            self.flag = false;
            self.pending > 0
        }
    }

    const W: Duration = Duration::from_micros(50);

    #[test]
    fn off_never_touches_the_flag() {
        let (mut window, mut ring, t) = (PollWindow::new(Duration::ZERO), FakeRing::default(), Instant::now());
        assert_eq!(window.after_pass(true, t, &mut ring), Next::Sleep);
        assert_eq!(window.after_pass(false, t + W, &mut ring), Next::Sleep);
        assert!(!ring.flag && ring.suppress_calls == 0 && !window.is_open());
    }

    #[test]
    fn work_opens_the_window_and_suppresses_once_until_it_closes() {
        let (mut window, mut ring, t) = (PollWindow::new(W), FakeRing::default(), Instant::now());
        assert_eq!(window.after_pass(false, t, &mut ring), Next::Sleep, "no work: nothing to poll for");
        assert_eq!(window.after_pass(true, t, &mut ring), Next::Poll);
        assert!(ring.flag && window.is_open());
        assert_eq!(window.after_pass(false, t + W / 2, &mut ring), Next::Poll);
        // More work extends the window from the last work, without writing the flag again.
        assert_eq!(window.after_pass(true, t + W / 2, &mut ring), Next::Poll);
        assert_eq!(window.after_pass(false, t + W, &mut ring), Next::Poll);
        assert_eq!(ring.suppress_calls, 1);
        assert_eq!(window.after_pass(false, t + W / 2 + W, &mut ring), Next::Sleep);
        assert!(!ring.flag && !window.is_open(), "kicks are allowed before the worker sleeps");
    }

    #[test]
    fn a_chain_published_as_the_window_closes_is_served_not_slept_on() {
        let (mut window, mut ring, t) = (PollWindow::new(W), FakeRing::default(), Instant::now());
        assert_eq!(window.after_pass(true, t, &mut ring), Next::Poll);
        // The driver read the flag as set and skipped its kick; the device's last look missed the chain.
        ring.publish_during_allow = true;
        assert_eq!(window.after_pass(false, t + W, &mut ring), Next::Serve);
        assert!(!ring.flag);
        // The pass that follows takes it, and polling starts over.
        ring.pending = 0;
        assert_eq!(window.after_pass(true, t + W, &mut ring), Next::Poll);
        assert!(ring.flag);
    }

    #[test]
    fn close_allows_kicks_at_once() {
        let (mut window, mut ring, t) = (PollWindow::new(W), FakeRing::default(), Instant::now());
        window.after_pass(true, t, &mut ring);
        assert!(!window.close(&mut ring), "nothing waits");
        assert!(!ring.flag && !window.is_open());
        // A chain published under the flag, with no kick coming: the close says so, for the caller to serve it.
        window.after_pass(true, t, &mut ring);
        ring.pending = 1;
        assert!(window.close(&mut ring));
    }

    #[test]
    fn the_window_is_bounded() {
        assert_eq!(PollWindow::new(Duration::from_secs(5)).window, MAX_POLL_WINDOW);
    }
}
