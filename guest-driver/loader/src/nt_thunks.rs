//! The ntoskrnl.exe / HAL.dll routines a loaded driver may import, as `extern "win64"` functions over the NT model
//! (IRQL, bugchecks) and the I/O manager, and `NtThunks`, which binds import names to these and every family's.
//! An import none binds is one the model does not implement: the load is refused naming it.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;
use std::time::Instant;

use vhca_ntapi::{NtAsyncKernel, NtKernel};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, DRIVER_OBJECT, IRP, KEVENT};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_INVALID_PARAMETER, STATUS_SUCCESS};
use windows_sys::Win32::System::Kernel::PROCESSOR_NUMBER;
use windows_sys::Win32::System::IO::IO_STATUS_BLOCK;

use crate::csq_thunks::csq_thunks;
use crate::debug_log::RESULT_MARK;
use crate::device_interface_thunks::device_interface_thunks;
use crate::dispatcher_thunks::dispatcher_thunks;
use crate::dma_thunks::dma_thunks;
use crate::dpc_thunks::dpc_thunks;
use crate::image_mapping::ImportResolver;
use crate::interrupt_thunks::interrupt_thunks;
use crate::io_manager::IoManager;
use crate::irp_cancel::cancel_thunks;
use crate::irp_dispatch;
use crate::kernel_context::{bugcheck, kernel};
use crate::lock_thunks::lock_thunks;
use crate::memory_thunks::memory_thunks;
use crate::power_life::power_thunks;
use crate::processor_thunks::processor_thunks;
use crate::registry_thunks::registry_thunks;
use crate::remove_lock_thunks::remove_lock_thunks;
use crate::timer_thunks::timer_thunks;
use crate::work_item_thunks::work_item_thunks;

/// DbgPrintEx cuts a message at 512 bytes.
const DBGPRINT_MAX: usize = 512;

// ---- Debug output ----

/// DbgPrintEx(ComponentId, Level, Format, ...). Windows x64 passes variadic arguments as fixed ones (the first four
/// in registers, the rest on the stack, each 8 bytes), so eight fixed arguments read what the format asks for.
#[allow(clippy::too_many_arguments)]
unsafe extern "win64" fn DbgPrintEx(
    _component: u32,
    _level: u32,
    format: *const c_char,
    a0: u64,
    a1: u64,
    a2: u64,
    a3: u64,
    a4: u64,
    a5: u64,
) -> NTSTATUS {
    if format.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    // SAFETY: the driver's NUL-terminated format; the arguments are what it names (the caller's contract).
    let text = unsafe { format_message(CStr::from_ptr(format).to_bytes(), &[a0, a1, a2, a3, a4, a5]) };
    let k = kernel();
    for line in text.lines() {
        if k.echo_results || !line.starts_with(RESULT_MARK) {
            println!("{line}");
        }
        k.debug_log.push(line);
    }
    STATUS_SUCCESS
}

