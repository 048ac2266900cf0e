//! WAIT_CQ requests kept pending until their CQ has completions: a cancel-safe IRP queue (IoCsq*, Microsoft's
//! "Cancel-Safe IRP Queues"), so a cancellation (CancelIoEx, the caller's thread exiting) and this driver's own
//! removal of a request can never both complete it, and a poller that answers them.
//!
//! Why a poller: no interrupt is connected outside START_DEVICE's scenario (started_device.rs), so nothing tells
//! the driver a user CQ got a completion. A work item runs while requests wait: at PASSIVE_LEVEL it takes every
//! request out of the queue, asks the control path (under its KMUTEX, where POLL_CQ runs) whether each one's CQ has
//! completions, completes those and puts the rest back, sleeps a millisecond and looks again. It keeps one system
//! worker thread while requests wait, which a driver with its interrupt connected would not need.
//!
//! Each pending request holds the remove lock until it is completed, as every IRP in a driver does ("Using Remove
//! Locks"); REMOVE_DEVICE therefore ends the queue first (`shutdown`), and CLEANUP, DESTROY_CQ, a surprise removal and
//! D3 complete the requests they end (`drain`).
//!
//! The bug variant (BreakFix 1, `pend` with `hand_rolled`): the queue kept by hand, with the driver's own cancel
//! routine, which completes the cancelled request as it must but leaves it on the list, and a poller that takes a
//! request off the list and clears its cancel routine without looking whether it was already running. A cancelled
//! request is then found again and completed a second time: 0x44 MULTIPLE_IRP_COMPLETE_REQUESTS.

use alloc::vec::Vec;
use core::cell::UnsafeCell;
use core::ffi::c_void;
use core::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, FILE_OBJECT, IRP, PIO_WORKITEM};
use windows_sys::Wdk::System::SystemServices::{
    DelayedWorkQueue, IoAllocateWorkItem, IoCsqInitialize, IoCsqInsertIrp, IoCsqRemoveNextIrp, IoFreeWorkItem,
    IoQueueWorkItem, IoReleaseCancelSpinLock, IofCompleteRequest, KeDelayExecutionThread, KernelMode, IO_CSQ,
    PIO_CSQ_ACQUIRE_LOCK, PIO_CSQ_COMPLETE_CANCELED_IRP, PIO_CSQ_INSERT_IRP, PIO_CSQ_PEEK_NEXT_IRP,
    PIO_CSQ_RELEASE_LOCK, PIO_CSQ_REMOVE_IRP, PIO_WORKITEM_ROUTINE,
};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_CANCELLED, STATUS_INSUFFICIENT_RESOURCES, STATUS_PENDING};
use windows_sys::Win32::System::Kernel::LIST_ENTRY;

use super::fdo::fdo;
use super::irp::current_stack;
use super::kernel_imports::{KeAcquireSpinLockRaiseToDpc, KeReleaseSpinLock};
use super::remove_lock;
use super::spin_locked::SpinLocked;

/// wdm.h's SL_PENDING_RETURNED (IoMarkIrpPending's bit).
const SL_PENDING_RETURNED: u8 = 0x01;
/// Where a pending request keeps its CQ, its file object and its buffer lengths, copied at `pend` (DriverContext[3]
/// is the cancel-safe queue's). Read from there, not from the stack location: once an IRP is completed its current
/// location is past its last, so a driver that meets a request it no longer owns (the bug variant) reads what it
/// stored, deterministically, instead of whatever lies beyond the IRP.
const CQ_SLOT: usize = 0;
const FILE_SLOT: usize = 1;
const LENGTHS_SLOT: usize = 2;
/// The bug variant's alone (the hand-kept queue leaves the cancel-safe queue's slot free): the CQ's view it keeps.
const CACHED_SLOT: usize = 3;

/// What the bug variant keeps of a pending wait's CQ at `pend`, as a C driver keeps the CQ object's pointer in the
/// IRP instead of its handle: the ring's reader and the kernel it reads through, read later by the poller without
/// the control mutex or the handle's check, while DESTROY_CQ completes no wait (user-wait-on-destroyed-cq). Nothing
/// frees it: it is the pointer the bug keeps, and every run of the bug ends in its bugcheck before the unload.
pub struct CachedCq {
    pub reader: vhca_driver_core::CqReader,
    pub kernel: alloc::sync::Arc<super::wdk_kernel::WdkKernel>,
}
/// How long the poller sleeps between looks, and how long `shutdown` waits for it to stop.
const POLL_INTERVAL_100NS: i64 = 10_000;
const SHUTDOWN_LOOKS: u32 = 10_000;

