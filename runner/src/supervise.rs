//! Process supervision: every child (device, QEMU, image build) runs in its own process group and is killed and reaped
//! when its guard drops, so timeouts, errors, panics and Ctrl-C all leave nothing behind.

use std::fs::File;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// How often waiting loops look at their children, the clock and the interrupt flag.
pub const POLL: Duration = Duration::from_millis(20);

#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    #[error("cannot start {name} ({program}): {source}")]
    Spawn { name: String, program: String, source: io::Error },
    #[error("cannot open log file {path}: {source}")]
    Log { path: String, source: io::Error },
    #[error("waiting for {name}: {source}")]
    Wait { name: String, source: io::Error },
    #[error("interrupted (SIGINT/SIGTERM/SIGHUP)")]
    Interrupted,
    #[error("{name} did not finish within {secs:.1} s")]
    Timeout { name: String, secs: f64 },
}

fn interrupt_flag() -> &'static Arc<AtomicBool> {
    static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();
    FLAG.get_or_init(|| Arc::new(AtomicBool::new(false)))
}

/// Makes SIGINT/SIGTERM/SIGHUP set a flag that every waiting loop checks, so the run unwinds through its guards (children
/// killed, temp dirs removed). A second signal exits at once; the children then die with us through PDEATHSIG.
pub fn install_interrupt_handler() -> io::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let flag = interrupt_flag().clone();
    // SIGHUP too: closing the terminal a suite runs in must clean up like Ctrl-C does.
    for sig in [SIGINT, SIGTERM, SIGHUP] {
        signal_hook::flag::register_conditional_shutdown(sig, 130, flag.clone())?;
        signal_hook::flag::register(sig, flag.clone())?;
    }
    // A panic in one worker raises the same flag, so the other workers unwind too (children killed, work dirs
    // removed) instead of finishing their runs while the panic waits for them.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        interrupt_flag().store(true, Ordering::SeqCst);
        default_hook(info);
    }));
    Ok(())
}

pub fn interrupted() -> bool {
    interrupt_flag().load(Ordering::SeqCst)
}

/// Sleeps one poll period, failing if an interrupt arrived.
pub fn tick() -> Result<(), SuperviseError> {
    if interrupted() {
        return Err(SuperviseError::Interrupted);
    }
    thread::sleep(POLL);
    Ok(())
}

/// A child process that lives exactly as long as this guard: dropping it kills the child's whole process group with
/// SIGKILL and reaps the child.
#[derive(Debug)]
pub struct Supervised {
    name: String,
    child: std::process::Child,
    status: Option<ExitStatus>,
}

