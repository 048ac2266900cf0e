//! vhca's device interface, what a user-mode verbs provider opens: registered on the PDO under our interface class
//! at START_DEVICE, enabled while the device is started, disabled at STOP, SURPRISE_REMOVAL and REMOVE.

use windows_sys::core::GUID;
use windows_sys::Wdk::Foundation::DEVICE_OBJECT;
use windows_sys::Wdk::System::SystemServices::{IoRegisterDeviceInterface, IoSetDeviceInterfaceState};
use windows_sys::Win32::Foundation::{NTSTATUS, UNICODE_STRING};

use super::kernel_imports::RtlFreeUnicodeString;

/// GUID_DEVINTERFACE_VHCA: the driver core's `DEVICE_INTERFACE_GUID`, the one docs/protocol.md section 12 and a
/// user-mode provider (vhca-verbs-test.exe's CM_Get_Device_Interface_List) name.
pub const GUID_DEVINTERFACE_VHCA: GUID = GUID::from_u128(vhca_driver_core::ioctl_codec::DEVICE_INTERFACE_GUID);

/// The symbolic link IoRegisterDeviceInterface gave; its buffer is the I/O manager's pool, given back on drop.
pub struct DeviceInterface {
    link: UNICODE_STRING,
    enabled: bool,
}

// SAFETY: the link's buffer is pool memory no one else writes; it is used from PnP IRPs only, which the PnP manager
// serialises per device.
unsafe impl Send for DeviceInterface {}

impl DeviceInterface {
    /// Registers the interface on `pdo` (again after a rebalance: Windows hands back the same link). PASSIVE_LEVEL.
    pub fn register(pdo: *mut DEVICE_OBJECT) -> Result<DeviceInterface, NTSTATUS> {
        let mut link = UNICODE_STRING { Length: 0, MaximumLength: 0, Buffer: core::ptr::null_mut() };
        // SAFETY: PASSIVE_LEVEL, no lock held; the PDO of our stack; no reference string (one interface per device).
        let status = unsafe { IoRegisterDeviceInterface(pdo, &GUID_DEVINTERFACE_VHCA, core::ptr::null(), &mut link) };
        if status < 0 {
            return Err(status);
        }
        Ok(DeviceInterface { link, enabled: false })
    }

    /// Opens become possible (true) or impossible (false); an interface is disabled before the HCA goes, so no new
    /// CREATE arrives for a device that is stopping. PASSIVE_LEVEL.
    pub fn set_enabled(&mut self, enabled: bool) -> NTSTATUS {
        if self.enabled == enabled {
            return 0;
        }
        // SAFETY: PASSIVE_LEVEL, no lock held; the link IoRegisterDeviceInterface gave.
        let status = unsafe { IoSetDeviceInterfaceState(&self.link, enabled) };
        if status >= 0 {
            self.enabled = enabled;
        }
        status
    }
}

impl Drop for DeviceInterface {
    fn drop(&mut self) {
        self.set_enabled(false);
        // SAFETY: PASSIVE_LEVEL; the caller of IoRegisterDeviceInterface frees the link (its reference page says
        // RtlFreeUnicodeString), once.
        unsafe { RtlFreeUnicodeString(&mut self.link) };
    }
}
