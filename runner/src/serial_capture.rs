//! Serial console capture: follows the file QEMU writes the guest's ttyS0 to and hands out complete lines as they
//! arrive; and the console socket a restored guest's run request is typed into. What the lines mean (results,
//! bugchecks, panics) is vhca-suite's to say.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Follows a growing file and yields the lines completed since the last poll.
#[derive(Debug)]
pub struct SerialLog {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl SerialLog {
    pub fn new(path: &Path) -> SerialLog {
        SerialLog { path: path.to_path_buf(), offset: 0, partial: Vec::new() }
    }

    /// Bytes read so far: growth means the guest said something, even without finishing a line.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// New complete lines (without line ends). A file QEMU has not created yet reads as empty.
    pub fn poll(&mut self) -> io::Result<Vec<String>> {
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        file.seek(SeekFrom::Start(self.offset))?;
        let mut buf = Vec::new();
        let n = file.read_to_end(&mut buf)?;
        self.offset += n as u64;
        self.partial.extend_from_slice(&buf);
        let mut lines = Vec::new();
        while let Some(pos) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=pos).collect();
            lines.push(clean_line(&line));
        }
        Ok(lines)
    }

    /// The unterminated tail, for when QEMU is gone and no newline will come.
    pub fn take_partial(&mut self) -> Option<String> {
        if self.partial.is_empty() {
            return None;
        }
        let line = clean_line(&self.partial);
        self.partial.clear();
        Some(line)
    }
}

/// The runner's end of a console socket (`-chardev socket`): a thread copies what the guest says into the log file
/// `SerialLog` follows, as it arrives. Draining at once matters: QEMU's serial writes one byte per socket message, so
/// an unread socket fills after a few hundred bytes and slows the guest's console to the reader's pace.
#[derive(Debug)]
pub struct ConsolePort {
    stream: UnixStream,
    pump: Option<std::thread::JoinHandle<()>>,
    /// Where the pump writes: a guest that serves several runs writes each run's console into that run's log.
    log: Arc<Mutex<File>>,
}

impl ConsolePort {
    /// Connects, retrying until `timeout` while QEMU creates the socket; `log` is created afresh.
    pub fn connect(path: &Path, log: &Path, timeout: Duration) -> io::Result<ConsolePort> {
        let end = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= end => {
                    return Err(io::Error::new(e.kind(), format!("console socket {}: {e}", path.display())))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        let log = Arc::new(Mutex::new(File::create(log)?));
        let file = log.clone();
        let mut reader = stream.try_clone()?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        let pump = std::thread::Builder::new().name("console".into()).spawn(move || {
            let mut buf = [0u8; 16 * 1024];
            // Ends when QEMU closes the socket, or when the port is dropped (shutdown makes the read return 0).
            loop {
                match reader.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => {
                        let mut file = file.lock().unwrap_or_else(|e| e.into_inner());
                        if file.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => return,
                }
            }
        })?;
        Ok(ConsolePort { stream, pump: Some(pump), log })
    }

    /// From now on the guest's console goes to `log`, created afresh (the next run's, on a guest that serves
    /// several). Called while the guest waits for its request, so no line is split between two logs.
    pub fn log_to(&mut self, log: &Path) -> io::Result<()> {
        let file = File::create(log)?;
        *self.log.lock().unwrap_or_else(|e| e.into_inner()) = file;
        Ok(())
    }

    /// Types one line into the guest's console.
    pub fn send_line(&mut self, line: &str) -> io::Result<()> {
        let mut bytes = line.as_bytes().to_vec();
        bytes.push(b'\n');
        self.stream.write_all(&bytes)
    }
}

impl ConsolePort {
    /// Lets the copy thread reach QEMU's end of the stream (QEMU is gone: what it sent is still in the socket) for up
    /// to `patience`, then closes. Dropping instead closes at once, and what was not yet read is lost.
    pub fn close(self, patience: Duration) {
        let end = Instant::now() + patience;
        while self.pump.as_ref().is_some_and(|p| !p.is_finished()) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for ConsolePort {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(pump) = self.pump.take() {
            let _ = pump.join();
        }
    }
}

fn clean_line(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim_end_matches(['\n', '\r']).replace('\r', "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn serial_log_yields_complete_lines_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.log");
        let mut log = SerialLog::new(&path);
        assert!(log.poll().unwrap().is_empty(), "missing file reads as empty");
        let mut f = File::create(&path).unwrap();
        f.write_all(b"one\r\ntw").unwrap();
        assert_eq!(log.poll().unwrap(), ["one"]);
        f.write_all(b"o\nthree").unwrap();
        assert_eq!(log.poll().unwrap(), ["two"]);
        assert_eq!(log.take_partial().as_deref(), Some("three"));
        assert!(log.poll().unwrap().is_empty());
    }

    #[test]
    fn console_port_logs_what_the_guest_says_and_types_lines() {
        use std::io::{BufRead, BufReader};
        use std::os::unix::net::UnixListener;
        let dir = tempfile::tempdir().unwrap();
        let (path, log) = (dir.path().join("serial.sock"), dir.path().join("serial.log"));
        let listener = UnixListener::bind(&path).unwrap();
        let mut port = ConsolePort::connect(&path, &log, Duration::from_secs(5)).unwrap();
        let (mut guest, _) = listener.accept().unwrap();
        // One byte per message, as QEMU's serial sends: more than an unread socket would hold.
        for _ in 0..2000 {
            guest.write_all(b"x").unwrap();
        }
        guest.write_all(b"\nVHCA-AGENT-READY\n").unwrap();
        port.send_line("{\"params\":[]}").unwrap();
        let mut line = String::new();
        BufReader::new(guest.try_clone().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line, "{\"params\":[]}\n");
        drop(guest);
        drop(port);
        let mut follow = SerialLog::new(&log);
        assert_eq!(follow.poll().unwrap(), ["x".repeat(2000), "VHCA-AGENT-READY".to_string()]);
        let missing = ConsolePort::connect(&dir.path().join("none.sock"), &log, Duration::from_millis(50)).unwrap_err();
        assert!(missing.to_string().contains("none.sock"), "{missing}");
    }

    #[test]
    fn each_run_of_a_guest_gets_its_own_console_log() {
        use std::os::unix::net::UnixListener;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.sock");
        let (first, second) = (dir.path().join("first.log"), dir.path().join("second.log"));
        let listener = UnixListener::bind(&path).unwrap();
        let mut port = ConsolePort::connect(&path, &first, Duration::from_secs(5)).unwrap();
        let (mut guest, _) = listener.accept().unwrap();
        guest.write_all(b"run one\nVHCA-AGENT-READY\n").unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while std::fs::read_to_string(&first).unwrap().lines().count() < 2 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
        port.log_to(&second).unwrap();
        guest.write_all(b"run two\n").unwrap();
        drop(guest);
        port.close(Duration::from_secs(5));
        assert_eq!(std::fs::read_to_string(&first).unwrap(), "run one\nVHCA-AGENT-READY\n");
        assert_eq!(std::fs::read_to_string(&second).unwrap(), "run two\n");
    }
}
