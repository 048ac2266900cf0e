//! Requests as the I/O manager builds them for a user-mode caller: CREATE on a device gives a FILE_OBJECT, each
//! DeviceIoControl an IRP_MJ_DEVICE_CONTROL (RequestorMode UserMode, the buffered copy in and out), and the last
//! handle's close CLEANUP then CLOSE; plus DriverEntry and AddDevice alone, for a driver these requests test.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use vhca_ntapi::{NtKernel, KPROCESSOR_MODE, LOCK_OPERATION, PMDL};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, DRIVER_OBJECT, FILE_OBJECT, IRP, MDL};
use windows_sys::Wdk::System::SystemServices::{
    IRP_BUFFERED_IO, IRP_DEALLOCATE_BUFFER, IRP_INPUT_OPERATION, IRP_MJ_CLEANUP, IRP_MJ_CLOSE, IRP_MJ_CREATE,
    IRP_MJ_DEVICE_CONTROL,
};
use windows_sys::Win32::Foundation::{
    NTSTATUS, STATUS_ACCESS_VIOLATION, STATUS_INSUFFICIENT_RESOURCES, STATUS_PENDING,
};

use crate::image_mapping::MappedImage;
use crate::io_manager::{top_of, AddDeviceFn, DriverEntryFn, IoManager};
use crate::irp_dispatch;
use crate::kernel_context::kernel;

/// wdm.h: KPROCESSOR_MODE UserMode; the FILE_OBJECT type code; the flag MmGetSystemAddressForMdlSafe reads.
const USER_MODE: i8 = 1;
const IO_TYPE_FILE: i16 = 5;
const MDL_MAPPED_TO_SYSTEM_VA: i16 = 0x0001;

/// The transfer method in a control code's low two bits (devioctl.h's METHOD_*).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TransferMethod {
    Buffered,
    InDirect,
    OutDirect,
    Neither,
}

fn method_of(code: u32) -> TransferMethod {
    [TransferMethod::Buffered, TransferMethod::InDirect, TransferMethod::OutDirect, TransferMethod::Neither]
        [(code & 3) as usize]
}

/// A driver after DriverEntry and AddDevice, its FDO on top of the bus driver's PDO.
pub struct AddedDriver {
    pub driver: *mut DRIVER_OBJECT,
    pub top: *mut DEVICE_OBJECT,
}

/// DriverEntry then AddDevice with the device's PDO, as the PnP life begins (pnp_life.rs), without START_DEVICE.
pub fn add_driver(image: &MappedImage) -> Result<AddedDriver, NTSTATUS> {
    let io = &kernel().io;
    let driver = io.new_driver_object(image.base(), image.size());
    let pdo = io.device_pdo();
    let registry_path = windows_sys::Win32::Foundation::UNICODE_STRING::default();
    // SAFETY: the image's entry point, PASSIVE_LEVEL, a fresh driver object, as the I/O manager calls DriverEntry;
    // then the AddDevice it set, with the PDO.
    unsafe {
        let entry = std::mem::transmute::<usize, DriverEntryFn>(image.at(image.image.entry_rva));
        let status = entry(driver, &registry_path as *const _ as *const c_void);
        if status < 0 {
            return Err(status);
        }
        let add = (*(*driver).DriverExtension).AddDevice.ok_or(STATUS_INSUFFICIENT_RESOURCES)?;
        let status = std::mem::transmute::<usize, AddDeviceFn>(add as usize)(driver, pdo);
        if status < 0 {
            return Err(status);
        }
        Ok(AddedDriver { driver, top: top_of(pdo) })
    }
}

/// An open of a device: the FILE_OBJECT CREATE filled in (its FsContext is the driver's).
pub struct UserFile {
    pub file: *mut FILE_OBJECT,
    device: *mut DEVICE_OBJECT,
}

/// What a DeviceIoControl returned: the IRP's final status, its Information, and the output the caller sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoctlReply {
    pub status: NTSTATUS,
    pub information: usize,
    pub output: Vec<u8>,
}

/// One IRP of `major` for `file` at the top of `device`'s stack, from a user-mode caller; `prepare` fills the
/// stack location and buffers. Returns the final status and Information (the driver completes synchronously; a
/// pending IRP is not waited for yet).
fn send(
    device: *mut DEVICE_OBJECT,
    file: *mut FILE_OBJECT,
    major: u32,
    prepare: impl FnOnce(*mut IRP),
) -> (NTSTATUS, usize) {
    let io = &kernel().io;
    // SAFETY: a live device; a fresh IRP whose next location is the top driver's.
    unsafe {
        let irp = io.allocate_irp((*device).StackSize);
        assert!(!irp.is_null(), "out of memory for an IRP");
        (*irp).RequestorMode = USER_MODE;
        (*irp).Tail.Overlay.OriginalFileObject = file;
        let stack = IoManager::next_stack(irp);
        (*stack).MajorFunction = major as u8;
        (*stack).FileObject = file;
        prepare(irp);
        irp_dispatch::call_driver(io, device, irp);
        let reply = ((*irp).IoStatus.Anonymous.Status, (*irp).IoStatus.Information);
        io.free_irp(irp);
        reply
    }
}

