//! The record of a suite run: one `RunReport` per concrete run, totals, the JSON report and the one-line reproducer
//! of every failure. JUnit and the terminal table render from the same records.

use std::path::PathBuf;

use serde::Serialize;

use crate::completion_seen::CompletionSeen;
use crate::expect::Expected;
use crate::fail_points::{FaultPointSeen, InjectedFaultSeen};
use crate::interleavings::{RaceSeen, SchedulePointSeen};
use crate::suite::{split_fail_point, ConcreteRun, Personality, Suite, VerifierMode};
use crate::verdict::{Actual, Outcome, Verdict};

/// How the guest was brought up for a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BootPath {
    Cold,
    Snapshot,
}

impl BootPath {
    pub fn as_str(self) -> &'static str {
        match self {
            BootPath::Cold => "cold",
            BootPath::Snapshot => "snapshot",
        }
    }
}

/// One concrete run's line in every report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunReport {
    /// `<run>/verifier-<mode>`.
    pub name: String,
    pub run: String,
    pub mode: VerifierMode,
    /// The driver personality that ran it.
    pub driver: Personality,
    pub expected: Expected,
    pub actual: Actual,
    /// `actual` as one line, as the table and JUnit show it.
    pub actual_text: String,
    pub outcome: Outcome,
    pub notes: Vec<String>,
    pub seconds: f64,
    /// "kvm" or "tcg": what the run used.
    pub accelerator: String,
    pub path: BootPath,
    pub artifact_dir: Option<PathBuf>,
    pub timeline_svg: Option<PathBuf>,
    /// Set for failed runs by `set_reproducer`.
    pub reproducer: Option<String>,
    /// The low-resources simulation's failure points the run saw (a recording run's list is what expands).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fault_points: Vec<FaultPointSeen>,
    /// The failures it injected, in order, as `!verifier 4` lists them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub injected_faults: Vec<InjectedFaultSeen>,
    /// How the driver waited for completions, and with interrupts how many came and how often its ISR and DPC ran
    /// (`completion_seen`); absent when the guest's result did not say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion: Option<CompletionSeen>,
    /// An expanded interleaving run: the spec `vhca-run boot --interleaving` takes and the run it came from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interleaving: Option<InterleavingOf>,
    /// The contended scheduling points a recording listed (what its `interleavings` plan expands).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub schedule_points: Vec<SchedulePointSeen>,
    /// Every point the recording passed (its PCT runs' horizon); 0 when it said nothing.
    #[serde(skip_serializing_if = "is_zero")]
    pub schedule_points_passed: u64,
    /// The races the guest's detector reported.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub races: Vec<RaceSeen>,
}

/// Where an interleaving run came from and the schedule it ran.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InterleavingOf {
    pub of: String,
    pub spec: String,
    /// A PCT run's horizon (`boot --pct-horizon`), the points its recording passed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pct_horizon: Option<u32>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl RunReport {
    pub fn new(run: &ConcreteRun, verdict: Verdict, seconds: f64, accelerator: &str, path: BootPath) -> RunReport {
        RunReport {
            name: run.name.clone(),
            run: run.run.clone(),
            mode: run.mode,
            driver: run.guest.driver,
            expected: run.expected.clone(),
            actual_text: verdict.actual.to_string(),
            actual: verdict.actual,
            outcome: verdict.outcome,
            notes: verdict.notes,
            seconds,
            accelerator: accelerator.to_string(),
            path,
            artifact_dir: None,
            timeline_svg: None,
            reproducer: None,
            fault_points: Vec::new(),
            injected_faults: Vec::new(),
            completion: None,
            interleaving: match (&run.interleaving.of, &run.interleaving.spec) {
                (Some(of), Some(spec)) => Some(InterleavingOf {
                    of: of.clone(),
                    spec: spec.clone(),
                    pct_horizon: run.interleaving.pct_horizon,
                }),
                _ => None,
            },
            schedule_points: Vec::new(),
            schedule_points_passed: 0,
            races: Vec::new(),
        }
    }

    pub fn passed(&self) -> bool {
        self.outcome.passed()
    }

    /// Gives a failed run its reproducer (see `reproducer`); a passed run keeps none.
    pub fn set_reproducer(&mut self, program: &str, suite_file: Option<&str>) {
        // A vhca.sys run is repeated as one, whether the file or `--driver` made it so.
        let driver = if self.driver == Personality::Sys { " --driver sys" } else { "" };
        self.reproducer = (!self.passed()).then(|| match (&self.interleaving, split_fail_point(&self.name)) {
            (Some(i), _) => interleaving_reproducer(program, suite_file, i) + driver,
            (None, Some((run, k))) => fail_point_reproducer(program, suite_file, run, k) + driver,
            (None, None) => reproducer(program, suite_file, &self.name) + driver,
        });
    }

    pub fn failure_reason(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Pass => None,
            Outcome::Fail { reason } => Some(reason),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Totals {
    pub runs: usize,
    pub passed: usize,
    pub failed: usize,
    /// Sum of the runs' seconds.
    pub run_seconds: f64,
    /// Wall time of the whole suite (less than `run_seconds` when runs go in parallel).
    pub wall_seconds: f64,
}

/// The whole suite's result: what `--json` writes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SuiteReport {
    pub suite: String,
    /// The suite file's path, or the built-in suite's name.
    pub source: String,
    pub runs: Vec<RunReport>,
    pub totals: Totals,
}

