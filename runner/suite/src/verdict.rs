//! The verdict: what actually happened in a run (one `Actual`, chosen by a fixed precedence documented in
//! docs/suites.md) and whether that is what the suite expected, with a reason a person reads in one line.

use std::fmt;

use serde::Serialize;

use crate::expect::Expected;
use crate::interleavings::{races, RaceSeen};
use crate::observation::{Observation, ProcessExit};
use crate::serial_scan::clip;
use crate::stop_line::Bugcheck;
use crate::suite::ConcreteRun;

/// What a run ended in.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Actual {
    /// The guest reported `"ok": true` and nothing worse happened.
    Pass,
    Bugcheck {
        #[serde(flatten)]
        bugcheck: Bugcheck,
        /// "serial" (a STOP line) or "qmp" (GUEST_PANICKED with Hyper-V crash parameters).
        source: &'static str,
    },
    /// The device refused a DMA; the first refusal's cause.
    DeviceFault { cause: String, count: usize },
    /// The guest kernel panicked or oopsed, or QEMU reported GUEST_PANICKED without a bugcheck.
    GuestPanic { message: String },
    /// The runner timed the run out before any result.
    Hang { silent_for_s: Option<f64>, timeout_s: Option<u32> },
    /// QEMU ended normally (the guest powered off) without a `VHCA-RESULT` line.
    UnexpectedPoweroff,
    /// vhca-device or QEMU died abnormally: the rig broke, nothing else in the run can be trusted.
    DeviceFailure { detail: String },
    /// The guest reported `"ok": false` (or a result the runner could not read).
    GuestFailed { error: String },
    /// The run ended without a result, a timeout or a poweroff: the runner stopped it (e.g. interrupted).
    NoResult { detail: String },
}

