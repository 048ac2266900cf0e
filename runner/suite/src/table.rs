//! The terminal result table: run, mode, verdict, seconds, accelerator; then totals and the failures' reproducers.
//! Plain text without colour; the UI may colour it.

use crate::report::SuiteReport;
use crate::suite::Personality;

/// The widest the verdict column is padded to.
const VERDICT_COLUMN_MAX: usize = 72;

/// Renders the table, a totals line, and one `reproduce:` line per failed run that has a reproducer.
pub fn render_table(report: &SuiteReport) -> String {
    let header = ["RUN", "MODE", "VERDICT", "SECONDS", "ACCEL"].map(str::to_string);
    let rows: Vec<[String; 5]> = report
        .runs
        .iter()
        .map(|r| {
            let verdict = match r.failure_reason() {
                None => format!("ok   {}", r.actual_text),
                Some(reason) => format!("FAIL {reason}"),
            };
            // A vhca.sys run says so next to its name; native runs read as they always did.
            let run = match r.driver {
                Personality::Native => r.run.clone(),
                Personality::Sys => format!("{} [sys]", r.run),
            };
            [run, r.mode.to_string(), verdict, format!("{:.2}", r.seconds), r.accelerator.clone()]
        })
        .collect();
    let mut widths = header.clone().map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    // One long verdict (a guest's explanation runs to 170 characters) must not push every other row's seconds off
    // the screen: longer verdicts run past the column on their own line only.
    widths[2] = widths[2].min(VERDICT_COLUMN_MAX);
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (i, (cell, width)) in row.iter().zip(widths).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            // Seconds align right, like numbers do.
            if i == 3 {
                line.push_str(&format!("{cell:>width$}"));
            } else {
                line.push_str(&format!("{cell:<width$}"));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    let t = &report.totals;
    out.push_str(&format!(
        "{} runs: {} passed, {} failed; {:.2} s of runs in {:.2} s wall\n",
        t.runs, t.passed, t.failed, t.run_seconds, t.wall_seconds
    ));
    if let Some(line) = completion_line(report) {
        out.push_str(&line);
    }
    for r in report.runs.iter().filter(|r| !r.passed()) {
        if let Some(cmd) = &r.reproducer {
            out.push_str(&format!("reproduce {}: {cmd}\n", r.name));
        }
    }
    out
}

/// `completion: 20 runs by interrupt (310 messages, 290 ISR calls, 288 DPC calls), 2 polled`, when any run said.
fn completion_line(report: &SuiteReport) -> Option<String> {
    let seen: Vec<_> = report.runs.iter().filter_map(|r| r.completion.as_ref()).collect();
    if seen.is_empty() {
        return None;
    }
    let by_interrupt: Vec<_> = seen.iter().filter(|c| c.mode == "interrupt").collect();
    let sum = |f: fn(&crate::CompletionSeen) -> Option<u64>| by_interrupt.iter().filter_map(|c| f(c)).sum::<u64>();
    let messages: u64 = by_interrupt.iter().map(|c| c.interrupt_total()).sum();
    Some(format!(
        "completion: {} runs by interrupt ({messages} messages, {} ISR calls, {} DPC calls), {} polled\n",
        by_interrupt.len(),
        sum(|c| c.isr_calls),
        sum(|c| c.dpc_calls),
        seen.len() - by_interrupt.len()
    ))
}
