//! Verdicts: a run's outcome judged against what its suite entry expects. Pure functions of the outcome, so every
//! rule is unit-tested with hand-written outcomes and logs.

use serde::{Deserialize, Serialize};
use vhca_proto::{Opcode, Status};

use crate::events::{check_coverage, Event, EventKind};
use crate::outcome::{RunEnd, RunOutcome};

/// The command queue: QUERY_DEVICE's request and response descriptors live there.
pub const COMMAND_QUEUE: u16 = 0;

/// What a suite entry expects from its run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "expect", rename_all = "snake_case")]
pub enum Expectation {
    /// The guest reports ok, QEMU and the device exit cleanly, nothing faulted; with `iova_check`, the device's log
    /// proves the command's descriptors were the guest's IOVAs, translated through QEMU's IOTLB.
    GuestOk { iova_check: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VerdictKind {
    Pass,
    Fail,
    Timeout,
    DeviceFailure,
}

impl VerdictKind {
    pub fn label(self) -> &'static str {
        match self {
            VerdictKind::Pass => "PASS",
            VerdictKind::Fail => "FAIL",
            VerdictKind::Timeout => "TIMEOUT",
            VerdictKind::DeviceFailure => "DEVICE-FAILURE",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    pub kind: VerdictKind,
    /// Every reason the run did not meet its expectation (empty on a pass).
    pub reasons: Vec<String>,
}

impl Verdict {
    pub fn pass(&self) -> bool {
        self.kind == VerdictKind::Pass
    }
}

pub fn judge(expect: &Expectation, out: &RunOutcome) -> Verdict {
    match expect {
        Expectation::GuestOk { iova_check } => judge_guest_ok(*iova_check, out),
    }
}

fn judge_guest_ok(iova_check: bool, out: &RunOutcome) -> Verdict {
    let mut reasons = Vec::new();
    let mut kind = VerdictKind::Fail;
    let qemu_aborted = out.qemu_exit.is_some_and(|e| e.signal == Some(libc::SIGABRT));
    match out.end {
        RunEnd::Timeout => {
            kind = VerdictKind::Timeout;
            reasons.push(format!("no VHCA-RESULT within {:.0} s", out.timeout_secs));
        }
        RunEnd::DeviceExited => {
            kind = VerdictKind::DeviceFailure;
            match out.device_exit {
                Some(exit) => reasons.push(format!("vhca-device ended before the guest's result ({exit})")),
                None => reasons.push("vhca-device never created its socket".into()),
            }
        }
        RunEnd::QemuExited if qemu_aborted => {
            // DESIGN.md: a failing backend can make QEMU assert; that is the device's fault, not the guest's.
            kind = VerdictKind::DeviceFailure;
            reasons.push("QEMU aborted (SIGABRT), as it does when the vhost-user backend misbehaves".into());
        }
        RunEnd::QemuExited => {
            let exit = out.qemu_exit.map(|e| e.to_string()).unwrap_or_default();
            reasons.push(format!("the guest stopped without a VHCA-RESULT (QEMU {exit})"));
        }
        RunEnd::GuestResult => {}
    }
    if let Some(e) = &out.result_error {
        reasons.push(format!("unreadable result: {e}"));
    }
    if let Some(r) = &out.guest_result {
        if r.scenario != out.scenario {
            reasons.push(format!("the guest ran scenario `{}`, not `{}`", r.scenario, out.scenario));
        }
        if !r.ok {
            reasons.push(format!("the guest reports failure: {}", r.error.as_deref().unwrap_or("(no error given)")));
        }
    }
    if out.end == RunEnd::GuestResult {
        match out.qemu_exit {
            Some(e) if e.success() => {}
            Some(e) => reasons.push(format!("QEMU {e} after the result")),
            None => reasons.push("QEMU did not exit after the guest powered off".into()),
        }
        match out.device_exit {
            Some(e) if e.success() => {}
            Some(e) => reasons.push(format!("vhca-device {e} after QEMU disconnected")),
            None => reasons.push("vhca-device did not exit after QEMU disconnected".into()),
        }
        match &out.events {
            Ok(events) => {
                reasons.extend(no_faults(events));
                if iova_check {
                    let iovas = out.guest_result.as_ref().map(|r| &r.iovas);
                    let gpas = out.guest_result.as_ref().and_then(|r| r.raw.get("gpas"));
                    reasons.extend(query_device_iovas(events, iovas, gpas));
                }
            }
            Err(e) => reasons.push(format!("event log: {e}")),
        }
    }
    if reasons.is_empty() {
        kind = VerdictKind::Pass;
    } else if kind == VerdictKind::Pass {
        kind = VerdictKind::Fail;
    }
    Verdict { kind, reasons }
}

fn no_faults(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::DmaFault { iova, cause, .. } => Some(format!("unexpected DMA fault at IOVA {iova:#x}: {cause}")),
            EventKind::ProtocolError { cause } => Some(format!("vhost-user protocol error: {cause}")),
            _ => None,
        })
        .collect()
}

/// Opcodes and statuses may be logged by name or number; compare by name.
fn opcode_is(text: &str, op: Opcode) -> bool {
    match text.parse::<u32>() {
        Ok(n) => Opcode::from_u32(n) == Some(op),
        Err(_) => text.eq_ignore_ascii_case(op.name()),
    }
}

fn status_ok(text: &str) -> bool {
    match text.parse::<u32>() {
        Ok(n) => Status::from_u32(n) == Some(Status::Ok),
        Err(_) => text.eq_ignore_ascii_case(Status::Ok.name()),
    }
}

/// QUERY_DEVICE ran; every command-queue descriptor lay inside an IOTLB update QEMU had sent; and the guest's own
/// VFIO IOVAs for the request and the response are among those descriptors.
fn query_device_iovas(
    events: &[Event],
    iovas: Option<&std::collections::BTreeMap<String, u64>>,
    gpas: Option<&serde_json::Value>,
) -> Vec<String> {
    let mut reasons = Vec::new();
    let commands: Vec<&String> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Command { opcode, status, .. } if opcode_is(opcode, Opcode::QueryDevice) => Some(status),
            _ => None,
        })
        .collect();
    if commands.is_empty() {
        reasons.push("the event log has no QUERY_DEVICE command".into());
    } else if !commands.iter().any(|s| status_ok(s)) {
        reasons.push(format!("QUERY_DEVICE never completed OK (statuses: {commands:?})"));
    }
    let cov = check_coverage(events, COMMAND_QUEUE);
    if cov.descs.is_empty() {
        reasons.push("the device logged no descriptor on the command queue".into());
    }
    for u in &cov.uncovered {
        reasons.push(format!("descriptor at IOVA {:#x}+{} (event {}): {}", u.iova, u.len, u.seq, u.reason));
    }
    let Some(iovas) = iovas else {
        reasons.push("no guest result, so no guest IOVAs to compare".into());
        return reasons;
    };
    for (name, writable) in [("cmd", false), ("resp", true)] {
        let Some(&iova) = iovas.get(name) else {
            reasons.push(format!("the guest's result lacks iovas.{name}"));
            continue;
        };
        let seen =
            cov.descs.iter().any(|&(d, len, w)| w == writable && d <= iova && iova < d.saturating_add(len.max(1)));
        if !seen {
            let dir = if writable { "device-writable" } else { "device-readable" };
            reasons.push(format!("the guest's {name} IOVA {iova:#x} is in no {dir} command-queue descriptor"));
        }
        // With the GPA alongside, an identity mapping would make the check prove nothing: insist they differ.
        if let Some(gpa) = gpas.and_then(|g| g.get(name)).and_then(crate::serial::json_u64) {
            if gpa == iova {
                reasons
                    .push(format!("the guest's {name} IOVA equals its GPA {gpa:#x}: the check cannot tell them apart"));
            }
        }
    }
    reasons
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::parse_log;
    use crate::outcome::ExitInfo;
    use crate::qemu_cmd::Accel;
    use crate::serial::parse_result_line;

    const LOG: &str = r#"{"seq":1,"t_us":1,"kind":"connected"}
{"seq":2,"t_us":2,"kind":"iotlb_update","iova":268435456,"size":65536,"uaddr":140000000000000,"perm":"rw"}
{"seq":3,"t_us":3,"kind":"desc","queue":0,"iova":268435456,"len":16,"writable":false}
{"seq":4,"t_us":4,"kind":"desc","queue":0,"iova":268439552,"len":80,"writable":true}
{"seq":5,"t_us":5,"kind":"command","opcode":1,"tag":7,"status":0}
{"seq":6,"t_us":6,"kind":"disconnected"}
"#;
    const RESULT: &str = r#"VHCA-RESULT {"scenario":"smoke","ok":true,"error":null,"iovas":{"cmd":268435456,"resp":268439552},"gpas":{"cmd":2101248,"resp":2105344}}"#;
    const CLEAN: Option<ExitInfo> = Some(ExitInfo { code: Some(0), signal: None });

    fn outcome(log: &str, result: &str) -> RunOutcome {
        RunOutcome {
            name: "smoke".into(),
            scenario: "smoke".into(),
            accel: Accel::Tcg,
            end: RunEnd::GuestResult,
            seconds: 4.0,
            timeout_secs: 120.0,
            qemu_exit: CLEAN,
            device_exit: CLEAN,
            guest_result: parse_result_line(result).map(|r| r.unwrap()),
            result_error: None,
            events: parse_log(log),
            artifacts: None,
            serial_tail: vec![],
            device_log_tail: vec![],
            qemu_log_tail: vec![],
            qmp_events: vec![],
            reproducer: String::new(),
        }
    }

    const SMOKE: Expectation = Expectation::GuestOk { iova_check: true };

    #[test]
    fn good_run_passes() {
        let v = judge(&SMOKE, &outcome(LOG, RESULT));
        assert_eq!(v.kind, VerdictKind::Pass, "{:?}", v.reasons);
    }

    #[test]
    fn descriptors_at_gpas_outside_the_iotlb_fail() {
        // The device read GPAs: nothing QEMU mapped covers them, and the guest's IOVAs were never seen.
        let log = LOG.replace("\"iova\":268435456,\"len\":16", "\"iova\":2101248,\"len\":16");
        let v = judge(&SMOKE, &outcome(&log, RESULT));
        assert_eq!(v.kind, VerdictKind::Fail);
        assert!(v.reasons.iter().any(|r| r.contains("no IOTLB update")), "{:?}", v.reasons);
        assert!(v.reasons.iter().any(|r| r.contains("cmd IOVA")), "{:?}", v.reasons);
    }

    #[test]
    fn response_in_a_readable_descriptor_or_missing_command_fails() {
        let log = LOG
            .replace("\"len\":80,\"writable\":true", "\"len\":80,\"writable\":false")
            .replace("\"opcode\":1", "\"opcode\":2");
        let v = judge(&SMOKE, &outcome(&log, RESULT));
        assert!(v.reasons.iter().any(|r| r.contains("resp IOVA")), "{:?}", v.reasons);
        assert!(v.reasons.iter().any(|r| r.contains("no QUERY_DEVICE")), "{:?}", v.reasons);
    }

    #[test]
    fn identity_iova_equal_to_gpa_fails() {
        let result = RESULT.replace("\"gpas\":{\"cmd\":2101248", "\"gpas\":{\"cmd\":268435456");
        let v = judge(&SMOKE, &outcome(LOG, &result));
        assert!(v.reasons.iter().any(|r| r.contains("equals its GPA")), "{:?}", v.reasons);
    }

    #[test]
    fn guest_failure_fault_and_dirty_exits_fail() {
        let result = RESULT.replace("\"ok\":true,\"error\":null", "\"ok\":false,\"error\":\"timeout on cq\"");
        let log = format!(
            "{LOG}{{\"seq\":7,\"t_us\":7,\"kind\":\"dma_fault\",\"iova\":4096,\"cause\":\"unmapped\",\"queue\":0}}\n"
        );
        let mut out = outcome(&log, &result);
        out.device_exit = Some(ExitInfo { code: Some(1), signal: None });
        let v = judge(&SMOKE, &out);
        assert_eq!(v.kind, VerdictKind::Fail);
        for needle in ["timeout on cq", "DMA fault", "vhca-device exit code 1"] {
            assert!(v.reasons.iter().any(|r| r.contains(needle)), "{needle} missing from {:?}", v.reasons);
        }
    }

    #[test]
    fn timeout_and_qemu_abort_are_classified() {
        let mut out = outcome(LOG, RESULT);
        out.end = RunEnd::Timeout;
        out.guest_result = None;
        assert_eq!(judge(&SMOKE, &out).kind, VerdictKind::Timeout);
        out.end = RunEnd::QemuExited;
        out.qemu_exit = Some(ExitInfo { code: None, signal: Some(libc::SIGABRT) });
        assert_eq!(judge(&SMOKE, &out).kind, VerdictKind::DeviceFailure);
    }
}
