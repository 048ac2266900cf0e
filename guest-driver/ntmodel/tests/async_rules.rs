//! The asynchronous paths: interrupts, DPCs, work items, timers, events and waits run with their documented IRQLs
//! and calling conventions, and every verifier rule on them raises its exact code and parameters where it should
//! and nothing next to it. Timing tests run on a manual clock, so every timeout and watchdog count is exact.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use common::{message_parameters, PDO};
use vhca_ntapi::*;
use vhca_ntmodel::{
    Bugcheck, ClockSource, InterruptResources, NtModel, NtModelConfig, RuleId, TimingConfig, VerifierFlags,
    DEVICE_DIRQL,
};

const IRQL: u32 = 0x2;
const DEADLOCK: u32 = 0x20;
const DMA: u32 = 0x80;
const STANDARD: u32 = 0x209BB;
const TAG: u32 = pool_tag(b"vhca");

/// A model on a manual clock with the default watchdog (tick 15.625 ms, 64 and 320 ticks).
fn machine(flags: u32) -> Arc<NtModel> {
    machine_timed(flags, TimingConfig { clock: ClockSource::Manual, ..TimingConfig::default() })
}

fn machine_timed(flags: u32, timing: TimingConfig) -> Arc<NtModel> {
    let config = NtModelConfig { verifier: VerifierFlags(flags), ..NtModelConfig::default() };
    NtModel::for_tests_with_timing(config, timing).0
}

fn stop<T>(f: impl FnOnce() -> T) -> Bugcheck {
    match NtModel::run_guarded(f) {
        Ok(_) => panic!("expected a bugcheck"),
        Err(b) => b,
    }
}

fn clean<T>(f: impl FnOnce() -> T) -> T {
    NtModel::run_guarded(f).unwrap_or_else(|b| panic!("unexpected bugcheck:\n{b}"))
}

const MS: i64 = 10_000;

