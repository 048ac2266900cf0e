//! Output: renders progress, the verdict table and failure details as text, and the report as JSON. The only module
//! that decides how things look; everything else returns data.

use std::fmt::Write as _;

use crate::run::Progress;
use crate::suite::{RunReport, SuiteReport};

/// Progress lines for the terminal (stderr); serial lines only when `echo_serial` (interactive boot).
pub fn progress_line(p: &Progress, echo_serial: bool) -> Option<String> {
    match p {
        Progress::Stage { run, what } => Some(format!("[{run}] {what}")),
        Progress::Serial { line, .. } if echo_serial => Some(format!("| {line}")),
        Progress::Serial { .. } => None,
    }
}

pub fn table(report: &SuiteReport) -> String {
    let rows: Vec<[String; 4]> = report
        .runs
        .iter()
        .map(|r| {
            [
                r.outcome.name.clone(),
                r.verdict.kind.label().to_string(),
                format!("{:.2}", r.outcome.seconds),
                r.outcome.accel.name().to_string(),
            ]
        })
        .collect();
    let header = ["run", "verdict", "seconds", "accelerator"];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &[String; 4]| {
        let _ = writeln!(
            out,
            "{:<w0$}  {:<w1$}  {:>w2$}  {:<w3$}",
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3]
        );
    };
    line(&header.map(String::from));
    for row in &rows {
        line(row);
    }
    out
}

pub fn summary(report: &SuiteReport) -> String {
    let passed = report.runs.iter().filter(|r| r.verdict.pass()).count();
    format!(
        "{passed}/{} passed · accelerator {} ({}) · carrier {} · kernel {} ({:?}) · image {}{}\n",
        report.runs.len(),
        report.accel.accel.name(),
        report.accel.how,
        report.carrier.device_name(),
        report.image.kernel_package,
        report.image.kernel_kind,
        report.image.key,
        if report.image.built { " (built now)" } else { "" },
    )
}

/// Why each failed run failed, what its guest, QEMU and device said last, and how to repeat it.
pub fn failures(report: &SuiteReport) -> String {
    let mut out = String::new();
    for r in report.runs.iter().filter(|r| !r.verdict.pass()) {
        failure(&mut out, r);
    }
    out
}

fn failure(out: &mut String, r: &RunReport) {
    let o = &r.outcome;
    let _ = writeln!(out, "--- {} {}", o.name, r.verdict.kind.label());
    for reason in &r.verdict.reasons {
        let _ = writeln!(out, "  - {reason}");
    }
    for (title, lines) in
        [("serial", &o.serial_tail), ("device log", &o.device_log_tail), ("qemu log", &o.qemu_log_tail)]
    {
        if lines.is_empty() {
            continue;
        }
        let _ = writeln!(out, "  {title} (last {} lines):", lines.len());
        for l in lines.iter() {
            let _ = writeln!(out, "    {l}");
        }
    }
    if let Some(dir) = &o.artifacts {
        let _ = writeln!(out, "  artifacts: {}", dir.display());
    }
    let _ = writeln!(out, "  reproduce: {}", o.reproducer);
}

pub fn json(report: &SuiteReport) -> serde_json::Result<String> {
    serde_json::to_string_pretty(report)
}
