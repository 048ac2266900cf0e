//! The exhaustive low-resources mode's logic: the failure points a recording run found, the failures a run
//! injected (both from the guest's result, as `!verifier 4` would list them), and the check that a fail-point run
//! failed exactly the point it was given, where the recording saw it.

use serde::Serialize;
use serde_json::Value;

use crate::observation::Observation;
use crate::suite::ConcreteRun;
use crate::verdict::{Outcome, Verdict};

/// A failure point as the guest reported it: a call site and the routine called there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FaultPointSeen {
    pub point: u32,
    pub routine: String,
    pub site: String,
}

/// One failure the simulation injected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InjectedFaultSeen {
    pub sequence: u32,
    pub point: u32,
    pub routine: String,
    /// `NULL` or the status, e.g. `0xC000009A`.
    pub result: String,
    pub site: String,
}

impl std::fmt::Display for InjectedFaultSeen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{} point {}: {} -> {} at {}", self.sequence, self.point, self.routine, self.result, self.site)
    }
}

fn details<'a>(o: &'a Observation, key: &str) -> &'a [Value] {
    o.guest_result
        .as_ref()
        .and_then(|r| r.get("details"))
        .and_then(|d| d.get(key))
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn text(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_string)
}

fn number(v: &Value, key: &str) -> Option<u32> {
    v.get(key).and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok())
}

/// The failure points the guest listed, in order; entries that do not read are skipped (guest output is untrusted).
pub fn fault_points(o: &Observation) -> Vec<FaultPointSeen> {
    details(o, "fault_points")
        .iter()
        .filter_map(|p| {
            Some(FaultPointSeen { point: number(p, "point")?, routine: text(p, "routine")?, site: text(p, "site")? })
        })
        .collect()
}

/// The failures the guest injected, in order.
pub fn injected_faults(o: &Observation) -> Vec<InjectedFaultSeen> {
    details(o, "injected_faults")
        .iter()
        .filter_map(|f| {
            Some(InjectedFaultSeen {
                sequence: number(f, "sequence")?,
                point: number(f, "point")?,
                routine: text(f, "routine")?,
                result: text(f, "result")?,
                site: text(f, "site")?,
            })
        })
        .collect()
}

/// The fail-point runs a recording run expands to, one per point it found, each knowing what the recording saw.
pub fn expand_recording(run: &ConcreteRun, points: &[FaultPointSeen]) -> Vec<ConcreteRun> {
    if !run.records_fail_points {
        return Vec::new();
    }
    points.iter().map(|p| ConcreteRun { recorded_point: Some(p.clone()), ..run.at_fail_point(p.point) }).collect()
}

/// Adds to a fail-point run's verdict what the point was, and fails the run when the guest did not fail exactly
/// that point once at the site the recording saw (the error path under test was not the one named). The run's
/// `recorded_point` is the recording's point k, when known (a `boot --fail-point` reproducer has none at hand).
pub fn judge_fail_point(run: &ConcreteRun, o: &Observation, verdict: &mut Verdict) {
    let Some(k) = run.fail_point else { return };
    let recorded = run.recorded_point.as_ref();
    let injected = injected_faults(o);
    for fault in &injected {
        verdict.notes.push(format!("injected {fault}"));
    }
    let problem = match (injected.as_slice(), recorded) {
        // A run stopped before reaching point k (e.g. by an earlier bugcheck) already fails on its own verdict.
        ([], _) if !verdict.outcome.passed() => None,
        ([], _) => Some(format!("failure point {k} was never reached: no failure was injected")),
        ([one], Some(r)) if one.point != k || one.site != r.site || one.routine != r.routine => Some(format!(
            "failure point {k} did not reproduce: the recording saw {} at {}, this run failed {one}",
            r.routine, r.site
        )),
        ([one], _) if one.point != k => Some(format!("asked to fail point {k}, the guest failed {one}")),
        ([_], _) => None,
        (many, _) => Some(format!("{} failures injected; fail point {k} allows one", many.len())),
    };
    if let Some(reason) = problem {
        verdict.outcome = match &verdict.outcome {
            Outcome::Fail { reason: first } => Outcome::Fail { reason: format!("{first}; {reason}") },
            _ => Outcome::Fail { reason },
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suite::Suite;
    use crate::verdict::judge_run;

    fn recording() -> ConcreteRun {
        let text = "name = \"t\"\n[[run]]\nname = \"lr\"\nmodes = [\"on\"]\nverifier_flags = \"0x400AA\"\n\
                    each_fail_point = true\nexpect = \"pass\"\n";
        Suite::parse(text, "t.toml").unwrap().expand().remove(0)
    }

    fn observed(points: Value, injected: Value) -> Observation {
        let result = serde_json::json!({"ok": true, "details": {"fault_points": points, "injected_faults": injected}});
        Observation { guest_result: Some(result), ..Observation::default() }
    }

    fn point(k: u32, site: &str) -> Value {
        serde_json::json!({"point": k, "routine": "IoAllocateMdl", "site": site})
    }

    fn fault(k: u32, site: &str) -> Value {
        serde_json::json!({"sequence": 1, "point": k, "routine": "IoAllocateMdl", "result": "NULL", "site": site})
    }

    #[test]
    fn a_recording_expands_to_one_run_per_point_and_ignores_junk() {
        let o = observed(serde_json::json!([point(1, "a.rs:1:1"), {"point": "x"}, point(2, "b.rs:2:2")]), Value::Null);
        let runs = expand_recording(&recording(), &fault_points(&o));
        let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["lr/verifier-on/fail-point-1", "lr/verifier-on/fail-point-2"]);
        assert_eq!(runs[1].recorded_point.as_ref().map(|p| p.site.as_str()), Some("b.rs:2:2"));
        assert!(expand_recording(&runs[0], &fault_points(&o)).is_empty(), "a fail-point run expands to nothing");
    }

    #[test]
    fn a_fail_point_run_must_fail_exactly_its_point_where_the_recording_saw_it() {
        let recorded = FaultPointSeen { point: 2, routine: "IoAllocateMdl".into(), site: "b.rs:2:2".into() };
        let run = ConcreteRun { recorded_point: Some(recorded), ..recording().at_fail_point(2) };
        let judged = |injected: Value| {
            let o = observed(Value::Null, injected);
            let mut v = judge_run(&run, &o);
            judge_fail_point(&run, &o, &mut v);
            v
        };
        let good = judged(serde_json::json!([fault(2, "b.rs:2:2")]));
        assert!(good.outcome.passed(), "{good:?}");
        assert!(good.notes[0].contains("IoAllocateMdl -> NULL at b.rs:2:2"));
        for bad in [
            serde_json::json!([]),
            serde_json::json!([fault(2, "c.rs:9:9")]),
            serde_json::json!([fault(1, "b.rs:2:2")]),
            serde_json::json!([fault(2, "b.rs:2:2"), fault(2, "b.rs:2:2")]),
        ] {
            assert!(!judged(bad.clone()).outcome.passed(), "{bad}");
        }
    }
}
