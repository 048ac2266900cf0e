//! The vhost-user connection as QEMU drives it: arbitrary message sequences (header, payload, fds stood in by a
//! memfd of guest RAM, eventfds, a socket for the backend channel, /dev/null) through the device's real request
//! dispatcher (`Frontend`) and queue worker (`Worker`), so IOTLB updates, invalidations and the misses the worker
//! sends for rings and buffers the guest wrote are all reached. Guest RAM holds what the input wrote. The worker
//! makes one pass after every request: one deterministic interleaving of the two threads `vhca_device::serve`
//! runs (their races are the device tests' job, tests/robustness.rs).
//!
//! Checks: no panic, no hang, and the event log is whole JSON lines ending in `disconnected`, with a
//! `protocol_error` naming its cause whenever the connection was refused.
//!
//! Input: records `[kind][len][len bytes]` (see `message` and `guest_write`, used to write seeds).

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::time::Duration;

use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use vhca_device::event_log::EventLog;
use vhca_device::queue_worker::Worker;
use vhca_device::vhost_user::connection::Frontend;
use vhca_device::{connection_ended, device_parts, DeviceOptions, ServeError};

/// Guest RAM shared as a memfd; region sizes in SET_MEM_TABLE are checked against this.
pub const RAM_SIZE: u64 = 0x10000;
pub const KIND_MESSAGE: u8 = 0;
pub const KIND_GUEST_WRITE: u8 = 1;
/// Fd kinds a message may carry (two bits each in the fd byte).
pub const FD_MEMFD: u8 = 0;
pub const FD_EVENTFD: u8 = 1;
pub const FD_SOCKET: u8 = 2;
pub const FD_DEVNULL: u8 = 3;
/// Flags byte: low two bits are the version field as sent, this bit asks for a reply.
pub const FLAG_NEED_REPLY: u8 = 0x4;
const MAX_MESSAGES: usize = 48;
/// Largest ring the harness's device accepts: what the carrier device sets up in every real run.
pub const QUEUE_LIMIT: u16 = 64;

/// A message record: request code, flags byte, fds, payload.
pub fn message(request: u8, flags: u8, fds: &[u8], payload: &[u8]) -> Vec<u8> {
    assert!(fds.len() <= 3);
    let fd_byte = fds.iter().enumerate().fold(fds.len() as u8, |acc, (i, kind)| acc | (kind & 3) << (2 + 2 * i));
    let mut body = vec![request, flags, fd_byte];
    body.extend_from_slice(payload);
    record(KIND_MESSAGE, &body)
}

/// A guest-RAM write record: offset, bytes.
pub fn guest_write(offset: u16, bytes: &[u8]) -> Vec<u8> {
    let mut body = offset.to_le_bytes().to_vec();
    body.extend_from_slice(bytes);
    record(KIND_GUEST_WRITE, &body)
}

fn record(kind: u8, body: &[u8]) -> Vec<u8> {
    let len = u8::try_from(body.len()).expect("a record carries at most 255 bytes");
    let mut out = vec![kind, len];
    out.extend_from_slice(body);
    out
}

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn make_fd(kind: u8, ram: &OwnedFd, backends: &mut Vec<UnixStream>) -> std::io::Result<OwnedFd> {
    match kind & 3 {
        FD_MEMFD => ram.try_clone(),
        FD_EVENTFD => {
            let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?;
            // Signalled already: a kick the worker sees as soon as it watches it.
            rustix::io::write(&fd, &1u64.to_ne_bytes())?;
            Ok(fd)
        }
        FD_SOCKET => {
            let (ours, theirs) = UnixStream::pair()?;
            // Misses must not block the worker on a full socket: ours is never read.
            theirs.set_nonblocking(true)?;
            backends.push(ours);
            Ok(theirs.into())
        }
        _ => Ok(std::fs::File::open("/dev/null")?.into()),
    }
}

/// One event log for every input of the process, its lines captured in memory. Each input used to start (and join)
/// the log's writer thread: with the handshakes that made most of an execution's time context switches, about
/// 1,000 executions a second; the device's behaviour does not depend on the log's state (`seq` only numbers lines).
fn shared_log() -> (Arc<EventLog>, Captured) {
    static LOG: OnceLock<(Arc<EventLog>, Captured)> = OnceLock::new();
    let (events, lines) = LOG.get_or_init(|| {
        let lines = Captured::default();
        (Arc::new(EventLog::to_writer(Box::new(lines.clone()))), lines)
    });
    (Arc::clone(events), lines.clone())
}

/// The fuzzer's process has libFuzzer's main, not Rust's, so SIGPIPE is not ignored as in the device binary.
fn ignore_sigpipe() {
    static ONCE: Once = Once::new();
    // SAFETY: setting SIGPIPE to SIG_IGN has no memory-safety preconditions.
    ONCE.call_once(|| unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    });
}