/// What each callback saw, in order.
#[derive(Default, Clone)]
struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    fn push(&self, s: impl Into<String>) {
        self.0.lock().unwrap().push(s.into());
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// A DPC that logs its name and IRQL.
fn logging_dpc(k: &Arc<NtModel>, log: &Log, name: &'static str) -> PKDPC {
    let (k2, log) = (Arc::downgrade(k), log.clone());
    k.KeInitializeDpc(Arc::new(move |_, a1, a2| {
        let irql = k2.upgrade().unwrap().KeGetCurrentIrql();
        log.push(format!("{name}@{irql} {:#x} {:#x}", a1.0, a2.0));
    }))
}

/// Connects `isr` to a device with `messages` messages; returns the connection.
fn connect(k: &Arc<NtModel>, messages: u32, isr: PKMESSAGE_SERVICE_ROUTINE) -> INTERRUPT_CONNECTION {
    k.assign_interrupts(PDO, InterruptResources::Messages(messages));
    k.IoConnectInterruptEx(message_parameters(isr)).expect("connect")
}

/// An ISR that runs `body` with the model (the routine's context, as a driver's ServiceContext would be).
fn isr(
    k: &Arc<NtModel>,
    body: impl Fn(&NtModel, PKINTERRUPT, u32) -> bool + Send + Sync + 'static,
) -> PKMESSAGE_SERVICE_ROUTINE {
    let k = Arc::downgrade(k);
    Arc::new(move |interrupt, message| body(&k.upgrade().unwrap(), interrupt, message))
}

fn in_image(k: &NtModel, address: u64) -> bool {
    let (start, end) = k.driver_image_range();
    (start..end).contains(&address)
}

// ---- Interrupts ----

#[test]
fn message_isr_runs_at_the_unified_irql_and_its_dpc_runs_after_it_at_dispatch() {
    let k = machine(STANDARD);
    let log = Log::default();
    let dpc = logging_dpc(&k, &log, "dpc");
    let l = log.clone();
    let connection = connect(
        &k,
        4,
        isr(&k, move |k, interrupt, message| {
            l.push(format!("isr {message}@{}", k.KeGetCurrentIrql()));
            assert!(!interrupt.is_null());
            assert!(k.KeInsertQueueDpc(dpc, PVOID(message as u64), PVOID::NULL));
            l.push("isr returns");
            true
        }),
    );
    let INTERRUPT_CONNECTION::MessageBased(info) = &connection else { panic!("message-based expected") };
    assert_eq!(connection.Version(), CONNECT_MESSAGE_BASED);
    assert_eq!(info.UnifiedIrql, DEVICE_DIRQL);
    assert!(info.UnifiedIrql > DISPATCH_LEVEL);
    assert_eq!(info.MessageInfo.len(), 4);
    assert!(info.MessageInfo.iter().all(|m| m.Irql == DEVICE_DIRQL && m.Mode == KINTERRUPT_MODE::Latched));
    clean(|| assert!(k.deliver(PDO, 2)));
    assert_eq!(log.take(), ["isr 2@5", "isr returns", "dpc@2 0x2 0x0"]);
    assert_eq!(k.KeGetCurrentIrql(), PASSIVE_LEVEL);
    // A message the device was not given, and a device nothing is connected for: no ISR runs.
    assert!(!k.deliver(PDO, 4));
    assert!(!k.deliver(PDEVICE_OBJECT(0x1234), 0));
    assert!(log.take().is_empty());
    clean(|| k.IoDisconnectInterruptEx(&connection));
    assert!(!k.deliver(PDO, 2), "disconnected");
    assert!(log.take().is_empty());
}

#[test]
fn the_isr_holds_the_interrupt_spin_lock_so_taking_it_again_is_a_self_deadlock_c4_1000() {
    let k = machine(DEADLOCK);
    let _connection = connect(
        &k,
        1,
        isr(&k, |k, interrupt, _| {
            let _ = k.KeAcquireInterruptSpinLock(interrupt);
            true
        }),
    );
    let b = stop(|| {
        k.deliver(PDO, 0);
    });
    assert_eq!(b.code, DRIVER_VERIFIER_DETECTED_VIOLATION);
    assert_eq!(b.params[0], 0x1000);
    // Outside the ISR the same lock is free: KeSynchronizeExecution takes it and raises to the ISR's IRQL.
    let k = machine(STANDARD);
    let connection2 = connect(&k, 1, isr(&k, |_, _, _| true));
    let interrupt = connection2.InterruptObject();
    let mut seen = None;
    let r = clean(|| {
        k.KeSynchronizeExecution(interrupt, &mut || {
            seen = Some(k.KeGetCurrentIrql());
            true
        })
    });
    assert!(r);
    assert_eq!(seen, Some(DEVICE_DIRQL));
    assert_eq!(k.KeGetCurrentIrql(), PASSIVE_LEVEL);
    let old = clean(|| k.KeAcquireInterruptSpinLock(interrupt));
    assert_eq!((old, k.KeGetCurrentIrql()), (PASSIVE_LEVEL, DEVICE_DIRQL));
    clean(|| k.KeReleaseInterruptSpinLock(interrupt, old));
    assert_eq!(k.KeGetCurrentIrql(), PASSIVE_LEVEL);
}

#[test]
fn an_isr_holding_off_a_synchronize_routine_makes_it_wait() {
    let k = machine(STANDARD);
    let (entered_tx, entered_rx) = mpsc::channel();
    let release = Arc::new(Barrier::new(2));
    let r2 = release.clone();
    let connection = connect(
        &k,
        1,
        isr(&k, move |_, _, _| {
            entered_tx.send(()).unwrap();
            r2.wait();
            true
        }),
    );
    let interrupt = connection.InterruptObject();
    let k2 = k.clone();
    let platform = std::thread::spawn(move || k2.deliver(PDO, 0));
    entered_rx.recv().unwrap();
    let synchronized = Arc::new(AtomicBool::new(false));
    let (k3, s2) = (k.clone(), synchronized.clone());
    let driver = std::thread::spawn(move || {
        k3.KeSynchronizeExecution(interrupt, &mut || {
            s2.store(true, Ordering::SeqCst);
            true
        })
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(!synchronized.load(Ordering::SeqCst), "ran while the ISR held the interrupt spin lock");
    release.wait();
    assert!(platform.join().unwrap());
    assert!(driver.join().unwrap());
    assert!(synchronized.load(Ordering::SeqCst));
}

#[test]
fn line_based_fallback_and_connect_failures() {
    let k = machine(STANDARD);
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let fallback: PKSERVICE_ROUTINE = Arc::new(move |_| {
        c.fetch_add(1, Ordering::SeqCst);
        true
    });
    let unused = isr(&k, |_, _, _| panic!("the message routine must not run for a line-based interrupt"));
    let mut p = message_parameters(unused.clone());
    assert_eq!(k.IoConnectInterruptEx(p.clone()), Err(STATUS_NOT_FOUND), "no interrupt resources");
    k.assign_interrupts(PDO, InterruptResources::Line);
    assert_eq!(k.IoConnectInterruptEx(p.clone()), Err(STATUS_INVALID_DEVICE_REQUEST), "line only, no fallback");
    p.FallBackServiceRoutine = Some(fallback);
    let connection = k.IoConnectInterruptEx(p.clone()).expect("fallback connects");
    assert_eq!(connection.Version(), CONNECT_LINE_BASED);
    assert!(matches!(connection, INTERRUPT_CONNECTION::LineBased(i) if !i.is_null()));
    assert_eq!(k.IoConnectInterruptEx(p.clone()), Err(STATUS_INVALID_DEVICE_REQUEST), "already connected");
    clean(|| assert!(k.deliver(PDO, 0)));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    p.PhysicalDeviceObject = PDEVICE_OBJECT::NULL;
    assert_eq!(k.IoConnectInterruptEx(p), Err(STATUS_INVALID_PARAMETER));
}

#[test]
fn isr_returning_at_another_irql_is_c4_111_with_the_isr_and_both_irqls() {
    let k = machine(IRQL);
    connect(
        &k,
        1,
        isr(&k, |k, _, _| {
            k.KeRaiseIrql(DEVICE_DIRQL + 1);
            true
        }),
    );
    let b = stop(|| {
        k.deliver(PDO, 0);
    });
    assert_eq!(b.code, DRIVER_VERIFIER_DETECTED_VIOLATION);
    assert_eq!((b.params[0], b.params[2], b.params[3]), (0x111, DEVICE_DIRQL as u64, DEVICE_DIRQL as u64 + 1));
    assert!(in_image(&k, b.params[1]), "P2 is the ISR: {:#x}", b.params[1]);
    // An ISR that puts the IRQL back is fine, and without IRQL checking the changed one is not checked.
    let k = machine(IRQL);
    connect(
        &k,
        1,
        isr(&k, |k, _, _| {
            let old = k.KeRaiseIrql(DEVICE_DIRQL + 1);
            k.KeLowerIrql(old);
            true
        }),
    );
    clean(|| assert!(k.deliver(PDO, 0)));
    let k = machine(0);
    connect(
        &k,
        1,
        isr(&k, |k, _, _| {
            k.KeRaiseIrql(DEVICE_DIRQL + 1);
            true
        }),
    );
    clean(|| assert!(k.deliver(PDO, 0)));
    assert_eq!(k.KeGetCurrentIrql(), PASSIVE_LEVEL, "the ISR's context never leaks into the thread");
}

#[test]
fn interrupt_routines_at_the_wrong_irql_are_c4_e5() {
    let k = machine(IRQL);
    k.assign_interrupts(PDO, InterruptResources::Messages(1));
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let b = stop(|| {
        let _ = k.IoConnectInterruptEx(message_parameters(isr(&k, |_, _, _| true)));
    });
    assert_eq!(b, Bugcheck::c4(0xE5, 2, 0, 0));
    let k = machine(IRQL);
    let connection = connect(&k, 1, isr(&k, |_, _, _| true));
    k.KeRaiseIrql(DEVICE_DIRQL + 1);
    assert_eq!(
        stop(|| {
            k.KeSynchronizeExecution(connection.InterruptObject(), &mut || true);
        }),
        Bugcheck::c4(0xE5, DEVICE_DIRQL as u64 + 1, 0, 0)
    );
    let k = machine(IRQL);
    let connection = connect(&k, 1, isr(&k, |_, _, _| true));
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(stop(|| k.IoDisconnectInterruptEx(&connection)), Bugcheck::c4(0xE5, 2, 0, 0));
}

/// The IRQL rules of pool, spin locks, events, waits and DMA reach an ISR's DIRQL.
#[test]
fn pool_spin_locks_events_waits_and_dma_in_an_isr_see_its_dirql() {
    let dirql = DEVICE_DIRQL as u64;
    let k = machine(IRQL);
    connect(
        &k,
        1,
        isr(&k, |k, _, _| {
            let _ = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 64, TAG);
            true
        }),
    );
    assert_eq!(stop(|| k.deliver(PDO, 0)), Bugcheck::c4(0x02, dirql, 0, 64));

    let k = machine(IRQL);
    let lock = k.KeInitializeSpinLock();
    connect(
        &k,
        1,
        isr(&k, move |k, _, _| {
            let _ = k.KeAcquireSpinLock(lock);
            true
        }),
    );
    assert_eq!(stop(|| k.deliver(PDO, 0)), Bugcheck::c4(0x42, dirql, lock.0, 0));

    let k = machine(IRQL);
    let event = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    connect(
        &k,
        1,
        isr(&k, move |k, _, _| {
            k.KeSetEvent(event, 0, false);
            true
        }),
    );
    assert_eq!(stop(|| k.deliver(PDO, 0)), Bugcheck::c4(0x80, dirql, event.0, 0));

    let k = machine(IRQL);
    let event = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, true);
    connect(
        &k,
        1,
        isr(&k, move |k, _, _| {
            k.KeWaitForSingleObject(event.into(), KWAIT_REASON::Executive, KPROCESSOR_MODE::KernelMode, false, Some(0));
            true
        }),
    );
    assert_eq!(stop(|| k.deliver(PDO, 0)), Bugcheck::c4(0x120, dirql, event.0, 0));

    let k = machine(DMA);
    let mut n = 0;
    let adapter = k.IoGetDmaAdapter(PDO, &DEVICE_DESCRIPTION::bus_master_64(64 * 1024), &mut n);
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 4096, TAG);
    let mdl = k.IoAllocateMdl(va, 4096, false, false);
    k.MmBuildMdlForNonPagedPool(mdl);
    connect(
        &k,
        1,
        isr(&k, move |k, _, _| {
            k.GetScatterGatherList(adapter, PDO, mdl, va, 4096, Box::new(|_, _| {}), true);
            true
        }),
    );
    assert_eq!(stop(|| k.deliver(PDO, 0)), Bugcheck::e6(0x13, 1, 2, dirql));
}

// ---- DPCs ----

#[test]
fn a_dpc_queued_below_dispatch_runs_at_once_at_dispatch_with_its_arguments() {
    let k = machine(STANDARD);
    let log = Log::default();
    let dpc = logging_dpc(&k, &log, "a");
    assert!(clean(|| k.KeInsertQueueDpc(dpc, PVOID(1), PVOID(2))));
    assert_eq!(log.take(), ["a@2 0x1 0x2"]);
    assert_eq!(k.KeGetCurrentIrql(), PASSIVE_LEVEL);
    assert_eq!(k.KeGetCurrentProcessorNumber(), 0);
}

#[test]
fn dpcs_queued_at_dispatch_run_once_each_in_order_when_the_irql_drops() {
    let k = machine(STANDARD);
    let log = Log::default();
    let (a, b) = (logging_dpc(&k, &log, "a"), logging_dpc(&k, &log, "b"));
    let lock = k.KeInitializeSpinLock();
    clean(|| {
        let old = k.KeAcquireSpinLock(lock);
        assert!(k.KeInsertQueueDpc(a, PVOID::NULL, PVOID::NULL));
        assert!(!k.KeInsertQueueDpc(a, PVOID(9), PVOID::NULL), "a DPC is queued at most once");
        assert!(k.KeInsertQueueDpc(b, PVOID::NULL, PVOID::NULL));
        assert!(log.take().is_empty(), "nothing runs at DISPATCH_LEVEL");
        k.KeReleaseSpinLock(lock, old);
    });
    assert_eq!(log.take(), ["a@2 0x0 0x0", "b@2 0x0 0x0"]);
}