/// What the poller asks of the control path for one pending request: Some((status, information)) to complete it
/// with, None while its CQ has nothing yet. PASSIVE_LEVEL; the request is the poller's while it asks.
pub type Satisfy = unsafe fn(*const DEVICE_OBJECT, *mut IRP) -> Option<(NTSTATUS, usize)>;

/// Which requests a drain ends (NULL file / None CQ: any).
#[derive(Clone, Copy)]
pub struct Matching {
    pub file: *mut FILE_OBJECT,
    pub cq: Option<u32>,
}

impl Matching {
    pub const ALL: Matching = Matching { file: core::ptr::null_mut(), cq: None };

    /// # Safety
    /// A live IRP this queue holds (its current stack location is this driver's).
    unsafe fn matches(&self, irp: *mut IRP) -> bool {
        // SAFETY: the caller's contract.
        let (file, cq) = unsafe { (file_of(irp), cq_of(irp)) };
        (self.file.is_null() || self.file == file) && self.cq.map_or(true, |c| c == cq)
    }
}

#[derive(Default)]
struct Poller {
    running: bool,
    stopping: bool,
}

/// In the FDO's (non-paged) extension, initialised once at its final address in AddDevice.
#[repr(C)]
pub struct CqWaits {
    /// First, so the IO_CSQ the queue routines are handed is this structure's own address.
    csq: UnsafeCell<IO_CSQ>,
    /// The spin lock over `head` (KSPIN_LOCK: 0 is free).
    lock: UnsafeCell<usize>,
    /// The pending requests, linked through Irp->Tail.Overlay.ListEntry, oldest first.
    head: UnsafeCell<LIST_ENTRY>,
    device: *mut DEVICE_OBJECT,
    satisfy: Option<Satisfy>,
    poller: SpinLocked<Poller>,
    /// Requests are queued by hand (the bug variant), set by `pend`.
    hand_rolled: AtomicBool,
}

impl CqWaits {
    pub fn new() -> CqWaits {
        CqWaits {
            csq: UnsafeCell::new(IO_CSQ::default()),
            lock: UnsafeCell::new(0),
            head: UnsafeCell::new(LIST_ENTRY { Flink: core::ptr::null_mut(), Blink: core::ptr::null_mut() }),
            device: core::ptr::null_mut(),
            satisfy: None,
            poller: SpinLocked::new(Poller { running: false, stopping: false }),
            hand_rolled: AtomicBool::new(false),
        }
    }

    /// # Safety
    /// Once, in AddDevice, at the structure's final address (the FDO's extension), before any request. PASSIVE_LEVEL.
    pub unsafe fn initialize(&mut self, device: *mut DEVICE_OBJECT, satisfy: Satisfy) {
        self.device = device;
        self.satisfy = Some(satisfy);
        // SAFETY: the caller's contract; the routines have the IO_CSQ_* signatures, which windows-sys declares
        // without parameters; the list is empty (pointing at itself), as InitializeListHead leaves it.
        unsafe {
            let head = self.head.get();
            (*head).Flink = head;
            (*head).Blink = head;
            IoCsqInitialize(
                self.csq.get(),
                core::mem::transmute::<InsertFn, PIO_CSQ_INSERT_IRP>(csq_insert),
                core::mem::transmute::<RemoveFn, PIO_CSQ_REMOVE_IRP>(csq_remove),
                core::mem::transmute::<PeekFn, PIO_CSQ_PEEK_NEXT_IRP>(csq_peek),
                core::mem::transmute::<AcquireFn, PIO_CSQ_ACQUIRE_LOCK>(csq_acquire),
                core::mem::transmute::<ReleaseFn, PIO_CSQ_RELEASE_LOCK>(csq_release),
                core::mem::transmute::<RemoveFn, PIO_CSQ_COMPLETE_CANCELED_IRP>(csq_complete_canceled),
            );
        }
    }

