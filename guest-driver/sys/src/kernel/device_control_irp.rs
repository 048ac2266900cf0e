//! IRP_MJ_CREATE, CLEANUP, CLOSE and DEVICE_CONTROL on the FDO: a FileContext per file object (in its FsContext),
//! the IOCTL's buffers found where its transfer method puts them, then the driver core's shared dispatcher.

use alloc::boxed::Box;
use alloc::vec::Vec;

use vhca_driver_core::ioctl_codec::STATUS_INVALID_HANDLE;
use vhca_driver_core::ioctl_codec::{
    method_of, HandleIn, PollCqIn, RegMrIn, TransferMethod, IOCTL_VHCA_DESTROY_CQ, IOCTL_VHCA_REG_MR,
    IOCTL_VHCA_WAIT_CQ,
};
use vhca_driver_core::{dispatch_device_control as dispatch_ioctl, poll_for_wait, ControlReply, FileContext};
use vhca_ntapi::NTSTATUS as CoreStatus;
use vhca_proto::CQE_SIZE;
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, FILE_OBJECT, IRP, MDL};
use windows_sys::Win32::Foundation::{
    NTSTATUS, STATUS_CANCELLED, STATUS_INSUFFICIENT_RESOURCES, STATUS_INVALID_DEVICE_REQUEST, STATUS_INVALID_PARAMETER,
    STATUS_PENDING, STATUS_SUCCESS,
};
use zerocopy::{FromBytes, IntoBytes};

use super::cq_waits::{cq_of, pended_request, Matching};
use super::fdo::fdo;
use super::irp::{complete, current_stack};
use super::registry;
use super::remove_lock;
use crate::scenario_choice::options;

/// wdm.h's MDL flags MmGetSystemAddressForMdlSafe reads.
const MDL_MAPPED_TO_SYSTEM_VA: i16 = 0x0001;
const MDL_SOURCE_IS_NONPAGED_POOL: i16 = 0x0004;
/// STATUS_INVALID_DEVICE_STATE: a request on a file object CREATE did not open through this driver.
const STATUS_INVALID_DEVICE_STATE: NTSTATUS = 0xC000_0184_u32 as i32;

/// What FsContext points to: the dispatcher's context and the START it was opened under.
struct OpenFile {
    context: FileContext,
    generation: u32,
}

/// The file's OpenFile, if CREATE made one.
///
/// # Safety
/// `file` is NULL or the IRP's live file object, used by one request of it at a time (the control mutex).
unsafe fn open_file<'a>(file: *mut FILE_OBJECT) -> Option<&'a mut OpenFile> {
    // SAFETY: the caller's contract; FsContext is ours from CREATE to CLOSE.
    unsafe { file.as_ref().and_then(|f| (f.FsContext as *mut OpenFile).as_mut()) }
}

/// What a request's handler decided: its completion now, or that it was kept pending (then whoever completes it later
/// gives back its remove lock).
enum Answer {
    Now(ControlReply),
    Pended,
}

impl From<ControlReply> for Answer {
    fn from(reply: ControlReply) -> Answer {
        Answer::Now(reply)
    }
}

/// Takes the remove lock for `irp`, runs `f`, completes the IRP with what `f` answers and releases the lock; a
/// request after REMOVE began is completed with STATUS_DELETE_PENDING. One `f` kept pending keeps the lock and returns
/// STATUS_PENDING. PASSIVE_LEVEL, the caller's thread.
///
/// # Safety
/// One of this driver's FDOs and an IRP of the I/O manager's, ours to complete.
unsafe fn under_remove_lock(device: *const DEVICE_OBJECT, irp: *mut IRP, f: impl FnOnce() -> Answer) -> NTSTATUS {
    // SAFETY: the caller's contract.
    unsafe {
        let fdo = fdo(device);
        if let Err(status) = remove_lock::acquire(&mut fdo.remove_lock, irp) {
            return complete(irp, status);
        }
        match f() {
            Answer::Pended => STATUS_PENDING,
            Answer::Now(reply) => {
                (*irp).IoStatus.Information = reply.information;
                let status = complete(irp, reply.status.0);
                remove_lock::release(&mut fdo.remove_lock, irp);
                status
            }
        }
    }
}

fn answer(status: NTSTATUS) -> ControlReply {
    ControlReply { status: vhca_ntapi::NTSTATUS(status), information: 0 }
}

