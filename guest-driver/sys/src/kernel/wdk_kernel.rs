//! The WDK shim: `vhca_ntapi::NtKernel` over the real kernel. Each method calls the Windows routine of the same
//! name (ntoskrnl.exe / HAL.dll exports, or the adapter's DMA_OPERATIONS table); objects Windows expects the
//! caller to allocate (FAST_MUTEX, KMUTEX, ERESOURCE, spin locks) come from non-paged pool here and are freed when
//! the shim is dropped, after the driver core is closed. Every call runs at the caller's IRQL, holding whatever
//! lock the caller holds, unless its comment says it raises. The asynchronous half (`NtAsyncKernel`: interrupts,
//! DPCs, work items, timers, events) is wdk_async_kernel.rs, its objects kept in the same table.

use alloc::boxed::Box;
use alloc::vec::Vec;
use core::ffi::c_void;
use core::sync::atomic::{AtomicU32, Ordering};

use vhca_ntapi::*;
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, ERESOURCE, FAST_MUTEX, KMUTANT, MDL};
use windows_sys::Wdk::System::SystemServices as wdk;
use windows_sys::Win32::System::Kernel::SynchronizationEvent;

use super::dma_operations as dma;
use super::irql;
use super::kernel_imports::{KeAcquireSpinLockRaiseToDpc, KeReleaseSpinLock};
use super::spin_locked::SpinLocked;
use super::wdk_async_kernel::{release, AsyncObject};

extern "C" {
    /// c/probe.c: MmProbeAndLockPages inside __try; 0 or the code of the exception it raised.
    fn vhca_probe_and_lock_pages(mdl: *mut MDL, access_mode: i8, operation: i32) -> i32;
}

// What c/probe.c calls, bound from ntoskrnl.exe here (the C unit names __imp_ symbols, which only these raw-dylib
// declarations provide): MmProbeAndLockPages, and __C_specific_handler, the language handler its unwind info
// names, imported as a WDK-built driver imports it. Neither is called from Rust.
#[allow(dead_code)]
#[link(name = "ntoskrnl.exe", kind = "raw-dylib", modifiers = "+verbatim")]
extern "system" {
    fn MmProbeAndLockPages(mdl: *mut MDL, access_mode: i8, operation: i32);
    fn __C_specific_handler(record: *mut c_void, frame: usize, context: *mut c_void, dispatcher: *mut c_void) -> i32;
}

/// A kernel object the shim allocated for the caller; boxed so its address never moves. Held, not read: the box
/// keeps the object alive until the shim is dropped.
#[allow(dead_code)]
pub(super) enum Owned {
    FastMutex(Box<FAST_MUTEX>),
    Mutex(Box<KMUTANT>),
    Resource(Box<ERESOURCE>),
    SpinLock(Box<usize>),
    CommonFromMdl(Box<dma::MdlCommonBuffer>, PDMA_ADAPTER),
    /// The asynchronous objects (wdk_async_kernel.rs).
    Async(AsyncObject),
}

// SAFETY: kernel dispatcher objects and locks exist to be used from any thread; the raw pointers inside the WDK
// structures are the kernel's own links, and the shim touches the boxes only under its spin lock or at drop.
unsafe impl Send for Owned {}

/// The NT kernel as vhca-driver-core sees it, over ntoskrnl.exe and HAL.dll.
pub struct WdkKernel {
    owned: SpinLocked<Vec<Owned>>,
    /// How many resources the kernel refused this driver (NULL allocations, STATUS_INSUFFICIENT_RESOURCES): what
    /// tells the scenario host a failure is the error path of a shortage (scenario_run.rs, error_path).
    refused: AtomicU32,
}

fn zeroed_box<T>() -> Box<T> {
    // SAFETY: the WDK objects boxed here are plain C structures for which all-zero is a valid (uninitialised)
    // state; each is initialised by its Windows routine before use.
    Box::new(unsafe { core::mem::zeroed::<T>() })
}

