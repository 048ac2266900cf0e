//! `NtKernel` for the model: each Windows routine forwards to the module that models it, and a violation found
//! there is raised here, after every model lock is released. The routines the low-resources simulation can fail
//! take their caller's location (`#[track_caller]`): the call site systematic mode identifies.

use vhca_ntapi::*;

use crate::bugcheck::Bugcheck;
use std::panic::Location;

use crate::locks::LockKind;
use crate::low_resources::at_location;
use crate::NtModel;

impl NtKernel for NtModel {
    fn KeGetCurrentIrql(&self) -> KIRQL {
        self.irql()
    }
    fn KeRaiseIrql(&self, new_irql: KIRQL) -> KIRQL {
        self.raise_irql(new_irql)
    }
    fn KeLowerIrql(&self, new_irql: KIRQL) {
        self.lower_irql(new_irql)
    }
    fn KeEnterCriticalRegion(&self) {
        self.enter_critical_region()
    }
    fn KeLeaveCriticalRegion(&self) {
        self.leave_critical_region()
    }

    fn ExInitializeFastMutex(&self) -> PFAST_MUTEX {
        PFAST_MUTEX(self.new_lock(LockKind::FastMutex))
    }
    fn ExAcquireFastMutex(&self, mutex: PFAST_MUTEX) {
        self.fast_mutex_acquire(mutex)
    }
    fn ExReleaseFastMutex(&self, mutex: PFAST_MUTEX) {
        self.fast_mutex_release(mutex)
    }

    fn KeInitializeGuardedMutex(&self) -> PKGUARDED_MUTEX {
        PKGUARDED_MUTEX(self.new_lock(LockKind::GuardedMutex))
    }
    fn KeAcquireGuardedMutex(&self, mutex: PKGUARDED_MUTEX) {
        self.guarded_mutex_acquire(mutex)
    }
    fn KeReleaseGuardedMutex(&self, mutex: PKGUARDED_MUTEX) {
        self.guarded_mutex_release(mutex)
    }

    fn KeInitializeMutex(&self, _level: u32) -> PKMUTEX {
        PKMUTEX(self.new_lock(LockKind::KMutex))
    }
    fn KeWaitForMutexObject(&self, mutex: PKMUTEX) -> NTSTATUS {
        self.kmutex_wait(mutex)
    }
    fn KeReleaseMutex(&self, mutex: PKMUTEX, _wait: bool) -> i32 {
        self.kmutex_release(mutex)
    }

    fn ExInitializeResourceLite(&self) -> PERESOURCE {
        PERESOURCE(self.new_lock(LockKind::Resource))
    }
    fn ExAcquireResourceExclusiveLite(&self, resource: PERESOURCE, wait: bool) -> bool {
        self.resource_acquire(resource, false, wait)
    }
    fn ExAcquireResourceSharedLite(&self, resource: PERESOURCE, wait: bool) -> bool {
        self.resource_acquire(resource, true, wait)
    }
    fn ExReleaseResourceLite(&self, resource: PERESOURCE) {
        self.resource_release(resource)
    }
    fn ExDeleteResourceLite(&self, _resource: PERESOURCE) -> NTSTATUS {
        STATUS_SUCCESS
    }

    fn KeInitializeSpinLock(&self) -> PKSPIN_LOCK {
        PKSPIN_LOCK(self.new_lock(LockKind::SpinLock))
    }
    fn KeAcquireSpinLock(&self, lock: PKSPIN_LOCK) -> KIRQL {
        self.spin_lock_acquire(lock)
    }
    fn KeReleaseSpinLock(&self, lock: PKSPIN_LOCK, new_irql: KIRQL) {
        self.spin_lock_release(lock, new_irql)
    }

    #[track_caller]
    fn ExAllocatePoolWithTag(&self, pool_type: POOL_TYPE, number_of_bytes: usize, tag: u32) -> PVOID {
        // A Rust caller has no code address the model can name: Code integrity checks' P2 is its call site's record.
        let site = Location::caller();
        let caller = site as *const Location<'_> as u64;
        let r = at_location(site, || self.pool_alloc(pool_type.into(), number_of_bytes, tag, caller));
        self.ok(r)
    }
    fn ExFreePoolWithTag(&self, p: PVOID, _tag: u32) {
        let r = self.pool_free(p);
        self.ok(r)
    }

    fn RtlCopyFromVa(&self, destination: &mut [u8], source: PVOID) {
        let r = self.cpu_read(source, destination);
        self.ok(r)
    }
    fn RtlCopyToVa(&self, destination: PVOID, source: &[u8]) {
        let r = self.cpu_write(destination, source);
        self.ok(r)
    }