/// IRP_MJ_CREATE: a new open of the interface gets an empty FileContext. PASSIVE_LEVEL, in the opener's thread.
///
/// # Safety
/// Called by the I/O manager with one of this driver's FDOs and its IRP.
pub unsafe extern "system" fn dispatch_create(device: *const DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the I/O manager's contract; the file object is the one being opened, ours to fill in.
    unsafe {
        let file = (*current_stack(irp)).FileObject;
        let generation = fdo(device).control.generation();
        under_remove_lock(device, irp, || {
            if file.is_null() {
                return answer(STATUS_INVALID_PARAMETER).into();
            }
            let open = Box::new(OpenFile { context: FileContext::new(), generation });
            (*file).FsContext = Box::into_raw(open).cast();
            answer(STATUS_SUCCESS).into()
        })
    }
}

/// IRP_MJ_CLEANUP: the last handle to the file closed (the process exited, say), in the closer's context: what the
/// file left on the HCA is destroyed, dependents first, and its user pages unlocked with its MRs. PASSIVE_LEVEL.
///
/// # Safety
/// As dispatch_create.
pub unsafe extern "system" fn dispatch_cleanup(device: *const DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the I/O manager's contract.
    unsafe {
        let file = (*current_stack(irp)).FileObject;
        let control = &fdo(device).control;
        let waits = &fdo(device).waits;
        under_remove_lock(device, irp, || {
            // The file's requests still waiting end first ("DispatchCleanup ... must complete" the file's queued
            // IRPs): what they wait on is about to be destroyed.
            waits.drain(Matching { file, cq: None }, STATUS_CANCELLED);
            // A file that holds nothing needs no HCA: an open and close must not open one.
            if let Some(open) = open_file(file).filter(|open| open.context.live_objects() != 0) {
                if user_path_broken() {
                    // The bug: the file's handles are dropped, its MRs' pages stay locked in the exiting process.
                    open.context.forget();
                    return answer(STATUS_SUCCESS).into();
                }
                let released = control.with_hca(|hca, generation| {
                    if open.generation == generation {
                        open.context.release(hca);
                    }
                });
                // Not started (STOP dropped the HCA and everything on it): nothing of the file is left to release.
                if released.is_err() || open.context.live_objects() != 0 {
                    open.context.forget();
                }
            }
            answer(STATUS_SUCCESS).into()
        })
    }
}

/// The user path's bug variants, BreakFix 1 (`vhca.break_fix=1`; no scenario's own path reads BreakFix in these
/// routines): CLEANUP releases nothing (the seed's user-exit-with-mr-registered, `vhca.user=exit-with-mr`),
/// REG_MR reads the caller's buffer through its embedded pointer before any probe (ioctl-bad-user-pointer,
/// `vhca.user=bad-pointer`), WAIT_CQ's queue is kept by hand (user-wait-cancel-race) and a pending wait keeps its
/// CQ's ring, which DESTROY_CQ frees under it (user-wait-on-destroyed-cq, `vhca.user=wait-destroy`). Each program
/// meets its own bug alone. Their fixed twins are BreakFix 0. PASSIVE_LEVEL.
fn user_path_broken() -> bool {
    let break_fix = registry::read_text(&registry::BREAK_FIX);
    options(None, break_fix.as_deref()).is_ok_and(|o| o.break_fix)
}

/// IRP_MJ_CLOSE: the file object's last reference went; its context is freed. PASSIVE_LEVEL, any thread.
///
/// # Safety
/// As dispatch_create.
pub unsafe extern "system" fn dispatch_close(device: *const DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the I/O manager's contract; CLEANUP ran before, so no request of this file is left.
    unsafe {
        let file = (*current_stack(irp)).FileObject;
        under_remove_lock(device, irp, || {
            if let Some(f) = file.as_mut() {
                if !f.FsContext.is_null() {
                    drop(Box::from_raw(f.FsContext as *mut OpenFile));
                    f.FsContext = core::ptr::null_mut();
                }
            }
            answer(STATUS_SUCCESS).into()
        })
    }
}