impl WdkKernel {
    /// How many resources the kernel refused so far.
    pub fn refusals(&self) -> u32 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Counts a refusal when `refused`, and passes `value` through.
    pub(super) fn noting<T>(&self, value: T, refused: bool) -> T {
        if refused {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        value
    }

    pub fn new() -> WdkKernel {
        WdkKernel { owned: SpinLocked::new(Vec::new()), refused: AtomicU32::new(0) }
    }

    pub(super) fn keep(&self, object: Owned) {
        self.owned.with(|owned| owned.push(object));
    }

    /// Takes the first kept object `pick` chooses out of the table (the caller frees it).
    pub(super) fn forget(&self, pick: impl Fn(&Owned) -> bool) -> Option<Owned> {
        self.owned.with(|owned| owned.iter().position(pick).map(|i| owned.swap_remove(i)))
    }
}

impl Drop for WdkKernel {
    /// PASSIVE_LEVEL, at remove or stop, after the core closed: no lock the shim made is held any more.
    fn drop(&mut self) {
        let owned = self.owned.with(core::mem::take);
        // The driver disconnected, cancelled and flushed what it used (wdk_async_kernel.rs says why the shim does
        // not do it for the driver).
        release(&owned);
        for object in owned {
            match object {
                Owned::Resource(mut r) => {
                    // SAFETY: initialised by ExInitializeResourceLite, no longer held by anyone.
                    unsafe { wdk::ExDeleteResourceLite(&mut *r) };
                }
                Owned::CommonFromMdl(buffer, adapter) => {
                    // An IoMapCommonBuffer the caller never unmapped: give it back before the adapter goes.
                    // SAFETY: made by create_common_buffer_from_mdl on this adapter.
                    unsafe { free_mdl_common(adapter, &buffer) };
                }
                Owned::FastMutex(_) | Owned::Mutex(_) | Owned::SpinLock(_) | Owned::Async(_) => {}
            }
        }
    }
}

/// # Safety
/// `buffer` was made by create_common_buffer_from_mdl on `adapter`, freed once.
unsafe fn free_mdl_common(adapter: PDMA_ADAPTER, buffer: &dma::MdlCommonBuffer) {
    // SAFETY: the caller's contract; FreeCommonBuffer releases what CreateCommonBufferFromMdl made.
    unsafe { dma::free_common_buffer(adapter, buffer.length, buffer.logical, buffer.va, buffer.cache_enabled) }
}

/// The POOL_FLAGS of the pool the caller named, executable or not as it asked: NonPagedPool is executable
/// (NonPagedPoolExecute), NonPagedPoolNx is not. Mapping every non-paged type to NX pool hid an executable request
/// from Windows and from Code integrity checks (docs/verifier.md): the caller's choice is the caller's to fix.
fn pool_flags(pool_type: POOL_TYPE) -> u64 {
    match pool_type {
        POOL_TYPE::PagedPool => POOL_FLAG_PAGED,
        POOL_TYPE::NonPagedPool => POOL_FLAG_NON_PAGED_EXECUTE,
        POOL_TYPE::NonPagedPoolNx => POOL_FLAG_NON_PAGED,
    }
}

impl NtKernel for WdkKernel {
    // wdm.h's x64 inline forms (irql.rs): CR8, no import.
    fn KeGetCurrentIrql(&self) -> KIRQL {
        irql::current()
    }

    fn KeRaiseIrql(&self, new_irql: KIRQL) -> KIRQL {
        // SAFETY: the caller raises (new_irql >= current), as KeRaiseIrql requires.
        unsafe { irql::raise(new_irql) }
    }

    fn KeLowerIrql(&self, new_irql: KIRQL) {
        // SAFETY: the caller lowers to the IRQL it raised from.
        unsafe { irql::lower(new_irql) }
    }

    fn KeEnterCriticalRegion(&self) {
        // SAFETY: IRQL <= APC_LEVEL, the caller's.
        unsafe { wdk::KeEnterCriticalRegion() }
    }

    fn KeLeaveCriticalRegion(&self) {
        // SAFETY: pairs with KeEnterCriticalRegion.
        unsafe { wdk::KeLeaveCriticalRegion() }
    }