/// The subset of the CRT's printf the kernel's DbgPrint understands that drivers use: %s %S/%ws %c %d %i %u %x %X
/// %p with l/ll/I64/h/z sizes and a width; anything else is copied as written.
///
/// # Safety
/// Each %s/%ws argument is a NUL-terminated string.
unsafe fn format_message(format: &[u8], args: &[u64]) -> String {
    let mut out = String::new();
    let mut args = args.iter().copied();
    let mut i = 0;
    while i < format.len() && out.len() < DBGPRINT_MAX {
        let c = format[i];
        i += 1;
        if c != b'%' {
            out.push(c as char);
            continue;
        }
        let start = i;
        while i < format.len() && (format[i].is_ascii_digit() || b"-+ #.lhzIw".contains(&format[i])) {
            i += 1;
        }
        let Some(&conv) = format.get(i) else { break };
        i += 1;
        let spec = &format[start..i - 1];
        let wide = spec.contains(&b'l') || spec.contains(&b'z') || spec.windows(3).any(|w| w == b"I64");
        let zero_pad = spec.first() == Some(&b'0');
        let width: usize = std::str::from_utf8(spec)
            .ok()
            .map(|t| t.trim_start_matches(['0', '-', '+', ' ', '#']))
            .map(|t| t.chars().take_while(char::is_ascii_digit).collect::<String>())
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        let pad = |text: String| {
            let fill = if zero_pad { '0' } else { ' ' };
            let n = width.saturating_sub(text.len());
            std::iter::repeat_n(fill, n).collect::<String>() + &text
        };
        match conv {
            b'%' => out.push('%'),
            b's' | b'S' => {
                let p = args.next().unwrap_or(0);
                if p == 0 {
                    out.push_str("(null)");
                } else if conv == b'S' || spec.contains(&b'w') || spec.contains(&b'l') {
                    // SAFETY: the caller's contract: a NUL-terminated UTF-16 string.
                    unsafe {
                        let mut q = p as *const u16;
                        let mut units = Vec::new();
                        while *q != 0 && units.len() < DBGPRINT_MAX {
                            units.push(*q);
                            q = q.add(1);
                        }
                        out.push_str(&String::from_utf16_lossy(&units));
                    }
                } else {
                    // SAFETY: the caller's contract: a NUL-terminated byte string.
                    out.push_str(&unsafe { CStr::from_ptr(p as *const c_char) }.to_string_lossy());
                }
            }
            b'c' => out.push(args.next().unwrap_or(0) as u8 as char),
            b'd' | b'i' => {
                let v = args.next().unwrap_or(0);
                out.push_str(&pad(if wide { (v as i64).to_string() } else { (v as i32).to_string() }))
            }
            b'u' => {
                let v = args.next().unwrap_or(0);
                out.push_str(&pad(if wide { v.to_string() } else { (v as u32).to_string() }))
            }
            b'x' => {
                let v = args.next().unwrap_or(0);
                out.push_str(&pad(if wide { format!("{v:x}") } else { format!("{:x}", v as u32) }))
            }
            b'X' => {
                let v = args.next().unwrap_or(0);
                out.push_str(&pad(if wide { format!("{v:X}") } else { format!("{:X}", v as u32) }))
            }
            b'p' => out.push_str(&format!("{:016X}", args.next().unwrap_or(0))),
            other => {
                out.push('%');
                out.push_str(&String::from_utf8_lossy(spec));
                out.push(other as char);
            }
        }
    }
    out
}

// ---- IRQL and stopping ----

unsafe extern "win64" fn KeGetCurrentIrql() -> u8 {
    kernel().model.KeGetCurrentIrql()
}

unsafe extern "win64" fn KfRaiseIrql(new_irql: u8) -> u8 {
    let k = kernel();
    let old = k.model.KeRaiseIrql(new_irql);
    if new_irql >= vhca_ntapi::DISPATCH_LEVEL {
        k.raised();
    }
    old
}

unsafe extern "win64" fn KeLowerIrql(new_irql: u8) {
    kernel().model.KeLowerIrql(new_irql)
}

unsafe extern "win64" fn KeBugCheckEx(code: u32, p1: u64, p2: u64, p3: u64, p4: u64) {
    bugcheck(code, p1, p2, p3, p4)
}

// ---- The C runtime routines ntoskrnl.exe exports ----

// The copy and fill routines' import addresses: each puts its return address, the driver's call site, into the
// fourth argument register (all take three) for the race watch, which reports the bytes they touch in watched
// blocks as the binary's accesses there (race_watch.rs).
crate::register_saving::return_address_in_r9!(memcpy_import => memcpy);
crate::register_saving::return_address_in_r9!(memmove_import => memmove);
crate::register_saving::return_address_in_r9!(memset_import => memset);
crate::register_saving::return_address_in_r9!(memcmp_import => memcmp);

/// Runs a CRT routine the driver called from `caller` over `ranges` (address, bytes, written) on the addresses
/// `f` is given, one per range: through the race watch when a kernel is installed, which may hand it a watched
/// block's alias (a thunk called with none is a test's).
fn crt<T>(caller: u64, ranges: &[(usize, usize, bool)], f: impl FnOnce(&[usize]) -> T) -> T {
    match crate::kernel_context::installed() {
        Some(k) => k.race_watch.crt_call(caller, ranges, f),
        None => f(&ranges.iter().map(|r| r.0).collect::<Vec<_>>()),
    }
}

unsafe extern "win64" fn memcpy(d: *mut c_void, s: *const c_void, n: usize, caller: u64) -> *mut c_void {
    // SAFETY: the driver's buffers, as the CRT's contract.
    crt(caller, &[(s as usize, n, false), (d as usize, n, true)], |at| unsafe {
        libc::memcpy(at[1] as *mut c_void, at[0] as *const c_void, n);
        d
    })
}

unsafe extern "win64" fn memmove(d: *mut c_void, s: *const c_void, n: usize, caller: u64) -> *mut c_void {
    // SAFETY: as memcpy.
    crt(caller, &[(s as usize, n, false), (d as usize, n, true)], |at| unsafe {
        libc::memmove(at[1] as *mut c_void, at[0] as *const c_void, n);
        d
    })
}