/// One input: the messages, sent all at once, then the front-end hangs up; `serve` must answer each and return.
pub fn run(data: &[u8]) {
    trace(data);
}

/// `run`, returning the kinds of event the device logged (the replay test checks the seeds reach deep states).
pub fn trace(data: &[u8]) -> Vec<String> {
    ignore_sigpipe();
    let ram = memfd_create("vhca-fuzz-ram", MemfdFlags::CLOEXEC).expect("memfd");
    ftruncate(&ram, RAM_SIZE).expect("size the memfd");
    let (ours, device_end) = UnixStream::pair().expect("socketpair");
    let mut backends = Vec::new();
    let mut rest = data;
    let mut sent = 0;
    while let [kind, len, tail @ ..] = rest {
        let len = usize::from(*len).min(tail.len());
        let body = &tail[..len];
        rest = &tail[len..];
        match kind % 2 {
            KIND_MESSAGE => {
                let [request, flags, fd_byte, payload @ ..] = body else { continue };
                let count = usize::from(fd_byte & 3).min(3);
                let fds: Vec<OwnedFd> =
                    (0..count).filter_map(|i| make_fd(fd_byte >> (2 + 2 * i), &ram, &mut backends).ok()).collect();
                let flags = u32::from(flags & 3) | if flags & FLAG_NEED_REPLY != 0 { 0x8 } else { 0 };
                let mut bytes = Vec::with_capacity(12 + payload.len());
                for word in [u32::from(*request), flags, payload.len() as u32] {
                    bytes.extend_from_slice(&word.to_ne_bytes());
                }
                bytes.extend_from_slice(payload);
                let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
                let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(3))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                if !borrowed.is_empty() {
                    control.push(SendAncillaryMessage::ScmRights(&borrowed));
                }
                if sendmsg(&ours, &[std::io::IoSlice::new(&bytes)], &mut control, SendFlags::NOSIGNAL).is_err() {
                    break;
                }
                sent += 1;
                if sent == MAX_MESSAGES {
                    break;
                }
            }
            _ => {
                let [lo, hi, bytes @ ..] = body else { continue };
                let offset = u64::from(u16::from_le_bytes([*lo, *hi]));
                let _ = rustix::io::pwrite(&ram, bytes, offset);
            }
        }
    }
    let _ = ours.shutdown(std::net::Shutdown::Write);
    // One input at a time owns the process's log (the replay test calls this from several threads at once).
    static ONE_INPUT: Mutex<()> = Mutex::new(());
    let _owner = ONE_INPUT.lock().unwrap_or_else(|p| p.into_inner());
    let (events, log) = shared_log();
    // Whatever an earlier input left (nothing, once its disconnection drained the log) is not this one's.
    events.flush();
    std::mem::take(&mut *log.0.lock().unwrap_or_else(|p| p.into_inner()));
    // Queues of at most the carrier's 64 entries: with QEMU's limit of 1024 one input could post 1024 looping chains
    // of 1024 descriptors each per pass, and the corpus fills up with such inputs (the rate fell from about 3,000
    // to under 300 executions a second); every path a 1024-entry ring takes, a 64-entry one takes too.
    let options =
        DeviceOptions { miss_timeout: Duration::ZERO, max_queue_size: QUEUE_LIMIT, ..DeviceOptions::default() };
    let (shared, hca, config) = device_parts(&events, &options).expect("eventfd and epoll for the device");
    let mut worker = Worker::new(Arc::clone(&shared), hca).expect("epoll for the worker");
    let mut frontend = Frontend::new(device_end, Arc::clone(&shared), config);
    // The worker's pass after every request: one deterministic interleaving of the two threads serve() runs.
    let result = loop {
        match frontend.serve_one() {
            Ok(true) => worker.serve_queues(),
            Ok(false) => break Ok(()),
            Err(err) => break Err(err),
        }
    };
    let result = connection_ended(&events, result);
    drop(backends);
    drop(ours);
    // connection_ended's `disconnected` line drained the log: every line of this input is in `log` now.
    let text =
        String::from_utf8(std::mem::take(&mut *log.0.lock().unwrap_or_else(|p| p.into_inner()))).expect("UTF-8 log");
    let kinds: Vec<String> = text
        .lines()
        .map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).expect("each event-log line is JSON");
            value["kind"].as_str().expect("each event has a kind").to_string()
        })
        .collect();
    assert_eq!(kinds.last().map(String::as_str), Some("disconnected"), "the log ends with the disconnect");
    if let Err(ServeError::Protocol(_)) = result {
        assert!(kinds.iter().any(|k| k == "protocol_error"), "a refused connection logs its cause");
    }
    kinds
}
