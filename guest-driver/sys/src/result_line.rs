//! The result of a Windows run as the runner reads it: the same `VHCA-RESULT {json}` line the Linux guest prints
//! (`ok`, `scenario`, `lock`, `error`, `details`). vhca.sys prints it with DbgPrintEx and stores it in the registry value
//! `Result` under the service's Parameters key, where the guest's script copies it to the serial console.

use alloc::string::{String, ToString};

use serde_json::{Map, Value};

pub const RESULT_PREFIX: &str = "VHCA-RESULT ";

/// A run's outcome, filled in as the scenario goes.
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    pub scenario: &'static str,
    /// The lock the control path took (`vhca.lock`'s spelling), where the scenario takes one.
    pub lock: Option<&'static str>,
    pub error: Option<String>,
    pub details: Map<String, Value>,
}

impl RunResult {
    pub fn new(scenario: &'static str) -> RunResult {
        RunResult { scenario, lock: None, error: None, details: Map::new() }
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
    }
}
