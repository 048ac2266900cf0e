//! Resident memory and open fds of a process, read from /proc: what the soak samples of the runner and, while each run
//! is live, of its vhca-device and QEMU. The run records the sample of its children where the soak can take it.

use std::cell::RefCell;

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
}

pub fn record(usage: ChildrenUsage) {
    LAST.with(|l| *l.borrow_mut() = Some(usage));
}

/// The sample of the last run on this thread, if it was taken (a run that never got both children going has none).
pub fn take_last() -> Option<ChildrenUsage> {
    LAST.with(|l| l.borrow_mut().take())
}

#[cfg(test)]
mod tests {
    use super::*;

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
