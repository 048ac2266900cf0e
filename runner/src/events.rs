//! The device's event log (JSON lines) read into typed events, and the IOTLB coverage check: every descriptor the
//! device followed must lie inside a mapping QEMU had sent it, which proves the device used IOVAs through the vIOMMU.

use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::serial::json_u64;

/// Access rights of an IOTLB entry, vhost's numbering (RO 1, WO 2, RW 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Perm {
    pub read: bool,
    pub write: bool,
}

impl Perm {
    fn parse(v: &Value) -> Option<Perm> {
        if let Some(n) = v.as_u64() {
            return Some(Perm { read: n & 1 != 0, write: n & 2 != 0 });
        }
        let s = v.as_str()?.to_ascii_lowercase().replace(['_', '-', ' '], "");
        match s.as_str() {
            "rw" | "readwrite" | "3" => Some(Perm { read: true, write: true }),
            "ro" | "r" | "read" | "readonly" | "1" => Some(Perm { read: true, write: false }),
            "wo" | "w" | "write" | "writeonly" | "2" => Some(Perm { read: false, write: true }),
            "none" | "noaccess" | "0" => Some(Perm { read: false, write: false }),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventKind {
    IotlbUpdate {
        iova: u64,
        size: u64,
        uaddr: u64,
        perm: Perm,
    },
    IotlbInvalidate {
        iova: u64,
        size: u64,
    },
    IotlbMiss {
        iova: u64,
    },
    Desc {
        queue: u16,
        iova: u64,
        len: u64,
        writable: bool,
        uaddr: Option<u64>,
    },
    DmaFault {
        iova: u64,
        cause: String,
        queue: Option<u16>,
    },
    Command {
        opcode: String,
        tag: Option<u64>,
        status: String,
    },
    Connected,
    Disconnected,
    ProtocolError {
        cause: String,
    },
    /// A kind this runner does not check yet; kept so reports can still show it.
    Other {
        name: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Event {
    pub seq: u64,
    pub t_us: u64,
    #[serde(flatten)]
    pub kind: EventKind,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EventLogError {
    #[error("cannot read event log {path}: {cause}")]
    Read { path: String, cause: String },
    #[error("event log line {line}: {cause}")]
    Line { line: usize, cause: String },
}

/// Reads the whole log. A last line without its newline is dropped: the device may have been killed mid-write.
pub fn read_log(path: &Path) -> Result<Vec<Event>, EventLogError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| EventLogError::Read { path: path.display().to_string(), cause: e.to_string() })?;
    parse_log(&text)
}

pub fn parse_log(text: &str) -> Result<Vec<Event>, EventLogError> {
    let complete = match text.rfind('\n') {
        Some(end) => &text[..end],
        None => "",
    };
    complete
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| parse_event(l).map_err(|cause| EventLogError::Line { line: i + 1, cause }))
        .collect()
}

/// Fields may sit at the top level or in a nested object (`{"kind":"desc","desc":{...}}`): look in both.
fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).or_else(|| obj.values().filter_map(Value::as_object).find_map(|inner| inner.get(name)))
}

fn num(obj: &Map<String, Value>, name: &str) -> Result<u64, String> {
    let v = field(obj, name).ok_or_else(|| format!("missing `{name}`"))?;
    json_u64(v).ok_or_else(|| format!("`{name}` is not a number: {v}"))
}

fn opt_num(obj: &Map<String, Value>, name: &str) -> Result<Option<u64>, String> {
    match field(obj, name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => json_u64(v).map(Some).ok_or_else(|| format!("`{name}` is not a number: {v}")),
    }
}

/// Strings and numbers both name things (opcodes, statuses, causes); keep them as text.
fn text(obj: &Map<String, Value>, name: &str) -> Result<String, String> {
    match field(obj, name) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Number(n)) => Ok(n.to_string()),
        Some(other) => Err(format!("`{name}` is neither text nor a number: {other}")),
        None => Err(format!("missing `{name}`")),
    }
}

fn queue(obj: &Map<String, Value>) -> Result<Option<u16>, String> {
    opt_num(obj, "queue")?.map(|q| u16::try_from(q).map_err(|_| format!("queue {q} out of range"))).transpose()
}

