//! The control path's waits on the interrupt path, on the model: a command's wait sleeps on the KEVENT the DPC sets
//! (woken by the DPC of a message, ended at PASSIVE_LEVEL by its deadline when nothing comes), the transport is
//! handed that signal at connect and takes it back before the interrupt is disconnected, and events that are not
//! CQ completions reach the control path through a work item at PASSIVE_LEVEL.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use vhca_driver_core::*;
use vhca_ntapi::*;
use vhca_ntmodel::{InterruptResources, NtModel};
use vhca_proto::{Event, EventKind};

const STANDARD: u32 = 0x209BB;

/// The fake device as a transport that keeps what `wait_for_interrupts` handed it.
struct Signalled {
    device: FakeDevice,
    signal: Mutex<Option<Arc<dyn CompletionSignal>>>,
    handed: Mutex<Vec<bool>>,
}

impl CommandTransport for Signalled {
    fn execute(&self, request: &[u8], capacity: usize) -> Result<Vec<u8>, CommandTransportError> {
        self.device.execute(request, capacity)
    }
    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError> {
        self.device.ring_doorbell(records)
    }
    fn poll_event(&self) -> Option<Event> {
        self.device.poll_event()
    }
    fn wait_for_interrupts(&self, signal: Option<Arc<dyn CompletionSignal>>) {
        self.handed.lock().unwrap().push(signal.is_some());
        *self.signal.lock().unwrap() = signal;
    }
}

fn clean<T>(f: impl FnOnce() -> T) -> T {
    NtModel::run_guarded(f).unwrap_or_else(|b| panic!("unexpected bugcheck:\n{b}"))
}

struct Rig {
    k: Arc<NtModel>,
    dev: FakeDevice,
    hca: Hca<NtModel, FakeDevice>,
    transport: Arc<Signalled>,
    waits: CompletionWaits<NtModel, Signalled>,
}

fn rig() -> Rig {
    let (k, backend) = machine(STANDARD);
    let dev = FakeDevice::new(k.clone(), backend);
    let hca = Hca::open(k.clone(), dev.clone(), PDO, HcaConfig::default()).expect("open");
    k.assign_interrupts(PDO, InterruptResources::Messages(1));
    let transport =
        Arc::new(Signalled { device: dev.clone(), signal: Mutex::new(None), handed: Mutex::new(Vec::new()) });
    let waits =
        CompletionWaits::connect(k.clone(), transport.clone(), PathDevices::pdo_only(PDO), DEFAULT_CQE_BUDGET, None)
            .expect("connect");
    Rig { k, dev, hca, transport, waits }
}

/// Disconnects and unloads: the verifier's unload checks find no timer set, no DPC queued, no work item left.
fn finish(r: Rig) -> CompletionCounts {
    let Rig { k, hca, waits, transport, .. } = r;
    let counts = clean(|| (Box::new(waits) as Box<dyn CqCompletions>).disconnect());
    assert_eq!(*transport.handed.lock().unwrap(), [true, false], "handed at connect, taken back at disconnect");
    assert!(transport.signal.lock().unwrap().is_none());
    clean(|| hca.close());
    clean(|| k.unload_driver());
    counts
}

#[test]
fn a_command_wait_sleeps_on_the_dpcs_kevent_and_its_deadline_ends_it_at_passive_level_with_nothing() {
    let r = rig();
    let signal = r.transport.signal.lock().unwrap().clone().expect("the transport got the command event at connect");
    assert_eq!(r.k.KeGetCurrentIrql(), PASSIVE_LEVEL);

    // Nothing comes: the deadline's DPC wakes the one sleep (one more poll of the ring), the next gives up.
    let started = Instant::now();
    clean(|| signal.begin(Duration::from_millis(30)));
    let mut sleeps = 0;
    while clean(|| signal.sleep()) {
        sleeps += 1;
        assert!(sleeps < 5, "the deadline did not end the wait");
    }
    clean(|| signal.end());
    assert!(started.elapsed() >= Duration::from_millis(30), "gave up early: {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(5), "the deadline's DPC ended it: {:?}", started.elapsed());
    assert_eq!(sleeps, 1, "woken once, by the deadline");
    assert_eq!(r.waits.command_waits(), (1, 0), "one sleep, no wake by a message");

    // A message on another thread (the platform's interrupt): its ISR queues the DPC, which sets the event.
    clean(|| signal.begin(Duration::from_secs(10)));
    let k2 = r.k.clone();
    let platform = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        clean(|| k2.deliver(PDO, 0))
    });
    let started = Instant::now();
    assert!(clean(|| signal.sleep()), "the DPC's KeSetEvent woke the wait");
    assert!(started.elapsed() < Duration::from_secs(5), "woken by the message, not the deadline");
    assert!(platform.join().unwrap(), "the ISR claimed the message");
    clean(|| signal.end());
    assert_eq!(r.waits.command_waits(), (2, 1));
    let counts = finish(r);
    assert_eq!((counts.isr_calls, counts.dpc_calls), (1, 1));
}

