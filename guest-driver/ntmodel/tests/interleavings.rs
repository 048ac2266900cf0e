//! The interleaving engine on the model's threads: a recording names its points the same in two identical runs,
//! a bounded preemption pauses the thread at the named point until the other is quiescent (and so turns a read,
//! pause, write into a lost update), and a PCT seed picks the same change points every time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use vhca_ntapi::*;
use vhca_ntmodel::interleaving::{change_points, Resumed, SchedulePoint};
use vhca_ntmodel::{InterleavingConfig, InterleavingMode, NtModel, NtModelConfig, PointId};

const TAG: u32 = pool_tag(b"vhca");

fn model(interleaving: InterleavingConfig) -> Arc<NtModel> {
    NtModel::for_tests(NtModelConfig { interleaving, ..NtModelConfig::default() }).0
}

fn mode(mode: InterleavingMode) -> InterleavingConfig {
    InterleavingConfig { mode, ..InterleavingConfig::default() }
}

fn read_counter(k: &NtModel, at: PVOID) -> u64 {
    let mut bytes = [0u8; 8];
    k.RtlCopyFromVa(&mut bytes, at);
    u64::from_le_bytes(bytes)
}

/// Two threads add one to a counter in pool, each a read then a write with no lock: "writer-b" makes its first
/// point, then sleeps outside the model (active all the while) before its read; "writer-a" starts once b is known
/// and, unpaused, is done long before b wakes. The counter's final value. The counter is set up on a thread of its
/// own that is gone by then: the test's thread, blocked outside the model, would count as active.
fn two_increments(k: &Arc<NtModel>) -> u64 {
    let (known, b_is_known) = mpsc::channel();
    thread::scope(|s| {
        let setup = || {
            let counter = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, 8, TAG);
            k.RtlCopyToVa(counter, &0u64.to_le_bytes());
            counter
        };
        let counter = thread::Builder::new().name("setup".into()).spawn_scoped(s, setup).unwrap().join().unwrap();
        let b = thread::Builder::new()
            .name("writer-b".into())
            .spawn_scoped(s, move || {
                k.KeGetCurrentIrql();
                known.send(()).unwrap();
                thread::sleep(Duration::from_millis(100));
                let seen = read_counter(k, counter);
                k.RtlCopyToVa(counter, &(seen + 1).to_le_bytes());
            })
            .unwrap();
        b_is_known.recv().unwrap();
        thread::Builder::new()
            .name("writer-a".into())
            .spawn_scoped(s, move || {
                let seen = read_counter(k, counter);
                k.RtlCopyToVa(counter, &(seen + 1).to_le_bytes());
            })
            .unwrap()
            .join()
            .unwrap();
        b.join().unwrap();
        read_counter(k, counter)
    })
}

/// A preemption at `point` whose pause outlasts any sleep of these tests: only the other threads' quiescence
/// ends it.
fn preempt_patiently(point: &PointId) -> InterleavingConfig {
    InterleavingConfig {
        mode: InterleavingMode::Preempt(vec![point.clone()]),
        settle: Duration::from_secs(5),
        limit: Duration::from_secs(10),
        ..InterleavingConfig::default()
    }
}

fn points_of<'p>(points: &'p [SchedulePoint], thread: &str) -> Vec<&'p SchedulePoint> {
    points.iter().filter(|p| p.id.thread == thread).collect()
}

#[test]
fn a_recording_names_its_points_the_same_in_two_identical_runs() {
    let run = || {
        let k = model(mode(InterleavingMode::Record));
        assert_eq!(two_increments(&k), 2);
        k.schedule_points().into_iter().map(|p| (p.id.to_string(), p.kind, p.site)).collect::<Vec<_>>()
    };
    let (first, second) = (run(), run());
    assert_eq!(first, second);
    let a: Vec<_> = first.iter().filter(|(id, _, _)| id.starts_with("writer-a#")).collect();
    assert_eq!(a.len(), 2, "{first:#?}");
    assert_eq!((a[0].0.as_str(), a[0].1.as_str()), ("writer-a#1", "call RtlCopyFromVa"));
    assert_eq!((a[1].0.as_str(), a[1].1.as_str()), ("writer-a#2", "call RtlCopyToVa"));
    assert!(a[0].2.contains("interleavings.rs:"), "named by the driver's call site: {}", a[0].2);
}

#[test]
fn a_preemption_at_the_write_pauses_until_the_other_is_done_and_loses_its_update() {
    let write = PointId { thread: "writer-a".into(), index: 2 };
    let config = InterleavingConfig {
        mode: InterleavingMode::Preempt(vec![write.clone()]),
        // Longer than b's sleep: only b's end (quiescent once its thread is gone) lets a go on.
        settle: Duration::from_secs(5),
        limit: Duration::from_secs(10),
        ..InterleavingConfig::default()
    };
    let k = model(config);
    assert_eq!(two_increments(&k), 1, "a read 0, paused, b wrote 1, a wrote 1 over it");
    let preemptions = k.preemptions();
    assert_eq!(preemptions.len(), 1, "{preemptions:#?}");
    assert_eq!((&preemptions[0].id, preemptions[0].kind.as_str()), (&write, "call RtlCopyToVa"));
    assert_eq!(preemptions[0].resumed, Resumed::Quiescent);
    assert!(preemptions[0].paused >= Duration::from_millis(50), "{:?}", preemptions[0].paused);
    let points = k.schedule_points();
    assert!(points_of(&points, "writer-a")[1].contended, "b was active when a got there");
    let unpaused = model(mode(InterleavingMode::Record));
    assert_eq!(two_increments(&unpaused), 2, "without the preemption no update is lost");
    assert_eq!(unpaused.preemptions(), vec![]);
}

