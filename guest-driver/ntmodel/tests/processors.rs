//! Several processors in the model: DPCs on their target processor's thread, messages on message_id % N, one
//! context per processor at DISPATCH_LEVEL and above, flushes that wait for other processors, spin locks really
//! contended across processors, and the ISR that interrupts a holder of the lock it wants. Manual clock throughout,
//! so a routine that spins on purpose never meets the watchdog.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::thread::ThreadId;
use std::time::Duration;

use common::PDO;
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, ClockSource, InterruptResources, NtModel, NtModelConfig, TimingConfig, VerifierFlags};

const STANDARD: u32 = 0x209BB;
/// Long enough for a thread that should be waiting to have got past the wait if it were not.
const SETTLE: Duration = Duration::from_millis(50);

fn machine_with(processors: u32, flags: u32) -> Arc<NtModel> {
    let config = NtModelConfig { verifier: VerifierFlags(flags), processors, ..NtModelConfig::default() };
    NtModel::for_tests_with_timing(config, TimingConfig { clock: ClockSource::Manual, ..TimingConfig::default() }).0
}

fn clean<T>(f: impl FnOnce() -> T) -> T {
    NtModel::run_guarded(f).unwrap_or_else(|b| panic!("unexpected bugcheck:\n{b}"))
}

/// Where a routine ran: the processor KeGetCurrentProcessorNumberEx gave (group, number, index), its IRQL and
/// thread.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    group: u16,
    number: u8,
    index: u32,
    irql: KIRQL,
    thread: ThreadId,
}

fn seen(k: &NtModel) -> Seen {
    let mut n = PROCESSOR_NUMBER { Group: 7, Number: 7, Reserved: 7 };
    let index = k.KeGetCurrentProcessorNumberEx(Some(&mut n));
    assert_eq!(n.Reserved, 0);
    Seen { group: n.Group, number: n.Number, index, irql: k.KeGetCurrentIrql(), thread: std::thread::current().id() }
}

/// A DPC that records where it ran, then runs `body`.
fn recording_dpc(
    k: &Arc<NtModel>,
    log: &Arc<Mutex<Vec<Seen>>>,
    body: impl Fn(&NtModel) + Send + Sync + 'static,
) -> PKDPC {
    let (weak, log) = (Arc::downgrade(k), log.clone());
    k.KeInitializeDpc(Arc::new(move |_, _, _| {
        let k = weak.upgrade().unwrap();
        log.lock().unwrap().push(seen(&k));
        body(&k);
    }))
}

fn on_processor_1(k: &Arc<NtModel>) -> PROCESSOR_NUMBER {
    assert!(k.processor_count() >= 2);
    PROCESSOR_NUMBER { Group: 0, Number: 1, Reserved: 0 }
}

#[test]
fn a_dpc_targeted_at_processor_1_runs_there_while_the_inserting_thread_stays_passive_on_0() {
    let k = machine_with(2, STANDARD);
    let log = Arc::new(Mutex::new(Vec::new()));
    let dpc = recording_dpc(&k, &log, |_| {});
    assert_eq!(k.KeSetTargetProcessorDpcEx(dpc, &on_processor_1(&k)), STATUS_SUCCESS);
    clean(|| assert!(k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL)));
    let me = seen(&k);
    assert_eq!((me.index, me.irql), (0, PASSIVE_LEVEL), "the inserter stays at PASSIVE_LEVEL on processor 0");
    clean(|| k.KeFlushQueuedDpcs());
    let ran = log.lock().unwrap().clone();
    assert_eq!(ran.len(), 1);
    assert_eq!((ran[0].group, ran[0].number, ran[0].index, ran[0].irql), (0, 1, 1, DISPATCH_LEVEL));
    assert_ne!(ran[0].thread, me.thread, "processor 1's own thread ran it");
    assert_eq!(k.KeGetCurrentProcessorNumber(), 0);
}

#[test]
fn a_target_past_the_processors_is_refused_or_ignored_as_windows_does() {
    let k = machine_with(2, STANDARD);
    let log = Arc::new(Mutex::new(Vec::new()));
    let dpc = recording_dpc(&k, &log, |_| {});
    for bad in
        [PROCESSOR_NUMBER { Group: 0, Number: 2, Reserved: 0 }, PROCESSOR_NUMBER { Group: 1, Number: 0, Reserved: 0 }]
    {
        assert_eq!(k.KeSetTargetProcessorDpcEx(dpc, &bad), STATUS_INVALID_PARAMETER);
    }
    // KeSetTargetProcessorDpc past group 0's processors leaves the target as it was: here, the inserter's.
    k.KeSetTargetProcessorDpc(dpc, 5);
    k.KeSetTargetProcessorDpc(dpc, -1);
    clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
    assert_eq!(log.lock().unwrap()[0].index, 0);
    k.KeSetTargetProcessorDpc(dpc, 1);
    clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
    clean(|| k.KeFlushQueuedDpcs());
    assert_eq!(log.lock().unwrap()[1].index, 1);
}

