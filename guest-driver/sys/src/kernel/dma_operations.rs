//! The DMA adapter's routines, reached through the adapter's DMA_OPERATIONS table as Windows requires (they are
//! not exports: Driver Verifier wraps the table only under DMA checking). Where Windows calls the driver back
//! (GetScatterGatherList's AdapterListControl, AllocateAdapterChannel's AdapterControl), one trampoline per kind
//! takes a pool-allocated Context holding the core's routine and calls it, at DISPATCH_LEVEL, now or later.
//! The shim never changes IRQL for these: the core calls them at DISPATCH_LEVEL, as Windows requires.

use alloc::boxed::Box;
use alloc::vec::Vec;
use core::ffi::c_void;

use vhca_ntapi::{
    MAP_REGISTER_BASE, NTSTATUS, PAGE_SIZE, PDEVICE_OBJECT, PDMA_ADAPTER, PDRIVER_CONTROL, PDRIVER_LIST_CONTROL,
    PHYSICAL_ADDRESS, PMDL, PSCATTER_GATHER_LIST, PVOID, SCATTER_GATHER_ELEMENT, SCATTER_GATHER_LIST,
    STATUS_INVALID_PARAMETER, STATUS_NOT_SUPPORTED,
};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IRP, MDL};
use windows_sys::Wdk::System::SystemServices::{DMA_ADAPTER, DMA_OPERATIONS, SCATTER_GATHER_LIST as WdkSgList};

/// The adapter's table. Windows never hands out an adapter without one.
///
/// # Safety
/// `adapter` came from IoGetDmaAdapter and has not been put back.
unsafe fn ops(adapter: PDMA_ADAPTER) -> &'static DMA_OPERATIONS {
    // SAFETY: per the contract, the adapter and its table stay valid until PutDmaAdapter.
    unsafe { &*(*(adapter.0 as *const DMA_ADAPTER)).DmaOperations }
}

/// Whether the table is long enough to hold the routine at `offset` (v1 tables end before the v3 routines).
fn table_has(table: &DMA_OPERATIONS, offset: usize) -> bool {
    offset + core::mem::size_of::<usize>() <= table.Size as usize
}

fn adapter_ptr(adapter: PDMA_ADAPTER) -> *const DMA_ADAPTER {
    adapter.0 as *const DMA_ADAPTER
}

/// AdapterListControl's Context: the driver core's routine and the device object it is for.
struct ListContext {
    routine: PDRIVER_LIST_CONTROL,
    device: PDEVICE_OBJECT,
}

/// AdapterControl's Context, the same for AllocateAdapterChannel.
struct ControlContext {
    routine: PDRIVER_CONTROL,
    device: PDEVICE_OBJECT,
}

/// The one AdapterListControl vhca.sys hands Windows: runs at DISPATCH_LEVEL (before GetScatterGatherList returns
/// or later, when map registers free up) and passes the list on to the core's routine.
unsafe extern "system" fn list_control(
    _device: *const DEVICE_OBJECT,
    _irp: *const IRP,
    list: *const WdkSgList,
    context: *const c_void,
) {
    // SAFETY: `context` is the box get_scatter_gather_list leaked for exactly this one call.
    let context = unsafe { Box::from_raw(context as *mut ListContext) };
    let list = copy_list(list as usize);
    (context.routine)(context.device, &list);
}

/// The one AdapterControl (ExecutionRoutine) for AllocateAdapterChannel: DISPATCH_LEVEL, with the base.
unsafe extern "system" fn adapter_control(
    _device: *const DEVICE_OBJECT,
    _irp: *mut IRP,
    map_register_base: *const c_void,
    context: *const c_void,
) -> i32 {
    // SAFETY: `context` is the box allocate_adapter_channel leaked for this one call.
    let context = unsafe { Box::from_raw(context as *mut ControlContext) };
    (context.routine)(context.device, MAP_REGISTER_BASE(map_register_base as u64)) as i32
}

/// Hands `context` to a DDI that calls a driver routine back with it (`call` gets the Context pointer). Windows
/// calls the routine exactly when the DDI succeeds; on an error the routine never runs and the context is freed
/// here, else the trampoline frees it.
fn call_with_context<T>(context: T, call: impl FnOnce(*const c_void) -> i32) -> NTSTATUS {
    let context = Box::into_raw(Box::new(context));
    let status = call(context as *const c_void);
    if status < 0 {
        // SAFETY: the routine will never run, so no trampoline took the box back.
        drop(unsafe { Box::from_raw(context) });
    }
    NTSTATUS(status)
}