    /// Keeps a WAIT_CQ pending on `cq`: queued (cancelable), and the poller started if it is not running. Returns
    /// STATUS_PENDING, for the dispatch routine to return; or STATUS_INSUFFICIENT_RESOURCES with nothing queued when
    /// no work item could be had (the caller completes the request with it). PASSIVE_LEVEL, holding the remove lock
    /// for `irp`, which the completion gives back.
    ///
    /// # Safety
    /// The dispatch routine's IRP, at this driver's stack location.
    pub unsafe fn pend(&self, irp: *mut IRP, cq: u32, hand_rolled: bool, cached: Option<CachedCq>) -> NTSTATUS {
        // An item before the request is queued: a pending request nothing would look at is a hang.
        // SAFETY: PASSIVE_LEVEL; the FDO is this driver's device object.
        let item = unsafe { IoAllocateWorkItem(self.device) };
        if item == 0 {
            return STATUS_INSUFFICIENT_RESOURCES;
        }
        // SAFETY: the caller's contract.
        unsafe {
            let stack = current_stack(irp);
            let p = (*stack).Parameters.DeviceIoControl;
            let lengths = p.InputBufferLength as usize | (p.OutputBufferLength as usize) << 32;
            let context = &mut (*irp).Tail.Overlay.Anonymous1.Anonymous.DriverContext;
            context[CQ_SLOT] = cq as usize as *mut c_void;
            context[FILE_SLOT] = (*stack).FileObject.cast();
            context[LENGTHS_SLOT] = lengths as *mut c_void;
            context[CACHED_SLOT] = match cached {
                Some(view) if hand_rolled => alloc::boxed::Box::into_raw(alloc::boxed::Box::new(view)).cast(),
                _ => core::ptr::null_mut(),
            };
            self.hand_rolled.store(hand_rolled, Ordering::Relaxed);
            if hand_rolled {
                (*stack).Control |= SL_PENDING_RETURNED;
                self.insert_by_hand(irp);
            } else {
                IoCsqInsertIrp(self.csq.get(), irp, core::ptr::null_mut());
            }
        }
        self.start_poller(item);
        STATUS_PENDING
    }

    /// Completes every pending request `which` names with `status`. PASSIVE_LEVEL or DISPATCH_LEVEL.
    pub fn drain(&self, which: Matching, status: NTSTATUS) {
        for irp in self.take(which) {
            // SAFETY: taken out of the queue: this driver's to complete.
            unsafe { self.finish(irp, status, 0) };
        }
    }

    /// REMOVE_DEVICE, before the remove lock's wait: every pending request completed (STATUS_DELETE_PENDING's
    /// caller sees `status`), the poller told to stop and waited for. PASSIVE_LEVEL.
    pub fn shutdown(&self, status: NTSTATUS) {
        self.poller.with(|p| p.stopping = true);
        self.drain(Matching::ALL, status);
        for _ in 0..SHUTDOWN_LOOKS {
            if !self.poller.with(|p| p.running) {
                return;
            }
            delay();
        }
    }

    fn start_poller(&self, item: PIO_WORKITEM) {
        let start = self.poller.with(|p| {
            let start = !p.running && !p.stopping;
            p.running |= start;
            start
        });
        // SAFETY: PASSIVE_LEVEL; a fresh item of the FDO (which it references until the routine returned), the
        // routine with IO_WORKITEM_ROUTINE's parameters (windows-sys leaves them out), the item as its context.
        unsafe {
            if start {
                let routine = core::mem::transmute::<Option<WorkItemRoutine>, PIO_WORKITEM_ROUTINE>(Some(poll_waits));
                IoQueueWorkItem(item, routine, DelayedWorkQueue, item as *const c_void);
            } else {
                IoFreeWorkItem(item);
            }
        }
    }

    /// The requests `which` names, out of the queue and no longer cancelable: each is the caller's to complete or
    /// put back.
    fn take(&self, which: Matching) -> Vec<*mut IRP> {
        let mut taken = Vec::new();
        if self.hand_rolled() {
            // The bug: off the list, its cancel routine cleared without asking whether it already ran.
            self.locked(|head| {
                // SAFETY: the list is this queue's, its entries live IRPs' (or, for the bug, IRPs already
                // completed, whose memory the I/O manager's lookaside keeps).
                unsafe {
                    let mut at = (*head).Flink;
                    while at != head {
                        let next = (*at).Flink;
                        let irp = irp_of(at);
                        if which.matches(irp) {
                            unlink(at);
                            taken.push(irp);
                        }
                        at = next;
                    }
                }
            });
            for &irp in &taken {
                // SAFETY: as above.
                unsafe { set_cancel_routine(irp, None) };
            }
            return taken;
        }
        let peek = if which.file.is_null() && which.cq.is_none() {
            core::ptr::null()
        } else {
            &which as *const Matching as *const c_void
        };
        loop {
            // SAFETY: the queue IoCsqInitialize made; `peek` is NULL or the Matching csq_peek reads.
            let irp = unsafe { IoCsqRemoveNextIrp(self.csq.get(), peek) };
            if irp.is_null() {
                return taken;
            }
            taken.push(irp);
        }
    }

