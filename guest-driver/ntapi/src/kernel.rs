//! The kernel services the driver core calls, one method per Windows routine, with Windows' name and IRQL rule.
//! Each method's doc gives the IRQL Windows documents for it; an implementation may check it (the model does).

use crate::types::*;

/// The NT kernel as the driver sees it. Where Windows passes caller-allocated objects, the implementation allocates
/// them and hands back an opaque pointer. Where Windows calls a driver routine back (AdapterControl,
/// AdapterListControl) the routine is a boxed closure holding its context, called as Windows calls it: at
/// DISPATCH_LEVEL, possibly after the call that queued it has returned.
pub trait NtKernel: Send + Sync {
    // ---- IRQL and critical regions ----

    /// Any IRQL.
    fn KeGetCurrentIrql(&self) -> KIRQL;
    /// Raises to `new_irql` (>= current) and returns the old IRQL.
    fn KeRaiseIrql(&self, new_irql: KIRQL) -> KIRQL;
    /// Lowers to `new_irql` (<= current).
    fn KeLowerIrql(&self, new_irql: KIRQL);
    /// IRQL <= APC_LEVEL. Disables normal kernel APCs (needed around ERESOURCE use).
    fn KeEnterCriticalRegion(&self);
    /// IRQL <= APC_LEVEL.
    fn KeLeaveCriticalRegion(&self);

    // ---- FAST_MUTEX: acquire at IRQL <= APC_LEVEL, runs the owner at APC_LEVEL, release at APC_LEVEL ----

    fn ExInitializeFastMutex(&self) -> PFAST_MUTEX;
    fn ExAcquireFastMutex(&self, mutex: PFAST_MUTEX);
    fn ExReleaseFastMutex(&self, mutex: PFAST_MUTEX);

    // ---- Guarded mutex: IRQL <= APC_LEVEL; enters a guarded region, IRQL unchanged ----

    fn KeInitializeGuardedMutex(&self) -> PKGUARDED_MUTEX;
    fn KeAcquireGuardedMutex(&self, mutex: PKGUARDED_MUTEX);
    fn KeReleaseGuardedMutex(&self, mutex: PKGUARDED_MUTEX);

    // ---- KMUTEX: wait at IRQL <= APC_LEVEL (no timeout), recursive for the owner, IRQL unchanged ----

    fn KeInitializeMutex(&self, level: u32) -> PKMUTEX;
    /// KeWaitForSingleObject(mutex, Executive, KernelMode, FALSE, NULL).
    fn KeWaitForMutexObject(&self, mutex: PKMUTEX) -> NTSTATUS;
    /// IRQL <= DISPATCH_LEVEL. Returns the previous signal state.
    fn KeReleaseMutex(&self, mutex: PKMUTEX, wait: bool) -> i32;

    // ---- ERESOURCE: IRQL <= APC_LEVEL, inside a critical region ----

    fn ExInitializeResourceLite(&self) -> PERESOURCE;
    fn ExAcquireResourceExclusiveLite(&self, resource: PERESOURCE, wait: bool) -> bool;
    fn ExAcquireResourceSharedLite(&self, resource: PERESOURCE, wait: bool) -> bool;
    fn ExReleaseResourceLite(&self, resource: PERESOURCE);
    fn ExDeleteResourceLite(&self, resource: PERESOURCE) -> NTSTATUS;

    // ---- Spin lock: acquire at IRQL <= DISPATCH_LEVEL, runs the owner at DISPATCH_LEVEL ----

    fn KeInitializeSpinLock(&self) -> PKSPIN_LOCK;
    /// Returns the IRQL to give back to KeReleaseSpinLock.
    fn KeAcquireSpinLock(&self, lock: PKSPIN_LOCK) -> KIRQL;
    fn KeReleaseSpinLock(&self, lock: PKSPIN_LOCK, new_irql: KIRQL);

    // ---- Pool: paged at IRQL <= APC_LEVEL, non-paged at IRQL <= DISPATCH_LEVEL ----

    /// NULL when the pool cannot satisfy the request.
    fn ExAllocatePoolWithTag(&self, pool_type: POOL_TYPE, number_of_bytes: usize, tag: u32) -> PVOID;
    fn ExFreePoolWithTag(&self, p: PVOID, tag: u32);

