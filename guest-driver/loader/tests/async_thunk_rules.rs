//! Verifier rules firing through the asynchronous thunks, as they fire for the native build: a wait with a timeout
//! at DISPATCH_LEVEL (0xC4/0x122), a wait without one in the driver's DPC (0xC4/0x121), an ordinary spin lock taken
//! in the driver's ISR at DIRQL (0xC4/0x42), a DPC-level spin lock taken at PASSIVE_LEVEL (0xC4/0x40), paged pool
//! read in the driver's DPC after Force IRQL checking's trim (0xD1), a touch at PASSIVE_LEVEL paging it back in. A bugcheck in
//! a thunk stops the machine and cannot unwind through the driver's frames, so each case runs in a child process
//! (this test binary again, its ignored `child` test) whose bugcheck handler prints the STOP line and exits.

mod common;

use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use common::{routine, NoBus, StopAndExit, STOPPED};
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_ntapi::PDEVICE_OBJECT;
use vhca_ntmodel::{BackendError, DmaBackend, HostMemId, InterruptResources, NtModel, NtModelConfig, VerifierFlags};
use windows_sys::Wdk::Foundation::{KDPC, KEVENT};
use windows_sys::Wdk::System::SystemServices::IO_CONNECT_INTERRUPT_PARAMETERS;
use windows_sys::Win32::Foundation::NTSTATUS;

const CASE: &str = "VHCA_LOADER_RULE_CASE";

type Wait = unsafe extern "win64" fn(*mut c_void, u32, i8, u8, *const i64) -> NTSTATUS;

/// Page-aligned host memory, as the guest's VFIO backend gives it (the trim protects whole pages of one block);
/// nothing here does DMA, so mappings are never asked for.
#[derive(Default)]
struct PagesBackend {
    blocks: Mutex<HashMap<HostMemId, (usize, Layout)>>,
    next: Mutex<u64>,
}