fn parse_event(line: &str) -> Result<Event, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    let seq = num(obj, "seq")?;
    let t_us = num(obj, "t_us")?;
    let kind_name = obj.get("kind").and_then(Value::as_str).ok_or("missing `kind`")?;
    let kind = match kind_name {
        "iotlb_update" => {
            let pv = field(obj, "perm").ok_or("missing `perm`")?;
            EventKind::IotlbUpdate {
                iova: num(obj, "iova")?,
                size: num(obj, "size")?,
                uaddr: num(obj, "uaddr")?,
                perm: Perm::parse(pv).ok_or_else(|| format!("unrecognised perm {pv}"))?,
            }
        }
        "iotlb_invalidate" => EventKind::IotlbInvalidate { iova: num(obj, "iova")?, size: num(obj, "size")? },
        "iotlb_miss" => EventKind::IotlbMiss { iova: num(obj, "iova")? },
        "desc" => EventKind::Desc {
            queue: queue(obj)?.ok_or("desc without `queue`")?,
            iova: num(obj, "iova")?,
            len: num(obj, "len")?,
            writable: field(obj, "writable").and_then(Value::as_bool).ok_or("desc without boolean `writable`")?,
            uaddr: opt_num(obj, "uaddr")?,
        },
        "dma_fault" => EventKind::DmaFault { iova: num(obj, "iova")?, cause: text(obj, "cause")?, queue: queue(obj)? },
        "command" => {
            EventKind::Command { opcode: text(obj, "opcode")?, tag: opt_num(obj, "tag")?, status: text(obj, "status")? }
        }
        "connected" => EventKind::Connected,
        "disconnected" => EventKind::Disconnected,
        "protocol_error" => EventKind::ProtocolError { cause: text(obj, "cause")? },
        other => EventKind::Other { name: other.to_string() },
    };
    Ok(Event { seq, t_us, kind })
}

/// One mapping QEMU sent: [start, end) of IOVA space onto QEMU virtual address `uaddr` (of `start`).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Mapping {
    start: u64,
    end: u64,
    uaddr: u64,
    perm: Perm,
}

/// The IOTLB as the device knew it at some point of the log: updates add, invalidations cut.
#[derive(Debug, Default)]
struct IotlbShadow {
    maps: Vec<Mapping>,
}

impl IotlbShadow {
    fn update(&mut self, iova: u64, size: u64, uaddr: u64, perm: Perm) {
        let end = iova.saturating_add(size);
        self.cut(iova, end);
        self.maps.push(Mapping { start: iova, end, uaddr, perm });
    }

    fn cut(&mut self, start: u64, end: u64) {
        let mut kept = Vec::with_capacity(self.maps.len());
        for m in self.maps.drain(..) {
            if m.end <= start || m.start >= end {
                kept.push(m);
                continue;
            }
            if m.start < start {
                kept.push(Mapping { end: start, ..m });
            }
            if m.end > end {
                kept.push(Mapping { start: end, uaddr: m.uaddr.wrapping_add(end - m.start), ..m });
            }
        }
        self.maps = kept;
    }

    /// The mapping that holds all of [iova, iova+len), if one does (a descriptor never spans two updates here).
    fn covering(&self, iova: u64, len: u64) -> Option<&Mapping> {
        let end = iova.checked_add(len.max(1))?;
        self.maps.iter().find(|m| m.start <= iova && end <= m.end)
    }
}

/// Why a descriptor failed the coverage check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Uncovered {
    pub seq: u64,
    pub iova: u64,
    pub len: u64,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Coverage {
    /// Descriptors checked, in log order: (iova, len, writable).
    pub descs: Vec<(u64, u64, bool)>,
    pub uncovered: Vec<Uncovered>,
}