#[test]
fn the_active_processor_count_is_the_configured_one() {
    for n in [1u32, 2, 4] {
        let k = machine_with(n, 0);
        assert_eq!(k.KeQueryActiveProcessorCountEx(ALL_PROCESSOR_GROUPS), n);
        assert_eq!(k.KeQueryActiveProcessorCountEx(0), n);
        assert_eq!(k.KeQueryActiveProcessorCountEx(1), 0, "a group the machine does not have");
        let mut active: KAFFINITY = 0;
        assert_eq!(k.KeQueryActiveProcessorCount(Some(&mut active)), n);
        assert_eq!(active, (1u64 << n) - 1);
        assert_eq!(k.KeQueryActiveProcessorCount(None), n);
    }
    // Out of range is a configuration error the constructor clamps.
    assert_eq!(machine_with(0, 0).KeQueryActiveProcessorCountEx(0), 1);
    let widest = machine_with(65, 0);
    let mut active: KAFFINITY = 0;
    assert_eq!(widest.KeQueryActiveProcessorCount(Some(&mut active)), 64);
    assert_eq!(active, u64::MAX);
}

/// Connects an ISR that records where it ran and queues `dpc` (NULL: none) with no target of its own.
fn connect_recording_isr(k: &Arc<NtModel>, messages: u32, log: &Arc<Mutex<Vec<(u32, Seen)>>>, dpc: PKDPC) {
    let (weak, log): (Weak<NtModel>, _) = (Arc::downgrade(k), log.clone());
    k.assign_interrupts(PDO, InterruptResources::Messages(messages));
    let isr: PKMESSAGE_SERVICE_ROUTINE = Arc::new(move |_, message| {
        let k = weak.upgrade().unwrap();
        log.lock().unwrap().push((message, seen(&k)));
        if !dpc.is_null() {
            k.KeInsertQueueDpc(dpc, PVOID(message as u64), PVOID::NULL);
        }
        true
    });
    k.IoConnectInterruptEx(common::message_parameters(isr)).expect("connect");
}

#[test]
fn message_k_runs_its_isr_and_its_dpc_on_processor_k_mod_n() {
    for n in [2u32, 4] {
        let k = machine_with(n, STANDARD);
        let isrs = Arc::new(Mutex::new(Vec::new()));
        let dpcs = Arc::new(Mutex::new(Vec::new()));
        let dpc = recording_dpc(&k, &dpcs, |_| {});
        connect_recording_isr(&k, 5, &isrs, dpc);
        for message in 0..5 {
            clean(|| assert!(k.deliver(PDO, message)));
        }
        let on: Vec<(u32, u32)> = isrs.lock().unwrap().iter().map(|(m, s)| (*m, s.index)).collect();
        assert_eq!(on, (0..5).map(|m| (m, m % n)).collect::<Vec<_>>(), "{n} processors");
        assert!(isrs.lock().unwrap().iter().all(|(_, s)| s.irql == vhca_ntmodel::DEVICE_DIRQL));
        let dpc_on: Vec<u32> = dpcs.lock().unwrap().iter().map(|s| s.index).collect();
        assert_eq!(dpc_on, (0..5).map(|m| m % n).collect::<Vec<_>>(), "each DPC on its ISR's processor");
        // The delivering thread is back where it was.
        assert_eq!(k.KeGetCurrentProcessorNumber(), 0);
    }
}

#[test]
fn a_second_thread_of_a_processor_raising_to_dispatch_waits_for_the_first_to_drop() {
    let k = machine_with(2, STANDARD);
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let raised = Arc::new(AtomicBool::new(false));
    let spawn_raiser = |processor: u32| {
        let (k, raised) = (k.clone(), raised.clone());
        std::thread::spawn(move || {
            k.run_on_processor(processor, || {
                let old = k.KeRaiseIrql(DISPATCH_LEVEL);
                raised.store(true, Ordering::SeqCst);
                k.KeLowerIrql(old);
            })
        })
    };
    // Another processor does not wait.
    spawn_raiser(1).join().unwrap();
    assert!(raised.swap(false, Ordering::SeqCst));
    let same = spawn_raiser(0);
    std::thread::sleep(SETTLE);
    assert!(!raised.load(Ordering::SeqCst), "processor 0 runs one context at DISPATCH_LEVEL");
    k.KeLowerIrql(old);
    same.join().unwrap();
    assert!(raised.load(Ordering::SeqCst));
}

