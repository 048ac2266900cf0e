//! Cancelling IRPs through the imports a driver calls: IoCancelIrp and the cancel spin lock, the cancel-safe queue
//! routines (IoCsq*) around a fake driver's own queue and spin lock, and a user-mode caller's overlapped
//! DeviceIoControl that its driver leaves pending, cancels (CancelIoEx) or leaves behind at its thread's exit.
//! A cancel routine that returns holding the cancel spin lock stops the machine (0x11B), so that case runs in a
//! child process (this binary again).

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::shared_kernel::{irql, take_turn};
use common::{child_of_this_test, routine, NoBus, StopAndExit, STOPPED};
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_loader::user_requests::{take_stuck, Sent, UserFile};
use vhca_ntmodel::{HostDmaBackend, NtModel, NtModelConfig, VerifierFlags};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, DRIVER_OBJECT, IRP};
use windows_sys::Wdk::System::SystemServices::{
    IO_CSQ, IO_CSQ_IRP_CONTEXT, IRP_MJ_CLEANUP, IRP_MJ_CLOSE, IRP_MJ_CREATE, IRP_MJ_DEVICE_CONTROL,
};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_CANCELLED, STATUS_PENDING, STATUS_SUCCESS};

const CASE: &str = "VHCA_LOADER_IRP_CANCEL_CASE";
const SL_PENDING_RETURNED: u8 = 0x01;

/// The fake driver's control codes (METHOD_BUFFERED, FILE_DEVICE_UNKNOWN).
const fn code(function: u32) -> u32 {
    (0x22 << 16) | (function << 2)
}
/// Queued in the cancel-safe queue, without a context.
const QUEUE: u32 = code(0x801);
/// Queued with the driver's one IO_CSQ_IRP_CONTEXT.
const QUEUE_WITH_CONTEXT: u32 = code(0x802);
/// Cancelled by the driver itself (as another thread could) just before it is queued.
const CANCELLED_THEN_QUEUED: u32 = code(0x803);
/// Kept pending with no cancel routine: a cancellation never reaches it.
const IGNORES_CANCEL: u32 = code(0x804);
/// Kept pending with a cancel routine that returns holding the cancel spin lock.
const HOLDS_CANCEL_LOCK: u32 = code(0x805);

type Dispatch = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP) -> NTSTATUS;
type Create =
    unsafe extern "win64" fn(*mut DRIVER_OBJECT, u32, *const c_void, u32, u32, u8, *mut *mut DEVICE_OBJECT) -> NTSTATUS;
type Attach = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut DEVICE_OBJECT) -> *mut DEVICE_OBJECT;
type CsqInitialize = unsafe extern "win64" fn(*mut IO_CSQ, usize, usize, usize, usize, usize, usize) -> NTSTATUS;
type CsqInsert = unsafe extern "win64" fn(*mut IO_CSQ, *mut IRP, *mut IO_CSQ_IRP_CONTEXT);
type CsqRemove = unsafe extern "win64" fn(*mut IO_CSQ, *mut IO_CSQ_IRP_CONTEXT) -> *mut IRP;
type CsqRemoveNext = unsafe extern "win64" fn(*mut IO_CSQ, *mut c_void) -> *mut IRP;
type CancelIrp = unsafe extern "win64" fn(*mut IRP) -> u8;
type SpinAcquire = unsafe extern "win64" fn(usize) -> u8;
type SpinRelease = unsafe extern "win64" fn(usize, u8);

/// The fake driver's state: its queue (IRP addresses, oldest first), the spin lock guarding it, what its
/// CsqCompleteCanceledIrp saw, and its IO_CSQ and context.
struct Driver {
    queue: Mutex<Vec<usize>>,
    lock: usize,
    lock_held: AtomicBool,
    cancelled: AtomicUsize,
    completed_with_lock_held: AtomicBool,
    completion_irql: AtomicU8,
    csq: usize,
    context: usize,
    fdo: usize,
    kept: AtomicUsize,
}

