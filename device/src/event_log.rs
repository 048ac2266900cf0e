//! The device's JSON-lines event log: one object per line with `seq`, `t_us` and `kind`, in order. The thread that
//! records an event only stamps it and queues it (owned, no formatting, no system call); a writer thread
//! serialises the queue and appends it to the file every `WRITE_EVERY` while events come. Recording a fault or a
//! disconnection, dropping the log, SIGTERM/SIGINT/SIGHUP and a panic (`install_flush_guards`) drain the queue to
//! the file before going on, so the runner's verdicts never miss a line. Also the HCA's `EventSink`.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use serde::Serialize;
use vhca_hca::{EventSink, FaultInjection, HcaEvent};

/// What the transport records. Serialised with `"kind"` as tag; the log adds `seq` and `t_us`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TransportEvent {
    /// First line: who is running and with which configuration (`injection` lists only the knobs that are set).
    Start {
        schema: u32,
        pid: u32,
        socket: String,
        map_registers: u32,
        version: &'static str,
        miss_timeout_ms: u64,
        probe_pages: bool,
        revalidate_stale: bool,
        max_pd: u32,
        max_cq: u32,
        max_qp: u32,
        max_mr: u32,
        injection: FaultInjection,
        /// The per-queue notification bound (`--max-notifications-per-ms`).
        max_notifications_per_ms: u32,
    },
    Connected,
    Disconnected {
        reason: String,
    },
    ProtocolError {
        cause: String,
    },
    IotlbUpdate {
        iova: u64,
        size: u64,
        uaddr: u64,
        perm: &'static str,
    },
    IotlbInvalidate {
        iova: u64,
        size: u64,
    },
    IotlbMiss {
        iova: u64,
        perm: &'static str,
    },
    /// One descriptor the device read or wrote; `uaddr` is where the IOTLB put its first byte (QEMU's address).
    Desc {
        queue: u16,
        iova: u64,
        len: u32,
        writable: bool,
        uaddr: u64,
    },
    DmaFault {
        iova: u64,
        cause: &'static str,
        queue: u16,
    },
    /// A descriptor chain the device refused (returned with used length 0) and why.
    ChainError {
        queue: u16,
        head: u16,
        cause: String,
    },
    /// The device wrote a queue's call eventfd (a used-buffer notification; QEMU makes it the queue's MSI-X message).
    /// `buffers`: used since the queue's last notification; `cq`: the first CQ a `cq_event` names; `coalesced`: the
    /// notifications the rate bound held back that this one stands for.
    Notify {
        queue: u16,
        cause: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        cq: Option<u32>,
        buffers: u32,
        #[serde(skip_serializing_if = "Option::is_none")]
        coalesced: Option<u32>,
    },
    /// A queue's notifications met the rate bound (`limit` in any `window_us`): the excess is folded into one later
    /// notification. Written once each time the bound engages.
    NotifyBounded {
        queue: u16,
        cause: &'static str,
        limit: u32,
        window_us: u64,
    },
}

/// How long a queued line waits for the writer while events keep coming (a reader of the live file sees it within
/// about this time; faults, the end of the connection and stop signals write at once).
const WRITE_EVERY: Duration = Duration::from_millis(2);
const BUFFER: usize = 64 * 1024;
/// Events queued at most before the recording thread waits for the writer (never drops one).
const QUEUE_LIMIT: usize = 1 << 16;
/// Longest a panic waits for the writer to drain (the writer itself may be what is stuck).
const PANIC_DRAIN: Duration = Duration::from_secs(2);

/// One queued event with the time it was stamped with. Transport events are boxed: they are few (not one per DMA)
/// and the largest, and every queued record is as large as the largest kind.
enum Record {
    Transport { t_us: u64, event: Box<TransportEvent> },
    Hca { t_us: u64, event: HcaEvent },
}