#[test]
fn a_dpc_removed_before_it_ran_never_runs() {
    let k = machine(STANDARD);
    let log = Log::default();
    let a = logging_dpc(&k, &log, "a");
    clean(|| {
        let old = k.KeRaiseIrql(DISPATCH_LEVEL);
        assert!(!k.KeRemoveQueueDpc(a), "not queued");
        k.KeInsertQueueDpc(a, PVOID::NULL, PVOID::NULL);
        assert!(k.KeRemoveQueueDpc(a));
        assert!(!k.KeRemoveQueueDpc(a));
        k.KeLowerIrql(old);
    });
    assert!(log.take().is_empty());
}

#[test]
fn flush_returns_when_every_queued_dpc_has_run_and_only_at_passive() {
    let k = machine(STANDARD);
    let log = Log::default();
    let a = logging_dpc(&k, &log, "a");
    // Queued on processor 0 by a thread that holds it at DISPATCH_LEVEL: a flush elsewhere waits until that
    // processor drops below and runs it (before, a single-processor model let the flushing thread run it).
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    k.KeInsertQueueDpc(a, PVOID::NULL, PVOID::NULL);
    let k2 = k.clone();
    let flusher = std::thread::spawn(move || clean(|| k2.run_on_processor(1, || k2.KeFlushQueuedDpcs())));
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(!flusher.is_finished(), "the flush waits for processor 0's queue");
    assert_eq!(stop(|| k.KeFlushQueuedDpcs()), Bugcheck::c4(0xE5, 2, 0, 0));
    k.KeLowerIrql(old);
    flusher.join().unwrap();
    assert_eq!(log.take(), ["a@2 0x0 0x0"]);
}

#[test]
fn dpc_for_isr_runs_with_its_device_and_context_and_io_request_dpc_wants_dirql() {
    let k = machine(STANDARD);
    let log = Log::default();
    let (k2, l) = (Arc::downgrade(&k), log.clone());
    k.IoInitializeDpcRequest(
        PDO,
        Arc::new(move |_, device, context| {
            let irql = k2.upgrade().unwrap().KeGetCurrentIrql();
            l.push(format!("dpc for isr@{irql} {:#x} {:#x}", device.0, context.0));
        }),
    );
    connect(
        &k,
        1,
        isr(&k, |k, _, _| {
            k.IoRequestDpc(PDO, PVOID(0x77));
            true
        }),
    );
    clean(|| assert!(k.deliver(PDO, 0)));
    assert_eq!(log.take(), [format!("dpc for isr@2 {:#x} 0x77", PDO.0)]);
    assert_eq!(stop(|| k.IoRequestDpc(PDO, PVOID::NULL)), Bugcheck::c4(0xE5, 0, 0, 0));
}

#[test]
fn spin_lock_at_dpc_level_below_dispatch_is_c4_40_and_41() {
    let k = machine(IRQL);
    let lock = k.KeInitializeSpinLock();
    assert_eq!(stop(|| k.KeAcquireSpinLockAtDpcLevel(lock)), Bugcheck::c4(0x40, 0, lock.0, 0));
    let k = machine(IRQL);
    let lock = k.KeInitializeSpinLock();
    assert_eq!(stop(|| k.KeReleaseSpinLockFromDpcLevel(lock)), Bugcheck::c4(0x41, 0, lock.0, 0));
    // In a DPC, at DISPATCH_LEVEL, both are right and the IRQL stays.
    let k = machine(STANDARD);
    let lock = k.KeInitializeSpinLock();
    let k2 = Arc::downgrade(&k);
    let dpc = k.KeInitializeDpc(Arc::new(move |_, _, _| {
        let k = k2.upgrade().unwrap();
        k.KeAcquireSpinLockAtDpcLevel(lock);
        assert_eq!(k.KeGetCurrentIrql(), DISPATCH_LEVEL);
        k.KeReleaseSpinLockFromDpcLevel(lock);
    }));
    clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
}

// ---- The DPC watchdog (0x133) ----

#[test]
fn a_dpc_over_its_allotment_is_133_p1_0_with_its_ticks_and_the_allotment() {
    let k = machine(0);
    let k2 = Arc::downgrade(&k);
    // 1.1 s at 15.625 ms a tick: 70 ticks against 64.
    let dpc = k.KeInitializeDpc(Arc::new(move |_, _, _| k2.upgrade().unwrap().KeStallExecutionProcessor(1_100_000)));
    let b = stop(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
    assert_eq!(b, Bugcheck::new(DPC_WATCHDOG_VIOLATION, 0, 70, 64, 0));
    assert_eq!(b.name(), "DPC_WATCHDOG_VIOLATION");
    assert_eq!(k.KeGetCurrentIrql(), PASSIVE_LEVEL);
    // 0.9 s is inside it.
    let k = machine(0);
    let k2 = Arc::downgrade(&k);
    let dpc = k.KeInitializeDpc(Arc::new(move |_, _, _| k2.upgrade().unwrap().KeStallExecutionProcessor(900_000)));
    clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
}

#[test]
fn an_isr_over_its_allotment_is_133_p1_0_too() {
    let k = machine(0);
    connect(
        &k,
        1,
        isr(&k, |k, _, _| {
            k.KeStallExecutionProcessor(2_000_000);
            true
        }),
    );
    assert_eq!(stop(|| k.deliver(PDO, 0)), Bugcheck::new(DPC_WATCHDOG_VIOLATION, 0, 128, 64, 0));
}

#[test]
fn a_dpc_that_spins_past_its_allotment_is_caught_by_the_clock_interrupt() {
    // No stall: time passes on the clock (another processor's clock interrupt sees the DPC still running).
    let k = machine(0);
    let k2 = Arc::downgrade(&k);
    let dpc = k.KeInitializeDpc(Arc::new(move |_, _, _| k2.upgrade().unwrap().advance_clock(Duration::from_secs(2))));
    assert_eq!(
        stop(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL)),
        Bugcheck::new(DPC_WATCHDOG_VIOLATION, 0, 128, 64, 0)
    );
}

#[test]
fn dpcs_back_to_back_past_the_watchdog_period_are_133_p1_1() {
    // Six DPCs of 0.9 s each: every one inside its allotment, 5.4 s at DISPATCH_LEVEL in one stretch (> 5 s).
    let k = machine(0);
    let ran = Arc::new(AtomicU32::new(0));
    let dpcs: Vec<PKDPC> = (0..6)
        .map(|_| {
            let (k2, ran) = (Arc::downgrade(&k), ran.clone());
            k.KeInitializeDpc(Arc::new(move |_, _, _| {
                ran.fetch_add(1, Ordering::SeqCst);
                k2.upgrade().unwrap().KeStallExecutionProcessor(900_000);
            }))
        })
        .collect();
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    for d in &dpcs {
        k.KeInsertQueueDpc(*d, PVOID::NULL, PVOID::NULL);
    }
    assert_eq!(stop(|| k.KeLowerIrql(old)), Bugcheck::new(DPC_WATCHDOG_VIOLATION, 1, 320, 0, 0));
    assert_eq!(ran.load(Ordering::SeqCst), 6);
    // Five fit.
    let k = machine(0);
    let dpcs: Vec<PKDPC> = (0..5)
        .map(|_| {
            let k2 = Arc::downgrade(&k);
            k.KeInitializeDpc(Arc::new(move |_, _, _| k2.upgrade().unwrap().KeStallExecutionProcessor(900_000)))
        })
        .collect();
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    for d in &dpcs {
        k.KeInsertQueueDpc(*d, PVOID::NULL, PVOID::NULL);
    }
    clean(|| k.KeLowerIrql(old));
}

#[test]
fn a_thread_kept_at_dispatch_past_the_period_is_133_p1_1_and_dropping_below_ends_the_stretch() {
    let k = machine(0);
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    clean(|| (0..5).for_each(|_| k.KeStallExecutionProcessor(1_000_000)));
    assert_eq!(stop(|| k.KeStallExecutionProcessor(1_000_000)), Bugcheck::new(DPC_WATCHDOG_VIOLATION, 1, 320, 0, 0));
    let _ = old;
    // 4 s, below DISPATCH_LEVEL, 4 s again: two stretches, neither over.
    let k = machine(0);
    clean(|| {
        for _ in 0..2 {
            let old = k.KeRaiseIrql(DISPATCH_LEVEL);
            (0..4).for_each(|_| k.KeStallExecutionProcessor(1_000_000));
            k.KeLowerIrql(old);
        }
    });
}

