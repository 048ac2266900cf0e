//! `NtKernel` for the model: each Windows routine forwards to the module that models it, and a violation found
//! there is raised here, after every model lock is released. The routines the low-resources simulation can fail
//! take their caller's location (`#[track_caller]`): the call site systematic mode identifies. Every routine is
//! also a scheduling point (`kernel_call`), named by its caller's location, in both personalities: the loader's
//! thunks for vhca.sys call these same routines.

use vhca_ntapi::*;

use crate::bugcheck::Bugcheck;
use std::panic::Location;

use crate::locks::LockKind;
use crate::low_resources::at_location;
use crate::NtModel;

impl NtKernel for NtModel {
    #[track_caller]
    fn KeGetCurrentIrql(&self) -> KIRQL {
        let _call = self.kernel_call("KeGetCurrentIrql");
        self.irql()
    }
    #[track_caller]
    fn KeRaiseIrql(&self, new_irql: KIRQL) -> KIRQL {
        let _call = self.kernel_call("KeRaiseIrql");
        self.raise_irql(new_irql)
    }
    #[track_caller]
    fn KeLowerIrql(&self, new_irql: KIRQL) {
        let _call = self.kernel_call("KeLowerIrql");
        self.lower_irql(new_irql)
    }
    #[track_caller]
    fn KeEnterCriticalRegion(&self) {
        let _call = self.kernel_call("KeEnterCriticalRegion");
        self.enter_critical_region()
    }
    #[track_caller]
    fn KeLeaveCriticalRegion(&self) {
        let _call = self.kernel_call("KeLeaveCriticalRegion");
        self.leave_critical_region()
    }

    #[track_caller]
    fn ExInitializeFastMutex(&self) -> PFAST_MUTEX {
        let _call = self.kernel_call("ExInitializeFastMutex");
        PFAST_MUTEX(self.new_lock(LockKind::FastMutex))
    }
    #[track_caller]
    fn ExAcquireFastMutex(&self, mutex: PFAST_MUTEX) {
        let _call = self.kernel_call("ExAcquireFastMutex");
        self.fast_mutex_acquire(mutex)
    }
    #[track_caller]
    fn ExReleaseFastMutex(&self, mutex: PFAST_MUTEX) {
        let _call = self.kernel_call("ExReleaseFastMutex");
        self.fast_mutex_release(mutex)
    }

    #[track_caller]
    fn KeInitializeGuardedMutex(&self) -> PKGUARDED_MUTEX {
        let _call = self.kernel_call("KeInitializeGuardedMutex");
        PKGUARDED_MUTEX(self.new_lock(LockKind::GuardedMutex))
    }
    #[track_caller]
    fn KeAcquireGuardedMutex(&self, mutex: PKGUARDED_MUTEX) {
        let _call = self.kernel_call("KeAcquireGuardedMutex");
        self.guarded_mutex_acquire(mutex)
    }
    #[track_caller]
    fn KeReleaseGuardedMutex(&self, mutex: PKGUARDED_MUTEX) {
        let _call = self.kernel_call("KeReleaseGuardedMutex");
        self.guarded_mutex_release(mutex)
    }

    #[track_caller]
    fn KeInitializeMutex(&self, _level: u32) -> PKMUTEX {
        let _call = self.kernel_call("KeInitializeMutex");
        PKMUTEX(self.new_lock(LockKind::KMutex))
    }
    #[track_caller]
    fn KeWaitForMutexObject(&self, mutex: PKMUTEX) -> NTSTATUS {
        let _call = self.kernel_call("KeWaitForMutexObject");
        self.kmutex_wait(mutex)
    }
    #[track_caller]
    fn KeReleaseMutex(&self, mutex: PKMUTEX, _wait: bool) -> i32 {
        let _call = self.kernel_call("KeReleaseMutex");
        self.kmutex_release(mutex)
    }

    #[track_caller]
    fn ExInitializeResourceLite(&self) -> PERESOURCE {
        let _call = self.kernel_call("ExInitializeResourceLite");
        PERESOURCE(self.new_lock(LockKind::Resource))
    }
    #[track_caller]
    fn ExAcquireResourceExclusiveLite(&self, resource: PERESOURCE, wait: bool) -> bool {
        let _call = self.kernel_call("ExAcquireResourceExclusiveLite");
        self.resource_acquire(resource, false, wait)
    }
    #[track_caller]
    fn ExAcquireResourceSharedLite(&self, resource: PERESOURCE, wait: bool) -> bool {
        let _call = self.kernel_call("ExAcquireResourceSharedLite");
        self.resource_acquire(resource, true, wait)
    }
    #[track_caller]
    fn ExReleaseResourceLite(&self, resource: PERESOURCE) {
        let _call = self.kernel_call("ExReleaseResourceLite");
        self.resource_release(resource)
    }
    #[track_caller]
    fn ExDeleteResourceLite(&self, _resource: PERESOURCE) -> NTSTATUS {
        let _call = self.kernel_call("ExDeleteResourceLite");
        STATUS_SUCCESS
    }

