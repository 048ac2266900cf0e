//! Special Pool (0x1) on a driver binary's own stores, through the pool thunks: one byte past a block is 0xD6
//! naming the address, the write and the instruction; with Verify Start one byte before it too; a store into a freed
//! block 0xD5; a store into the pattern after a block's end, which faults on no page, 0xC1/0x24 at its free; none of
//! these without 0x1. A bugcheck stops the machine, so each case runs in a child process (this test binary again,
//! its ignored `child` test) whose bugcheck handler prints the STOP line and exits.

mod common;

use std::sync::Arc;

use common::{routine, NoBus, StopAndExit, STOPPED};
use vhca_loader::driver_symbols::DriverSymbols;
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, LoaderKernel};
use vhca_ntmodel::{BackendError, DmaBackend, HostMemId, NtModel, NtModelConfig, SpecialPoolAlignment, VerifierFlags};

const CASE: &str = "VHCA_LOADER_SPECIAL_POOL_CASE";
const TAG: u32 = u32::from_le_bytes(*b"Test");
/// POOL_FLAG_NON_PAGED.
const NON_PAGED: u64 = 0x40;
/// How much of `driver_store`'s code the fault handler counts as the driver's image.
const DRIVER_CODE: usize = 256;

/// One anonymous mapping per allocation, as the guest's VFIO backend gives memory: what lets the loader protect a
/// block's pages alone. Nothing here does DMA.
#[derive(Default)]
struct MappingsBackend {
    blocks: std::sync::Mutex<std::collections::HashMap<HostMemId, (usize, usize)>>,
    next: std::sync::Mutex<u64>,
}

impl DmaBackend for MappingsBackend {
    fn alloc(&self, pages: usize) -> Result<HostMemId, BackendError> {
        let bytes = pages.max(1) * 4096;
        // SAFETY: a fresh private anonymous mapping, unmapped in `free`.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if at == libc::MAP_FAILED {
            return Err(BackendError::OutOfMemory { pages });
        }
        let mut next = self.next.lock().unwrap();
        *next += 1;
        self.blocks.lock().unwrap().insert(HostMemId(*next), (at as usize, bytes));
        Ok(HostMemId(*next))
    }
    fn free(&self, mem: HostMemId) -> Result<(), BackendError> {
        let (at, bytes) = self.blocks.lock().unwrap().remove(&mem).ok_or(BackendError::UnknownMemory(mem))?;
        // SAFETY: the mapping `alloc` made, unmapped once.
        unsafe { libc::munmap(at as *mut libc::c_void, bytes) };
        Ok(())
    }
    fn read(&self, mem: HostMemId, offset: usize, buf: &mut [u8]) -> Result<(), BackendError> {
        let at = self.host_address(mem).ok_or(BackendError::UnknownMemory(mem))?;
        // SAFETY: inside the mapping (the model reads what it allocated, never its guard page).
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
        self.blocks.lock().unwrap().get(&mem).map(|(at, _)| *at as *mut u8)
    }
    fn revoke_device_access(&self, _mem: HostMemId) -> Result<(), BackendError> {
        Ok(())
    }
}

/// The "driver": one store, whose code the fault handler is told is the image.
#[inline(never)]
extern "win64" fn driver_store(at: *mut u8) {
    // SAFETY: whatever the case hands it: the store under test.
    unsafe { at.write_volatile(0x5A) };
}

