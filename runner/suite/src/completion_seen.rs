//! How a run's driver waited for completions, from the guest's result line (`completion`, `interrupts`,
//! `completion_path`, `completion_times`): the counts go into the run's report, the times onto its timeline.

use serde::Serialize;
use serde_json::Value;

use crate::observation::Observation;

/// What the guest said of its completions: the mode, the MSI-X messages per vector, the ISR and DPC counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CompletionSeen {
    /// `poll` or `interrupt` (`vhca.completion`), as the guest reported it.
    pub mode: String,
    /// MSI-X messages delivered per enabled vector, vector i at index i; empty when the run polled.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub interrupts: Vec<u64>,
    /// The native driver's interrupt path, when it was connected: ISR runs, DPC runs, DPC re-queues, CQEs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isr_calls: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dpc_calls: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dpc_requeues: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cqes: Option<u64>,
}

impl CompletionSeen {
    /// Messages over every vector.
    pub fn interrupt_total(&self) -> u64 {
        self.interrupts.iter().sum()
    }
}

/// `interrupt: 9 messages, 9 ISR calls, 8 DPC calls (1 re-queued), 12 CQEs`, or `poll`: one line for JUnit.
impl std::fmt::Display for CompletionSeen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.mode)?;
        if !self.interrupts.is_empty() {
            write!(f, ": {} messages", self.interrupt_total())?;
        }
        if let (Some(isr), Some(dpc)) = (self.isr_calls, self.dpc_calls) {
            write!(f, ", {isr} ISR calls, {dpc} DPC calls ({} re-queued)", self.dpc_requeues.unwrap_or(0))?;
        }
        if let Some(cqes) = self.cqes {
            write!(f, ", {cqes} CQEs")?;
        }
        Ok(())
    }
}

/// The guest's completion figures; None when its result names no mode (an older guest, vhca.sys, no result).
/// Guest output is untrusted: a field that does not read is left out, never guessed.
pub fn completion_seen(o: &Observation) -> Option<CompletionSeen> {
    let result = o.guest_result.as_ref()?;
    let mode = result.get("completion")?.as_str()?.to_string();
    let interrupts = result
        .pointer("/interrupts/per_vector")
        .and_then(Value::as_array)
        .map(|v| v.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let path = |key: &str| result.get("completion_path")?.get(key)?.as_u64();
    Some(CompletionSeen {
        mode,
        interrupts,
        isr_calls: path("isr_calls"),
        dpc_calls: path("dpc_calls"),
        dpc_requeues: path("dpc_requeues"),
        cqes: path("cqes"),
    })
}

/// When the driver's ISR and DPC ran, on the device event log's clock (µs since the device started), for the
/// timeline. Empty when the guest reported no times or the runner did not see its result line arrive.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PathMarks {
    pub isr_us: Vec<u64>,
    pub dpc_us: Vec<u64>,
    /// Runs of each the guest counted but did not time (it keeps the first few hundred).
    pub isr_untimed: u64,
    pub dpc_untimed: u64,
}

impl PathMarks {
    pub fn is_empty(&self) -> bool {
        self.isr_us.is_empty() && self.dpc_us.is_empty()
    }
}

/// The guest gives each time as µs before its result line was written (`completion_times`), on its own clock;
/// `result_seen_us` is when the runner read that line, on the device's clock. Each mark is placed that far back
/// from the line's arrival, so every mark is late by the line's way over the serial console (about a poll tick of
/// the runner's watch), the same for all of them; their spacing is the guest's own.
pub fn path_marks(o: &Observation, result_seen_us: Option<u64>) -> PathMarks {
    let (Some(times), Some(seen)) = (o.guest_result.as_ref().and_then(|r| r.get("completion_times")), result_seen_us)
    else {
        return PathMarks::default();
    };
    let back_from = |key: &str| -> Vec<u64> {
        let before = times.get(key).and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
        let mut at: Vec<u64> = before.iter().filter_map(Value::as_u64).map(|b| seen.saturating_sub(b)).collect();
        at.sort_unstable();
        at
    };
    let untimed = |key: &str| times.get(key).and_then(Value::as_u64).unwrap_or(0);
    PathMarks {
        isr_us: back_from("isr_us_before_result"),
        dpc_us: back_from("dpc_us_before_result"),
        isr_untimed: untimed("isr_untimed"),
        dpc_untimed: untimed("dpc_untimed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn observed(result: Value) -> Observation {
        Observation { guest_result: Some(result), ..Observation::default() }
    }

    #[test]
    fn an_interrupt_run_carries_its_mode_vectors_and_path_counts() {
        let o = observed(json!({
            "completion": "interrupt",
            "interrupts": {"table_entries": 2, "per_vector": [7, "junk", 2]},
            "completion_path": {"isr_calls": 9, "dpc_calls": 8, "dpc_requeues": 1, "cqes": 12},
        }));
        let seen = completion_seen(&o).unwrap();
        assert_eq!(seen.mode, "interrupt");
        assert_eq!(seen.interrupts, [7, 2], "what does not read is left out");
        assert_eq!(seen.interrupt_total(), 9);
        assert_eq!(
            (seen.isr_calls, seen.dpc_calls, seen.dpc_requeues, seen.cqes),
            (Some(9), Some(8), Some(1), Some(12))
        );
        assert_eq!(seen.to_string(), "interrupt: 9 messages, 9 ISR calls, 8 DPC calls (1 re-queued), 12 CQEs");
    }

    #[test]
    fn a_polling_run_has_only_its_mode_and_an_older_guest_nothing() {
        let o = observed(json!({"completion": "poll", "interrupts": null, "completion_path": null}));
        let seen = completion_seen(&o).unwrap();
        assert_eq!(serde_json::to_value(&seen).unwrap(), json!({"mode": "poll"}));
        assert_eq!(seen.to_string(), "poll");
        assert_eq!(completion_seen(&observed(json!({"ok": true}))), None);
        assert_eq!(completion_seen(&Observation::default()), None);
    }

    #[test]
    fn marks_are_placed_back_from_the_result_lines_arrival() {
        let o = observed(json!({"completion_times": {
            "isr_us_before_result": [9_000, 4_000, "x"], "dpc_us_before_result": [3_500, 20_000], "isr_untimed": 5
        }}));
        let marks = path_marks(&o, Some(10_000));
        assert_eq!(marks.isr_us, [1_000, 6_000], "in time order");
        assert_eq!(marks.dpc_us, [0, 6_500], "never before the device started");
        assert_eq!((marks.isr_untimed, marks.dpc_untimed), (5, 0));
        assert!(path_marks(&o, None).is_empty(), "without the line's arrival there is nothing to place them from");
        assert!(path_marks(&observed(json!({"ok": true})), Some(10_000)).is_empty());
    }
}
