//! The driver core's interrupt-driven completion path on the model: the ISR at DIRQL only queues the DPC, the DPC
//! at DISPATCH_LEVEL hands CQEs to the consumers there and re-arms, its budget re-queues it, and teardown
//! disconnects and flushes (an interrupt left connected at unload is the verifier's 0xC7); a waiter sleeps on the
//! KEVENT the callback sets.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use vhca_driver_core::*;
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, InterruptResources, NtModel};
use vhca_proto::{Cqe, DoorbellKind, Event, EventKind};

const STANDARD: u32 = 0x209BB;

/// The transport the DPC uses, recording the IRQL of every call: the device is touched only where the DPC runs.
struct Recording {
    device: FakeDevice,
    kernel: Arc<NtModel>,
    irqls: Mutex<Vec<KIRQL>>,
}

impl Recording {
    fn seen(&self) -> Vec<KIRQL> {
        self.irqls.lock().unwrap().clone()
    }
    fn note(&self) {
        self.irqls.lock().unwrap().push(self.kernel.KeGetCurrentIrql());
    }
}

impl CommandTransport for Recording {
    fn execute(&self, request: &[u8], capacity: usize) -> Result<Vec<u8>, CommandTransportError> {
        self.note();
        self.device.execute(request, capacity)
    }
    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError> {
        self.note();
        self.device.ring_doorbell(records)
    }
    fn poll_event(&self) -> Option<Event> {
        self.note();
        self.device.poll_event()
    }
}

/// Each CQE a callback got: (CQ, wr_id, the IRQL it was called at).
type Seen = Arc<Mutex<Vec<(u32, u64, KIRQL)>>>;

struct Rig {
    k: Arc<NtModel>,
    dev: FakeDevice,
    hca: Hca<NtModel, FakeDevice>,
    transport: Arc<Recording>,
    path: CompletionPath<NtModel, Recording>,
    cq: u32,
    seen: Seen,
}

fn rig(flags: u32, resources: InterruptResources, budget: usize) -> Rig {
    let (k, backend) = machine(flags);
    let dev = FakeDevice::new(k.clone(), backend);
    let mut hca = Hca::open(k.clone(), dev.clone(), PDO, HcaConfig::default()).expect("open");
    let cq = hca.create_cq(16).expect("create_cq");
    k.assign_interrupts(PDO, resources);
    let transport = Arc::new(Recording { device: dev.clone(), kernel: k.clone(), irqls: Mutex::new(Vec::new()) });
    let path = CompletionPath::connect(k.clone(), transport.clone(), PDO, budget, None).expect("connect");
    let seen = Seen::default();
    let (s, kw) = (seen.clone(), Arc::downgrade(&k));
    let callback: CompletionCallback = Arc::new(move |cq, cqe: &Cqe| {
        s.lock().unwrap().push((cq, cqe.wr_id.get(), kw.upgrade().unwrap().KeGetCurrentIrql()));
    });
    path.watch(cq, hca.cq_reader(cq).unwrap(), callback);
    Rig { k, dev, hca, transport, path, cq, seen }
}

fn clean<T>(f: impl FnOnce() -> T) -> T {
    NtModel::run_guarded(f).unwrap_or_else(|b| panic!("unexpected bugcheck:\n{b}"))
}

fn cq_arms(dev: &FakeDevice) -> Vec<(u32, u32)> {
    dev.doorbells()
        .iter()
        .filter(|d| d.kind.get() == DoorbellKind::CqArm as u32)
        .map(|d| (d.handle.get(), d.index.get()))
        .collect()
}