impl DmaBackend for PagesBackend {
    fn alloc(&self, pages: usize) -> Result<HostMemId, BackendError> {
        let layout =
            Layout::from_size_align(pages.max(1) * 4096, 4096).map_err(|_| BackendError::OutOfMemory { pages })?;
        // SAFETY: a non-zero size; freed in `free`.
        let block = unsafe { std::alloc::alloc_zeroed(layout) } as usize;
        let mut next = self.next.lock().unwrap();
        *next += 1;
        self.blocks.lock().unwrap().insert(HostMemId(*next), (block, layout));
        Ok(HostMemId(*next))
    }
    fn free(&self, mem: HostMemId) -> Result<(), BackendError> {
        let (block, layout) = self.blocks.lock().unwrap().remove(&mem).ok_or(BackendError::UnknownMemory(mem))?;
        // SAFETY: the block `alloc` made with this layout, freed once.
        unsafe { std::alloc::dealloc(block as *mut u8, layout) };
        Ok(())
    }
    fn read(&self, mem: HostMemId, offset: usize, buf: &mut [u8]) -> Result<(), BackendError> {
        let at = self.host_address(mem).ok_or(BackendError::UnknownMemory(mem))?;
        // SAFETY: inside the block (the model reads what it allocated).
        unsafe { std::ptr::copy_nonoverlapping(at.add(offset), buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }
    fn write(&self, mem: HostMemId, offset: usize, buf: &[u8]) -> Result<(), BackendError> {
        let at = self.host_address(mem).ok_or(BackendError::UnknownMemory(mem))?;
        // SAFETY: as read.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), at.add(offset), buf.len()) };
        Ok(())
    }
    fn map(&self, _mem: HostMemId, _first_page: usize, pages: usize) -> Result<u64, BackendError> {
        Err(BackendError::OutOfMemory { pages })
    }
    fn unmap(&self, _iova: u64, _pages: usize) -> Result<(), BackendError> {
        Ok(())
    }
    fn host_address(&self, mem: HostMemId) -> Option<*mut u8> {
        self.blocks.lock().unwrap().get(&mem).map(|(block, _)| *block as *mut u8)
    }
}

fn event() -> *mut KEVENT {
    // SAFETY: an all-zero KEVENT, initialized by the thunk below; resident for the process.
    let event = Box::into_raw(Box::new(unsafe { std::mem::zeroed::<KEVENT>() }));
    let init: unsafe extern "win64" fn(*mut KEVENT, u32, u8) = routine("KeInitializeEvent");
    // SAFETY: the thunk with the caller's KEVENT.
    unsafe { init(event, 0, 0) };
    event
}

unsafe extern "win64" fn waiting_dpc(_dpc: *mut KDPC, context: *mut c_void, _a1: *mut c_void, _a2: *mut c_void) {
    let wait: Wait = routine("KeWaitForSingleObject");
    // SAFETY: the thunk, at the DPC's DISPATCH_LEVEL, with no timeout: the bug under test.
    unsafe { wait(context, 0, 0, 0, std::ptr::null()) };
}

unsafe extern "win64" fn reading_dpc(_dpc: *mut KDPC, context: *mut c_void, _a1: *mut c_void, _a2: *mut c_void) {
    // SAFETY: the caller's paged pool block, read at the DPC's DISPATCH_LEVEL: the bug under test.
    unsafe { (context as *const u8).read_volatile() };
}

unsafe extern "win64" fn locking_isr(_interrupt: *mut c_void, context: *mut c_void, _message_id: u32) -> u8 {
    let acquire: unsafe extern "win64" fn(*mut c_void) -> u8 = routine("KeAcquireSpinLockRaiseToDpc");
    // SAFETY: the thunk at the ISR's DIRQL on the caller's KSPIN_LOCK: the bug under test.
    unsafe { acquire(context) };
    1
}

/// One case, in this (child) process: the kernel with IRQL checking and a bugcheck handler that exits.
fn run_case(case: &str) {
    let config = NtModelConfig { verifier: VerifierFlags::IRQL_CHECKING, ..Default::default() };
    let model = Arc::new(NtModel::new(config, Arc::new(PagesBackend::default()), Arc::new(StopAndExit)));
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    vhca_loader::driver_fault::install_handlers();
    let raise: unsafe extern "win64" fn(u8) -> u8 = routine("KfRaiseIrql");
    let wait: Wait = routine("KeWaitForSingleObject");
    // SAFETY (all calls below): the thunks with the caller's objects and routines, each case breaking one rule.
    unsafe {
        match case {
            "wait-at-dispatch-with-timeout" => {
                let event = event();
                raise(2);
                let timeout = -100_000i64; // 10 ms
                wait(event.cast(), 0, 0, 0, &timeout);
            }
            "wait-in-dpc" => {
                let dpc = Box::into_raw(Box::new(std::mem::zeroed::<KDPC>()));
                type Deferred = unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void, *mut c_void);
                let init: unsafe extern "win64" fn(*mut KDPC, Deferred, *mut c_void) = routine("KeInitializeDpc");
                let insert: unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void) -> u8 =
                    routine("KeInsertQueueDpc");
                init(dpc, waiting_dpc, event().cast());
                insert(dpc, std::ptr::null_mut(), std::ptr::null_mut());
            }
            "spin-lock-in-isr" => {
                let pdo = 0xFFFF_C000_0000_5000u64;
                kernel().model.assign_interrupts(PDEVICE_OBJECT(pdo), InterruptResources::Messages(1));
                let lock = Box::into_raw(Box::new(0u64));
                let mut context: *mut c_void = std::ptr::null_mut();
                let mut p = IO_CONNECT_INTERRUPT_PARAMETERS { Version: 3, ..Default::default() };
                let m = &mut p.Anonymous.MessageBased;
                m.PhysicalDeviceObject = pdo as *mut _;
                m.ConnectionContext.Generic = &mut context;
                type Isr = unsafe extern "win64" fn(*mut c_void, *mut c_void, u32) -> u8;
                m.MessageServiceRoutine =
                    Some(std::mem::transmute::<Isr, unsafe extern "system" fn() -> bool>(locking_isr));
                m.ServiceContext = lock.cast();
                let connect: unsafe extern "win64" fn(*mut IO_CONNECT_INTERRUPT_PARAMETERS) -> NTSTATUS =
                    routine("IoConnectInterruptEx");
                assert_eq!(connect(&mut p), 0);
                let model = kernel().model.clone();
                std::thread::spawn(move || model.deliver(PDEVICE_OBJECT(pdo), 0)).join().unwrap();
            }
            "paged-pool-in-dpc" => {
                let allocate: unsafe extern "win64" fn(u64, usize, u32) -> *mut u8 = routine("ExAllocatePool2");
                let lower: unsafe extern "win64" fn(u8) = routine("KeLowerIrql");
                let context = allocate(0x100, 64, u32::from_le_bytes(*b"Test")); // POOL_FLAG_PAGED
                context.write(7);
                // Raised and lowered again: the trim came, and a touch at PASSIVE_LEVEL pages the block back in.
                lower(raise(2));
                assert_eq!(context.read_volatile(), 7);
                let dpc = Box::into_raw(Box::new(std::mem::zeroed::<KDPC>()));
                type Deferred = unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void, *mut c_void);
                let init: unsafe extern "win64" fn(*mut KDPC, Deferred, *mut c_void) = routine("KeInitializeDpc");
                let insert: unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void) -> u8 =
                    routine("KeInsertQueueDpc");
                init(dpc, reading_dpc, context.cast());
                insert(dpc, std::ptr::null_mut(), std::ptr::null_mut());
            }
            "dpc-level-lock-at-passive" => {
                let mut lock = 0u64;
                let acquire: unsafe extern "win64" fn(*mut u64) = routine("KeAcquireSpinLockAtDpcLevel");
                acquire(&mut lock);
            }
            other => panic!("no case {other}"),
        }
    }
    println!("no bugcheck");
}

