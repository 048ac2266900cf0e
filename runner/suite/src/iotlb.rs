//! The rig's proof that the device used IOVAs through the vIOMMU: every command-queue descriptor it followed lies in
//! an IOTLB mapping QEMU had sent by then, with the right permission, and the guest's own IOVAs are among them.

use serde_json::Value;

use crate::event_log_reader::{EventLog, LogEvent};

/// The command queue: every command's request and response descriptors live there.
pub const COMMAND_QUEUE: u64 = 0;

/// One IOTLB entry as QEMU sent it: [start, end) → uaddr.
#[derive(Debug, Clone, Copy)]
struct Mapping {
    start: u64,
    end: u64,
    uaddr: u64,
    read: bool,
    write: bool,
}

/// A number written as JSON number or "0x.." string (the device writes numbers; hand-made logs may not).
fn number(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => {
            let s = s.trim();
            match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => s.parse().ok(),
            }
        }
        _ => None,
    }
}

fn field(e: &LogEvent, name: &str) -> Option<u64> {
    number(e.fields.get(name)?)
}

/// `perm` as docs/events.md writes it ("r", "w", "rw", "none") or vhost's number (RO 1, WO 2, RW 3).
fn perm(e: &LogEvent) -> Option<(bool, bool)> {
    let v = e.fields.get("perm")?;
    if let Some(n) = v.as_u64() {
        return Some((n & 1 != 0, n & 2 != 0));
    }
    match v.as_str()?.to_ascii_lowercase().as_str() {
        "rw" => Some((true, true)),
        "r" | "ro" => Some((true, false)),
        "w" | "wo" => Some((false, true)),
        "none" => Some((false, false)),
        _ => None,
    }
}

#[derive(Default)]
struct Shadow {
    maps: Vec<Mapping>,
}