impl fmt::Display for Actual {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Actual::Pass => write!(f, "pass"),
            Actual::Bugcheck { bugcheck, .. } => write!(f, "{bugcheck}"),
            Actual::DeviceFault { cause, count: 1 } => write!(f, "device-fault {cause}"),
            Actual::DeviceFault { cause, count } => write!(f, "device-fault {cause} (first of {count})"),
            Actual::GuestPanic { message } => write!(f, "guest-panic: {message}"),
            Actual::Hang { silent_for_s, timeout_s } => {
                write!(f, "hang")?;
                match (silent_for_s, timeout_s) {
                    (Some(s), Some(t)) => write!(f, " (no output for {s:.1} s, timeout {t} s)"),
                    (Some(s), None) => write!(f, " (no output for {s:.1} s)"),
                    (None, Some(t)) => write!(f, " (timeout {t} s)"),
                    (None, None) => Ok(()),
                }
            }
            Actual::UnexpectedPoweroff => write!(f, "unexpected-poweroff (no VHCA-RESULT line)"),
            Actual::DeviceFailure { detail } => write!(f, "device-failure: {detail}"),
            Actual::GuestFailed { error } => write!(f, "guest-failed: {error}"),
            Actual::NoResult { detail } => write!(f, "no-result: {detail}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "lowercase")]
pub enum Outcome {
    Pass,
    Fail { reason: String },
}

impl Outcome {
    pub fn passed(&self) -> bool {
        matches!(self, Outcome::Pass)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    pub actual: Actual,
    pub outcome: Outcome,
    /// What else the run showed that the chosen `actual` hides (a device fault before the bugcheck, a second
    /// bugcheck, a malformed result line...), for the report.
    pub notes: Vec<String>,
}

/// Judges one run. Precedence, highest first: device-failure, bugcheck, guest-panic, device-fault, the guest's
/// result (pass / guest-failed), hang, unexpected-poweroff, no-result.
pub fn judge(expected: &Expected, o: &Observation) -> Verdict {
    let mut notes = Vec::new();
    let actual = actual_of(o, &mut notes);
    let outcome = judge_races(expected, &actual, &races(o), &mut notes);
    Verdict { actual, outcome, notes }
}

/// Judges a concrete run: its expectation, then the event-log kinds it requires. A run whose verdict matched but
/// whose device never logged a required kind fails, naming the missing kinds; one that failed anyway gets a note.
pub fn judge_run(run: &ConcreteRun, o: &Observation) -> Verdict {
    let mut verdict = judge(&run.expected, o);
    let missing: Vec<&str> =
        run.events.iter().filter(|k| !o.event_kinds.contains(k.as_str())).map(String::as_str).collect();
    if missing.is_empty() {
        return verdict;
    }
    let what = format!("required event-log kind(s) never logged by the device: {}", missing.join(", "));
    if verdict.outcome.passed() {
        verdict.outcome =
            Outcome::Fail { reason: format!("expected {}, got {} but {what}", run.expected, verdict.actual) };
    } else {
        verdict.notes.push(what);
    }
    verdict
}

fn actual_of(o: &Observation, notes: &mut Vec<String>) -> Actual {
    let serial_bugcheck = o.bugchecks.first();
    let qmp_bugcheck = o.guest_panicked.as_ref().and_then(|p| p.hyperv.as_ref()).and_then(|h| h.bugcheck());
    if o.bugchecks.len() > 1 {
        notes.push(format!("{} STOP lines on serial; the first counts", o.bugchecks.len()));
    }
    if let (Some(s), Some(q)) = (serial_bugcheck, &qmp_bugcheck) {
        if s.code != q.code || s.params != q.params {
            notes.push(format!("QMP GUEST_PANICKED reports {q}, serial says {s}"));
        }
    }
    if let Some(first) = o.device_faults.first() {
        let when = first.t_us.map(|t| format!(" at t={t} µs")).unwrap_or_default();
        notes.push(format!("device fault {}{when} (event log line {}): {}", first.cause, first.line, first.detail));
    }
    if let Some(p) = o.linux_panics.first() {
        notes.push(format!("guest kernel: {}", p.message));
    }
    if o.timed_out {
        notes.push(match o.timeout_s {
            Some(t) => format!("the runner timed the run out after {t} s"),
            None => "the runner timed the run out".to_string(),
        });
    }
    notes.extend(o.result_problems.iter().cloned());

    let mut failures = Vec::new();
    failures.extend(o.rig_problems.iter().cloned());
    if o.device_exit.is_abnormal() {
        failures.push(format!("vhca-device {}", o.device_exit.describe()));
    }
    if o.qemu_exit.is_abnormal() {
        failures.push(format!("QEMU {}", o.qemu_exit.describe()));
    }
    if !failures.is_empty() {
        return Actual::DeviceFailure { detail: failures.join("; ") };
    }
    if let Some(b) = serial_bugcheck {
        return Actual::Bugcheck { bugcheck: b.clone(), source: "serial" };
    }
    if let Some(b) = qmp_bugcheck {
        return Actual::Bugcheck { bugcheck: b, source: "qmp" };
    }
    if let Some(p) = o.linux_panics.first() {
        return Actual::GuestPanic { message: p.message.clone() };
    }
    if let Some(p) = &o.guest_panicked {
        let info = p.info_type.as_deref().map(|t| format!(", info {t}")).unwrap_or_default();
        return Actual::GuestPanic { message: format!("QMP GUEST_PANICKED (action {}{info})", p.action) };
    }
    if let Some(first) = o.device_faults.first() {
        // The device's refusal is the verdict; a guest that failed its own checks as well is worth knowing (a bug
        // scenario whose own story went wrong would otherwise pass on the fault alone).
        if let Some(result) = o.guest_result.as_ref().filter(|r| r.get("ok").and_then(|ok| ok.as_bool()) != Some(true))
        {
            notes.push(format!("the guest's own checks failed as well: {}", result_error(result)));
        }
        return Actual::DeviceFault { cause: first.cause.clone(), count: o.device_faults.len() };
    }
    if let Some(result) = &o.guest_result {
        return match result.get("ok").and_then(|ok| ok.as_bool()) {
            Some(true) => Actual::Pass,
            Some(false) => Actual::GuestFailed { error: result_error(result) },
            None => Actual::GuestFailed {
                error: format!("VHCA-RESULT has no boolean \"ok\": {}", clip(&result.to_string(), 160)),
            },
        };
    }
    if let Some(problem) = o.result_problems.first() {
        return Actual::GuestFailed { error: problem.clone() };
    }
    if o.timed_out {
        return Actual::Hang { silent_for_s: o.silent_for_s, timeout_s: o.timeout_s };
    }
    match o.qemu_exit {
        ProcessExit::Exited { code: 0 } => Actual::UnexpectedPoweroff,
        other => Actual::NoResult { detail: format!("QEMU {} before a VHCA-RESULT line", other.describe()) },
    }
}

/// The guest's own words for a failure: its `error` string, else the whole result.
fn result_error(result: &serde_json::Value) -> String {
    match result.get("error") {
        Some(serde_json::Value::String(s)) => clip(s, 200),
        Some(other) => clip(&other.to_string(), 200),
        None => format!("\"ok\": false without an \"error\": {}", clip(&result.to_string(), 160)),
    }
}

/// The race detector's reports against the expectation: `race` passes on a reported race whatever the run did
/// after (a race often ends in the bugcheck it causes), save a broken rig; any other expectation fails on one,
/// naming both call sites, even when the run ended as expected (that end may be the race's luck).
fn judge_races(expected: &Expected, actual: &Actual, races: &[RaceSeen], notes: &mut Vec<String>) -> Outcome {
    let more = |n: usize| if n > 1 { format!(" (first of {n})") } else { String::new() };
    if let Expected::Race { word } = expected {
        let found = races.iter().find(|r| word.as_ref().is_none_or(|w| r.mentions(w)));
        return match (found, actual) {
            (_, Actual::DeviceFailure { .. }) => Outcome::Fail { reason: format!("expected {expected}, got {actual}") },
            (Some(race), _) => {
                notes.push(format!("{race}{}", more(races.len())));
                Outcome::Pass
            }
            (None, _) if races.is_empty() => {
                Outcome::Fail { reason: format!("expected {expected}, got {actual} and no race was reported") }
            }
            (None, _) => Outcome::Fail {
                reason: format!("expected {expected}, got {actual}; the races reported name it nowhere: {}", races[0]),
            },
        };
    }
    let outcome = compare(expected, actual);
    let Some(race) = races.first() else { return outcome };
    let race = format!("{race}{}", more(races.len()));
    match outcome {
        Outcome::Pass => {
            Outcome::Fail { reason: format!("expected {expected}, got {actual} but the detector reported a {race}") }
        }
        failed => {
            notes.push(race);
            failed
        }
    }
}

fn compare(expected: &Expected, actual: &Actual) -> Outcome {
    let matched = match (expected, actual) {
        (Expected::Pass, Actual::Pass) => true,
        (Expected::Bugcheck { code, params }, Actual::Bugcheck { bugcheck, .. }) => {
            if *code != bugcheck.code {
                false
            } else {
                // Every parameter counts (Windows prints four); `*` marks the addresses that differ per run.
                let wrong: Vec<String> = params
                    .iter()
                    .enumerate()
                    .filter_map(|(i, want)| {
                        let got = bugcheck.params.get(i).copied();
                        match got {
                            Some(g) if want.matches(g) => None,
                            Some(g) => Some(format!("parameter {} is {g:#X}, not {want}", i + 1)),
                            None => Some(format!("parameter {} is missing, expected {want}", i + 1)),
                        }
                    })
                    .collect();
                if !wrong.is_empty() {
                    return Outcome::Fail {
                        reason: format!("expected {expected}, got {actual}: {}", wrong.join(", ")),
                    };
                }
                true
            }
        }
        (Expected::DeviceFault { cause }, Actual::DeviceFault { cause: got, .. }) => cause == got,
        (Expected::GuestPanic, Actual::GuestPanic { .. }) => true,
        (Expected::GuestFailed { word }, Actual::GuestFailed { error }) => {
            word.as_ref().is_none_or(|w| error.contains(w.as_str()))
        }
        (Expected::Hang, Actual::Hang { .. }) => true,
        _ => false,
    };
    if matched {
        Outcome::Pass
    } else {
        Outcome::Fail { reason: format!("expected {expected}, got {actual}") }
    }
}
