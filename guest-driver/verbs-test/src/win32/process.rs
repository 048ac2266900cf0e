//! This process as vhca-user-verbs' provider sees one: vhca's interface found through the configuration manager
//! and opened with CreateFileW, IOCTLs through DeviceIoControl, memory from VirtualAlloc. The loopback life opens
//! the handle synchronous; the wait-cancel life opens it overlapped (FILE_FLAG_OVERLAPPED), where every request
//! carries an OVERLAPPED with its own event and a request the driver keeps pending returns to the caller.

use alloc::boxed::Box;
use alloc::vec;
use alloc::vec::Vec;
use core::ffi::c_void;

use vhca_driver_core::ioctl_codec::DEVICE_INTERFACE_GUID;
use vhca_user_verbs::{Overlapped, OverlappedProcess, Reply, VerbsProcess};
use vhca_verbs_test::{first_interface, status_from_win32};
use windows_sys::core::GUID;
use windows_sys::Win32::Devices::DeviceAndDriverInstallation::{
    CM_Get_Device_Interface_ListW, CM_Get_Device_Interface_List_SizeW, CM_GET_DEVICE_INTERFACE_LIST_PRESENT, CR_SUCCESS,
};
use windows_sys::Win32::Foundation::{
    CloseHandle, GetLastError, ERROR_IO_INCOMPLETE, ERROR_IO_PENDING, GENERIC_READ, GENERIC_WRITE, HANDLE,
    INVALID_HANDLE_VALUE, WAIT_TIMEOUT,
};
use windows_sys::Win32::Storage::FileSystem::{
    CreateFileW, FILE_ATTRIBUTE_NORMAL, FILE_FLAG_OVERLAPPED, OPEN_EXISTING,
};
use windows_sys::Win32::System::Memory::{VirtualAlloc, MEM_COMMIT, MEM_RESERVE, PAGE_READWRITE};
use windows_sys::Win32::System::Threading::{CreateEventW, Sleep, INFINITE};
use windows_sys::Win32::System::IO::{CancelIoEx, DeviceIoControl, GetOverlappedResultEx, OVERLAPPED};

const PAGE: usize = 4096;
/// What `open_interface` answers when no vhca interface is present (STATUS_NO_SUCH_DEVICE).
const STATUS_NO_SUCH_DEVICE: i32 = 0xC000_000E_u32 as i32;

/// STATUS_PENDING, what OVERLAPPED.Internal holds until the request completes (HasOverlappedIoCompleted's test).
const STATUS_PENDING: usize = 0x103;

/// A request on an overlapped handle, boxed so its OVERLAPPED stays where the kernel was told it is until the
/// request completes.
struct InFlight {
    overlapped: OVERLAPPED,
    handle: HANDLE,
}

impl InFlight {
    /// The reply of a request that completed: its NTSTATUS (OVERLAPPED.Internal, the IRP's final status) and its
    /// Information (InternalHigh).
    fn reply(&self) -> Reply {
        Reply { status: self.overlapped.Internal as u32 as i32, information: self.overlapped.InternalHigh }
    }

    fn close_event(&self) {
        // SAFETY: the event CreateEventW made for this request, closed once, after the request completed.
        unsafe { CloseHandle(self.overlapped.hEvent) };
    }
}

pub struct Win32Process {
    handles: Vec<HANDLE>,
    no_device: bool,
    /// Handles are opened with FILE_FLAG_OVERLAPPED (the wait-cancel life).
    overlapped: bool,
    in_flight: Vec<Option<Box<InFlight>>>,
}

