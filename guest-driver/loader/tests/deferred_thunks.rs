//! The DPC, timer, work item, event and processor routines a driver binary calls, called here as the binary calls
//! them (the bound addresses, the Windows x64 convention, KDPC/KTIMER/KEVENT in the caller's memory), with fake
//! driver routines as `extern "win64"` functions, over the NT model with IRQL checking: DPCs at DISPATCH_LEVEL, a
//! timer's expiry queueing its DPC, work items at PASSIVE_LEVEL on the model's worker thread, waits on events and
//! timers. One kernel per process.

mod common;

use std::ffi::c_void;
use std::sync::Mutex;
use std::time::Duration;

use common::routine;
use common::shared_kernel::{irql, resident, take_turn};
use vhca_loader::kernel_context::kernel;
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, KDPC, KEVENT};
use windows_sys::Wdk::System::SystemServices::KTIMER;
use windows_sys::Win32::Foundation::NTSTATUS;
use windows_sys::Win32::System::Kernel::PROCESSOR_NUMBER;

type Deferred = unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void, *mut c_void);
type InitDpc = unsafe extern "win64" fn(*mut KDPC, Deferred, *mut c_void);
type InsertDpc = unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void) -> u8;
type Wait = unsafe extern "win64" fn(*mut c_void, u32, i8, u8, *const i64) -> NTSTATUS;

const STATUS_TIMEOUT: NTSTATUS = 0x102;