    #[track_caller]
    fn KeInitializeSpinLock(&self) -> PKSPIN_LOCK {
        let _call = self.kernel_call("KeInitializeSpinLock");
        PKSPIN_LOCK(self.new_lock(LockKind::SpinLock))
    }
    #[track_caller]
    fn KeAcquireSpinLock(&self, lock: PKSPIN_LOCK) -> KIRQL {
        let _call = self.kernel_call("KeAcquireSpinLock");
        self.spin_lock_acquire(lock)
    }
    #[track_caller]
    fn KeReleaseSpinLock(&self, lock: PKSPIN_LOCK, new_irql: KIRQL) {
        let _call = self.kernel_call("KeReleaseSpinLock");
        self.spin_lock_release(lock, new_irql)
    }

    #[track_caller]
    fn ExAllocatePoolWithTag(&self, pool_type: POOL_TYPE, number_of_bytes: usize, tag: u32) -> PVOID {
        let _call = self.kernel_call("ExAllocatePoolWithTag");
        // A Rust caller has no code address the model can name: Code integrity checks' P2 is its call site's record.
        let site = Location::caller();
        let caller = site as *const Location<'_> as u64;
        let r = at_location(site, || self.pool_alloc(pool_type.into(), number_of_bytes, tag, caller));
        self.ok(r)
    }
    #[track_caller]
    fn ExFreePoolWithTag(&self, p: PVOID, _tag: u32) {
        let _call = self.kernel_call("ExFreePoolWithTag");
        let r = self.pool_free(p);
        self.ok(r)
    }

    #[track_caller]
    fn RtlCopyFromVa(&self, destination: &mut [u8], source: PVOID) {
        let _call = self.kernel_call("RtlCopyFromVa");
        let r = self.cpu_read(source, destination);
        self.ok(r)
    }
    #[track_caller]
    fn RtlCopyToVa(&self, destination: PVOID, source: &[u8]) {
        let _call = self.kernel_call("RtlCopyToVa");
        let r = self.cpu_write(destination, source);
        self.ok(r)
    }

    #[track_caller]
    fn IoAllocateMdl(&self, virtual_address: PVOID, length: u32, _secondary: bool, _charge_quota: bool) -> PMDL {
        let _call = self.kernel_call("IoAllocateMdl");
        let r = at_location(Location::caller(), || self.mdl_alloc(virtual_address, length));
        self.ok(r)
    }
    #[track_caller]
    fn IoFreeMdl(&self, mdl: PMDL) {
        let _call = self.kernel_call("IoFreeMdl");
        self.mdl_free(mdl)
    }
    #[track_caller]
    fn MmBuildMdlForNonPagedPool(&self, mdl: PMDL) {
        let _call = self.kernel_call("MmBuildMdlForNonPagedPool");
        let r = self.mdl_build_nonpaged(mdl);
        self.ok(r)
    }
    #[track_caller]
    fn MmProbeAndLockPages(&self, mdl: PMDL, access_mode: KPROCESSOR_MODE, operation: LOCK_OPERATION) -> NTSTATUS {
        let _call = self.kernel_call("MmProbeAndLockPages");
        let r = at_location(Location::caller(), || self.mdl_probe_and_lock(mdl, access_mode, operation));
        self.ok(r)
    }
    #[track_caller]
    fn MmUnlockPages(&self, mdl: PMDL) {
        let _call = self.kernel_call("MmUnlockPages");
        let r = self.mdl_unlock(mdl);
        self.ok(r)
    }
    #[track_caller]
    fn MmGetMdlVirtualAddress(&self, mdl: PMDL) -> PVOID {
        let _call = self.kernel_call("MmGetMdlVirtualAddress");
        self.mdl(mdl).map(|d| PVOID(d.va)).unwrap_or(PVOID::NULL)
    }
    #[track_caller]
    fn MmGetMdlByteCount(&self, mdl: PMDL) -> u32 {
        let _call = self.kernel_call("MmGetMdlByteCount");
        self.mdl(mdl).map(|d| d.len).unwrap_or(0)
    }

    #[track_caller]
    fn MmAllocateContiguousMemorySpecifyCache(
        &self,
        number_of_bytes: usize,
        _lowest: PHYSICAL_ADDRESS,
        _highest: PHYSICAL_ADDRESS,
        _boundary: PHYSICAL_ADDRESS,
        _cache_type: MEMORY_CACHING_TYPE,
    ) -> PVOID {
        let _call = self.kernel_call("MmAllocateContiguousMemorySpecifyCache");
        let r = at_location(Location::caller(), || self.contiguous_alloc(number_of_bytes));
        self.ok(r)
    }
    #[track_caller]
    fn MmFreeContiguousMemory(&self, base_address: PVOID) {
        let _call = self.kernel_call("MmFreeContiguousMemory");
        let r = self.contiguous_free(base_address);
        self.ok(r)
    }

    fn MmGetPhysicalAddress(&self, base_address: PVOID) -> PHYSICAL_ADDRESS {
        PHYSICAL_ADDRESS(self.mm_get_physical_address(base_address.0))
    }

