//! Used-buffer notifications of one queue: what the buffers used since its last notification were, and a rate bound
//! that lets at most `burst` notifications through in any `window` and folds the excess into one later notification.
//! The worker decides when the driver wants one and writes the call eventfd; this module only decides and counts.

use std::time::{Duration, Instant};

use crate::event_log::TransportEvent;

/// Notifications a queue may send in any `DEFAULT_WINDOW` unless `--max-notifications-per-ms` says otherwise. A
/// driver that waits for each answer before its next request cannot go faster than one round trip a notification
/// (tens of µs under TCG, several even under KVM), so this bound is never met by such a driver; a storm that meets
/// it (an ISR that re-arms and rings again on every notification, a doorbell loop) gets at most this many
/// interrupts a millisecond from the device, each one telling the driver of everything used so far.
pub const DEFAULT_BURST: u32 = 256;
pub const DEFAULT_WINDOW: Duration = Duration::from_millis(1);
/// Most `--max-notifications-per-ms` accepts: one per µs is already far past an interrupt a guest can take.
pub const MAX_BURST: u32 = 1000;

/// At most `burst` notifications in any `window`, spaced evenly past the burst (a generic cell rate algorithm:
/// one token per `window / burst`, a bucket of `burst`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateBound {
    pub burst: u32,
    pub window: Duration,
}

impl Default for RateBound {
    fn default() -> Self {
        RateBound { burst: DEFAULT_BURST, window: DEFAULT_WINDOW }
    }
}

impl RateBound {
    /// The spacing of notifications past the burst.
    fn interval(self) -> Duration {
        self.window / self.burst.max(1)
    }

    /// How far ahead of now the schedule may run: a full bucket's worth, less the notification being sent.
    fn tolerance(self) -> Duration {
        self.window.saturating_sub(self.interval())
    }
}

/// Why a queue notifies: the cause of its `notify` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Buffers of a request queue (or refused chains) were returned.
    UsedBuffer,
    /// Event-queue buffers that hold only CQ_COMPLETION events.
    CqEvent,
    /// Event-queue buffers that hold another asynchronous event (QP_FATAL, DMA_FAULT, ...).
    AsyncEvent,
}

impl Cause {
    pub fn name(self) -> &'static str {
        match self {
            Cause::UsedBuffer => "used_buffer",
            Cause::CqEvent => "cq_event",
            Cause::AsyncEvent => "async_event",
        }
    }
}

/// What the buffers returned since the queue's last notification were.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Used {
    buffers: u32,
    cq_events: u32,
    other_events: u32,
    first_cq: Option<u32>,
}

impl Used {
    fn cause(&self) -> Cause {
        if self.other_events > 0 {
            Cause::AsyncEvent
        } else if self.cq_events > 0 {
            Cause::CqEvent
        } else {
            Cause::UsedBuffer
        }
    }
}

/// What to do now about a notification the queue's driver wants.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Write the call eventfd and log this `notify` line.
    Notify(TransportEvent),
    /// Over the bound: nothing now; `bounded` is the `notify_bounded` line to log when the bound engages with this
    /// notification, `None` while it stays engaged. The notification goes out at `QueueNotifier::due`.
    Deferred { bounded: Option<TransportEvent> },
}

/// One queue's notification state, kept by the queue worker.
#[derive(Debug)]
pub struct QueueNotifier {
    queue: u16,
    bound: RateBound,
    /// The time the next notification is scheduled at (the cell rate algorithm's "theoretical arrival time").
    next_at: Option<Instant>,
    used: Used,
    /// When the deferred notification goes out, and how many wanted ones it stands for.
    deferred: Option<(Instant, u32)>,
    /// The bound held the last notification back: a `notify_bounded` line is written once per engagement.
    engaged: bool,
}

impl QueueNotifier {
    pub fn new(queue: u16, bound: RateBound) -> QueueNotifier {
        QueueNotifier { queue, bound, next_at: None, used: Used::default(), deferred: None, engaged: false }
    }

