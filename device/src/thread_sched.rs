//! Scheduling hints for the device's threads, so that QEMU's vCPU thread and the device's own background work do
//! not hold a core that a kicked request is waiting for.
//!
//! **A short slice for the threads a request waits for** (the queue worker, the IOTLB reply reader). Under TCG,
//! QEMU's vCPU thread writes the kick eventfd and keeps running (the guest spins on its used ring). The woken worker
//! often lands on that same core, and under EEVDF (Linux 6.6+) a woken task with the default slice may wait until
//! the running one has used up its own: 0.1–0.3 ms per such wake-up, in 1–3 % of them (`perf sched timehist`,
//! docs/bench.md section 5), which was the whole of the guest round trip's p99. Since Linux 6.12 a SCHED_OTHER task
//! may ask for a shorter slice with `sched_setattr(2)`'s `sched_runtime`, and one whose slice is shorter than the
//! running task's may preempt it at wake-up instead of waiting out its slice (the scheduler feature PREEMPT_SHORT;
//! measured: the worker's wake-up delay p99 went from 97 to 22 µs). It needs no privilege and does not
//! raise the thread's share of the CPU (that is its nice value, kept); an older kernel accepts and ignores the field.
//!
//! **A lower priority for the event log's writer** (`lower_this_thread`). It wakes every 2 ms while events come and
//! writes for ~0.1 ms; a worker woken onto its core waited that long behind it (the back-to-back round trip's p99,
//! 150–200 µs). Nice +10 makes the scheduler prefer the worker without starving the writer, whose CPU need is ~1 %;
//! a producer that fills the queue still waits for it (event_log.rs), so it must keep running under load.
//!
//! Hand-written: neither libc nor rustix wraps `sched_setattr`/`sched_getattr` or defines `struct sched_attr`.

use std::io;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

/// `struct sched_attr` of include/uapi/linux/sched/types.h, version 1 (56 bytes, with the utilisation clamps).
#[repr(C)]
#[derive(Debug, Default)]
struct SchedAttr {
    size: u32,
    sched_policy: u32,
    sched_flags: u64,
    sched_nice: i32,
    sched_priority: u32,
    sched_runtime: u64,
    sched_deadline: u64,
    sched_period: u64,
    sched_util_min: u32,
    sched_util_max: u32,
}

const SCHED_ATTR_SIZE: u32 = std::mem::size_of::<SchedAttr>() as u32;

/// The shortest slice the kernel grants (it clamps `sched_runtime` to 0.1–100 ms): `vhca-device --thread-slice-us`
/// unless given.
pub const SHORTEST: Duration = Duration::from_micros(100);
/// The longest the kernel grants.
pub const LONGEST: Duration = Duration::from_millis(100);

/// Asks for `slice` for the calling thread, keeping its policy (SCHED_OTHER) and its nice value.
pub fn request_for_this_thread(slice: Duration) -> io::Result<()> {
    let attr = SchedAttr {
        size: SCHED_ATTR_SIZE,
        sched_policy: libc::SCHED_OTHER as u32,
        sched_nice: this_thread_nice()?,
        sched_runtime: u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX),
        ..SchedAttr::default()
    };
    // SAFETY: pid 0 is the calling thread; `attr` is a live, fully initialised sched_attr whose `size` field tells
    // the kernel how much of it to read; flags 0.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The calling thread's slice as the kernel reports it (`slice_of`).
pub fn this_thread_slice() -> io::Result<Duration> {
    slice_of(0)
}

/// Thread `tid`'s slice as the kernel reports it (`sched_runtime` of `sched_getattr`, Linux 6.12+; 0 before); 0 is
/// the calling thread. Reading another thread's needs no privilege.
pub fn slice_of(tid: libc::pid_t) -> io::Result<Duration> {
    let mut attr = SchedAttr::default();
    // SAFETY: the kernel writes at most `SCHED_ATTR_SIZE` bytes into `attr`, which is exactly that large; flags 0.
    let rc = unsafe { libc::syscall(libc::SYS_sched_getattr, tid, &mut attr as *mut SchedAttr, SCHED_ATTR_SIZE, 0) };
    if rc == 0 {
        Ok(Duration::from_nanos(attr.sched_runtime))
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether the running kernel takes `sched_runtime` as a SCHED_OTHER thread's slice (Linux 6.12 and later; before,
/// the request is accepted and has no effect).
pub fn kernel_grants_slices() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").is_ok_and(|release| release_grants_slices(&release))
}

/// `kernel_grants_slices` for a kernel release string ("6.18.44-fc-v669", "6.1.0-28-amd64").
fn release_grants_slices(release: &str) -> bool {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit()).map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (6, 12)
}

/// How much lower than its process the event log's writer runs (`lower_this_thread`).
pub const BACKGROUND_NICE_OFFSET: i32 = 10;
/// The lowest priority Linux has.
const NICEST: i32 = 19;

