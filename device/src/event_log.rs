//! The device's JSON-lines event log: one object per line with `seq`, `t_us` and `kind`, in order. Lines are buffered
//! off the DMA path and flushed at least every `FLUSH_EVERY` while events come, at once for a fault or a
//! disconnection, when the log is dropped, and on SIGTERM/SIGINT/SIGHUP or a panic (`install_flush_guards`), so
//! the runner's verdicts never miss a line. Also the HCA's `EventSink`.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
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
}

/// The longest a written line waits in the buffer while later events keep coming (a reader of the live file sees
/// it within this time; the last lines are flushed when the device stops).
const FLUSH_EVERY: Duration = Duration::from_millis(20);
const BUFFER: usize = 64 * 1024;

struct Inner {
    out: BufWriter<Box<dyn Write + Send>>,
    seq: u64,
    flushed_at: Instant,
    /// One event's JSON, kept between events so a line costs no allocation.
    scratch: Vec<u8>,
}

impl Inner {
    fn flush(&mut self) {
        if let Err(err) = self.out.flush() {
            tracing::error!("event log: flush failed: {err}");
        }
        self.flushed_at = Instant::now();
    }
}

/// Appends events; cheap enough to call for every DMA (one formatted line into a buffer per event).
pub struct EventLog {
    inner: Mutex<Inner>,
    start: Instant,
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
        Ok(EventLog::to_writer(Box::new(file)))
    }

    /// A log writing to any sink; used by tests to capture lines in memory.
    pub fn to_writer(out: Box<dyn Write + Send>) -> EventLog {
        let inner = Inner {
            out: BufWriter::with_capacity(BUFFER, out),
            seq: 0,
            flushed_at: Instant::now(),
            scratch: Vec::new(),
        };
        EventLog { inner: Mutex::new(inner), start: Instant::now() }
    }

    pub fn record(&self, event: &TransportEvent) {
        self.write_event(event, event.flushes());
    }

    /// Writes every buffered line to the file.
    pub fn flush(&self) {
        self.lock().flush();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write_event<T: Serialize>(&self, event: &T, flush_now: bool) {
        let now = Instant::now();
        let t_us = u64::try_from(now.duration_since(self.start).as_micros()).unwrap_or(u64::MAX);
        let mut inner = self.lock();
        let Inner { out, seq, flushed_at, scratch } = &mut *inner;
        // Serialised once into a reused buffer; `seq` and `t_us` are spliced in front of its fields so every line
        // starts with them.
        scratch.clear();
        if let Err(err) = serde_json::to_writer(&mut *scratch, event) {
            tracing::error!("event log: cannot serialise event: {err}");
            return;
        }
        let Some(fields) = scratch.strip_prefix(b"{") else {
            tracing::error!("event log: event did not serialise to an object: {}", String::from_utf8_lossy(scratch));
            return;
        };
        let written = write!(out, "{{\"seq\":{seq},\"t_us\":{t_us},")
            .and_then(|()| out.write_all(fields))
            .and_then(|()| out.write_all(b"\n"));
        *seq += 1;
        if let Err(err) = written {
            tracing::error!("event log: write failed: {err}");
        }
        if flush_now || now.duration_since(*flushed_at) >= FLUSH_EVERY {
            inner.flush();
        }
    }
}

impl Drop for EventLog {
    fn drop(&mut self) {
        self.flush();
    }
}

impl EventSink for EventLog {
    fn emit(&self, event: HcaEvent) {
        let flush_now = matches!(event, HcaEvent::Fault { .. });
        self.write_event(&event, flush_now);
    }
}

/// Flushes `log` when the process is told to stop (SIGTERM, SIGINT, SIGHUP: then the signal's default action ends
/// it, as before) and when any thread panics, so a buffered line is never lost to either. SIGKILL cannot be caught:
/// what `FLUSH_EVERY` has not yet written is lost then, at most that much time of events.
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
            // try_lock: the panicking thread may hold the log's lock itself.
            if let Ok(mut inner) = log.inner.try_lock() {
                inner.flush();
            }
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
