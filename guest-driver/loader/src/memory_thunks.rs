//! Pool, physically contiguous memory and MDLs for a driver binary: the NT model allocates and checks (pool
//! tracking, IRQL, the verifier's MDL rules) and the driver gets process addresses of the same pages
//! (`address_space`). MDLs are Windows-layout MDLs (windows-sys's MDL plus its PFN array) the driver may read
//! directly, as wdm.h's MmGetMdlVirtualAddress and MmGetMdlByteCount do, each tied to the model's MDL (`mdl_table`).
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement, as the driver imports them.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ffi::c_void;

use vhca_ntapi::{
    NtKernel, MDL_SOURCE_IS_NONPAGED_POOL, MEMORY_CACHING_TYPE, PAGE_SIZE, PHYSICAL_ADDRESS, PMDL,
    POOL_FLAG_RAISE_ON_FAILURE, SPECIAL_POOL_DETECTED_MEMORY_CORRUPTION,
};
use vhca_ntmodel::PoolRequest;
use windows_sys::Wdk::Foundation::MDL;

use crate::driver_stack::{at_driver_site, site_entry};
use crate::kernel_context::kernel;

// The routines the low-resources simulation can fail enter through a stub that finds the driver's call site first.
site_entry!(ExAllocatePool2_entry => ExAllocatePool2);
site_entry!(MmAllocateContiguousMemorySpecifyCache_entry => MmAllocateContiguousMemorySpecifyCache);
site_entry!(IoAllocateMdl_entry => IoAllocateMdl);
// MmProbeAndLockPages raises its failure into the driver: its stub keeps the driver's registers for the dispatch.
crate::seh::raise::raising_entry!(MmProbeAndLockPages_entry => MmProbeAndLockPages);

// The pool routines' import addresses: each puts its return address, the driver's code that called it, into the
// fourth argument register (both routines take three) before the call-site stub, so the thunk can name it as Code
// integrity checks' P2.
crate::register_saving::return_address_in_r9!(ExAllocatePool2_import => ExAllocatePool2_entry);
crate::register_saving::return_address_in_r9!(ExAllocatePoolWithTag_import => ExAllocatePoolWithTag_entry);
site_entry!(ExAllocatePoolWithTag_entry => ExAllocatePoolWithTag);

/// What an exception ExAllocatePool2 raises under POOL_FLAG_RAISE_ON_FAILURE carries: Microsoft names no status;
/// the model assumes STATUS_INSUFFICIENT_RESOURCES, what a failed allocation reports everywhere else.
const STATUS_INSUFFICIENT_RESOURCES: u32 = 0xC000_009A;

/// ExAllocatePool2(Flags, NumberOfBytes, Tag): the model's pool (zeroed pages), at a process address. The flags go to
/// the model as they are (which pool, executable or not); what ExAllocatePool2's page says returns NULL ("Tag is set
/// to 0 or invalid POOL_FLAGS are specified") does, before the model sees the call.
unsafe extern "win64" fn ExAllocatePool2(flags: u64, bytes: usize, tag: u32, caller: u64) -> *mut c_void {
    let at = match PoolRequest::from_pool_flags(flags).filter(|_| tag != 0) {
        Some(request) => allocate(request, bytes, tag, caller),
        None => 0,
    };
    if at == 0 && flags & POOL_FLAG_RAISE_ON_FAILURE != 0 {
        // Raised into a driver without a handler (vhca.sys is Rust: no __try), as MmProbeAndLockPages' is.
        crate::kernel_context::bugcheck(
            crate::driver_fault::SYSTEM_THREAD_EXCEPTION_NOT_HANDLED,
            u64::from(STATUS_INSUFFICIENT_RESOURCES),
            0,
            0,
            0,
        );
    }
    at as *mut c_void
}

/// ExAllocatePoolWithTag(PoolType, NumberOfBytes, Tag), the routine ExAllocatePool2 replaced (a driver built for
/// Windows before 10 version 2004 imports it): any POOL_TYPE value, by its bits (`PoolRequest::from_pool_type`).
unsafe extern "win64" fn ExAllocatePoolWithTag(pool_type: u32, bytes: usize, tag: u32, caller: u64) -> *mut c_void {
    allocate(PoolRequest::from_pool_type(pool_type), bytes, tag, caller) as *mut c_void
}