/// MmGetSystemAddressForMdlSafe (a wdm.h inline): the MDL's system address when it has one. This driver imports no
/// MmMapLockedPagesSpecifyCache: an MDL the I/O manager built for IN/OUT_DIRECT without a mapping is refused as the
/// macro's NULL would be.
///
/// # Safety
/// A live, locked MDL.
unsafe fn system_address(mdl: *mut MDL) -> Option<*mut u8> {
    // SAFETY: the caller's contract.
    unsafe {
        let mapped = (*mdl).MdlFlags & (MDL_MAPPED_TO_SYSTEM_VA | MDL_SOURCE_IS_NONPAGED_POOL) != 0;
        Some((*mdl).MappedSystemVa.cast::<u8>()).filter(|p| mapped && !p.is_null())
    }
}

/// IRP_MJ_DEVICE_CONTROL: the buffers as the I/O manager passes them for the code's method (the input always in
/// SystemBuffer; the output there too for BUFFERED, behind Irp->MdlAddress for the direct methods; NEITHER is not
/// used by vhca's codes), then the shared dispatcher on the started HCA under the control mutex. PASSIVE_LEVEL, in
/// the caller's thread and process (REG_MR's probe runs there).
///
/// # Safety
/// As dispatch_create.
pub unsafe extern "system" fn dispatch_device_control(device: *const DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the I/O manager's contract: the stack location's parameters describe SystemBuffer and the MDL.
    unsafe {
        let stack = current_stack(irp);
        let p = (*stack).Parameters.DeviceIoControl;
        let (code, in_len, out_len) = (p.IoControlCode, p.InputBufferLength as usize, p.OutputBufferLength as usize);
        let file = (*stack).FileObject;
        let control = &fdo(device).control;
        let waits = &fdo(device).waits;
        under_remove_lock(device, irp, || {
            let Some(open) = open_file(file) else { return answer(STATUS_INVALID_DEVICE_STATE).into() };
            let system = (*irp).AssociatedIrp.SystemBuffer as *mut u8;
            if (in_len > 0 || out_len > 0) && system.is_null() && method_of(code) == TransferMethod::Buffered {
                return answer(STATUS_INVALID_PARAMETER).into();
            }
            if in_len > 0 && system.is_null() {
                return answer(STATUS_INVALID_PARAMETER).into();
            }
            // Copied out first: for BUFFERED the output is written over the same SystemBuffer.
            let input: Vec<u8> =
                if in_len == 0 { Vec::new() } else { core::slice::from_raw_parts(system, in_len).to_vec() };
            let output: &mut [u8] = match method_of(code) {
                _ if out_len == 0 => &mut [],
                TransferMethod::Buffered => core::slice::from_raw_parts_mut(system, out_len),
                TransferMethod::InDirect | TransferMethod::OutDirect => {
                    let mdl = (*irp).MdlAddress;
                    if mdl.is_null() || ((*mdl).ByteCount as usize) < out_len {
                        return answer(STATUS_INVALID_PARAMETER).into();
                    }
                    match system_address(mdl) {
                        Some(va) => core::slice::from_raw_parts_mut(va, out_len),
                        None => return answer(STATUS_INSUFFICIENT_RESOURCES).into(),
                    }
                }
                TransferMethod::Neither => return answer(STATUS_INVALID_DEVICE_REQUEST).into(),
            };
            if code == IOCTL_VHCA_REG_MR && user_path_broken() {
                if let Ok(req) = RegMrIn::read_from_bytes(&input) {
                    // SAFETY: none: this is the bug. A pointer from UserMode read before MmProbeAndLockPages checked
                    // it is the caller's: a kernel address or an unmapped one faults here, in no __try (0x50 for an
                    // invalid kernel address, docs/scenarios.md "A bad user pointer").
                    let first = core::ptr::read_volatile(req.addr.get() as usize as *const u8);
                    core::hint::black_box(first);
                }
            }
            let reply = control.with_hca(|hca, generation| {
                if open.generation != generation {
                    // Opened before a STOP: its handles named objects of an HCA that is gone.
                    open.context.forget();
                    open.generation = generation;
                }
                dispatch_ioctl(hca, &mut open.context, code, &input, output)
            });
            let reply = reply.unwrap_or_else(|status| ControlReply { status, information: 0 });
            match code {
                IOCTL_VHCA_WAIT_CQ if reply.status == CoreStatus(STATUS_PENDING) => {
                    // Nothing on the CQ yet: kept until the poller finds some (the input names a CQ the file owns:
                    // the dispatcher checked it).
                    let cq = PollCqIn::read_from_bytes(&input).map_or(0, |r| r.cq.get());
                    let broken = user_path_broken();
                    // The bug keeps the CQ's ring itself, not its handle (cq_waits.rs, CachedCq).
                    let cached = if broken { control.cq_view(cq) } else { None };
                    match waits.pend(irp, cq, broken, cached) {
                        STATUS_PENDING => Answer::Pended,
                        status => answer(status).into(),
                    }
                }
                IOCTL_VHCA_DESTROY_CQ if reply.status.0 >= 0 => {
                    // A wait on a CQ that is gone has nothing left to wait for. The bug (BreakFix 1) forgets its
                    // waits here: one whose kept ring it polls after this freed it (user-wait-on-destroyed-cq).
                    if let (Ok(req), false) = (HandleIn::read_from_bytes(&input), user_path_broken()) {
                        waits.drain(Matching { file, cq: Some(req.handle.get()) }, STATUS_CANCELLED);
                    }
                    reply.into()
                }
                _ => reply.into(),
            }
        })
    }
}

