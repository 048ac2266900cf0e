//! The thread that stands in for the CPU's interrupt entry: it waits on the MSI-X eventfds and delivers each message
//! to a sink as "message N fired", counting them per vector. Stopped and joined on every path, its fds closed.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// What receives the messages: the program's own completion waits and the NT model's interrupts. It knows
/// message ids only (the MSI-X table entry, as an NT driver's MessageID), never the eventfds behind them.
pub trait MessageInterruptSink: Send + Sync {
    /// Message `id` fired once. Called on the interrupt thread, one call per message the kernel signalled.
    fn message(&self, id: u32);
}

/// One message source: its id and the eventfd the kernel signals for it.
pub struct MessageSource {
    pub id: u32,
    pub eventfd: OwnedFd,
}

/// Messages delivered so far, per source, in the order the sources were given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageCounts(pub Vec<(u32, u64)>);

pub struct InterruptThread {
    stop: OwnedFd,
    counts: Arc<Vec<(u32, AtomicU64)>>,
    thread: Option<JoinHandle<()>>,
}

impl InterruptThread {
    /// Starts the thread on `sources`; it owns their eventfds from here on.
    pub fn start(sources: Vec<MessageSource>, sink: Arc<dyn MessageInterruptSink>) -> std::io::Result<InterruptThread> {
        let stop = crate::msix_vectors::eventfd()?;
        let stop_for_thread = stop.try_clone()?;
        let counts: Arc<Vec<(u32, AtomicU64)>> = Arc::new(sources.iter().map(|s| (s.id, AtomicU64::new(0))).collect());
        let thread_counts = counts.clone();
        let thread = std::thread::Builder::new()
            .name("msix-interrupts".into())
            .spawn(move || deliver(&stop_for_thread, &sources, &thread_counts, sink.as_ref()))?;
        Ok(InterruptThread { stop, counts, thread: Some(thread) })
    }

    pub fn counts(&self) -> MessageCounts {
        MessageCounts(self.counts.iter().map(|(id, n)| (*id, n.load(Ordering::Relaxed))).collect())
    }

    /// Stops and joins the thread; returns what it delivered. A message that fires after this is not delivered.
    pub fn stop(mut self) -> MessageCounts {
        self.halt();
        self.counts()
    }

    fn halt(&mut self) {
        let Some(thread) = self.thread.take() else { return };
        // A failed write (the counter full) still leaves the stop eventfd readable: the thread ends either way.
        let _ = write_eventfd(self.stop.as_raw_fd());
        if thread.join().is_err() {
            crate::report::progress("the interrupt thread panicked (in its sink)");
        }
    }
}

impl Drop for InterruptThread {
    /// Every path that drops the thread joins it: a run's process must end with no thread of its own left.
    fn drop(&mut self) {
        self.halt();
    }
}

/// The thread's loop: poll(2) on the stop eventfd and every source, read what fired, deliver it.
fn deliver(stop: &OwnedFd, sources: &[MessageSource], counts: &[(u32, AtomicU64)], sink: &dyn MessageInterruptSink) {
    let mut fds: Vec<libc::pollfd> = std::iter::once(stop.as_raw_fd())
        .chain(sources.iter().map(|s| s.eventfd.as_raw_fd()))
        .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
        .collect();
    loop {
        // SAFETY: `fds` is a live, correctly sized array of pollfd; poll writes only their revents fields.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if ready < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            crate::report::progress(format_args!("interrupt thread: poll: {}", std::io::Error::last_os_error()));
            return;
        }
        let stopping = fds[0].revents != 0;
        for (slot, (id, count)) in fds[1..].iter_mut().zip(counts) {
            let readable = slot.revents & libc::POLLIN != 0;
            if !readable && slot.revents != 0 {
                // A source in error (or not an eventfd) would wake poll at once forever: stop watching it.
                crate::report::progress(format_args!("interrupt thread: message {id}: revents {:#x}", slot.revents));
                slot.fd = -1;
                continue;
            }
            // When stopping, every source is read once more: a message that fired before the stop is counted.
            if (readable || stopping) && slot.fd >= 0 {
                // The eventfd counts the signals since the last read: each is one message the kernel took.
                let fired = read_eventfd(slot.fd);
                count.fetch_add(fired, Ordering::Relaxed);
                for _ in 0..fired {
                    sink.message(*id);
                }
            }
        }
        if stopping {
            return;
        }
    }
}