/// What the recording threads and the writer share, under one lock held only to push or to swap.
#[derive(Default)]
struct Pending {
    records: Vec<Record>,
    /// Drains asked for (a counter) and done: a drain is done once `done` reaches the value it got.
    requested: u64,
    done: u64,
    /// The writer waits without a timeout (nothing came for a whole `WRITE_EVERY`): the next event wakes it.
    idle: bool,
    stop: bool,
    writer_gone: bool,
}

#[derive(Default)]
struct Channel {
    pending: Mutex<Pending>,
    /// Wakes the writer (an event after idleness, a drain, stop).
    wake: Condvar,
    /// Wakes drain waiters.
    drained: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Appends events; cheap enough to call for every DMA (a push onto a queue per event).
pub struct EventLog {
    channel: Arc<Channel>,
    writer: Mutex<Option<JoinHandle<()>>>,
    writer_id: ThreadId,
    /// The log's clock: the TSC where it is invariant (quanta calibrates it against the OS clock once, at start),
    /// else the OS's monotonic clock. A TSC read and its scaling took 9.6 ns on this project's AMD EPYC host
    /// against 25.8 ns for `Instant::elapsed`, and the clock is read once per HCA request and per transport line.
    clock: quanta::Clock,
    /// `clock`'s raw reading at the log's start: `t_us` counts from it.
    start: u64,
    /// `t_us` of the HCA request in progress (`EventSink::request_started`), or of the last transport event if that
    /// came later: the HCA's events carry it, so a DMA's line costs no clock read (one costs 40-90 ns on the hosts
    /// measured, more than queueing the line).
    request_t_us: AtomicU64,
}

impl TransportEvent {
    /// Events after which the file must hold every line at once: a refusal, or the end of the connection.
    fn flushes(&self) -> bool {
        matches!(
            self,
            TransportEvent::Disconnected { .. }
                | TransportEvent::ProtocolError { .. }
                | TransportEvent::DmaFault { .. }
                | TransportEvent::ChainError { .. }
        )
    }
}

impl EventLog {
    pub fn create(path: &Path) -> io::Result<EventLog> {
        let file = File::create(path)?;
        EventLog::spawn(Box::new(file))
    }

    /// A log writing to any sink; used by tests to capture lines in memory.
    pub fn to_writer(out: Box<dyn Write + Send>) -> EventLog {
        EventLog::spawn(out).expect("cannot start the event log's writer thread")
    }

    /// Starts the writer thread and waits until it runs, so its set-up is done before the sandbox goes on (it makes
    /// no system call beyond write and futex afterwards).
    fn spawn(out: Box<dyn Write + Send>) -> io::Result<EventLog> {
        let channel = Arc::new(Channel::default());
        let theirs = Arc::clone(&channel);
        let (ready, set_up) = std::sync::mpsc::channel();
        let writer = std::thread::Builder::new().name("event-log".into()).spawn(move || {
            // Behind the queue worker on a shared core (thread_sched.rs); before `ready`, so before the sandbox.
            if let Err(err) = crate::thread_sched::lower_this_thread() {
                tracing::warn!("event log writer: cannot lower its priority ({err}); it may delay requests");
            }
            let _ = ready.send(());
            write_lines(&theirs, BufWriter::with_capacity(BUFFER, out));
        })?;
        let _ = set_up.recv();
        let writer_id = writer.thread().id();
        let clock = quanta::Clock::new();
        Ok(EventLog {
            channel,
            writer: Mutex::new(Some(writer)),
            writer_id,
            start: clock.raw(),
            clock,
            request_t_us: AtomicU64::new(0),
        })
    }

    fn now_us(&self) -> u64 {
        self.clock.delta_as_nanos(self.start, self.clock.raw()) / 1000
    }

    pub fn record(&self, event: &TransportEvent) {
        let t_us = self.now_us();
        // The HCA's events after this one are not stamped earlier than it (t_us never goes back in the file).
        self.request_t_us.fetch_max(t_us, Ordering::Relaxed);
        self.push(Record::Transport { t_us, event: Box::new(event.clone()) });
        if event.flushes() {
            self.flush();
        }
    }