/// One pool block for the driver, at its process address (0 when refused). The pages are the backend's as the
/// model keeps them, read/write and never executable whatever the pool (docs/loader.md, "Pool"); paged ones join
/// Force IRQL checking's trim. Under Special Pool the block's guard page is made inaccessible here, so the
/// driver's own overrun (or underrun, Verify Start) faults at its first byte past the block.
fn allocate(request: PoolRequest, bytes: usize, tag: u32, caller: u64) -> usize {
    let k = kernel();
    let va = at_driver_site(|| k.model.allocate_pool(request, bytes, tag, caller));
    let at = k.addresses.to_host(&k.model, va);
    let guard = k.model.special_pool_guard(va).map(|g| k.addresses.to_host(&k.model, g));
    if let Some(guard) = guard {
        k.addresses.special_pool.guard(guard);
    }
    if !request.paged {
        k.race_watch.insert(at, bytes, va.0, tag);
    }
    if request.paged {
        // Force IRQL checking trims whole pages: a special pool block's are its data pages (from the page it
        // starts in up to its guard page with Verify End; from its start with Verify Start), never the guard.
        let (first, bytes) = match guard {
            Some(guard) if guard > at => (at - at % PAGE_SIZE as usize, guard - (at - at % PAGE_SIZE as usize)),
            _ => (at, bytes),
        };
        k.pageable.insert(first, bytes);
    }
    at
}

unsafe extern "win64" fn ExFreePoolWithTag(p: *mut c_void, tag: u32) {
    let k = kernel();
    let va = k.addresses.to_model(p as usize);
    // A paged block is on the trim's books by its first page (a Verify End block does not start its page).
    let first = match k.model.special_pool_guard(va) {
        Some(_) => p as usize - p as usize % PAGE_SIZE as usize,
        None => p as usize,
    };
    k.pageable.remove(first);
    k.race_watch.remove(p as usize);
    // Special Pool's pattern first, so 0xC1 names the driver's addresses, not the model's.
    if let Some((corrupted, subcode)) = k.model.special_pool_corruption(va) {
        let at = k.addresses.to_host(&k.model, corrupted) as u64;
        crate::kernel_context::bugcheck(SPECIAL_POOL_DETECTED_MEMORY_CORRUPTION, p as u64, at, 0, subcode);
    }
    // The model checks the free (double free, a block it never gave out) and stops the machine as Windows does.
    k.model.ExFreePoolWithTag(va, tag);
    // Freed special pool: inaccessible at once, while the model still holds its pages.
    k.model.with_freed_special_pool(va, |view| k.addresses.special_pool.freed(view.host_base, view.bytes as usize));
    k.addresses.forget(p as usize);
}

/// MmIsVerifierEnabled(VerifierFlags): the verifier's flags, STATUS_SUCCESS when Driver Verifier is on and
/// STATUS_NOT_SUPPORTED when it is off (the model's reading of wdm.h's routine, which Microsoft documents only by
/// its prototype). vhca.sys asks it whether Special Pool is on, to give each Rust allocation its own pool block.
unsafe extern "win64" fn MmIsVerifierEnabled(flags: *mut u32) -> i32 {
    const STATUS_NOT_SUPPORTED: i32 = 0xC000_00BBu32 as i32;
    let verifier = kernel().model.verifier();
    if !flags.is_null() {
        // SAFETY: the driver's out parameter.
        unsafe { *flags = verifier.0 };
    }
    if verifier.enabled() {
        0
    } else {
        STATUS_NOT_SUPPORTED
    }
}

unsafe extern "win64" fn MmAllocateContiguousMemorySpecifyCache(
    bytes: usize,
    lowest: i64,
    highest: i64,
    boundary: i64,
    cache: i32,
) -> *mut c_void {
    let cache = match cache {
        0 => MEMORY_CACHING_TYPE::MmNonCached,
        2 => MEMORY_CACHING_TYPE::MmWriteCombined,
        _ => MEMORY_CACHING_TYPE::MmCached,
    };
    let k = kernel();
    let va = at_driver_site(|| {
        k.model.MmAllocateContiguousMemorySpecifyCache(
            bytes,
            PHYSICAL_ADDRESS(lowest as u64),
            PHYSICAL_ADDRESS(highest as u64),
            PHYSICAL_ADDRESS(boundary as u64),
            cache,
        )
    });
    k.addresses.to_host(&k.model, va) as *mut c_void
}

unsafe extern "win64" fn MmFreeContiguousMemory(base: *mut c_void) {
    let k = kernel();
    k.model.MmFreeContiguousMemory(k.addresses.to_model(base as usize));
    k.addresses.forget(base as usize);
}