#[test]
fn the_watchdog_limits_and_tick_are_knobs_and_0_turns_a_check_off() {
    let timing = TimingConfig {
        clock: ClockSource::Manual,
        tick: Duration::from_millis(1),
        dpc_time_limit: 10,
        dpc_watchdog_limit: 0,
    };
    let k = machine_timed(0, timing);
    let k2 = Arc::downgrade(&k);
    let dpc = k.KeInitializeDpc(Arc::new(move |_, _, _| k2.upgrade().unwrap().KeStallExecutionProcessor(11_000)));
    assert_eq!(
        stop(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL)),
        Bugcheck::new(DPC_WATCHDOG_VIOLATION, 0, 11, 10, 0)
    );
    // The cumulative check is off: an hour at DISPATCH_LEVEL outside any DPC says nothing.
    let k = machine_timed(0, timing);
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    clean(|| {
        k.advance_clock(Duration::from_secs(3600));
        k.KeLowerIrql(old);
    });
    let k = machine_timed(0, TimingConfig { dpc_time_limit: 0, ..timing });
    let k2 = Arc::downgrade(&k);
    let dpc = k.KeInitializeDpc(Arc::new(move |_, _, _| k2.upgrade().unwrap().KeStallExecutionProcessor(1_000_000)));
    clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
}

// ---- Work items ----

fn work_item_routine(f: impl FnOnce(PDEVICE_OBJECT) + Send + 'static) -> PIO_WORKITEM_ROUTINE {
    Box::new(f)
}

#[test]
fn a_work_item_runs_on_a_worker_thread_at_passive_and_may_free_itself() {
    let k = machine(STANDARD);
    let item = k.IoAllocateWorkItem(PDO);
    assert!(!item.is_null());
    let (tx, rx) = mpsc::channel();
    let k2 = Arc::downgrade(&k);
    let queuer = std::thread::current().id();
    clean(|| {
        let old = k.KeRaiseIrql(DISPATCH_LEVEL);
        k.IoQueueWorkItem(
            item,
            work_item_routine(move |device| {
                let k = k2.upgrade().unwrap();
                let seen = (k.KeGetCurrentIrql(), device, std::thread::current().id() != queuer);
                k.IoFreeWorkItem(item);
                tx.send(seen).unwrap();
            }),
            WORK_QUEUE_TYPE::DelayedWorkQueue,
        );
        k.KeLowerIrql(old);
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), (PASSIVE_LEVEL, PDO, true));
    assert!(k.bugchecks().is_empty());
}

/// Fills the model's eight system worker threads with routines that wait for the returned barrier, so a work item
/// queued next stays queued.
fn busy_workers(k: &Arc<NtModel>) -> Arc<Barrier> {
    let release = Arc::new(Barrier::new(9));
    let started = Arc::new(Barrier::new(9));
    for _ in 0..8 {
        let item = k.IoAllocateWorkItem(PDO);
        let (release, started) = (release.clone(), started.clone());
        k.IoQueueWorkItem(
            item,
            work_item_routine(move |_| {
                started.wait();
                release.wait();
            }),
            WORK_QUEUE_TYPE::DelayedWorkQueue,
        );
    }
    started.wait();
    release
}

#[test]
fn a_queued_work_item_queued_again_is_e4_1_and_freed_is_e4_2() {
    let k = machine(0);
    let release = busy_workers(&k);
    let item = k.IoAllocateWorkItem(PDO);
    k.IoQueueWorkItem(item, work_item_routine(|_| {}), WORK_QUEUE_TYPE::DelayedWorkQueue);
    assert_eq!(
        stop(|| k.IoQueueWorkItem(item, work_item_routine(|_| {}), WORK_QUEUE_TYPE::CriticalWorkQueue)),
        Bugcheck::new(WORKER_INVALID, 1, item.0, 0, 0)
    );
    let b = stop(|| k.IoFreeWorkItem(item));
    assert_eq!((b.code, b.params[0], b.params[1], b.params[3]), (WORKER_INVALID, 2, item.0, 0));
    assert!(in_image(&k, b.params[2]), "P3 is the worker routine: {:#x}", b.params[2]);
    release.wait();
    // Once it ran, freeing it is fine.
    clean(|| k.unload_driver());
    clean(|| k.IoFreeWorkItem(item));
}

#[test]
fn work_item_routines_above_dispatch_are_c4_e5() {
    let k = machine(IRQL);
    k.KeRaiseIrql(DEVICE_DIRQL);
    assert_eq!(stop(|| k.IoAllocateWorkItem(PDO)), Bugcheck::c4(0xE5, DEVICE_DIRQL as u64, 0, 0));
    let k = machine(IRQL);
    let item = k.IoAllocateWorkItem(PDO);
    k.KeRaiseIrql(DEVICE_DIRQL);
    assert_eq!(
        stop(|| k.IoQueueWorkItem(item, work_item_routine(|_| {}), WORK_QUEUE_TYPE::DelayedWorkQueue)),
        Bugcheck::c4(0xE5, DEVICE_DIRQL as u64, 0, 0)
    );
}

#[test]
fn unload_waits_for_queued_work_items_to_run() {
    let k = machine(STANDARD);
    let item = k.IoAllocateWorkItem(PDO);
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    k.IoQueueWorkItem(
        item,
        work_item_routine(move |_| {
            std::thread::sleep(Duration::from_millis(50));
            d.store(true, Ordering::SeqCst);
        }),
        WORK_QUEUE_TYPE::DelayedWorkQueue,
    );
    clean(|| k.unload_driver());
    assert!(done.load(Ordering::SeqCst));
    k.IoFreeWorkItem(item);
}

// ---- Timers ----

#[test]
fn a_relative_timer_expires_on_the_clock_and_queues_its_dpc() {
    let k = machine(STANDARD);
    let log = Log::default();
    let dpc = logging_dpc(&k, &log, "timer");
    let timer = k.KeInitializeTimer();
    assert!(!clean(|| k.KeSetTimer(timer, -10 * MS, dpc)), "was not set");
    k.advance_clock(Duration::from_millis(9));
    assert!(log.take().is_empty());
    k.advance_clock(Duration::from_millis(1));
    assert_eq!(log.take(), ["timer@2 0x0 0x0"]);
    assert!(!k.KeCancelTimer(timer), "a one-shot timer that expired is no longer set");
    // Set again while set: TRUE, and only the new due time counts.
    k.KeSetTimer(timer, -10 * MS, dpc);
    assert!(k.KeSetTimer(timer, -20 * MS, dpc));
    k.advance_clock(Duration::from_millis(10));
    assert!(log.take().is_empty());
    k.advance_clock(Duration::from_millis(10));
    assert_eq!(log.take().len(), 1);
}

#[test]
fn a_periodic_timer_runs_each_period_until_cancelled() {
    let k = machine(STANDARD);
    let log = Log::default();
    let dpc = logging_dpc(&k, &log, "tick");
    let timer = k.KeInitializeTimerEx(TIMER_TYPE::NotificationTimer);
    k.KeSetTimerEx(timer, -5 * MS, 5, dpc);
    for _ in 0..3 {
        k.advance_clock(Duration::from_millis(5));
    }
    assert_eq!(log.take().len(), 3);
    assert!(k.KeCancelTimer(timer), "a periodic timer stays set");
    k.advance_clock(Duration::from_millis(50));
    assert!(log.take().is_empty());
}

#[test]
fn a_cancelled_timer_never_runs_its_dpc_and_an_absolute_one_expires_at_its_time() {
    let k = machine(STANDARD);
    let log = Log::default();
    let dpc = logging_dpc(&k, &log, "t");
    let timer = k.KeInitializeTimer();
    k.KeSetTimer(timer, -10 * MS, dpc);
    assert!(k.KeCancelTimer(timer));
    k.advance_clock(Duration::from_millis(20));
    assert!(log.take().is_empty());
    let at = k.interrupt_time() as i64 + 7 * MS;
    k.KeSetTimer(timer, at, dpc);
    k.advance_clock(Duration::from_millis(6));
    assert!(log.take().is_empty());
    k.advance_clock(Duration::from_millis(1));
    assert_eq!(log.take().len(), 1);
}

