//! What one finished run showed, as the runner collected it: serial findings, QMP panics, device faults, how the
//! processes ended and whether the runner had to time the run out. `judge` turns it into a verdict.

use std::collections::BTreeSet;

use serde::Serialize;

use crate::event_log_reader::{DeviceFault, EventLog};
use crate::serial_scan::{scan_serial, LinuxPanic};
use crate::stop_line::{bugcheck_name, Bugcheck};

/// How a child process (QEMU or vhca-device) ended, as far as the runner knows when it judges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum ProcessExit {
    /// Still running when observed; the runner stops it afterwards. Not a failure by itself.
    #[default]
    Running,
    /// Exited on its own with this code (QEMU: 0 after the guest powered off).
    Exited { code: i32 },
    /// Died of a signal the runner did not send (e.g. 6, SIGABRT: a QEMU assertion).
    Signaled { signal: i32 },
    /// The runner killed it: on a timeout, or to end a run whose result was already in.
    KilledByRunner,
}

impl ProcessExit {
    /// From `std::process::ExitStatus::code()` and `ExitStatusExt::signal()`.
    pub fn from_status(code: Option<i32>, signal: Option<i32>) -> ProcessExit {
        match (code, signal) {
            (Some(code), _) => ProcessExit::Exited { code },
            (None, Some(signal)) => ProcessExit::Signaled { signal },
            (None, None) => ProcessExit::Running,
        }
    }

    /// From a shell-style return code where a negative value is the signal (`-6`: SIGABRT).
    pub fn from_rc(rc: i32) -> ProcessExit {
        if rc < 0 {
            ProcessExit::Signaled { signal: rc.saturating_neg() }
        } else {
            ProcessExit::Exited { code: rc }
        }
    }

    /// Ended abnormally on its own: a non-zero exit or a signal nobody sent.
    pub fn is_abnormal(self) -> bool {
        matches!(self, ProcessExit::Exited { code } if code != 0) || matches!(self, ProcessExit::Signaled { .. })
    }

    pub fn describe(self) -> String {
        match self {
            ProcessExit::Running => "still running".into(),
            ProcessExit::Exited { code } => format!("exited with status {code}"),
            ProcessExit::Signaled { signal } => match signal_name(signal) {
                Some(name) => format!("killed by signal {signal} ({name})"),
                None => format!("killed by signal {signal}"),
            },
            ProcessExit::KilledByRunner => "stopped by the runner".into(),
        }
    }
}

fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        15 => "SIGTERM",
        _ => return None,
    })
}

/// The Hyper-V crash MSRs QEMU reports with GUEST_PANICKED (`info.type = "hyper-v"`): a Windows guest's bugcheck
/// code in arg1 and its four parameters in arg2..arg5.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HyperVCrash {
    pub arg1: u64,
    pub arg2: u64,
    pub arg3: u64,
    pub arg4: u64,
    pub arg5: u64,
}

impl HyperVCrash {
    /// The bugcheck these registers describe; `None` if arg1 is not a 32-bit code.
    pub fn bugcheck(&self) -> Option<Bugcheck> {
        let code = u32::try_from(self.arg1).ok()?;
        Some(Bugcheck {
            code,
            params: vec![self.arg2, self.arg3, self.arg4, self.arg5],
            name: bugcheck_name(code).map(str::to_string),
        })
    }
}

/// A QMP `GUEST_PANICKED` event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestPanicked {
    /// QEMU's `action`: pause, poweroff, run.
    pub action: String,
    /// `info.type` when present (hyper-v, s390, tdx).
    pub info_type: Option<String>,
    pub hyperv: Option<HyperVCrash>,
}

impl GuestPanicked {
    /// Reads a whole QMP event (`{"event":"GUEST_PANICKED","data":{...}}`) or just its `data`.
    /// `None` for any other event. Missing numbers in a hyper-v `info` leave `hyperv` empty rather than guessing.
    pub fn from_qmp(event: &serde_json::Value) -> Option<GuestPanicked> {
        let data = match event.get("event") {
            Some(name) if name == "GUEST_PANICKED" => event.get("data")?,
            Some(_) => return None,
            None => event,
        };
        let action = data.get("action")?.as_str()?.to_string();
        let info = data.get("info");
        let info_type = info.and_then(|i| i.get("type")).and_then(|t| t.as_str()).map(str::to_string);
        let hyperv = info.filter(|_| info_type.as_deref() == Some("hyper-v")).and_then(|i| {
            let arg = |n: &str| i.get(n)?.as_u64();
            Some(HyperVCrash {
                arg1: arg("arg1")?,
                arg2: arg("arg2")?,
                arg3: arg("arg3")?,
                arg4: arg("arg4")?,
                arg5: arg("arg5")?,
            })
        });
        Some(GuestPanicked { action, info_type, hyperv })
    }
}