    /// A buffer went back to the used ring; `event` is the asynchronous event it holds (event queue), with the
    /// CQ a CQ_COMPLETION names.
    pub fn buffer_used(&mut self, event: Option<(vhca_proto::EventKind, u32)>) {
        self.used.buffers = self.used.buffers.saturating_add(1);
        match event {
            Some((vhca_proto::EventKind::CqCompletion, cq)) => {
                self.used.cq_events = self.used.cq_events.saturating_add(1);
                self.used.first_cq.get_or_insert(cq);
            }
            Some(_) => self.used.other_events = self.used.other_events.saturating_add(1),
            None => {}
        }
    }

    /// The driver declined this notification (VRING_AVAIL_F_NO_INTERRUPT): what was used is not owed one.
    pub fn declined(&mut self) {
        self.used = Used::default();
        self.deferred = None;
    }

    /// The driver wants a notification for what was used, at `now`.
    pub fn wanted(&mut self, now: Instant) -> Decision {
        if let Some((_, wanted)) = self.deferred.as_mut() {
            *wanted = wanted.saturating_add(1);
            return Decision::Deferred { bounded: None };
        }
        let scheduled = self.next_at.map_or(now, |at| at.max(now));
        if scheduled <= now + self.bound.tolerance() {
            self.next_at = Some(scheduled + self.bound.interval());
            self.engaged = false;
            return Decision::Notify(self.line(None));
        }
        let due = scheduled.checked_sub(self.bound.tolerance()).unwrap_or(scheduled);
        self.deferred = Some((due, 1));
        let bounded = (!self.engaged).then(|| TransportEvent::NotifyBounded {
            queue: self.queue,
            cause: self.used.cause().name(),
            limit: self.bound.burst,
            window_us: u64::try_from(self.bound.window.as_micros()).unwrap_or(u64::MAX),
        });
        self.engaged = true;
        Decision::Deferred { bounded }
    }

    /// When the deferred notification is due, if one waits.
    pub fn due(&self) -> Option<Instant> {
        self.deferred.map(|(due, _)| due)
    }

    /// The deferred notification, once it is due at `now`: its `notify` line (the caller writes the call eventfd,
    /// unless the driver has declined notifications since, see `declined`).
    pub fn take_due(&mut self, now: Instant) -> Option<TransportEvent> {
        let (due, wanted) = self.deferred.filter(|(due, _)| *due <= now)?;
        self.deferred = None;
        self.next_at = Some(self.next_at.map_or(due, |at| at.max(due)) + self.bound.interval());
        Some(self.line(Some(wanted)))
    }

