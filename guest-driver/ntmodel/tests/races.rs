//! The race detector on two threads over the model's pool: unordered writes are one report naming both call
//! sites; a common spin lock or a KeSetEvent/KeWaitForSingleObject order makes none; a read after another
//! thread's unordered free is one; with the mode Off nothing is looked for.

mod common;

use std::sync::Arc;
use std::thread;

use vhca_ntapi::*;
use vhca_ntmodel::interleaving::{Access, RaceReport};
use vhca_ntmodel::{InterleavingConfig, InterleavingMode, NtModel, NtModelConfig};

const TAG: u32 = pool_tag(b"vhca");

fn model(mode: InterleavingMode) -> Arc<NtModel> {
    let interleaving = InterleavingConfig { mode, ..InterleavingConfig::default() };
    NtModel::for_tests(NtModelConfig { interleaving, ..NtModelConfig::default() }).0
}

/// A write from a thread ordered with nothing: the control that shows the detector was looking all along (one
/// report, with the last ordered write).
fn unordered_write(k: &Arc<NtModel>, at: PVOID) -> Vec<RaceReport> {
    thread::scope(|s| {
        let third = thread::Builder::new().name("third".into());
        third.spawn_scoped(s, || k.RtlCopyToVa(at, &[3u8; 16])).unwrap().join().unwrap();
    });
    k.race_reports()
}

/// Runs `first` to its end on a thread named "first", then `second` on one named "second": an order the model
/// cannot see (it knows no thread's start or join), so only the model's own edges order them.
fn one_then_other(k: &Arc<NtModel>, first: impl FnOnce(&NtModel) + Send, second: impl FnOnce(&NtModel) + Send) {
    thread::scope(|s| {
        thread::Builder::new().name("first".into()).spawn_scoped(s, || first(k)).unwrap().join().unwrap();
        thread::Builder::new().name("second".into()).spawn_scoped(s, || second(k)).unwrap().join().unwrap();
    });
}

fn site_line(report_site: &str) -> u32 {
    let (_, rest) = report_site.split_once("races.rs:").expect("a site in this file");
    rest.split(':').next().unwrap().parse().unwrap()
}

#[test]
fn two_threads_writing_the_same_pool_bytes_without_a_lock_are_one_report_naming_both_sites() {
    let k = model(InterleavingMode::Record);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, 64, TAG);
    let (line_first, line_second) = (line!() + 4, line!() + 7);
    one_then_other(
        &k,
        |k| {
            k.RtlCopyToVa(PVOID(p.0 + 0x10), &[1u8; 16]);
        },
        |k| {
            k.RtlCopyToVa(PVOID(p.0 + 0x10), &[2u8; 16]);
        },
    );
    let reports = k.race_reports();
    assert_eq!(reports.len(), 1, "two granules, one pair of call sites: {reports:#?}");
    let RaceReport { object, earlier, later } = &reports[0];
    assert_eq!(object, &format!("memory {:#x}+0x10 (pool tag 'vhca')", p.0));
    assert_eq!((earlier.thread.as_str(), earlier.access), ("first", Access::Write));
    assert_eq!((later.thread.as_str(), later.access), ("second", Access::Write));
    assert_eq!((site_line(&earlier.site), site_line(&later.site)), (line_first, line_second));
}

#[test]
fn the_same_writes_under_one_spin_lock_are_no_race() {
    let k = model(InterleavingMode::Record);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, 64, TAG);
    let lock = k.KeInitializeSpinLock();
    let write_under_lock = |k: &NtModel, byte: u8| {
        let old = k.KeAcquireSpinLock(lock);
        k.RtlCopyToVa(p, &[byte; 16]);
        k.KeReleaseSpinLock(lock, old);
    };
    one_then_other(&k, |k| write_under_lock(k, 1), |k| write_under_lock(k, 2));
    assert_eq!(k.race_reports(), vec![]);
    let reports = unordered_write(&k, p);
    assert_eq!(reports.len(), 1, "{reports:#?}");
    assert_eq!((reports[0].earlier.thread.as_str(), reports[0].later.thread.as_str()), ("second", "third"));
}

#[test]
fn a_write_after_taking_the_lock_the_earlier_writer_gave_back_is_ordered_by_the_edge_alone() {
    let k = model(InterleavingMode::Record);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, 64, TAG);
    let lock = k.KeInitializeSpinLock();
    let write_then_release = |k: &NtModel| {
        let old = k.KeAcquireSpinLock(lock);
        k.RtlCopyToVa(p, &[1u8; 16]);
        k.KeReleaseSpinLock(lock, old);
    };
    // The second thread writes holding nothing, so no common lock excuses it: only release-to-acquire orders it.
    let acquire_release_then_write = |k: &NtModel| {
        let old = k.KeAcquireSpinLock(lock);
        k.KeReleaseSpinLock(lock, old);
        k.RtlCopyToVa(p, &[2u8; 16]);
    };
    one_then_other(&k, write_then_release, acquire_release_then_write);
    assert_eq!(k.race_reports(), vec![]);
}

