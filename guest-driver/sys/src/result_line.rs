//! The result of a Windows run as the runner reads it: the same `VHCA-RESULT {json}` line the Linux guest prints
//! (`ok`, `scenario`, `lock`, `error`, `completion`, `completion_path`, `details`). vhca.sys prints it with DbgPrintEx and stores it in the registry value
//! `Result` under the service's Parameters key, where the guest's script copies it to the serial console.

use alloc::string::{String, ToString};

use serde_json::{json, Map, Value};
use vhca_driver_core::CompletionCounts;

pub const RESULT_PREFIX: &str = "VHCA-RESULT ";

/// A run's outcome, filled in as the scenario goes.
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    pub scenario: &'static str,
    /// The lock the control path took (`vhca.lock`'s spelling), where the scenario takes one.
    pub lock: Option<&'static str>,
    pub error: Option<String>,
    pub details: Map<String, Value>,
    /// How the scenario waited for completions: "interrupt" (the ISR, its DPC and KEVENTs) or "poll"; None
    /// before a scenario ran.
    pub completion: Option<&'static str>,
    /// With interrupts, what the path's ISR and DPC did (the Linux guest's `completion_path`, same names).
    pub completion_path: Option<CompletionCounts>,
}

impl RunResult {
    pub fn new(scenario: &'static str) -> RunResult {
        RunResult { scenario, lock: None, error: None, details: Map::new(), completion: None, completion_path: None }
    }

    pub fn detail(&mut self, key: &str, value: impl Into<Value>) {
        self.details.insert(key.to_string(), value.into());
    }

    /// Records the first failure; later ones are consequences and kept in details only.
    pub fn fail(&mut self, why: impl ToString) {
        let why = why.to_string();
        if self.error.is_none() {
            self.error = Some(why);
        } else {
            self.details.insert("later_error".into(), Value::String(why));
        }
    }

    /// The line, without a newline. JSON is made by serde_json, so names and messages are escaped correctly.
    pub fn line(&self) -> String {
        let mut object = Map::new();
        object.insert("ok".into(), Value::Bool(self.error.is_none()));
        object.insert("scenario".into(), Value::String(self.scenario.into()));
        object.insert("platform".into(), Value::String("windows".into()));
        if let Some(lock) = self.lock {
            object.insert("lock".into(), Value::String(lock.into()));
        }
        if let Some(e) = &self.error {
            object.insert("error".into(), Value::String(e.clone()));
        }
        if let Some(mode) = self.completion {
            object.insert("completion".into(), Value::String(mode.into()));
            let path = self.completion_path.map(|c| {
                json!({"isr_calls": c.isr_calls, "dpc_calls": c.dpc_calls, "dpc_requeues": c.dpc_requeues, "cqes": c.cqes})
            });
            object.insert("completion_path".into(), path.unwrap_or(Value::Null));
        }
        object.insert("details".into(), Value::Object(self.details.clone()));
        let mut line = String::from(RESULT_PREFIX);
        line.push_str(&Value::Object(object).to_string());
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runner's own parser (vhca-suite) reads what vhca.sys writes, failures and odd text included.
    #[test]
    fn the_runner_reads_the_line() {
        let mut ok = RunResult::new("smoke");
        ok.detail("map_registers", 32u32);
        ok.lock = Some("kmutex");
        let parsed = vhca_suite::parse_result_line(&ok.line()).unwrap().unwrap();
        assert_eq!(parsed["lock"], "kmutex");
        assert_eq!(parsed["ok"], true);
        assert_eq!(parsed["scenario"], "smoke");
        assert_eq!(parsed["details"]["map_registers"], 32);

        let mut failed = RunResult::new("fast-mutex-create-cq");
        failed.fail("CREATE_CQ refused: \"bad\"\n");
        failed.fail("second");
        let parsed = vhca_suite::parse_result_line(&failed.line()).unwrap().unwrap();
        assert_eq!(parsed["ok"], false);
        assert!(parsed.get("lock").is_none(), "no lock taken, none reported");
        assert_eq!(parsed["error"], "CREATE_CQ refused: \"bad\"\n");
        assert_eq!(parsed["details"]["later_error"], "second");
        assert!(!failed.line().contains('\n'), "one line");
        assert!(parsed.get("completion").is_none(), "no scenario wait yet, no completion mode");
    }

    /// The completion fields have the Linux guest's names and shape, so the runner's reader takes them alike.
    #[test]
    fn the_completion_path_is_reported_as_the_linux_guest_does() {
        let mut polled = RunResult::new("smoke");
        polled.completion = Some("poll");
        let parsed = vhca_suite::parse_result_line(&polled.line()).unwrap().unwrap();
        assert_eq!(parsed["completion"], "poll");
        assert!(parsed["completion_path"].is_null());

        let mut interrupts = RunResult::new("verbs-loopback");
        interrupts.completion = Some("interrupt");
        interrupts.completion_path = Some(CompletionCounts { isr_calls: 9, dpc_calls: 8, dpc_requeues: 1, cqes: 12 });
        let parsed = vhca_suite::parse_result_line(&interrupts.line()).unwrap().unwrap();
        assert_eq!(parsed["completion"], "interrupt");
        let path = &parsed["completion_path"];
        assert_eq!(
            (&path["isr_calls"], &path["dpc_calls"], &path["dpc_requeues"], &path["cqes"]),
            (&9.into(), &8.into(), &1.into(), &12.into())
        );
    }
}
