//! Serial console capture: follows the file QEMU writes the guest's ttyS0 to and hands out complete lines as they
//! arrive. What the lines mean (results, bugchecks, panics) is vhca-suite's to say.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

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
}