    /// Writes every line recorded so far to the file before returning.
    pub fn flush(&self) {
        self.drain(None);
    }

    fn push(&self, record: Record) {
        let mut pending = lock(&self.channel.pending);
        pending.records.push(record);
        let full = pending.records.len() >= QUEUE_LIMIT;
        let wake = std::mem::take(&mut pending.idle);
        drop(pending);
        if wake {
            self.channel.wake.notify_one();
        }
        if full {
            // The writer is behind: wait for it rather than grow without bound or drop a line.
            self.flush();
        }
    }

    /// Asks the writer to write out everything queued and waits for it (at most `limit`). Returns at once on the
    /// writer thread itself, or if the writer is gone.
    fn drain(&self, limit: Option<Duration>) {
        if std::thread::current().id() == self.writer_id {
            return;
        }
        let deadline = limit.map(|limit| Instant::now() + limit);
        let mut pending = lock(&self.channel.pending);
        pending.requested += 1;
        let ticket = pending.requested;
        pending.idle = false;
        self.channel.wake.notify_one();
        while pending.done < ticket && !pending.writer_gone {
            pending = match deadline {
                None => self.channel.drained.wait(pending).unwrap_or_else(|poisoned| poisoned.into_inner()),
                Some(deadline) => {
                    let Some(left) = deadline.checked_duration_since(Instant::now()) else { return };
                    match self.channel.drained.wait_timeout(pending, left) {
                        Ok((guard, _)) => guard,
                        Err(poisoned) => poisoned.into_inner().0,
                    }
                }
            };
        }
    }
}

/// The writer thread: takes the whole queue at a time, serialises it, appends it to the file and flushes, then
/// answers the drains that asked before it took the queue. Ends once stopped and everything is written.
fn write_lines(channel: &Channel, mut out: BufWriter<Box<dyn Write + Send>>) {
    /// Marks the writer gone however it ends, so no drain waits for it forever.
    struct Gone<'a>(&'a Channel);
    impl Drop for Gone<'_> {
        fn drop(&mut self) {
            lock(&self.0.pending).writer_gone = true;
            self.0.drained.notify_all();
        }
    }
    let _gone = Gone(channel);
    let mut batch: Vec<Record> = Vec::new();
    let mut seq = 0u64;
    // One event's JSON, kept between events so a line costs no allocation.
    let mut scratch = Vec::new();
    let mut quiet = false;
    loop {
        let (answered, stop) = {
            let mut pending = lock(&channel.pending);
            while pending.records.is_empty() && pending.requested == pending.done && !pending.stop {
                if quiet {
                    pending.idle = true;
                    pending = channel.wake.wait(pending).unwrap_or_else(|poisoned| poisoned.into_inner());
                } else {
                    pending = match channel.wake.wait_timeout(pending, WRITE_EVERY) {
                        Ok((guard, _)) => guard,
                        Err(poisoned) => poisoned.into_inner().0,
                    };
                    quiet = true;
                }
            }
            pending.idle = false;
            std::mem::swap(&mut pending.records, &mut batch);
            (pending.requested, pending.stop)
        };
        quiet = batch.is_empty();
        for record in &batch {
            let written = match record {
                Record::Transport { t_us, event } => write_line(&mut out, &mut scratch, seq, *t_us, &**event),
                Record::Hca { t_us, event } => write_line(&mut out, &mut scratch, seq, *t_us, event),
            };
            match written {
                Ok(()) => seq += 1,
                Err(err) => tracing::error!("event log: {err}"),
            }
        }
        batch.clear();
        if let Err(err) = out.flush() {
            tracing::error!("event log: flush failed: {err}");
        }
        let mut pending = lock(&channel.pending);
        pending.done = pending.done.max(answered);
        let finished = stop && pending.records.is_empty();
        drop(pending);
        channel.drained.notify_all();
        if finished {
            return;
        }
        if !quiet {
            // Let events gather for a while rather than wake per event (the recording thread then never makes a
            // system call for the log); a drain or stop cuts the wait short.
            let pending = lock(&channel.pending);
            if pending.requested == pending.done && !pending.stop {
                drop(channel.wake.wait_timeout(pending, WRITE_EVERY));
            }
        }
    }
}

