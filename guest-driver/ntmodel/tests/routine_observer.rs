//! The completion path's observer on the model: it is told of every ISR run and every DPC run (re-queued ones
//! too), at the routine's own IRQL, so a host's times add up to the path's counts; and `unwatch_all` lets the
//! close free CQs while the interrupt stays connected for its commands.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use vhca_driver_core::*;
use vhca_ntapi::*;
use vhca_ntmodel::{InterruptResources, NtModel};
use vhca_proto::{Cqe, EventKind};

const STANDARD: u32 = 0x209BB;

fn clean<T>(f: impl FnOnce() -> T) -> T {
    NtModel::run_guarded(f).unwrap_or_else(|b| panic!("unexpected bugcheck:\n{b}"))
}

/// Each run the observer was told of: (routine, the IRQL it was told at).
type Runs = Arc<Mutex<Vec<(PathRoutine, KIRQL)>>>;

fn observer(k: &Arc<NtModel>, runs: &Runs) -> RoutineObserver {
    let (runs, k) = (runs.clone(), Arc::downgrade(k));
    Arc::new(move |routine| runs.lock().unwrap().push((routine, k.upgrade().unwrap().KeGetCurrentIrql())))
}

#[test]
fn every_isr_and_dpc_run_is_observed_at_its_own_irql() {
    let (k, backend) = machine(STANDARD);
    let dev = FakeDevice::new(k.clone(), backend);
    let mut hca = Hca::open(k.clone(), dev.clone(), PDO, HcaConfig::default()).expect("open");
    let cq = hca.create_cq(16).expect("create_cq");
    k.assign_interrupts(PDO, InterruptResources::Messages(1));
    let runs = Runs::default();
    let path =
        CompletionPath::connect(k.clone(), Arc::new(dev.clone()), PDO, 4, Some(observer(&k, &runs))).expect("connect");
    path.watch(cq, hca.cq_reader(cq).unwrap(), Arc::new(|_, _: &Cqe| {}));
    for i in 0..10 {
        dev.write_cqe(cq, i, i as u64);
    }
    dev.push_event(EventKind::CqCompletion, cq);
    assert!(clean(|| k.deliver(PDO, 0)));
    let counts = path.counts();
    assert_eq!((counts.isr_calls, counts.dpc_calls, counts.dpc_requeues), (1, 3, 2), "a budget of 4 for 10 CQEs");
    let seen = runs.lock().unwrap().clone();
    let isr: Vec<KIRQL> = seen.iter().filter(|r| r.0 == PathRoutine::Isr).map(|r| r.1).collect();
    let dpc: Vec<KIRQL> = seen.iter().filter(|r| r.0 == PathRoutine::Dpc).map(|r| r.1).collect();
    assert_eq!((isr.len() as u64, dpc.len() as u64), (counts.isr_calls, counts.dpc_calls), "{seen:?}");
    assert!(isr.iter().all(|&irql| irql > DISPATCH_LEVEL), "the ISR is observed at DIRQL: {seen:?}");
    assert!(dpc.iter().all(|&irql| irql == DISPATCH_LEVEL), "the DPC at DISPATCH_LEVEL: {seen:?}");
    assert_eq!(seen[0].0, PathRoutine::Isr, "the ISR runs before the DPC it queued: {seen:?}");
    clean(|| path.disconnect());
    hca.destroy_cq(cq).expect("destroy_cq");
    clean(|| hca.close());
    clean(|| k.unload_driver());
}

#[test]
fn after_unwatch_all_the_dpc_reads_no_cq_while_the_interrupt_stays_connected() {
    let (k, backend) = machine(STANDARD);
    let dev = FakeDevice::new(k.clone(), backend);
    let mut hca = Hca::open(k.clone(), dev.clone(), PDO, HcaConfig::default()).expect("open");
    let cqs = [hca.create_cq(16).expect("create_cq"), hca.create_cq(16).expect("create_cq")];
    let waits = connected_waits(&k, &dev);
    for cq in cqs {
        waits.watch(cq, hca.cq_reader(cq).unwrap());
    }
    waits.unwatch_all();
    for cq in cqs {
        assert!(!waits.is_watched(cq));
        dev.write_cqe(cq, 0, 1);
        dev.push_event(EventKind::CqCompletion, cq);
    }
    assert!(clean(|| k.deliver(PDO, 0)), "still connected: the ISR claims the message");
    let counts = waits.counts();
    assert_eq!((counts.isr_calls, counts.dpc_calls, counts.cqes), (1, 1, 0), "no CQ read after unwatch_all");
    // The close frees both CQs with the interrupt still connected; the disconnect comes after it.
    clean(|| hca.close());
    clean(|| waits.disconnect());
    clean(|| k.unload_driver());
}
