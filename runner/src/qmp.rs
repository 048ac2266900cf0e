//! QMP client: connects to QEMU's control socket, negotiates capabilities, runs commands and collects asynchronous
//! events (SHUTDOWN, GUEST_PANICKED, ...). Snapshot restore and hot-plug will be driven through `execute`.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP socket {path}: {source}")]
    Connect { path: String, source: io::Error },
    #[error("QMP i/o: {0}")]
    Io(#[from] io::Error),
    #[error("QMP sent something that is not JSON: {0}")]
    Json(String),
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command { command: String, class: String, desc: String },
    #[error("QMP: no answer to {0} in time")]
    Timeout(String),
    #[error("QMP: QEMU closed the connection")]
    Closed,
}

/// An asynchronous QMP event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QmpEvent {
    pub event: String,
    pub data: Value,
}

#[derive(Debug)]
pub struct Qmp {
    stream: UnixStream,
    pending: Vec<u8>,
    events: Vec<QmpEvent>,
    closed: bool,
}

/// How long one read may block; callers poll in their own loops.
const READ_SLICE: Duration = Duration::from_millis(10);

impl Qmp {
    /// Connects, reads the greeting and leaves capabilities negotiation done. QEMU creates the socket shortly after
    /// it starts, so a missing socket is retried until `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let end = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < end => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(source) => return Err(QmpError::Connect { path: path.display().to_string(), source }),
            }
        };
        stream.set_read_timeout(Some(READ_SLICE))?;
        let mut qmp = Qmp { stream, pending: Vec::new(), events: Vec::new(), closed: false };
        let greeting = qmp.next_message(Instant::now() + timeout)?.ok_or(QmpError::Timeout("greeting".into()))?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Json(format!("unexpected greeting {greeting}")));
        }
        qmp.execute("qmp_capabilities", None, timeout)?;
        Ok(qmp)
    }

    /// Runs one command and returns its `return` value; events that arrive meanwhile are kept for `take_events`.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>, timeout: Duration) -> Result<Value, QmpError> {
        let mut msg = json!({ "execute": command });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut line = msg.to_string();
        line.push('\n');
        self.stream.write_all(line.as_bytes())?;
        let end = Instant::now() + timeout;
        loop {
            let Some(reply) = self.next_message(end)? else {
                return Err(QmpError::Timeout(command.to_string()));
            };
            if let Some(ret) = reply.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = reply.get("error") {
                let text = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
                return Err(QmpError::Command {
                    command: command.to_string(),
                    class: text("class"),
                    desc: text("desc"),
                });
            }
        }
    }

    /// `query-status`: the VM's run state ("running", "paused", "shutdown", "guest-panicked", ...).
    pub fn query_status(&mut self, timeout: Duration) -> Result<String, QmpError> {
        let ret = self.execute("query-status", None, timeout)?;
        Ok(ret.get("status").and_then(Value::as_str).unwrap_or("unknown").to_string())
    }

    /// Reads whatever events have arrived, without waiting. Not waiting matters: a run's wait loop calls this every
    /// turn, and a read that blocked for its slice (10 ms) made every turn that long, so the guest's result line
    /// was noticed up to 12 ms late in every run.
    pub fn poll_events(&mut self) -> Result<(), QmpError> {
        self.stream.set_nonblocking(true)?;
        let mut polled = Ok(());
        while !self.closed {
            match self.next_message(Instant::now()) {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(e) => {
                    polled = Err(e);
                    break;
                }
            }
        }
        self.stream.set_nonblocking(false)?;
        polled
    }

    pub fn take_events(&mut self) -> Vec<QmpEvent> {
        std::mem::take(&mut self.events)
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The next non-event message, or None if `deadline` passes (or QEMU closed the socket). Events are stashed.
    fn next_message(&mut self, deadline: Instant) -> Result<Option<Value>, QmpError> {
        loop {
            while let Some(pos) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=pos).collect();
                let text = String::from_utf8_lossy(&line);
                if text.trim().is_empty() {
                    continue;
                }
                let v: Value = serde_json::from_str(text.trim()).map_err(|e| QmpError::Json(format!("{e}: {text}")))?;
                if let Some(name) = v.get("event").and_then(Value::as_str) {
                    let data = v.get("data").cloned().unwrap_or(Value::Null);
                    self.events.push(QmpEvent { event: name.to_string(), data });
                    continue;
                }
                return Ok(Some(v));
            }
            if self.closed {
                return Ok(None);
            }
            let mut buf = [0u8; 4096];
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    self.closed = true;
                }
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => self.closed = true,
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::os::unix::net::UnixListener;

    /// A scripted QMP server: greets, acknowledges capabilities, answers query-status after an event, then hangs up.
    #[test]
    fn negotiates_runs_commands_and_collects_events() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            s.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n").unwrap();
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            assert!(line.contains("qmp_capabilities"));
            s.write_all(b"{\"return\": {}}\r\n").unwrap();
            line.clear();
            r.read_line(&mut line).unwrap();
            assert!(line.contains("query-status"));
            s.write_all(b"{\"event\": \"GUEST_PANICKED\", \"data\": {\"action\": \"pause\"}}\r\n").unwrap();
            s.write_all(b"{\"return\": {\"status\": \"guest-panicked\", \"running\": false}}\r\n").unwrap();
            line.clear();
            r.read_line(&mut line).unwrap();
            s.write_all(b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"no such device\"}}\r\n").unwrap();
            s.write_all(b"{\"event\": \"SHUTDOWN\", \"data\": {\"guest\": true}}\r\n").unwrap();
        });
        let mut qmp = Qmp::connect(&path, Duration::from_secs(5)).unwrap();
        assert_eq!(qmp.query_status(Duration::from_secs(5)).unwrap(), "guest-panicked");
        let err = qmp.execute("device_del", Some(json!({"id": "x"})), Duration::from_secs(5)).unwrap_err();
        assert!(matches!(err, QmpError::Command { ref desc, .. } if desc == "no such device"), "{err}");
        server.join().unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while !qmp.is_closed() && Instant::now() < end {
            qmp.poll_events().unwrap();
        }
        let names: Vec<String> = qmp.take_events().into_iter().map(|e| e.event).collect();
        assert_eq!(names, ["GUEST_PANICKED", "SHUTDOWN"]);
        assert!(qmp.is_closed());
    }
}