/// Everything the runner saw of one finished run. Fill it with the `add_*` helpers or field by field.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Observation {
    /// The first well-formed `VHCA-RESULT {json}` object.
    pub guest_result: Option<serde_json::Value>,
    /// Malformed or extra result lines, each with its line number; reported, and a failure when no good one came.
    pub result_problems: Vec<String>,
    /// STOP lines from serial, in order.
    pub bugchecks: Vec<Bugcheck>,
    /// Linux panic and oops lines, in order.
    pub linux_panics: Vec<LinuxPanic>,
    pub guest_panicked: Option<GuestPanicked>,
    /// Refused DMAs from the device's event log, in order.
    pub device_faults: Vec<DeviceFault>,
    /// Every event-log `kind` that appeared, for the suite's required `events`.
    pub event_kinds: BTreeSet<String>,
    /// The rig itself misbehaved in a way no process exit shows: the device never listened, it followed a
    /// descriptor no IOTLB update covered, the guest ran another scenario than asked, the runner could not start
    /// QEMU. Judged as a device failure: nothing else the run showed can be trusted.
    pub rig_problems: Vec<String>,
    pub qemu_exit: ProcessExit,
    pub device_exit: ProcessExit,
    /// Seconds between the last serial output and the end of the run.
    pub silent_for_s: Option<f64>,
    /// The runner ended the run because its timeout passed.
    pub timed_out: bool,
    /// The timeout that applied, for messages.
    pub timeout_s: Option<u32>,
}

impl Observation {
    /// Adds what the serial log shows: the result line, bugchecks and Linux panics.
    pub fn add_serial(&mut self, text: &str) {
        let found = scan_serial(text);
        for result in found.results {
            match result.parsed {
                Ok(value) if self.guest_result.is_none() => self.guest_result = Some(value),
                Ok(_) => {
                    self.result_problems.push(format!("serial line {}: another VHCA-RESULT line, ignored", result.line))
                }
                Err(e) => self.result_problems.push(format!("serial line {}: {e}", result.line)),
            }
        }
        self.bugchecks.extend(found.bugchecks);
        self.linux_panics.extend(found.panics);
    }

    /// Adds the device's refused DMAs and the kinds of event it logged.
    pub fn add_event_log(&mut self, log: &EventLog) {
        self.device_faults.extend(log.faults());
        self.event_kinds.extend(log.events.iter().map(|e| e.kind.clone()));
    }

    /// Records a QMP event if it is GUEST_PANICKED (the first one counts); returns whether it was.
    pub fn add_qmp_event(&mut self, event: &serde_json::Value) -> bool {
        match GuestPanicked::from_qmp(event) {
            Some(p) => {
                self.guest_panicked.get_or_insert(p);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn process_exits() {
        assert_eq!(ProcessExit::from_rc(-6), ProcessExit::Signaled { signal: 6 });
        assert_eq!(ProcessExit::from_rc(0), ProcessExit::Exited { code: 0 });
        assert_eq!(ProcessExit::from_status(None, Some(11)), ProcessExit::Signaled { signal: 11 });
        assert!(ProcessExit::from_rc(-6).is_abnormal());
        assert!(ProcessExit::from_rc(1).is_abnormal());
        assert!(!ProcessExit::from_rc(0).is_abnormal());
        assert!(!ProcessExit::KilledByRunner.is_abnormal());
        assert_eq!(ProcessExit::from_rc(-6).describe(), "killed by signal 6 (SIGABRT)");
        assert_eq!(ProcessExit::from_rc(i32::MIN), ProcessExit::Signaled { signal: i32::MAX });
    }

    #[test]
    fn qmp_guest_panicked() {
        let hv = json!({"event":"GUEST_PANICKED","data":{"action":"pause","info":{"type":"hyper-v","arg1":230,"arg2":38,"arg3":0,"arg4":0,"arg5":0}}});
        let p = GuestPanicked::from_qmp(&hv).unwrap();
        let b = p.hyperv.unwrap().bugcheck().unwrap();
        assert_eq!((b.code, b.params[0]), (0xE6, 0x26));
        assert_eq!(b.name.as_deref(), Some("DRIVER_VERIFIER_DMA_VIOLATION"));
        let linux = GuestPanicked::from_qmp(&json!({"action":"poweroff"})).unwrap();
        assert_eq!((linux.info_type, linux.hyperv), (None, None));
        assert_eq!(GuestPanicked::from_qmp(&json!({"event":"STOP","data":{}})), None);
        let partial = GuestPanicked::from_qmp(&json!({"action":"pause","info":{"type":"hyper-v","arg1":1}})).unwrap();
        assert_eq!(partial.hyperv, None);
        let huge = HyperVCrash { arg1: 1 << 40, arg2: 0, arg3: 0, arg4: 0, arg5: 0 };
        assert_eq!(huge.bugcheck(), None);
    }

    #[test]
    fn add_serial_keeps_the_first_good_result() {
        let mut o = Observation::default();
        o.add_serial("VHCA-RESULT {bad\nVHCA-RESULT {\"ok\":true}\nVHCA-RESULT {\"ok\":false}\n");
        assert_eq!(o.guest_result, Some(json!({"ok": true})));
        assert_eq!(o.result_problems.len(), 2);
        assert!(o.result_problems[0].starts_with("serial line 1:"));
        assert!(o.add_qmp_event(&json!({"event":"GUEST_PANICKED","data":{"action":"pause"}})));
        assert!(!o.add_qmp_event(&json!({"event":"RESUME"})));
        assert!(o.guest_panicked.is_some());
    }
}