/// The model's MDL over `len` bytes at the caller's `at`, probed and locked UserMode: IN_DIRECT's buffer is read by
/// the driver, OUT_DIRECT's written. Err: what DeviceIoControl's caller is told, the driver never called.
fn lock_user_buffer(at: *mut u8, len: usize, method: TransferMethod) -> Result<PMDL, NTSTATUS> {
    if !crate::user_process::user_probe_allowed(at as usize, len) {
        return Err(STATUS_ACCESS_VIOLATION);
    }
    let k = kernel();
    let mdl = k.model.IoAllocateMdl(k.addresses.to_model(at as usize), len as u32, false, false);
    if mdl.is_null() {
        return Err(STATUS_INSUFFICIENT_RESOURCES);
    }
    let operation =
        if method == TransferMethod::InDirect { LOCK_OPERATION::IoReadAccess } else { LOCK_OPERATION::IoWriteAccess };
    let status = k.model.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, operation);
    if status.0 < 0 {
        k.model.IoFreeMdl(mdl);
        return Err(status.0);
    }
    Ok(mdl)
}

impl UserFile {
    /// CREATE on `device` (the top of its stack, as opening its interface's link reaches it).
    pub fn create(device: *mut DEVICE_OBJECT) -> Result<UserFile, NTSTATUS> {
        // SAFETY: FILE_OBJECT is plain data; zeroed as the object manager hands one to the I/O manager.
        let mut file: Box<FILE_OBJECT> = Box::new(unsafe { std::mem::zeroed() });
        file.Type = IO_TYPE_FILE;
        file.Size = size_of::<FILE_OBJECT>() as i16;
        file.DeviceObject = device;
        let file = Box::into_raw(file);
        let (status, _) = send(device, file, IRP_MJ_CREATE, |_| {});
        if status < 0 {
            // SAFETY: made above, no driver holds it after a failed CREATE.
            drop(unsafe { Box::from_raw(file) });
            return Err(status);
        }
        Ok(UserFile { file, device })
    }

    /// The driver's FsContext (what CREATE stored).
    pub fn fs_context(&self) -> *mut c_void {
        // SAFETY: our live file object.
        unsafe { (*self.file).FsContext }
    }

    /// DeviceIoControl: `input` copied into a SystemBuffer of max(in, out) bytes; for BUFFERED the output is copied
    /// back from it (Information bytes), for IN/OUT_DIRECT `output` is described by an MDL mapped to system space
    /// (one address space here) and the driver writes it in place. NEITHER passes the caller's pointers. A request
    /// the driver leaves pending is waited for, as a synchronous handle's DeviceIoControl waits.
    pub fn device_control(&self, code: u32, input: &[u8], output: &mut [u8]) -> IoctlReply {
        match self.device_control_overlapped(code, input, output) {
            Sent::Done(reply) => reply,
            Sent::Pending(pending) => pending.wait(None).unwrap_or_else(|_| unreachable!("waited without a bound")),
        }
    }

    /// DeviceIoControl on an overlapped handle: the reply when the driver completed the IRP before its dispatch
    /// routine returned, otherwise the request in flight (its buffers stay locked and described until it completes).
    pub fn device_control_overlapped<'a>(&self, code: u32, input: &[u8], output: &'a mut [u8]) -> Sent<'a> {
        let request = match Request::build(self, code, input, output) {
            Ok(request) => request,
            Err(status) => return Sent::Done(IoctlReply { status, information: 0, output: Vec::new() }),
        };
        let io = &kernel().io;
        // SAFETY: the request's fresh IRP, addressed to the top of this file's stack.
        let returned = unsafe { irp_dispatch::call_driver(io, self.device, request.irp) };
        if returned == STATUS_PENDING && !io.ledger().is_done(request.irp as usize) {
            return Sent::Pending(Pending { request: Some(request) });
        }
        Sent::Done(request.finish())
    }

    /// The last handle closed: CLEANUP in the caller's context, then CLOSE once no reference is left. Returns both
    /// statuses.
    pub fn close(self) -> (NTSTATUS, NTSTATUS) {
        let (cleanup, _) = send(self.device, self.file, IRP_MJ_CLEANUP, |_| {});
        let (close, _) = send(self.device, self.file, IRP_MJ_CLOSE, |_| {});
        // SAFETY: made by `create`; after CLOSE no driver holds it.
        drop(unsafe { Box::from_raw(self.file) });
        (cleanup, close)
    }
}

