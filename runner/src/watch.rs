//! The wait of one run: every tick it reads the console, QMP and both processes, until the guest's result, a crash,
//! silence, a dead process or the timeout, or until a run on a reusable guest left it clean and ready again.

use std::fs;
use std::time::{Duration, Instant};

use vhca_suite::{parse_bugcheck, parse_linux_panic, parse_result_line, ConcreteRun, GuestPanicked, ProcessExit};

use crate::child_wait::{exit_of, pause, wait_exit};
use crate::load_ahead::Loaded;
use crate::phase_hook::{self, Phase, Pids};
use crate::proc_usage::{self, Point};
use crate::qemu_cmd::{HCA_CHARDEV, HCA_DEVICE_ID};
use crate::qmp::Qmp;
use crate::run_context::RunContext;
use crate::run_files::RunFiles;
use crate::run_progress::Progress;
use crate::serial_capture::{ConsolePort, SerialLog};
use crate::supervise::{SuperviseError, Supervised};

/// QEMU creates its QMP socket at once; waiting longer only delays noticing a QEMU that died at start-up.
const QMP_CONNECT: Duration = Duration::from_secs(5);
/// After its result QEMU is sent SIGTERM (and the guest powers off anyway); QEMU then exits within milliseconds.
const AFTER_RESULT: Duration = Duration::from_secs(15);
/// After a bugcheck or panic the guest stops (panic=-1 with -no-reboot ends QEMU); a few more lines may follow.
pub const AFTER_CRASH: Duration = Duration::from_secs(3);
/// How long after the result of a run that pulled its HCA the runner waits to read QEMU's DEVICE_DELETED of it
/// (the guest waited for the eject before its result, so it is on its way); within AFTER_CRASH, the grace.
const UNPLUG_EVENT_WAIT: Duration = Duration::from_secs(2);
/// The device leaves when QEMU hangs up, and QEMU may still be tearing down then.
const QEMU_AFTER_DEVICE: Duration = Duration::from_secs(2);

/// Set to make the runner panic mid-run, once QEMU runs: the test of "a runner panic leaves nothing behind".
pub const TEST_PANIC_ENV: &str = "VHCA_RUN_TEST_PANIC";

/// How a run's wait ended, and what the runner saw on the way; the evidence module reads the rest from the files.
#[derive(Debug, Default)]
pub struct Watched {
    pub qemu_exit: ProcessExit,
    pub device_exit: ProcessExit,
    pub timed_out: bool,
    pub silent_for_s: Option<f64>,
    pub qmp_events: Vec<serde_json::Value>,
    pub rig_problems: Vec<String>,
    /// When the first bugcheck or panic showed, in µs on the device's event-log clock, and its label.
    pub crash_mark: Option<(u64, String)>,
    /// When the guest's result line showed, on the same clock: the timeline places the guest's ISR and DPC times
    /// back from it.
    pub result_seen_us: Option<u64>,
}

/// The wait of one run: polls serial, QMP and both processes every tick.
pub struct Watch<'a> {
    pub ctx: &'a RunContext,
    pub run: &'a ConcreteRun,
    pub files: &'a RunFiles,
    pub device_started: Instant,
    pub watched: &'a mut Watched,
    pub on: &'a mut dyn FnMut(Progress),
    /// How long QEMU may go on after a bugcheck or panic: a Linux guest stops at once, Windows writes its dump.
    pub crash_grace: Duration,
}

/// How the wait came out.
pub enum WatchEnd {
    /// The run left its guest clean: running, its agent waiting, its HCA ejected and the HCA's chardev removed.
    Recycled(Loaded),
    /// Any other end: what the teardown (teardown.rs) stops, reaps and reads last.
    Over(Remains),
}

/// What a wait that is over leaves to the teardown: both children (either may still run), QMP and the console still
/// open, and when each stage of the run's end came so far.
pub struct Remains {
    pub device: Supervised,
    pub qemu: Supervised,
    pub qmp: Option<Qmp>,
    pub port: Option<ConsolePort>,
    pub serial: SerialLog,
    pub ending: Vec<(&'static str, f64)>,
}

/// Why the wait loop stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    QemuExited,
    DeviceExited,
    /// A result or crash was in and QEMU did not end by itself within the grace period.
    GraceOver,
    Silence,
    Timeout,
    /// The run left its guest clean and the guest said it can serve again (`reuse`).
    Recycled,
}

