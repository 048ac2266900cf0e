//! One process per run under the resident agent. The agent forks each run's process from itself as it waits (the
//! state every restore starts from: vhca.sys loaded, nothing of a run done), so no run sees what an earlier one
//! changed in the program; the agent outlives the run and decides what the machine does next (`after_run`): serve
//! another run on the same guest, or end it as a guest without the agent would.
//!
//! A restored guest that serves several runs keeps its translated code: under TCG a fresh QEMU translates ~31 000
//! blocks per run afresh (docs/bench.md section 6), which is most of a run's time.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

static IN_RUN_PROCESS: AtomicBool = AtomicBool::new(false);

/// True in a run's process forked by the agent: it ends by exiting, and the agent decides the machine's fate.
pub fn in_run_process() -> bool {
    IN_RUN_PROCESS.load(Ordering::Relaxed)
}

/// The write end of the pipe a run's process reports its end on (`end_run`); -1 outside one.
static DONE_FD: AtomicI32 = AtomicI32::new(-1);

/// Which side of the fork this is.
pub enum Forked {
    /// The run's process: it serves the run and ends with `end_run`.
    Run,
    /// The agent, with the run's process going on.
    Agent(RunChild),
}

/// How a run's process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnding {
    Exited(i32),
    Signaled(i32),
}

/// The agent's handle on a run's process.
pub struct RunChild {
    pid: libc::pid_t,
    done: std::fs::File,
}

/// Forks the run's process. The agent gets a handle to wait for the run's end and then to let the process go.
pub fn fork_run() -> std::io::Result<Forked> {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into the valid two-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Anything buffered would be printed twice, once by each process.
    let _ = std::io::stdout().flush();
    // SAFETY: fork(2) has no memory-safety preconditions of its own. The child only has the calling thread: it must
    // not wait on anything another thread of the agent holds. The agent's one other thread (sys_driver's idle
    // IOMMU watcher) holds no lock while it waits for its job, and the child drops its handle to it
    // (`sys_driver::forget_idle_watcher`) and starts its own when it needs one.
    match unsafe { libc::fork() } {
        -1 => {
            let e = std::io::Error::last_os_error();
            // SAFETY: both descriptors were just made by pipe2 and are owned here only.
            unsafe { (libc::close(fds[0]), libc::close(fds[1])) };
            Err(e)
        }
        0 => {
            // SAFETY: the read end is this process's copy, used by nobody here.
            unsafe { libc::close(fds[0]) };
            IN_RUN_PROCESS.store(true, Ordering::Relaxed);
            DONE_FD.store(fds[1], Ordering::Relaxed);
            Ok(Forked::Run)
        }
        pid => {
            // SAFETY: the write end is the child's; this process's copy is used by nobody here.
            unsafe { libc::close(fds[1]) };
            // SAFETY: the read end was just made by pipe2 and nothing else owns it: the File takes it over.
            let done = unsafe { std::fs::File::from_raw_fd(fds[0]) };
            Ok(Forked::Agent(RunChild { pid, done }))
        }
    }
}

/// Ends a run's process: tells the agent the run is over and how (`code`: 0 passed, 1 failed), then waits to be
/// let go (`RunChild::let_go`). The process keeps its VFIO descriptors open until then, so the agent can start
/// the HCA's removal first: see `RunChild::let_go`. Without an agent to tell, it exits.
pub fn end_run(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let fd = DONE_FD.load(Ordering::Relaxed);
    let byte = [u8::try_from(code).unwrap_or(u8::MAX)];
    // SAFETY: `fd` is this process's write end of the agent's pipe (or -1: write fails with EBADF); the buffer is a
    // valid one-byte array.
    if fd >= 0 && unsafe { libc::write(fd, byte.as_ptr().cast(), 1) } == 1 {
        loop {
            // SAFETY: pause has no preconditions; the agent ends this process with SIGKILL.
            unsafe { libc::pause() };
        }
    }
    std::process::exit(code)
}

