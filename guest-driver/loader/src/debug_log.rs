//! Every line a driver binary printed through DbgPrintEx, in order, kept so the run can read the driver's result
//! line back (`VHCA-RESULT {json}`): the debug-output family's table, which `nt_thunks`' DbgPrintEx appends to.

use std::sync::Mutex;

/// The marker of a result line, as the runner reads it.
pub const RESULT_MARK: &str = "VHCA-RESULT ";

#[derive(Default)]
pub struct DebugLog {
    lines: Mutex<Vec<String>>,
}

impl DebugLog {
    pub fn push(&self, line: &str) {
        crate::lock(&self.lines).push(line.to_string());
    }

    /// The JSON after the marker of the last result line.
    pub fn last_result(&self) -> Option<String> {
        let lines = crate::lock(&self.lines);
        lines.iter().rev().find_map(|l| l.strip_prefix(RESULT_MARK).map(|j| j.trim().to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_result_line_wins_and_other_lines_are_not_results() {
        let log = DebugLog::default();
        assert_eq!(log.last_result(), None);
        log.push("VHCA-RESULT {\"ok\":false}");
        log.push("VHCA-RESULT {\"ok\":true} ");
        log.push("vhca: unloading");
        assert_eq!(log.last_result().as_deref(), Some("{\"ok\":true}"));
    }
}
