//! The end of a run's processes: once the wait is over (or the guest never got its request), QEMU and the device are
//! stopped and reaped, QMP and the console read to their last word, and a reused guest's QEMU log cut to this run.

use std::fs;
use std::path::Path;
use std::time::Duration;

use vhca_suite::ProcessExit;

use crate::child_wait::{exit_of, wait_exit};
use crate::supervise::{SuperviseError, Supervised};
use crate::watch::{Remains, Watch, Watched};

/// The device exits when QEMU hangs up; QEMU closes the socket while it is still tearing down.
const DEVICE_AFTER_QEMU: Duration = Duration::from_secs(5);
/// How long the console copy may take to reach the end of a dead QEMU's socket.
const CONSOLE_TAIL: Duration = Duration::from_millis(500);

/// Stops what the wait left running (QEMU killed, the device given a moment to follow), then reads what QEMU and the
/// guest wrote last into the watch: QMP events, then the console once QEMU is gone.
pub fn stop_and_reap(watch: &mut Watch, remains: Remains) -> Result<(), SuperviseError> {
    let Remains { mut device, mut qemu, mut qmp, port, mut serial, mut ending } = remains;
    if watch.watched.qemu_exit == ProcessExit::Running {
        qemu.kill();
        watch.watched.qemu_exit = ProcessExit::KilledByRunner;
    }
    if watch.watched.device_exit == ProcessExit::Running {
        watch.watched.device_exit = match wait_exit(&mut device, DEVICE_AFTER_QEMU)? {
            Some(status) => exit_of(status),
            None => {
                device.kill();
                ProcessExit::KilledByRunner
            }
        };
    }
    ending.push(("both exited", watch.device_started.elapsed().as_secs_f64()));
    watch.write_ending(&ending);
    // A closed QMP socket still holds what QEMU wrote before it exited (GUEST_PANICKED comes just before).
    watch.drain_qmp(qmp.as_mut());
    drop(qmp);
    drop(qemu);
    if let Some(port) = port {
        // QEMU is gone (exited, or killed and reaped): its last console bytes are still in the socket.
        port.close(CONSOLE_TAIL);
    }
    drop(device);
    watch.drain_console(&mut serial);
    Ok(())
}

/// A guest that never got its request (a Windows agent that never said it was ready): nothing to watch, so both are
/// stopped and reaped here, and `why` is the rig's problem.
pub fn stop_unstarted(
    qemu: &mut Supervised,
    device: &mut Supervised,
    watched: &mut Watched,
    why: String,
) -> Result<(), SuperviseError> {
    watched.rig_problems.push(why);
    watched.qemu_exit = match qemu.try_status()? {
        Some(status) => exit_of(status),
        None => {
            qemu.kill();
            ProcessExit::KilledByRunner
        }
    };
    device.kill();
    watched.device_exit = ProcessExit::KilledByRunner;
    Ok(())
}

/// This run's part of a log a guest's QEMU writes for its whole life: from `from` on, into the run's own file.
pub fn copy_log_tail(log: &Path, from: u64, to: &Path) {
    use std::io::{Read, Seek, SeekFrom};
    let mut tail = Vec::new();
    if let Ok(mut file) = fs::File::open(log) {
        if file.seek(SeekFrom::Start(from)).is_ok() {
            let _ = file.read_to_end(&mut tail);
        }
    }
    let _ = fs::write(to, tail);
}