/// (which routine, IRQL, KDPC, DeferredContext, SystemArgument1) of one DPC call.
type DpcCall = (&'static str, u8, usize, usize, usize);
static DPC_CALLS: Mutex<Vec<DpcCall>> = Mutex::new(Vec::new());

unsafe extern "win64" fn first(dpc: *mut KDPC, context: *mut c_void, argument1: *mut c_void, _a2: *mut c_void) {
    DPC_CALLS.lock().unwrap().push(("first", irql(), dpc as usize, context as usize, argument1 as usize));
}

unsafe extern "win64" fn second(dpc: *mut KDPC, context: *mut c_void, argument1: *mut c_void, _a2: *mut c_void) {
    DPC_CALLS.lock().unwrap().push(("second", irql(), dpc as usize, context as usize, argument1 as usize));
}

fn calls_of(dpc: *mut KDPC) -> Vec<(&'static str, u8, usize, usize)> {
    let calls = DPC_CALLS.lock().unwrap();
    calls.iter().filter(|c| c.2 == dpc as usize).map(|c| (c.0, c.1, c.3, c.4)).collect()
}

#[test]
fn a_dpc_runs_at_dispatch_once_per_queueing_and_a_second_initialization_replaces_the_first() {
    let _turn = take_turn();
    let init: InitDpc = routine("KeInitializeDpc");
    let insert: InsertDpc = routine("KeInsertQueueDpc");
    let remove: unsafe extern "win64" fn(*mut KDPC) -> u8 = routine("KeRemoveQueueDpc");
    let flush: unsafe extern "win64" fn() = routine("KeFlushQueuedDpcs");
    let raise: unsafe extern "win64" fn(u8) -> u8 = routine("KfRaiseIrql");
    let lower: unsafe extern "win64" fn(u8) = routine("KeLowerIrql");
    let dpc = resident::<KDPC>();
    // SAFETY (all calls below): the thunks with the caller's KDPC and routines, at the IRQLs they allow.
    unsafe {
        init(dpc, first, 0xC0 as *mut c_void);
        assert_eq!((*dpc).Anonymous.Anonymous.Type, 0x13, "DpcObject, as KeInitializeDpc writes it");
        assert_eq!((*dpc).DeferredContext as usize, 0xC0);
        // Queued at PASSIVE_LEVEL, it runs before KeInsertQueueDpc returns, at DISPATCH_LEVEL.
        assert_eq!(insert(dpc, 7 as *mut c_void, std::ptr::null_mut()), 1);
        assert_eq!(calls_of(dpc), vec![("first", 2, 0xC0, 7)]);
        assert_eq!(irql(), 0);

        // At DISPATCH_LEVEL it waits: a second insert is refused, KeRemoveQueueDpc takes it off before it ran.
        let old = raise(2);
        assert_eq!(insert(dpc, 8 as *mut c_void, std::ptr::null_mut()), 1);
        assert_eq!(insert(dpc, 9 as *mut c_void, std::ptr::null_mut()), 0, "already queued");
        assert_eq!(remove(dpc), 1);
        assert_eq!(remove(dpc), 0);
        lower(old);
        flush();
        assert_eq!(calls_of(dpc).len(), 1, "the removed DPC never ran");

        init(dpc, second, 0xC1 as *mut c_void);
        insert(dpc, 10 as *mut c_void, std::ptr::null_mut());
        assert_eq!(calls_of(dpc)[1..], [("second", 2, 0xC1, 10)]);
    }
    assert!(kernel().model.bugchecks().is_empty());
}

#[test]
fn a_timer_expiry_queues_its_dpc_and_satisfies_a_wait() {
    let (k, _turn) = take_turn();
    let init_timer: unsafe extern "win64" fn(*mut KTIMER, i32) = routine("KeInitializeTimerEx");
    let set_timer: unsafe extern "win64" fn(*mut KTIMER, i64, i32, *mut KDPC) -> u8 = routine("KeSetTimerEx");
    let cancel: unsafe extern "win64" fn(*mut KTIMER) -> u8 = routine("KeCancelTimer");
    let init: InitDpc = routine("KeInitializeDpc");
    let wait: Wait = routine("KeWaitForSingleObject");
    let (timer, dpc) = (resident::<KTIMER>(), resident::<KDPC>());
    // SAFETY (all calls below): the thunks with the caller's objects, at PASSIVE_LEVEL.
    unsafe {
        init(dpc, first, 0x71 as *mut c_void);
        init_timer(timer, 0);
        assert_eq!(*(timer as *const u8), 8, "TimerNotificationObject");
        let zero = 0i64;
        assert_eq!(wait(timer.cast(), 0, 0, 0, &zero), STATUS_TIMEOUT, "not yet signaled");
        assert_eq!(set_timer(timer, -10_000, 0, dpc), 0, "1 ms from now; not set before");
        k.model.advance_clock(Duration::from_millis(5));
        assert_eq!(calls_of(dpc), vec![("first", 2, 0x71, 0)], "the expiry queued its DPC, run at DISPATCH");
        assert_eq!(wait(timer.cast(), 0, 0, 0, std::ptr::null()), 0, "the expired timer satisfies the wait");
        assert_eq!(set_timer(timer, -100_000_000, 0, dpc), 0);
        assert_eq!(cancel(timer), 1, "it was set");
        k.model.advance_clock(Duration::from_secs(11));
        assert_eq!(calls_of(dpc).len(), 1, "a cancelled timer queues nothing");
    }
}

/// (IRQL, device object, context, thread) per work item call.
static WORK: Mutex<Vec<(u8, usize, usize, std::thread::ThreadId)>> = Mutex::new(Vec::new());

unsafe extern "win64" fn worker(device: *mut DEVICE_OBJECT, context: *mut c_void) {
    WORK.lock().unwrap().push((irql(), device as usize, context as usize, std::thread::current().id()));
}

#[test]
fn a_work_item_runs_at_passive_on_the_models_worker_thread() {
    let (k, _turn) = take_turn();
    let allocate: unsafe extern "win64" fn(*mut DEVICE_OBJECT) -> *mut c_void = routine("IoAllocateWorkItem");
    type Worker = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut c_void);
    let queue: unsafe extern "win64" fn(*mut c_void, Worker, i32, *mut c_void) = routine("IoQueueWorkItem");
    let free: unsafe extern "win64" fn(*mut c_void) = routine("IoFreeWorkItem");
    let device = 0xFFFF_C000_0000_4000usize as *mut DEVICE_OBJECT;
    // SAFETY (all calls below): the thunks with a device object and the caller's routine, at their IRQLs.
    let item = unsafe { allocate(device) };
    assert!(!item.is_null());
    let raise: unsafe extern "win64" fn(u8) -> u8 = routine("KfRaiseIrql");
    let lower: unsafe extern "win64" fn(u8) = routine("KeLowerIrql");
    // SAFETY: as above; queued from DISPATCH_LEVEL, as a DPC queues one.
    unsafe {
        let old = raise(2);
        queue(item, worker, 1, 0x3E as *mut c_void);
        lower(old);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while WORK.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let work = WORK.lock().unwrap().clone();
    assert_eq!(work.len(), 1, "the routine ran once");
    let (work_irql, work_device, context, thread) = work[0];
    assert_eq!((work_irql, work_device, context), (0, device as usize, 0x3E));
    assert_ne!(thread, std::thread::current().id(), "on a worker thread");
    // SAFETY: the item, run and no longer queued.
    unsafe { free(item) };
    assert!(k.model.bugchecks().is_empty());
}

#[test]
fn events_wake_a_waiter_on_another_thread_and_reset_says_what_they_were() {
    let _turn = take_turn();
    let init: unsafe extern "win64" fn(*mut KEVENT, u32, u8) = routine("KeInitializeEvent");
    let set: unsafe extern "win64" fn(*mut KEVENT, i32, u8) -> i32 = routine("KeSetEvent");
    let clear: unsafe extern "win64" fn(*mut KEVENT) = routine("KeClearEvent");
    let reset: unsafe extern "win64" fn(*mut KEVENT) -> i32 = routine("KeResetEvent");
    let wait: Wait = routine("KeWaitForSingleObject");
    let event = resident::<KEVENT>() as usize;
    // SAFETY (all calls below): the thunks with the caller's KEVENT, at PASSIVE_LEVEL.
    unsafe {
        init(event as *mut KEVENT, 1, 0);
        let timeout = -10_000i64;
        assert_eq!(wait(event as *mut c_void, 0, 0, 0, &timeout), STATUS_TIMEOUT);
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            set(event as *mut KEVENT, 0, 0)
        });
        assert_eq!(wait(event as *mut c_void, 0, 0, 0, std::ptr::null()), 0, "woken by the other thread's set");
        assert_eq!(setter.join().unwrap(), 0, "it was not signaled before");
        assert_eq!(wait(event as *mut c_void, 0, 0, 0, &timeout), STATUS_TIMEOUT, "a synchronization event resets");

        init(event as *mut KEVENT, 0, 1);
        assert_eq!(wait(event as *mut c_void, 0, 0, 0, std::ptr::null()), 0);
        assert_eq!(wait(event as *mut c_void, 0, 0, 0, std::ptr::null()), 0, "a notification event stays set");
        assert_eq!(reset(event as *mut KEVENT), 1);
        assert_eq!(reset(event as *mut KEVENT), 0);
        set(event as *mut KEVENT, 0, 0);
        clear(event as *mut KEVENT);
        assert_eq!(wait(event as *mut c_void, 0, 0, 0, &timeout), STATUS_TIMEOUT);
    }
}

