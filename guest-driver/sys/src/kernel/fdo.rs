//! The functional device object's extension: the PDO it serves, the device it attached to, the started device
//! while there is one, and the remove lock. Lives in DEVICE_OBJECT.DeviceExtension from AddDevice to REMOVE_DEVICE.

use windows_sys::Wdk::Foundation::DEVICE_OBJECT;
use windows_sys::Wdk::System::SystemServices::IO_REMOVE_LOCK;

use super::control_path::ControlPath;
use super::cq_waits::CqWaits;
use super::started_device::StartedDevice;

pub struct Fdo {
    pub pdo: *mut DEVICE_OBJECT,
    /// What IoAttachDeviceToDeviceStack returned: where IRPs go down.
    pub lower: *mut DEVICE_OBJECT,
    pub started: Option<StartedDevice>,
    /// Held by every IRP in this driver; REMOVE_DEVICE waits for it (remove_lock.rs).
    pub remove_lock: IO_REMOVE_LOCK,
    /// What IRP_MJ_DEVICE_CONTROL reaches of the started device, and the device interface (control_path.rs).
    pub control: ControlPath,
    /// WAIT_CQ requests kept pending, and the poller that answers them (cq_waits.rs).
    pub waits: CqWaits,
}

/// The extension of one of this driver's FDOs.
///
/// # Safety
/// `device` is an FDO this driver created in AddDevice and has not deleted; the PnP manager serialises the PnP
/// IRPs that change it; the other IRP paths read `lower` and go through `control`'s own mutex.
pub unsafe fn fdo<'a>(device: *const DEVICE_OBJECT) -> &'a mut Fdo {
    // SAFETY: the caller's contract; AddDevice wrote an Fdo there.
    unsafe { &mut *((*device).DeviceExtension as *mut Fdo) }
}
