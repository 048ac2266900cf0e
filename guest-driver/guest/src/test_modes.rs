//! The runner's own test modes (`vhca.init=`): a guest that never answers, one whose kernel panics, one that powers
//! off without a result. They prove the runner's hang, panic and power-off verdicts can fire.

use std::time::Duration;

use crate::cmdline::Options;
use crate::report::progress;
use crate::shutdown;

/// The runner's own tests: a guest that never answers, one whose kernel panics, one that powers off without a result.
/// Only `panic` returns, if the kernel refused to crash; the run then reports that.
pub fn run(mode: &str, options: &Options) {
    match mode {
        "hang" => {
            progress(format_args!("vhca.init=hang: hanging without a result"));
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        // Off PID 1 (and outside a run's process under the agent) this is a host, which must not be crashed.
        "panic" if std::process::id() == 1 || crate::run_process::in_run_process() => {
            progress(format_args!("vhca.init=panic: crashing the kernel"));
            // panic=-1 and -no-reboot end QEMU; pvpanic tells QMP.
            if let Err(e) = std::fs::write("/proc/sysrq-trigger", "c") {
                progress(format_args!("sysrq crash refused: {e}"));
            }
            std::thread::sleep(Duration::from_secs(10));
        }
        "poweroff" => {
            progress(format_args!("vhca.init=poweroff: powering off without a result"));
            if crate::run_process::in_run_process() {
                // The machine goes off, as it would from PID 1; the agent never gets to serve again.
                shutdown::end_machine(options.poweroff)
            }
            shutdown::finish(options.poweroff, false)
        }
        _ => progress(format_args!("vhca.init={mode} is not available here")),
    }
}