/// IoAllocateMdl(VirtualAddress, Length, SecondaryBuffer, ChargeQuota, Irp): an MDL for `length` bytes at `va`,
/// its PFN array room for every page spanned, as Windows sizes it (MmSizeOfMdl).
unsafe extern "win64" fn IoAllocateMdl(
    va: *mut c_void,
    length: u32,
    secondary: u8,
    charge_quota: u8,
    _irp: *mut c_void,
) -> *mut MDL {
    let k = kernel();
    let model_va = k.addresses.to_model(va as usize);
    let model_mdl = at_driver_site(|| k.model.IoAllocateMdl(model_va, length, secondary != 0, charge_quota != 0));
    if model_mdl.is_null() {
        return std::ptr::null_mut();
    }
    let offset = va as usize % PAGE_SIZE as usize;
    let pages = (offset + length as usize).div_ceil(PAGE_SIZE as usize);
    let bytes = std::mem::size_of::<MDL>() + pages * 8;
    let layout = Layout::from_size_align(bytes, 16).expect("MDL layout");
    // SAFETY: a non-zero size.
    let mdl = unsafe { alloc_zeroed(layout) } as *mut MDL;
    if mdl.is_null() {
        k.model.IoFreeMdl(model_mdl);
        return mdl;
    }
    // SAFETY: a fresh zeroed block sized for the MDL and its PFN array.
    unsafe {
        (*mdl).Size = bytes as i16;
        (*mdl).StartVa = (va as usize - offset) as *mut c_void;
        (*mdl).ByteOffset = offset as u32;
        (*mdl).ByteCount = length;
    }
    k.mdls.insert(mdl, model_mdl, bytes);
    mdl
}

unsafe extern "win64" fn IoFreeMdl(mdl: *mut MDL) {
    let k = kernel();
    let Some((model_mdl, bytes)) = k.mdls.remove(mdl) else {
        // Not an MDL of this kernel: the model sees the address and says what Windows would.
        k.model.IoFreeMdl(PMDL(mdl as u64));
        return;
    };
    k.model.IoFreeMdl(model_mdl);
    // SAFETY: the block IoAllocateMdl made with this size, freed once (removed from the table above).
    unsafe { dealloc(mdl as *mut u8, Layout::from_size_align(bytes, 16).expect("MDL layout")) };
}

/// MmBuildMdlForNonPagedPool: the model checks and locks; the MDL says it is mapped and non-paged, its PFN array
/// holds the pages' frame numbers as this process sees them (a driver must not hand those to a device: it gets
/// device addresses from the DMA routines, as on Windows with DMA remapping).
unsafe extern "win64" fn MmBuildMdlForNonPagedPool(mdl: *mut MDL) {
    let k = kernel();
    k.model.MmBuildMdlForNonPagedPool(k.mdls.model_mdl(mdl));
    // SAFETY: the driver's MDL, sized by IoAllocateMdl for its pages.
    unsafe {
        let va = (*mdl).StartVa as usize + (*mdl).ByteOffset as usize;
        (*mdl).MappedSystemVa = va as *mut c_void;
        (*mdl).MdlFlags |= MDL_SOURCE_IS_NONPAGED_POOL as i16;
        fill_pfns(mdl);
    }
}

/// ZwAllocateVirtualMemory(ProcessHandle, BaseAddress, ZeroBits, RegionSize, AllocationType, Protect) in the
/// current process: the model's user-mode memory (pageable until MmProbeAndLockPages locks it), at a process
/// address. Only fresh allocations (BaseAddress NULL) are modelled, which is what a driver asks for.
unsafe extern "win64" fn ZwAllocateVirtualMemory(
    _process: *mut c_void,
    base: *mut *mut c_void,
    _zero_bits: usize,
    size: *mut usize,
    _allocation_type: u32,
    _protect: u32,
) -> i32 {
    const STATUS_INVALID_PARAMETER: i32 = 0xC000_000Du32 as i32;
    const STATUS_NO_MEMORY: i32 = 0xC000_0017u32 as i32;
    // SAFETY: the driver's in/out parameters.
    let (wanted, bytes) = unsafe {
        if base.is_null() || size.is_null() {
            return STATUS_INVALID_PARAMETER;
        }
        (*base, *size)
    };
    if !wanted.is_null() || bytes == 0 {
        return STATUS_INVALID_PARAMETER;
    }
    let k = kernel();
    let va = k.model.alloc_user_buffer(bytes as u64, 0);
    if va.is_null() {
        return STATUS_NO_MEMORY;
    }
    // SAFETY: as above; the region is whole pages.
    unsafe {
        *base = k.addresses.to_host(&k.model, va) as *mut c_void;
        *size = bytes.div_ceil(PAGE_SIZE as usize) * PAGE_SIZE as usize;
    }
    0
}

/// ZwFreeVirtualMemory(ProcessHandle, BaseAddress, RegionSize, FreeType): MEM_RELEASE of a whole allocation.
unsafe extern "win64" fn ZwFreeVirtualMemory(
    _process: *mut c_void,
    base: *mut *mut c_void,
    _size: *mut usize,
    _free_type: u32,
) -> i32 {
    if base.is_null() {
        return 0xC000_000Du32 as i32;
    }
    let k = kernel();
    // SAFETY: the driver's in parameter.
    let host = unsafe { *base } as usize;
    k.model.free_user_buffer(k.addresses.to_model(host));
    k.addresses.forget(host);
    0
}