/// One line: `seq` and `t_us` spliced in front of the event's own fields, so every line starts with them.
fn write_line<T: Serialize>(
    out: &mut impl Write,
    scratch: &mut Vec<u8>,
    seq: u64,
    t_us: u64,
    event: &T,
) -> Result<(), String> {
    scratch.clear();
    serde_json::to_writer(&mut *scratch, event).map_err(|err| format!("cannot serialise event: {err}"))?;
    let Some(fields) = scratch.strip_prefix(b"{") else {
        return Err(format!("event did not serialise to an object: {}", String::from_utf8_lossy(scratch)));
    };
    write!(out, "{{\"seq\":{seq},\"t_us\":{t_us},")
        .and_then(|()| out.write_all(fields))
        .and_then(|()| out.write_all(b"\n"))
        .map_err(|err| format!("write failed: {err}"))
}

impl Drop for EventLog {
    fn drop(&mut self) {
        lock(&self.channel.pending).stop = true;
        self.channel.wake.notify_one();
        if let Some(writer) = lock(&self.writer).take() {
            if writer.join().is_err() {
                tracing::error!("event log: the writer thread panicked");
            }
        }
    }
}

impl EventSink for EventLog {
    fn emit(&self, event: HcaEvent) {
        let flush_now = matches!(event, HcaEvent::Fault(_));
        self.push(Record::Hca { t_us: self.request_t_us.load(Ordering::Relaxed), event });
        if flush_now {
            self.flush();
        }
    }

    fn request_started(&self) {
        self.request_t_us.fetch_max(self.now_us(), Ordering::Relaxed);
    }
}

/// Flushes `log` when the process is told to stop (SIGTERM, SIGINT, SIGHUP: then the signal's default action ends
/// it, as before) and when any thread panics, so a queued line is never lost to either. SIGKILL cannot be caught:
/// what the writer has not yet written is lost then, at most about `WRITE_EVERY` of events.
pub fn install_flush_guards(log: &Arc<EventLog>) -> io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    let on_signal = log.clone();
    std::thread::Builder::new().name("event-log-signals".into()).spawn(move || {
        if let Some(signal) = signals.forever().next() {
            on_signal.flush();
            tracing::info!("signal {signal}: event log flushed, stopping");
            // The default action of these signals ends the process, as it did before this thread caught them.
            let _ = signal_hook::low_level::emulate_default_handler(signal);
            std::process::exit(128 + signal);
        }
    })?;
    let on_panic = Arc::downgrade(log);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if let Some(log) = on_panic.upgrade() {
            // Bounded: a panic on the writer thread returns at once, and a writer stuck in a write cannot hang
            // the panic.
            log.drain(Some(PANIC_DRAIN));
        }
        previous(info);
    }));
    Ok(())
}