fn run_case(case: &str) {
    let flags = if case == "no-special-pool" { VerifierFlags::POOL_TRACKING } else { VerifierFlags(0x1) };
    let config = NtModelConfig { verifier: flags, ..Default::default() };
    let model = Arc::new(NtModel::new(config, Arc::new(MappingsBackend::default()), Arc::new(StopAndExit)));
    if case == "underrun-verify-start" {
        model.set_special_pool_alignment(SpecialPoolAlignment::VerifyStart);
    }
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    vhca_loader::driver_fault::install(
        driver_store as *const () as usize,
        DRIVER_CODE,
        "test.sys",
        DriverSymbols::entry_only(0),
    );
    println!("driver 0x{:x}", driver_store as *const () as usize);
    let allocate: unsafe extern "win64" fn(u64, usize, u32) -> *mut u8 = routine("ExAllocatePool2");
    let free: unsafe extern "win64" fn(*mut u8, u32) = routine("ExFreePoolWithTag");
    // SAFETY (all calls below): the thunks as a driver calls them; each case's store is the misuse under test.
    unsafe {
        match case {
            "overrun" => {
                let block = allocate(NON_PAGED, 64, TAG);
                println!("block {:#x}", block as usize);
                driver_store(block.add(63));
                driver_store(block.add(64));
            }
            "underrun-verify-start" => {
                let block = allocate(NON_PAGED, 64, TAG);
                println!("block {:#x}", block as usize);
                driver_store(block);
                driver_store(block.sub(1));
            }
            "use-after-free" => {
                let block = allocate(NON_PAGED, 64, TAG);
                println!("block {:#x}", block as usize);
                driver_store(block);
                free(block, TAG);
                driver_store(block.add(8));
            }
            "pattern-at-free" => {
                // 13 bytes: the block starts 16 bytes before its guard page, three pattern bytes after its end.
                let block = allocate(NON_PAGED, 13, TAG);
                println!("block {:#x}", block as usize);
                driver_store(block.add(13));
                free(block, TAG);
            }
            "no-special-pool" => {
                let block = allocate(NON_PAGED, 64, TAG);
                driver_store(block.add(64));
                free(block, TAG);
                driver_store(block.add(8));
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

/// The hex number the child printed after `label` (0 when it printed none).
fn printed(stdout: &str, label: &str) -> u64 {
    let marker = format!("{label} 0x");
    stdout
        .lines()
        .find_map(|l| l.find(&marker).map(|at| &l[at + marker.len()..]))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0)
}

/// The child's exit status, its STOP line's code and parameters, the block it allocated and its whole output.
fn stop_of(case: &str) -> (i32, u32, Vec<u64>, u64, String) {
    let out = common::child_of_this_test(CASE, case).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let block = printed(&stdout, "block");
    let Some(stop) = stdout.lines().find_map(|l| l.find("*** STOP: 0x").map(|at| &l[at + "*** STOP: 0x".len()..]))
    else {
        return (out.status.code().unwrap_or(-1), 0, Vec::new(), block, stdout);
    };
    let code = u32::from_str_radix(&stop[..8], 16).unwrap();
    let params = stop[stop.find('(').unwrap() + 1..stop.find(')').unwrap()]
        .split(',')
        .map(|p| u64::from_str_radix(p.trim().trim_start_matches("0x"), 16).unwrap())
        .collect();
    (out.status.code().unwrap_or(-1), code, params, block, stdout)
}

/// Whether `rip` is in the child's `driver_store` (its address as the child printed it: another process).
fn in_driver_store(rip: u64, out: &str) -> bool {
    (rip.wrapping_sub(printed(out, "driver")) as usize) < DRIVER_CODE
}

#[test]
fn one_byte_stored_past_a_special_pool_block_is_0xd6_with_the_address_the_write_and_the_instruction() {
    let (status, code, params, block, out) = stop_of("overrun");
    assert_eq!((status, code), (STOPPED, 0xD6), "{out}");
    assert_eq!(params[..2], [block + 64, 1], "{out}");
    assert!(in_driver_store(params[2], &out), "P3 the driver's store: {out}");
    assert!(out.contains("special pool guard page") && out.contains("test.sys at RVA"), "{out}");
}

#[test]
fn with_verify_start_one_byte_stored_before_the_block_is_0xd6() {
    let (status, code, params, block, out) = stop_of("underrun-verify-start");
    assert_eq!((status, code), (STOPPED, 0xD6), "{out}");
    assert_eq!(block % 4096, 0, "the block starts its page: {out}");
    assert_eq!(params[..2], [block - 1, 1], "{out}");
}

#[test]
fn a_store_into_a_freed_special_pool_block_is_0xd5() {
    let (status, code, params, block, out) = stop_of("use-after-free");
    assert_eq!((status, code), (STOPPED, 0xD5), "{out}");
    assert_eq!(params[..2], [block + 8, 1], "{out}");
    assert!(in_driver_store(params[2], &out), "{out}");
}

#[test]
fn a_store_into_the_pattern_after_the_end_is_0xc1_0x24_at_the_free() {
    let (status, code, params, block, out) = stop_of("pattern-at-free");
    assert_eq!((status, code), (STOPPED, 0xC1), "{out}");
    assert_eq!(params[0], block, "P1 the address freed: {out}");
    assert_eq!(params[1], block + 13, "P2 the corrupted byte: {out}");
    assert_eq!(params[3], 0x24, "{out}");
}

#[test]
fn without_special_pool_the_same_stores_meet_no_check() {
    let (status, code, _, _, out) = stop_of("no-special-pool");
    assert_eq!((status, code), (0, 0), "{out}");
    assert!(out.contains("no bugcheck"), "{out}");
}