    #[track_caller]
    fn IoGetDmaAdapter(
        &self,
        _physical_device_object: PDEVICE_OBJECT,
        device_description: &DEVICE_DESCRIPTION,
        number_of_map_registers: &mut u32,
    ) -> PDMA_ADAPTER {
        let _call = self.kernel_call("IoGetDmaAdapter");
        self.get_dma_adapter(device_description, number_of_map_registers)
    }
    #[track_caller]
    fn PutDmaAdapter(&self, adapter: PDMA_ADAPTER) {
        let _call = self.kernel_call("PutDmaAdapter");
        let r = self.put_dma_adapter(adapter);
        self.ok(r)
    }
    #[track_caller]
    fn AllocateCommonBuffer(
        &self,
        adapter: PDMA_ADAPTER,
        length: u32,
        logical_address: &mut PHYSICAL_ADDRESS,
        _cache_enabled: bool,
    ) -> PVOID {
        let _call = self.kernel_call("AllocateCommonBuffer");
        let r = at_location(Location::caller(), || self.allocate_common_buffer(adapter, length));
        let (va, logical) = self.ok(r);
        *logical_address = PHYSICAL_ADDRESS(logical);
        va
    }
    #[track_caller]
    fn FreeCommonBuffer(
        &self,
        adapter: PDMA_ADAPTER,
        _length: u32,
        _logical_address: PHYSICAL_ADDRESS,
        virtual_address: PVOID,
        _cache_enabled: bool,
    ) {
        let _call = self.kernel_call("FreeCommonBuffer");
        let r = self.free_common_buffer(adapter, virtual_address);
        self.ok(r)
    }
    #[track_caller]
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
        let _call = self.kernel_call("GetScatterGatherList");
        at_location(Location::caller(), || {
            self.get_scatter_gather_list(
                adapter,
                device_object,
                mdl,
                current_va,
                length,
                execution_routine,
                write_to_device,
            )
        })
    }
    #[track_caller]
    fn PutScatterGatherList(&self, adapter: PDMA_ADAPTER, list: PSCATTER_GATHER_LIST, _write_to_device: bool) {
        let _call = self.kernel_call("PutScatterGatherList");
        let r = self.put_scatter_gather_list(adapter, list);
        self.ok(r)
    }
    #[track_caller]
    fn AllocateAdapterChannel(
        &self,
        adapter: PDMA_ADAPTER,
        device_object: PDEVICE_OBJECT,
        number_of_map_registers: u32,
        execution_routine: PDRIVER_CONTROL,
    ) -> NTSTATUS {
        let _call = self.kernel_call("AllocateAdapterChannel");
        self.allocate_adapter_channel(adapter, device_object, number_of_map_registers, execution_routine)
    }
    #[track_caller]
    fn FreeAdapterChannel(&self, adapter: PDMA_ADAPTER) {
        let _call = self.kernel_call("FreeAdapterChannel");
        let r = self.free_adapter_channel(adapter);
        self.ok(r)
    }
    #[track_caller]
    fn MapTransfer(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        map_register_base: MAP_REGISTER_BASE,
        current_va: PVOID,
        length: &mut u32,
        write_to_device: bool,
    ) -> Result<PHYSICAL_ADDRESS, NTSTATUS> {
        let _call = self.kernel_call("MapTransfer");
        self.map_transfer(adapter, mdl, map_register_base, current_va, length, write_to_device)
    }
    #[track_caller]
    fn FlushAdapterBuffers(
        &self,
        _adapter: PDMA_ADAPTER,
        mdl: PMDL,
        map_register_base: MAP_REGISTER_BASE,
        current_va: PVOID,
        _length: u32,
        _write_to_device: bool,
    ) -> bool {
        let _call = self.kernel_call("FlushAdapterBuffers");
        let r = self.flush_adapter_buffers(mdl, map_register_base, current_va);
        self.ok(r)
    }
    #[track_caller]
    fn FreeMapRegisters(
        &self,
        adapter: PDMA_ADAPTER,
        map_register_base: MAP_REGISTER_BASE,
        number_of_map_registers: u32,
    ) {
        let _call = self.kernel_call("FreeMapRegisters");
        let r = self.free_map_registers(adapter, map_register_base, number_of_map_registers);
        self.ok(r)
    }

    #[track_caller]
    fn KeBugCheckEx(&self, code: u32, p1: u64, p2: u64, p3: u64, p4: u64) -> ! {
        let _call = self.kernel_call("KeBugCheckEx");
        self.raise(Bugcheck::new(code, p1, p2, p3, p4))
    }

    #[track_caller]
    fn IoMapCommonBuffer(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        length: u32,
        _cache_enabled: bool,
    ) -> Result<(HANDLE, SCATTER_GATHER_LIST), NTSTATUS> {
        let _call = self.kernel_call("IoMapCommonBuffer");
        self.map_common_buffer(adapter, mdl, length)
    }
    #[track_caller]
    fn IoUnmapCommonBuffer(&self, adapter: PDMA_ADAPTER, common_buffer: HANDLE) {
        let _call = self.kernel_call("IoUnmapCommonBuffer");
        let r = self.unmap_common_buffer(adapter, common_buffer);
        self.ok(r)
    }
}