    /// The `notify` line for what was used since the last one, which it resets.
    fn line(&mut self, coalesced: Option<u32>) -> TransportEvent {
        let used = std::mem::take(&mut self.used);
        let cause = used.cause();
        TransportEvent::Notify {
            queue: self.queue,
            cause: cause.name(),
            cq: if cause == Cause::CqEvent { used.first_cq } else { None },
            buffers: used.buffers,
            coalesced,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vhca_proto::EventKind;

    const US: Duration = Duration::from_micros(1);

    fn bound(burst: u32, window_ms: u64) -> RateBound {
        RateBound { burst, window: Duration::from_millis(window_ms) }
    }

    fn is_notify(d: &Decision) -> bool {
        matches!(d, Decision::Notify(_))
    }

    #[test]
    fn a_paced_driver_never_meets_the_default_bound() {
        // One round trip every 4 µs, faster than any guest's ping-pong: every notification goes out at once.
        let mut n = QueueNotifier::new(0, RateBound::default());
        let t = Instant::now();
        for i in 0..10_000u32 {
            n.buffer_used(None);
            assert!(is_notify(&n.wanted(t + 4 * i * US)), "notification {i} held back");
        }
    }

    #[test]
    fn a_storm_gets_the_burst_then_one_coalesced_notification_per_interval() {
        let mut n = QueueNotifier::new(2, bound(4, 1));
        let t = Instant::now();
        let mut now_sent = 0;
        let mut bounded_lines = Vec::new();
        // 100 wanted notifications within 10 µs: a doorbell loop.
        for i in 0..100u32 {
            n.buffer_used(None);
            match n.wanted(t + i * US / 10) {
                Decision::Notify(_) => now_sent += 1,
                Decision::Deferred { bounded } => bounded_lines.extend(bounded),
            }
        }
        assert_eq!(now_sent, 4, "the burst goes out, the rest is held");
        assert_eq!(bounded_lines.len(), 1, "one line when the bound engages: {bounded_lines:?}");
        assert_eq!(
            bounded_lines[0],
            TransportEvent::NotifyBounded { queue: 2, cause: "used_buffer", limit: 4, window_us: 1000 }
        );
        // Nothing is lost: one notification stands for the other 96, due once a token is back (250 µs).
        let due = n.due().expect("a deferred notification");
        assert_eq!(due, t + 250 * US);
        assert_eq!(n.take_due(due - US), None, "not before it is due");
        assert_eq!(
            n.take_due(due),
            Some(TransportEvent::Notify { queue: 2, cause: "used_buffer", cq: None, buffers: 96, coalesced: Some(96) })
        );
        assert_eq!(n.due(), None);
    }

    #[test]
    fn a_storm_that_goes_on_is_held_to_the_rate_and_logs_the_engagement_once() {
        // A driver that rings again from inside every notification: wanted again the moment one goes out.
        let mut n = QueueNotifier::new(1, bound(4, 1));
        let start = Instant::now();
        let mut now = start;
        let (mut sent, mut bounded) = (0u32, 0u32);
        while now < start + Duration::from_millis(100) {
            n.buffer_used(Some((EventKind::CqCompletion, 7)));
            match n.wanted(now) {
                Decision::Notify(_) => sent += 1,
                Decision::Deferred { bounded: line } => bounded += u32::from(line.is_some()),
            }
            now = match n.due() {
                Some(due) => {
                    let line = n.take_due(due).unwrap();
                    assert!(matches!(line, TransportEvent::Notify { cause: "cq_event", cq: Some(7), .. }));
                    sent += 1;
                    due
                }
                None => now,
            };
        }
        // 100 ms at 4 a millisecond, plus the first burst.
        assert!((400..=404).contains(&sent), "{sent} notifications in 100 ms");
        assert_eq!(bounded, 1, "still the one engagement");
    }

    #[test]
    fn a_declined_notification_cancels_the_deferred_one_and_causes_are_told_apart() {
        let mut n = QueueNotifier::new(1, bound(1, 1));
        let t = Instant::now();
        n.buffer_used(Some((EventKind::QpFatal, 16)));
        n.buffer_used(Some((EventKind::CqCompletion, 3)));
        let Decision::Notify(line) = n.wanted(t) else { panic!("the first goes out") };
        assert_eq!(
            line,
            TransportEvent::Notify { queue: 1, cause: "async_event", cq: None, buffers: 2, coalesced: None }
        );
        n.buffer_used(Some((EventKind::CqCompletion, 3)));
        assert!(!is_notify(&n.wanted(t)));
        n.declined();
        assert_eq!(n.due(), None, "a driver that now polls is not interrupted");
        // Once the bound allows it again, a CQ event names its CQ.
        n.buffer_used(Some((EventKind::CqCompletion, 5)));
        let Decision::Notify(line) = n.wanted(t + Duration::from_millis(1)) else { panic!("allowed again") };
        assert_eq!(
            line,
            TransportEvent::Notify { queue: 1, cause: "cq_event", cq: Some(5), buffers: 1, coalesced: None }
        );
    }
}