#[test]
fn the_isr_only_queues_the_dpc_which_runs_when_the_irql_drops_below_dispatch() {
    let r = rig(STANDARD, InterruptResources::Messages(1), DEFAULT_CQE_BUDGET);
    assert!(matches!(r.path.connection(), Some(INTERRUPT_CONNECTION::MessageBased(_))));
    r.dev.write_cqe(r.cq, 0, 7);
    r.dev.push_event(EventKind::CqCompletion, r.cq);
    // At DISPATCH_LEVEL the queued DPC cannot run yet: what happened until the IRQL drops is the ISR's alone.
    let old = r.k.KeRaiseIrql(DISPATCH_LEVEL);
    assert!(clean(|| r.k.deliver(PDO, 0)), "the ISR claims its message");
    let counts = r.path.counts();
    assert_eq!((counts.isr_calls, counts.dpc_calls), (1, 0));
    assert!(r.transport.seen().is_empty(), "the ISR touched the device: {:?}", r.transport.seen());
    assert!(r.seen.lock().unwrap().is_empty());
    clean(|| r.k.KeLowerIrql(old));
    assert_eq!(r.path.counts().dpc_calls, 1);
    assert_eq!(*r.seen.lock().unwrap(), vec![(r.cq, 7, DISPATCH_LEVEL)]);
    assert!(r.transport.seen().iter().all(|&irql| irql == DISPATCH_LEVEL), "{:?}", r.transport.seen());
    clean(|| r.path.disconnect());
}

#[test]
fn the_dpc_hands_each_cqe_to_its_consumer_at_dispatch_and_rearms_the_drained_cq() {
    for flags in [0, STANDARD] {
        let r = rig(flags, InterruptResources::Messages(1), DEFAULT_CQE_BUDGET);
        for i in 0..3 {
            r.dev.write_cqe(r.cq, i, 100 + i as u64);
        }
        r.dev.push_event(EventKind::CqCompletion, r.cq);
        r.dev.push_event(EventKind::QpFatal, 9);
        assert!(clean(|| r.k.deliver(PDO, 0)));
        let want: Vec<_> = (0..3).map(|i| (r.cq, 100 + i, DISPATCH_LEVEL)).collect();
        assert_eq!(*r.seen.lock().unwrap(), want, "flags {flags:#x}");
        assert_eq!(cq_arms(&r.dev), vec![(r.cq, 3)], "armed once, at the new consumer index");
        let other = r.path.take_event().expect("the QP error is kept for the control path");
        assert_eq!((other.kind.get(), other.handle.get()), (EventKind::QpFatal as u32, 9));
        assert_eq!(r.path.counts(), CompletionCounts { isr_calls: 1, dpc_calls: 1, dpc_requeues: 0, cqes: 3 });
        clean(|| r.path.disconnect());
    }
}

#[test]
fn a_dpc_over_its_budget_queues_itself_again_until_the_cq_is_drained() {
    let r = rig(STANDARD, InterruptResources::Messages(1), 4);
    for i in 0..10 {
        r.dev.write_cqe(r.cq, i, i as u64);
    }
    r.dev.push_event(EventKind::CqCompletion, r.cq);
    assert!(clean(|| r.k.deliver(PDO, 0)));
    let got: Vec<u64> = r.seen.lock().unwrap().iter().map(|s| s.1).collect();
    assert_eq!(got, (0..10).collect::<Vec<u64>>(), "every CQE once, in ring order");
    // 4 + 4 + 2: two runs stopped at the budget; only the run that drained the CQ armed it.
    assert_eq!(r.path.counts(), CompletionCounts { isr_calls: 1, dpc_calls: 3, dpc_requeues: 2, cqes: 10 });
    assert_eq!(cq_arms(&r.dev), vec![(r.cq, 10)]);
    clean(|| r.path.disconnect());
}

#[test]
fn the_line_interrupt_is_connected_when_the_kernel_gives_no_messages() {
    let r = rig(STANDARD, InterruptResources::Line, DEFAULT_CQE_BUDGET);
    assert!(matches!(r.path.connection(), Some(INTERRUPT_CONNECTION::LineBased(_))));
    r.dev.write_cqe(r.cq, 0, 5);
    r.dev.push_event(EventKind::CqCompletion, r.cq);
    assert!(clean(|| r.k.deliver(PDO, 0)));
    assert_eq!(*r.seen.lock().unwrap(), vec![(r.cq, 5, DISPATCH_LEVEL)]);
    clean(|| r.path.disconnect());
}