impl SuiteReport {
    pub fn new(suite: &Suite, runs: Vec<RunReport>, wall_seconds: f64) -> SuiteReport {
        let passed = runs.iter().filter(|r| r.passed()).count();
        let totals = Totals {
            runs: runs.len(),
            passed,
            failed: runs.len() - passed,
            run_seconds: runs.iter().map(|r| r.seconds).sum(),
            wall_seconds,
        };
        SuiteReport { suite: suite.name.clone(), source: suite.source.clone(), runs, totals }
    }

    pub fn all_passed(&self) -> bool {
        self.totals.failed == 0
    }

    pub fn to_json(&self) -> String {
        // Serialising plain structs of strings, numbers and vectors into a String cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

/// The command that re-runs exactly one concrete run: `PROGRAM suite [FILE] --filter '^<name>$'`, shell-quoted.
/// `suite_file` is `None` for the built-in suite (the runner's default).
pub fn reproducer(program: &str, suite_file: Option<&str>, run_name: &str) -> String {
    let mut words = vec![shell_quote(program), "suite".to_string()];
    if let Some(file) = suite_file {
        words.push(shell_quote(file));
    }
    words.push("--filter".to_string());
    words.push(shell_quote(&format!("^{}$", regex_literal(run_name))));
    words.join(" ")
}

/// The one-line reproducer of a fail-point run: `vhca-run boot --run <run> --fail-point k` boots exactly it.
pub fn fail_point_reproducer(program: &str, suite_file: Option<&str>, run_name: &str, k: u32) -> String {
    let mut words = vec![shell_quote(program), "boot".to_string(), "--run".to_string(), shell_quote(run_name)];
    if let Some(file) = suite_file {
        words.push("--suite".to_string());
        words.push(shell_quote(file));
    }
    words.push("--fail-point".to_string());
    words.push(k.to_string());
    words.join(" ")
}

/// The one-line reproducer of an interleaving run: `vhca-run boot --run <run> --interleaving <spec>`.
pub fn interleaving_reproducer(program: &str, suite_file: Option<&str>, run: &InterleavingOf) -> String {
    let mut words = vec![shell_quote(program), "boot".to_string(), "--run".to_string(), shell_quote(&run.of)];
    if let Some(file) = suite_file {
        words.push("--suite".to_string());
        words.push(shell_quote(file));
    }
    words.push("--interleaving".to_string());
    words.push(shell_quote(&run.spec));
    if let Some(n) = run.pct_horizon {
        words.push(format!("--pct-horizon {n}"));
    }
    words.join(" ")
}

/// `text` as a regex that matches it literally. Unlike `regex::escape`, leaves `-` alone (it only means something
/// inside a class), so the usual run name reads as itself.
fn regex_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn shell_quote(word: &str) -> String {
    shell_words::quote(word).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reproducer_quotes_and_escapes() {
        assert_eq!(
            reproducer("/usr/bin/vhca-run", Some("suites/my suite.toml"), "use-after-unmap/verifier-on"),
            "/usr/bin/vhca-run suite 'suites/my suite.toml' --filter '^use-after-unmap/verifier-on$'"
        );
        assert_eq!(reproducer("vhca-run", None, "a.b/verifier-off"), "vhca-run suite --filter '^a\\.b/verifier-off$'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn a_fail_point_run_reproduces_with_boot() {
        assert_eq!(
            fail_point_reproducer("vhca-run", Some("my suite.toml"), "lr/verifier-on", 4),
            "vhca-run boot --run lr/verifier-on --suite 'my suite.toml' --fail-point 4"
        );
        assert_eq!(
            fail_point_reproducer("vhca-run", None, "lr/verifier-on", 1),
            "vhca-run boot --run lr/verifier-on --fail-point 1"
        );
    }

    #[test]
    fn reproducer_filter_matches_only_its_run() {
        let cmd = reproducer("vhca-run", None, "a.b/verifier-off");
        let pattern = cmd.rsplit(' ').next().unwrap().trim_matches('\'');
        let re = regex::Regex::new(pattern).unwrap();
        assert!(re.is_match("a.b/verifier-off"));
        assert!(!re.is_match("axb/verifier-off"));
        assert!(!re.is_match("a.b/verifier-offx"));
        let odd = "x(1)+[y]^$|*?{2}\\";
        let re = regex::Regex::new(&format!("^{}$", regex_literal(odd))).unwrap();
        assert!(re.is_match(odd));
        assert!(!re.is_match("x1+y"));
    }
}