unsafe extern "win64" fn memset(d: *mut c_void, c: i32, n: usize, caller: u64) -> *mut c_void {
    // SAFETY: as memcpy.
    crt(caller, &[(d as usize, n, true)], |at| unsafe {
        libc::memset(at[0] as *mut c_void, c, n);
        d
    })
}

unsafe extern "win64" fn memcmp(a: *const c_void, b: *const c_void, n: usize, caller: u64) -> i32 {
    // SAFETY: as memcpy.
    crt(caller, &[(a as usize, n, false), (b as usize, n, false)], |at| unsafe {
        libc::memcmp(at[0] as *const c_void, at[1] as *const c_void, n)
    })
}

unsafe extern "win64" fn strlen(s: *const c_char) -> usize {
    // SAFETY: as memcpy.
    unsafe { libc::strlen(s) }
}

// ---- Devices and IRPs ----

#[allow(clippy::too_many_arguments)]
unsafe extern "win64" fn IoCreateDevice(
    driver: *mut DRIVER_OBJECT,
    extension_size: u32,
    _name: *const c_void,
    device_type: u32,
    characteristics: u32,
    exclusive: u8,
    out: *mut *mut DEVICE_OBJECT,
) -> NTSTATUS {
    if driver.is_null() || out.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    let k = kernel();
    // SAFETY: the driver's out pointer.
    let status = k.io.create_device(driver, extension_size, unsafe { &mut *out });
    if status >= 0 {
        // SAFETY: just created.
        unsafe {
            (**out).DeviceType = device_type;
            (**out).Characteristics = characteristics;
            let _ = exclusive;
        }
    }
    status
}

unsafe extern "win64" fn IoDeleteDevice(device: *mut DEVICE_OBJECT) {
    kernel().io.delete_device(device)
}

unsafe extern "win64" fn IoAttachDeviceToDeviceStack(
    source: *mut DEVICE_OBJECT,
    target: *mut DEVICE_OBJECT,
) -> *mut DEVICE_OBJECT {
    kernel().io.attach(source, target)
}

unsafe extern "win64" fn IoDetachDevice(target: *mut DEVICE_OBJECT) {
    kernel().io.detach(target)
}

unsafe extern "win64" fn IofCallDriver(device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: the driver's device and IRP, as IoCallDriver's contract.
    unsafe { irp_dispatch::call_driver(&kernel().io, device, irp) }
}

unsafe extern "win64" fn IofCompleteRequest(irp: *mut IRP, _priority_boost: i8) {
    // SAFETY: as IofCallDriver.
    unsafe { irp_dispatch::complete_irp(&kernel().io, irp) }
}

unsafe extern "win64" fn IoForwardIrpSynchronously(device: *mut DEVICE_OBJECT, irp: *mut IRP) -> u8 {
    // SAFETY: as IofCallDriver.
    unsafe { irp_dispatch::forward_synchronously(&kernel().io, device, irp) as u8 }
}

/// IoGetAttachedDeviceReference: the top of the stack, referenced (the reference count is kept on the object).
unsafe extern "win64" fn IoGetAttachedDeviceReference(device: *mut DEVICE_OBJECT) -> *mut DEVICE_OBJECT {
    // SAFETY: a live device of the driver's stack.
    unsafe {
        let top = crate::io_manager::top_of(device);
        (*top).ReferenceCount += 1;
        top
    }
}

/// ObfDereferenceObject on a device object (the only objects this driver references).
unsafe extern "win64" fn ObfDereferenceObject(object: *mut c_void) -> isize {
    let device = object as *mut DEVICE_OBJECT;
    if !kernel().io.is_device(device) {
        return 0;
    }
    // SAFETY: a live device.
    unsafe {
        (*device).ReferenceCount -= 1;
        (*device).ReferenceCount as isize
    }
}

/// IoBuildSynchronousFsdRequest: an IRP for `device`'s stack whose completion sets `event` and fills `iosb`, and
/// which the I/O manager frees then.
#[allow(clippy::too_many_arguments)]
unsafe extern "win64" fn IoBuildSynchronousFsdRequest(
    major: u32,
    device: *mut DEVICE_OBJECT,
    buffer: *mut c_void,
    _length: u32,
    _offset: *const i64,
    event: *mut KEVENT,
    iosb: *mut IO_STATUS_BLOCK,
) -> *mut IRP {
    let k = kernel();
    // SAFETY: a live device.
    let irp = k.io.allocate_irp(unsafe { (*device).StackSize });
    if irp.is_null() {
        return irp;
    }
    // SAFETY: a fresh IRP with a location below the current one.
    unsafe {
        (*irp).UserEvent = event;
        (*irp).Anonymous.UserIosb = iosb;
        (*irp).UserBuffer = buffer;
        (*IoManager::next_stack(irp)).MajorFunction = major as u8;
    }
    irp
}

