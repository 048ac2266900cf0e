//! Serial console capture: follows the file QEMU writes the guest's ttyS0 to, hands out complete lines, and parses the
//! guest's `VHCA-RESULT {json}` line. Bugcheck lines will be recognised here too.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

pub const RESULT_MARKER: &str = "VHCA-RESULT ";

/// The guest's verdict on its own scenario, as printed on the console.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GuestResult {
    pub scenario: String,
    pub ok: bool,
    pub error: Option<String>,
    /// Named IOVAs the guest's driver used (`cmd`, `resp`, ...): what the device must have seen.
    pub iovas: BTreeMap<String, u64>,
    /// The whole JSON object, for reports and scenario-specific checks.
    pub raw: Value,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ResultParseError {
    #[error("VHCA-RESULT is not JSON: {0}")]
    Json(String),
    #[error("VHCA-RESULT is not a JSON object")]
    NotObject,
    #[error("VHCA-RESULT lacks field `{0}` or it has the wrong type")]
    Field(&'static str),
    #[error("VHCA-RESULT iovas.{0} is not an address")]
    Iova(String),
}

/// Reads an address written as a JSON number or a "0x..." / decimal string.
pub fn json_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => {
            let s = s.trim();
            match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => s.parse().ok(),
            }
        }
        _ => None,
    }
}

/// If `line` carries a result, parses it. Kernel messages can share the line, so the marker may sit anywhere.
pub fn parse_result_line(line: &str) -> Option<Result<GuestResult, ResultParseError>> {
    let start = line.find(RESULT_MARKER)? + RESULT_MARKER.len();
    Some(parse_result_json(line[start..].trim()))
}

fn parse_result_json(text: &str) -> Result<GuestResult, ResultParseError> {
    let raw: Value = serde_json::from_str(text).map_err(|e| ResultParseError::Json(e.to_string()))?;
    let obj = raw.as_object().ok_or(ResultParseError::NotObject)?;
    let scenario = obj.get("scenario").and_then(Value::as_str).ok_or(ResultParseError::Field("scenario"))?;
    let ok = obj.get("ok").and_then(Value::as_bool).ok_or(ResultParseError::Field("ok"))?;
    let error = match obj.get("error") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => Some(other.to_string()),
    };
    let mut iovas = BTreeMap::new();
    match obj.get("iovas") {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            // Single addresses are kept by name; lists (ring addresses per queue, ...) stay in `raw`.
            for (name, v) in map {
                match v {
                    Value::Array(_) | Value::Object(_) | Value::Null => {}
                    _ => {
                        let iova = json_u64(v).ok_or_else(|| ResultParseError::Iova(name.clone()))?;
                        iovas.insert(name.clone(), iova);
                    }
                }
            }
        }
        Some(_) => return Err(ResultParseError::Field("iovas")),
    }
    Ok(GuestResult { scenario: scenario.to_string(), ok, error, iovas, raw: raw.clone() })
}

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
    fn parses_a_full_result_with_hex_and_number_iovas() {
        let line = r#"VHCA-RESULT {"scenario":"smoke","ok":true,"error":null,"query_device":{"max_qp":4},"iovas":{"cmd":4096,"resp":"0x2000","rings":[[1,2,3]]}}"#;
        let r = parse_result_line(line).unwrap().unwrap();
        assert_eq!(r.scenario, "smoke");
        assert!(r.ok);
        assert_eq!(r.error, None);
        assert_eq!(r.iovas.get("cmd"), Some(&4096));
        assert_eq!(r.iovas.get("resp"), Some(&0x2000));
        assert_eq!(r.iovas.len(), 2, "lists are not single IOVAs");
        assert_eq!(r.raw["query_device"]["max_qp"], 4);
    }

    #[test]
    fn marker_after_kernel_noise_and_failure_result() {
        let line = "[    3.1] random: crng init done\rVHCA-RESULT {\"scenario\":\"smoke\",\"ok\":false,\"error\":\"no device\"}";
        let r = parse_result_line(line).unwrap().unwrap();
        assert!(!r.ok);
        assert_eq!(r.error.as_deref(), Some("no device"));
        assert!(r.iovas.is_empty());
    }

    #[test]
    fn lines_without_marker_are_not_results() {
        assert!(parse_result_line("vhca-guest: binding 0000:01:00.0 to vfio-pci").is_none());
    }

    #[test]
    fn malformed_results_name_their_fault() {
        assert!(matches!(parse_result_line("VHCA-RESULT {oops").unwrap(), Err(ResultParseError::Json(_))));
        assert_eq!(parse_result_line("VHCA-RESULT [1]").unwrap(), Err(ResultParseError::NotObject));
        assert_eq!(
            parse_result_line(r#"VHCA-RESULT {"scenario":"smoke"}"#).unwrap(),
            Err(ResultParseError::Field("ok"))
        );
        assert_eq!(
            parse_result_line(r#"VHCA-RESULT {"scenario":"s","ok":true,"iovas":{"cmd":-1}}"#).unwrap(),
            Err(ResultParseError::Iova("cmd".into()))
        );
    }

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
