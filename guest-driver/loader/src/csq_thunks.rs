//! Cancel-safe IRP queues (IoCsqInitialize(Ex), IoCsqInsertIrp(Ex), IoCsqRemoveIrp, IoCsqRemoveNextIrp): the
//! routines ntoskrnl exports around a driver's own queue and lock, written from Microsoft's pages for each routine
//! and "Cancel-Safe IRP Queues". The driver keeps the queue (its CsqInsertIrp, CsqRemoveIrp, CsqPeekNextIrp) and
//! the lock (CsqAcquireLock/CsqReleaseLock); these routines own the IRP's cancelable state:
//! - insert, under the driver's lock: the driver's insert, IoMarkIrpPending, then the IRP made cancelable with this
//!   module's cancel routine. An IRP already cancelled is taken back out at once and completed through the
//!   driver's CsqCompleteCanceledIrp once the lock is released (the pages say only that it is "not inserted"; the
//!   model assumes it is completed as cancelled, as the cancel routine would have done).
//! - remove (by context, or the next the driver's peek matches): only an IRP whose cancel routine this takes back;
//!   one whose cancellation has begun is left to the cancel routine ("returns ... NULL if that IRP has been
//!   canceled"; "only returns IRPs that have not yet been canceled").
//! - the cancel routine: releases the system's cancel spin lock, removes the IRP under the driver's lock and hands it
//!   to CsqCompleteCanceledIrp ("the system always calls the queue's CsqRemoveIrp routine ... before calling
//!   CsqCompleteCanceledIrp").
//!
//! The IRP's DriverContext[3] holds its IO_CSQ_IRP_CONTEXT, or the IO_CSQ when the driver passed none ("IoCsqXxx
//! routines use the DriverContext[3] member of the IRP"); both begin with their Type, which tells them apart.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::ffi::c_void;

use vhca_ntapi::KIRQL;
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IRP};
use windows_sys::Wdk::System::SystemServices::{
    IO_CSQ, IO_CSQ_IRP_CONTEXT, IO_TYPE_CSQ, IO_TYPE_CSQ_EX, IO_TYPE_CSQ_IRP_CONTEXT, PIO_CSQ_ACQUIRE_LOCK,
    PIO_CSQ_COMPLETE_CANCELED_IRP, PIO_CSQ_INSERT_IRP, PIO_CSQ_PEEK_NEXT_IRP, PIO_CSQ_RELEASE_LOCK, PIO_CSQ_REMOVE_IRP,
};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_INVALID_PARAMETER, STATUS_SUCCESS};

use crate::irp_cancel::{self, set_cancel_routine, CancelFn};

/// wdm.h's SL_PENDING_RETURNED, which IoMarkIrpPending sets in the current stack location.
const SL_PENDING_RETURNED: u8 = 0x01;

type InsertFn = unsafe extern "win64" fn(*mut IO_CSQ, *mut IRP);
type InsertExFn = unsafe extern "win64" fn(*mut IO_CSQ, *mut IRP, *mut c_void) -> NTSTATUS;
type RemoveFn = unsafe extern "win64" fn(*mut IO_CSQ, *mut IRP);
type PeekFn = unsafe extern "win64" fn(*mut IO_CSQ, *mut IRP, *mut c_void) -> *mut IRP;
type AcquireFn = unsafe extern "win64" fn(*mut IO_CSQ, *mut KIRQL);
type ReleaseFn = unsafe extern "win64" fn(*mut IO_CSQ, KIRQL);
type CompleteCanceledFn = unsafe extern "win64" fn(*mut IO_CSQ, *mut IRP);

/// The driver's routines of an initialized IO_CSQ, with their real signatures (windows-sys declares them without
/// parameters).
struct Routines {
    csq: *mut IO_CSQ,
}

impl Routines {
    /// # Safety
    /// An IO_CSQ IoCsqInitialize(Ex) filled, whose routines are the driver's, live while it is used.
    unsafe fn of(csq: *mut IO_CSQ) -> Routines {
        Routines { csq }
    }

