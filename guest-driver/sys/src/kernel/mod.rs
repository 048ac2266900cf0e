//! The kernel half of vhca.sys: DriverEntry and the dispatch table, AddDevice and DriverUnload; the WDK shim
//! (vhca-ntapi over ntoskrnl.exe and HAL.dll), the device's registers and DMA memory, and the IRP families
//! (pnp.rs, power.rs, device_control_irp.rs for CREATE/CLEANUP/CLOSE/DEVICE_CONTROL; everything else goes down
//! unchanged).

mod common_buffer;
mod completion_routine;
mod config_space;
mod control_path;
mod cq_waits;
mod debug_print;
mod device_control_irp;
mod device_interface;
mod dma_operations;
mod fdo;
mod interrupt_completions;
mod irp;
mod irql;
mod kernel_callbacks;
mod kernel_imports;
mod mmio_registers;
mod pnp;
mod pool_allocator;
mod power;
mod registry;
mod remove_lock;
mod runtime;
mod scenario_services;
mod spin_locked;
mod started_device;
mod sys_command_transport;
mod wdk_async_kernel;
mod wdk_kernel;

use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, DRIVER_OBJECT, IRP};
use windows_sys::Wdk::Storage::FileSystem::{DO_DEVICE_INITIALIZING, DO_POWER_PAGABLE};
use windows_sys::Wdk::System::SystemServices::IO_REMOVE_LOCK;
use windows_sys::Wdk::System::SystemServices::{
    IoAttachDeviceToDeviceStack, IoCreateDevice, IoDeleteDevice, IRP_MJ_CLEANUP, IRP_MJ_CLOSE, IRP_MJ_CREATE,
    IRP_MJ_DEVICE_CONTROL, IRP_MJ_PNP, IRP_MJ_POWER,
};
use windows_sys::Win32::Foundation::{
    NTSTATUS, STATUS_INSUFFICIENT_RESOURCES, STATUS_NO_SUCH_DEVICE, STATUS_SUCCESS, UNICODE_STRING,
};
use windows_sys::Win32::System::Ioctl::FILE_DEVICE_UNKNOWN;

use fdo::{fdo, Fdo};

/// FILE_DEVICE_SECURE_OPEN (wdm.h): the device's security applies to opens of names below it.
const FILE_DEVICE_SECURE_OPEN: u32 = 0x100;

/// DriverEntry's body: the dispatch table, AddDevice and DriverUnload. PASSIVE_LEVEL, no lock held. A PnP driver
/// creates no device here: AddDevice does, once per vhca device the PnP manager finds.
///
/// # Safety
/// `driver` is the I/O manager's driver object for this image, as DriverEntry receives it.
pub unsafe fn driver_entry(driver: *mut DRIVER_OBJECT, _registry_path: *const UNICODE_STRING) -> NTSTATUS {
    // The Rust heap first: nothing of the driver allocates before it, and without it the driver cannot load.
    if !pool_allocator::reserve() {
        return STATUS_INSUFFICIENT_RESOURCES;
    }
    // SAFETY: the driver object is ours to fill in during DriverEntry.
    unsafe {
        let d = &mut *driver;
        for entry in d.MajorFunction.iter_mut() {
            *entry = Some(dispatch_pass_down);
        }
        d.MajorFunction[IRP_MJ_PNP as usize] = Some(pnp::dispatch_pnp);
        d.MajorFunction[IRP_MJ_POWER as usize] = Some(power::dispatch_power);
        d.MajorFunction[IRP_MJ_CREATE as usize] = Some(device_control_irp::dispatch_create);
        d.MajorFunction[IRP_MJ_CLEANUP as usize] = Some(device_control_irp::dispatch_cleanup);
        d.MajorFunction[IRP_MJ_CLOSE as usize] = Some(device_control_irp::dispatch_close);
        d.MajorFunction[IRP_MJ_DEVICE_CONTROL as usize] = Some(device_control_irp::dispatch_device_control);
        d.DriverUnload = Some(driver_unload);
        (*d.DriverExtension).AddDevice = Some(add_device);
    }
    STATUS_SUCCESS
}

/// AddDevice: creates the FDO, attaches it above the PDO and clears DO_DEVICE_INITIALIZING. PASSIVE_LEVEL.
unsafe extern "system" fn add_device(driver: *const DRIVER_OBJECT, pdo: *const DEVICE_OBJECT) -> NTSTATUS {
    let mut device: *mut DEVICE_OBJECT = core::ptr::null_mut();
    // SAFETY: PASSIVE_LEVEL; an unnamed FDO with room for the extension.
    let status = unsafe {
        IoCreateDevice(
            driver,
            core::mem::size_of::<Fdo>() as u32,
            core::ptr::null(),
            FILE_DEVICE_UNKNOWN,
            FILE_DEVICE_SECURE_OPEN,
            false,
            &mut device,
        )
    };
    if status < 0 {
        return status;
    }
    // SAFETY: PASSIVE_LEVEL (AddDevice); both devices are live; attaching returns the device below, or NULL when
    // the stack is going away.
    let lower = unsafe { IoAttachDeviceToDeviceStack(device, pdo) };
    if lower.is_null() {
        // SAFETY: PASSIVE_LEVEL; created above, never attached.
        unsafe { IoDeleteDevice(device) };
        return STATUS_NO_SUCH_DEVICE;
    }
    // SAFETY: the extension is ours, sized for an Fdo, uninitialised until this write.
    unsafe {
        let extension = (*device).DeviceExtension as *mut Fdo;
        let remove_lock = IO_REMOVE_LOCK::default();
        let control = control_path::ControlPath::new();
        let waits = cq_waits::CqWaits::new();
        extension.write(Fdo { pdo: pdo as *mut DEVICE_OBJECT, lower, started: None, remove_lock, control, waits });
        remove_lock::initialize(&mut (*extension).remove_lock);
        (*extension).control.initialize();
        (*extension).waits.initialize(device, device_control_irp::satisfy_wait);
        (*device).Flags |= DO_POWER_PAGABLE;
        (*device).Flags &= !DO_DEVICE_INITIALIZING;
    }
    STATUS_SUCCESS
}

/// Every IRP this driver does not handle goes to the next lower driver unchanged, holding the remove lock while
/// it does. Any IRQL the IRP comes at (<= DISPATCH_LEVEL).
unsafe extern "system" fn dispatch_pass_down(device: *const DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the IRP's IRQL (<= DISPATCH_LEVEL), no lock held but the remove lock; one of our FDOs (only FDOs
    // exist in this driver) and its IRP.
    unsafe {
        let fdo = fdo(device);
        if let Err(status) = remove_lock::acquire(&mut fdo.remove_lock, irp) {
            return irp::complete(irp, status);
        }
        let status = irp::pass_down(fdo.lower, irp);
        remove_lock::release(&mut fdo.remove_lock, irp);
        status
    }
}

/// DriverUnload: every FDO was deleted at REMOVE_DEVICE before the I/O manager calls this; only the Rust heap is
/// left, given back here.
unsafe extern "system" fn driver_unload(_driver: *const DRIVER_OBJECT) {
    pool_allocator::release();
}