    fn ExInitializeFastMutex(&self) -> PFAST_MUTEX {
        // ExInitializeFastMutex is an inline function in wdm.h: Count = FM_LOCK_BIT (1), no owner, no contention,
        // and a synchronization event, not signalled. Done here on windows-sys's FAST_MUTEX.
        let mut m = zeroed_box::<FAST_MUTEX>();
        m.Count = 1;
        // SAFETY: the event is inside the boxed mutex, in non-paged pool; any IRQL <= DISPATCH_LEVEL.
        unsafe { wdk::KeInitializeEvent(&mut m.Event, SynchronizationEvent, false) };
        let p = PFAST_MUTEX(&*m as *const FAST_MUTEX as u64);
        self.keep(Owned::FastMutex(m));
        p
    }

    fn ExAcquireFastMutex(&self, mutex: PFAST_MUTEX) {
        // SAFETY: IRQL <= APC_LEVEL (the caller's); the mutex was made by ExInitializeFastMutex above.
        unsafe { wdk::ExAcquireFastMutex(mutex.0 as *mut FAST_MUTEX) }
    }

    fn ExReleaseFastMutex(&self, mutex: PFAST_MUTEX) {
        // SAFETY: APC_LEVEL, held by this thread.
        unsafe { wdk::ExReleaseFastMutex(mutex.0 as *mut FAST_MUTEX) }
    }

    fn KeInitializeGuardedMutex(&self) -> PKGUARDED_MUTEX {
        let mut m = zeroed_box::<FAST_MUTEX>();
        // SAFETY: KGUARDED_MUTEX is FAST_MUTEX in current WDKs (windows-sys declares it so); IRQL <= DISPATCH.
        unsafe { wdk::KeInitializeGuardedMutex(&mut *m) };
        let p = PKGUARDED_MUTEX(&*m as *const FAST_MUTEX as u64);
        self.keep(Owned::FastMutex(m));
        p
    }

    fn KeAcquireGuardedMutex(&self, mutex: PKGUARDED_MUTEX) {
        // SAFETY: IRQL <= APC_LEVEL; initialised above.
        unsafe { wdk::KeAcquireGuardedMutex(mutex.0 as *mut FAST_MUTEX) }
    }

    fn KeReleaseGuardedMutex(&self, mutex: PKGUARDED_MUTEX) {
        // SAFETY: held by this thread.
        unsafe { wdk::KeReleaseGuardedMutex(mutex.0 as *mut FAST_MUTEX) }
    }

    fn KeInitializeMutex(&self, level: u32) -> PKMUTEX {
        let mut m = zeroed_box::<KMUTANT>();
        // SAFETY: non-paged storage, PASSIVE_LEVEL.
        unsafe { wdk::KeInitializeMutex(&mut *m, level) };
        let p = PKMUTEX(&*m as *const KMUTANT as u64);
        self.keep(Owned::Mutex(m));
        p
    }

    fn KeWaitForMutexObject(&self, mutex: PKMUTEX) -> NTSTATUS {
        // SAFETY: IRQL <= APC_LEVEL with no timeout, as KeWaitForSingleObject requires for an infinite wait.
        NTSTATUS(unsafe {
            wdk::KeWaitForSingleObject(
                mutex.0 as *const c_void,
                wdk::Executive,
                wdk::KernelMode as i8,
                false,
                core::ptr::null(),
            )
        })
    }

    fn KeReleaseMutex(&self, mutex: PKMUTEX, wait: bool) -> i32 {
        // SAFETY: IRQL <= DISPATCH_LEVEL, owned by this thread.
        unsafe { wdk::KeReleaseMutex(mutex.0 as *mut KMUTANT, wait) }
    }

    fn ExInitializeResourceLite(&self) -> PERESOURCE {
        let mut r = zeroed_box::<ERESOURCE>();
        // SAFETY: non-paged storage (ERESOURCE must not be paged), PASSIVE_LEVEL.
        let status = unsafe { wdk::ExInitializeResourceLite(&mut *r) };
        if status < 0 {
            return PERESOURCE::NULL;
        }
        let p = PERESOURCE(&*r as *const ERESOURCE as u64);
        self.keep(Owned::Resource(r));
        p
    }