    fn field(&self, f: impl FnOnce(&IO_CSQ) -> usize) -> usize {
        // SAFETY: `of`'s contract.
        f(unsafe { &*self.csq })
    }

    /// # Safety
    /// As `of`; the routines are called with the driver's own convention.
    unsafe fn acquire(&self) -> KIRQL {
        let mut irql: KIRQL = 0;
        // SAFETY: the caller's contract; the field holds the driver's CsqAcquireLock.
        unsafe {
            let f = std::mem::transmute::<usize, AcquireFn>(self.field(|c| c.CsqAcquireLock.map_or(0, |f| f as usize)));
            f(self.csq, &mut irql);
        }
        irql
    }

    /// # Safety
    /// As `acquire`.
    unsafe fn release(&self, irql: KIRQL) {
        // SAFETY: as above, CsqReleaseLock.
        unsafe {
            let f = std::mem::transmute::<usize, ReleaseFn>(self.field(|c| c.CsqReleaseLock.map_or(0, |f| f as usize)));
            f(self.csq, irql);
        }
    }

    /// The driver's insert: CsqInsertIrpEx's status for an IO_TYPE_CSQ_EX queue, success for the plain one.
    ///
    /// # Safety
    /// As `acquire`, with the lock held.
    unsafe fn insert(&self, irp: *mut IRP, insert_context: *mut c_void) -> NTSTATUS {
        let routine = self.field(|c| c.CsqInsertIrp.map_or(0, |f| f as usize));
        // SAFETY: as above; the Type tells which signature the field holds.
        unsafe {
            if (*self.csq).Type == IO_TYPE_CSQ_EX {
                std::mem::transmute::<usize, InsertExFn>(routine)(self.csq, irp, insert_context)
            } else {
                std::mem::transmute::<usize, InsertFn>(routine)(self.csq, irp);
                STATUS_SUCCESS
            }
        }
    }

    /// # Safety
    /// As `insert`.
    unsafe fn remove(&self, irp: *mut IRP) {
        // SAFETY: as above, CsqRemoveIrp.
        unsafe {
            let f = std::mem::transmute::<usize, RemoveFn>(self.field(|c| c.CsqRemoveIrp.map_or(0, |f| f as usize)));
            f(self.csq, irp);
        }
    }

    /// # Safety
    /// As `insert`.
    unsafe fn peek(&self, after: *mut IRP, peek_context: *mut c_void) -> *mut IRP {
        // SAFETY: as above, CsqPeekNextIrp.
        unsafe {
            let f = std::mem::transmute::<usize, PeekFn>(self.field(|c| c.CsqPeekNextIrp.map_or(0, |f| f as usize)));
            f(self.csq, after, peek_context)
        }
    }

    /// # Safety
    /// As `of`, with the lock released.
    unsafe fn complete_canceled(&self, irp: *mut IRP) {
        let routine = self.field(|c| c.CsqCompleteCanceledIrp.map_or(0, |f| f as usize));
        // SAFETY: as above, CsqCompleteCanceledIrp.
        unsafe { std::mem::transmute::<usize, CompleteCanceledFn>(routine)(self.csq, irp) }
    }
}

/// DriverContext[3] of an IRP: where these routines keep what the IRP was queued with.
///
/// # Safety
/// A live IRP.
unsafe fn slot(irp: *mut IRP) -> *mut *mut c_void {
    // SAFETY: the caller's contract; DriverContext is four pointers in the IRP's Tail.Overlay.
    unsafe { std::ptr::addr_of_mut!((*irp).Tail.Overlay.Anonymous1.Anonymous.DriverContext[3]) }
}

/// The queue and the context (NULL when the driver passed none) an IRP was inserted with.
///
/// # Safety
/// An IRP these routines queued: DriverContext[3] holds an IO_CSQ_IRP_CONTEXT or an IO_CSQ.
unsafe fn queued_with(irp: *mut IRP) -> (*mut IO_CSQ, *mut IO_CSQ_IRP_CONTEXT) {
    // SAFETY: the caller's contract; both structures begin with their u32 Type.
    unsafe {
        let p = *slot(irp);
        if *(p as *const u32) == IO_TYPE_CSQ_IRP_CONTEXT {
            let context = p as *mut IO_CSQ_IRP_CONTEXT;
            ((*context).Csq, context)
        } else {
            (p as *mut IO_CSQ, std::ptr::null_mut())
        }
    }
}

