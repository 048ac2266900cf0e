//! Timers as a driver binary uses them: the KTIMER lives in the driver's memory, KeInitializeTimer(Ex) binds it to
//! a timer of the NT model, which expires it on its clock, signals it and queues its DPC (the driver's KDPC,
//! through the DPC table), with the verifier's IRQL and unload rules.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use vhca_ntapi::{NtAsyncKernel, PKDPC, PKTIMER, TIMER_TYPE};
use windows_sys::Wdk::Foundation::KDPC;
use windows_sys::Wdk::System::SystemServices::KTIMER;

use crate::driver_stack::{at_driver_site, site_entry};
use crate::kernel_context::kernel;

// Every routine here is a scheduling point of the interleaving modes (a kernel call, a lock's acquire or release, a
// wait): each enters through a stub that finds the driver's call site first, so its points, pauses and races name
// the binary's RVA and symbol, not this file's line (the stub walks the stack only while a mode or the
// low-resources simulation is on).
site_entry!(KeInitializeTimer_entry => KeInitializeTimer);
site_entry!(KeInitializeTimerEx_entry => KeInitializeTimerEx);
site_entry!(KeSetTimer_entry => KeSetTimer);
site_entry!(KeSetTimerEx_entry => KeSetTimerEx);
site_entry!(KeCancelTimer_entry => KeCancelTimer);

/// KOBJECTS' TimerNotificationObject and TimerSynchronizationObject (wdm.h): the DISPATCHER_HEADER's Type
/// KeInitializeTimerEx writes.
const TIMER_NOTIFICATION_OBJECT: u8 = 8;
const TIMER_SYNCHRONIZATION_OBJECT: u8 = 9;

/// KeInitializeTimerEx(Timer, Type): TIMER_TYPE NotificationTimer 0, SynchronizationTimer 1. Initialized again at
/// the same address, the KTIMER gets a new model timer.
unsafe extern "win64" fn KeInitializeTimerEx(timer: *mut KTIMER, timer_type: i32) {
    at_driver_site(|| {
        let (kind, object) = match timer_type {
            1 => (TIMER_TYPE::SynchronizationTimer, TIMER_SYNCHRONIZATION_OBJECT),
            _ => (TIMER_TYPE::NotificationTimer, TIMER_NOTIFICATION_OBJECT),
        };
        // SAFETY: the driver's KTIMER, resident; its first byte is the DISPATCHER_HEADER's Type.
        unsafe {
            std::ptr::write_bytes(timer, 0, 1);
            *(timer as *mut u8) = object;
        }
        let k = kernel();
        k.timers.bind(timer as usize, k.model.KeInitializeTimerEx(kind));
    })
}

/// KeInitializeTimer(Timer): a notification timer.
unsafe extern "win64" fn KeInitializeTimer(timer: *mut KTIMER) {
    at_driver_site(|| {
        // SAFETY: as KeInitializeTimerEx.
        unsafe { KeInitializeTimerEx(timer, 0) }
    })
}

/// KeSetTimerEx(Timer, DueTime, Period, Dpc): DueTime is a LARGE_INTEGER passed by value (an i64 in a register on
/// x64), in 100 ns units, negative = relative; Period in ms ("must be greater than or equal to zero": a negative one
/// is taken as one-shot). TRUE when the timer was already set.
unsafe extern "win64" fn KeSetTimerEx(timer: *mut KTIMER, due_time: i64, period: i32, dpc: *mut KDPC) -> u8 {
    at_driver_site(|| {
        let k = kernel();
        let t = k.timers.model_of(timer as usize, PKTIMER);
        let d = k.dpcs.model_of(dpc as usize, PKDPC);
        k.model.KeSetTimerEx(t, due_time, period.max(0) as u32, d) as u8
    })
}

unsafe extern "win64" fn KeSetTimer(timer: *mut KTIMER, due_time: i64, dpc: *mut KDPC) -> u8 {
    at_driver_site(|| {
        // SAFETY: as KeSetTimerEx.
        unsafe { KeSetTimerEx(timer, due_time, 0, dpc) }
    })
}

unsafe extern "win64" fn KeCancelTimer(timer: *mut KTIMER) -> u8 {
    at_driver_site(|| {
        let k = kernel();
        k.model.KeCancelTimer(k.timers.model_of(timer as usize, PKTIMER)) as u8
    })
}

/// (routine, thunk) for the timer routines, all ntoskrnl.exe's.
pub fn timer_thunks() -> [(&'static str, usize); 5] {
    [
        ("KeInitializeTimer", KeInitializeTimer_entry as *const () as usize),
        ("KeInitializeTimerEx", KeInitializeTimerEx_entry as *const () as usize),
        ("KeSetTimer", KeSetTimer_entry as *const () as usize),
        ("KeSetTimerEx", KeSetTimerEx_entry as *const () as usize),
        ("KeCancelTimer", KeCancelTimer_entry as *const () as usize),
    ]
}
