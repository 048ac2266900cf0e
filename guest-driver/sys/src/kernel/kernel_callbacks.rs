//! The routines Windows calls back (message and line ISRs, deferred routines, DpcForIsr, synchronize routines, work
//! items): `extern "system"` trampolines whose context pointer leads to the Rust closure the driver core gave.
//!
//! Why trampolines: Windows knows a C routine and one PVOID of context, vhca-ntapi passes closures (`Arc<dyn Fn>`,
//! a fat pointer). Each object that Windows calls back therefore lives in a box with its closure beside it, and the
//! box's address is the context. The boxes are in the Rust heap, which is non-paged pool (pool_allocator.rs): a
//! DPC or an ISR may read them at DISPATCH_LEVEL or DIRQL. No trampoline allocates, frees or takes a lock above
//! DISPATCH_LEVEL: an ISR only follows its context and calls its routine.

use alloc::boxed::Box;
use alloc::vec::Vec;
use core::ffi::c_void;

use vhca_ntapi::{
    PDEVICE_OBJECT, PIO_DPC_ROUTINE, PIO_WORKITEM_ROUTINE, PKDEFERRED_ROUTINE, PKDPC, PKINTERRUPT,
    PKMESSAGE_SERVICE_ROUTINE, PKSERVICE_ROUTINE, PVOID,
};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IRP, KDPC, PKINTERRUPT as KernelInterrupt};
use windows_sys::Wdk::System::SystemServices as wdk;

use super::spin_locked::SpinLocked;

/// wdm.h's BOOLEAN: a UCHAR, TRUE = 1 (named as Windows names it).
#[allow(clippy::upper_case_acronyms)]
pub type BOOLEAN = u8;

/// A KDPC and the routine its DeferredContext leads to. `repr(C)` with the KDPC first: the PKDPC the driver core
/// holds is this object's address, and the KDPC never moves (boxed until the shim is dropped).
#[repr(C)]
pub struct DpcObject {
    pub dpc: KDPC,
    pub routine: PKDEFERRED_ROUTINE,
}

/// The ServiceContext of a connected interrupt: the message routine, and the line-based fallback.
pub struct InterruptRoutines {
    pub message: PKMESSAGE_SERVICE_ROUTINE,
    pub line: Option<PKSERVICE_ROUTINE>,
}

/// KDEFERRED_ROUTINE. DISPATCH_LEVEL, on the processor the DPC was queued to.
///
/// # Safety
/// Windows calls it for a KDPC initialised by `WdkKernel::KeInitializeDpc`, whose DeferredContext is its DpcObject.
unsafe extern "system" fn deferred_routine(
    dpc: *const KDPC,
    context: *const c_void,
    argument1: *const c_void,
    argument2: *const c_void,
) {
    // SAFETY: the context is the DpcObject boxed beside this KDPC, alive until after KeFlushQueuedDpcs at drop.
    let object = unsafe { &*(context as *const DpcObject) };
    (object.routine)(PKDPC(dpc as u64), PVOID(argument1 as u64), PVOID(argument2 as u64));
}

/// KMESSAGE_SERVICE_ROUTINE. The connection's DIRQL, the interrupt spin lock held.
///
/// # Safety
/// Windows calls it for a connection made by `WdkKernel::IoConnectInterruptEx`, whose ServiceContext is its
/// InterruptRoutines.
unsafe extern "system" fn message_service_routine(
    interrupt: KernelInterrupt,
    context: *mut c_void,
    message_id: u32,
) -> BOOLEAN {
    // SAFETY: the context is the connection's InterruptRoutines, freed only after IoDisconnectInterruptEx returned
    // (after which no ISR of the connection runs).
    let routines = unsafe { &*(context as *const InterruptRoutines) };
    (routines.message)(PKINTERRUPT(interrupt as u64), message_id) as BOOLEAN
}

/// KSERVICE_ROUTINE, the line-based fallback. The line's DIRQL, the interrupt spin lock held.
///
/// # Safety
/// As `message_service_routine`; connected only when the connection has a fallback routine.
unsafe extern "system" fn service_routine(interrupt: KernelInterrupt, context: *mut c_void) -> BOOLEAN {
    // SAFETY: as in message_service_routine.
    let routines = unsafe { &*(context as *const InterruptRoutines) };
    routines.line.as_ref().is_some_and(|line| line(PKINTERRUPT(interrupt as u64))) as BOOLEAN
}

/// KSYNCHRONIZE_ROUTINE. The connection's synchronize IRQL, the interrupt spin lock held.
///
/// # Safety
/// The context is a `*mut &mut dyn FnMut() -> bool` living on the caller's stack for the call of
/// KeSynchronizeExecution (`WdkKernel::KeSynchronizeExecution`).
unsafe extern "system" fn synchronize_routine(context: *mut c_void) -> BOOLEAN {
    // SAFETY: the caller's contract: KeSynchronizeExecution calls this before it returns, so the borrow is alive.
    let routine = unsafe { &mut *(context as *mut &mut dyn FnMut() -> bool) };
    routine() as BOOLEAN
}

/// IO_WORKITEM_ROUTINE. PASSIVE_LEVEL, in a system worker thread; called once per IoQueueWorkItem.
///
/// # Safety
/// The context is a `Box<PIO_WORKITEM_ROUTINE>` leaked by `work_item_context`, taken back here once.
unsafe extern "system" fn work_item_routine(device: *const DEVICE_OBJECT, context: *const c_void) {
    // SAFETY: the caller's contract; the routine runs once, so the box is reclaimed once.
    let routine = unsafe { Box::from_raw(context as *mut PIO_WORKITEM_ROUTINE) };
    routine(PDEVICE_OBJECT(device as u64));
}