impl RunChild {
    /// Waits until the run's process says it is over (Some(code)), or ends without saying so (None).
    pub fn wait_done(&mut self) -> Option<i32> {
        use std::io::Read;
        let mut byte = [0u8; 1];
        loop {
            match self.done.read(&mut byte) {
                Ok(1) => return Some(i32::from(byte[0])),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                _ => return None,
            }
        }
    }

    /// Ends the run's process (it waits in `end_run`, or is already gone) and reaps it.
    pub fn let_go(self) -> std::io::Result<RunEnding> {
        // SAFETY: kill on our own unreaped child's pid, which cannot have been reused before the wait below.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        wait(self.pid)
    }
}

fn wait(pid: libc::pid_t) -> std::io::Result<RunEnding> {
    let mut status = 0;
    loop {
        // SAFETY: waitpid writes the status into the valid, exclusively borrowed `status`.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(if libc::WIFSIGNALED(status) {
        RunEnding::Signaled(libc::WTERMSIG(status))
    } else {
        RunEnding::Exited(libc::WEXITSTATUS(status))
    })
}

/// What a run left behind, as the agent found it once the run's process was gone.
pub struct Leftovers {
    pub ending: RunEnding,
    /// IOMMU fault lines the kernel logged from the run's request on.
    pub faults: usize,
    /// How many of `slots` were emptied, or why they could not be.
    pub ejected: Result<usize, String>,
}

