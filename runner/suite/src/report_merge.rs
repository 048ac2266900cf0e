//! `vhca-run report merge`: the shards' JSON reports and JUnit files combined into one of each, with one verdict.
//! Works on the documents as written (no re-judging): runs are concatenated shard by shard, totals recomputed.

use quick_xml::events::{BytesStart, Event};
use quick_xml::{Reader, Writer};
use serde_json::{json, Value};

#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    #[error("{source_name}: not a vhca-run JSON report: {why}")]
    NotAReport { source_name: String, why: String },
    #[error("{source_name}: JUnit: {why}")]
    Junit { source_name: String, why: String },
    #[error("run {0:?} is in more than one shard: the shards overlap")]
    Duplicate(String),
    #[error("the reports are of different suites: {0:?} and {1:?}")]
    DifferentSuites(String, String),
    #[error("nothing to merge")]
    Empty,
}

/// The merged JSON report and whether every run in it passed.
#[derive(Debug, Clone)]
pub struct Merged {
    pub json: Value,
    pub all_passed: bool,
    pub runs: usize,
    pub failed: usize,
}

/// Merges JSON reports given as (name for messages, text). Wall time: the longest shard's (they ran side by side).
pub fn merge_json(reports: &[(String, String)]) -> Result<Merged, MergeError> {
    let mut suite: Option<(String, String)> = None;
    let mut runs: Vec<Value> = Vec::new();
    let mut wall = 0.0f64;
    for (name, text) in reports {
        let bad = |why: String| MergeError::NotAReport { source_name: name.clone(), why };
        let v: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let this = v.get("suite").and_then(Value::as_str).ok_or_else(|| bad("no \"suite\"".into()))?.to_string();
        let source = v.get("source").and_then(Value::as_str).unwrap_or("").to_string();
        match &suite {
            Some((s, _)) if *s != this => return Err(MergeError::DifferentSuites(s.clone(), this)),
            Some(_) => {}
            None => suite = Some((this, source)),
        }
        let shard_runs = v.get("runs").and_then(Value::as_array).ok_or_else(|| bad("no \"runs\" list".into()))?;
        for r in shard_runs {
            let run_name = r.get("name").and_then(Value::as_str).ok_or_else(|| bad("a run without a name".into()))?;
            r.get("outcome").and_then(|o| o.get("result")).ok_or_else(|| bad(format!("run {run_name}: no outcome")))?;
            if runs.iter().any(|x| x.get("name").and_then(Value::as_str) == Some(run_name)) {
                return Err(MergeError::Duplicate(run_name.to_string()));
            }
            runs.push(r.clone());
        }
        wall = wall.max(v.pointer("/totals/wall_seconds").and_then(Value::as_f64).unwrap_or(0.0));
    }
    let (suite, source) = suite.ok_or(MergeError::Empty)?;
    let passed = runs.iter().filter(|r| r.pointer("/outcome/result").and_then(Value::as_str) == Some("pass")).count();
    let run_seconds: f64 = runs.iter().filter_map(|r| r.get("seconds").and_then(Value::as_f64)).sum();
    let failed = runs.len() - passed;
    let json = json!({
        "suite": suite,
        "source": source,
        "runs": runs,
        "totals": {
            "runs": runs.len(), "passed": passed, "failed": failed,
            "run_seconds": run_seconds, "wall_seconds": wall,
            "shards": reports.len(),
        },
    });
    Ok(Merged { all_passed: failed == 0, runs: runs.len(), failed, json })
}

/// Merges JUnit documents (vhca-run's: `<testsuites><testsuite>…<testcase>…`): one testsuite holding every shard's
/// testcases, with the counts recomputed. Also returns the number of failed testcases.
pub fn merge_junit(docs: &[(String, String)], suite: &str) -> Result<(String, usize), MergeError> {
    let mut cases: Vec<Vec<u8>> = Vec::new();
    let (mut failures, mut time) = (0usize, 0.0f64);
    for (name, text) in docs {
        let bad = |why: String| MergeError::Junit { source_name: name.clone(), why };
        let mut reader = Reader::from_str(text);
        // The testcase being copied, and how deep inside it the reader is.
        let mut current: Option<Writer<Vec<u8>>> = None;
        let mut depth = 0usize;
        loop {
            let event = reader.read_event().map_err(|e| bad(e.to_string()))?;
            if matches!(event, Event::Eof) {
                break;
            }
            if let Some(w) = current.as_mut() {
                let mut closes = false;
                match &event {
                    Event::Start(e) => {
                        depth += 1;
                        failures += usize::from(e.name().as_ref() == b"failure");
                    }
                    Event::Empty(e) => failures += usize::from(e.name().as_ref() == b"failure"),
                    Event::End(e) if depth == 0 && e.name().as_ref() == b"testcase" => closes = true,
                    Event::End(_) => depth = depth.saturating_sub(1),
                    _ => {}
                }
                w.write_event(event.borrow()).map_err(|e| bad(e.to_string()))?;
                if closes {
                    cases.extend(current.take().map(Writer::into_inner));
                }
                continue;
            }
            match &event {
                Event::Start(e) if e.name().as_ref() == b"testsuite" => time = time.max(attr_f64(e, b"time")),
                Event::Start(e) if e.name().as_ref() == b"testcase" => {
                    let mut w = Writer::new(Vec::new());
                    w.write_event(event.borrow()).map_err(|e| bad(e.to_string()))?;
                    (current, depth) = (Some(w), 0);
                }
                Event::Empty(e) if e.name().as_ref() == b"testcase" => {
                    let mut w = Writer::new(Vec::new());
                    w.write_event(event.borrow()).map_err(|e| bad(e.to_string()))?;
                    cases.push(w.into_inner());
                }
                _ => {}
            }
        }
        if current.is_some() {
            return Err(bad("a testcase is not closed".into()));
        }
    }
    let tests = cases.len();
    let attrs = format!("tests=\"{tests}\" failures=\"{failures}\" errors=\"0\" time=\"{time:.3}\"");
    let mut out = format!("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"vhca-run\" {attrs}>\n");
    out.push_str(&format!(
        "  <testsuite name=\"{}\" {attrs} skipped=\"0\">\n",
        crate::xml_text::xml_safe(suite).replace('"', "&quot;")
    ));
    for case in cases {
        out.push_str("    ");
        out.push_str(&String::from_utf8_lossy(&case));
        out.push('\n');
    }
    out.push_str("  </testsuite>\n</testsuites>\n");
    Ok((out, failures))
}