    fn ExAcquireResourceExclusiveLite(&self, resource: PERESOURCE, wait: bool) -> bool {
        // SAFETY: IRQL <= APC_LEVEL inside a critical region (the caller's, see ClMutex).
        unsafe { wdk::ExAcquireResourceExclusiveLite(resource.0 as *mut ERESOURCE, wait) }
    }

    fn ExAcquireResourceSharedLite(&self, resource: PERESOURCE, wait: bool) -> bool {
        // SAFETY: as above.
        unsafe { wdk::ExAcquireResourceSharedLite(resource.0 as *mut ERESOURCE, wait) }
    }

    fn ExReleaseResourceLite(&self, resource: PERESOURCE) {
        // SAFETY: held by this thread.
        unsafe { wdk::ExReleaseResourceLite(resource.0 as *mut ERESOURCE) }
    }

    fn ExDeleteResourceLite(&self, resource: PERESOURCE) -> NTSTATUS {
        // Deleted once, here or at drop: the shim forgets it first.
        let target = resource.0 as *const ERESOURCE;
        let removed = self.owned.with(|owned| {
            let at = owned.iter().position(|o| matches!(o, Owned::Resource(r) if core::ptr::eq(&**r, target)));
            at.map(|i| owned.swap_remove(i))
        });
        match removed {
            Some(Owned::Resource(mut r)) => {
                // SAFETY: initialised, not held (the caller's contract), PASSIVE_LEVEL.
                NTSTATUS(unsafe { wdk::ExDeleteResourceLite(&mut *r) })
            }
            _ => STATUS_INVALID_PARAMETER,
        }
    }

    fn KeInitializeSpinLock(&self) -> PKSPIN_LOCK {
        // KeInitializeSpinLock is `*SpinLock = 0` inline on x64.
        let lock = Box::new(0usize);
        let p = PKSPIN_LOCK(&*lock as *const usize as u64);
        self.keep(Owned::SpinLock(lock));
        p
    }

    fn KeAcquireSpinLock(&self, lock: PKSPIN_LOCK) -> KIRQL {
        // SAFETY: IRQL <= DISPATCH_LEVEL; raises to DISPATCH_LEVEL (KeAcquireSpinLock on x64 is this export).
        unsafe { KeAcquireSpinLockRaiseToDpc(lock.0 as *mut usize) }
    }

    fn KeReleaseSpinLock(&self, lock: PKSPIN_LOCK, new_irql: KIRQL) {
        // SAFETY: DISPATCH_LEVEL, held by this processor.
        unsafe { KeReleaseSpinLock(lock.0 as *mut usize, new_irql) }
    }

    fn ExAllocatePoolWithTag(&self, pool_type: POOL_TYPE, number_of_bytes: usize, tag: u32) -> PVOID {
        // ExAllocatePool2 is what Microsoft asks new code to call (ExAllocatePoolWithTag is deprecated since
        // Windows 10 2004); it zeroes the block, which the older routine did not.
        // SAFETY: paged pool at IRQL <= APC_LEVEL, non-paged at <= DISPATCH_LEVEL: the caller's IRQL.
        let p = PVOID(unsafe { wdk::ExAllocatePool2(pool_flags(pool_type), number_of_bytes, tag) } as u64);
        self.noting(p, p.is_null())
    }

    fn ExFreePoolWithTag(&self, p: PVOID, tag: u32) {
        // SAFETY: `p` came from ExAllocatePoolWithTag above with this tag.
        unsafe { wdk::ExFreePoolWithTag(p.0 as *mut c_void, tag) }
    }

    fn RtlCopyFromVa(&self, destination: &mut [u8], source: PVOID) {
        // RtlCopyMemory is memcpy.
        // SAFETY: the caller names a resident kernel VA of at least destination.len() bytes.
        unsafe { core::ptr::copy_nonoverlapping(source.0 as *const u8, destination.as_mut_ptr(), destination.len()) }
    }

    fn RtlCopyToVa(&self, destination: PVOID, source: &[u8]) {
        // SAFETY: as above, for writes.
        unsafe { core::ptr::copy_nonoverlapping(source.as_ptr(), destination.0 as *mut u8, source.len()) }
    }