/// Lowers the calling thread's priority by `BACKGROUND_NICE_OFFSET` (to at most nice 19): for background work that
/// must go on but never ahead of a request.
pub fn lower_this_thread() -> io::Result<()> {
    let nice = (this_thread_nice()? + BACKGROUND_NICE_OFFSET).min(NICEST);
    // SAFETY: setpriority with who = 0 sets the calling thread's nice value (Linux: PRIO_PROCESS names a thread);
    // raising it needs no privilege.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The calling thread's nice value.
pub fn this_thread_nice() -> io::Result<i32> {
    // SAFETY: getpriority with who = 0 reads the calling thread's nice value (Linux: PRIO_PROCESS names a thread);
    // errno is cleared first because -1 is a valid nice value.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, 0)
    };
    match io::Error::last_os_error() {
        err if nice == -1 && err.raw_os_error() != Some(0) => Err(err),
        _ => Ok(nice),
    }
}

/// Spawns `name` running `body` with `slice` requested first (`Duration::ZERO`: the kernel's default, untouched),
/// and returns once the request is made, so a seccomp filter installed after this returns never sees it. A slice
/// refused is logged and the thread runs anyway: it costs latency, not correctness.
pub fn spawn<T: Send + 'static>(
    name: &str,
    slice: Duration,
    body: impl FnOnce() -> T + Send + 'static,
) -> io::Result<JoinHandle<T>> {
    let (asked, answer) = mpsc::sync_channel(1);
    let thread_name = name.to_string();
    let handle = std::thread::Builder::new().name(thread_name.clone()).spawn(move || {
        if !slice.is_zero() {
            if let Err(err) = request_for_this_thread(slice) {
                tracing::warn!("{thread_name}: scheduler slice of {slice:?} refused ({err}); wake-ups may wait");
            }
        }
        let _ = asked.send(());
        body()
    })?;
    // The thread sends before it runs `body`; a receive error means it died before that, which join reports.
    let _ = answer.recv();
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases_are_compared_as_numbers() {
        assert!(["6.18.44-fc-v669", "6.12.0", "7.0.1\n", "10.2"].iter().all(|r| release_grants_slices(r)));
        assert!(!["6.1.0-28-amd64", "6.11.9", "5.19.0", "", "garbage"].iter().any(|r| release_grants_slices(r)));
    }

    #[test]
    fn a_spawned_thread_runs_with_its_slice_and_its_nice_value() {
        assert_eq!(SCHED_ATTR_SIZE, 56, "struct sched_attr, version 1");
        let seen = spawn("slice-test", SHORTEST, || (this_thread_slice().unwrap(), this_thread_nice().unwrap()))
            .unwrap()
            .join()
            .unwrap();
        let nice_before = this_thread_nice().unwrap();
        if kernel_grants_slices() {
            assert_eq!(seen.0, SHORTEST, "the kernel reports the slice asked for");
        }
        assert_eq!(seen.1, nice_before, "a new thread inherits its nice value, and the request keeps it");
    }

    #[test]
    fn the_request_keeps_a_lowered_priority() {
        let seen = std::thread::spawn(|| {
            // SAFETY: setpriority on the calling thread (who = 0) to a lower priority, which needs no privilege.
            assert_eq!(unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 7) }, 0);
            request_for_this_thread(Duration::from_millis(2)).unwrap();
            (this_thread_nice().unwrap(), this_thread_slice().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(seen.0, 7);
        if kernel_grants_slices() {
            assert_eq!(seen.1, Duration::from_millis(2));
        }
    }

    #[test]
    fn background_threads_run_ten_nicer_at_most_nineteen() {
        let seen = std::thread::spawn(|| {
            let before = this_thread_nice().unwrap();
            lower_this_thread().unwrap();
            let once = this_thread_nice().unwrap();
            lower_this_thread().unwrap();
            lower_this_thread().unwrap();
            (before, once, this_thread_nice().unwrap())
        })
        .join()
        .unwrap();
        assert_eq!(seen.1, (seen.0 + 10).min(19));
        assert_eq!(seen.2, 19, "clamped at the lowest priority, not an error");
        assert_eq!(this_thread_nice().unwrap(), seen.0, "only the calling thread is lowered");
    }

    #[test]
    fn a_zero_slice_leaves_the_kernel_default() {
        let (default, spawned) = std::thread::scope(|s| {
            let default = s.spawn(|| this_thread_slice().unwrap()).join().unwrap();
            (default, spawn("no-slice", Duration::ZERO, || this_thread_slice().unwrap()).unwrap().join().unwrap())
        });
        assert_eq!(spawned, default);
        if kernel_grants_slices() {
            assert_ne!(spawned, SHORTEST, "the kernel's default slice is longer than the shortest");
        }
    }
}