/// MmProbeAndLockPages(Mdl, AccessMode, Operation). Windows raises an exception when the pages cannot be locked:
/// the status returned here is raised by the entry stub into the driver's frames (`seh`), where a __try/__except
/// takes it; with no handler it is 0x7E with the status, as an unhandled exception in a system thread is. On
/// success the MDL says its pages are locked, with their frame numbers, and nothing is raised (0).
unsafe extern "win64" fn MmProbeAndLockPages(mdl: *mut MDL, mode: i8, operation: i32) -> u32 {
    use vhca_ntapi::{KPROCESSOR_MODE, LOCK_OPERATION, MDL_PAGES_LOCKED};
    let mode = if mode == 0 { KPROCESSOR_MODE::KernelMode } else { KPROCESSOR_MODE::UserMode };
    let operation = match operation {
        0 => LOCK_OPERATION::IoReadAccess,
        1 => LOCK_OPERATION::IoWriteAccess,
        _ => LOCK_OPERATION::IoModifyAccess,
    };
    // A UserMode probe in a user process's context reaches only that process's memory (user_process.rs): the
    // model's own check refuses kernel memory, not another process's user memory.
    let k = kernel();
    let model_mdl = k.mdls.model_mdl(mdl);
    // Only an MDL the loader made is read here; the model answers for any other.
    if mode == KPROCESSOR_MODE::UserMode && model_mdl.0 != mdl as u64 {
        // SAFETY: the driver's MDL, as IoAllocateMdl made it (it is in the table).
        let (start, length) =
            unsafe { ((*mdl).StartVa as usize + (*mdl).ByteOffset as usize, (*mdl).ByteCount as usize) };
        if !crate::user_process::user_probe_allowed(start, length) {
            return vhca_ntapi::STATUS_ACCESS_VIOLATION.0 as u32;
        }
    }
    let status = at_driver_site(|| k.model.MmProbeAndLockPages(model_mdl, mode, operation));
    if status.0 < 0 {
        return status.0 as u32;
    }
    // SAFETY: the driver's MDL, sized by IoAllocateMdl for its pages.
    unsafe {
        (*mdl).MdlFlags |= MDL_PAGES_LOCKED as i16;
        fill_pfns(mdl);
    }
    0
}

unsafe extern "win64" fn MmUnlockPages(mdl: *mut MDL) {
    let k = kernel();
    k.model.MmUnlockPages(k.mdls.model_mdl(mdl));
    // SAFETY: the driver's MDL.
    unsafe { (*mdl).MdlFlags &= !(vhca_ntapi::MDL_PAGES_LOCKED as i16) };
}

/// The PFN array after the MDL: the pages' frame numbers as this process sees them.
///
/// # Safety
/// `mdl` is an MDL IoAllocateMdl made (room for every page it spans).
unsafe fn fill_pfns(mdl: *mut MDL) {
    // SAFETY: the caller's contract.
    unsafe {
        let pages = ((*mdl).ByteOffset as usize + (*mdl).ByteCount as usize).div_ceil(PAGE_SIZE as usize);
        let pfns = (mdl as *mut u8).add(std::mem::size_of::<MDL>()) as *mut u64;
        for i in 0..pages {
            *pfns.add(i) = ((*mdl).StartVa as u64 / PAGE_SIZE) + i as u64;
        }
    }
}

pub fn memory_thunks() -> [(&'static str, usize); 13] {
    [
        ("MmIsVerifierEnabled", MmIsVerifierEnabled as *const () as usize),
        ("ExAllocatePool2", ExAllocatePool2_import as *const () as usize),
        ("ExAllocatePoolWithTag", ExAllocatePoolWithTag_import as *const () as usize),
        ("ExFreePoolWithTag", ExFreePoolWithTag as *const () as usize),
        ("MmAllocateContiguousMemorySpecifyCache", MmAllocateContiguousMemorySpecifyCache_entry as *const () as usize),
        ("MmFreeContiguousMemory", MmFreeContiguousMemory as *const () as usize),
        ("IoAllocateMdl", IoAllocateMdl_entry as *const () as usize),
        ("IoFreeMdl", IoFreeMdl as *const () as usize),
        ("MmBuildMdlForNonPagedPool", MmBuildMdlForNonPagedPool as *const () as usize),
        ("ZwAllocateVirtualMemory", ZwAllocateVirtualMemory as *const () as usize),
        ("ZwFreeVirtualMemory", ZwFreeVirtualMemory as *const () as usize),
        ("MmProbeAndLockPages", MmProbeAndLockPages_entry as *const () as usize),
        ("MmUnlockPages", MmUnlockPages as *const () as usize),
    ]
}
