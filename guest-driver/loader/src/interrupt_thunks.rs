//! Interrupts as a driver binary connects them: IoConnectInterruptEx reads the driver's
//! IO_CONNECT_INTERRUPT_PARAMETERS (CONNECT_MESSAGE_BASED, with the line-based FallBackServiceRoutine), connects
//! through the NT model, and writes back Version and the IO_INTERRUPT_MESSAGE_INFO it allocates for the driver, whose
//! InterruptObjects are the model's KINTERRUPT handles (opaque to a driver). The model calls the driver's ISR through
//! its Windows signature on the platform's delivery thread, at the message's DIRQL with the interrupt spin lock held.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::ffi::c_void;
use std::sync::Arc;

use vhca_ntapi::{
    NtAsyncKernel, NtKernel, INTERRUPT_CONNECTION, IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS, KINTERRUPT_MODE,
    KINTERRUPT_POLARITY, PDEVICE_OBJECT, PKINTERRUPT, PKSPIN_LOCK,
};
use windows_sys::Wdk::System::SystemServices::{
    InterruptActiveHigh, InterruptActiveLow, InterruptPolarityUnknown, Latched, LevelSensitive,
    IO_CONNECT_INTERRUPT_PARAMETERS, IO_DISCONNECT_INTERRUPT_PARAMETERS, IO_INTERRUPT_MESSAGE_INFO,
    IO_INTERRUPT_MESSAGE_INFO_ENTRY,
};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_INVALID_PARAMETER, STATUS_SUCCESS};

use crate::interrupt_table::Connection;
use crate::kernel_context::kernel;

/// wdm.h's BOOLEAN (a UCHAR, TRUE = 1), by its Windows name.
#[allow(clippy::upper_case_acronyms)]
type BOOLEAN = u8;
/// KMESSAGE_SERVICE_ROUTINE(Interrupt, ServiceContext, MessageID), as the image calls it.
pub type MessageServiceRoutine = unsafe extern "win64" fn(*mut c_void, *mut c_void, u32) -> BOOLEAN;
/// KSERVICE_ROUTINE(Interrupt, ServiceContext): the line-based fallback.
pub type ServiceRoutine = unsafe extern "win64" fn(*mut c_void, *mut c_void) -> BOOLEAN;
/// KSYNCHRONIZE_ROUTINE(SynchronizeContext).
pub type SynchronizeRoutine = unsafe extern "win64" fn(*mut c_void) -> BOOLEAN;

/// IO_CONNECT_INTERRUPT_PARAMETERS.Version (wdm.h).
const CONNECT_MESSAGE_BASED: u32 = 0x3;

/// An `Option<unsafe extern "system" fn()>` slot of windows-sys (its metadata drops the parameters) as the routine
/// the driver stored there, with the Windows x64 convention it was compiled for.
fn routine_in<F: Copy>(slot: Option<unsafe extern "system" fn() -> bool>) -> Option<F> {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<usize>());
    // SAFETY: a code address the driver stored; F is the slot's wdm.h signature (one function pointer).
    slot.map(|f| unsafe { std::mem::transmute_copy::<usize, F>(&(f as usize)) })
}

