//! The functional device object's extension: the PDO it serves, the device it attached to, and the started
//! device while there is one. Lives in DEVICE_OBJECT.DeviceExtension from AddDevice to REMOVE_DEVICE.

use windows_sys::Wdk::Foundation::DEVICE_OBJECT;

use super::started_device::StartedDevice;

pub struct Fdo {
    pub pdo: *mut DEVICE_OBJECT,
    /// What IoAttachDeviceToDeviceStack returned: where IRPs go down.
    pub lower: *mut DEVICE_OBJECT,
    pub started: Option<StartedDevice>,
}

/// The extension of one of this driver's FDOs.
///
/// # Safety
/// `device` is an FDO this driver created in AddDevice and has not deleted; the PnP manager serialises the PnP
/// IRPs that change it, and the other IRP paths only read `lower`.
pub unsafe fn fdo<'a>(device: *const DEVICE_OBJECT) -> &'a mut Fdo {
    // SAFETY: the caller's contract; AddDevice wrote an Fdo there.
    unsafe { &mut *((*device).DeviceExtension as *mut Fdo) }
}