#[test]
fn a_wait_left_over_from_an_earlier_dpc_run_costs_one_poll_and_not_the_next_commands_deadline() {
    let r = rig();
    let signal = r.transport.signal.lock().unwrap().clone().unwrap();
    // A DPC run with no command waiting (an event's message) leaves the event set; the next command's wait begins
    // by clearing it, so its first sleep waits for a new signal instead of returning at once.
    clean(|| r.k.deliver(PDO, 0));
    clean(|| signal.begin(Duration::from_millis(30)));
    let started = Instant::now();
    assert!(clean(|| signal.sleep()));
    assert!(started.elapsed() >= Duration::from_millis(25), "a stale set ended the sleep: {:?}", started.elapsed());
    assert!(!clean(|| signal.sleep()), "past the deadline");
    clean(|| signal.end());
    finish(r);
}

#[test]
fn an_event_that_is_not_a_cq_completion_reaches_the_control_path_through_a_work_item_at_passive_level() {
    let r = rig();
    // Nothing yet: the event wait at PASSIVE_LEVEL ends at its timeout.
    assert!(!clean(|| r.waits.wait_event(Duration::from_millis(20))));
    r.dev.push_event(EventKind::QpFatal, 9);
    r.dev.push_event(EventKind::DmaFault, 0);
    // The ISR and DPC run on this thread; the DPC only queues the work item, which runs on a system worker.
    clean(|| r.k.deliver(PDO, 0));
    assert!(clean(|| r.waits.wait_event(Duration::from_secs(5))), "the work item handed the events over");
    let mut kinds = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while kinds.len() < 2 && Instant::now() < deadline {
        match r.waits.take_event() {
            Some(e) => kinds.push((e.kind.get(), e.handle.get())),
            None => {
                clean(|| r.waits.wait_event(Duration::from_millis(100)));
            }
        }
    }
    assert_eq!(kinds, [(EventKind::QpFatal as u32, 9), (EventKind::DmaFault as u32, 0)], "in arrival order");
    let handed = r.waits.event_hand_offs();
    assert_eq!(handed.events, 2);
    assert!(handed.runs >= 1);
    assert_eq!(handed.max_irql, PASSIVE_LEVEL, "IoQueueWorkItem's routine runs at PASSIVE_LEVEL");
    // A CQ completion is the DPC's own business: it never goes to the work item.
    r.dev.push_event(EventKind::CqCompletion, 1);
    clean(|| r.k.deliver(PDO, 0));
    assert!(!clean(|| r.waits.wait_event(Duration::from_millis(20))));
    assert_eq!(r.waits.event_hand_offs().events, 2);
    finish(r);
}

#[test]
fn teardown_waits_for_a_queued_work_item_before_it_frees_it() {
    let r = rig();
    r.dev.push_event(EventKind::QpFatal, 3);
    clean(|| r.k.deliver(PDO, 0));
    // Disconnected at once, whether or not the worker ran yet: a queued item freed would be 0xE4/0x2.
    finish(r);
}

#[test]
fn the_event_hand_offs_work_item_belongs_to_the_drivers_own_device_object_and_the_interrupt_to_the_pdo() {
    let (k, backend) = machine(STANDARD);
    let dev = FakeDevice::new(k.clone(), backend);
    let hca = Hca::open(k.clone(), dev.clone(), PDO, HcaConfig::default()).expect("open");
    k.assign_interrupts(PDO, InterruptResources::Messages(1));
    // vhca.sys's FDO stands apart from the bus driver's PDO: the item's reference must keep vhca.sys loaded.
    let fdo = PDEVICE_OBJECT(PDO.0 + 0x1000);
    let waits = CompletionWaits::connect(k.clone(), Arc::new(dev.clone()), PathDevices { pdo: PDO, own: fdo }, 1, None)
        .expect("connect");
    assert_eq!(k.work_item_devices(), [fdo], "one work item, the FDO's");
    assert!(waits.connection().is_some(), "the interrupt was connected for the PDO, which has the messages");
    clean(|| (Box::new(waits) as Box<dyn CqCompletions>).disconnect());
    assert!(k.work_item_devices().is_empty(), "freed at disconnect");
    clean(|| hca.close());
}