/// How long the agent waits for the HCA's removal to hold the device (vfio-pci then waits for the run's process to
/// let go of it) before it ends the run's process anyway.
const REMOVAL_HOLDS: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits for the run's end, ejects what it left in `slots` (the hot-plug slots empty before the run) and ends the
/// run's process. The removal is started while the process still holds the HCA's VFIO descriptors: vfio-pci's
/// remove then holds the device's lock while it waits for them, so their close skips the secondary-bus reset that
/// vfio-pci tries at every last close of a device with no function reset (`reset_method` is none here). That reset
/// sleeps a second on this guest kernel (Linux 6.1's `pci_reset_secondary_bus`): a run's process that exited first
/// took 2.1-2.2 s to end, against 0.1 s for the run. The device is ejected right after either way.
pub fn finish_run(
    mut child: RunChild,
    slots: &Result<Vec<crate::hotplug_slot::Slot>, String>,
    log: &mut crate::kmsg::KmsgFollower,
) -> Leftovers {
    let reported = child.wait_done();
    let mut lines = log.new_iommu_lines();
    let ejector = slots.clone().map(|slots| std::thread::spawn(move || crate::hotplug_slot::eject_occupied(&slots)));
    if let Ok(ejector) = &ejector {
        let deadline = std::time::Instant::now() + REMOVAL_HOLDS;
        while !ejector.is_finished() && std::time::Instant::now() < deadline {
            let new = log.new_iommu_lines();
            let holding = new.iter().any(|l| l.contains("blocked until released"));
            lines.extend(new);
            if holding {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    let ended = child.let_go();
    let ejected = match ejector {
        Ok(ejector) => match ejector.join() {
            Ok(result) => result.map_err(|e| e.to_string()),
            Err(_) => Err("the eject thread panicked".to_string()),
        },
        Err(e) => Err(e),
    };
    lines.extend(log.new_iommu_lines());
    let ending = match (reported, ended) {
        (Some(code), _) => RunEnding::Exited(code),
        (None, Ok(ending)) => ending,
        (None, Err(_)) => RunEnding::Exited(i32::from(u8::MAX)),
    };
    Leftovers { ending, faults: crate::kmsg::count_faults(&lines, None), ejected }
}

/// What the agent does after a run's process ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// The guest is as the run found it: announce readiness and take the next request.
    Serve,
    /// End the machine as a guest without the agent would have at the end of this run (power-off, or the shell that
    /// `vhca.poweroff=0` asks for), saying why it cannot serve again.
    End { why: String },
    /// The run's process died of a signal: as PID 1 it would have taken the kernel down ("Attempted to kill
    /// init"), so the agent exits with this status and does the same.
    Die { status: i32, why: String },
}

/// Decides from how the run ended whether its guest may serve another run. Only a guest whose kernel is as a fresh
/// restore's, for everything a run can observe, serves again:
/// - the run's process exited by itself (0: passed, 1: failed or bugchecked; its result line is out);
/// - the run asked for the machine to power off at its end (`vhca.poweroff=0` keeps it for a person);
/// - the kernel logged no IOMMU fault during the run: the kernel rate-limits those lines (10 per 5 s per call site),
///   so a guest that logged some could log fewer for the next run than a fresh one;
/// - every hot-plug slot the runs use is empty again (the HCA ejected).
///
/// `ejected`: how many slots were emptied, or why they could not be.
pub fn after_run(ending: RunEnding, poweroff: bool, faults_logged: usize, ejected: Result<usize, String>) -> Next {
    match ending {
        RunEnding::Signaled(signal) => {
            return Next::Die { status: 128 + signal, why: format!("the run's process was killed by signal {signal}") }
        }
        RunEnding::Exited(code) if code > 1 => {
            return Next::End { why: format!("the run's process exited with status {code}") };
        }
        RunEnding::Exited(_) => {}
    }
    if !poweroff {
        return Next::End { why: "vhca.poweroff=0: the guest stays up".into() };
    }
    if faults_logged > 0 {
        return Next::End { why: format!("{faults_logged} IOMMU fault line(s) logged during the run") };
    }
    match ejected {
        Ok(_) => Next::Serve,
        Err(e) => Next::End { why: format!("the HCA could not be given back: {e}") },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_clean_guest_serves_again() {
        assert_eq!(after_run(RunEnding::Exited(0), true, 0, Ok(1)), Next::Serve);
        // A failed or bugchecked run leaves the kernel as it found it.
        assert_eq!(after_run(RunEnding::Exited(1), true, 0, Ok(1)), Next::Serve);
        assert!(matches!(after_run(RunEnding::Exited(0), true, 2, Ok(1)), Next::End { .. }));
        assert!(matches!(after_run(RunEnding::Exited(1), false, 0, Ok(1)), Next::End { .. }));
        assert!(matches!(after_run(RunEnding::Exited(3), true, 0, Ok(1)), Next::End { .. }));
        let stuck = crate::hotplug_slot::SlotError::StillThere { slot: "0".into(), address: "0000:01:00".into() };
        match after_run(RunEnding::Exited(0), true, 0, Err(stuck.to_string())) {
            Next::End { why } => assert!(why.contains("given back") && why.contains("slot 0"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            after_run(RunEnding::Signaled(11), true, 0, Ok(1)),
            Next::Die { status: 139, why: "the run's process was killed by signal 11".into() }
        );
    }

    #[test]
    fn the_run_process_reports_its_end_and_waits_to_be_let_go() {
        match fork_run().unwrap() {
            Forked::Run => {
                // Only async-signal-safe calls in the forked test process: the report, then pause until killed.
                let byte = [1u8];
                let fd = DONE_FD.load(Ordering::Relaxed);
                // SAFETY: `fd` is the pipe's write end in this process; the buffer is one valid byte.
                unsafe { libc::write(fd, byte.as_ptr().cast(), 1) };
                loop {
                    // SAFETY: pause has no preconditions; the test kills this process.
                    unsafe { libc::pause() };
                }
            }
            Forked::Agent(mut child) => {
                assert_eq!(child.wait_done(), Some(1));
                assert_eq!(child.let_go().unwrap(), RunEnding::Signaled(libc::SIGKILL));
            }
        }
        assert!(!in_run_process());
    }

    #[test]
    fn a_run_process_that_dies_says_nothing() {
        match fork_run().unwrap() {
            // SAFETY: _exit ends the forked test process at once, without running the test harness's handlers.
            Forked::Run => unsafe { libc::_exit(7) },
            Forked::Agent(mut child) => {
                assert_eq!(child.wait_done(), None);
                assert_eq!(child.let_go().unwrap(), RunEnding::Exited(7));
            }
        }
    }
}