/// Forgets the IRP's queueing: its context no longer names it, DriverContext[3] is the driver's to leave unused.
///
/// # Safety
/// An IRP these routines queued.
unsafe fn dequeued(irp: *mut IRP) {
    // SAFETY: the caller's contract.
    unsafe {
        let (_, context) = queued_with(irp);
        if !context.is_null() {
            (*context).Irp = std::ptr::null_mut();
        }
        *slot(irp) = std::ptr::null_mut();
    }
}

/// The cancel routine every queued IRP carries: called by IoCancelIrp with the cancel spin lock held.
unsafe extern "win64" fn csq_cancel(_device: *mut DEVICE_OBJECT, irp: *mut IRP) {
    // SAFETY: IoCancelIrp's IRP, one these routines queued (only they set this routine).
    unsafe {
        irp_cancel::release((*irp).CancelIrql);
        let (csq, _) = queued_with(irp);
        let routines = Routines::of(csq);
        let irql = routines.acquire();
        routines.remove(irp);
        dequeued(irp);
        routines.release(irql);
        routines.complete_canceled(irp);
    }
}

unsafe extern "win64" fn IoCsqInitialize(
    csq: *mut IO_CSQ,
    insert: usize,
    remove: usize,
    peek: usize,
    acquire: usize,
    release: usize,
    complete_canceled: usize,
) -> NTSTATUS {
    // SAFETY: the driver's IO_CSQ to fill.
    unsafe { initialize(csq, IO_TYPE_CSQ, [insert, remove, peek, acquire, release, complete_canceled]) }
}

unsafe extern "win64" fn IoCsqInitializeEx(
    csq: *mut IO_CSQ,
    insert_ex: usize,
    remove: usize,
    peek: usize,
    acquire: usize,
    release: usize,
    complete_canceled: usize,
) -> NTSTATUS {
    // SAFETY: as IoCsqInitialize.
    unsafe { initialize(csq, IO_TYPE_CSQ_EX, [insert_ex, remove, peek, acquire, release, complete_canceled]) }
}

/// # Safety
/// `csq` is NULL or the driver's writable IO_CSQ.
unsafe fn initialize(csq: *mut IO_CSQ, kind: u32, routines: [usize; 6]) -> NTSTATUS {
    if csq.is_null() || routines.contains(&0) {
        return STATUS_INVALID_PARAMETER;
    }
    let [insert, remove, peek, acquire, release, complete_canceled] = routines;
    // SAFETY: the caller's contract; each field is an Option of a function pointer, non-NULL here.
    unsafe {
        (*csq).Type = kind;
        (*csq).CsqInsertIrp = std::mem::transmute::<usize, PIO_CSQ_INSERT_IRP>(insert);
        (*csq).CsqRemoveIrp = std::mem::transmute::<usize, PIO_CSQ_REMOVE_IRP>(remove);
        (*csq).CsqPeekNextIrp = std::mem::transmute::<usize, PIO_CSQ_PEEK_NEXT_IRP>(peek);
        (*csq).CsqAcquireLock = std::mem::transmute::<usize, PIO_CSQ_ACQUIRE_LOCK>(acquire);
        (*csq).CsqReleaseLock = std::mem::transmute::<usize, PIO_CSQ_RELEASE_LOCK>(release);
        (*csq).CsqCompleteCanceledIrp = std::mem::transmute::<usize, PIO_CSQ_COMPLETE_CANCELED_IRP>(complete_canceled);
        (*csq).ReservePointer = std::ptr::null_mut();
    }
    STATUS_SUCCESS
}

unsafe extern "win64" fn IoCsqInsertIrp(csq: *mut IO_CSQ, irp: *mut IRP, context: *mut IO_CSQ_IRP_CONTEXT) {
    // SAFETY: the driver's initialized queue and an IRP its dispatch routine holds.
    unsafe { insert(csq, irp, context, std::ptr::null_mut()) };
}