// ---- Time and the processor ----

/// KeDelayExecutionThread(WaitMode, Alertable, Interval): the model's delay on its clock (100 ns units, negative
/// relative), with its rules: 0xC4/0xE5 above APC_LEVEL under IRQL checking, 0xB8 from the driver's DPC or ISR.
/// A host sleep here would let a DPC yield unseen.
unsafe extern "win64" fn KeDelayExecutionThread(_mode: i8, _alertable: u8, interval: *const i64) -> NTSTATUS {
    // SAFETY: the driver's interval.
    let t = unsafe { *interval };
    kernel().model.delay_execution_thread(t).0
}

/// KeStallExecutionProcessor(MicroSeconds): the model's stall, which busy-waits on its clock and counts against the
/// DPC watchdog when a DPC or an ISR stalls, as the native build's.
unsafe extern "win64" fn KeStallExecutionProcessor(micros: u32) {
    NtAsyncKernel::KeStallExecutionProcessor(&*kernel().model, micros)
}

/// KeGetCurrentProcessorNumberEx(ProcNumber): the system-wide index of the processor the model runs the caller on;
/// with ProcNumber, its PROCESSOR_NUMBER too (group 0: the model has no processor groups).
unsafe extern "win64" fn KeGetCurrentProcessorNumberEx(number: *mut PROCESSOR_NUMBER) -> u32 {
    let n = kernel().model.KeGetCurrentProcessorNumber();
    if !number.is_null() {
        // SAFETY: the driver's out structure.
        unsafe { *number = PROCESSOR_NUMBER { Group: 0, Number: n as u8, Reserved: 0 } };
    }
    n
}

/// KeQueryInterruptTimePrecise: 100 ns units since boot (here, since the loader started).
unsafe extern "win64" fn KeQueryInterruptTimePrecise(qpc: *mut u64) -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let elapsed = START.get_or_init(Instant::now).elapsed();
    if !qpc.is_null() {
        // SAFETY: the driver's out pointer.
        unsafe { *qpc = elapsed.as_nanos() as u64 };
    }
    (elapsed.as_nanos() / 100) as u64
}

// ---- Power IRPs ----

/// PoCallDriver: power IRPs go down as any other (Windows Vista and later need no power-IRP serialization).
unsafe extern "win64" fn PoCallDriver(device: *mut DEVICE_OBJECT, irp: *mut IRP) -> NTSTATUS {
    // SAFETY: as IofCallDriver.
    unsafe { irp_dispatch::call_driver(&kernel().io, device, irp) }
}

/// PoStartNextPowerIrp: "Starting with Windows Vista, ... this routine does nothing" (Microsoft's reference page).
unsafe extern "win64" fn PoStartNextPowerIrp(_irp: *mut IRP) {}

// ---- Device registers ----

/// MmMapIoSpaceEx(PhysicalAddress, NumberOfBytes, Protect): the bus driver's mapping of a BAR, or NULL.
/// While anything is watched, the race watch traps the range too: the binary's stores there are its doorbells,
/// which the model then sees instead of counting every kernel call as one (`NtModel::trap_doorbells`).
unsafe extern "win64" fn MmMapIoSpaceEx(physical: i64, length: usize, _protect: u32) -> *mut c_void {
    let k = kernel();
    let Some(at) = k.io.bus().map_io_space(physical as u64, length) else { return std::ptr::null_mut() };
    let device = k.io.device_pdo() as u64;
    let alias = |first: usize, bytes: usize| k.io.bus().alias_io_space(first as *mut u8, bytes).map(|p| p as usize);
    if k.race_watch.insert_device_registers(at as usize, length, device, alias) {
        k.model.trap_doorbells();
    }
    at.cast()
}

unsafe extern "win64" fn MmUnmapIoSpace(base: *mut c_void, length: usize) {
    let k = kernel();
    k.race_watch.remove(base as usize);
    k.io.bus().unmap_io_space(base.cast(), length)
}