#[test]
fn timer_routines_above_dispatch_are_c4_e5() {
    let k = machine(IRQL);
    k.KeRaiseIrql(DEVICE_DIRQL);
    assert_eq!(stop(|| k.KeInitializeTimer()), Bugcheck::c4(0xE5, DEVICE_DIRQL as u64, 0, 0));
    let k = machine(IRQL);
    let timer = k.KeInitializeTimer();
    k.KeRaiseIrql(DEVICE_DIRQL);
    assert_eq!(stop(|| k.KeSetTimer(timer, -MS, PKDPC::NULL)), Bugcheck::c4(0xE5, DEVICE_DIRQL as u64, 0, 0));
    let k = machine(IRQL);
    let timer = k.KeInitializeTimer();
    k.KeRaiseIrql(DEVICE_DIRQL);
    assert_eq!(stop(|| k.KeCancelTimer(timer)), Bugcheck::c4(0xE5, DEVICE_DIRQL as u64, 0, 0));
    // At DISPATCH_LEVEL all three are allowed.
    let k = machine(IRQL);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    clean(|| {
        let timer = k.KeInitializeTimer();
        k.KeSetTimer(timer, -MS, PKDPC::NULL);
        k.KeCancelTimer(timer);
    });
}

// ---- Events and waits ----

fn wait(k: &NtModel, object: impl Into<DISPATCHER_OBJECT>, timeout: Option<i64>) -> NTSTATUS {
    k.KeWaitForSingleObject(object.into(), KWAIT_REASON::Executive, KPROCESSOR_MODE::KernelMode, false, timeout)
}

#[test]
fn notification_and_synchronization_events() {
    let k = machine(STANDARD);
    let n = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    assert_eq!(wait(&k, n, Some(0)), STATUS_TIMEOUT);
    assert_eq!(k.KeSetEvent(n, 0, false), 0);
    assert_ne!(k.KeSetEvent(n, 0, false), 0, "returns the previous state");
    assert_eq!(wait(&k, n, None), STATUS_SUCCESS);
    assert_eq!(wait(&k, n, Some(0)), STATUS_SUCCESS, "a notification event stays signaled");
    k.KeClearEvent(n);
    assert_eq!(wait(&k, n, Some(0)), STATUS_TIMEOUT);
    let s = k.KeInitializeEvent(EVENT_TYPE::SynchronizationEvent, true);
    assert_eq!(wait(&k, s, Some(0)), STATUS_SUCCESS);
    assert_eq!(wait(&k, s, Some(0)), STATUS_TIMEOUT, "the satisfied wait cleared it");
    assert!(k.bugchecks().is_empty());
}

#[test]
fn a_waiter_wakes_when_another_thread_sets_the_event_or_its_timeout_passes_on_the_clock() {
    let k = machine(STANDARD);
    let e = k.KeInitializeEvent(EVENT_TYPE::SynchronizationEvent, false);
    let k2 = k.clone();
    let waiter = std::thread::spawn(move || wait(&k2, e, None));
    std::thread::sleep(Duration::from_millis(20));
    k.KeSetEvent(e, 0, false);
    assert_eq!(waiter.join().unwrap(), STATUS_SUCCESS);
    // An absolute timeout, fixed before the waiter starts, so the test does not race the waiter's start.
    let (k2, at) = (k.clone(), k.interrupt_time() as i64 + 10 * MS);
    let waiter = std::thread::spawn(move || wait(&k2, e, Some(at)));
    std::thread::sleep(Duration::from_millis(20));
    assert!(!waiter.is_finished(), "a manual clock has not moved");
    k.advance_clock(Duration::from_millis(10));
    assert_eq!(waiter.join().unwrap(), STATUS_TIMEOUT);
    // On the host clock the timeout passes by itself.
    let k = machine_timed(STANDARD, TimingConfig::default());
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    assert_eq!(wait(&k, e, Some(-MS)), STATUS_TIMEOUT);
}

#[test]
fn a_thread_waiting_on_a_timer_wakes_when_it_expires() {
    let k = machine(STANDARD);
    let t = k.KeInitializeTimerEx(TIMER_TYPE::SynchronizationTimer);
    k.KeSetTimer(t, -10 * MS, PKDPC::NULL);
    let k2 = k.clone();
    let waiter = std::thread::spawn(move || (wait(&k2, t, None), wait(&k2, t, Some(0))));
    std::thread::sleep(Duration::from_millis(20));
    k.advance_clock(Duration::from_millis(10));
    assert_eq!(waiter.join().unwrap(), (STATUS_SUCCESS, STATUS_TIMEOUT), "a synchronization timer resets");
    // On the host clock the waiter expires the timer itself when its time comes.
    let k = machine_timed(STANDARD, TimingConfig::default());
    let t = k.KeInitializeTimer();
    k.KeSetTimer(t, -2 * MS, PKDPC::NULL);
    assert_eq!(wait(&k, t, None), STATUS_SUCCESS);
    assert_eq!(wait(&k, t, Some(0)), STATUS_SUCCESS, "a notification timer stays signaled");
}

#[test]
fn waits_at_dispatch_are_c4_121_without_a_timeout_122_with_one_and_fine_with_zero() {
    // Signaled events: without the check the wait would return at once instead of hanging the test.
    let k = machine(IRQL);
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, true);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(stop(|| wait(&k, e, None)), Bugcheck::c4(0x121, 2, e.0, 0));
    let k = machine(IRQL);
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, true);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(stop(|| wait(&k, e, Some(-10 * MS))), Bugcheck::c4(0x122, 2, e.0, (-10 * MS) as u64));
    let k = machine(IRQL);
    let t = k.KeInitializeTimer();
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(clean(|| wait(&k, t, Some(0))), STATUS_TIMEOUT);
    // At APC_LEVEL a timeout is fine.
    let k = machine(IRQL);
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, true);
    k.KeRaiseIrql(APC_LEVEL);
    assert_eq!(clean(|| wait(&k, e, Some(-10 * MS))), STATUS_SUCCESS);
    // Without IRQL checking nothing is checked, and a thread that raised its own IRQL is no DPC: its wait blocks
    // (no 0xB8, which Microsoft names for DPC routines only).
    let k = machine(0);
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let (k2, at) = (k.clone(), k.interrupt_time() as i64 + MS);
    let waiter = std::thread::spawn(move || {
        k2.KeRaiseIrql(DISPATCH_LEVEL);
        wait(&k2, e, Some(at))
    });
    std::thread::sleep(Duration::from_millis(10));
    k.advance_clock(Duration::from_millis(1));
    assert_eq!(waiter.join().unwrap(), STATUS_TIMEOUT);
}

#[test]
fn a_wait_in_a_dpc_without_a_timeout_is_c4_121() {
    let k = machine(IRQL);
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, true);
    let k2 = Arc::downgrade(&k);
    let dpc = k.KeInitializeDpc(Arc::new(move |_, _, _| {
        wait(&k2.upgrade().unwrap(), e, None);
    }));
    assert_eq!(stop(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL)), Bugcheck::c4(0x121, 2, e.0, 0));
}

// ---- 0xB8: a wait that would block, in a DPC or an ISR ----

/// What a waiting DPC saw: an address on its stack taken just before the wait, and what the wait returned.
#[derive(Default, Clone)]
struct WaitSeen {
    stack: Arc<AtomicU64>,
    status: Arc<Mutex<Option<NTSTATUS>>>,
}

/// A DPC that waits on `object` with `timeout`.
fn waiting_dpc(k: &Arc<NtModel>, object: impl Into<DISPATCHER_OBJECT>, timeout: Option<i64>) -> (PKDPC, WaitSeen) {
    let (k2, object, seen) = (Arc::downgrade(k), object.into(), WaitSeen::default());
    let s = seen.clone();
    let dpc = k.KeInitializeDpc(Arc::new(move |_, _, _| {
        let here = 0u8;
        s.stack.store(std::ptr::addr_of!(here) as u64, Ordering::SeqCst);
        *s.status.lock().unwrap() = Some(wait(&k2.upgrade().unwrap(), object, timeout));
    }));
    (dpc, seen)
}

