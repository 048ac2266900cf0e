//! The loader calls DriverUnload only after the driver's last work item routine returned, as Windows does: the
//! I/O manager holds a reference on the device object of a queued item until its routine returns, and unloads a
//! driver only once its device objects are unreferenced. A routine still running at the driver's REMOVE (it set
//! the event its queuer waited on, then still frees its own context, as vhca.sys's does) must not find its driver
//! unloaded. Before this rule the loader called DriverUnload first and waited only in the unload checks, so
//! vhca.sys's heap was still in use at DriverUnload under one schedule of two-requests-locked (0xC4/0x60).

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{routine, NoBus};
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, LoaderKernel};
use vhca_loader::pnp_life::unload;
use vhca_ntmodel::{Bugcheck, BugcheckHandler, HostDmaBackend, NtModel, NtModelConfig};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, DRIVER_OBJECT};
use windows_sys::Win32::Foundation::NTSTATUS;

struct Panics;

impl BugcheckHandler for Panics {
    fn bugcheck(&self, bugcheck: &Bugcheck) -> ! {
        panic!("unexpected stop {bugcheck}")
    }
}

type Create =
    unsafe extern "win64" fn(*mut DRIVER_OBJECT, u32, *const c_void, u32, u32, u8, *mut *mut DEVICE_OBJECT) -> NTSTATUS;
type AllocateWorkItem = unsafe extern "win64" fn(*mut DEVICE_OBJECT) -> *mut c_void;
type WorkItemRoutine = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut c_void);
type QueueWorkItem = unsafe extern "win64" fn(*mut c_void, WorkItemRoutine, i32, *mut c_void);
type DriverUnload = unsafe extern "win64" fn(*mut DRIVER_OBJECT);

/// The routine is under way (its queuer may go on, as after a KeSetEvent it makes).
static STARTED: AtomicBool = AtomicBool::new(false);
/// The routine returned.
static RETURNED: AtomicBool = AtomicBool::new(false);
/// What DriverUnload saw: 0 not called, 1 the routine still running, 2 it had returned.
static AT_UNLOAD: AtomicU8 = AtomicU8::new(0);

unsafe extern "win64" fn slow_routine(_device: *mut DEVICE_OBJECT, _context: *mut c_void) {
    STARTED.store(true, Ordering::SeqCst);
    // What follows its last kernel call: vhca.sys's routine drops its boxed closure here.
    std::thread::sleep(Duration::from_millis(300));
    RETURNED.store(true, Ordering::SeqCst);
}

unsafe extern "win64" fn driver_unload(_driver: *mut DRIVER_OBJECT) {
    AT_UNLOAD.store(if RETURNED.load(Ordering::SeqCst) { 2 } else { 1 }, Ordering::SeqCst);
}

#[test]
fn driver_unload_comes_after_the_last_work_item_routine_returned() {
    let model = Arc::new(NtModel::new(NtModelConfig::default(), Arc::new(HostDmaBackend::default()), Arc::new(Panics)));
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    let driver: *mut DRIVER_OBJECT = Box::into_raw(Box::new(DRIVER_OBJECT::default()));
    // SAFETY: a fresh driver object, the thunks' Windows x64 signatures; the objects outlive the test.
    unsafe {
        (*driver).DriverUnload =
            Some(std::mem::transmute::<DriverUnload, unsafe extern "system" fn(*const DRIVER_OBJECT)>(driver_unload));
        let mut fdo = std::ptr::null_mut();
        assert_eq!(routine::<Create>("IoCreateDevice")(driver, 0, std::ptr::null(), 0x22, 0, 0, &mut fdo), 0);
        let item = routine::<AllocateWorkItem>("IoAllocateWorkItem")(fdo);
        assert!(!item.is_null());
        routine::<QueueWorkItem>("IoQueueWorkItem")(item, slow_routine, 1, std::ptr::null_mut());
    }
    while !STARTED.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
    unload(driver);
    assert_eq!(AT_UNLOAD.load(Ordering::SeqCst), 2, "DriverUnload ran while the work item routine still ran");
}