    /// A request the poller took that must wait on: queued again (cancelled meanwhile, it is completed as such).
    ///
    /// # Safety
    /// A request `take` returned.
    unsafe fn put_back(&self, irp: *mut IRP) {
        // SAFETY: the caller's contract.
        unsafe {
            if self.hand_rolled() {
                self.insert_by_hand(irp);
            } else {
                IoCsqInsertIrp(self.csq.get(), irp, core::ptr::null_mut());
            }
        }
    }

    /// The bug's queueing: its cancel routine set, appended to the list (`pend` marked it pending).
    ///
    /// # Safety
    /// A request `pend` queued.
    unsafe fn insert_by_hand(&self, irp: *mut IRP) {
        // SAFETY: the caller's contract.
        unsafe { set_cancel_routine(irp, Some(hand_rolled_cancel)) };
        // SAFETY: as above; the entry is the IRP's own ListEntry.
        self.locked(|head| unsafe { append(head, list_entry(irp)) });
    }

    /// The CQ view the bug variant kept for `irp` at `pend` (None for the cancel-safe queue's requests).
    ///
    /// # Safety
    /// A request `pend` queued (its memory still there).
    pub unsafe fn cached<'a>(&self, irp: *mut IRP) -> Option<&'a CachedCq> {
        if !self.hand_rolled() {
            return None;
        }
        // SAFETY: the caller's contract; the slot is NULL or the box `pend` leaked.
        unsafe { ((*irp).Tail.Overlay.Anonymous1.Anonymous.DriverContext[CACHED_SLOT] as *const CachedCq).as_ref() }
    }

    /// Whether this queue is kept by hand (the bug variant; a run is one variant throughout).
    fn hand_rolled(&self) -> bool {
        self.hand_rolled.load(Ordering::Relaxed)
    }

    fn locked<R>(&self, f: impl FnOnce(*mut LIST_ENTRY) -> R) -> R {
        // SAFETY: IRQL <= DISPATCH_LEVEL; the lock word lives with the queue in the FDO's non-paged extension.
        let old = unsafe { KeAcquireSpinLockRaiseToDpc(self.lock.get()) };
        let out = f(self.head.get());
        // SAFETY: releases the lock taken above and returns to the IRQL it saved.
        unsafe { KeReleaseSpinLock(self.lock.get(), old) };
        out
    }

    /// Completes a request this queue held and gives back the remove lock its dispatch routine kept for it.
    ///
    /// # Safety
    /// A request this driver holds (out of the queue), not touched after.
    unsafe fn finish(&self, irp: *mut IRP, status: NTSTATUS, information: usize) {
        // SAFETY: the caller's contract; IRQL <= DISPATCH_LEVEL; the FDO outlives every request (REMOVE waits).
        unsafe {
            (*irp).IoStatus.Anonymous.Status = status;
            (*irp).IoStatus.Information = information;
            IofCompleteRequest(irp, 0);
            remove_lock::release(&mut fdo(self.device).remove_lock, irp);
        }
    }
}

/// A pending request's file object and its input and output lengths, as `pend` stored them.
///
/// # Safety
/// A request `pend` queued (its memory still there).
pub unsafe fn pended_request(irp: *mut IRP) -> (*mut FILE_OBJECT, usize, usize) {
    // SAFETY: the caller's contract.
    let lengths = unsafe { (*irp).Tail.Overlay.Anonymous1.Anonymous.DriverContext[LENGTHS_SLOT] as usize };
    // SAFETY: as above.
    (unsafe { file_of(irp) }, lengths & 0xFFFF_FFFF, lengths >> 32)
}

/// # Safety
/// As `pended_request`.
unsafe fn file_of(irp: *mut IRP) -> *mut FILE_OBJECT {
    // SAFETY: the caller's contract.
    unsafe { (*irp).Tail.Overlay.Anonymous1.Anonymous.DriverContext[FILE_SLOT].cast() }
}

