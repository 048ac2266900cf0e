//! What a person sees while a suite runs: a progress bar on a terminal, plain lines otherwise (CI logs), and the
//! guest's console for an interactive boot. Everything goes to stderr; the result table is stdout's.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use vhca_suite::RunReport;

use crate::run_progress::Progress;
use crate::suite_run::SuiteEvent;

pub struct SuiteUi {
    bar: Option<ProgressBar>,
    total: usize,
    done: usize,
    running: BTreeMap<usize, String>,
    echo_serial: bool,
}

impl SuiteUi {
    /// `echo_serial` shows the guest's console lines (interactive boot); a bar is drawn only on a terminal.
    pub fn new(total: usize, echo_serial: bool) -> SuiteUi {
        let bar = (std::io::stderr().is_terminal() && !echo_serial).then(|| {
            let bar = ProgressBar::new(total as u64);
            let style = ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {wide_msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        SuiteUi { bar, total, done: 0, running: BTreeMap::new(), echo_serial }
    }

    fn say(&self, line: String) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    fn refresh(&self) {
        if let Some(bar) = &self.bar {
            bar.set_position(self.done as u64);
            bar.set_message(self.running.values().cloned().collect::<Vec<_>>().join(", "));
        }
    }

    pub fn handle(&mut self, event: SuiteEvent) {
        match event {
            SuiteEvent::Started { index, name } => {
                if self.bar.is_none() {
                    self.say(format!("[{}/{}] start {name}", index + 1, self.total));
                }
                self.running.insert(index, name);
            }
            SuiteEvent::Progress(Progress::Stage { run, what }) => {
                if self.echo_serial {
                    self.say(format!("[{run}] {what}"));
                }
            }
            SuiteEvent::Progress(Progress::Notice { run, what }) => self.say(format!("[{run}] {what}")),
            SuiteEvent::Progress(Progress::Serial { line, .. }) => {
                if self.echo_serial {
                    self.say(format!("| {line}"));
                }
            }
            SuiteEvent::Finished { report, .. } => {
                self.done += 1;
                self.running.retain(|_, name| *name != report.name);
                self.say(format!("[{}/{}] {}", self.done, self.total, finished_line(&report)));
            }
            SuiteEvent::Expanded { runs, what } => {
                self.total += runs;
                if let Some(bar) = &self.bar {
                    bar.set_length(self.total as u64);
                }
                self.say(what);
            }
        }
        self.refresh();
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// One line per finished run: `ok   NAME: ACTUAL (S s)` or `FAIL NAME: REASON (S s)`.
pub fn finished_line(r: &RunReport) -> String {
    match r.failure_reason() {
        None => {
            format!("ok   {}: {} ({:.1} s, {}, {})", r.name, r.actual_text, r.seconds, r.accelerator, r.path.as_str())
        }
        Some(reason) => {
            format!("FAIL {}: {reason} ({:.1} s, {}, {})", r.name, r.seconds, r.accelerator, r.path.as_str())
        }
    }
}
