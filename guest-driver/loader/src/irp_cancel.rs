//! Cancelling IRPs: the system's one cancel spin lock (IoAcquireCancelSpinLock / IoReleaseCancelSpinLock) and
//! IoCancelIrp, as Microsoft documents them ("Using the System's Cancel Spin Lock", IoCancelIrp's page, and
//! "Bug Check 0x11B: DRIVER_RETURNED_HOLDING_CANCEL_LOCK"). IoCancelIrp takes the cancel spin lock, sets the IRP's
//! Cancel flag, takes the cancel routine out of the IRP (a driver's IoSetCancelRoutine is an interlocked exchange
//! on the same field, so exactly one of the two gets it) and, if there was one, calls it at DISPATCH_LEVEL with the
//! lock held and the IRQL to return to in Irp->CancelIrql; the routine must release the lock. A routine that
//! returns holding it is 0x11B (P1 the IRP, P2 the routine), raised in every mode: the kernel checks it itself.
//! The lock is a spin lock of the model, so IRQL rules and deadlock detection see it as any other.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread::ThreadId;

use vhca_ntapi::{NtKernel, DRIVER_RETURNED_HOLDING_CANCEL_LOCK, KIRQL, PKSPIN_LOCK};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IRP};

use crate::kernel_context::{bugcheck, kernel};

/// A driver's cancel routine (DRIVER_CANCEL), called with the Windows x64 convention.
pub type CancelFn = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP);

/// The address the model's cancel spin lock is bound to (the lock table keys spin locks by address).
static CANCEL_LOCK: AtomicU64 = AtomicU64::new(0);
/// Who holds the cancel spin lock: what 0x11B is checked against after a cancel routine returns.
static HOLDER: Mutex<Option<ThreadId>> = Mutex::new(None);

fn cancel_lock() -> PKSPIN_LOCK {
    let k = kernel();
    k.locks.spin_locks.bound(&CANCEL_LOCK as *const AtomicU64 as usize, || k.model.KeInitializeSpinLock())
}

/// IoAcquireCancelSpinLock: the old IRQL (the lock raises to DISPATCH_LEVEL).
pub fn acquire() -> KIRQL {
    let k = kernel();
    let old = k.model.KeAcquireSpinLock(cancel_lock());
    k.raised();
    *crate::lock(&HOLDER) = Some(std::thread::current().id());
    old
}

/// IoReleaseCancelSpinLock: back to `irql`.
pub fn release(irql: KIRQL) {
    let k = kernel();
    *crate::lock(&HOLDER) = None;
    k.model.KeReleaseSpinLock(cancel_lock(), irql);
}

/// Whether this thread holds the cancel spin lock.
pub fn held_here() -> bool {
    *crate::lock(&HOLDER) == Some(std::thread::current().id())
}

/// IoSetCancelRoutine, wdm.h's inline form: an interlocked exchange of Irp->CancelRoutine; returns the old one.
///
/// # Safety
/// A live IRP.
pub unsafe fn set_cancel_routine(irp: *mut IRP, routine: Option<CancelFn>) -> Option<CancelFn> {
    // SAFETY: CancelRoutine is a pointer-sized field of the live IRP; every writer goes through this exchange.
    let field = unsafe { &*(std::ptr::addr_of_mut!((*irp).CancelRoutine) as *const AtomicPtr<()>) };
    let new = routine.map_or(std::ptr::null_mut(), |f| f as *const () as *mut ());
    let old = field.swap(new, Ordering::AcqRel);
    // SAFETY: only function pointers of this type (or NULL) are stored in the field.
    (!old.is_null()).then(|| unsafe { std::mem::transmute::<*mut (), CancelFn>(old) })
}

/// IoCancelIrp. True when a cancel routine was called; false when the IRP had none (it is not cancelable now, and
/// its Cancel flag tells its owner to complete it as cancelled when it can).
///
/// # Safety
/// A live IRP in flight.
pub unsafe fn cancel_irp(irp: *mut IRP) -> bool {
    let irql = acquire();
    // SAFETY: the caller's contract.
    unsafe {
        (*irp).Cancel = true;
        let Some(routine) = set_cancel_routine(irp, None) else {
            release(irql);
            return false;
        };
        (*irp).CancelIrql = irql;
        // The routine's device: the one whose driver set it, the IRP's current location's.
        let stack = (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation;
        let device =
            if (*irp).CurrentLocation <= (*irp).StackCount { (*stack).DeviceObject } else { std::ptr::null_mut() };
        routine(device, irp);
        if held_here() {
            bugcheck(DRIVER_RETURNED_HOLDING_CANCEL_LOCK, irp as u64, routine as usize as u64, 0, 0);
        }
    }
    true
}

unsafe extern "win64" fn IoAcquireCancelSpinLock(irql: *mut KIRQL) {
    let old = acquire();
    if !irql.is_null() {
        // SAFETY: the driver's KIRQL to store the old level in.
        unsafe { irql.write(old) };
    }
}

unsafe extern "win64" fn IoReleaseCancelSpinLock(irql: KIRQL) {
    release(irql);
}

unsafe extern "win64" fn IoCancelIrp(irp: *mut IRP) -> u8 {
    // SAFETY: the driver's IRP, live while it may cancel it (the caller's contract on Windows too).
    u8::from(unsafe { cancel_irp(irp) })
}

pub fn cancel_thunks() -> [(&'static str, usize); 3] {
    [
        ("IoAcquireCancelSpinLock", IoAcquireCancelSpinLock as *const () as usize),
        ("IoReleaseCancelSpinLock", IoReleaseCancelSpinLock as *const () as usize),
        ("IoCancelIrp", IoCancelIrp as *const () as usize),
    ]
}