    fn IoAllocateMdl(&self, virtual_address: PVOID, length: u32, secondary_buffer: bool, charge_quota: bool) -> PMDL {
        // SAFETY: IRQL <= DISPATCH_LEVEL; no IRP to chain to.
        let mdl = unsafe {
            wdk::IoAllocateMdl(
                virtual_address.0 as *const c_void,
                length,
                secondary_buffer,
                charge_quota,
                core::ptr::null_mut(),
            )
        };
        self.noting(PMDL(mdl as u64), mdl.is_null())
    }

    fn IoFreeMdl(&self, mdl: PMDL) {
        // SAFETY: an MDL from IoAllocateMdl, unlocked.
        unsafe { wdk::IoFreeMdl(mdl.0 as *mut MDL) }
    }

    fn MmBuildMdlForNonPagedPool(&self, mdl: PMDL) {
        // SAFETY: the MDL describes non-paged memory (the caller's contract).
        unsafe { wdk::MmBuildMdlForNonPagedPool(mdl.0 as *mut MDL) }
    }

    fn MmProbeAndLockPages(&self, mdl: PMDL, access_mode: KPROCESSOR_MODE, operation: LOCK_OPERATION) -> NTSTATUS {
        // Windows raises an exception when the pages cannot be locked; Rust has no __try, so the call is made in
        // C (c/probe.c), whose __except returns the exception's code (docs/windows.md). The simulation's
        // STATUS_INSUFFICIENT_RESOURCES counts as a refused resource, as a NULL from an allocation does.
        // SAFETY: IRQL <= APC_LEVEL for pageable memory, the caller's; the wrapper only calls MmProbeAndLockPages.
        let status =
            NTSTATUS(unsafe { vhca_probe_and_lock_pages(mdl.0 as *mut MDL, access_mode as i8, operation as i32) });
        self.noting(status, status == STATUS_INSUFFICIENT_RESOURCES)
    }

    fn MmUnlockPages(&self, mdl: PMDL) {
        // SAFETY: locked by MmProbeAndLockPages.
        unsafe { wdk::MmUnlockPages(mdl.0 as *mut MDL) }
    }

    fn MmGetMdlVirtualAddress(&self, mdl: PMDL) -> PVOID {
        // A wdm.h macro: StartVa + ByteOffset.
        // SAFETY: a live MDL.
        let m = unsafe { &*(mdl.0 as *const MDL) };
        PVOID(m.StartVa as u64 + m.ByteOffset as u64)
    }

    fn MmGetMdlByteCount(&self, mdl: PMDL) -> u32 {
        // SAFETY: a live MDL.
        unsafe { (*(mdl.0 as *const MDL)).ByteCount }
    }

    fn MmAllocateContiguousMemorySpecifyCache(
        &self,
        number_of_bytes: usize,
        lowest_acceptable_address: PHYSICAL_ADDRESS,
        highest_acceptable_address: PHYSICAL_ADDRESS,
        boundary_address_multiple: PHYSICAL_ADDRESS,
        cache_type: MEMORY_CACHING_TYPE,
    ) -> PVOID {
        // SAFETY: IRQL <= DISPATCH_LEVEL.
        let va = PVOID(unsafe {
            wdk::MmAllocateContiguousMemorySpecifyCache(
                number_of_bytes,
                lowest_acceptable_address.0 as i64,
                highest_acceptable_address.0 as i64,
                boundary_address_multiple.0 as i64,
                cache_type as i32,
            )
        } as u64);
        self.noting(va, va.is_null())
    }

    fn MmFreeContiguousMemory(&self, base_address: PVOID) {
        // SAFETY: from MmAllocateContiguousMemorySpecifyCache, IRQL < DISPATCH_LEVEL.
        unsafe { wdk::MmFreeContiguousMemory(base_address.0 as *const c_void) }
    }

    fn MmGetPhysicalAddress(&self, base_address: PVOID) -> PHYSICAL_ADDRESS {
        // SAFETY: any IRQL; it only reads the page tables for the address, which the caller holds resident.
        PHYSICAL_ADDRESS(unsafe { wdk::MmGetPhysicalAddress(base_address.0 as *const c_void) } as u64)
    }