/// The event log's spelling of an IOTLB permission.
pub fn perm_name(perm: vm_memory::Permissions) -> &'static str {
    match perm {
        vm_memory::Permissions::No => "none",
        vm_memory::Permissions::Read => "r",
        vm_memory::Permissions::Write => "w",
        vm_memory::Permissions::ReadWrite => "rw",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_carry_seq_time_and_kind() {
        let sink = Shared::default();
        let log = EventLog::to_writer(Box::new(sink.clone()));
        log.record(&TransportEvent::IotlbMiss { iova: 0x1000, perm: "rw" });
        log.emit(HcaEvent::Command { opcode: "QUERY_DEVICE".into(), tag: 7, status: "OK".into() });
        log.flush();
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["seq"], 0);
        assert_eq!(lines[0]["kind"], "iotlb_miss");
        assert_eq!(lines[0]["iova"], 0x1000);
        assert_eq!(lines[1]["seq"], 1);
        assert_eq!(lines[1]["kind"], "command");
        assert_eq!(lines[1]["tag"], 7);
        assert!(lines[1]["t_us"].as_u64().unwrap() >= lines[0]["t_us"].as_u64().unwrap());
    }

    #[test]
    fn the_hca_s_lines_carry_their_request_s_time_and_time_never_goes_back() {
        let sink = Shared::default();
        let log = EventLog::to_writer(Box::new(sink.clone()));
        let doorbell = || HcaEvent::TranslationsStale { iova: 0, size: 0x1000, registers: 1, injected: false };
        log.request_started();
        log.emit(doorbell());
        std::thread::sleep(Duration::from_millis(3));
        log.emit(doorbell());
        log.record(&TransportEvent::IotlbMiss { iova: 0x1000, perm: "r" });
        log.emit(doorbell());
        std::thread::sleep(Duration::from_millis(3));
        log.request_started();
        log.emit(doorbell());
        log.flush();
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let t: Vec<u64> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["t_us"].as_u64().unwrap())
            .collect();
        assert_eq!(t.len(), 5);
        assert_eq!(t[0], t[1], "one request, one time");
        assert!(t[2] >= t[1] + 3000, "a transport line has its own time: {t:?}");
        assert_eq!(t[3], t[2], "and later HCA lines of the request are not stamped before it");
        assert!(t[4] >= t[3] + 3000, "the next request has its own time: {t:?}");
    }

    #[test]
    fn a_writer_behind_holds_the_recording_thread_back_and_loses_nothing() {
        let sink = Shared::default();
        let log = Arc::new(EventLog::to_writer(Box::new(sink.clone())));
        let other = Arc::clone(&log);
        let n = QUEUE_LIMIT as u64 + 1000;
        let front_end = std::thread::spawn(move || {
            for i in 0..n {
                other.record(&TransportEvent::IotlbMiss { iova: i, perm: "r" });
            }
        });
        for i in 0..n {
            log.emit(HcaEvent::TranslationsStale { iova: i, size: 1, registers: 0, injected: false });
        }
        front_end.join().unwrap();
        drop(Arc::into_inner(log).expect("the only holder"));
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len() as u64, 2 * n, "every line of both threads");
        assert!(lines.iter().enumerate().all(|(i, l)| l["seq"] == i as u64), "seq without gaps");
        for kind in ["iotlb_miss", "translations_stale"] {
            let iovas: Vec<u64> =
                lines.iter().filter(|l| l["kind"] == kind).map(|l| l["iova"].as_u64().unwrap()).collect();
            assert_eq!(iovas, (0..n).collect::<Vec<_>>(), "{kind}: each thread's lines in its order");
        }
    }

    #[test]
    fn a_fault_flushes_every_line_before_it_in_order_and_drop_flushes_the_rest() {
        let sink = Shared::default();
        let log = EventLog::to_writer(Box::new(sink.clone()));
        let text = || String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        for i in 0..100 {
            log.record(&TransportEvent::IotlbMiss { iova: i, perm: "r" });
        }
        log.record(&TransportEvent::DmaFault { iova: 0x2000, cause: "iommu_unmapped", queue: 2 });
        let lines: Vec<serde_json::Value> = text().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 101, "a fault writes out every line before it");
        assert!(lines.iter().enumerate().all(|(i, l)| l["seq"] == i as u64), "in order, none missing");
        assert_eq!(lines[100]["kind"], "dma_fault");
        log.emit(HcaEvent::Command { opcode: "QUERY_DEVICE".into(), tag: 1, status: "OK".into() });
        drop(log);
        assert_eq!(text().lines().count(), 102, "dropping the log flushes it");
    }
}