/// # Safety
/// `adapter`, `device` and `mdl` are live kernel objects; the MDL describes locked or non-paged memory; the
/// caller runs at DISPATCH_LEVEL.
pub unsafe fn get_scatter_gather_list(
    adapter: PDMA_ADAPTER,
    device: PDEVICE_OBJECT,
    mdl: PMDL,
    current_va: PVOID,
    length: u32,
    routine: PDRIVER_LIST_CONTROL,
    write_to_device: bool,
) -> NTSTATUS {
    // SAFETY: the caller's contract.
    let Some(get) = unsafe { ops(adapter) }.GetScatterGatherList else { return STATUS_NOT_SUPPORTED };
    // SAFETY: the caller's contract; the context lives until list_control takes it back.
    call_with_context(ListContext { routine, device }, |context| unsafe {
        get(
            adapter_ptr(adapter),
            device.0 as *const DEVICE_OBJECT,
            mdl.0 as *const MDL,
            current_va.0 as *const c_void,
            length,
            Some(list_control),
            context,
            write_to_device,
        )
    })
}

fn copy_list(list: usize) -> SCATTER_GATHER_LIST {
    let raw = list as *const WdkSgList;
    // SAFETY: Windows hands the routine a valid list of NumberOfElements elements (a flexible array member).
    let (count, first) = unsafe { ((*raw).NumberOfElements as usize, core::ptr::addr_of!((*raw).Elements).cast()) };
    // SAFETY: as above: `count` elements follow the header.
    let elements: &[windows_sys::Wdk::System::SystemServices::SCATTER_GATHER_ELEMENT] =
        unsafe { core::slice::from_raw_parts(first, count) };
    SCATTER_GATHER_LIST {
        Handle: PSCATTER_GATHER_LIST(list as u64),
        Elements: elements
            .iter()
            .map(|e| SCATTER_GATHER_ELEMENT { Address: PHYSICAL_ADDRESS(e.Address as u64), Length: e.Length })
            .collect::<Vec<_>>(),
    }
}

/// # Safety
/// `list` is the Handle of a list this adapter delivered, put back once, at DISPATCH_LEVEL.
pub unsafe fn put_scatter_gather_list(adapter: PDMA_ADAPTER, list: PSCATTER_GATHER_LIST, write_to_device: bool) {
    // SAFETY: the caller's contract.
    if let Some(put) = unsafe { ops(adapter) }.PutScatterGatherList {
        // SAFETY: as above.
        unsafe { put(adapter_ptr(adapter), list.0 as *const WdkSgList, write_to_device) };
    }
}

/// # Safety
/// Live adapter and device objects; the caller runs at DISPATCH_LEVEL.
pub unsafe fn allocate_adapter_channel(
    adapter: PDMA_ADAPTER,
    device: PDEVICE_OBJECT,
    number_of_map_registers: u32,
    routine: PDRIVER_CONTROL,
) -> NTSTATUS {
    // SAFETY: the caller's contract.
    let Some(allocate) = unsafe { ops(adapter) }.AllocateAdapterChannel else { return STATUS_NOT_SUPPORTED };
    // SAFETY: the caller's contract; the context lives until adapter_control takes it back.
    call_with_context(ControlContext { routine, device }, |context| unsafe {
        allocate(
            adapter_ptr(adapter),
            device.0 as *const DEVICE_OBJECT,
            number_of_map_registers,
            Some(adapter_control),
            context,
        )
    })
}

macro_rules! table_call {
    ($adapter:expr, $routine:ident, $default:expr, |$f:ident| $call:expr) => {{
        // SAFETY: the callers' contract: a live adapter from IoGetDmaAdapter.
        match unsafe { ops($adapter) }.$routine {
            Some($f) => $call,
            None => $default,
        }
    }};
}

/// # Safety
/// Live adapter; on return the caller owns the buffer until free_common_buffer.
pub unsafe fn allocate_common_buffer(
    adapter: PDMA_ADAPTER,
    length: u32,
    logical: &mut PHYSICAL_ADDRESS,
    cache_enabled: bool,
) -> PVOID {
    let mut address = 0i64;
    // SAFETY: AllocateCommonBuffer at PASSIVE_LEVEL (the caller's IRQL, unchanged).
    let va = table_call!(adapter, AllocateCommonBuffer, core::ptr::null_mut(), |f| unsafe {
        f(adapter_ptr(adapter), length, &mut address, cache_enabled)
    });
    *logical = PHYSICAL_ADDRESS(address as u64);
    PVOID(va as u64)
}

/// # Safety
/// The buffer came from allocate_common_buffer on this adapter with these values.
pub unsafe fn free_common_buffer(
    adapter: PDMA_ADAPTER,
    length: u32,
    logical: PHYSICAL_ADDRESS,
    va: PVOID,
    cache_enabled: bool,
) {
    table_call!(adapter, FreeCommonBuffer, (), |f| unsafe {
        f(adapter_ptr(adapter), length, logical.0 as i64, va.0 as *const c_void, cache_enabled)
    })
}