impl Win32Process {
    pub fn new(overlapped: bool) -> Win32Process {
        Win32Process { handles: Vec::new(), no_device: false, overlapped, in_flight: Vec::new() }
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
        // A request still pending may be written by the kernel until it completes (the handle's CLEANUP, below,
        // completes vhca.sys's waits; the process's exit cancels the rest): its OVERLAPPED and event are left to the
        // exit rather than freed under it.
        for request in self.in_flight.drain(..).flatten() {
            core::mem::forget(request);
        }
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
                FILE_ATTRIBUTE_NORMAL | if self.overlapped { FILE_FLAG_OVERLAPPED } else { 0 },
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
        if self.overlapped {
            // An overlapped handle takes no request without an OVERLAPPED: sent as one and waited for.
            return match self.send(file, code, input, output.as_mut_ptr(), output.len()) {
                Overlapped::Done(reply) => reply,
                Overlapped::Pending(id) => self.wait(id, INFINITE).unwrap_or(Reply { status: -1, information: 0 }),
            };
        }
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

impl Win32Process {
    /// DeviceIoControl with an OVERLAPPED of its own (and its own manual-reset event).
    fn send(&mut self, file: usize, code: u32, input: &[u8], output: *mut u8, len: usize) -> Overlapped {
        // SAFETY: no security attributes, no name: a fresh unnamed manual-reset event, not signalled.
        let event = unsafe { CreateEventW(core::ptr::null(), 1, 0, core::ptr::null()) };
        if event.is_null() {
            // SAFETY: no preconditions.
            return Overlapped::Done(Reply { status: status_from_win32(unsafe { GetLastError() }), information: 0 });
        }
        // SAFETY: OVERLAPPED is plain data; all zeros is its initial state (offsets unused for a device).
        let mut overlapped: OVERLAPPED = unsafe { core::mem::zeroed() };
        overlapped.hEvent = event;
        let handle = self.handles[file];
        let mut request = Box::new(InFlight { overlapped, handle });
        let mut returned = 0u32;
        let pointer = |len: usize, at: *const u8| if len == 0 { core::ptr::null() } else { at as *const c_void };
        // SAFETY: an open overlapped handle of this process; the input is copied by the I/O manager before the call
        // returns; the output is process memory from `allocate` (or the caller's buffer, waited for before it
        // goes), and the boxed OVERLAPPED stays put until the request completes.
        let ok = unsafe {
            DeviceIoControl(
                handle,
                code,
                pointer(input.len(), input.as_ptr()),
                input.len() as u32,
                pointer(len, output) as *mut c_void,
                len as u32,
                &mut returned,
                &mut request.overlapped,
            )
        };
        // SAFETY: no preconditions.
        let error = if ok == 0 { unsafe { GetLastError() } } else { 0 };
        if ok == 0 && error == ERROR_IO_PENDING {
            self.in_flight.push(Some(request));
            return Overlapped::Pending(self.in_flight.len() - 1);
        }
        let reply = if ok != 0 {
            Reply { status: 0, information: returned as usize }
        } else if request.overlapped.Internal != 0 && request.overlapped.Internal != STATUS_PENDING {
            // Completed at once with an error: the driver's own status.
            request.reply()
        } else {
            Reply { status: status_from_win32(error), information: 0 }
        };
        request.close_event();
        Overlapped::Done(reply)
    }
}

impl OverlappedProcess for Win32Process {
    fn device_control_overlapped(&mut self, file: usize, code: u32, input: &[u8], at: usize, len: usize) -> Overlapped {
        self.send(file, code, input, at as *mut u8, len)
    }

    fn is_complete(&mut self, request: usize) -> bool {
        match self.in_flight.get(request).and_then(Option::as_ref) {
            // HasOverlappedIoCompleted (a minwinbase.h macro): the kernel writes Internal at completion.
            Some(r) => {
                // SAFETY: a live boxed OVERLAPPED of this process.
                let internal = unsafe { core::ptr::read_volatile(&r.overlapped.Internal) };
                internal != STATUS_PENDING
            }
            None => true,
        }
    }

    fn cancel(&mut self, request: usize) -> Option<bool> {
        if let Some(r) = self.in_flight.get(request).and_then(Option::as_ref) {
            // SAFETY: the request's handle and OVERLAPPED, both live; CancelIoEx only marks it for cancellation.
            unsafe { CancelIoEx(r.handle, &r.overlapped) };
        }
        // Whether a cancel routine ran is the driver's business; a Windows process cannot see it.
        None
    }

    fn wait(&mut self, request: usize, ms: u32) -> Option<Reply> {
        let r = self.in_flight.get(request).and_then(Option::as_ref)?;
        let mut transferred = 0u32;
        // SAFETY: the request's handle and live OVERLAPPED; not alertable.
        let ok = unsafe { GetOverlappedResultEx(r.handle, &r.overlapped, &mut transferred, ms, 0) };
        // SAFETY: no preconditions.
        if ok == 0 && matches!(unsafe { GetLastError() }, WAIT_TIMEOUT | ERROR_IO_INCOMPLETE) {
            return None;
        }
        // Completed, with success or the driver's error status (STATUS_CANCELLED for a cancelled one, which
        // GetOverlappedResultEx reports as ERROR_OPERATION_ABORTED): the IRP's own status either way.
        let r = self.in_flight[request].take()?;
        let reply = r.reply();
        r.close_event();
        Some(reply)
    }
}
