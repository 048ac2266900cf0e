//! DPCs as a driver binary uses them: the KDPC lives in the driver's memory (often its device extension; wdm.h's
//! IoInitializeDpcRequest and IoRequestDpc are inlines over DeviceObject->Dpc), and KeInitializeDpc binds it to a
//! DPC of the NT model, which queues it, runs its DeferredRoutine at DISPATCH_LEVEL and checks the verifier's rules.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::ffi::c_void;

use vhca_ntapi::{NtAsyncKernel, PKDPC, PROCESSOR_NUMBER, PVOID};
use windows_sys::Wdk::Foundation::KDPC;
use windows_sys::Win32::Foundation::NTSTATUS;
use windows_sys::Win32::System::Kernel::PROCESSOR_NUMBER as KernelProcessorNumber;

use crate::kernel_context::kernel;

/// KDEFERRED_ROUTINE(Dpc, DeferredContext, SystemArgument1, SystemArgument2), as the image calls it.
pub type DeferredRoutine = unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void, *mut c_void);

/// KOBJECTS' DpcObject and KDPC_IMPORTANCE's MediumImportance (wdm.h), as KeInitializeDpc writes them.
const DPC_OBJECT: u8 = 0x13;
const MEDIUM_IMPORTANCE: u8 = 1;

/// KeInitializeDpc(Dpc, DeferredRoutine, DeferredContext): the KDPC's fields as Windows writes them, and a model
/// DPC whose routine calls the driver's with its own KDPC address and context (at DISPATCH_LEVEL, on whichever
/// thread drains the model's DPC queue). Initialized again at the same address, the KDPC gets a new model DPC.
unsafe extern "win64" fn KeInitializeDpc(dpc: *mut KDPC, routine: DeferredRoutine, context: *mut c_void) {
    let (address, context_value) = (dpc as usize, context as usize);
    // SAFETY: the driver's KDPC, resident (Microsoft: "caller-allocated, resident storage").
    unsafe {
        std::ptr::write_bytes(dpc, 0, 1);
        (*dpc).Anonymous.Anonymous.Type = DPC_OBJECT;
        (*dpc).Anonymous.Anonymous.Importance = MEDIUM_IMPORTANCE;
        (*dpc).DeferredRoutine = std::mem::transmute::<DeferredRoutine, unsafe extern "system" fn()>(routine).into();
        (*dpc).DeferredContext = context;
    }
    let k = kernel();
    let model = k.model.KeInitializeDpc(std::sync::Arc::new(move |_model_dpc, argument1: PVOID, argument2: PVOID| {
        crate::driver_fault::prepare_thread();
        kernel().raised();
        // SAFETY: the driver's DeferredRoutine with the KDPC it was initialized for, its context and the system
        // arguments KeInsertQueueDpc passed, at DISPATCH_LEVEL as Windows calls it.
        unsafe {
            routine(
                address as *mut KDPC,
                context_value as *mut c_void,
                argument1.0 as *mut c_void,
                argument2.0 as *mut c_void,
            )
        }
    }));
    k.dpcs.bind(address, model);
}

/// KeInsertQueueDpc(Dpc, SystemArgument1, SystemArgument2): FALSE when already queued. The arguments go to the
/// routine as the driver passed them.
unsafe extern "win64" fn KeInsertQueueDpc(dpc: *mut KDPC, argument1: *mut c_void, argument2: *mut c_void) -> u8 {
    let k = kernel();
    k.model.KeInsertQueueDpc(k.dpcs.model_of(dpc as usize, PKDPC), PVOID(argument1 as u64), PVOID(argument2 as u64))
        as u8
}

unsafe extern "win64" fn KeRemoveQueueDpc(dpc: *mut KDPC) -> u8 {
    let k = kernel();
    k.model.KeRemoveQueueDpc(k.dpcs.model_of(dpc as usize, PKDPC)) as u8
}

unsafe extern "win64" fn KeFlushQueuedDpcs() {
    kernel().model.KeFlushQueuedDpcs()
}

/// KeSetTargetProcessorDpc(Dpc, Number): the model DPC's processor from its next insert; a number past the
/// model's processors leaves it as it was (Windows 7 and later).
unsafe extern "win64" fn KeSetTargetProcessorDpc(dpc: *mut KDPC, number: i8) {
    let k = kernel();
    k.model.KeSetTargetProcessorDpc(k.dpcs.model_of(dpc as usize, PKDPC), number)
}

/// KeSetTargetProcessorDpcEx(Dpc, ProcNumber): as KeSetTargetProcessorDpc with a group; STATUS_INVALID_PARAMETER
/// for a processor the model does not have.
unsafe extern "win64" fn KeSetTargetProcessorDpcEx(dpc: *mut KDPC, number: *const KernelProcessorNumber) -> NTSTATUS {
    let k = kernel();
    // SAFETY: the driver's PROCESSOR_NUMBER (Microsoft: caller-allocated).
    let n = unsafe { *number };
    let n = PROCESSOR_NUMBER { Group: n.Group, Number: n.Number, Reserved: n.Reserved };
    k.model.KeSetTargetProcessorDpcEx(k.dpcs.model_of(dpc as usize, PKDPC), &n).0
}

/// (routine, thunk) for the DPC routines, all ntoskrnl.exe's. IoInitializeDpcRequest and IoRequestDpc are wdm.h
/// inlines over KeInitializeDpc and KeInsertQueueDpc: a driver never imports them.
pub fn dpc_thunks() -> [(&'static str, usize); 6] {
    [
        ("KeInitializeDpc", KeInitializeDpc as *const () as usize),
        ("KeInsertQueueDpc", KeInsertQueueDpc as *const () as usize),
        ("KeRemoveQueueDpc", KeRemoveQueueDpc as *const () as usize),
        ("KeFlushQueuedDpcs", KeFlushQueuedDpcs as *const () as usize),
        ("KeSetTargetProcessorDpc", KeSetTargetProcessorDpc as *const () as usize),
        ("KeSetTargetProcessorDpcEx", KeSetTargetProcessorDpcEx as *const () as usize),
    ]
}