#[test]
fn flush_waits_for_a_dpc_running_on_the_other_processor() {
    let k = machine_with(2, STANDARD);
    let (release, done) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let log = Arc::new(Mutex::new(Vec::new()));
    let (r, d) = (release.clone(), done.clone());
    let dpc = recording_dpc(&k, &log, move |_| {
        while !r.load(Ordering::SeqCst) {
            std::hint::spin_loop();
        }
        d.store(true, Ordering::SeqCst);
    });
    assert_eq!(k.KeSetTargetProcessorDpcEx(dpc, &on_processor_1(&k)), STATUS_SUCCESS);
    clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
    while log.lock().unwrap().is_empty() {
        std::thread::yield_now();
    }
    let (k2, d) = (k.clone(), done.clone());
    let flusher = std::thread::spawn(move || {
        clean(|| k2.KeFlushQueuedDpcs());
        d.load(Ordering::SeqCst)
    });
    std::thread::sleep(SETTLE);
    assert!(!flusher.is_finished(), "the flush waits while processor 1 runs the DPC");
    release.store(true, Ordering::SeqCst);
    assert!(flusher.join().unwrap(), "the DPC had returned when the flush did");
}

#[test]
fn a_spin_lock_held_at_dispatch_on_processor_0_makes_processor_1_wait_for_it() {
    let k = machine_with(2, STANDARD);
    let lock = k.KeInitializeSpinLock();
    let old = k.KeAcquireSpinLock(lock);
    let taken_on = Arc::new(AtomicU32::new(u32::MAX));
    let (k2, t) = (k.clone(), taken_on.clone());
    let waiter = std::thread::spawn(move || {
        clean(|| {
            k2.run_on_processor(1, || {
                let old = k2.KeAcquireSpinLock(lock);
                t.store(k2.KeGetCurrentProcessorNumber(), Ordering::SeqCst);
                k2.KeReleaseSpinLock(lock, old);
            })
        })
    });
    std::thread::sleep(SETTLE);
    assert_eq!(taken_on.load(Ordering::SeqCst), u32::MAX, "processor 1 spins while processor 0 holds the lock");
    k.KeReleaseSpinLock(lock, old);
    waiter.join().unwrap();
    assert_eq!(taken_on.load(Ordering::SeqCst), 1);
}

#[test]
fn an_isr_interrupting_a_holder_of_its_spin_lock_on_its_processor_is_the_deadlock_c4_1000() {
    let k = machine_with(2, STANDARD);
    // The driver's own KSPIN_LOCK as the interrupt spin lock, taken at DISPATCH_LEVEL on processor 0.
    let lock = k.KeInitializeSpinLock();
    let isr: PKMESSAGE_SERVICE_ROUTINE = Arc::new(|_, _| true);
    k.assign_interrupts(PDO, InterruptResources::Messages(2));
    k.IoConnectInterruptEx(IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS {
        PhysicalDeviceObject: PDO,
        MessageServiceRoutine: isr,
        SpinLock: lock,
        SynchronizeIrql: PASSIVE_LEVEL,
        FloatingSave: false,
        FallBackServiceRoutine: None,
    })
    .expect("connect");
    let old = k.KeAcquireSpinLock(lock);
    let deliver = |message: u32| {
        let (k, (tx, rx)) = (k.clone(), mpsc::channel());
        std::thread::spawn(move || tx.send(NtModel::run_guarded(|| k.deliver(PDO, message))));
        rx.recv_timeout(Duration::from_secs(5))
    };
    // Message 0 comes to processor 0, whose interrupted context holds the lock.
    match deliver(0) {
        Ok(Err(b)) => assert_eq!(b, Bugcheck::c4(0x1000, lock.0, 0, 0)),
        other => panic!("expected 0xC4/0x1000, got {other:?}"),
    }
    // Message 1 comes to processor 1: a holder on another processor is only waited for.
    let (k1, (tx, rx)) = (k.clone(), mpsc::channel());
    std::thread::spawn(move || tx.send(NtModel::run_guarded(|| k1.deliver(PDO, 1))));
    assert!(rx.recv_timeout(SETTLE).is_err(), "processor 1's ISR spins for the lock");
    k.KeReleaseSpinLock(lock, old);
    assert!(matches!(rx.recv_timeout(Duration::from_secs(5)), Ok(Ok(true))));
}