/// What DeviceIoControl on an overlapped handle gave back.
pub enum Sent<'a> {
    Done(IoctlReply),
    Pending(Pending<'a>),
}

/// How long a thread's exit waits for its requests after cancelling them, before it reports that it cannot exit.
/// Windows waits five minutes and then lets the thread go with the request still in the driver; a run here has
/// no such time, and a request that ignores its cancellation for this long is the finding.
const RUNDOWN_WAIT: Duration = Duration::from_secs(5);

/// Requests a thread's exit cancelled that did not complete in RUNDOWN_WAIT, described (their buffers are kept).
static STUCK: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Takes what `STUCK` noted since the last call: the user process's exit reports each.
pub fn take_stuck() -> Vec<String> {
    std::mem::take(&mut *crate::lock(&STUCK))
}

/// A DeviceIoControl the driver answered STATUS_PENDING: its IRP is the driver's until completed. Dropped while
/// still pending, it is what a thread's exit does to its requests (Windows' IoCancelThreadIo): cancelled, and waited
/// for up to RUNDOWN_WAIT.
pub struct Pending<'a> {
    request: Option<Request<'a>>,
}

impl<'a> Pending<'a> {
    /// The IRP in flight (what the driver sees).
    pub fn irp(&self) -> *mut IRP {
        self.request.as_ref().map_or(std::ptr::null_mut(), |r| r.irp)
    }

    /// Whether the driver completed it.
    pub fn is_complete(&self) -> bool {
        kernel().io.ledger().is_done(self.irp() as usize)
    }

    /// CancelIoEx: IoCancelIrp on the request's IRP. True when the driver's cancel routine ran; the request still
    /// completes only when its driver completes it.
    pub fn cancel(&self) -> bool {
        if self.is_complete() {
            return false;
        }
        // SAFETY: the IRP is in flight (not completed, so not freed): the I/O manager's to cancel.
        unsafe { crate::irp_cancel::cancel_irp(self.irp()) }
    }

    /// Waits for the completion (GetOverlappedResult), up to `timeout` (None: for as long as it takes); Err gives the
    /// request back when the time passed first.
    pub fn wait(mut self, timeout: Option<Duration>) -> Result<IoctlReply, Pending<'a>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        while !self.is_complete() {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(self);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let request = self.request.take().expect("a pending request holds its IRP until it is waited for");
        Ok(request.finish())
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let Some(request) = self.request.take() else { return };
        let pending = Pending { request: Some(request) };
        pending.cancel();
        if let Err(mut still) = pending.wait(Some(RUNDOWN_WAIT)) {
            let irp = still.irp();
            crate::lock(&STUCK).push(format!(
                "IRP {:#x} (IOCTL {:#x}) still pending {} s after its thread's exit cancelled it (cancel routine {})",
                irp as usize,
                still.request.as_ref().map_or(0, |r| r.code),
                RUNDOWN_WAIT.as_secs(),
                // SAFETY: an IRP still in flight is live.
                if unsafe { (*irp).CancelRoutine.is_some() } { "set" } else { "none" },
            ));
            // Its driver may still complete it and write its buffers: they are never freed.
            std::mem::forget(still.request.take());
        }
    }
}

/// One DEVICE_CONTROL IRP and the buffers it describes, from its build to its completion.
struct Request<'a> {
    irp: *mut IRP,
    code: u32,
    method: TransferMethod,
    /// The SystemBuffer (METHOD_BUFFERED's copy in and out, the direct methods' input).
    system: Vec<u8>,
    /// The MDL the IRP's MdlAddress points to for IN/OUT_DIRECT.
    mdl: Box<MDL>,
    /// The model's MDL locking a user process's direct buffer, unlocked at completion.
    locked: Option<PMDL>,
    output: &'a mut [u8],
}