/// IoConnectInterruptEx(Parameters). Only CONNECT_MESSAGE_BASED, the version a PnP driver of an MSI-X device
/// asks for (and the only one the model implements): any other is STATUS_INVALID_PARAMETER, the model's choice.
unsafe extern "win64" fn IoConnectInterruptEx(parameters: *mut IO_CONNECT_INTERRUPT_PARAMETERS) -> NTSTATUS {
    // SAFETY: the driver's parameters (the routine's contract); MessageBased is the member Version names.
    let (version, p) = unsafe { ((*parameters).Version, (*parameters).Anonymous.MessageBased) };
    let k = kernel();
    let message: Option<MessageServiceRoutine> = routine_in(p.MessageServiceRoutine);
    let fallback: Option<ServiceRoutine> = routine_in(p.FallBackServiceRoutine);
    // SAFETY: a union of pointers: Generic is the PVOID* every member is.
    let context_slot = unsafe { p.ConnectionContext.Generic };
    let (Some(message), true, false) = (message, version == CONNECT_MESSAGE_BASED, context_slot.is_null()) else {
        println!("VHCA-LOADER: IoConnectInterruptEx: Version {version:#x} with no message routine or context slot");
        return STATUS_INVALID_PARAMETER;
    };
    let service_context = p.ServiceContext as usize;
    let spin_lock = if p.SpinLock.is_null() {
        PKSPIN_LOCK::NULL
    } else {
        k.locks.spin_locks.bound(p.SpinLock as usize, || k.model.KeInitializeSpinLock())
    };
    let connection = k.model.IoConnectInterruptEx(IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS {
        PhysicalDeviceObject: PDEVICE_OBJECT(p.PhysicalDeviceObject as u64),
        MessageServiceRoutine: Arc::new(move |interrupt: PKINTERRUPT, message_id: u32| {
            crate::driver_fault::prepare_thread();
            kernel().raised();
            // SAFETY: the driver's ISR with its interrupt object, ServiceContext and MessageID, at the message's
            // DIRQL with the interrupt spin lock held, as Windows calls it.
            unsafe { message(interrupt.0 as *mut c_void, service_context as *mut c_void, message_id) != 0 }
        }),
        SpinLock: spin_lock,
        SynchronizeIrql: p.SynchronizeIrql,
        FloatingSave: p.FloatingSave,
        FallBackServiceRoutine: fallback.map(|line| {
            Arc::new(move |interrupt: PKINTERRUPT| {
                crate::driver_fault::prepare_thread();
                kernel().raised();
                // SAFETY: as the message routine, without a MessageID.
                unsafe { line(interrupt.0 as *mut c_void, service_context as *mut c_void) != 0 }
            }) as vhca_ntapi::PKSERVICE_ROUTINE
        }),
    });
    let connection = match connection {
        Ok(c) => c,
        Err(status) => return status.0,
    };
    // The ConnectionContext: the message table for a message-based connection, the line's KINTERRUPT otherwise.
    let message_table = match &connection {
        INTERRUPT_CONNECTION::MessageBased(info) => Some(message_table(info)),
        INTERRUPT_CONNECTION::LineBased(_) => None,
    };
    let context = match &message_table {
        Some(table) => table.as_ptr() as usize,
        None => connection.InterruptObject().0 as usize,
    };
    // SAFETY: the driver's parameters and its ConnectionContext slot (checked non-NULL above).
    unsafe {
        *context_slot = context as *mut c_void;
        (*parameters).Version = connection.Version();
    }
    k.interrupts.insert(context, Connection { model: connection, message_table });
    STATUS_SUCCESS
}

