//! This process as vhca-user-verbs' provider sees one: vhca's interface found through the configuration manager
//! and opened with CreateFileW, IOCTLs through DeviceIoControl (synchronous: the handle is not overlapped), memory
//! from VirtualAlloc.

use alloc::vec;
use alloc::vec::Vec;
use core::ffi::c_void;

use vhca_driver_core::ioctl_codec::DEVICE_INTERFACE_GUID;
use vhca_user_verbs::{Reply, VerbsProcess};
use vhca_verbs_test::{first_interface, status_from_win32};
use windows_sys::core::GUID;
use windows_sys::Win32::Devices::DeviceAndDriverInstallation::{
    CM_Get_Device_Interface_ListW, CM_Get_Device_Interface_List_SizeW, CM_GET_DEVICE_INTERFACE_LIST_PRESENT, CR_SUCCESS,
};
use windows_sys::Win32::Foundation::{
    CloseHandle, GetLastError, GENERIC_READ, GENERIC_WRITE, HANDLE, INVALID_HANDLE_VALUE,
};
use windows_sys::Win32::Storage::FileSystem::{CreateFileW, FILE_ATTRIBUTE_NORMAL, OPEN_EXISTING};
use windows_sys::Win32::System::Memory::{VirtualAlloc, MEM_COMMIT, MEM_RESERVE, PAGE_READWRITE};
use windows_sys::Win32::System::Threading::Sleep;
use windows_sys::Win32::System::IO::DeviceIoControl;

const PAGE: usize = 4096;
/// What `open_interface` answers when no vhca interface is present (STATUS_NO_SUCH_DEVICE).
const STATUS_NO_SUCH_DEVICE: i32 = 0xC000_000E_u32 as i32;

pub struct Win32Process {
    handles: Vec<HANDLE>,
    no_device: bool,
}

impl Win32Process {
    pub fn new() -> Win32Process {
        Win32Process { handles: Vec::new(), no_device: false }
    }

    /// Whether the run failed because no vhca interface is present (exit code 2, not 1).
    pub fn no_device(&self) -> bool {
        self.no_device
    }

    /// The present interfaces of vhca's class as CM_Get_Device_Interface_ListW lists them (a REG_MULTI_SZ). The
    /// size is asked for first; an interface arriving between the two calls makes the second fail with
    /// CR_BUFFER_SMALL, and the caller's run then fails with that code rather than guess.
    fn interface_list() -> Result<Vec<u16>, i32> {
        let class = GUID::from_u128(DEVICE_INTERFACE_GUID);
        let mut units = 0u32;
        // SAFETY: the GUID and the out-parameter outlive the call; no device instance filter (NULL).
        let cr = unsafe {
            CM_Get_Device_Interface_List_SizeW(
                &mut units,
                &class,
                core::ptr::null(),
                CM_GET_DEVICE_INTERFACE_LIST_PRESENT,
            )
        };
        if cr != CR_SUCCESS {
            return Err(cr as i32);
        }
        let mut list = vec![0u16; units.max(1) as usize];
        // SAFETY: `list` holds `units` UTF-16 units, as the size call asked for.
        let cr = unsafe {
            CM_Get_Device_Interface_ListW(
                &class,
                core::ptr::null(),
                list.as_mut_ptr(),
                list.len() as u32,
                CM_GET_DEVICE_INTERFACE_LIST_PRESENT,
            )
        };
        if cr != CR_SUCCESS {
            return Err(cr as i32);
        }
        Ok(list)
    }
}

impl Drop for Win32Process {
    fn drop(&mut self) {
        for handle in self.handles.drain(..) {
            // SAFETY: a handle CreateFileW gave this process, closed once.
            unsafe { CloseHandle(handle) };
        }
    }
}

impl VerbsProcess for Win32Process {
    fn open_interface(&mut self) -> Result<usize, i32> {
        let list = Win32Process::interface_list()?;
        let Some(path) = first_interface(&list) else {
            self.no_device = true;
            return Err(STATUS_NO_SUCH_DEVICE);
        };
        let mut path: Vec<u16> = path.to_vec();
        path.push(0);
        // SAFETY: a NUL-terminated path; no security attributes, no template. Read and write access: vhca's state-
        // changing codes ask for both (the I/O manager checks them against the handle).
        let handle = unsafe {
            CreateFileW(
                path.as_ptr(),
                GENERIC_READ | GENERIC_WRITE,
                0,
                core::ptr::null(),
                OPEN_EXISTING,
                FILE_ATTRIBUTE_NORMAL,
                core::ptr::null_mut(),
            )
        };
        if handle == INVALID_HANDLE_VALUE {
            // SAFETY: no preconditions.
            return Err(status_from_win32(unsafe { GetLastError() }));
        }
        self.handles.push(handle);
        Ok(self.handles.len() - 1)
    }

    fn device_control(&mut self, file: usize, code: u32, input: &[u8], output: &mut [u8]) -> Reply {
        let mut returned = 0u32;
        let pointer = |len: usize, at: *const u8| if len == 0 { core::ptr::null() } else { at as *const c_void };
        // SAFETY: an open handle of this process; both buffers outlive the synchronous call (no OVERLAPPED).
        let ok = unsafe {
            DeviceIoControl(
                self.handles[file],
                code,
                pointer(input.len(), input.as_ptr()),
                input.len() as u32,
                pointer(output.len(), output.as_ptr()) as *mut c_void,
                output.len() as u32,
                &mut returned,
                core::ptr::null_mut(),
            )
        };
        if ok == 0 {
            // SAFETY: no preconditions.
            return Reply { status: status_from_win32(unsafe { GetLastError() }), information: 0 };
        }
        Reply { status: 0, information: returned as usize }
    }

    fn allocate(&mut self, bytes: usize, in_page_offset: usize) -> Option<usize> {
        let span = (in_page_offset % PAGE + bytes).div_ceil(PAGE) * PAGE;
        // SAFETY: a fresh committed range of the process's own memory, kept until the process exits (the MRs over
        // it are deregistered first; freeing it is the exit's).
        let base = unsafe { VirtualAlloc(core::ptr::null(), span, MEM_COMMIT | MEM_RESERVE, PAGE_READWRITE) };
        (!base.is_null()).then(|| base as usize + in_page_offset % PAGE)
    }

    fn pause(&mut self, ms: u32) {
        // SAFETY: no preconditions.
        unsafe { Sleep(ms) };
    }

    fn log(&mut self, line: &str) {
        super::console::line(line);
    }
}
