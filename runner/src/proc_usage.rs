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

/// A run's two children, sampled together while the run was live.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ChildrenUsage {
    pub device: Option<ProcUsage>,
    pub qemu: Option<ProcUsage>,
    /// Their pids, for the check that they are gone after the run.
    pub device_pid: Option<u32>,
    pub qemu_pid: Option<u32>,
}

impl ChildrenUsage {
    pub fn sample(device_pid: u32, qemu_pid: u32) -> ChildrenUsage {
        ChildrenUsage {
            device: of(&device_pid.to_string()),
            qemu: of(&qemu_pid.to_string()),
            device_pid: Some(device_pid),
            qemu_pid: Some(qemu_pid),
        }
    }
}

thread_local! {
    /// The last run's sample on this thread: runs execute on their worker's thread from start to end.
    static LAST: RefCell<Option<ChildrenUsage>> = const { RefCell::new(None) };
    static COLLECT: Cell<bool> = const { Cell::new(false) };
}

/// Whether runs on this thread sample their children (the soak turns it on; suites leave it off and pay nothing).
pub fn collect(on: bool) {
    COLLECT.with(|c| c.set(on));
}

pub fn collecting() -> bool {
    COLLECT.with(Cell::get)
}

/// Records a sample of the run's children. A later sample of the same two processes keeps, for each, the earlier
/// reading where the later one found the process exiting or gone.
pub fn record(usage: ChildrenUsage) {
    LAST.with(|l| {
        let mut last = l.borrow_mut();
        let merged = match *last {
            Some(before) if (before.device_pid, before.qemu_pid) == (usage.device_pid, usage.qemu_pid) => {
                ChildrenUsage { device: usage.device.or(before.device), qemu: usage.qemu.or(before.qemu), ..usage }
            }
            _ => usage,
        };
        *last = Some(merged);
    });
}

/// The sample of the last run on this thread, if it was taken (a run that never got both children going has none).
pub fn take_last() -> Option<ChildrenUsage> {
    LAST.with(|l| l.borrow_mut().take())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_later_sample_keeps_the_earlier_reading_of_a_process_gone_since() {
        let live = |rss_kib| Some(ProcUsage { rss_kib, fds: 20 });
        let at = |device, qemu| ChildrenUsage { device, qemu, device_pid: Some(1), qemu_pid: Some(2) };
        let _ = take_last();
        record(at(live(100), live(200)));
        record(at(live(110), None));
        assert_eq!(take_last(), Some(at(live(110), live(200))));
        // Another run's processes: nothing carried over.
        record(at(live(100), live(200)));
        record(ChildrenUsage { device_pid: Some(3), ..at(None, None) });
        assert_eq!(take_last().unwrap().qemu, None);
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