/// The CQ a pending request waits on, as `pend` stored it.
///
/// # Safety
/// A live IRP.
pub unsafe fn cq_of(irp: *mut IRP) -> u32 {
    // SAFETY: the caller's contract; `pend` stored the CQ there.
    unsafe { (*irp).Tail.Overlay.Anonymous1.Anonymous.DriverContext[CQ_SLOT] as usize as u32 }
}

/// # Safety
/// A live IRP.
unsafe fn list_entry(irp: *mut IRP) -> *mut LIST_ENTRY {
    // SAFETY: the caller's contract; ListEntry is the driver's while it owns the IRP.
    unsafe { core::ptr::addr_of_mut!((*irp).Tail.Overlay.Anonymous2.ListEntry) }
}

/// CONTAINING_RECORD(entry, IRP, Tail.Overlay.ListEntry).
///
/// # Safety
/// `entry` is a queued IRP's ListEntry.
unsafe fn irp_of(entry: *mut LIST_ENTRY) -> *mut IRP {
    let offset = core::mem::offset_of!(IRP, Tail.Overlay.Anonymous2.ListEntry);
    // SAFETY: the caller's contract.
    unsafe { entry.cast::<u8>().sub(offset).cast::<IRP>() }
}

/// InsertTailList.
///
/// # Safety
/// `head` is a list's head, `entry` on no list; the list's lock is held.
unsafe fn append(head: *mut LIST_ENTRY, entry: *mut LIST_ENTRY) {
    // SAFETY: the caller's contract.
    unsafe {
        let last = (*head).Blink;
        (*entry).Flink = head;
        (*entry).Blink = last;
        (*last).Flink = entry;
        (*head).Blink = entry;
    }
}

/// RemoveEntryList.
///
/// # Safety
/// `entry` is on a list whose lock is held.
unsafe fn unlink(entry: *mut LIST_ENTRY) {
    // SAFETY: the caller's contract.
    unsafe {
        let (next, prev) = ((*entry).Flink, (*entry).Blink);
        (*prev).Flink = next;
        (*next).Blink = prev;
        (*entry).Flink = entry;
        (*entry).Blink = entry;
    }
}

type CancelFn = unsafe extern "system" fn(*mut DEVICE_OBJECT, *mut IRP);

/// IoSetCancelRoutine, wdm.h's inline form: an interlocked exchange of Irp->CancelRoutine.
///
/// # Safety
/// A live IRP.
unsafe fn set_cancel_routine(irp: *mut IRP, routine: Option<CancelFn>) -> bool {
    // SAFETY: the caller's contract; the field is pointer-sized, and IoCancelIrp exchanges it the same way.
    let field = unsafe { &*(core::ptr::addr_of_mut!((*irp).CancelRoutine) as *const AtomicPtr<()>) };
    let new = routine.map_or(core::ptr::null_mut(), |f| f as *const () as *mut ());
    !field.swap(new, Ordering::AcqRel).is_null()
}

/// The bug's cancel routine: called by IoCancelIrp with the cancel spin lock held; releases it and completes the
/// request as cancelled, as a cancel routine must, but leaves it on the list: the poller finds it again.
unsafe extern "system" fn hand_rolled_cancel(device: *mut DEVICE_OBJECT, irp: *mut IRP) {
    // SAFETY: IoCancelIrp's contract: the IRP is live, the cancel spin lock held at DISPATCH_LEVEL, CancelIrql the
    // level to return to; the device is the FDO whose queue this is.
    unsafe {
        IoReleaseCancelSpinLock((*irp).CancelIrql);
        fdo(device).waits.finish(irp, STATUS_CANCELLED, 0);
    }
}

type InsertFn = unsafe extern "system" fn(*mut IO_CSQ, *mut IRP);
type RemoveFn = unsafe extern "system" fn(*mut IO_CSQ, *mut IRP);
type PeekFn = unsafe extern "system" fn(*mut IO_CSQ, *mut IRP, *mut c_void) -> *mut IRP;
type AcquireFn = unsafe extern "system" fn(*mut IO_CSQ, *mut u8);
type ReleaseFn = unsafe extern "system" fn(*mut IO_CSQ, u8);

/// # Safety
/// The IO_CSQ is a CqWaits' first field (csq_* routines are only registered on one).
unsafe fn waits_of<'a>(csq: *mut IO_CSQ) -> &'a CqWaits {
    // SAFETY: the caller's contract; repr(C) puts `csq` at offset 0.
    unsafe { &*(csq as *const CqWaits) }
}