/// The DpcForIsr routines by device object. Windows' IoInitializeDpcRequest makes the device object the DPC's
/// DeferredContext (wdm.h), so the routine is found by the device, not by a context of its own.
static DPC_FOR_ISR: SpinLocked<Vec<(u64, PIO_DPC_ROUTINE)>> = SpinLocked::new(Vec::new());

/// IO_DPC_ROUTINE, called as the KDEFERRED_ROUTINE of DEVICE_OBJECT.Dpc: (Dpc, DeviceObject, Irp, Context) are
/// the DPC, its DeferredContext and the two system arguments IoRequestDpc queued. DISPATCH_LEVEL.
///
/// # Safety
/// Windows calls it for a device object's Dpc initialised by `WdkKernel::IoInitializeDpcRequest`.
unsafe extern "system" fn dpc_for_isr(
    dpc: *const KDPC,
    device: *const DEVICE_OBJECT,
    _irp: *const IRP,
    context: *const c_void,
) {
    let device = PDEVICE_OBJECT(device as u64);
    // Cloned out of the table so the routine runs without its spin lock.
    let routine = DPC_FOR_ISR.with(|table| table.iter().find(|(d, _)| *d == device.0).map(|(_, r)| r.clone()));
    if let Some(routine) = routine {
        routine(PKDPC(dpc as u64), device, PVOID(context as u64));
    }
}

/// Registers `device`'s DpcForIsr (replacing an earlier one). IRQL <= DISPATCH_LEVEL.
pub fn register_dpc_for_isr(device: PDEVICE_OBJECT, routine: PIO_DPC_ROUTINE) {
    DPC_FOR_ISR.with(|table| {
        table.retain(|(d, _)| *d != device.0);
        table.push((device.0, routine));
    });
}

/// Forgets `device`'s DpcForIsr, once its DPC can no longer run.
pub fn unregister_dpc_for_isr(device: PDEVICE_OBJECT) {
    let removed = DPC_FOR_ISR.with(|table| {
        let at = table.iter().position(|(d, _)| *d == device.0);
        at.map(|i| table.swap_remove(i))
    });
    // The closure is dropped here, outside the table's spin lock (its drop may free heap memory).
    drop(removed);
}

// windows-sys declares every callback type as `Option<unsafe extern "system" fn()>` (its metadata drops their
// parameters), so each trampoline, written with the parameters wdm.h gives its type, is cast to that. The cast keeps
// the address and the calling convention; Windows calls it with the wdm.h parameters, which the trampoline takes.

pub fn deferred() -> windows_sys::Wdk::Foundation::PKDEFERRED_ROUTINE {
    type Routine = unsafe extern "system" fn(*const KDPC, *const c_void, *const c_void, *const c_void);
    // SAFETY: a function pointer to a function pointer of the same size and ABI (see above).
    Some(unsafe { core::mem::transmute::<Routine, unsafe extern "system" fn()>(deferred_routine) })
}

pub fn deferred_dpc_for_isr() -> windows_sys::Wdk::Foundation::PKDEFERRED_ROUTINE {
    type Routine = unsafe extern "system" fn(*const KDPC, *const DEVICE_OBJECT, *const IRP, *const c_void);
    // SAFETY: as above; the IO_DPC_ROUTINE cast to PKDEFERRED_ROUTINE, as wdm.h's IoInitializeDpcRequest casts it.
    Some(unsafe { core::mem::transmute::<Routine, unsafe extern "system" fn()>(dpc_for_isr) })
}

pub fn message_service() -> wdk::PKMESSAGE_SERVICE_ROUTINE {
    type Routine = unsafe extern "system" fn(KernelInterrupt, *mut c_void, u32) -> BOOLEAN;
    // SAFETY: as above; BOOLEAN and windows-sys's bool are both one byte returned in AL.
    Some(unsafe { core::mem::transmute::<Routine, unsafe extern "system" fn() -> bool>(message_service_routine) })
}

pub fn service() -> wdk::PKSERVICE_ROUTINE {
    type Routine = unsafe extern "system" fn(KernelInterrupt, *mut c_void) -> BOOLEAN;
    // SAFETY: as above.
    Some(unsafe { core::mem::transmute::<Routine, unsafe extern "system" fn() -> bool>(service_routine) })
}

pub fn synchronize() -> wdk::PKSYNCHRONIZE_ROUTINE {
    type Routine = unsafe extern "system" fn(*mut c_void) -> BOOLEAN;
    // SAFETY: as above.
    Some(unsafe { core::mem::transmute::<Routine, unsafe extern "system" fn() -> bool>(synchronize_routine) })
}

pub fn work_item() -> wdk::PIO_WORKITEM_ROUTINE {
    type Routine = unsafe extern "system" fn(*const DEVICE_OBJECT, *const c_void);
    // SAFETY: as above.
    Some(unsafe { core::mem::transmute::<Routine, unsafe extern "system" fn()>(work_item_routine) })
}

/// The context `work_item_routine` takes back: the routine, boxed again to be a thin pointer.
pub fn work_item_context(routine: PIO_WORKITEM_ROUTINE) -> *const c_void {
    Box::into_raw(Box::new(routine)) as *const c_void
}