/// Checks every `desc` on `queue` against the IOTLB state QEMU had built up by then (in `seq` order).
pub fn check_coverage(events: &[Event], queue: u16) -> Coverage {
    let mut order: Vec<&Event> = events.iter().collect();
    order.sort_by_key(|e| e.seq);
    let mut shadow = IotlbShadow::default();
    let mut cov = Coverage { descs: Vec::new(), uncovered: Vec::new() };
    for e in order {
        match &e.kind {
            EventKind::IotlbUpdate { iova, size, uaddr, perm } => shadow.update(*iova, *size, *uaddr, *perm),
            EventKind::IotlbInvalidate { iova, size } => shadow.cut(*iova, iova.saturating_add(*size)),
            EventKind::Desc { queue: q, iova, len, writable, uaddr } if *q == queue => {
                cov.descs.push((*iova, *len, *writable));
                let fail = |reason: String| Uncovered { seq: e.seq, iova: *iova, len: *len, reason };
                let Some(m) = shadow.covering(*iova, *len) else {
                    cov.uncovered.push(fail("no IOTLB update from QEMU covers it".into()));
                    continue;
                };
                if *writable && !m.perm.write {
                    cov.uncovered.push(fail("device-writable but mapped without write permission".into()));
                } else if !*writable && !m.perm.read {
                    cov.uncovered.push(fail("device-readable but mapped without read permission".into()));
                } else if let Some(u) = uaddr {
                    let expected = m.uaddr.wrapping_add(iova - m.start);
                    if *u != expected {
                        cov.uncovered.push(fail(format!(
                            "translated to uaddr {u:#x}, but the covering update maps it to {expected:#x}"
                        )));
                    }
                }
            }
            _ => {}
        }
    }
    cov
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"seq":1,"t_us":10,"kind":"connected"}
{"seq":2,"t_us":20,"kind":"iotlb_update","iova":"0x10000","size":8192,"uaddr":"0x7f0000000000","perm":"rw"}
{"seq":3,"t_us":30,"kind":"desc","queue":0,"iova":65536,"len":16,"writable":false,"uaddr":139637976727552}
{"seq":4,"t_us":31,"kind":"desc","queue":0,"iova":69632,"len":64,"writable":true,"uaddr":139637976731648}
{"seq":5,"t_us":40,"kind":"command","opcode":"QUERY_DEVICE","tag":1,"status":"OK"}
{"seq":6,"t_us":50,"kind":"iotlb_miss","iova":4096,"perm":"ro"}
{"seq":7,"t_us":60,"kind":"disconnected"}
"#;

    #[test]
    fn parses_every_kind_and_drops_a_torn_last_line() {
        let text = format!("{GOOD}{{\"seq\":8,\"t_us\":70,\"ki");
        let events = parse_log(&text).unwrap();
        assert_eq!(events.len(), 7);
        assert_eq!(events[0].kind, EventKind::Connected);
        assert_eq!(
            events[1].kind,
            EventKind::IotlbUpdate {
                iova: 0x10000,
                size: 8192,
                uaddr: 0x7f00_0000_0000,
                perm: Perm { read: true, write: true }
            }
        );
        assert!(
            matches!(&events[4].kind, EventKind::Command { opcode, status, tag: Some(1) } if opcode == "QUERY_DEVICE" && status == "OK")
        );
    }

    #[test]
    fn a_bad_line_is_an_error_naming_the_line() {
        let text = "{\"seq\":1,\"t_us\":1,\"kind\":\"connected\"}\n{\"seq\":2,\"kind\":\"connected\"}\n";
        assert_eq!(parse_log(text), Err(EventLogError::Line { line: 2, cause: "missing `t_us`".into() }));
    }

    #[test]
    fn good_log_is_fully_covered() {
        let cov = check_coverage(&parse_log(GOOD).unwrap(), 0);
        assert_eq!(cov.descs, [(0x10000, 16, false), (0x11000, 64, true)]);
        assert!(cov.uncovered.is_empty(), "{:?}", cov.uncovered);
    }

    #[test]
    fn desc_before_its_update_or_outside_it_is_uncovered() {
        let log = r#"{"seq":1,"t_us":1,"kind":"desc","queue":0,"iova":65536,"len":16,"writable":false}
{"seq":2,"t_us":2,"kind":"iotlb_update","iova":65536,"size":4096,"uaddr":4096,"perm":3}
{"seq":3,"t_us":3,"kind":"desc","queue":0,"iova":69630,"len":16,"writable":false}
{"seq":4,"t_us":4,"kind":"desc","queue":1,"iova":1,"len":16,"writable":false}
"#;
        let cov = check_coverage(&parse_log(log).unwrap(), 0);
        assert_eq!(cov.uncovered.iter().map(|u| u.seq).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(cov.descs.len(), 2, "queue 1 is not checked");
    }

    #[test]
    fn invalidation_and_permissions_and_translation_are_enforced() {
        let log = r#"{"seq":1,"t_us":1,"kind":"iotlb_update","iova":0,"size":12288,"uaddr":1048576,"perm":"RO"}
{"seq":2,"t_us":2,"kind":"iotlb_invalidate","iova":4096,"size":4096}
{"seq":3,"t_us":3,"kind":"desc","queue":0,"iova":4100,"len":8,"writable":false}
{"seq":4,"t_us":4,"kind":"desc","queue":0,"iova":8192,"len":8,"writable":true}
{"seq":5,"t_us":5,"kind":"desc","queue":0,"iova":8192,"len":8,"writable":false,"uaddr":1056768}
{"seq":6,"t_us":6,"kind":"desc","queue":0,"iova":8192,"len":8,"writable":false,"uaddr":1}
"#;
        let cov = check_coverage(&parse_log(log).unwrap(), 0);
        let seqs: Vec<u64> = cov.uncovered.iter().map(|u| u.seq).collect();
        assert_eq!(seqs, [3, 4, 6], "{:?}", cov.uncovered);
        assert!(cov.uncovered[1].reason.contains("write permission"));
        assert!(cov.uncovered[2].reason.contains("uaddr"));
    }
}