#[test]
fn dpc_level_spin_locks_and_the_processor_number_leave_the_irql_alone() {
    let _turn = take_turn();
    let raise: unsafe extern "win64" fn(u8) -> u8 = routine("KfRaiseIrql");
    let lower: unsafe extern "win64" fn(u8) = routine("KeLowerIrql");
    let acquire: unsafe extern "win64" fn(*mut u64) = routine("KeAcquireSpinLockAtDpcLevel");
    let release: unsafe extern "win64" fn(*mut u64) = routine("KeReleaseSpinLockFromDpcLevel");
    let number: unsafe extern "win64" fn(*mut PROCESSOR_NUMBER) -> u32 = routine("KeGetCurrentProcessorNumberEx");
    let mut lock = 0u64;
    let mut processor = PROCESSOR_NUMBER { Group: 7, Number: 7, Reserved: 7 };
    // SAFETY (all calls below): the thunks at DISPATCH_LEVEL, as a DPC calls them, on the caller's KSPIN_LOCK.
    unsafe {
        let old = raise(2);
        acquire(&mut lock);
        assert_eq!(irql(), 2);
        release(&mut lock);
        assert_eq!(irql(), 2);
        let n = number(&mut processor);
        assert_eq!((processor.Group, u32::from(processor.Number), processor.Reserved), (0, n, 0));
        lower(old);
    }
    assert!(kernel().model.bugchecks().is_empty());
}
