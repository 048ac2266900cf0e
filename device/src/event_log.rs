//! The device's JSON-lines event log: one object per line with `seq`, `t_us` and `kind`, flushed line by line so
//! the runner can read it live or after killing the device. Also the HCA's `EventSink`.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

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

struct Inner {
    out: Box<dyn Write + Send>,
    seq: u64,
}

/// Appends events; cheap enough to call for every descriptor (one formatted line and one write per event).
pub struct EventLog {
    inner: Mutex<Inner>,
    start: Instant,
}

impl EventLog {
    pub fn create(path: &Path) -> io::Result<EventLog> {
        let file = File::create(path)?;
        Ok(EventLog::to_writer(Box::new(file)))
    }

    /// A log writing to any sink; used by tests to capture lines in memory.
    pub fn to_writer(out: Box<dyn Write + Send>) -> EventLog {
        EventLog { inner: Mutex::new(Inner { out, seq: 0 }), start: Instant::now() }
    }

    pub fn record(&self, event: &TransportEvent) {
        self.write_event(event);
    }

    fn write_event<T: Serialize>(&self, event: &T) {
        let body = match serde_json::to_string(event) {
            Ok(body) => body,
            Err(err) => {
                tracing::error!("event log: cannot serialise event: {err}");
                return;
            }
        };
        // `body` is a JSON object; splice seq and t_us in front so every line starts with them.
        let Some(fields) = body.strip_prefix('{') else {
            tracing::error!("event log: event did not serialise to an object: {body}");
            return;
        };
        let t_us = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX);
        let mut inner = self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let seq = inner.seq;
        inner.seq += 1;
        let line = format!("{{\"seq\":{seq},\"t_us\":{t_us},{fields}\n");
        if let Err(err) = inner.out.write_all(line.as_bytes()).and_then(|()| inner.out.flush()) {
            tracing::error!("event log: write failed: {err}");
        }
    }
}

impl EventSink for EventLog {
    fn emit(&self, event: HcaEvent) {
        self.write_event(&event);
    }
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
}