fn driver() -> &'static Driver {
    static DRIVER: std::sync::OnceLock<Driver> = std::sync::OnceLock::new();
    DRIVER.get_or_init(|| {
        let csq: *mut IO_CSQ = Box::into_raw(Box::new(IO_CSQ::default()));
        let init: CsqInitialize = routine("IoCsqInitialize");
        // SAFETY: the thunk with the driver's IO_CSQ and its routines, all with the Windows x64 convention.
        let status = unsafe {
            init(
                csq,
                csq_insert as *const () as usize,
                csq_remove as *const () as usize,
                csq_peek as *const () as usize,
                csq_acquire as *const () as usize,
                csq_release as *const () as usize,
                csq_complete_canceled as *const () as usize,
            )
        };
        assert_eq!(status, STATUS_SUCCESS);
        Driver {
            queue: Mutex::new(Vec::new()),
            lock: Box::into_raw(Box::new(0u64)) as *const () as usize,
            lock_held: AtomicBool::new(false),
            cancelled: AtomicUsize::new(0),
            completed_with_lock_held: AtomicBool::new(false),
            completion_irql: AtomicU8::new(0xFF),
            csq: csq as *const () as usize,
            context: Box::into_raw(Box::new(IO_CSQ_IRP_CONTEXT::default())) as *const () as usize,
            fdo: make_fdo() as *const () as usize,
            kept: AtomicUsize::new(0),
        }
    })
}

unsafe extern "win64" fn csq_insert(_csq: *mut IO_CSQ, irp: *mut IRP) {
    driver().queue.lock().unwrap().push(irp as usize);
}

unsafe extern "win64" fn csq_remove(_csq: *mut IO_CSQ, irp: *mut IRP) {
    driver().queue.lock().unwrap().retain(|&i| i != irp as usize);
}

/// The next IRP after `irp` (the first for NULL); the peek context is unused (every IRP matches).
unsafe extern "win64" fn csq_peek(_csq: *mut IO_CSQ, irp: *mut IRP, _peek: *mut c_void) -> *mut IRP {
    let queue = driver().queue.lock().unwrap();
    let next =
        if irp.is_null() { 0 } else { queue.iter().position(|&i| i == irp as usize).map_or(queue.len(), |p| p + 1) };
    queue.get(next).map_or(std::ptr::null_mut(), |&i| i as *mut IRP)
}

unsafe extern "win64" fn csq_acquire(_csq: *mut IO_CSQ, irql: *mut u8) {
    let acquire: SpinAcquire = routine("KeAcquireSpinLockRaiseToDpc");
    // SAFETY: the thunk, the driver's own lock; the caller's KIRQL to fill.
    unsafe { *irql = acquire(driver().lock) };
    driver().lock_held.store(true, Ordering::SeqCst);
}

unsafe extern "win64" fn csq_release(_csq: *mut IO_CSQ, irql: u8) {
    driver().lock_held.store(false, Ordering::SeqCst);
    let release: SpinRelease = routine("KeReleaseSpinLock");
    // SAFETY: the thunk, the lock csq_acquire took.
    unsafe { release(driver().lock, irql) };
}

unsafe extern "win64" fn csq_complete_canceled(_csq: *mut IO_CSQ, irp: *mut IRP) {
    let d = driver();
    d.cancelled.fetch_add(1, Ordering::SeqCst);
    d.completed_with_lock_held.store(d.lock_held.load(Ordering::SeqCst), Ordering::SeqCst);
    d.completion_irql.store(irql(), Ordering::SeqCst);
    // SAFETY: the cancelled IRP, the driver's to complete.
    unsafe { complete(irp, STATUS_CANCELLED) };
}

/// # Safety
/// A live IRP the caller holds.
unsafe fn complete(irp: *mut IRP, status: NTSTATUS) {
    let complete: unsafe extern "win64" fn(*mut IRP, i8) = routine("IofCompleteRequest");
    // SAFETY: the caller's contract.
    unsafe {
        (*irp).IoStatus.Anonymous.Status = status;
        (*irp).IoStatus.Information = 0;
        complete(irp, 0);
    }
}

