//! Resident memory and open fds of a process, read from /proc: what the soak samples of the runner and, while each run
//! is live, of its vhca-device and QEMU. The run records the sample of its children where the soak can take it.

use std::cell::{Cell, RefCell};

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcUsage {
    /// VmRSS, KiB.
    pub rss_kib: u64,
    pub fds: usize,
}

/// `pid` is a number or `self`; None once the process is exiting, a zombie or gone.
pub fn of(pid: &str) -> Option<ProcUsage> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.split_whitespace().next()?.parse().ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count();
    // A live child has at least its stdio; none left means it is exiting (fds closed, memory not yet released).
    (fds > 0).then_some(ProcUsage { rss_kib, fds })
}

/// A run's two children read together; None for one exiting or gone by then.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Pair {
    pub device: Option<ProcUsage>,
    pub qemu: Option<ProcUsage>,
}

impl Pair {
    pub fn read(device_pid: u32, qemu_pid: u32) -> Pair {
        Pair { device: of(&device_pid.to_string()), qemu: of(&qemu_pid.to_string()) }
    }
}

/// Where in a run its children are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// The guest's first console output: both surely live, whatever the run comes to.
    FirstOutput,
    /// Its result or crash line, else (a hang, a killed child) the end of its wait, before either is told to stop.
    /// A guest that powers off at once may leave both exiting by then: those read None.
    End,
}

/// A run's children at both points, and their pids for the check that they are gone after the run.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ChildrenUsage {
    pub device_pid: Option<u32>,
    pub qemu_pid: Option<u32>,
    pub first_output: Pair,
    pub end: Pair,
}

thread_local! {
    /// The last run's readings on this thread: runs execute on their worker's thread from start to end.
    static LAST: RefCell<Option<ChildrenUsage>> = const { RefCell::new(None) };
    static COLLECT: Cell<bool> = const { Cell::new(false) };
}

/// Whether runs on this thread read their children (the soak turns it on; suites leave it off and pay nothing).
pub fn collect(on: bool) {
    COLLECT.with(|c| c.set(on));
}

pub fn collecting() -> bool {
    COLLECT.with(Cell::get)
}

/// Reads the run's two children at `point`; readings of other processes (an earlier run's) are dropped.
pub fn record(point: Point, device_pid: u32, qemu_pid: u32) {
    let pair = Pair::read(device_pid, qemu_pid);
    let pids = (Some(device_pid), Some(qemu_pid));
    LAST.with(|l| {
        let mut last = l.borrow_mut();
        let mut usage = match *last {
            Some(before) if (before.device_pid, before.qemu_pid) == pids => before,
            _ => ChildrenUsage { device_pid: pids.0, qemu_pid: pids.1, ..ChildrenUsage::default() },
        };
        match point {
            Point::FirstOutput => usage.first_output = pair,
            Point::End => usage.end = pair,
        }
        *last = Some(usage);
    });
}

/// The readings of the last run on this thread, if any were taken (a run that never got both children going has none).
pub fn take_last() -> Option<ChildrenUsage> {
    LAST.with(|l| l.borrow_mut().take())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_points_are_kept_for_the_same_run_and_dropped_for_another() {
        let me = std::process::id();
        let _ = take_last();
        record(Point::FirstOutput, me, me);
        record(Point::End, me, me);
        let usage = take_last().expect("recorded");
        assert!(usage.first_output.device.is_some() && usage.end.qemu.is_some(), "{usage:?}");
        // Another pair of pids is another run: its first reading starts afresh.
        record(Point::FirstOutput, me, me);
        record(Point::End, u32::MAX, u32::MAX);
        let usage = take_last().expect("recorded");
        assert_eq!((usage.first_output, usage.end), (Pair::default(), Pair::default()));
    }

    #[test]
    fn reads_this_process_and_nothing_for_a_gone_one() {
        let me = of("self").expect("this process");
        assert!(me.rss_kib > 0 && me.fds >= 3, "{me:?}");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(of(&pid.to_string()), None);
    }
}
