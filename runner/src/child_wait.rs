//! How a run waits on its children: one poll tick at a time, failing as soon as an interrupt arrives, and a child's
//! exit status in the terms the suite judges (`ProcessExit`).

use std::time::{Duration, Instant};

use vhca_suite::ProcessExit;

use crate::supervise::{SuperviseError, Supervised};

/// How often the wait of a run looks at the console, QMP and both processes: each look is a few reads and two
/// waitpid calls, and every stage of a run's end waits for the next look.
const WATCH_POLL: Duration = Duration::from_millis(2);

/// One `WATCH_POLL`, failing if an interrupt arrived.
pub fn pause() -> Result<(), SuperviseError> {
    if crate::supervise::interrupted() {
        return Err(SuperviseError::Interrupted);
    }
    std::thread::sleep(WATCH_POLL);
    Ok(())
}

/// Waits for a child's exit, looking every `WATCH_POLL`, up to `timeout` (then `Ok(None)`, still running).
pub fn wait_exit(
    child: &mut Supervised,
    timeout: Duration,
) -> Result<Option<std::process::ExitStatus>, SuperviseError> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_status()? {
            return Ok(Some(status));
        }
        if Instant::now() >= end {
            return Ok(None);
        }
        pause()?;
    }
}

fn exit_signal(status: &std::process::ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.signal()
}

pub fn exit_of(status: std::process::ExitStatus) -> ProcessExit {
    ProcessExit::from_status(status.code(), exit_signal(&status))
}