#[test]
fn a_pct_seed_gives_the_same_change_points_twice() {
    assert_eq!(change_points(42, 3, 2000), change_points(42, 3, 2000));
    // One thread, so each pause ends at once (nobody else is active): the pauses are the change points.
    let run = || {
        let config = InterleavingConfig {
            mode: InterleavingMode::Pct { seed: 42, depth: 3 },
            pct_horizon: 8,
            ..InterleavingConfig::default()
        };
        let k = model(config);
        let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, 8, TAG);
        for _ in 0..8 {
            k.RtlCopyToVa(p, &[1; 8]);
        }
        k.preemptions().into_iter().map(|p| (p.id, p.resumed)).collect::<Vec<_>>()
    };
    let first = run();
    assert_eq!(first.len(), 2, "depth 3 is two change points, all inside the 9 points passed: {first:?}");
    assert!(first.iter().all(|(_, resumed)| *resumed == Resumed::Quiescent));
    let global: Vec<u64> = first.iter().map(|(id, _)| u64::from(id.index)).collect();
    assert_eq!(global, change_points(42, 3, 8), "one thread: its indices are the global numbers");
    assert_eq!(run(), first);
}

/// "waiter" makes its first point, then (after a sleep outside the model, active all the while) blocks on a fast
/// mutex that "holder" took before its pause point: the pause must end when the waiter blocks, as a thread blocked
/// in the model is quiescent, long before `settle` (a pause that waited for it would hold the model up).
fn holder_and_waiter(k: &Arc<NtModel>) {
    let (known, waiter_is_known) = mpsc::channel();
    thread::scope(|s| {
        let setup = || k.ExInitializeFastMutex();
        let mutex = thread::Builder::new().name("setup".into()).spawn_scoped(s, setup).unwrap().join().unwrap();
        let waiter = thread::Builder::new()
            .name("waiter".into())
            .spawn_scoped(s, move || {
                k.KeGetCurrentIrql();
                known.send(()).unwrap();
                thread::sleep(Duration::from_millis(50));
                k.ExAcquireFastMutex(mutex);
                k.ExReleaseFastMutex(mutex);
            })
            .unwrap();
        waiter_is_known.recv().unwrap();
        thread::Builder::new()
            .name("holder".into())
            .spawn_scoped(s, move || {
                k.ExAcquireFastMutex(mutex);
                k.KeGetCurrentIrql();
                k.ExReleaseFastMutex(mutex);
            })
            .unwrap()
            .join()
            .unwrap();
        waiter.join().unwrap();
    });
}

#[test]
fn a_pause_ends_when_the_other_thread_blocks_on_the_lock_the_paused_one_holds() {
    let recording = model(mode(InterleavingMode::Record));
    holder_and_waiter(&recording);
    let points = recording.schedule_points();
    let pause_at = points_of(&points, "holder")
        .into_iter()
        .find(|p| p.kind == "call KeGetCurrentIrql")
        .map(|p| p.id.clone())
        .expect("the holder's point under the mutex");
    let config = preempt_patiently(&pause_at);
    let k = model(config);
    holder_and_waiter(&k);
    let preemptions = k.preemptions();
    assert_eq!(preemptions.len(), 1, "{preemptions:#?}");
    assert_eq!((&preemptions[0].id, preemptions[0].resumed), (&pause_at, Resumed::Quiescent));
    assert!(preemptions[0].paused < Duration::from_secs(2), "{:?}", preemptions[0].paused);
}

/// The calling thread runs only when no other thread wants a CPU (SCHED_IDLE): with `hog`'s spinners on every
/// CPU, a thread woken from its wait runs again only milliseconds later, as under a loaded host.
fn run_last() {
    // SAFETY: sched_param is plain data; pid 0 is the calling thread, and SCHED_IDLE takes priority 0.
    let rc = unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        libc::sched_setscheduler(0, libc::SCHED_IDLE, &param)
    };
    assert_eq!(rc, 0, "SCHED_IDLE: {}", std::io::Error::last_os_error());
}

/// Spinners on every CPU until `stop`.
fn hog<'s, 'e>(s: &'s thread::Scope<'s, 'e>, stop: &'e AtomicBool) {
    let cpus = thread::available_parallelism().map_or(2, |n| n.get());
    for _ in 0..cpus {
        s.spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
    }
}