/// The poller's question for one pending WAIT_CQ (cq_waits.rs): its CQ polled again under the control mutex, as
/// the dispatcher would, into the request's own output buffer. Some((status, information)) completes it; None: the
/// CQ is still empty. PASSIVE_LEVEL, in a system worker thread.
///
/// # Safety
/// One of this driver's FDOs and a WAIT_CQ request the poller took out of the queue (what `pend` stored of it, its
/// SystemBuffer and MDL as the I/O manager sent them).
pub unsafe fn satisfy_wait(device: *const DEVICE_OBJECT, irp: *mut IRP) -> Option<(NTSTATUS, usize)> {
    // SAFETY: the caller's contract: the buffers were checked by the dispatch routine that pended it.
    unsafe {
        let (file, in_len, out_len) = pended_request(irp);
        let system = (*irp).AssociatedIrp.SystemBuffer as *const u8;
        let mdl = (*irp).MdlAddress;
        let (Some(open), false, false) = (open_file(file), system.is_null(), mdl.is_null()) else {
            return Some((STATUS_INVALID_PARAMETER, 0));
        };
        let Some(va) = system_address(mdl) else { return Some((STATUS_INSUFFICIENT_RESOURCES, 0)) };
        let input = core::slice::from_raw_parts(system, in_len);
        let output = core::slice::from_raw_parts_mut(va, out_len);
        if let Some(kept) = fdo(device).waits.cached(irp) {
            // The bug: the ring it kept at `pend`, read with no mutex and no handle's check, so a CQ destroyed
            // meanwhile is read after DESTROY_CQ freed its ring.
            let max = PollCqIn::read_from_bytes(input).map_or(0, |r| r.max.get() as usize).min(out_len / CQE_SIZE);
            let cqes = kept.reader.poll(&*kept.kernel, max);
            if cqes.is_empty() {
                return None;
            }
            for (slot, cqe) in output.chunks_exact_mut(CQE_SIZE).zip(&cqes) {
                slot.copy_from_slice(cqe.as_bytes());
            }
            return Some((STATUS_SUCCESS, cqes.len() * CQE_SIZE));
        }
        let answered = fdo(device).control.with_hca(|hca, generation| {
            if open.generation != generation {
                // A STOP or D3 came between: the CQ is of an HCA that is gone.
                return Some(ControlReply { status: STATUS_INVALID_HANDLE, information: 0 });
            }
            if !open.context.owns_cq(cq_of(irp)) {
                // DESTROY_CQ took the CQ while the poller held this wait out of the queue, where its drain could
                // not find it: ended as that drain ends the CQ's waits (docs/protocol.md). Asked as a poll, it
                // answered STATUS_INVALID_HANDLE instead, 1 of 2 user-wait-destroyed-cq-drained runs on their
                // first sitting.
                return Some(ControlReply { status: vhca_ntapi::NTSTATUS(STATUS_CANCELLED), information: 0 });
            }
            poll_for_wait(hca, &open.context, input, output)
        });
        match answered {
            Ok(None) => None,
            Ok(Some(reply)) => Some((reply.status.0, reply.information)),
            Err(status) => Some((status.0, 0)),
        }
    }
}
