//! Reports written as each run ends, so a runner killed mid-suite (SIGKILL from a CI system) leaves the verdicts of
//! every run that finished: one JSON line per run in `<artifacts>/finished-runs.jsonl`, synced to disk before the
//! next run's verdict, and the same report as `run-report.json` in the run's artifact folder. The suite's
//! report.json and junit.xml are still written once, at the end.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use vhca_suite::RunReport;

pub const FINISHED_RUNS: &str = "finished-runs.jsonl";
pub const RUN_REPORT: &str = "run-report.json";

/// A new suite starts a new record: the previous invocation's lines go.
pub fn begin(root: &Path) {
    let _ = fs::remove_file(root.join(FINISHED_RUNS));
}

/// Appends `report` to the record and writes it next to the run's artifacts. Failures are the report's notes'
/// business, not the run's: they are returned for the caller to log.
pub fn record(root: &Path, report: &RunReport) -> io::Result<()> {
    fs::create_dir_all(root)?;
    // The run's own report first, the line last: a line in FINISHED_RUNS means everything of that run is on disk,
    // even when the runner is killed right after (the next run's guest is already loaded by then).
    if let Some(dir) = &report.artifact_dir {
        fs::write(dir.join(RUN_REPORT), serde_json::to_string_pretty(report).map_err(io::Error::other)?)?;
    }
    let mut line = serde_json::to_string(report).map_err(io::Error::other)?;
    line.push('\n');
    // One write of one whole line with O_APPEND: parallel workers' lines never interleave.
    let mut file = OpenOptions::new().create(true).append(true).open(root.join(FINISHED_RUNS))?;
    file.write_all(line.as_bytes())?;
    file.sync_data()?;
    Ok(())
}