fn attr_f64(e: &BytesStart<'_>, key: &[u8]) -> f64 {
    e.attributes()
        .flatten()
        .find(|a| a.key.as_ref() == key)
        .and_then(|a| String::from_utf8_lossy(&a.value).parse().ok())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{RunReport, SuiteReport};
    use crate::suite::Suite;
    use crate::verdict::{Actual, Outcome, Verdict};
    use crate::{render_junit, BootPath};

    /// The seed suite's reports, as two shards would write them; `fail` names runs that failed.
    fn shard_reports(fail: &[&str]) -> Vec<(String, String, String)> {
        let suite = Suite::seed().unwrap();
        let runs = suite.expand();
        let half = runs.len() / 2;
        [&runs[..half], &runs[half..]]
            .iter()
            .enumerate()
            .map(|(i, part)| {
                let reports: Vec<RunReport> = part
                    .iter()
                    .map(|r| {
                        let verdict = if fail.contains(&r.name.as_str()) {
                            let reason = "expected pass, got hang".to_string();
                            Verdict { actual: Actual::Pass, outcome: Outcome::Fail { reason }, notes: vec![] }
                        } else {
                            Verdict { actual: Actual::Pass, outcome: Outcome::Pass, notes: vec![] }
                        };
                        RunReport::new(r, verdict, 0.5, "tcg", BootPath::Snapshot)
                    })
                    .collect();
                let report = SuiteReport::new(&suite, reports, 5.0 + i as f64);
                (format!("shard-{}", i + 1), report.to_json(), render_junit(&report))
            })
            .collect()
    }

    fn merge(shards: &[(String, String, String)]) -> (Merged, String, usize) {
        let json: Vec<(String, String)> = shards.iter().map(|(n, j, _)| (n.clone(), j.clone())).collect();
        let junit: Vec<(String, String)> = shards.iter().map(|(n, _, x)| (n.clone(), x.clone())).collect();
        let merged = merge_json(&json).unwrap();
        let (xml, failures) = merge_junit(&junit, "seed").unwrap();
        (merged, xml, failures)
    }

    #[test]
    fn passing_shards_merge_into_one_passing_report_with_every_run() {
        let shards = shard_reports(&[]);
        let (merged, xml, failures) = merge(&shards);
        let n = Suite::seed().unwrap().expand().len();
        assert!(merged.all_passed);
        assert_eq!((merged.runs, merged.failed, failures), (n, 0, 0));
        assert_eq!(merged.json["totals"]["wall_seconds"], 6.0, "the longest shard's wall time");
        assert_eq!(xml.matches("<testcase ").count(), n, "{xml}");
        assert!(xml.contains(&format!("tests=\"{n}\" failures=\"0\"")), "{xml}");
    }

    #[test]
    fn a_failed_run_in_one_shard_fails_the_merge() {
        let runs = Suite::seed().unwrap().expand();
        let last = runs.last().unwrap().name.clone();
        let shards = shard_reports(&[last.as_str()]);
        let (merged, xml, failures) = merge(&shards);
        assert!(!merged.all_passed);
        assert_eq!((merged.failed, failures), (1, 1));
        assert!(xml.contains("<failure"), "{xml}");
        assert!(xml.contains("failures=\"1\""), "{xml}");
    }

    #[test]
    fn overlapping_foreign_or_broken_shards_are_refused() {
        let shards = shard_reports(&[]);
        let twice = vec![(shards[0].0.clone(), shards[0].1.clone()), ("again".into(), shards[0].1.clone())];
        assert!(matches!(merge_json(&twice), Err(MergeError::Duplicate(_))));
        let other = shards[1].1.replace("\"suite\": \"seed\"", "\"suite\": \"other\"");
        let mixed = vec![(shards[0].0.clone(), shards[0].1.clone()), ("other".into(), other)];
        assert!(matches!(merge_json(&mixed), Err(MergeError::DifferentSuites(..))));
        assert!(matches!(merge_json(&[("x".into(), "{}".into())]), Err(MergeError::NotAReport { .. })));
        assert!(matches!(merge_json(&[]), Err(MergeError::Empty)));
        let cut = shards[0].2.split("</testcase>").next().unwrap().to_string();
        assert!(merge_junit(&[("cut".into(), cut)], "seed").is_err());
    }
}