impl Supervised {
    /// Starts `cmd` in a new process group. `log`, when given, receives stdout and stderr; otherwise they are
    /// inherited (interactive use).
    pub fn spawn(name: &str, mut cmd: Command, log: Option<&Path>) -> Result<Supervised, SuperviseError> {
        if let Some(path) = log {
            let file = File::create(path)
                .map_err(|source| SuperviseError::Log { path: path.display().to_string(), source })?;
            let err =
                file.try_clone().map_err(|source| SuperviseError::Log { path: path.display().to_string(), source })?;
            cmd.stdout(Stdio::from(file)).stderr(Stdio::from(err));
        }
        cmd.stdin(Stdio::null());
        cmd.process_group(0);
        // SAFETY: the closure runs in the forked child before exec and only calls prctl and getppid, which are
        // async-signal-safe and touch no memory of the parent. PDEATHSIG makes the kernel kill the child if the
        // runner dies without unwinding (SIGKILL, second Ctrl-C), the one case the drop guard cannot cover. A runner
        // that died between the fork and the prctl sends no signal any more: the child then sees another parent and
        // does not exec (a snapshot build's QEMU outlived a runner SIGKILLed as it spawned it, in a CI run's fault
        // test).
        let runner = std::process::id();
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if u32::try_from(libc::getppid()).ok() != Some(runner) {
                    return Err(io::Error::other("the runner died before its child could exec"));
                }
                Ok(())
            });
        }
        let program = cmd.get_program().to_string_lossy().into_owned();
        let child = cmd.spawn().map_err(|source| SuperviseError::Spawn { name: name.to_string(), program, source })?;
        Ok(Supervised { name: name.to_string(), child, status: None })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if the child has exited (reaped once, remembered after).
    pub fn try_status(&mut self) -> Result<Option<ExitStatus>, SuperviseError> {
        if self.status.is_none() {
            self.status =
                self.child.try_wait().map_err(|source| SuperviseError::Wait { name: self.name.clone(), source })?;
        }
        Ok(self.status)
    }

    /// Waits until the child exits or `timeout` passes (then `Ok(None)`, the child still running).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>, SuperviseError> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status()? {
                return Ok(Some(status));
            }
            if Instant::now() >= end {
                return Ok(None);
            }
            tick()?;
        }
    }

    /// Asks the child (not its group) to end with SIGTERM; it is reaped by `try_status`, `wait_timeout` or `kill`.
    pub fn terminate(&self) {
        if self.status.is_some() {
            return;
        }
        let Ok(pid) = libc::pid_t::try_from(self.child.id()) else { return };
        // SAFETY: kill(2) signals our own unreaped child (its pid cannot have been reused while it is unreaped); it
        // touches no memory.
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }

    /// Kills the process group and reaps the child; returns its status.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        self.kill_group();
        if self.status.is_none() {
            self.status = self.child.wait().ok();
        }
        self.status
    }

    fn kill_group(&self) {
        let Ok(pgid) = libc::pid_t::try_from(self.child.id()) else { return };
        // SAFETY: kill(2) with a negative pid signals the process group we created for this child at spawn
        // (process_group(0) makes its pgid equal to its pid); it touches no memory.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        // Even a child that exited may have left grandchildren in its group: always signal the group.
        self.kill();
    }
}

/// True if a process with this pid exists and has not been reaped (zombies count as gone).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state letter follows the parenthesised command name, which may itself contain spaces.
        Ok(stat) => stat.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')).unwrap_or(false),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sleeper(dir: &Path) -> Supervised {
        let mut cmd = Command::new("sh");
        // The shell forks a grandchild `sleep` into the same group: the guard must take it down too.
        cmd.arg("-c").arg("sleep 300 & echo $! > grandchild.pid; wait").current_dir(dir);
        Supervised::spawn("sleeper", cmd, Some(&dir.join("sleeper.log"))).expect("spawn sh")
    }

    fn grandchild_pid(dir: &Path) -> u32 {
        let path = dir.join("grandchild.pid");
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            if let Ok(s) = std::fs::read_to_string(&path) {
                if let Ok(pid) = s.trim().parse() {
                    return pid;
                }
            }
            assert!(Instant::now() < end, "grandchild never wrote its pid");
            thread::sleep(POLL);
        }
    }

    #[test]
    fn drop_kills_and_reaps_the_group_and_the_temp_dir_goes() {
        let dir = tempfile::tempdir().unwrap();
        let dir_path = dir.path().to_path_buf();
        let child = sleeper(dir.path());
        let pid = child.pid();
        let grandchild = grandchild_pid(dir.path());
        assert!(process_alive(pid) && process_alive(grandchild));
        drop(child);
        drop(dir);
        assert!(!process_alive(pid), "child {pid} survived its guard");
        let end = Instant::now() + Duration::from_secs(2);
        // The grandchild is reparented and reaped by init (or the subreaper): give that a moment.
        while process_alive(grandchild) && Instant::now() < end {
            thread::sleep(POLL);
        }
        assert!(!process_alive(grandchild), "grandchild {grandchild} survived the group kill");
        assert!(!dir_path.exists(), "temp dir left behind");
    }

    #[test]
    fn timeout_leaves_child_running_then_kill_reaps_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = sleeper(dir.path());
        let waited = child.wait_timeout(Duration::from_millis(200)).unwrap();
        assert!(waited.is_none(), "sleep 300 cannot have exited");
        let status = child.kill().expect("status after kill");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert!(!process_alive(child.pid()));
    }

    #[test]
    fn exit_status_of_a_finished_child_is_reported() {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg("exit 3");
        let mut child = Supervised::spawn("exit3", cmd, None).unwrap();
        let status = child.wait_timeout(Duration::from_secs(10)).unwrap().expect("sh exits");
        assert_eq!(status.code(), Some(3));
    }
}