/// The bugcheck `f` raises on a thread of its own (a processor whose thread a DPC borrows); a wait that blocks
/// instead fails the test after 5 s rather than hanging it.
fn stop_on_thread(f: impl FnOnce() + Send + 'static) -> Bugcheck {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(NtModel::run_guarded(f)));
    match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(Err(b)) => b,
        Ok(Ok(())) => panic!("expected a bugcheck, the wait returned"),
        Err(_) => panic!("no bugcheck in 5 s: the wait blocked"),
    }
}

fn queue(k: &Arc<NtModel>, dpc: PKDPC) -> impl FnOnce() + Send + 'static {
    let k = k.clone();
    move || {
        k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL);
    }
}

/// The model's thread stand-ins (ETHREAD addresses): 0xFFFFB000'00000000 up.
fn is_thread(p: u64) -> bool {
    (0xFFFF_B000_0000_0000..0xFFFF_C000_0000_0000).contains(&p)
}

#[test]
fn a_dpc_whose_wait_would_block_is_b8_with_the_threads_and_its_stack_in_every_mode_but_irql_checking() {
    for timeout in [Some(-10 * MS), None] {
        let k = machine(0);
        let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
        let (dpc, seen) = waiting_dpc(&k, e, timeout);
        let b = stop_on_thread(queue(&k, dpc));
        assert_eq!((b.code, b.name(), b.params[3]), (0xB8, "ATTEMPTED_SWITCH_FROM_DPC", 0), "{b}");
        let (original, new, stack) = (b.params[0], b.params[1], b.params[2]);
        assert!(is_thread(original) && is_thread(new) && original != new, "P1 and P2 are two threads: {b}");
        let dpc_stack = seen.stack.load(Ordering::SeqCst);
        assert!(stack.abs_diff(dpc_stack) < 64 * 1024, "P3 {stack:#x} is not on the DPC's stack ({dpc_stack:#x})");
        assert_eq!(*seen.status.lock().unwrap(), None, "the wait never returned");
        // Another processor's thread is another original thread; the processor switches to its idle thread.
        let again = stop_on_thread(queue(&k, dpc));
        assert_ne!(again.params[0], original, "P1 is the thread the DPC borrowed");
        assert_eq!(again.params[1], new, "P2 is processor 0's idle thread");
    }
    // IRQL checking stops the call first, at DISPATCH_LEVEL with a non-zero timeout; with that rule off the
    // kernel's own stop is what is left.
    let k = machine(IRQL);
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let (dpc, _) = waiting_dpc(&k, e, Some(-10 * MS));
    assert_eq!(stop_on_thread(queue(&k, dpc)), Bugcheck::c4(0x122, 2, e.0, (-10 * MS) as u64));
    let config = NtModelConfig {
        verifier: VerifierFlags(STANDARD),
        disabled_rules: vec![RuleId::parse("0xC4/0x122").unwrap()],
        ..NtModelConfig::default()
    };
    let k = NtModel::for_tests_with_timing(config, TimingConfig { clock: ClockSource::Manual, ..Default::default() }).0;
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let (dpc, _) = waiting_dpc(&k, e, Some(-10 * MS));
    assert_eq!(stop_on_thread(queue(&k, dpc)).code, 0xB8);
}

#[test]
fn a_dpc_wait_that_need_not_block_returns_in_every_mode() {
    for flags in [0, IRQL] {
        // A zero timeout tests and returns: legal at DISPATCH_LEVEL.
        let k = machine(flags);
        let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
        let (dpc, seen) = waiting_dpc(&k, e, Some(0));
        clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
        assert_eq!(*seen.status.lock().unwrap(), Some(STATUS_TIMEOUT), "flags {flags:#x}");
    }
    // A signaled object satisfies the wait without a switch (IRQL checking would stop the timeout itself).
    let k = machine(0);
    let e = k.KeInitializeEvent(EVENT_TYPE::SynchronizationEvent, true);
    let (dpc, seen) = waiting_dpc(&k, e, Some(-10 * MS));
    clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
    assert_eq!(*seen.status.lock().unwrap(), Some(STATUS_SUCCESS));
    // A timer whose time came while no clock interrupt ran yet is expired by the wait, not refused (a host clock:
    // a manual one only moves with its interrupt).
    let k = machine_timed(0, TimingConfig::default());
    let t = k.KeInitializeTimer();
    k.KeSetTimer(t, -MS, PKDPC::NULL);
    std::thread::sleep(Duration::from_millis(5));
    let (dpc, seen) = waiting_dpc(&k, t, Some(-10 * MS));
    clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
    assert_eq!(*seen.status.lock().unwrap(), Some(STATUS_SUCCESS));
    assert!(k.bugchecks().is_empty());
}

#[test]
fn an_isr_whose_wait_would_block_is_b8_and_one_that_tests_and_returns_is_not() {
    let k = machine(0);
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let returned = Arc::new(AtomicBool::new(false));
    let r = returned.clone();
    connect(
        &k,
        1,
        isr(&k, move |k, _, _| {
            assert_eq!(wait(k, e, Some(0)), STATUS_TIMEOUT);
            wait(k, e, Some(-10 * MS));
            r.store(true, Ordering::SeqCst);
            true
        }),
    );
    let k2 = k.clone();
    let b = stop_on_thread(move || {
        k2.deliver(PDO, 0);
    });
    assert_eq!((b.code, b.params[3]), (0xB8, 0), "{b}");
    assert!(is_thread(b.params[0]) && is_thread(b.params[1]), "{b}");
    assert!(!returned.load(Ordering::SeqCst));
}

#[test]
fn with_b8_disabled_the_dpcs_wait_blocks_its_thread_until_the_timeout() {
    let config = NtModelConfig { disabled_rules: vec![RuleId::parse("0xB8").unwrap()], ..NtModelConfig::default() };
    let k = NtModel::for_tests_with_timing(config, TimingConfig { clock: ClockSource::Manual, ..Default::default() }).0;
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    let (dpc, seen) = waiting_dpc(&k, e, Some(-10 * MS));
    let k2 = k.clone();
    let waiter = std::thread::spawn(move || clean(|| k2.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL)));
    std::thread::sleep(Duration::from_millis(20));
    assert!(!waiter.is_finished(), "a manual clock has not moved");
    k.advance_clock(Duration::from_millis(10));
    assert!(waiter.join().unwrap());
    assert_eq!(*seen.status.lock().unwrap(), Some(STATUS_TIMEOUT));
    assert!(k.bugchecks().is_empty());
}

// ---- 0xB8 for a KMUTEX wait and for KeDelayExecutionThread ----

/// A model whose `rules` are disabled, on a manual clock.
fn machine_without(flags: u32, rules: &[&str]) -> Arc<NtModel> {
    let config = NtModelConfig {
        verifier: VerifierFlags(flags),
        disabled_rules: rules.iter().map(|r| RuleId::parse(r).unwrap()).collect(),
        ..NtModelConfig::default()
    };
    NtModel::for_tests_with_timing(config, TimingConfig { clock: ClockSource::Manual, ..Default::default() }).0
}

/// A thread of its own takes `m` and holds it until the returned sender is dropped.
fn owned_elsewhere(k: &Arc<NtModel>, m: PKMUTEX) -> mpsc::Sender<()> {
    let (k, (taken_tx, taken_rx), (release_tx, release_rx)) = (k.clone(), mpsc::channel(), mpsc::channel::<()>());
    std::thread::spawn(move || {
        k.KeWaitForMutexObject(m);
        taken_tx.send(()).unwrap();
        let _ = release_rx.recv();
        k.KeReleaseMutex(m, false);
    });
    taken_rx.recv().unwrap();
    release_tx
}

/// A DPC that waits for `m` (KeWaitForMutexObject), releases it, and notes what the wait returned.
fn mutex_dpc(k: &Arc<NtModel>, m: PKMUTEX) -> (PKDPC, WaitSeen) {
    let (k2, seen) = (Arc::downgrade(k), WaitSeen::default());
    let s = seen.clone();
    let dpc = k.KeInitializeDpc(Arc::new(move |_, _, _| {
        let k = k2.upgrade().unwrap();
        let status = k.KeWaitForMutexObject(m);
        *s.status.lock().unwrap() = Some(status);
        k.KeReleaseMutex(m, false);
    }));
    (dpc, seen)
}

