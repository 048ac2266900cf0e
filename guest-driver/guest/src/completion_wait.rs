//! How this program waits for a used buffer (`vhca.completion`): polling the ring with sleeps on the monotonic clock
//! (`Deadline`), or sleeping until its queue's MSI-X message fires and then polling once more.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vhca_queues::WaitSource;
use vhca_virtio::PollWait;

use crate::interrupt_thread::MessageInterruptSink;
use crate::virtio_pci::Deadline;

/// How many times each message has fired, with a wake-up for whoever waits on one. The waits' side of the
/// interrupt thread: its sink.
#[derive(Debug)]
pub struct MessageSignals {
    fired: Mutex<Vec<u64>>,
    changed: Condvar,
}

impl MessageSignals {
    /// Signals for messages `0..messages`.
    pub fn new(messages: usize) -> Arc<MessageSignals> {
        Arc::new(MessageSignals { fired: Mutex::new(vec![0; messages]), changed: Condvar::new() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.fired.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn fired(&self, id: u32) -> u64 {
        self.lock().get(id as usize).copied().unwrap_or(0)
    }

    /// Waits until message `id` has fired more than `seen` times in all; its count then, or None once `deadline`
    /// passed first.
    fn wait_past(&self, id: u32, seen: u64, deadline: Instant) -> Option<u64> {
        let mut fired = self.lock();
        loop {
            let now = fired.get(id as usize).copied().unwrap_or(0);
            if now > seen {
                return Some(now);
            }
            let left = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())?;
            fired = self.changed.wait_timeout(fired, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

impl MessageInterruptSink for MessageSignals {
    fn message(&self, id: u32) {
        if let Some(n) = self.lock().get_mut(id as usize) {
            *n += 1;
        }
        // Every waiter: queues may share a vector, and each one checks its own ring.
        self.changed.notify_all();
    }
}

/// One wait for a completion signalled by message `vector`. No race with the device: the count is taken before
/// the ring's first poll, so a message that fires after it, even before the first pause, ends that pause at once;
/// one from before it means the used entry was already there for that poll. No spin: that is the point.
#[derive(Debug)]
pub struct InterruptWait {
    signals: Arc<MessageSignals>,
    vector: u32,
    seen: u64,
    deadline: Instant,
    limit: Duration,
}

impl PollWait for InterruptWait {
    fn pause(&mut self) -> bool {
        match self.signals.wait_past(self.vector, self.seen, self.deadline) {
            Some(fired) => {
                self.seen = fired;
                true
            }
            None => false,
        }
    }
    fn limit(&self) -> Duration {
        self.limit
    }
    fn keep_spinning(&mut self, _polls: u32) -> bool {
        false
    }
}

/// The wait of one completion, as the queue's mode says.
#[derive(Debug)]
pub enum CompletionWait {
    Poll(Deadline),
    Interrupt(InterruptWait),
}

impl PollWait for CompletionWait {
    fn pause(&mut self) -> bool {
        match self {
            CompletionWait::Poll(w) => w.pause(),
            CompletionWait::Interrupt(w) => w.pause(),
        }
    }
    fn limit(&self) -> Duration {
        match self {
            CompletionWait::Poll(w) => w.limit(),
            CompletionWait::Interrupt(w) => w.limit(),
        }
    }
    fn keep_spinning(&mut self, polls: u32) -> bool {
        match self {
            CompletionWait::Poll(w) => w.keep_spinning(polls),
            CompletionWait::Interrupt(w) => w.keep_spinning(polls),
        }
    }
}

/// Where a queue's completion waits come from: each allows `limit`, and waits on `interrupt`'s message when set.
#[derive(Debug, Clone)]
pub struct CompletionWaits {
    pub limit: Duration,
    pub interrupt: Option<(Arc<MessageSignals>, u32)>,
}

impl CompletionWaits {
    pub fn polling(limit: Duration) -> CompletionWaits {
        CompletionWaits { limit, interrupt: None }
    }

    pub fn start(&self) -> CompletionWait {
        match &self.interrupt {
            None => CompletionWait::Poll(Deadline::after(self.limit)),
            Some((signals, vector)) => CompletionWait::Interrupt(InterruptWait {
                signals: signals.clone(),
                vector: *vector,
                seen: signals.fired(*vector),
                deadline: Instant::now() + self.limit,
                limit: self.limit,
            }),
        }
    }
}

impl WaitSource for CompletionWaits {
    type Wait = CompletionWait;
    fn wait(&self) -> CompletionWait {
        self.start()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interrupt_waits(signals: &Arc<MessageSignals>, vector: u32, limit: Duration) -> CompletionWaits {
        CompletionWaits { limit, interrupt: Some((signals.clone(), vector)) }
    }

    #[test]
    fn a_pause_ends_when_its_vector_fires_and_not_for_another() {
        let signals = MessageSignals::new(2);
        let mut wait = interrupt_waits(&signals, 1, Duration::from_secs(10)).start();
        assert!(!wait.keep_spinning(0), "an interrupt wait never spins");
        let started = Instant::now();
        let waited = std::thread::scope(|scope| {
            let firing = scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                signals.message(0); // another vector: the pause goes on
                std::thread::sleep(Duration::from_millis(20));
                signals.message(1);
            });
            let paused = wait.pause();
            firing.join().unwrap();
            paused
        });
        assert!(waited, "the message ended the pause");
        assert!(started.elapsed() >= Duration::from_millis(40), "vector 0's message did not end vector 1's pause");
        assert_eq!((signals.fired(0), signals.fired(1)), (1, 1));
    }

    #[test]
    fn a_message_between_the_waits_start_and_its_pause_is_not_lost() {
        let signals = MessageSignals::new(1);
        signals.message(0); // before the wait: its used entry was there for the first poll
        let mut wait = interrupt_waits(&signals, 0, Duration::from_secs(10)).start();
        signals.message(0); // after the first poll, before the pause
        let started = Instant::now();
        assert!(wait.pause());
        assert!(started.elapsed() < Duration::from_secs(5), "the pause returned at once");
        // Consumed: the next pause waits for a new message, and gives up at the limit.
        let mut short = interrupt_waits(&signals, 0, Duration::from_millis(30)).start();
        assert!(!short.pause(), "no new message: the wait gives up");
        assert_eq!(short.limit(), Duration::from_millis(30));
    }

    #[test]
    fn polling_waits_are_the_clocks_deadline() {
        let mut wait = CompletionWaits::polling(Duration::from_millis(10)).wait();
        assert!(matches!(wait, CompletionWait::Poll(_)));
        assert!(wait.keep_spinning(0), "a polling wait spins before its first sleep");
        while wait.pause() {}
        assert_eq!(wait.limit(), Duration::from_millis(10));
    }
}
