//! Work items as a driver binary uses them: IoAllocateWorkItem's PIO_WORKITEM is opaque to the driver, so the
//! model's handle is handed out as is; the routine IoQueueWorkItem takes runs on the model's worker thread at
//! PASSIVE_LEVEL, called through its Windows signature, with the verifier's rules (queued items at unload, 0xE4).
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::ffi::c_void;

use vhca_ntapi::{NtAsyncKernel, PDEVICE_OBJECT, PIO_WORKITEM, WORK_QUEUE_TYPE};
use windows_sys::Wdk::Foundation::DEVICE_OBJECT;

use crate::driver_stack::{at_driver_site, site_entry};
use crate::kernel_context::kernel;

/// IO_WORKITEM_ROUTINE(DeviceObject, Context), as the image calls it.
pub type WorkItemRoutine = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut c_void);

// IoAllocateWorkItem is on the low-resources simulation's list: its stub names the driver's call site.
site_entry!(IoAllocateWorkItem_entry => IoAllocateWorkItem);

/// IoAllocateWorkItem(DeviceObject): NULL when the model refuses (the low-resources simulation, say).
unsafe extern "win64" fn IoAllocateWorkItem(device: *mut DEVICE_OBJECT) -> *mut c_void {
    at_driver_site(|| kernel().model.IoAllocateWorkItem(PDEVICE_OBJECT(device as u64)).0 as *mut c_void)
}

/// IoQueueWorkItem(IoWorkItem, WorkerRoutine, QueueType, Context): WORK_QUEUE_TYPE CriticalWorkQueue 0,
/// DelayedWorkQueue 1, HyperCriticalWorkQueue 2 (any other is taken as delayed: the model runs them alike).
unsafe extern "win64" fn IoQueueWorkItem(
    item: *mut c_void,
    routine: WorkItemRoutine,
    queue: i32,
    context: *mut c_void,
) {
    let queue = match queue {
        0 => WORK_QUEUE_TYPE::CriticalWorkQueue,
        2 => WORK_QUEUE_TYPE::HyperCriticalWorkQueue,
        _ => WORK_QUEUE_TYPE::DelayedWorkQueue,
    };
    let context = context as usize;
    kernel().model.IoQueueWorkItem(
        PIO_WORKITEM(item as u64),
        Box::new(move |device: PDEVICE_OBJECT| {
            crate::driver_fault::prepare_thread();
            // SAFETY: the driver's routine with the device object the item was allocated for and its context, at
            // PASSIVE_LEVEL on the model's worker thread, as a system worker thread calls it.
            unsafe { routine(device.0 as *mut DEVICE_OBJECT, context as *mut c_void) }
        }),
        queue,
    )
}

unsafe extern "win64" fn IoFreeWorkItem(item: *mut c_void) {
    kernel().model.IoFreeWorkItem(PIO_WORKITEM(item as u64))
}

/// (routine, thunk) for the work item routines, all ntoskrnl.exe's.
pub fn work_item_thunks() -> [(&'static str, usize); 3] {
    [
        ("IoAllocateWorkItem", IoAllocateWorkItem_entry as *const () as usize),
        ("IoQueueWorkItem", IoQueueWorkItem as *const () as usize),
        ("IoFreeWorkItem", IoFreeWorkItem as *const () as usize),
    ]
}