#[test]
fn a_dpc_waiting_for_a_mutex_another_thread_owns_is_b8_and_one_it_can_take_is_not() {
    let k = machine(0);
    let m = k.KeInitializeMutex(0);
    let owner = owned_elsewhere(&k, m);
    let (dpc, seen) = mutex_dpc(&k, m);
    let b = stop_on_thread(queue(&k, dpc));
    assert_eq!((b.code, b.params[3]), (0xB8, 0), "{b}");
    assert!(is_thread(b.params[0]) && is_thread(b.params[1]) && b.params[0] != b.params[1], "{b}");
    assert_eq!(*seen.status.lock().unwrap(), None, "the wait never returned");
    drop(owner);
    // Free, the DPC takes it at once; owned by the thread the DPC borrowed, it takes it again (a KMUTEX is
    // recursive, and its owner is that thread). Neither switches.
    let k = machine(0);
    let m = k.KeInitializeMutex(0);
    let (dpc, seen) = mutex_dpc(&k, m);
    clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
    assert_eq!(*seen.status.lock().unwrap(), Some(STATUS_SUCCESS));
    *seen.status.lock().unwrap() = None;
    clean(|| {
        k.KeWaitForMutexObject(m);
        k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL);
        k.KeReleaseMutex(m, false);
    });
    assert_eq!(*seen.status.lock().unwrap(), Some(STATUS_SUCCESS));
    assert!(k.bugchecks().is_empty());
}

#[test]
fn a_mutex_wait_in_a_dpc_or_an_isr_is_irql_checkings_c4_first_and_b8_after_it() {
    // IRQL checking stops a DPC's mutex wait (no timeout) at DISPATCH_LEVEL, before the kernel would switch.
    let k = machine(IRQL);
    let m = k.KeInitializeMutex(0);
    let _owner = owned_elsewhere(&k, m);
    let (dpc, _) = mutex_dpc(&k, m);
    assert_eq!(stop_on_thread(queue(&k, dpc)), Bugcheck::c4(0x121, 2, m.0, 0));
    // With that rule off the kernel's 0xB8 is what is left, deadlock detection's bookkeeping passed.
    let k = machine_without(STANDARD, &["0xC4/0x121"]);
    let m = k.KeInitializeMutex(0);
    let _owner = owned_elsewhere(&k, m);
    let (dpc, _) = mutex_dpc(&k, m);
    assert_eq!(stop_on_thread(queue(&k, dpc)).code, 0xB8);
    // An ISR: 0xC4/0x120 at its DIRQL with IRQL checking, 0xB8 without.
    for (flags, expected) in [(IRQL, 0xC4), (0, 0xB8)] {
        let k = machine(flags);
        let m = k.KeInitializeMutex(0);
        let _owner = owned_elsewhere(&k, m);
        connect(
            &k,
            1,
            isr(&k, move |k, _, _| {
                k.KeWaitForMutexObject(m);
                true
            }),
        );
        let k2 = k.clone();
        let b = stop_on_thread(move || {
            k2.deliver(PDO, 0);
        });
        assert_eq!(b.code, expected, "{b}");
        if expected == 0xC4 {
            assert_eq!(b, Bugcheck::c4(0x120, u64::from(DEVICE_DIRQL), m.0, 0));
        } else {
            assert!(is_thread(b.params[0]) && b.params[3] == 0, "{b}");
        }
    }
}

#[test]
fn with_b8_disabled_a_dpcs_mutex_wait_blocks_until_the_owner_releases() {
    let k = machine_without(0, &["0xB8"]);
    let m = k.KeInitializeMutex(0);
    let owner = owned_elsewhere(&k, m);
    let (dpc, seen) = mutex_dpc(&k, m);
    let k2 = k.clone();
    let waiter = std::thread::spawn(move || clean(|| k2.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL)));
    std::thread::sleep(Duration::from_millis(20));
    assert!(!waiter.is_finished(), "the owner still holds it");
    drop(owner);
    assert!(waiter.join().unwrap());
    assert_eq!(*seen.status.lock().unwrap(), Some(STATUS_SUCCESS));
    assert!(k.bugchecks().is_empty());
}

/// A DPC that delays `interval` (KeDelayExecutionThread) and notes what the delay returned.
fn delaying_dpc(k: &Arc<NtModel>, interval: i64) -> (PKDPC, WaitSeen) {
    let (k2, seen) = (Arc::downgrade(k), WaitSeen::default());
    let s = seen.clone();
    let dpc = k.KeInitializeDpc(Arc::new(move |_, _, _| {
        let here = 0u8;
        s.stack.store(std::ptr::addr_of!(here) as u64, Ordering::SeqCst);
        *s.status.lock().unwrap() = Some(k2.upgrade().unwrap().delay_execution_thread(interval));
    }));
    (dpc, seen)
}

#[test]
fn a_delay_in_a_dpc_or_an_isr_is_b8_whatever_its_interval() {
    for interval in [-10 * MS, 0] {
        let k = machine(0);
        let (dpc, seen) = delaying_dpc(&k, interval);
        let b = stop_on_thread(queue(&k, dpc));
        assert_eq!((b.code, b.params[3]), (0xB8, 0), "interval {interval}: {b}");
        assert!(is_thread(b.params[0]) && is_thread(b.params[1]) && b.params[0] != b.params[1], "{b}");
        let dpc_stack = seen.stack.load(Ordering::SeqCst);
        assert!(b.params[2].abs_diff(dpc_stack) < 64 * 1024, "P3 is not on the DPC's stack: {b}");
        assert_eq!(*seen.status.lock().unwrap(), None, "the delay never returned");
    }
    let k = machine(0);
    connect(
        &k,
        1,
        isr(&k, |k, _, _| {
            k.delay_execution_thread(-MS);
            true
        }),
    );
    let k2 = k.clone();
    let b = stop_on_thread(move || {
        k2.deliver(PDO, 0);
    });
    assert_eq!((b.code, b.params[3]), (0xB8, 0), "{b}");
}

#[test]
fn a_delay_above_apc_is_c4_e5_under_irql_checking_before_the_kernels_b8() {
    let k = machine(IRQL);
    let (dpc, _) = delaying_dpc(&k, -MS);
    assert_eq!(stop_on_thread(queue(&k, dpc)), Bugcheck::c4(0xE5, 2, 0, 0));
    // A thread that raised its own IRQL is no DPC, and IRQL checking stops it the same way.
    assert_eq!(
        stop(|| {
            k.KeRaiseIrql(DISPATCH_LEVEL);
            k.delay_execution_thread(0)
        }),
        Bugcheck::c4(0xE5, 2, 0, 0)
    );
    // APC_LEVEL is the page's limit.
    let k = machine(IRQL);
    clean(|| {
        let old = k.KeRaiseIrql(APC_LEVEL);
        assert_eq!(k.delay_execution_thread(0), STATUS_SUCCESS);
        k.KeLowerIrql(old);
    });
    // With 0xC4/0xE5 off the kernel's 0xB8 is what is left.
    let k = machine_without(IRQL, &["0xC4/0xE5"]);
    let (dpc, _) = delaying_dpc(&k, -MS);
    assert_eq!(stop_on_thread(queue(&k, dpc)).code, 0xB8);
}

#[test]
fn a_delay_waits_on_the_models_clock_and_with_b8_disabled_blocks_the_dpc_as_long() {
    let k = machine(STANDARD);
    clean(|| assert_eq!(k.delay_execution_thread(0), STATUS_SUCCESS));
    let k2 = k.clone();
    let sleeper = std::thread::spawn(move || clean(|| k2.delay_execution_thread(-10 * MS)));
    std::thread::sleep(Duration::from_millis(20));
    assert!(!sleeper.is_finished(), "a manual clock has not moved: the host's time does not count");
    k.advance_clock(Duration::from_millis(5));
    std::thread::sleep(Duration::from_millis(10));
    assert!(!sleeper.is_finished(), "half the interval");
    k.advance_clock(Duration::from_millis(5));
    assert_eq!(sleeper.join().unwrap(), STATUS_SUCCESS);
    // 0xB8 disabled: the DPC's delay holds the thread it borrowed until the interval has passed.
    let k = machine_without(0, &["0xB8"]);
    let (dpc, seen) = delaying_dpc(&k, -10 * MS);
    let k2 = k.clone();
    let waiter = std::thread::spawn(move || clean(|| k2.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL)));
    std::thread::sleep(Duration::from_millis(20));
    assert!(!waiter.is_finished());
    k.advance_clock(Duration::from_millis(10));
    assert!(waiter.join().unwrap());
    assert_eq!(*seen.status.lock().unwrap(), Some(STATUS_SUCCESS));
    assert!(k.bugchecks().is_empty());
}