/// (module, routine, thunk): every routine the model implements for a driver. Modules compare without case.
pub fn thunks() -> [(&'static str, &'static str, usize); 28] {
    [
        ("ntoskrnl.exe", "DbgPrintEx", DbgPrintEx as *const () as usize),
        ("ntoskrnl.exe", "KeGetCurrentIrql", KeGetCurrentIrql as *const () as usize),
        ("ntoskrnl.exe", "KfRaiseIrql", KfRaiseIrql as *const () as usize),
        ("ntoskrnl.exe", "KeLowerIrql", KeLowerIrql as *const () as usize),
        ("ntoskrnl.exe", "KeBugCheckEx", KeBugCheckEx as *const () as usize),
        ("ntoskrnl.exe", "memcpy", memcpy_import as *const () as usize),
        ("ntoskrnl.exe", "memmove", memmove_import as *const () as usize),
        ("ntoskrnl.exe", "memset", memset_import as *const () as usize),
        ("ntoskrnl.exe", "memcmp", memcmp_import as *const () as usize),
        ("ntoskrnl.exe", "strlen", strlen as *const () as usize),
        ("ntoskrnl.exe", "IoCreateDevice", IoCreateDevice as *const () as usize),
        ("ntoskrnl.exe", "IoDeleteDevice", IoDeleteDevice as *const () as usize),
        ("ntoskrnl.exe", "IoAttachDeviceToDeviceStack", IoAttachDeviceToDeviceStack as *const () as usize),
        ("ntoskrnl.exe", "IoDetachDevice", IoDetachDevice as *const () as usize),
        ("ntoskrnl.exe", "IofCallDriver", IofCallDriver as *const () as usize),
        ("ntoskrnl.exe", "IofCompleteRequest", IofCompleteRequest as *const () as usize),
        ("ntoskrnl.exe", "IoForwardIrpSynchronously", IoForwardIrpSynchronously as *const () as usize),
        ("ntoskrnl.exe", "IoGetAttachedDeviceReference", IoGetAttachedDeviceReference as *const () as usize),
        ("ntoskrnl.exe", "ObfDereferenceObject", ObfDereferenceObject as *const () as usize),
        ("ntoskrnl.exe", "IoBuildSynchronousFsdRequest", IoBuildSynchronousFsdRequest as *const () as usize),
        ("ntoskrnl.exe", "KeDelayExecutionThread", KeDelayExecutionThread as *const () as usize),
        ("ntoskrnl.exe", "KeQueryInterruptTimePrecise", KeQueryInterruptTimePrecise as *const () as usize),
        ("hal.dll", "KeStallExecutionProcessor", KeStallExecutionProcessor as *const () as usize),
        ("ntoskrnl.exe", "KeGetCurrentProcessorNumberEx", KeGetCurrentProcessorNumberEx as *const () as usize),
        ("ntoskrnl.exe", "PoCallDriver", PoCallDriver as *const () as usize),
        ("ntoskrnl.exe", "PoStartNextPowerIrp", PoStartNextPowerIrp as *const () as usize),
        ("ntoskrnl.exe", "MmMapIoSpaceEx", MmMapIoSpaceEx as *const () as usize),
        ("ntoskrnl.exe", "MmUnmapIoSpace", MmUnmapIoSpace as *const () as usize),
    ]
}

/// Binds each import to its thunk: this file's `thunks()`, then each family file's list (all ntoskrnl.exe's). A new
/// family's list is chained in here.
pub struct NtThunks;

impl ImportResolver for NtThunks {
    fn resolve(&self, module: &str, name: &str) -> Option<usize> {
        let kernel_routines = lock_thunks()
            .into_iter()
            .chain(registry_thunks())
            .chain(memory_thunks())
            .chain(dma_thunks())
            .chain(remove_lock_thunks())
            .chain(power_thunks())
            .chain(interrupt_thunks())
            .chain(dpc_thunks())
            .chain(work_item_thunks())
            .chain(timer_thunks())
            .chain(dispatcher_thunks())
            .chain(processor_thunks())
            .chain(crate::seh::raise::seh_thunks())
            .chain(device_interface_thunks())
            .chain(cancel_thunks())
            .chain(csq_thunks())
            .map(|(n, a)| ("ntoskrnl.exe", n, a));
        thunks()
            .into_iter()
            .chain(kernel_routines)
            .find(|(m, n, _)| m.eq_ignore_ascii_case(module) && *n == name)
            .map(|(_, _, a)| a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dbgprint_formats_what_drivers_pass() {
        let s = c"VHCA-RESULT {}";
        let w: Vec<u16> = "wide".encode_utf16().chain([0]).collect();
        // SAFETY: NUL-terminated strings that outlive the call.
        let text = unsafe {
            format_message(
                b"%s|%ws|%d|%u|%x|%08X|%llx|%c|%%|%5d",
                &[s.as_ptr() as u64, w.as_ptr() as u64, (-5i32) as u32 as u64, 7, 255, 0xAB, 1 << 40, b'z' as u64, 42],
            )
        };
        assert_eq!(text, "VHCA-RESULT {}|wide|-5|7|ff|000000AB|10000000000|z|%|   42");
    }
}
