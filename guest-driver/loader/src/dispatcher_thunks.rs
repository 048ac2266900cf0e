//! Dispatcher objects as a driver binary uses them: KEVENTs in the driver's memory bound to events of the NT model
//! (KeInitializeEvent), and KeWaitForSingleObject on any object the driver waits on, dispatched by which table holds
//! its address (a KMUTEX, an event, a timer), so each wait gets the model's IRQL rules (0xC4/0x120-0x122) and its
//! clock, as the native build's.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::ffi::c_void;

use vhca_ntapi::{
    NtAsyncKernel, NtKernel, DISPATCHER_OBJECT, EVENT_TYPE, KPROCESSOR_MODE, KWAIT_REASON, PKEVENT, STATUS_SUCCESS,
};
use windows_sys::Wdk::Foundation::KEVENT;
use windows_sys::Win32::Foundation::NTSTATUS;

use crate::driver_stack::{at_driver_site, site_entry};
use crate::kernel_context::kernel;

// Every routine here is a scheduling point of the interleaving modes (a kernel call, a lock's acquire or release, a
// wait): each enters through a stub that finds the driver's call site first, so its points, pauses and races name
// the binary's RVA and symbol, not this file's line (the stub walks the stack only while a mode or the
// low-resources simulation is on).
site_entry!(KeInitializeEvent_entry => KeInitializeEvent);
site_entry!(KeSetEvent_entry => KeSetEvent);
site_entry!(KeClearEvent_entry => KeClearEvent);
site_entry!(KeResetEvent_entry => KeResetEvent);
site_entry!(KeWaitForSingleObject_entry => KeWaitForSingleObject);

/// KeInitializeEvent(Event, Type, State): the DISPATCHER_HEADER as wdm.h's KeInitializeEvent writes it (Type 0
/// NotificationEvent, 1 SynchronizationEvent; SignalState), and a model event in the same state. Initialized again
/// at the same address, the KEVENT gets a new model event.
unsafe extern "win64" fn KeInitializeEvent(event: *mut KEVENT, event_type: u32, state: u8) {
    at_driver_site(|| {
        // SAFETY: the driver's event.
        unsafe {
            std::ptr::write_bytes(event, 0, 1);
            *(event as *mut u8) = event_type as u8;
            (*event).Header.SignalState = state as i32;
        }
        let kind = if event_type == 1 { EVENT_TYPE::SynchronizationEvent } else { EVENT_TYPE::NotificationEvent };
        let k = kernel();
        k.events.bind(event as usize, k.model.KeInitializeEvent(kind, state != 0));
    })
}

/// KeSetEvent(Event, Increment, Wait): the previous state.
unsafe extern "win64" fn KeSetEvent(event: *mut KEVENT, increment: i32, wait: u8) -> i32 {
    at_driver_site(|| {
        let k = kernel();
        k.model.KeSetEvent(k.events.model_of(event as usize, PKEVENT), increment, wait != 0)
    })
}

unsafe extern "win64" fn KeClearEvent(event: *mut KEVENT) {
    at_driver_site(|| {
        let k = kernel();
        k.model.KeClearEvent(k.events.model_of(event as usize, PKEVENT))
    })
}

/// KeResetEvent(Event): clears it and returns the previous state. The model has no such call: a zero-timeout wait
/// reads the state (allowed up to DISPATCH_LEVEL, as KeResetEvent is; it resets a synchronization event, which is
/// what the clear does anyway), then KeClearEvent.
unsafe extern "win64" fn KeResetEvent(event: *mut KEVENT) -> i32 {
    at_driver_site(|| {
        let k = kernel();
        let e = k.events.model_of(event as usize, PKEVENT);
        let signaled = k.model.KeWaitForSingleObject(
            DISPATCHER_OBJECT::Event(e),
            KWAIT_REASON::Executive,
            KPROCESSOR_MODE::KernelMode,
            false,
            Some(0),
        ) == STATUS_SUCCESS;
        k.model.KeClearEvent(e);
        signaled as i32
    })
}

/// KeWaitForSingleObject(Object, WaitReason, WaitMode, Alertable, Timeout): a KMUTEX goes to the model's mutex
/// wait; an event or a timer to its dispatcher wait with the timeout (NULL: none; 100 ns units, negative =
/// relative). An address no table holds was never initialized through the kernel: it goes to the model as an
/// event, whose verdict for an unknown object is the native build's.
unsafe extern "win64" fn KeWaitForSingleObject(
    object: *mut c_void,
    reason: u32,
    mode: i8,
    alertable: u8,
    timeout: *const i64,
) -> NTSTATUS {
    at_driver_site(|| {
        let k = kernel();
        let address = object as usize;
        if let Some(mutex) = k.locks.kmutex(address) {
            return k.model.KeWaitForMutexObject(mutex).0;
        }
        let target = match (k.events.get(address), k.timers.get(address)) {
            (Some(event), _) => DISPATCHER_OBJECT::Event(event),
            (None, Some(timer)) => DISPATCHER_OBJECT::Timer(timer),
            (None, None) => DISPATCHER_OBJECT::Event(PKEVENT(address as u64)),
        };
        // SAFETY: the driver's timeout, when it passes one.
        let timeout = if timeout.is_null() { None } else { Some(unsafe { *timeout }) };
        let reason = if reason == KWAIT_REASON::UserRequest as u32 {
            KWAIT_REASON::UserRequest
        } else {
            KWAIT_REASON::Executive
        };
        let mode = if mode == 1 { KPROCESSOR_MODE::UserMode } else { KPROCESSOR_MODE::KernelMode };
        k.model.KeWaitForSingleObject(target, reason, mode, alertable != 0, timeout).0
    })
}

/// (routine, thunk) for the dispatcher-object routines, all ntoskrnl.exe's.
pub fn dispatcher_thunks() -> [(&'static str, usize); 5] {
    [
        ("KeInitializeEvent", KeInitializeEvent_entry as *const () as usize),
        ("KeSetEvent", KeSetEvent_entry as *const () as usize),
        ("KeClearEvent", KeClearEvent_entry as *const () as usize),
        ("KeResetEvent", KeResetEvent_entry as *const () as usize),
        ("KeWaitForSingleObject", KeWaitForSingleObject_entry as *const () as usize),
    ]
}