#[test]
fn set_event_above_dispatch_is_c4_80_and_with_wait_above_apc_is_c4_e5() {
    let k = machine(IRQL);
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    clean(|| {
        k.KeSetEvent(e, 0, false);
        k.KeClearEvent(e);
    });
    assert_eq!(stop(|| k.KeSetEvent(e, 0, true)), Bugcheck::c4(0xE5, 2, 0, 0));
    let k = machine(IRQL);
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    k.KeRaiseIrql(DISPATCH_LEVEL + 1);
    assert_eq!(stop(|| k.KeSetEvent(e, 0, false)), Bugcheck::c4(0x80, 3, e.0, 0));
    let k = machine(IRQL);
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    k.KeRaiseIrql(DISPATCH_LEVEL + 1);
    assert_eq!(stop(|| k.KeClearEvent(e)), Bugcheck::c4(0xE5, 3, 0, 0));
}

// ---- Unload with work pending ----

#[test]
fn a_timer_still_set_at_unload_is_c7_0_with_the_range_checked() {
    let k = machine(IRQL);
    let timer = k.KeInitializeTimer();
    k.KeSetTimer(timer, -10 * MS, PKDPC::NULL);
    let (start, end) = k.driver_object_range();
    assert!((start..end).contains(&timer.0));
    let b = stop(|| k.unload_driver());
    assert_eq!(b, Bugcheck::new(TIMER_OR_DPC_INVALID, 0, timer.0, start, end));
    assert_eq!(b.name(), "TIMER_OR_DPC_INVALID");
    k.KeCancelTimer(timer);
    clean(|| k.unload_driver());
}

#[test]
fn a_dpc_still_queued_at_unload_is_c7_1() {
    let k = machine(IRQL);
    let log = Log::default();
    let dpc = logging_dpc(&k, &log, "late");
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL);
    let (start, end) = k.driver_object_range();
    assert_eq!(stop(|| k.unload_driver()), Bugcheck::new(TIMER_OR_DPC_INVALID, 1, dpc.0, start, end));
    assert!(k.KeRemoveQueueDpc(dpc));
    k.KeLowerIrql(old);
    clean(|| k.unload_driver());
}

#[test]
fn an_interrupt_still_connected_at_unload_is_c7_2_with_its_isr() {
    let k = machine(IRQL);
    let connection = connect(&k, 2, isr(&k, |_, _, _| true));
    let (start, end) = k.driver_image_range();
    let b = stop(|| k.unload_driver());
    assert_eq!((b.code, b.params[0], b.params[2], b.params[3]), (TIMER_OR_DPC_INVALID, 2, start, end));
    assert!(in_image(&k, b.params[1]));
    k.IoDisconnectInterruptEx(&connection);
    clean(|| k.unload_driver());
}

/// A DPC and an ISR run at raised IRQL, so the kernel calling them after unload is 0xD4 (0xCE's form "at a raised
/// IRQL"), with P2 the IRQL each runs at: DISPATCH_LEVEL for the timer's DPC, the DIRQL for the ISR.
#[test]
fn without_the_verifier_the_unloaded_drivers_routines_called_later_are_d4_at_their_irql() {
    let k = machine(0);
    let log = Log::default();
    let dpc = logging_dpc(&k, &log, "after unload");
    let timer = k.KeInitializeTimer();
    k.KeSetTimer(timer, -10 * MS, dpc);
    let connection = connect(&k, 1, isr(&k, |_, _, _| true));
    let dirql = match &connection {
        INTERRUPT_CONNECTION::MessageBased(info) => info.UnifiedIrql,
        INTERRUPT_CONNECTION::LineBased(_) => unreachable!("the device has messages"),
    };
    clean(|| k.unload_driver());
    let b = stop(|| k.advance_clock(Duration::from_millis(10)));
    let raised = SYSTEM_SCAN_AT_RAISED_IRQL_CAUGHT_IMPROPER_DRIVER_UNLOAD;
    assert_eq!((b.code, b.params[1], b.params[2]), (raised, DISPATCH_LEVEL as u64, 0));
    assert_eq!(b.params[0], b.params[3], "the routine touched is where the touch came from");
    assert!(in_image(&k, b.params[0]));
    assert!(log.take().is_empty(), "the DPC routine did not run");
    let b = stop(|| k.deliver(PDO, 0));
    assert_eq!((b.code, b.params[1], b.params[2]), (raised, dirql as u64, 0));
    assert!(in_image(&k, b.params[0]) && b.params[0] == b.params[3]);
    assert_eq!(b.name(), "SYSTEM_SCAN_AT_RAISED_IRQL_CAUGHT_IMPROPER_DRIVER_UNLOAD");
}

#[test]
fn a_driver_that_cancels_everything_unloads_clean_in_every_mode() {
    for flags in [0, IRQL, STANDARD] {
        let k = machine(flags);
        let log = Log::default();
        let dpc = logging_dpc(&k, &log, "d");
        let timer = k.KeInitializeTimer();
        k.KeSetTimerEx(timer, -MS, 1, dpc);
        (0..3).for_each(|_| k.advance_clock(Duration::from_millis(1)));
        let connection = connect(&k, 1, isr(&k, |_, _, _| true));
        let item = k.IoAllocateWorkItem(PDO);
        k.IoQueueWorkItem(item, work_item_routine(|_| {}), WORK_QUEUE_TYPE::DelayedWorkQueue);
        clean(|| {
            k.KeCancelTimer(timer);
            k.KeFlushQueuedDpcs();
            k.IoDisconnectInterruptEx(&connection);
            k.unload_driver();
            k.IoFreeWorkItem(item);
        });
        assert_eq!(log.take().len(), 3, "flags {flags:#x}");
        assert!(k.bugchecks().is_empty());
    }
}

#[test]
fn a_disabled_rule_lets_the_unchecked_path_run() {
    let config = NtModelConfig {
        verifier: VerifierFlags(IRQL),
        disabled_rules: vec![RuleId::parse("0xC4/0x122").unwrap(), RuleId::parse("0xC7").unwrap()],
        ..NtModelConfig::default()
    };
    let k = NtModel::for_tests_with_timing(config, TimingConfig { clock: ClockSource::Manual, ..Default::default() }).0;
    let e = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, true);
    let timer = k.KeInitializeTimer();
    k.KeSetTimer(timer, -MS, PKDPC::NULL);
    clean(|| {
        let old = k.KeRaiseIrql(DISPATCH_LEVEL);
        assert_eq!(wait(&k, e, Some(-MS)), STATUS_SUCCESS);
        k.KeLowerIrql(old);
        k.unload_driver();
    });
}

// ---- Stopping the machine ----

/// A handler that stops the machine as the guest's does: it never returns. It counts who got to report.
struct StopsForGood(AtomicU32);

impl vhca_ntmodel::BugcheckHandler for StopsForGood {
    fn bugcheck(&self, _: &Bugcheck) -> ! {
        self.0.fetch_add(1, Ordering::SeqCst);
        loop {
            std::thread::park();
        }
    }
}

#[test]
fn two_processors_finding_a_violation_at_once_report_one_stop() {
    // The clock interrupt and the overrunning DPC both see one 0x133; Windows' first KeBugCheckEx freezes the rest.
    let handler = Arc::new(StopsForGood(AtomicU32::new(0)));
    let backend = Arc::new(vhca_ntmodel::HostDmaBackend::default());
    let k = Arc::new(NtModel::new(NtModelConfig::default(), backend, handler.clone()));
    for _ in 0..2 {
        let k = k.clone();
        // Detached: a stopped processor never comes back.
        std::thread::spawn(move || k.KeBugCheckEx(DPC_WATCHDOG_VIOLATION, 0, 65, 64, 0));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(handler.0.load(Ordering::SeqCst), 1, "the second stop was reported too");
    assert_eq!(k.bugchecks().len(), 1);
}