impl Shadow {
    fn cut(&mut self, start: u64, end: u64) {
        let mut kept = Vec::with_capacity(self.maps.len());
        for m in self.maps.drain(..) {
            if m.end <= start || end <= m.start {
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

    fn covering(&self, iova: u64, len: u64) -> Option<&Mapping> {
        let end = iova.checked_add(len.max(1))?;
        self.maps.iter().find(|m| m.start <= iova && end <= m.end)
    }
}

/// A command-queue descriptor the device followed: (iova, len, device-writable).
type Desc = (u64, u64, bool);

/// Problems with the rig's IOVA path; empty when the log has no command-queue descriptor (the guest never got that
/// far) and no guest result names IOVAs to look for.
pub fn iotlb_problems(log: &EventLog, guest_result: Option<&Value>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut shadow = Shadow::default();
    let mut descs: Vec<Desc> = Vec::new();
    for e in &log.events {
        match e.kind.as_str() {
            "iotlb_update" => {
                let (Some(iova), Some(size), Some(uaddr), Some((read, write))) =
                    (field(e, "iova"), field(e, "size"), field(e, "uaddr"), perm(e))
                else {
                    problems.push(format!("event log line {}: iotlb_update without iova/size/uaddr/perm", e.line));
                    continue;
                };
                let Some(end) = iova.checked_add(size) else { continue };
                shadow.cut(iova, end);
                if read || write {
                    shadow.maps.push(Mapping { start: iova, end, uaddr, read, write });
                }
            }
            "iotlb_invalidate" => {
                if let (Some(iova), Some(size)) = (field(e, "iova"), field(e, "size")) {
                    shadow.cut(iova, iova.saturating_add(size));
                }
            }
            "desc" if field(e, "queue") == Some(COMMAND_QUEUE) => {
                let (Some(iova), Some(len)) = (field(e, "iova"), field(e, "len")) else { continue };
                let writable = e.fields.get("writable").and_then(Value::as_bool).unwrap_or(false);
                descs.push((iova, len, writable));
                let at = format!("command-queue descriptor at IOVA {iova:#x}+{len} (event log line {})", e.line);
                let Some(m) = shadow.covering(iova, len) else {
                    problems.push(format!("{at}: no IOTLB update from QEMU covers it"));
                    continue;
                };
                if (writable && !m.write) || (!writable && !m.read) {
                    let dir = if writable { "device-writable" } else { "device-readable" };
                    problems.push(format!("{at}: {dir} but QEMU mapped it without that permission"));
                } else if let Some(u) = field(e, "uaddr") {
                    let expected = m.uaddr.wrapping_add(iova - m.start);
                    if u != expected {
                        problems.push(format!("{at}: translated to {u:#x}, the covering update says {expected:#x}"));
                    }
                }
            }
            _ => {}
        }
    }
    problems.extend(guest_iovas_seen(&descs, guest_result));
    problems
}

/// The guest names the IOVAs of its command (`iovas.cmd`, device-readable) and response (`iovas.resp`,
/// device-writable): each must be inside a descriptor of that direction, and must differ from its GPA, or the check
/// could not tell an IOVA from a guest-physical address. A guest whose command was meant to be refused (it reports
/// `expected_failure`, as the `unmapped` control does) is exempt from the first rule: the device logs descriptors of
/// chains it completes, and that chain by design never completes.
fn guest_iovas_seen(descs: &[Desc], guest_result: Option<&Value>) -> Vec<String> {
    let mut problems = Vec::new();
    let Some(result) = guest_result else { return problems };
    let refusal_expected = result.get("expected_failure").is_some_and(|v| !v.is_null());
    for (name, writable) in [("cmd", false), ("resp", true)] {
        let Some(iova) = result.get("iovas").and_then(|i| i.get(name)).and_then(number) else { continue };
        let seen = descs.iter().any(|&(d, len, w)| w == writable && d <= iova && iova < d.saturating_add(len.max(1)));
        if !seen && !refusal_expected {
            let dir = if writable { "device-writable" } else { "device-readable" };
            problems.push(format!("the guest's {name} IOVA {iova:#x} is in no {dir} command-queue descriptor"));
        }
        if let Some(gpa) = result.get("gpas").and_then(|g| g.get(name)).and_then(number) {
            if gpa == iova {
                problems.push(format!("the guest's {name} IOVA equals its GPA {gpa:#x}: the check proves nothing"));
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event_log_reader::parse_event_log;
    use serde_json::json;

    const LOG: &str = r#"{"seq":1,"t_us":1,"kind":"connected"}
{"seq":2,"t_us":2,"kind":"iotlb_update","iova":268435456,"size":65536,"uaddr":140000000000000,"perm":"rw"}
{"seq":3,"t_us":3,"kind":"desc","queue":0,"iova":268435456,"len":16,"writable":false,"uaddr":140000000000000}
{"seq":4,"t_us":4,"kind":"desc","queue":0,"iova":268439552,"len":80,"writable":true}
{"seq":5,"t_us":5,"kind":"command","opcode":"QUERY_DEVICE","tag":7,"status":"OK"}
"#;

    fn result() -> Value {
        json!({"ok": true, "iovas": {"cmd": 268435456u64, "resp": 268439552u64}, "gpas": {"cmd": 2101248, "resp": 2105344}})
    }

    #[test]
    fn a_good_log_and_result_have_no_problem() {
        assert_eq!(iotlb_problems(&parse_event_log(LOG), Some(&result())), Vec::<String>::new());
        assert!(iotlb_problems(&parse_event_log(""), None).is_empty(), "no descriptor, no result: nothing to check");
    }

    #[test]
    fn descriptors_at_gpas_and_wrong_directions_are_problems() {
        // The device read a GPA: no update covers it, and the guest's cmd IOVA is then in no descriptor.
        let log = LOG.replace(r#""iova":268435456,"len":16"#, r#""iova":2101248,"len":16"#);
        let p = iotlb_problems(&parse_event_log(&log), Some(&result()));
        assert!(p.iter().any(|p| p.contains("no IOTLB update")), "{p:?}");
        assert!(p.iter().any(|p| p.contains("cmd IOVA")), "{p:?}");
        let log = LOG.replace(r#""len":80,"writable":true"#, r#""len":80,"writable":false"#);
        let p = iotlb_problems(&parse_event_log(&log), Some(&result()));
        assert!(p.iter().any(|p| p.contains("resp IOVA")), "{p:?}");
    }

    #[test]
    fn a_refusal_the_guest_expected_needs_no_completed_descriptor_but_keeps_the_other_checks() {
        // The `unmapped` control: its response IOVA is unmapped, so the chain never completes and no desc is logged.
        let log = "{\"seq\":1,\"t_us\":1,\"kind\":\"connected\"}\n";
        let mut expected = result();
        expected["expected_failure"] = json!("QUERY_DEVICE: IOMMU fault");
        assert_eq!(iotlb_problems(&parse_event_log(log), Some(&expected)), Vec::<String>::new());
        // Without the guest saying so, the same log is a problem; and IOVA == GPA is one either way.
        assert_eq!(iotlb_problems(&parse_event_log(log), Some(&result())).len(), 2);
        expected["gpas"]["cmd"] = json!(268435456u64);
        let p = iotlb_problems(&parse_event_log(log), Some(&expected));
        assert!(p.len() == 1 && p[0].contains("equals its GPA"), "{p:?}");
    }

    #[test]
    fn invalidation_permission_translation_and_identity_are_checked() {
        let log = r#"{"seq":1,"t_us":1,"kind":"iotlb_update","iova":0,"size":12288,"uaddr":1048576,"perm":"r"}
{"seq":2,"t_us":2,"kind":"iotlb_invalidate","iova":4096,"size":4096}
{"seq":3,"t_us":3,"kind":"desc","queue":0,"iova":4100,"len":8,"writable":false}
{"seq":4,"t_us":4,"kind":"desc","queue":0,"iova":8192,"len":8,"writable":true}
{"seq":5,"t_us":5,"kind":"desc","queue":0,"iova":8192,"len":8,"writable":false,"uaddr":1056768}
{"seq":6,"t_us":6,"kind":"desc","queue":0,"iova":8192,"len":8,"writable":false,"uaddr":1}
{"seq":7,"t_us":7,"kind":"desc","queue":1,"iova":99999999,"len":8,"writable":false}
"#;
        let p = iotlb_problems(&parse_event_log(log), None);
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(p[0].contains("line 3") && p[0].contains("no IOTLB update"), "{p:?}");
        assert!(p[1].contains("line 4") && p[1].contains("permission"), "{p:?}");
        assert!(p[2].contains("line 6") && p[2].contains("translated"), "{p:?}");
        let identity = json!({"ok": true, "iovas": {"cmd": 8192}, "gpas": {"cmd": 8192}});
        let p = iotlb_problems(&parse_event_log(log), Some(&identity));
        assert!(p.iter().any(|p| p.contains("equals its GPA")), "{p:?}");
    }
}
