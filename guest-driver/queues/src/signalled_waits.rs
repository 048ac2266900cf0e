//! A queue's completion waits that follow the driver's interrupt: the program's own polling waits until the driver
//! connects its interrupt and hands the queue a `CompletionSignal`, then a sleep on that signal between polls.
//!
//! Why switchable: a driver talks to its device (QUERY_DEVICE, its first objects) before it connects the interrupt
//! and after it disconnects it; a wait on a signal nobody sets then would only time out. Written once here so the
//! Linux guest program and vhca.sys wait the same way; the signal itself is the driver core's (an NT KEVENT).

use alloc::sync::Arc;
use core::time::Duration;

use vhca_driver_core::CompletionSignal;
use vhca_virtio::PollWait;

use crate::WaitSource;

/// `P`'s waits, or sleeps on the attached signal. Changed only through the queue's `&mut` (the queue's own lock),
/// so no wait is in flight when the signal comes or goes.
pub struct SignalledWaits<P: WaitSource> {
    polling: P,
    signal: Option<Arc<dyn CompletionSignal>>,
}

impl<P: WaitSource> SignalledWaits<P> {
    pub fn new(polling: P) -> SignalledWaits<P> {
        SignalledWaits { polling, signal: None }
    }

    /// Some: waits sleep on `signal` from the next command on; None: they poll again.
    pub fn attach(&mut self, signal: Option<Arc<dyn CompletionSignal>>) {
        self.signal = signal;
    }

    pub fn is_signalled(&self) -> bool {
        self.signal.is_some()
    }
}

impl<P: WaitSource> WaitSource for SignalledWaits<P> {
    type Wait = SignalledWait<P::Wait>;
    fn wait(&self) -> Self::Wait {
        let polling = self.polling.wait();
        match &self.signal {
            None => SignalledWait::Polling(polling),
            Some(signal) => SignalledWait::Signalled(SignalWait::begin(signal.clone(), polling.limit())),
        }
    }
}

pub enum SignalledWait<W: PollWait> {
    Polling(W),
    Signalled(SignalWait),
}

impl<W: PollWait> PollWait for SignalledWait<W> {
    fn pause(&mut self) -> bool {
        match self {
            SignalledWait::Polling(w) => w.pause(),
            SignalledWait::Signalled(w) => w.pause(),
        }
    }
    fn limit(&self) -> Duration {
        match self {
            SignalledWait::Polling(w) => w.limit(),
            SignalledWait::Signalled(w) => w.limit(),
        }
    }
    fn keep_spinning(&mut self, polls: u32) -> bool {
        match self {
            SignalledWait::Polling(w) => w.keep_spinning(polls),
            SignalledWait::Signalled(w) => w.keep_spinning(polls),
        }
    }
}

/// One wait on the signal: begun when made (its deadline set), ended when dropped (its deadline cancelled), so
/// every path out of `SplitQueue::wait_used` ends it.
pub struct SignalWait {
    signal: Arc<dyn CompletionSignal>,
    limit: Duration,
}

impl SignalWait {
    fn begin(signal: Arc<dyn CompletionSignal>, limit: Duration) -> SignalWait {
        signal.begin(limit);
        SignalWait { signal, limit }
    }
}

impl PollWait for SignalWait {
    /// Each wake is followed by a poll of the used ring: a wake for another queue on the shared vector, or one left
    /// from before the command, costs one empty poll.
    fn pause(&mut self) -> bool {
        self.signal.sleep()
    }
    fn limit(&self) -> Duration {
        self.limit
    }
    /// No spin: the point is that the thread sleeps until the DPC says there may be something.
    fn keep_spinning(&mut self, _polls: u32) -> bool {
        false
    }
}

impl Drop for SignalWait {
    fn drop(&mut self) {
        self.signal.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A signal that records its calls and wakes `wakes` times before its deadline passes.
    #[derive(Default)]
    struct Recorded {
        calls: Mutex<Vec<&'static str>>,
        wakes: Mutex<u32>,
    }

    impl CompletionSignal for Recorded {
        fn begin(&self, _limit: Duration) {
            self.calls.lock().unwrap().push("begin");
        }
        fn sleep(&self) -> bool {
            self.calls.lock().unwrap().push("sleep");
            let mut wakes = self.wakes.lock().unwrap();
            *wakes = wakes.saturating_sub(1);
            *wakes > 0
        }
        fn end(&self) {
            self.calls.lock().unwrap().push("end");
        }
    }

    struct Never;
    impl PollWait for Never {
        fn pause(&mut self) -> bool {
            false
        }
        fn limit(&self) -> Duration {
            Duration::from_millis(7)
        }
    }
    struct Polling;
    impl WaitSource for Polling {
        type Wait = Never;
        fn wait(&self) -> Never {
            Never
        }
    }

    #[test]
    fn waits_poll_until_a_signal_is_attached_then_sleep_on_it_and_poll_again_once_detached() {
        let mut waits = SignalledWaits::new(Polling);
        assert!(matches!(waits.wait(), SignalledWait::Polling(_)));
        let signal = Arc::new(Recorded { wakes: Mutex::new(3), ..Recorded::default() });
        waits.attach(Some(signal.clone()));
        assert!(waits.is_signalled());
        {
            let mut wait = waits.wait();
            assert_eq!(wait.limit(), Duration::from_millis(7), "the program's limit");
            assert!(!wait.keep_spinning(0), "a signalled wait never spins");
            while wait.pause() {}
        }
        assert_eq!(*signal.calls.lock().unwrap(), ["begin", "sleep", "sleep", "sleep", "end"]);
        waits.attach(None);
        assert!(matches!(waits.wait(), SignalledWait::Polling(_)));
        assert_eq!(signal.calls.lock().unwrap().len(), 5, "a polling wait leaves the signal alone");
    }
}