/// "sleeper" blocks on an event; "setter" (started once the sleeper waits) sets it and passes one more point. The
/// sleeper runs last (`run_last`) while spinners hold every CPU, so a woken sleeper runs again well after the
/// setter's next point; it stays 100 ms outside the model after its wait, then says it is done. Whether it was
/// done when the setter went on past its next point.
fn setter_and_sleeper(k: &Arc<NtModel>) -> bool {
    let done = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    let (waiting, sleeper_waits) = mpsc::channel();
    thread::scope(|s| {
        let setup = || k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
        let event = thread::Builder::new().name("setup".into()).spawn_scoped(s, setup).unwrap().join().unwrap();
        let done = &done;
        let sleeper = thread::Builder::new()
            .name("sleeper".into())
            .spawn_scoped(s, move || {
                run_last();
                waiting.send(()).unwrap();
                k.KeWaitForSingleObject(
                    event.into(),
                    KWAIT_REASON::Executive,
                    KPROCESSOR_MODE::KernelMode,
                    false,
                    None,
                );
                thread::sleep(Duration::from_millis(100));
                done.store(true, Ordering::SeqCst);
            })
            .unwrap();
        sleeper_waits.recv().unwrap();
        thread::sleep(Duration::from_millis(50));
        hog(s, &stop);
        let seen = thread::Builder::new()
            .name("setter".into())
            .spawn_scoped(s, move || {
                k.KeSetEvent(event, 0, false);
                k.KeGetCurrentIrql();
                done.load(Ordering::SeqCst)
            })
            .unwrap()
            .join()
            .unwrap();
        stop.store(true, Ordering::Relaxed);
        sleeper.join().unwrap();
        seen
    })
}

/// The setter pauses right after its signal: the sleeper it woke counts as active from the signal on, not from
/// when the OS runs it again, so the pause lasts until the sleeper is gone. Counting it quiescent until it ran
/// (as the engine once did) let the pause end at once whenever the setter looked first, and the sleeper's work
/// landed after the pause instead of inside it: with the spinners, every run.
#[test]
fn a_thread_woken_by_a_signal_counts_as_active_before_it_runs() {
    let recording = model(mode(InterleavingMode::Record));
    assert!(!setter_and_sleeper(&recording), "unpaused, the setter is long gone before the sleeper is done");
    let points = recording.schedule_points();
    let setter = points_of(&points, "setter");
    let after_signal = setter
        .iter()
        .position(|p| p.kind == "call KeSetEvent")
        .and_then(|i| setter.get(i + 1))
        .map(|p| p.id.clone())
        .expect("the setter's point after KeSetEvent");
    let config = preempt_patiently(&after_signal);
    for run in 0..5 {
        let k = model(config.clone());
        assert!(setter_and_sleeper(&k), "run {run}: the pause ended before the woken sleeper ran");
        let preemptions = k.preemptions();
        assert_eq!(preemptions.len(), 1, "{preemptions:#?}");
        assert_eq!((&preemptions[0].id, preemptions[0].resumed), (&after_signal, Resumed::Quiescent));
    }
}

/// What a recording costs per point, as vhca.sys's spin-locked wrappers pass them (KeAcquireSpinLock, irql 2,
/// acquire, KeReleaseSpinLock, release, irql 0) with every kernel call a kick and another thread active, so each
/// point is contended and logged. Prints the figure (`cargo test --release -p vhca-ntmodel --test interleavings
/// recording_cost -- --nocapture`); 20 us a point is far above it (0.3-1.0 us on the shared 2-core host, from
/// 1.1-2 us when every point made a futex wake and copied itself) and far below what a point that sleeps or walks
/// its log would cost.
#[test]
fn recording_cost_per_point_of_a_spin_locked_wrapper() {
    let k = model(InterleavingConfig { kicks_at_every_call: true, ..mode(InterleavingMode::Record) });
    let lock = k.KeInitializeSpinLock();
    let (done, other_ends) = mpsc::channel::<()>();
    let (known, other_is_known) = mpsc::channel();
    let other = {
        let k = k.clone();
        thread::spawn(move || {
            k.KeGetCurrentIrql();
            known.send(()).unwrap();
            // Active outside the model until told: every point of the loop below is contended.
            other_ends.recv().unwrap();
        })
    };
    other_is_known.recv().unwrap();
    const CYCLES: u32 = 10_000;
    let start = std::time::Instant::now();
    for _ in 0..CYCLES {
        let old = k.KeAcquireSpinLock(lock);
        k.KeReleaseSpinLock(lock, old);
    }
    let elapsed = start.elapsed();
    done.send(()).unwrap();
    other.join().unwrap();
    let points = k.schedule_points();
    let setup = ["call KeGetCurrentIrql", "call KeInitializeSpinLock"];
    let mine: Vec<_> = points.iter().filter(|p| !setup.contains(&p.kind.as_str())).collect();
    assert_eq!(mine.len(), 6 * CYCLES as usize, "six points a cycle");
    assert!(mine.iter().all(|p| p.contended), "the other thread was active throughout");
    let per_point = elapsed.as_secs_f64() * 1e6 / mine.len() as f64;
    println!("Record, kicks at every call: {per_point:.2} us per point ({CYCLES} spin-lock cycles)");
    assert!(per_point < 20.0, "{per_point} us per point");
}