    // ---- CPU access to memory (RtlCopyMemory on Windows; the model checks residency and IRQL) ----

    fn RtlCopyFromVa(&self, destination: &mut [u8], source: PVOID);
    fn RtlCopyToVa(&self, destination: PVOID, source: &[u8]);

    // ---- MDLs ----

    /// IRQL <= DISPATCH_LEVEL. NULL on failure.
    fn IoAllocateMdl(&self, virtual_address: PVOID, length: u32, secondary_buffer: bool, charge_quota: bool) -> PMDL;
    /// IRQL <= DISPATCH_LEVEL.
    fn IoFreeMdl(&self, mdl: PMDL);
    /// IRQL <= DISPATCH_LEVEL; the MDL must describe non-paged memory.
    fn MmBuildMdlForNonPagedPool(&self, mdl: PMDL);
    /// IRQL <= APC_LEVEL for pageable memory, <= DISPATCH_LEVEL for non-pageable. Windows raises an exception on
    /// failure; here it is the returned status.
    fn MmProbeAndLockPages(&self, mdl: PMDL, access_mode: KPROCESSOR_MODE, operation: LOCK_OPERATION) -> NTSTATUS;
    /// IRQL <= DISPATCH_LEVEL.
    fn MmUnlockPages(&self, mdl: PMDL);
    fn MmGetMdlVirtualAddress(&self, mdl: PMDL) -> PVOID;
    fn MmGetMdlByteCount(&self, mdl: PMDL) -> u32;

    // ---- Physically contiguous memory ----

    /// IRQL <= DISPATCH_LEVEL. NULL when no contiguous run that long is free.
    fn MmAllocateContiguousMemorySpecifyCache(
        &self,
        number_of_bytes: usize,
        lowest_acceptable_address: PHYSICAL_ADDRESS,
        highest_acceptable_address: PHYSICAL_ADDRESS,
        boundary_address_multiple: PHYSICAL_ADDRESS,
        cache_type: MEMORY_CACHING_TYPE,
    ) -> PVOID;
    /// IRQL < DISPATCH_LEVEL.
    fn MmFreeContiguousMemory(&self, base_address: PVOID);
    /// Any IRQL. The physical address behind a resident virtual address (0 for none). Not a device address: under
    /// DMA remapping only the adapter's logical addresses reach memory; only the physical-address-to-device bug
    /// scenario hands it to the device.
    fn MmGetPhysicalAddress(&self, base_address: PVOID) -> PHYSICAL_ADDRESS;

    // ---- DMA adapter (IoGetDmaAdapter and the DMA_OPERATIONS table) ----