impl<'a> Request<'a> {
    /// The IRP as the I/O manager builds it for `file`. Err: what the caller is told, the driver never called.
    fn build(file: &UserFile, code: u32, input: &[u8], output: &'a mut [u8]) -> Result<Request<'a>, NTSTATUS> {
        let method = method_of(code);
        // A user process's direct buffer is probed and locked by the I/O manager in its context before the IRP is
        // sent (IoBuildDeviceIoControlRequest's work on Windows); a bad pointer fails the call without the driver.
        let user_direct = matches!(method, TransferMethod::InDirect | TransferMethod::OutDirect)
            && !output.is_empty()
            && crate::user_process::attached() != 0;
        let locked =
            if user_direct { Some(lock_user_buffer(output.as_mut_ptr(), output.len(), method)?) } else { None };
        let system_len = match method {
            TransferMethod::Buffered => input.len().max(output.len()),
            _ => input.len(),
        };
        let mut system = vec![0u8; system_len];
        system[..input.len()].copy_from_slice(input);
        // SAFETY: MDL is plain data; its PFN array is not read by this driver's direct path.
        let mut mdl: Box<MDL> = Box::new(unsafe { std::mem::zeroed() });
        let io = &kernel().io;
        // SAFETY: a live device; a fresh IRP whose next location is the top driver's, its buffers owned by the
        // request, which lives until the IRP completes.
        let irp = unsafe {
            let irp = io.allocate_irp((*file.device).StackSize);
            assert!(!irp.is_null(), "out of memory for an IRP");
            (*irp).RequestorMode = USER_MODE;
            (*irp).Tail.Overlay.OriginalFileObject = file.file;
            let stack = IoManager::next_stack(irp);
            (*stack).MajorFunction = IRP_MJ_DEVICE_CONTROL as u8;
            (*stack).FileObject = file.file;
            let p = &mut (*stack).Parameters.DeviceIoControl;
            p.IoControlCode = code;
            p.InputBufferLength = input.len() as u32;
            p.OutputBufferLength = output.len() as u32;
            (*irp).AssociatedIrp.SystemBuffer =
                if system.is_empty() { std::ptr::null_mut() } else { system.as_mut_ptr().cast() };
            let out_ptr = output.as_mut_ptr();
            match method {
                TransferMethod::Buffered => {
                    (*irp).Flags = IRP_BUFFERED_IO | IRP_DEALLOCATE_BUFFER | IRP_INPUT_OPERATION;
                    (*irp).UserBuffer = out_ptr.cast();
                }
                TransferMethod::InDirect | TransferMethod::OutDirect if !output.is_empty() => {
                    (*irp).Flags = IRP_BUFFERED_IO | IRP_DEALLOCATE_BUFFER;
                    mdl.Size = size_of::<MDL>() as i16;
                    mdl.StartVa = ((out_ptr as usize) & !0xFFF) as *mut c_void;
                    mdl.ByteOffset = (out_ptr as usize & 0xFFF) as u32;
                    mdl.ByteCount = output.len() as u32;
                    mdl.MappedSystemVa = out_ptr.cast();
                    mdl.MdlFlags = MDL_MAPPED_TO_SYSTEM_VA;
                    (*irp).MdlAddress = &mut *mdl;
                }
                TransferMethod::InDirect | TransferMethod::OutDirect => {}
                TransferMethod::Neither => {
                    p.Type3InputBuffer = input.as_ptr() as *mut c_void;
                    (*irp).UserBuffer = out_ptr.cast();
                }
            }
            irp
        };
        Ok(Request { irp, code, method, system, mdl, locked, output })
    }

    /// The completed IRP's answer as the caller sees it; the IRP goes back to the I/O manager and the buffer is
    /// unlocked. The request's own buffers are kept a while (`RETIRED`): a driver that touches an IRP it no longer
    /// owns finds what was there, as the IRP's own memory is kept (io_manager.rs).
    fn finish(self) -> IoctlReply {
        let io = &kernel().io;
        // SAFETY: the completed IRP, not freed yet: only this request frees it.
        let (status, information) =
            unsafe { ((*self.irp).IoStatus.Anonymous.Status, (*self.irp).IoStatus.Information) };
        io.free_irp(self.irp);
        if let Some(mdl) = self.locked {
            let k = &kernel().model;
            k.MmUnlockPages(mdl);
            k.IoFreeMdl(mdl);
        }
        let shown = match self.method {
            TransferMethod::Buffered if status >= 0 => {
                let n = information.min(self.output.len());
                self.output[..n].copy_from_slice(&self.system[..n]);
                n
            }
            TransferMethod::Buffered => 0,
            _ => information.min(self.output.len()),
        };
        let reply = IoctlReply { status, information, output: self.output[..shown].to_vec() };
        retire(self.system, self.mdl);
        reply
    }
}

/// How many completed requests' SystemBuffers and MDLs are kept, as FREED_IRPS_KEPT keeps their IRPs.
const RETIRED_KEPT: usize = 64;

/// A completed request's buffers, kept allocated only: nothing here reads them again.
struct Retired {
    _system: Vec<u8>,
    _mdl: Box<MDL>,
}

// SAFETY: the MDL's pointers are never followed through this value; it only keeps the memory allocated.
unsafe impl Send for Retired {}

static RETIRED: Mutex<VecDeque<Retired>> = Mutex::new(VecDeque::new());

fn retire(system: Vec<u8>, mdl: Box<MDL>) {
    let mut retired = crate::lock(&RETIRED);
    retired.push_back(Retired { _system: system, _mdl: mdl });
    if retired.len() > RETIRED_KEPT {
        retired.pop_front();
    }
}