    fn IoGetDmaAdapter(
        &self,
        physical_device_object: PDEVICE_OBJECT,
        device_description: &DEVICE_DESCRIPTION,
        number_of_map_registers: &mut u32,
    ) -> PDMA_ADAPTER {
        // Version 3: 64-bit addressing is DmaAddressWidth, and the table carries the v3 routines
        // (CreateCommonBufferFromMdl) that IoMapCommonBuffer uses.
        let d = wdk::DEVICE_DESCRIPTION {
            Version: wdk::DEVICE_DESCRIPTION_VERSION3,
            Master: device_description.Master,
            ScatterGather: device_description.ScatterGather,
            Dma32BitAddresses: device_description.Dma32BitAddresses,
            Dma64BitAddresses: device_description.Dma64BitAddresses,
            InterfaceType: wdk::PCIBus,
            MaximumLength: device_description.MaximumLength,
            DmaAddressWidth: if device_description.Dma64BitAddresses { 64 } else { 32 },
            ..Default::default()
        };
        // SAFETY: PASSIVE_LEVEL; the PDO is the one AddDevice received.
        let adapter = unsafe {
            wdk::IoGetDmaAdapter(physical_device_object.0 as *const DEVICE_OBJECT, &d, number_of_map_registers)
        };
        PDMA_ADAPTER(adapter as u64)
    }

    fn PutDmaAdapter(&self, adapter: PDMA_ADAPTER) {
        // MDL common buffers made on this adapter go first: the table is gone after PutDmaAdapter.
        let stale = self.owned.with(|owned| {
            let (mine, rest): (Vec<Owned>, Vec<Owned>) =
                owned.drain(..).partition(|o| matches!(o, Owned::CommonFromMdl(_, a) if *a == adapter));
            *owned = rest;
            mine
        });
        for object in stale {
            if let Owned::CommonFromMdl(buffer, a) = object {
                // SAFETY: made on this adapter, not yet freed.
                unsafe { free_mdl_common(a, &buffer) };
            }
        }
        // SAFETY: PASSIVE_LEVEL, the adapter from IoGetDmaAdapter.
        unsafe { dma::put_dma_adapter(adapter) }
    }

    fn AllocateCommonBuffer(
        &self,
        adapter: PDMA_ADAPTER,
        length: u32,
        logical_address: &mut PHYSICAL_ADDRESS,
        cache_enabled: bool,
    ) -> PVOID {
        // SAFETY: PASSIVE_LEVEL (the caller's), live adapter.
        let va = unsafe { dma::allocate_common_buffer(adapter, length, logical_address, cache_enabled) };
        self.noting(va, va.is_null())
    }

    fn FreeCommonBuffer(
        &self,
        adapter: PDMA_ADAPTER,
        length: u32,
        logical_address: PHYSICAL_ADDRESS,
        virtual_address: PVOID,
        cache_enabled: bool,
    ) {
        // SAFETY: the buffer came from AllocateCommonBuffer with these values.
        unsafe { dma::free_common_buffer(adapter, length, logical_address, virtual_address, cache_enabled) }
    }

    fn GetScatterGatherList(
        &self,
        adapter: PDMA_ADAPTER,
        device_object: PDEVICE_OBJECT,
        mdl: PMDL,
        current_va: PVOID,
        length: u32,
        execution_routine: PDRIVER_LIST_CONTROL,
        write_to_device: bool,
    ) -> NTSTATUS {
        // SAFETY: DISPATCH_LEVEL (the core raises; Microsoft's rule), live objects from the core.
        let status = unsafe {
            dma::get_scatter_gather_list(
                adapter,
                device_object,
                mdl,
                current_va,
                length,
                execution_routine,
                write_to_device,
            )
        };
        self.noting(status, status == STATUS_INSUFFICIENT_RESOURCES)
    }

    fn PutScatterGatherList(&self, adapter: PDMA_ADAPTER, list: PSCATTER_GATHER_LIST, write_to_device: bool) {
        // SAFETY: DISPATCH_LEVEL; the list's Handle as AdapterListControl received it.
        unsafe { dma::put_scatter_gather_list(adapter, list, write_to_device) }
    }