#[test]
fn the_same_writes_ordered_by_an_event_are_no_race() {
    let k = model(InterleavingMode::Record);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, 64, TAG);
    let event = k.KeInitializeEvent(EVENT_TYPE::NotificationEvent, false);
    thread::scope(|s| {
        // The waiter starts first and blocks in the model: only the event orders it after the setter's write.
        let waiter = thread::Builder::new()
            .name("waiter".into())
            .spawn_scoped(s, || {
                let status = k.KeWaitForSingleObject(
                    DISPATCHER_OBJECT::Event(event),
                    KWAIT_REASON::Executive,
                    KPROCESSOR_MODE::KernelMode,
                    false,
                    None,
                );
                assert_eq!(status, STATUS_SUCCESS);
                k.RtlCopyToVa(p, &[2u8; 16]);
            })
            .unwrap();
        thread::Builder::new()
            .name("setter".into())
            .spawn_scoped(s, || {
                k.RtlCopyToVa(p, &[1u8; 16]);
                k.KeSetEvent(event, 0, false);
            })
            .unwrap()
            .join()
            .unwrap();
        waiter.join().unwrap();
    });
    assert_eq!(k.race_reports(), vec![]);
    let reports = unordered_write(&k, p);
    assert_eq!(reports.len(), 1, "{reports:#?}");
    assert_eq!((reports[0].earlier.thread.as_str(), reports[0].later.thread.as_str()), ("waiter", "third"));
}

#[test]
fn a_read_after_another_threads_unordered_free_is_one_report() {
    let k = model(InterleavingMode::Record);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, 64, TAG);
    one_then_other(
        &k,
        |k| k.ExFreePoolWithTag(p, TAG),
        |k| {
            // The model's own view of freed pool is gone (0x50); the race is reported before the access faults.
            let mut out = [0u8; 8];
            let faulted = NtModel::run_guarded(|| k.RtlCopyFromVa(&mut out, p)).is_err();
            assert!(faulted, "freed pool is 0x50 for the native driver");
        },
    );
    let reports = k.race_reports();
    assert_eq!(reports.len(), 1, "{reports:#?}");
    assert_eq!((reports[0].earlier.access, reports[0].later.access), (Access::Free, Access::Read));
    assert_eq!(reports[0].object, format!("memory {:#x}+0x0 (pool tag 'vhca', freed)", p.0));
    assert_eq!((reports[0].earlier.thread.as_str(), reports[0].later.thread.as_str()), ("first", "second"));
}

#[test]
fn with_the_mode_off_nothing_is_recorded_or_reported() {
    let k = model(InterleavingMode::Off);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, 64, TAG);
    one_then_other(&k, |k| k.RtlCopyToVa(p, &[1u8; 16]), |k| k.RtlCopyToVa(p, &[2u8; 16]));
    assert_eq!(k.race_reports(), vec![]);
    assert_eq!(k.schedule_points(), vec![]);
}

/// A passive path's store, then a kernel call, then an ISR's store to the same bytes on another thread, with a
/// doorbell of the passive path's (`binary_doorbell`) before its store or not at all. `kicks` counts every kernel
/// call as a doorbell (vhca.sys's default); `trapped` is the loader trapping the binary's real doorbells instead.
fn passive_then_isr(kicks: bool, trapped: bool, doorbell_before_store: bool) -> Vec<RaceReport> {
    use common::PDO;
    let interleaving =
        InterleavingConfig { mode: InterleavingMode::Record, kicks_at_every_call: kicks, ..Default::default() };
    let k = NtModel::for_tests(NtModelConfig { interleaving, ..NtModelConfig::default() }).0;
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, 64, TAG);
    k.assign_interrupts(PDO, vhca_ntmodel::InterruptResources::Messages(1));
    let weak = Arc::downgrade(&k);
    let isr: PKMESSAGE_SERVICE_ROUTINE = Arc::new(move |_, _| {
        weak.upgrade().unwrap().binary_access(p.0, 8, true, "vhca.sys+0x2000 (isr)");
        true
    });
    let _connection = k.IoConnectInterruptEx(common::message_parameters(isr)).expect("connect");
    if trapped {
        k.trap_doorbells();
    }
    one_then_other(
        &k,
        |k| {
            if doorbell_before_store {
                k.binary_access(p.0, 8, true, "vhca.sys+0x1000 (passive)");
                k.binary_doorbell(PDO.0, "vhca.sys+0x1010 (doorbell)");
            } else {
                k.binary_doorbell(PDO.0, "vhca.sys+0x1010 (doorbell)");
                k.binary_access(p.0, 8, true, "vhca.sys+0x1000 (passive)");
            }
            // A kernel call after the store: a doorbell only while every call counts as one.
            k.KeGetCurrentProcessorNumberEx(None);
        },
        |k| assert!(k.deliver(PDO, 0)),
    );
    k.race_reports()
}

#[test]
fn a_store_after_the_doorbell_races_the_isr_unless_every_kernel_call_counts_as_a_doorbell() {
    assert!(passive_then_isr(true, false, false).is_empty(), "hidden by the kernel call's implied kick");
    let reports = passive_then_isr(true, true, false);
    assert_eq!(reports.len(), 1, "with the binary's doorbells trapped the call kicks nothing: {reports:#?}");
    assert!(reports[0].earlier.site.contains("passive") && reports[0].later.site.contains("isr"), "{reports:#?}");
    assert!(passive_then_isr(false, false, false).len() == 1, "the native transport's kicks alone");
}

#[test]
fn a_store_before_the_doorbell_is_ordered_before_the_isr_it_rings_for() {
    assert!(passive_then_isr(true, true, true).is_empty());
    assert!(passive_then_isr(false, false, true).is_empty());
}