/// The same deadlock through the ISR's own KeAcquireSpinLockAtDpcLevel on a driver lock (not the interrupt spin
/// lock): the context it interrupted on processor 0 holds it, so it would spin forever there; 0xC4/0x1000 as well.
#[test]
fn an_isr_taking_at_dpc_level_a_lock_its_interrupted_context_holds_is_the_deadlock_c4_1000() {
    let k = machine_with(2, STANDARD);
    let lock = k.KeInitializeSpinLock();
    let weak = Arc::downgrade(&k);
    let isr: PKMESSAGE_SERVICE_ROUTINE = Arc::new(move |_, _| {
        let k = weak.upgrade().unwrap();
        k.KeAcquireSpinLockAtDpcLevel(lock);
        k.KeReleaseSpinLockFromDpcLevel(lock);
        true
    });
    k.assign_interrupts(PDO, InterruptResources::Messages(2));
    k.IoConnectInterruptEx(common::message_parameters(isr)).expect("connect");
    let deliver = |message: u32| {
        let (k, (tx, rx)) = (k.clone(), mpsc::channel());
        std::thread::spawn(move || tx.send(NtModel::run_guarded(|| k.deliver(PDO, message))));
        rx
    };
    // Message 1 comes to processor 1: the holder on processor 0 is only waited for. First, as the bugcheck below
    // unwinds with the connection's interrupt spin lock taken (a stopped machine never gives it back).
    let old = k.KeAcquireSpinLock(lock);
    let on_1 = deliver(1);
    assert!(on_1.recv_timeout(SETTLE).is_err(), "processor 1's ISR spins for the lock");
    k.KeReleaseSpinLock(lock, old);
    let r = on_1.recv_timeout(Duration::from_secs(5));
    assert!(matches!(r, Ok(Ok(true))), "{r:?}");
    // Message 0 comes to processor 0, whose interrupted context holds the lock: without the check it spins.
    let _old = k.KeAcquireSpinLock(lock);
    match deliver(0).recv_timeout(Duration::from_secs(5)) {
        Ok(Err(b)) => assert_eq!(b, Bugcheck::c4(0x1000, lock.0, 0, 0)),
        other => panic!("expected 0xC4/0x1000, got {other:?}"),
    }
}

#[test]
fn the_first_system_worker_runs_on_processor_1() {
    let k = machine_with(2, STANDARD);
    let item = k.IoAllocateWorkItem(PDO);
    let (tx, rx) = mpsc::channel();
    let weak = Arc::downgrade(&k);
    k.IoQueueWorkItem(
        item,
        Box::new(move |_| {
            let k = weak.upgrade().unwrap();
            tx.send(seen(&k)).unwrap();
        }),
        WORK_QUEUE_TYPE::DelayedWorkQueue,
    );
    let ran = rx.recv_timeout(Duration::from_secs(5)).expect("the routine ran");
    assert_eq!((ran.index, ran.irql), (1, PASSIVE_LEVEL));
}

#[test]
fn dropping_the_model_ends_its_dpc_threads() {
    let k = machine_with(4, STANDARD);
    let log = Arc::new(Mutex::new(Vec::new()));
    let dpc = recording_dpc(&k, &log, |_| {});
    for n in 1..4 {
        assert_eq!(
            k.KeSetTargetProcessorDpcEx(dpc, &PROCESSOR_NUMBER { Group: 0, Number: n, Reserved: 0 }),
            STATUS_SUCCESS
        );
        clean(|| k.KeInsertQueueDpc(dpc, PVOID::NULL, PVOID::NULL));
        clean(|| k.KeFlushQueuedDpcs());
    }
    assert_eq!(log.lock().unwrap().iter().map(|s| s.index).collect::<Vec<_>>(), [1, 2, 3]);
    let weak = Arc::downgrade(&k);
    let (tx, rx) = mpsc::channel();
    // The drop joins the three DPC threads: it returns only when they have ended.
    std::thread::spawn(move || {
        drop(k);
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(5)).expect("the drop returned");
    assert!(weak.upgrade().is_none());
}