unsafe extern "win64" fn IoCsqInsertIrpEx(
    csq: *mut IO_CSQ,
    irp: *mut IRP,
    context: *mut IO_CSQ_IRP_CONTEXT,
    insert_context: *mut c_void,
) -> NTSTATUS {
    // SAFETY: as IoCsqInsertIrp.
    unsafe { insert(csq, irp, context, insert_context) }
}

/// # Safety
/// An initialized queue and an IRP its caller holds, not queued.
unsafe fn insert(
    csq: *mut IO_CSQ,
    irp: *mut IRP,
    context: *mut IO_CSQ_IRP_CONTEXT,
    insert_context: *mut c_void,
) -> NTSTATUS {
    // SAFETY: the caller's contract.
    unsafe {
        let routines = Routines::of(csq);
        let irql = routines.acquire();
        if context.is_null() {
            *slot(irp) = csq.cast();
        } else {
            (*context).Type = IO_TYPE_CSQ_IRP_CONTEXT;
            (*context).Irp = irp;
            (*context).Csq = csq;
            *slot(irp) = context.cast();
        }
        let status = routines.insert(irp, insert_context);
        if status < 0 {
            // The driver's CsqInsertIrpEx refused it: not queued, still the caller's.
            dequeued(irp);
            routines.release(irql);
            return status;
        }
        (*(*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation).Control |= SL_PENDING_RETURNED;
        set_cancel_routine(irp, Some(csq_cancel as CancelFn));
        // Cancelled before it became cancelable: take it back, unless IoCancelIrp already took the routine (then
        // the cancel routine, waiting for the driver's lock, removes and completes it).
        let taken_back = (*irp).Cancel && set_cancel_routine(irp, None).is_some();
        if taken_back {
            routines.remove(irp);
            dequeued(irp);
        }
        routines.release(irql);
        if taken_back {
            routines.complete_canceled(irp);
        }
        status
    }
}

unsafe extern "win64" fn IoCsqRemoveIrp(csq: *mut IO_CSQ, context: *mut IO_CSQ_IRP_CONTEXT) -> *mut IRP {
    if csq.is_null() || context.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the driver's queue and the context IoCsqInsertIrp filled.
    unsafe {
        let routines = Routines::of(csq);
        let irql = routines.acquire();
        let irp = (*context).Irp;
        let removed = if !irp.is_null() && set_cancel_routine(irp, None).is_some() {
            routines.remove(irp);
            dequeued(irp);
            irp
        } else {
            std::ptr::null_mut()
        };
        routines.release(irql);
        removed
    }
}

unsafe extern "win64" fn IoCsqRemoveNextIrp(csq: *mut IO_CSQ, peek_context: *mut c_void) -> *mut IRP {
    if csq.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the driver's queue; each IRP its peek returns is one queued in it.
    unsafe {
        let routines = Routines::of(csq);
        let irql = routines.acquire();
        let mut irp = routines.peek(std::ptr::null_mut(), peek_context);
        while !irp.is_null() {
            if set_cancel_routine(irp, None).is_some() {
                routines.remove(irp);
                dequeued(irp);
                break;
            }
            // Its cancellation has begun: the cancel routine removes it once it has the lock.
            irp = routines.peek(irp, peek_context);
        }
        routines.release(irql);
        irp
    }
}

pub fn csq_thunks() -> [(&'static str, usize); 6] {
    [
        ("IoCsqInitialize", IoCsqInitialize as *const () as usize),
        ("IoCsqInitializeEx", IoCsqInitializeEx as *const () as usize),
        ("IoCsqInsertIrp", IoCsqInsertIrp as *const () as usize),
        ("IoCsqInsertIrpEx", IoCsqInsertIrpEx as *const () as usize),
        ("IoCsqRemoveIrp", IoCsqRemoveIrp as *const () as usize),
        ("IoCsqRemoveNextIrp", IoCsqRemoveNextIrp as *const () as usize),
    ]
}