    /// IRQL = PASSIVE_LEVEL. NULL on failure; sets `number_of_map_registers` to what the adapter grants.
    fn IoGetDmaAdapter(
        &self,
        physical_device_object: PDEVICE_OBJECT,
        device_description: &DEVICE_DESCRIPTION,
        number_of_map_registers: &mut u32,
    ) -> PDMA_ADAPTER;
    /// IRQL = PASSIVE_LEVEL.
    fn PutDmaAdapter(&self, adapter: PDMA_ADAPTER);
    /// IRQL = PASSIVE_LEVEL. NULL on failure; `logical_address` is what the device uses.
    fn AllocateCommonBuffer(
        &self,
        adapter: PDMA_ADAPTER,
        length: u32,
        logical_address: &mut PHYSICAL_ADDRESS,
        cache_enabled: bool,
    ) -> PVOID;
    /// IRQL = PASSIVE_LEVEL.
    fn FreeCommonBuffer(
        &self,
        adapter: PDMA_ADAPTER,
        length: u32,
        logical_address: PHYSICAL_ADDRESS,
        virtual_address: PVOID,
        cache_enabled: bool,
    );
    /// IRQL = DISPATCH_LEVEL. Builds the list for `length` bytes of `mdl` from `current_va` (using map registers
    /// only where the adapter needs them) and calls `execution_routine` (the driver's AdapterListControl) with it at
    /// DISPATCH_LEVEL: before this returns when the resources are there, later (when map registers free up) when
    /// not. STATUS_SUCCESS means the routine was called or will be; an error means it never will be
    /// (STATUS_INSUFFICIENT_RESOURCES: the list could not be allocated, or the transfer needs more map registers than
    /// IoGetDmaAdapter granted; STATUS_BUFFER_TOO_SMALL: the buffer is too small for the transfer).
    #[allow(clippy::too_many_arguments)]
    fn GetScatterGatherList(
        &self,
        adapter: PDMA_ADAPTER,
        device_object: PDEVICE_OBJECT,
        mdl: PMDL,
        current_va: PVOID,
        length: u32,
        execution_routine: PDRIVER_LIST_CONTROL,
        write_to_device: bool,
    ) -> NTSTATUS;
    /// IRQL = DISPATCH_LEVEL. Ends the mapping of a list AdapterListControl received (`list` is its `Handle`).
    fn PutScatterGatherList(&self, adapter: PDMA_ADAPTER, list: PSCATTER_GATHER_LIST, write_to_device: bool);
    /// IRQL = DISPATCH_LEVEL. Takes the adapter channel and `number_of_map_registers` map registers, then calls
    /// `execution_routine` (the driver's AdapterControl) at DISPATCH_LEVEL with the map-register base: at once
    /// when the channel and registers are free, else queued until they are. The routine's IO_ALLOCATION_ACTION
    /// says what stays held. STATUS_INSUFFICIENT_RESOURCES (routine never called) when `number_of_map_registers`
    /// exceeds what IoGetDmaAdapter granted.
    fn AllocateAdapterChannel(
        &self,
        adapter: PDMA_ADAPTER,
        device_object: PDEVICE_OBJECT,
        number_of_map_registers: u32,
        execution_routine: PDRIVER_CONTROL,
    ) -> NTSTATUS;
    /// IRQL = DISPATCH_LEVEL.
    fn FreeAdapterChannel(&self, adapter: PDMA_ADAPTER);
    /// IRQL <= DISPATCH_LEVEL. `length` comes back as the bytes mapped. Windows cannot fail here; the model fails
    /// cleanly (STATUS_INSUFFICIENT_RESOURCES) when the registers held do not cover the transfer.
    fn MapTransfer(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        map_register_base: MAP_REGISTER_BASE,
        current_va: PVOID,
        length: &mut u32,
        write_to_device: bool,
    ) -> Result<PHYSICAL_ADDRESS, NTSTATUS>;
    /// IRQL <= DISPATCH_LEVEL.
    fn FlushAdapterBuffers(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        map_register_base: MAP_REGISTER_BASE,
        current_va: PVOID,
        length: u32,
        write_to_device: bool,
    ) -> bool;
    /// IRQL = DISPATCH_LEVEL.
    fn FreeMapRegisters(
        &self,
        adapter: PDMA_ADAPTER,
        map_register_base: MAP_REGISTER_BASE,
        number_of_map_registers: u32,
    );

    // ---- Model extension: the API proposed on openib-windows (2006), never shipped by Windows ----

    /// IRQL <= DISPATCH_LEVEL. Makes a locked buffer (MDL locked by MmProbeAndLockPages, or built for non-paged
    /// pool) a common buffer: the device sees the real pages even where DMA checking double-buffers S/G lists.
    /// Kernels without it (Windows, the WDK shim) keep this default and answer STATUS_NOT_SUPPORTED.
    fn IoMapCommonBuffer(
        &self,
        _adapter: PDMA_ADAPTER,
        _mdl: PMDL,
        _length: u32,
        _cache_enabled: bool,
    ) -> Result<(HANDLE, SCATTER_GATHER_LIST), NTSTATUS> {
        Err(STATUS_NOT_SUPPORTED)
    }
    /// IRQL <= DISPATCH_LEVEL.
    fn IoUnmapCommonBuffer(&self, _adapter: PDMA_ADAPTER, _common_buffer: HANDLE) {}

    // ---- Stopping the machine ----

    fn KeBugCheckEx(&self, code: u32, p1: u64, p2: u64, p3: u64, p4: u64) -> !;
}