#[test]
fn teardown_disconnects_and_flushes_so_the_driver_unloads_clean() {
    let mut r = rig(STANDARD, InterruptResources::Messages(1), DEFAULT_CQE_BUDGET);
    r.dev.write_cqe(r.cq, 0, 1);
    r.dev.push_event(EventKind::CqCompletion, r.cq);
    clean(|| r.k.deliver(PDO, 0));
    let counts = clean(|| r.path.disconnect());
    assert_eq!((counts.isr_calls, counts.dpc_calls, counts.cqes), (1, 1, 1));
    assert!(!clean(|| r.k.deliver(PDO, 0)), "no ISR is connected after disconnect");
    r.hca.destroy_cq(r.cq).expect("destroy_cq");
    clean(|| r.hca.close());
    clean(|| r.k.unload_driver());
}

#[test]
fn unloading_with_the_interrupt_still_connected_is_c7_under_the_verifier() {
    let r = rig(STANDARD, InterruptResources::Messages(1), DEFAULT_CQE_BUDGET);
    let b: Bugcheck = match NtModel::run_guarded(|| r.k.unload_driver()) {
        Ok(()) => panic!("expected 0xC7"),
        Err(b) => b,
    };
    assert_eq!((b.code, b.params[0]), (TIMER_OR_DPC_INVALID, 2), "{b}");
    // The path's drop disconnects (an error path that never called disconnect), and the unload is clean then.
    let Rig { k, path, hca, .. } = r;
    clean(|| drop(path));
    clean(|| hca.close());
    clean(|| k.unload_driver());
}

#[test]
fn a_waiter_sleeps_on_the_cqs_kevent_until_its_callback_queued_the_cqe_and_times_out_without_one() {
    let (k, backend) = machine(STANDARD);
    let dev = FakeDevice::new(k.clone(), backend);
    let mut hca = Hca::open(k.clone(), dev.clone(), PDO, HcaConfig::default()).expect("open");
    let cq = hca.create_cq(16).expect("create_cq");
    let waits = connected_waits(&k, &dev);
    waits.watch(cq, hca.cq_reader(cq).unwrap());
    assert!(waits.is_watched(cq));
    // Nothing arrived: the wait at PASSIVE_LEVEL ends at its timeout.
    assert!(!clean(|| waits.wait(cq, std::time::Duration::from_millis(20))));
    // A CQE from another thread (the platform's interrupt), as in the guest.
    let (k2, dev2) = (k.clone(), dev.clone());
    let platform = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(20));
        dev2.write_cqe(cq, 0, 42);
        dev2.push_event(EventKind::CqCompletion, cq);
        clean(|| k2.deliver(PDO, 0))
    });
    assert!(clean(|| waits.wait(cq, std::time::Duration::from_secs(5))), "the callback set the CQ's event");
    assert!(platform.join().unwrap());
    let got: Vec<u64> = waits.take(cq, 8).iter().map(|c| c.wr_id.get()).collect();
    assert_eq!(got, vec![42]);
    assert!(waits.take(cq, 8).is_empty(), "each CQE is taken once");
    waits.unwatch(cq);
    let counts = clean(|| waits.disconnect());
    assert_eq!((counts.isr_calls, counts.dpc_calls, counts.cqes), (1, 1, 1));
    clean(|| hca.close());
    clean(|| k.unload_driver());
}

#[test]
fn a_kick_makes_the_dpc_look_at_a_cq_whose_cqe_came_before_it_was_armed() {
    let r = rig(STANDARD, InterruptResources::Messages(1), DEFAULT_CQE_BUDGET);
    r.dev.write_cqe(r.cq, 0, 3);
    // No event and no interrupt: without the kick nothing would read it.
    clean(|| r.path.kick(r.cq));
    assert_eq!(*r.seen.lock().unwrap(), vec![(r.cq, 3, DISPATCH_LEVEL)]);
    assert_eq!(r.path.counts().isr_calls, 0);
    clean(|| r.path.disconnect());
}