/// Reads and resets an eventfd's counter; 0 when nothing was pending (it is non-blocking).
fn read_eventfd(fd: RawFd) -> u64 {
    let mut value = 0u64;
    // SAFETY: reads 8 bytes into the valid, exclusively borrowed u64, as eventfd(2) requires.
    let n = unsafe { libc::read(fd, (&mut value as *mut u64).cast(), 8) };
    if n == 8 {
        value
    } else {
        0
    }
}

fn write_eventfd(fd: RawFd) -> std::io::Result<()> {
    let one = 1u64;
    // SAFETY: writes the 8 bytes of a live u64, as eventfd(2) requires.
    if unsafe { libc::write(fd, (&one as *const u64).cast(), 8) } == 8 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    use std::os::fd::FromRawFd;

    use super::*;
    use crate::msix_vectors::eventfd;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<u32>>);

    impl MessageInterruptSink for Recorder {
        fn message(&self, id: u32) {
            self.0.lock().unwrap().push(id);
        }
    }

    /// A pipe whose read end stands in for an eventfd: once the read end is closed, a write fails with EPIPE, which
    /// shows that the thread closed its fd (an eventfd's closing cannot be seen from another descriptor).
    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two new descriptors into the valid two-element array.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) }, 0);
        // SAFETY: both descriptors were just made by pipe2 and nothing else owns them.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    fn write_end_is_orphaned(write: &OwnedFd) -> bool {
        // SAFETY: writes one byte of a live array to a descriptor this test owns (SIGPIPE is ignored under Rust).
        let n = unsafe { libc::write(write.as_raw_fd(), [0u8].as_ptr().cast(), 1) };
        n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPIPE)
    }

    #[test]
    fn each_signal_is_delivered_as_its_message_and_counted_per_vector() {
        let (a, b) = (eventfd().unwrap(), eventfd().unwrap());
        let (signal_a, signal_b) = (a.as_raw_fd(), b.as_raw_fd());
        let sink = Arc::new(Recorder::default());
        let sources = vec![MessageSource { id: 0, eventfd: a }, MessageSource { id: 3, eventfd: b }];
        // The thread owns the fds now; the test signals them through their numbers, as the kernel would.
        let thread = InterruptThread::start(sources, sink.clone()).unwrap();
        for _ in 0..2 {
            write_eventfd(signal_b).unwrap();
        }
        write_eventfd(signal_a).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while sink.0.lock().unwrap().len() < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let counts = thread.stop();
        assert_eq!(counts, MessageCounts(vec![(0, 1), (3, 2)]));
        let mut seen = sink.0.lock().unwrap().clone();
        seen.sort();
        assert_eq!(seen, vec![0, 3, 3], "one sink call per signal, with its vector's id");
    }

    #[test]
    fn stopping_or_dropping_joins_the_thread_and_closes_its_fds() {
        for stop in [true, false] {
            let (read, write) = pipe();
            let sink = Arc::new(Recorder::default());
            let thread = InterruptThread::start(vec![MessageSource { id: 0, eventfd: read }], sink.clone()).unwrap();
            assert_eq!(Arc::strong_count(&sink), 2, "the thread holds the sink while it runs");
            assert!(!write_end_is_orphaned(&write));
            if stop {
                // The byte written above is not an eventfd's counter, so it reads as no message.
                assert_eq!(thread.stop(), MessageCounts(vec![(0, 0)]));
            } else {
                drop(thread);
            }
            assert_eq!(Arc::strong_count(&sink), 1, "the thread ended and let go of its sink (stop: {stop})");
            assert!(write_end_is_orphaned(&write), "the thread closed its source fd (stop: {stop})");
        }
    }
}