/// # Safety
/// Live adapter, put back once.
pub unsafe fn put_dma_adapter(adapter: PDMA_ADAPTER) {
    table_call!(adapter, PutDmaAdapter, (), |f| unsafe { f(adapter.0 as *mut DMA_ADAPTER) })
}

/// # Safety
/// The adapter holds the channel (AllocateAdapterChannel with KeepObject).
pub unsafe fn free_adapter_channel(adapter: PDMA_ADAPTER) {
    table_call!(adapter, FreeAdapterChannel, (), |f| unsafe { f(adapter_ptr(adapter)) })
}

/// # Safety
/// Live objects; `base` is a map-register base this adapter granted.
pub unsafe fn map_transfer(
    adapter: PDMA_ADAPTER,
    mdl: PMDL,
    base: MAP_REGISTER_BASE,
    current_va: PVOID,
    length: &mut u32,
    write_to_device: bool,
) -> Result<PHYSICAL_ADDRESS, NTSTATUS> {
    table_call!(adapter, MapTransfer, Err(STATUS_NOT_SUPPORTED), |f| {
        // SAFETY: MapTransfer at IRQL <= DISPATCH_LEVEL, the caller's.
        let address = unsafe {
            f(
                adapter_ptr(adapter),
                mdl.0 as *const MDL,
                base.0 as *const c_void,
                current_va.0 as *const c_void,
                length,
                write_to_device,
            )
        };
        Ok(PHYSICAL_ADDRESS(address as u64))
    })
}

/// # Safety
/// As map_transfer.
pub unsafe fn flush_adapter_buffers(
    adapter: PDMA_ADAPTER,
    mdl: PMDL,
    base: MAP_REGISTER_BASE,
    current_va: PVOID,
    length: u32,
    write_to_device: bool,
) -> bool {
    table_call!(adapter, FlushAdapterBuffers, false, |f| unsafe {
        f(
            adapter_ptr(adapter),
            mdl.0 as *const MDL,
            base.0 as *const c_void,
            current_va.0 as *const c_void,
            length,
            write_to_device,
        )
    })
}

/// # Safety
/// `base` and the count are what AllocateAdapterChannel granted and kept.
pub unsafe fn free_map_registers(adapter: PDMA_ADAPTER, base: MAP_REGISTER_BASE, count: u32) {
    table_call!(adapter, FreeMapRegisters, (), |f| unsafe { f(adapter_ptr(adapter), base.0 as *mut c_void, count) })
}

/// The common buffer IoMapCommonBuffer made from an MDL, remembered for IoUnmapCommonBuffer.
pub struct MdlCommonBuffer {
    pub va: PVOID,
    pub length: u32,
    pub logical: PHYSICAL_ADDRESS,
    pub cache_enabled: bool,
}

/// The seed's IoMapCommonBuffer as vhca.sys's own helper over an existing DDI: DMA_OPERATIONS v3's
/// CreateCommonBufferFromMdl makes the MDL's pages a common buffer (one logical range, no double buffering).
/// Tables older than v3 lack the routine: STATUS_NOT_SUPPORTED, as the interface's default answers.
///
/// # Safety
/// Live adapter; `mdl` describes locked memory of `length` bytes at `va`.
pub unsafe fn create_common_buffer_from_mdl(
    adapter: PDMA_ADAPTER,
    mdl: PMDL,
    va: PVOID,
    length: u32,
    cache_enabled: bool,
) -> Result<MdlCommonBuffer, NTSTATUS> {
    // Microsoft's page for PCREATE_COMMON_BUFFER_FROM_MDL: the MDL is resident and mapped (non-paged pool, or
    // locked), page aligned, a multiple of PAGE_SIZE, not chained, and physically contiguous where DMA remapping is
    // off. The alignment is checked here so the refusal names its cause; the rest is Windows' to refuse.
    if va.0 % PAGE_SIZE != 0 || length as u64 % PAGE_SIZE != 0 {
        return Err(STATUS_INVALID_PARAMETER);
    }
    // SAFETY: the caller's contract.
    let table = unsafe { ops(adapter) };
    if !table_has(table, core::mem::offset_of!(DMA_OPERATIONS, CreateCommonBufferFromMdl)) {
        return Err(STATUS_NOT_SUPPORTED);
    }
    let Some(create) = table.CreateCommonBufferFromMdl else { return Err(STATUS_NOT_SUPPORTED) };
    let mut logical = 0i64;
    // SAFETY: CreateCommonBufferFromMdl at PASSIVE_LEVEL; no extended configuration.
    let status = unsafe { create(adapter_ptr(adapter), mdl.0 as *const MDL, core::ptr::null(), 0, &mut logical) };
    if status < 0 {
        return Err(NTSTATUS(status));
    }
    Ok(MdlCommonBuffer { va, length, logical: PHYSICAL_ADDRESS(logical as u64), cache_enabled })
}
