//! PCI config space of the device, read and written through its own device stack with IRP_MN_READ_CONFIG /
//! IRP_MN_WRITE_CONFIG (Microsoft, "Obtaining Device Configuration Information at IRQL = PASSIVE_LEVEL"): an IRP
//! built by IoBuildSynchronousFsdRequest, sent to the top of the stack, waited for on an event.

use core::ffi::c_void;

use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IO_STACK_LOCATION, KEVENT};
use windows_sys::Wdk::System::SystemServices::{
    Executive, IoBuildSynchronousFsdRequest, IoGetAttachedDeviceReference, IofCallDriver, KeInitializeEvent,
    KeWaitForSingleObject, KernelMode, ObfDereferenceObject, IRP_MJ_PNP, IRP_MN_READ_CONFIG, IRP_MN_WRITE_CONFIG,
    PCI_WHICHSPACE_CONFIG,
};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_NOT_SUPPORTED, STATUS_PENDING};
use windows_sys::Win32::System::Kernel::NotificationEvent;
use windows_sys::Win32::System::IO::IO_STATUS_BLOCK;

use super::irp::current_stack;

/// PASSIVE_LEVEL. Reads (`write` false) or writes `buffer` at `offset` of the PDO's config space.
fn config_irp(pdo: *mut DEVICE_OBJECT, write: bool, offset: u32, buffer: &mut [u8]) -> NTSTATUS {
    // SAFETY: an event and a status block on this (non-pageable while waiting in kernel mode) stack.
    let mut event: KEVENT = unsafe { core::mem::zeroed() };
    let mut io_status: IO_STATUS_BLOCK = IO_STATUS_BLOCK::default();
    // SAFETY: PASSIVE_LEVEL; the event lives until the wait below returns.
    unsafe { KeInitializeEvent(&mut event, NotificationEvent, false) };
    // SAFETY: PASSIVE_LEVEL, no lock held; the PDO is live while the driver is attached; the reference is
    // dropped below.
    let top = unsafe { IoGetAttachedDeviceReference(pdo) };
    // SAFETY: PASSIVE_LEVEL; no buffer (config IRPs carry theirs in the stack location).
    let irp = unsafe {
        IoBuildSynchronousFsdRequest(
            IRP_MJ_PNP,
            top,
            core::ptr::null_mut(),
            0,
            core::ptr::null(),
            &event,
            &mut io_status,
        )
    };
    if irp.is_null() {
        // SAFETY: PASSIVE_LEVEL; the reference from IoGetAttachedDeviceReference.
        unsafe { ObfDereferenceObject(top as *const c_void) };
        return windows_sys::Win32::Foundation::STATUS_INSUFFICIENT_RESOURCES;
    }
    // SAFETY: a fresh IRP: the next stack location (the first the target sees) is one below the current one.
    unsafe {
        let next: *mut IO_STACK_LOCATION = current_stack(irp).sub(1);
        (*next).MajorFunction = IRP_MJ_PNP as u8;
        (*next).MinorFunction = if write { IRP_MN_WRITE_CONFIG } else { IRP_MN_READ_CONFIG } as u8;
        (*next).Parameters.ReadWriteConfig.WhichSpace = PCI_WHICHSPACE_CONFIG;
        (*next).Parameters.ReadWriteConfig.Buffer = buffer.as_mut_ptr().cast();
        (*next).Parameters.ReadWriteConfig.Offset = offset;
        (*next).Parameters.ReadWriteConfig.Length = buffer.len() as u32;
        // PnP IRPs start as "not supported", so a stack that ignores them is not read as success.
        (*irp).IoStatus.Anonymous.Status = STATUS_NOT_SUPPORTED;
    }
    // SAFETY: PASSIVE_LEVEL; the IRP is the I/O manager's and completes (freeing itself) into io_status.
    let mut status = unsafe { IofCallDriver(top, irp) };
    if status == STATUS_PENDING {
        // SAFETY: PASSIVE_LEVEL, no timeout, the event above.
        unsafe {
            KeWaitForSingleObject(
                (&event as *const KEVENT).cast(),
                Executive,
                KernelMode as i8,
                false,
                core::ptr::null(),
            )
        };
        // SAFETY: written by the I/O manager before it signalled the event.
        status = unsafe { io_status.Anonymous.Status };
    }
    // SAFETY: PASSIVE_LEVEL; the reference from IoGetAttachedDeviceReference.
    unsafe { ObfDereferenceObject(top as *const c_void) };
    status
}

pub fn read(pdo: *mut DEVICE_OBJECT, offset: u32, buffer: &mut [u8]) -> NTSTATUS {
    config_irp(pdo, false, offset, buffer)
}

pub fn write(pdo: *mut DEVICE_OBJECT, offset: u32, bytes: &[u8]) -> NTSTATUS {
    let mut copy = [0u8; 8];
    let n = bytes.len().min(copy.len());
    copy[..n].copy_from_slice(&bytes[..n]);
    config_irp(pdo, true, offset, &mut copy[..n])
}