unsafe extern "win64" fn succeeds(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the I/O manager's IRP, completed once.
    unsafe { complete(irp, STATUS_SUCCESS) };
    STATUS_SUCCESS
}

/// A cancel routine that never releases the cancel spin lock.
unsafe extern "win64" fn keeps_cancel_lock(_device: *mut DEVICE_OBJECT, _irp: *mut IRP) {}

unsafe extern "win64" fn device_control(_device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    let d = driver();
    let insert: CsqInsert = routine("IoCsqInsertIrp");
    // SAFETY: the I/O manager's IRP at this driver's location; the queue routines with the driver's IO_CSQ.
    unsafe {
        let stack = (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation;
        match (*stack).Parameters.DeviceIoControl.IoControlCode {
            QUEUE => insert(d.csq as *mut IO_CSQ, irp, std::ptr::null_mut()),
            QUEUE_WITH_CONTEXT => insert(d.csq as *mut IO_CSQ, irp, d.context as *mut IO_CSQ_IRP_CONTEXT),
            CANCELLED_THEN_QUEUED => {
                let cancel: CancelIrp = routine("IoCancelIrp");
                assert_eq!(cancel(irp), 0, "no cancel routine yet: nothing to call");
                insert(d.csq as *mut IO_CSQ, irp, std::ptr::null_mut());
            }
            IGNORES_CANCEL => {
                (*stack).Control |= SL_PENDING_RETURNED;
                d.kept.store(irp as usize, Ordering::SeqCst);
            }
            HOLDS_CANCEL_LOCK => {
                (*stack).Control |= SL_PENDING_RETURNED;
                (*irp).CancelRoutine = std::mem::transmute::<usize, _>(keeps_cancel_lock as *const () as usize);
            }
            _ => {
                complete(irp, STATUS_SUCCESS);
                return STATUS_SUCCESS;
            }
        }
    }
    STATUS_PENDING
}

/// The fake driver's FDO on the PDO's stack.
fn make_fdo() -> *mut DEVICE_OBJECT {
    let create: Create = routine("IoCreateDevice");
    let attach: Attach = routine("IoAttachDeviceToDeviceStack");
    let object: *mut DRIVER_OBJECT = Box::into_raw(Box::new(DRIVER_OBJECT::default()));
    // SAFETY: a fresh driver object whose routines have the Windows x64 convention its table is called with; the
    // thunks with objects that live as long as the process.
    unsafe {
        let set = |major: u32, f: Dispatch| {
            (*object).MajorFunction[major as usize] = Some(std::mem::transmute::<
                Dispatch,
                unsafe extern "system" fn(*const DEVICE_OBJECT, *mut IRP) -> NTSTATUS,
            >(f));
        };
        set(IRP_MJ_CREATE, succeeds);
        set(IRP_MJ_CLEANUP, succeeds);
        set(IRP_MJ_CLOSE, succeeds);
        set(IRP_MJ_DEVICE_CONTROL, device_control);
        let mut fdo = std::ptr::null_mut();
        assert_eq!(create(object, 0, std::ptr::null(), 0x22, 0, 0, &mut fdo), STATUS_SUCCESS);
        assert!(!attach(fdo, kernel().io.device_pdo()).is_null());
        fdo
    }
}

fn open() -> UserFile {
    UserFile::create(driver().fdo as *mut DEVICE_OBJECT).expect("CREATE succeeds")
}

fn queued() -> usize {
    driver().queue.lock().unwrap().len()
}

#[test]
fn a_cancelled_queued_request_is_removed_then_completed_at_passive_with_no_lock_held() {
    let (_k, _turn) = take_turn();
    let file = open();
    let d = driver();
    let before = d.cancelled.load(Ordering::SeqCst);
    let mut out = [0u8; 8];
    let Sent::Pending(pending) = file.device_control_overlapped(QUEUE, &[], &mut out) else {
        panic!("the driver queued it: STATUS_PENDING");
    };
    let irp = pending.irp();
    // SAFETY: the IRP is queued, live until it completes.
    unsafe {
        assert!((*irp).CancelRoutine.is_some(), "IoCsqInsertIrp made it cancelable");
        let stack = (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation;
        assert_ne!((*stack).Control & SL_PENDING_RETURNED, 0, "IoCsqInsertIrp marked it pending");
    }
    assert_eq!(queued(), 1);
    assert!(pending.cancel(), "its cancel routine ran");
    let reply = pending.wait(Some(std::time::Duration::from_secs(5))).ok().expect("completed as cancelled");
    assert_eq!((reply.status, reply.information), (STATUS_CANCELLED, 0));
    assert_eq!(queued(), 0, "CsqRemoveIrp took it out before CsqCompleteCanceledIrp");
    assert_eq!(d.cancelled.load(Ordering::SeqCst), before + 1);
    assert!(!d.completed_with_lock_held.load(Ordering::SeqCst), "completed outside the driver's lock");
    assert_eq!(d.completion_irql.load(Ordering::SeqCst), 0, "and back at the canceller's IRQL");
    assert_eq!(irql(), 0, "the cancel spin lock was released");
    file.close();
}

#[test]
fn remove_next_hands_out_in_order_and_a_removed_request_is_no_longer_cancelable() {
    let (_k, _turn) = take_turn();
    let file = open();
    let remove_next: CsqRemoveNext = routine("IoCsqRemoveNextIrp");
    let (mut a, mut b) = ([0u8; 4], [0u8; 4]);
    let (Sent::Pending(first), Sent::Pending(second)) =
        (file.device_control_overlapped(QUEUE, &[], &mut a), file.device_control_overlapped(QUEUE, &[], &mut b))
    else {
        panic!("both queued");
    };
    let csq = driver().csq as *mut IO_CSQ;
    // SAFETY: the driver's queue.
    let taken = unsafe { remove_next(csq, std::ptr::null_mut()) };
    assert_eq!(taken, first.irp(), "the oldest first");
    // SAFETY: the IRP IoCsqRemoveNextIrp handed back: the driver's now.
    unsafe {
        assert!((*taken).CancelRoutine.is_none(), "taken out of the queue, it is not cancelable");
        assert!(!first.cancel(), "IoCancelIrp finds no cancel routine");
        assert!((*taken).Cancel, "but marks it cancelled for its owner");
        complete(taken, STATUS_SUCCESS);
    }
    assert_eq!(first.wait(None).ok().map(|r| r.status), Some(STATUS_SUCCESS));
    assert!(second.cancel());
    assert_eq!(second.wait(None).ok().map(|r| r.status), Some(STATUS_CANCELLED));
    // SAFETY: as above; the queue is empty now.
    assert!(unsafe { remove_next(csq, std::ptr::null_mut()) }.is_null());
    file.close();
}

#[test]
fn remove_by_context_gives_the_request_back_or_null_once_it_was_cancelled() {
    let (_k, _turn) = take_turn();
    let file = open();
    let remove: CsqRemove = routine("IoCsqRemoveIrp");
    let (csq, context) = (driver().csq as *mut IO_CSQ, driver().context as *mut IO_CSQ_IRP_CONTEXT);
    let mut out = [0u8; 4];
    let Sent::Pending(pending) = file.device_control_overlapped(QUEUE_WITH_CONTEXT, &[], &mut out) else {
        panic!("queued");
    };
    // SAFETY: the context IoCsqInsertIrp filled.
    unsafe {
        assert_eq!((*context).Irp, pending.irp());
        assert_eq!((*context).Csq, csq);
    }
    assert!(pending.cancel());
    assert_eq!(pending.wait(None).ok().map(|r| r.status), Some(STATUS_CANCELLED));
    // SAFETY: as above: the cancel routine cleared the context.
    assert!(unsafe { remove(csq, context) }.is_null(), "a cancelled IRP is not handed out");
    let Sent::Pending(pending) = file.device_control_overlapped(QUEUE_WITH_CONTEXT, &[], &mut out) else {
        panic!("queued");
    };
    // SAFETY: as above.
    let irp = unsafe { remove(csq, context) };
    assert_eq!(irp, pending.irp());
    // SAFETY: removed: the driver's to complete.
    unsafe { complete(irp, STATUS_SUCCESS) };
    assert_eq!(pending.wait(None).ok().map(|r| r.status), Some(STATUS_SUCCESS));
    file.close();
}

#[test]
fn a_request_cancelled_before_it_was_queued_completes_as_cancelled_at_once() {
    let (_k, _turn) = take_turn();
    let file = open();
    let mut out = [0u8; 4];
    match file.device_control_overlapped(CANCELLED_THEN_QUEUED, &[], &mut out) {
        Sent::Done(reply) => assert_eq!(reply.status, STATUS_CANCELLED),
        Sent::Pending(_) => panic!("IoCsqInsertIrp found it cancelled and completed it through CsqCompleteCanceledIrp"),
    }
    assert_eq!(queued(), 0);
    file.close();
}

#[test]
fn a_thread_exit_cancels_its_pending_requests_and_reports_one_that_ignores_it() {
    let (_k, _turn) = take_turn();
    let file = open();
    let before = driver().cancelled.load(Ordering::SeqCst);
    let mut out = [0u8; 4];
    drop(file.device_control_overlapped(QUEUE, &[], &mut out));
    assert_eq!(driver().cancelled.load(Ordering::SeqCst), before + 1, "the exit cancelled it");
    assert!(take_stuck().is_empty(), "and it completed");
    let mut kept_out = vec![0u8; 4];
    let started = std::time::Instant::now();
    drop(file.device_control_overlapped(IGNORES_CANCEL, &[], &mut kept_out));
    let stuck = take_stuck();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert!(stuck[0].contains("still pending 5 s") && stuck[0].contains("cancel routine none"), "{stuck:?}");
    assert!(started.elapsed() >= std::time::Duration::from_secs(5));
    // The driver completes it after all: its buffers were kept for it.
    // SAFETY: the IRP the driver kept, completed once.
    unsafe { complete(driver().kept.load(Ordering::SeqCst) as *mut IRP, STATUS_SUCCESS) };
    std::mem::forget(kept_out);
    file.close();
}

/// Not a test of its own: the 0x11B test runs it in a child process.
#[test]
#[ignore]
fn child() {
    let case = std::env::var(CASE).expect("run by the test below");
    let config = NtModelConfig { verifier: VerifierFlags::NONE, ..Default::default() };
    let model = Arc::new(NtModel::new(config, Arc::new(HostDmaBackend::new(None)), Arc::new(StopAndExit)));
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    assert_eq!(case, "holds-cancel-lock");
    let file = open();
    let mut out = [0u8; 4];
    let Sent::Pending(pending) = file.device_control_overlapped(HOLDS_CANCEL_LOCK, &[], &mut out) else {
        panic!("kept pending");
    };
    println!("irp {:#x} routine {:#x}", pending.irp() as usize, keeps_cancel_lock as *const () as usize);
    pending.cancel();
    println!("no bugcheck");
    std::process::exit(0);
}

#[test]
fn a_cancel_routine_that_returns_holding_the_cancel_lock_is_0x11b_with_the_irp_and_the_routine() {
    let out = child_of_this_test(CASE, "holds-cancel-lock").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(STOPPED), "{stdout}");
    let line = stdout.lines().find_map(|l| l.find("irp 0x").map(|at| &l[at..])).expect("the child names both");
    let words: Vec<&str> = line.split_whitespace().collect();
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
    let (irp, routine) = (hex(words[1]), hex(words[3]));
    let expected =
        format!("*** STOP: 0x0000011B (0x{irp:016X},0x{routine:016X},0x0000000000000000,0x0000000000000000)");
    assert!(stdout.contains(&expected), "{expected}\n{stdout}");
    assert!(stdout.contains("DRIVER_RETURNED_HOLDING_CANCEL_LOCK"), "{stdout}");
    assert!(!stdout.contains("no bugcheck"), "{stdout}");
}