    #[track_caller]
    fn IoAllocateMdl(&self, virtual_address: PVOID, length: u32, _secondary: bool, _charge_quota: bool) -> PMDL {
        let r = at_location(Location::caller(), || self.mdl_alloc(virtual_address, length));
        self.ok(r)
    }
    fn IoFreeMdl(&self, mdl: PMDL) {
        self.mdl_free(mdl)
    }
    fn MmBuildMdlForNonPagedPool(&self, mdl: PMDL) {
        let r = self.mdl_build_nonpaged(mdl);
        self.ok(r)
    }
    #[track_caller]
    fn MmProbeAndLockPages(&self, mdl: PMDL, access_mode: KPROCESSOR_MODE, operation: LOCK_OPERATION) -> NTSTATUS {
        let r = at_location(Location::caller(), || self.mdl_probe_and_lock(mdl, access_mode, operation));
        self.ok(r)
    }
    fn MmUnlockPages(&self, mdl: PMDL) {
        let r = self.mdl_unlock(mdl);
        self.ok(r)
    }
    fn MmGetMdlVirtualAddress(&self, mdl: PMDL) -> PVOID {
        self.mdl(mdl).map(|d| PVOID(d.va)).unwrap_or(PVOID::NULL)
    }
    fn MmGetMdlByteCount(&self, mdl: PMDL) -> u32 {
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
        let r = at_location(Location::caller(), || self.contiguous_alloc(number_of_bytes));
        self.ok(r)
    }
    fn MmFreeContiguousMemory(&self, base_address: PVOID) {
        let r = self.contiguous_free(base_address);
        self.ok(r)
    }

    fn IoGetDmaAdapter(
        &self,
        _physical_device_object: PDEVICE_OBJECT,
        device_description: &DEVICE_DESCRIPTION,
        number_of_map_registers: &mut u32,
    ) -> PDMA_ADAPTER {
        self.get_dma_adapter(device_description, number_of_map_registers)
    }
    fn PutDmaAdapter(&self, adapter: PDMA_ADAPTER) {
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
        let r = at_location(Location::caller(), || self.allocate_common_buffer(adapter, length));
        let (va, logical) = self.ok(r);
        *logical_address = PHYSICAL_ADDRESS(logical);
        va
    }
    fn FreeCommonBuffer(
        &self,
        adapter: PDMA_ADAPTER,
        _length: u32,
        _logical_address: PHYSICAL_ADDRESS,
        virtual_address: PVOID,
        _cache_enabled: bool,
    ) {
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
    fn PutScatterGatherList(&self, adapter: PDMA_ADAPTER, list: PSCATTER_GATHER_LIST, _write_to_device: bool) {
        let r = self.put_scatter_gather_list(adapter, list);
        self.ok(r)
    }
    fn AllocateAdapterChannel(
        &self,
        adapter: PDMA_ADAPTER,
        device_object: PDEVICE_OBJECT,
        number_of_map_registers: u32,
        execution_routine: PDRIVER_CONTROL,
    ) -> NTSTATUS {
        self.allocate_adapter_channel(adapter, device_object, number_of_map_registers, execution_routine)
    }
    fn FreeAdapterChannel(&self, adapter: PDMA_ADAPTER) {
        let r = self.free_adapter_channel(adapter);
        self.ok(r)
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
        self.map_transfer(adapter, mdl, map_register_base, current_va, length, write_to_device)
    }
    fn FlushAdapterBuffers(
        &self,
        _adapter: PDMA_ADAPTER,
        mdl: PMDL,
        map_register_base: MAP_REGISTER_BASE,
        current_va: PVOID,
        _length: u32,
        _write_to_device: bool,
    ) -> bool {
        let r = self.flush_adapter_buffers(mdl, map_register_base, current_va);
        self.ok(r)
    }
    fn FreeMapRegisters(
        &self,
        adapter: PDMA_ADAPTER,
        map_register_base: MAP_REGISTER_BASE,
        number_of_map_registers: u32,
    ) {
        let r = self.free_map_registers(adapter, map_register_base, number_of_map_registers);
        self.ok(r)
    }

    fn KeBugCheckEx(&self, code: u32, p1: u64, p2: u64, p3: u64, p4: u64) -> ! {
        self.raise(Bugcheck::new(code, p1, p2, p3, p4))
    }

    fn IoMapCommonBuffer(
        &self,
        adapter: PDMA_ADAPTER,
        mdl: PMDL,
        length: u32,
        _cache_enabled: bool,
    ) -> Result<(HANDLE, SCATTER_GATHER_LIST), NTSTATUS> {
        self.map_common_buffer(adapter, mdl, length)
    }
    fn IoUnmapCommonBuffer(&self, adapter: PDMA_ADAPTER, common_buffer: HANDLE) {
        let r = self.unmap_common_buffer(adapter, common_buffer);
        self.ok(r)
    }
}