unsafe extern "system" fn csq_insert(csq: *mut IO_CSQ, irp: *mut IRP) {
    // SAFETY: IoCsqInsertIrp calls this with the queue's lock held and an IRP on no list.
    unsafe { append(waits_of(csq).head.get(), list_entry(irp)) }
}

unsafe extern "system" fn csq_remove(_csq: *mut IO_CSQ, irp: *mut IRP) {
    // SAFETY: called with the queue's lock held for an IRP this queue holds.
    unsafe { unlink(list_entry(irp)) }
}

/// The next queued request after `irp` (from the first for NULL) that the peek context matches (NULL: any).
unsafe extern "system" fn csq_peek(csq: *mut IO_CSQ, irp: *mut IRP, peek: *mut c_void) -> *mut IRP {
    // SAFETY: called with the queue's lock held; `irp` is NULL or queued; `peek` is NULL or `take`'s Matching.
    unsafe {
        let head = waits_of(csq).head.get();
        let mut at = if irp.is_null() { (*head).Flink } else { (*list_entry(irp)).Flink };
        while at != head {
            let candidate = irp_of(at);
            if peek.is_null() || (*(peek as *const Matching)).matches(candidate) {
                return candidate;
            }
            at = (*at).Flink;
        }
        core::ptr::null_mut()
    }
}

unsafe extern "system" fn csq_acquire(csq: *mut IO_CSQ, irql: *mut u8) {
    // SAFETY: IRQL <= DISPATCH_LEVEL (the IoCsq routines' rule); the lock word is the queue's.
    unsafe { *irql = KeAcquireSpinLockRaiseToDpc(waits_of(csq).lock.get()) }
}

unsafe extern "system" fn csq_release(csq: *mut IO_CSQ, irql: u8) {
    // SAFETY: the lock csq_acquire took, back to the IRQL it saved.
    unsafe { KeReleaseSpinLock(waits_of(csq).lock.get(), irql) }
}

/// The system removed a cancelled request from the queue: completed as cancelled (its remove lock given back).
unsafe extern "system" fn csq_complete_canceled(csq: *mut IO_CSQ, irp: *mut IRP) {
    // SAFETY: the cancelled IRP, out of the queue, this driver's to complete.
    unsafe { waits_of(csq).finish(irp, STATUS_CANCELLED, 0) }
}

/// IO_WORKITEM_ROUTINE, as windows-sys leaves its parameters out.
type WorkItemRoutine = unsafe extern "system" fn(*const DEVICE_OBJECT, *const c_void);

/// The poller, at PASSIVE_LEVEL on a system worker thread: every pending request asked about, answered or put
/// back, then a millisecond's sleep, until none waits or the queue shuts down; then its item freed, the last thing
/// it does with it.
unsafe extern "system" fn poll_waits(device: *const DEVICE_OBJECT, context: *const c_void) {
    // SAFETY: the FDO the item was queued for; its extension lives until REMOVE, which waits for this routine.
    let waits = unsafe { &fdo(device).waits };
    let satisfy = waits.satisfy.expect("initialised in AddDevice");
    loop {
        if waits.poller.with(|p| p.stopping) {
            break;
        }
        for irp in waits.take(Matching::ALL) {
            // SAFETY: taken out of the queue: the poller's until it completes it or puts it back.
            unsafe {
                match satisfy(device, irp) {
                    Some((status, information)) => waits.finish(irp, status, information),
                    None => waits.put_back(irp),
                }
            }
        }
        // Nothing left to wait for: stop, unless a request came meanwhile (checked under both locks, so a `pend`
        // either sees the poller still running or starts another).
        let idle = waits.poller.with(|p| {
            // SAFETY: the list's head; read under its lock.
            let empty = waits.locked(|head| unsafe { (*head).Flink == head });
            if empty {
                p.running = false;
            }
            empty
        });
        if idle {
            // SAFETY: this routine's own item, dequeued before it ran.
            unsafe { IoFreeWorkItem(context as PIO_WORKITEM) };
            return;
        }
        delay();
    }
    waits.poller.with(|p| p.running = false);
    // SAFETY: as above.
    unsafe { IoFreeWorkItem(context as PIO_WORKITEM) };
}

/// One poll interval's sleep. PASSIVE_LEVEL.
fn delay() {
    let interval = -POLL_INTERVAL_100NS;
    // SAFETY: PASSIVE_LEVEL, kernel mode, not alertable (KeDelayExecutionThread's rules).
    unsafe { KeDelayExecutionThread(KernelMode as i8, false, &interval) };
}