/// Not a test of its own: the parent runs it in a child process with the case in the environment.
#[test]
#[ignore]
fn child() {
    run_case(&std::env::var(CASE).expect("run by the tests below, with the case named"));
}

/// The STOP line of `case` run in a child: its code and parameters.
fn stop_of(case: &str) -> (i32, String) {
    let out = common::child_of_this_test(CASE, case).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    // The test harness prints its own "test child ... " before the child's first line.
    let stop = stdout.lines().find_map(|l| l.find("*** STOP:").map(|at| l[at..].to_string())).unwrap_or_default();
    (out.status.code().unwrap_or(-1), if stop.is_empty() { stdout } else { stop })
}

fn c4(subcode: u64, p2: u64) -> String {
    format!("*** STOP: 0x000000C4 (0x{subcode:016X},0x{p2:016X},")
}

#[test]
fn a_wait_with_a_timeout_at_dispatch_is_c4_122_with_the_irql_and_the_timeout() {
    let (status, stop) = stop_of("wait-at-dispatch-with-timeout");
    assert_eq!(status, STOPPED, "{stop}");
    assert!(stop.starts_with(&c4(0x122, 2)), "{stop}");
    assert!(stop.ends_with(&format!("0x{:016X})", -100_000i64 as u64)), "P4 the timeout: {stop}");
}

#[test]
fn a_wait_without_a_timeout_in_the_drivers_dpc_is_c4_121() {
    let (status, stop) = stop_of("wait-in-dpc");
    assert_eq!(status, STOPPED, "{stop}");
    assert!(stop.starts_with(&c4(0x121, 2)), "{stop}");
}

#[test]
fn an_ordinary_spin_lock_in_the_drivers_isr_is_c4_42_at_its_dirql() {
    let (status, stop) = stop_of("spin-lock-in-isr");
    assert_eq!(status, STOPPED, "{stop}");
    assert!(stop.starts_with(&c4(0x42, u64::from(vhca_ntmodel::DEVICE_DIRQL))), "{stop}");
}

#[test]
fn paged_pool_read_in_the_drivers_dpc_is_0xd1_under_irql_checking() {
    let (status, stop) = stop_of("paged-pool-in-dpc");
    assert_eq!(status, STOPPED, "{stop}");
    assert!(stop.starts_with("*** STOP: 0x000000D1 (0x"), "{stop}");
    let params: Vec<&str> = stop["*** STOP: 0x000000D1 (".len()..].trim_end_matches(')').split(',').collect();
    assert_eq!(params[1..3], ["0x0000000000000002", "0x0000000000000000"], "at DISPATCH_LEVEL, a read: {stop}");
}

#[test]
fn a_dpc_level_spin_lock_at_passive_is_c4_40() {
    let (status, stop) = stop_of("dpc-level-lock-at-passive");
    assert_eq!(status, STOPPED, "{stop}");
    assert!(stop.starts_with("*** STOP: 0x000000C4 (0x0000000000000040,"), "{stop}");
}