    fn AllocateAdapterChannel(
        &self,
        adapter: PDMA_ADAPTER,
        device_object: PDEVICE_OBJECT,
        number_of_map_registers: u32,
        execution_routine: PDRIVER_CONTROL,
    ) -> NTSTATUS {
        // SAFETY: DISPATCH_LEVEL (AllocateAdapterChannel's IRQL, the core's), live objects.
        unsafe { dma::allocate_adapter_channel(adapter, device_object, number_of_map_registers, execution_routine) }
    }

    fn FreeAdapterChannel(&self, adapter: PDMA_ADAPTER) {
        // SAFETY: DISPATCH_LEVEL (the caller's); the channel is held.
        unsafe { dma::free_adapter_channel(adapter) }
    }

    fn MapTransfer(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        map_register_base: MAP_REGISTER_BASE,
        current_va: PVOID,
        length: &mut u32,
        write_to_device: bool,
    ) -> Result<PHYSICAL_ADDRESS, NTSTATUS> {
        // SAFETY: IRQL <= DISPATCH_LEVEL; the base was granted by AllocateAdapterChannel.
        unsafe { dma::map_transfer(adapter, mdl, map_register_base, current_va, length, write_to_device) }
    }

    fn FlushAdapterBuffers(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        map_register_base: MAP_REGISTER_BASE,
        current_va: PVOID,
        length: u32,
        write_to_device: bool,
    ) -> bool {
        // SAFETY: as MapTransfer.
        unsafe { dma::flush_adapter_buffers(adapter, mdl, map_register_base, current_va, length, write_to_device) }
    }

    fn FreeMapRegisters(&self, adapter: PDMA_ADAPTER, map_register_base: MAP_REGISTER_BASE, number: u32) {
        // SAFETY: DISPATCH_LEVEL (the caller's); the registers were kept (DeallocateObjectKeepRegisters).
        unsafe { dma::free_map_registers(adapter, map_register_base, number) }
    }

    fn IoMapCommonBuffer(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        length: u32,
        cache_enabled: bool,
    ) -> Result<(HANDLE, SCATTER_GATHER_LIST), NTSTATUS> {
        let va = self.MmGetMdlVirtualAddress(mdl);
        // SAFETY: PASSIVE_LEVEL; the MDL is locked (the caller's contract, as for the model's extension).
        let buffer = Box::new(unsafe { dma::create_common_buffer_from_mdl(adapter, mdl, va, length, cache_enabled) }?);
        let handle = HANDLE(&*buffer as *const dma::MdlCommonBuffer as u64);
        let list = SCATTER_GATHER_LIST {
            Handle: PSCATTER_GATHER_LIST::NULL,
            Elements: alloc::vec![SCATTER_GATHER_ELEMENT { Address: buffer.logical, Length: length }],
        };
        self.keep(Owned::CommonFromMdl(buffer, adapter));
        Ok((handle, list))
    }

    fn IoUnmapCommonBuffer(&self, adapter: PDMA_ADAPTER, common_buffer: HANDLE) {
        let target = common_buffer.0 as *const dma::MdlCommonBuffer;
        let removed = self.owned.with(|owned| {
            let at = owned.iter().position(|o| matches!(o, Owned::CommonFromMdl(b, _) if core::ptr::eq(&**b, target)));
            at.map(|i| owned.swap_remove(i))
        });
        if let Some(Owned::CommonFromMdl(buffer, _)) = removed {
            // SAFETY: made on this adapter by IoMapCommonBuffer, freed once (just removed from the table).
            unsafe { free_mdl_common(adapter, &buffer) };
        }
    }

    fn KeBugCheckEx(&self, code: u32, p1: u64, p2: u64, p3: u64, p4: u64) -> ! {
        // SAFETY: any IRQL; does not return.
        unsafe { wdk::KeBugCheckEx(code, p1 as usize, p2 as usize, p3 as usize, p4 as usize) };
        #[allow(clippy::empty_loop)]
        loop {}
    }
}