/// The IO_INTERRUPT_MESSAGE_INFO for `info`, in Windows' layout: UnifiedIrql, MessageCount, then MessageCount
/// entries (a C flexible array), in a block the driver reads until it disconnects.
fn message_table(info: &vhca_ntapi::IO_INTERRUPT_MESSAGE_INFO) -> Box<[u64]> {
    let entries = info.MessageInfo.len();
    let first = std::mem::offset_of!(IO_INTERRUPT_MESSAGE_INFO, MessageInfo);
    let bytes = first + entries.max(1) * std::mem::size_of::<IO_INTERRUPT_MESSAGE_INFO_ENTRY>();
    let mut block = vec![0u64; bytes.div_ceil(8)].into_boxed_slice();
    let table = block.as_mut_ptr() as *mut IO_INTERRUPT_MESSAGE_INFO;
    // SAFETY: the block holds the header and every entry (sized above), 8-aligned as the structures need.
    unsafe {
        (*table).UnifiedIrql = info.UnifiedIrql;
        (*table).MessageCount = entries as u32;
        let entry = std::ptr::addr_of_mut!((*table).MessageInfo) as *mut IO_INTERRUPT_MESSAGE_INFO_ENTRY;
        for (i, m) in info.MessageInfo.iter().enumerate() {
            entry.add(i).write(IO_INTERRUPT_MESSAGE_INFO_ENTRY {
                MessageAddress: m.MessageAddress.0 as i64,
                TargetProcessorSet: m.TargetProcessorSet as usize,
                InterruptObject: m.InterruptObject.0 as _,
                MessageData: m.MessageData,
                Vector: m.Vector,
                Irql: m.Irql,
                Mode: match m.Mode {
                    KINTERRUPT_MODE::Latched => Latched,
                    KINTERRUPT_MODE::LevelSensitive => LevelSensitive,
                },
                Polarity: match m.Polarity {
                    KINTERRUPT_POLARITY::InterruptActiveHigh => InterruptActiveHigh,
                    KINTERRUPT_POLARITY::InterruptActiveLow => InterruptActiveLow,
                    KINTERRUPT_POLARITY::InterruptPolarityUnknown => InterruptPolarityUnknown,
                },
            });
        }
    }
    block
}

/// IoDisconnectInterruptEx(Parameters): the connection made under the ConnectionContext the driver passes back.
/// After the model's disconnect no ISR of it runs, so its message table goes then.
unsafe extern "win64" fn IoDisconnectInterruptEx(parameters: *mut IO_DISCONNECT_INTERRUPT_PARAMETERS) {
    // SAFETY: the driver's parameters; the union's members are all one pointer.
    let context = unsafe { (*parameters).ConnectionContext.Generic } as usize;
    let k = kernel();
    match k.interrupts.remove(context) {
        Some(connection) => k.model.IoDisconnectInterruptEx(&connection.model),
        None => println!("VHCA-LOADER: IoDisconnectInterruptEx: no connection has context {context:#x}"),
    }
}

/// KeSynchronizeExecution(Interrupt, SynchronizeRoutine, SynchronizeContext): the routine at the connection's
/// synchronize IRQL with its interrupt spin lock held, on the caller's thread.
unsafe extern "win64" fn KeSynchronizeExecution(
    interrupt: *mut c_void,
    routine: SynchronizeRoutine,
    context: *mut c_void,
) -> BOOLEAN {
    let k = kernel();
    let context = context as usize;
    let mut call = || {
        k.raised();
        // SAFETY: the driver's routine and context, under the interrupt spin lock as Windows calls it.
        unsafe { routine(context as *mut c_void) != 0 }
    };
    k.model.KeSynchronizeExecution(PKINTERRUPT(interrupt as u64), &mut call) as BOOLEAN
}

unsafe extern "win64" fn KeAcquireInterruptSpinLock(interrupt: *mut c_void) -> u8 {
    let k = kernel();
    let old = k.model.KeAcquireInterruptSpinLock(PKINTERRUPT(interrupt as u64));
    k.raised();
    old
}

unsafe extern "win64" fn KeReleaseInterruptSpinLock(interrupt: *mut c_void, old_irql: u8) {
    kernel().model.KeReleaseInterruptSpinLock(PKINTERRUPT(interrupt as u64), old_irql)
}

/// (routine, thunk) for the interrupt routines, all ntoskrnl.exe's.
pub fn interrupt_thunks() -> [(&'static str, usize); 5] {
    [
        ("IoConnectInterruptEx", IoConnectInterruptEx as *const () as usize),
        ("IoDisconnectInterruptEx", IoDisconnectInterruptEx as *const () as usize),
        ("KeSynchronizeExecution", KeSynchronizeExecution as *const () as usize),
        ("KeAcquireInterruptSpinLock", KeAcquireInterruptSpinLock as *const () as usize),
        ("KeReleaseInterruptSpinLock", KeReleaseInterruptSpinLock as *const () as usize),
    ]
}
