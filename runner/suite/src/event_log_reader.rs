//! Reads the device's JSON-lines event log (docs/events.md): DMA faults for verdicts, map-register use and commands
//! for the timeline. A line that does not parse is recorded and skipped: a killed device may leave half a line.

use serde::Serialize;

use crate::serial_scan::clip;

/// One parsed event line.
#[derive(Debug, Clone, PartialEq)]
pub struct LogEvent {
    /// 1-based line in the log.
    pub line: usize,
    pub kind: String,
    /// Microseconds since the device started, when the line has it.
    pub t_us: Option<u64>,
    pub fields: serde_json::Value,
}

impl LogEvent {
    pub fn u64_field(&self, name: &str) -> Option<u64> {
        self.fields.get(name)?.as_u64()
    }

    pub fn str_field(&self, name: &str) -> Option<&str> {
        self.fields.get(name)?.as_str()
    }

    /// Map registers in use after this event, if it says.
    pub fn in_use(&self) -> Option<u64> {
        self.u64_field("in_use")
    }

    /// Whether this line is a refused DMA: the transport's `dma_fault`, the HCA's `fault`, any other `*_fault`.
    pub fn is_fault(&self) -> bool {
        self.kind == "fault" || self.kind.ends_with("_fault")
    }
}

/// A refused DMA, as the verdict and the report name it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceFault {
    /// `FaultCause` name (`iommu_unmapped`), or `unknown` when the line has none.
    pub cause: String,
    pub kind: String,
    pub t_us: Option<u64>,
    pub line: usize,
    /// The whole line, clipped, for the failure message.
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LogLineError {
    pub line: usize,
    pub message: String,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EventLog {
    pub events: Vec<LogEvent>,
    pub errors: Vec<LogLineError>,
}

impl EventLog {
    /// Every refused DMA, in log order.
    pub fn faults(&self) -> Vec<DeviceFault> {
        self.events
            .iter()
            .filter(|e| e.is_fault())
            .map(|e| DeviceFault {
                cause: e.str_field("cause").unwrap_or("unknown").to_string(),
                kind: e.kind.clone(),
                t_us: e.t_us,
                line: e.line,
                detail: clip(&e.fields.to_string(), 200),
            })
            .collect()
    }

    /// Size of the map-register pool: the `start` line's `map_registers`, else the largest `in_use + free` seen.
    pub fn map_register_total(&self) -> Option<u64> {
        let from_start = self.events.iter().find(|e| e.kind == "start").and_then(|e| e.u64_field("map_registers"));
        from_start.or_else(|| self.events.iter().filter_map(|e| e.in_use()?.checked_add(e.u64_field("free")?)).max())
    }
}

/// Parses a whole event log. Blank lines are ignored; other lines must be JSON objects with a string `kind`.
pub fn parse_event_log(text: &str) -> EventLog {
    let mut log = EventLog::default();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        let fields: serde_json::Value = match serde_json::from_str(raw) {
            Ok(v) => v,
            Err(e) => {
                log.errors.push(LogLineError { line, message: format!("not JSON ({e}): {}", clip(raw, 80)) });
                continue;
            }
        };
        let Some(kind) = fields.get("kind").and_then(|k| k.as_str()).map(str::to_string) else {
            log.errors.push(LogLineError { line, message: format!("no string \"kind\": {}", clip(raw, 80)) });
            continue;
        };
        let t_us = fields.get("t_us").and_then(|t| t.as_u64());
        log.events.push(LogEvent { line, kind, t_us, fields });
    }
    log
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = r#"{"seq":0,"t_us":0,"kind":"start","schema":1,"pid":7,"socket":"s","map_registers":64,"version":"0"}
{"seq":1,"t_us":120,"kind":"map","owner":"cq","handle":1,"registers":4,"first_iova":4096,"in_use":4,"free":60}
{"seq":2,"t_us":150,"kind":"command","opcode":"CREATE_CQ","tag":1,"status":"OK"}
not json at all
{"seq":3,"t_us":300,"kind":"fault","cause":"iommu_unmapped","dir":"write","purpose":"cqe","iova":8192}
{"seq":4,"t_us":310,"kind":"dma_fault","iova":8192,"cause":"iommu_unmapped","queue":0}
{"seq":5,"t_us":400,"kind":"async_event","event":"dma_fault","handle":0,"cause":"iommu_unmapped","detail":0}
{"seq":6}
{"seq":7,"t_us":500,"kind":"unmap","owner":"cq","handle":1,"registers":4,"in_use":0,"free":64}
{"seq":8,"t_us":5"#;

    #[test]
    fn parses_faults_and_records_bad_lines() {
        let log = parse_event_log(LOG);
        assert_eq!(log.events.len(), 7);
        assert_eq!(log.errors.iter().map(|e| e.line).collect::<Vec<_>>(), [4, 8, 10]);
        let faults = log.faults();
        assert_eq!(faults.len(), 2, "{faults:?}");
        assert_eq!(faults[0].cause, "iommu_unmapped");
        assert_eq!(faults[0].kind, "fault");
        assert_eq!(faults[0].t_us, Some(300));
        assert_eq!(faults[1].kind, "dma_fault");
        assert_eq!(log.map_register_total(), Some(64));
    }

    #[test]
    fn pool_size_without_a_start_line() {
        let log = parse_event_log(r#"{"kind":"map","in_use":3,"free":13}"#);
        assert_eq!(log.map_register_total(), Some(16));
        assert_eq!(parse_event_log("").map_register_total(), None);
    }
}