impl Watch<'_> {
    /// `qmp` and `port`: already connected (a restore needed them first); a cold boot's QMP is connected here.
    /// `reuse`: the guest may serve another run if this one leaves it clean; then it is returned, running, its agent
    /// waiting, its HCA ejected and the HCA's chardev removed.
    pub fn run(
        &mut self,
        mut device: Supervised,
        mut qemu: Supervised,
        mut qmp: Option<Qmp>,
        mut port: Option<ConsolePort>,
        reuse: bool,
    ) -> Result<WatchEnd, SuperviseError> {
        let qemu_started = Instant::now();
        let mut serial = SerialLog::new(&self.files.serial());
        let mut last_output = qemu_started;
        let mut last_offset = 0;
        let mut qmp_tried = qmp.is_some();
        // When a result or crash arrived, and how long QEMU then gets to end by itself.
        let mut settled: Option<(Instant, Duration)> = None;
        let untimed = self.ctx.gdb.is_some() || self.ctx.paused;
        let silence = Duration::from_secs(u64::from(self.run.guest.silence_s));
        let timeout = Duration::from_secs(u64::from(self.run.guest.timeout_s));
        let test_panic = std::env::var_os(TEST_PANIC_ENV).is_some();
        let mut quit_sent = false;
        // The guest's word that the run is over (its result line), and, on a guest that may serve again, the
        // agent's readiness after it, the HCA's DEVICE_DELETED and the device's own exit: all three make it clean.
        let mut result_seen = false;
        let mut agent_ready = false;
        let mut hca_deleted = false;
        let mut device_gone = false;
        let mut chardev_removed: Option<bool> = None;
        // A run that asks for a real hot-unplug (hot_unplug.rs): what the HCA was deleted by, once pulled.
        let unplug_asked = crate::hot_unplug::asked_by(self.run);
        let mut pulled: Option<String> = None;
        let mut backend_let_go = false;
        let pids = Pids { qemu: Some(qemu.pid()), device: Some(device.pid()) };
        let mut mid_run = false;
        // For the soak only (`proc_usage::collect`): both children's memory and fds while the run is live.
        let collect = proc_usage::collecting();
        let mut sampled = false;
        let (device_pid, qemu_pid) = (device.pid(), qemu.pid());
        let sample = |point, sampled: &mut bool| {
            if collect && !std::mem::replace(sampled, true) {
                proc_usage::record(point, device_pid, qemu_pid);
            }
        };

        // For `ending.log`: seconds after the device started.
        let mut ending: Vec<(&'static str, f64)> = Vec::new();
        let since_device = |device_started: Instant| device_started.elapsed().as_secs_f64();
        let end = loop {
            for line in serial.poll().unwrap_or_default() {
                if let Some(grace) = self.absorb(&line) {
                    if settled.is_none() {
                        ending.push(("result or crash line seen", since_device(self.device_started)));
                    }
                    settled.get_or_insert((Instant::now(), grace));
                }
                if parse_result_line(&line).is_some() {
                    result_seen = true;
                } else if result_seen && line.trim() == crate::snapshot::READY_LINE && !agent_ready {
                    agent_ready = true;
                    ending.push(("agent ready again", since_device(self.device_started)));
                }
                if unplug_asked && pulled.is_none() && crate::hot_unplug::is_request(&line) {
                    let carrier = self.ctx.carrier.device_name();
                    match qmp.as_mut().map(|q| crate::hot_unplug::pull(q, carrier)) {
                        Some(Ok(by)) => {
                            let what = format!("hot-unplug: device_del of {by} sent");
                            (self.on)(Progress::Stage { run: self.run.name.clone(), what });
                            pulled = Some(by);
                        }
                        Some(Err(e)) => self.watched.rig_problems.push(format!("hot-unplug: {e}")),
                        None => self.watched.rig_problems.push("hot-unplug: no QMP connection".into()),
                    }
                    pulled.get_or_insert_with(String::new);
                    ending.push(("hot-unplug: device_del sent", since_device(self.device_started)));
                }
                (self.on)(Progress::Serial { run: self.run.name.clone(), line });
            }
            if serial.offset() != last_offset {
                last_offset = serial.offset();
                last_output = Instant::now();
            }
            if !qmp_tried {
                qmp_tried = true;
                qmp = Qmp::connect(&self.files.qmp(), QMP_CONNECT).ok();
            }
            if self.drain_qmp(qmp.as_mut()) {
                settled.get_or_insert((Instant::now(), self.crash_grace));
            }
            if reuse && !hca_deleted && self.hca_deleted() {
                hca_deleted = true;
                ending.push(("HCA deleted", since_device(self.device_started)));
            }
            // The vhost-user connection belongs to the chardev, not the device: removing it hangs up on the device,
            // which then ends, and frees the id for the next run's chardev. Only after the result line: QEMU can
            // announce the removal before the runner has read the guest's last lines.
            if reuse && hca_deleted && result_seen && chardev_removed.is_none() {
                let removed = match qmp.as_mut() {
                    Some(q) => q.execute("chardev-remove", Some(serde_json::json!({ "id": HCA_CHARDEV })), QMP_CONNECT),
                    None => Err(crate::qmp::QmpError::Closed),
                };
                chardev_removed = Some(removed.is_ok());
                ending.push((
                    if removed.is_ok() { "chardev removed" } else { "chardev-remove failed" },
                    since_device(self.device_started),
                ));
                if let Err(e) = removed {
                    let what = format!("the guest will not serve again: chardev-remove: {e}");
                    (self.on)(Progress::Stage { run: self.run.name.clone(), what });
                }
            }
            // Not once QEMU was told to end (the result came first): its exit hangs up on the device anyway, and
            // a QEMU on its way out may not answer.
            if let (Some(by), false, false) = (pulled.as_deref(), backend_let_go, quit_sent) {
                if self.watched.qmp_events.iter().any(|e| crate::hot_unplug::is_deleted(e, by)) {
                    backend_let_go = true;
                    let removed = qmp.as_mut().map(crate::hot_unplug::let_go_of_backend);
                    ending.push(("hot-unplug: HCA deleted, chardev removed", since_device(self.device_started)));
                    if let Some(Err(e)) = removed {
                        // The device then ends with QEMU, as on any run: nothing the verdict needs.
                        let what = format!("hot-unplug: chardev-remove: {e}");
                        (self.on)(Progress::Stage { run: self.run.name.clone(), what });
                    }
                }
            }
            if test_panic && last_offset > 0 {
                panic!("{TEST_PANIC_ENV} is set: the runner panics mid-run, with QEMU and the device running");
            }
            if !mid_run && last_offset > 0 {
                mid_run = true;
                // Both children surely live, and just before the soak's hook may kill one.
                sample(Point::FirstOutput, &mut false);
                phase_hook::at(Phase::MidRun, pids);
            }
            if let Some(status) = qemu.try_status()? {
                self.watched.qemu_exit = exit_of(status);
                break End::QemuExited;
            }
            if !device_gone {
                if let Some(status) = device.try_status()? {
                    self.watched.device_exit = exit_of(status);
                    // On a guest that may serve again, the device leaves once the agent ejected its HCA (after
                    // the result, whichever of the two the runner notices first): expected, if it ends well.
                    let ejected = result_seen || hca_deleted;
                    let clean = self.watched.device_exit == (ProcessExit::Exited { code: 0 });
                    // After a hot-unplug the device leaves when its chardev goes: expected, if it ends well.
                    if !(((reuse && ejected) || backend_let_go) && clean) {
                        break End::DeviceExited;
                    }
                    device_gone = true;
                    ending.push(("device exited", since_device(self.device_started)));
                }
            }
            if reuse && agent_ready && chardev_removed == Some(true) && device_gone {
                break End::Recycled;
            }
            if let Some((at, grace)) = settled {
                sample(Point::End, &mut sampled);
                // A pulled HCA's DEVICE_DELETED is part of the run's evidence: QEMU is told to end once the runner
                // read it, or at most UNPLUG_EVENT_WAIT after the result (once, QEMU ended with it still unread).
                let unplug_read = pulled.is_none() || backend_let_go || at.elapsed() >= UNPLUG_EVENT_WAIT;
                if result_seen && !reuse && !quit_sent && unplug_read {
                    // The result line is the guest's last word (its teardown is done and checked by then): QEMU is
                    // told to end instead of waiting for the guest's power-off. With SIGTERM, not QMP's `quit`:
                    // QEMU's monitor reads a command one byte per main-loop turn, and with the vCPU busy (the
                    // guest powering off) the 19 bytes of `quit` took 10-14 ms to be answered. QEMU ends on SIGTERM
                    // as on `quit` (a clean shutdown, exit status 0, a SHUTDOWN event on QMP).
                    quit_sent = true;
                    qemu.terminate();
                    ending.push(("SIGTERM sent to QEMU", since_device(self.device_started)));
                }
                if at.elapsed() >= grace {
                    break End::GraceOver;
                }
            } else if !untimed {
                if last_output.elapsed() >= silence {
                    break End::Silence;
                }
                if qemu_started.elapsed() >= timeout {
                    break End::Timeout;
                }
            }
            pause()?;
        };
        sample(Point::End, &mut sampled);
        ending.push(("wait over", since_device(self.device_started)));
        self.watched.silent_for_s = Some(last_output.elapsed().as_secs_f64());
        match end {
            End::Silence | End::Timeout => {
                self.watched.timed_out = true;
                let why = if end == End::Silence {
                    format!("no serial output for {} s", silence.as_secs())
                } else {
                    format!("timeout {} s", timeout.as_secs())
                };
                (self.on)(Progress::Stage { run: self.run.name.clone(), what: format!("stopping: {why}") });
            }
            End::DeviceExited => {
                // The device leaves when QEMU hangs up; QEMU may still be tearing down. Give it a moment.
                if let Some(status) = wait_exit(&mut qemu, QEMU_AFTER_DEVICE)? {
                    self.watched.qemu_exit = exit_of(status);
                } else if self.watched.device_exit == (ProcessExit::Exited { code: 0 }) {
                    self.watched.rig_problems.push("vhca-device exited (status 0) while QEMU still ran".into());
                }
            }
            End::QemuExited | End::GraceOver | End::Recycled => {}
        }
        if end == End::Recycled {
            // Reuse is only asked for a restored guest, which has QMP and a console port.
            if let (Some(qmp), Some(port)) = (qmp.take(), port.take()) {
                self.write_ending(&ending);
                self.drain_console(&mut serial);
                return Ok(WatchEnd::Recycled(Loaded { qemu, qmp, port, timings: Default::default() }));
            }
        }
        Ok(WatchEnd::Over(Remains { device, qemu, qmp, port, serial, ending }))
    }

    /// `ending.log`: when each stage of the run's end came.
    pub fn write_ending(&self, ending: &[(&str, f64)]) {
        let ending: String = ending.iter().map(|(what, s)| format!("{what} {s:.3} s\n")).collect();
        let _ = fs::write(self.files.ending_log(), format!("seconds after the device started\n{ending}"));
    }

    /// The console's last lines, a partial one included: on a guest that serves again, after the agent's readiness;
    /// otherwise once QEMU is gone.
    pub fn drain_console(&mut self, serial: &mut SerialLog) {
        for line in serial.poll().unwrap_or_default().into_iter().chain(serial.take_partial()) {
            self.absorb(&line);
            (self.on)(Progress::Serial { run: self.run.name.clone(), line });
        }
    }

    /// True once QEMU announced the HCA's removal (the agent ejected it).
    fn hca_deleted(&self) -> bool {
        self.watched.qmp_events.iter().any(|e| {
            e.get("event").and_then(|v| v.as_str()) == Some("DEVICE_DELETED")
                && e.get("data").and_then(|d| d.get("device")).and_then(|v| v.as_str()) == Some(HCA_DEVICE_ID)
        })
    }

    /// Notes what a serial line means for the wait: the grace period it starts, if any; a crash also marks the
    /// timeline. The verdict itself reads the whole serial log afterwards, through the same parsers.
    fn absorb(&mut self, line: &str) -> Option<Duration> {
        if parse_result_line(line).is_some() {
            if self.watched.result_seen_us.is_none() {
                self.watched.result_seen_us =
                    Some(u64::try_from(self.device_started.elapsed().as_micros()).unwrap_or(u64::MAX));
            }
            return Some(AFTER_RESULT);
        }
        let label = match (parse_bugcheck(line), parse_linux_panic(line)) {
            (Some(b), _) => format!("STOP {:#X}", b.code),
            (None, Some(_)) => "kernel panic".to_string(),
            (None, None) => return None,
        };
        self.mark_crash(label);
        Some(AFTER_CRASH)
    }

    fn mark_crash(&mut self, label: String) {
        if self.watched.crash_mark.is_none() {
            let t_us = u64::try_from(self.device_started.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.watched.crash_mark = Some((t_us, label));
        }
    }

    /// Collects QMP events; true if one was GUEST_PANICKED.
    pub fn drain_qmp(&mut self, qmp: Option<&mut Qmp>) -> bool {
        let Some(q) = qmp else { return false };
        let _ = q.poll_events();
        let mut panicked = false;
        for e in q.take_events() {
            let value = serde_json::json!({ "event": e.event, "data": e.data });
            if let Some(p) = GuestPanicked::from_qmp(&value) {
                panicked = true;
                let label = match p.hyperv.and_then(|h| h.bugcheck()) {
                    Some(b) => {
                        // A Windows guest prints no STOP line: show the Hyper-V crash MSRs in the NT model's form.
                        let what = format!("QMP GUEST_PANICKED (hyper-v): {}", b.stop_line());
                        (self.on)(Progress::Stage { run: self.run.name.clone(), what });
                        format!("STOP {:#X} (QMP)", b.code)
                    }
                    None => "GUEST_PANICKED".to_string(),
                };
                self.mark_crash(label);
            }
            self.watched.qmp_events.push(value);
        }
        panicked
    }
}
