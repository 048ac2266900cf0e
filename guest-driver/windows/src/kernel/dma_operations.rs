//! The DMA adapter's routines, reached through the adapter's DMA_OPERATIONS table as Windows requires (they are
//! not exports: Driver Verifier wraps the table only under DMA checking). Where Windows calls the driver back
//! (GetScatterGatherList's AdapterListControl, AllocateAdapterChannel's ExecutionRoutine), the callback may run
//! before the call returns or later; a handshake on a pool-allocated context decides who owns what it delivers.

use alloc::boxed::Box;
use alloc::vec::Vec;
use core::ffi::c_void;
use core::sync::atomic::{AtomicU8, Ordering};

use vhca_ntapi::{
    IO_ALLOCATION_ACTION, MAP_REGISTER_BASE, NTSTATUS, PDEVICE_OBJECT, PDMA_ADAPTER, PHYSICAL_ADDRESS, PMDL,
    PSCATTER_GATHER_LIST, PVOID, SCATTER_GATHER_ELEMENT, SCATTER_GATHER_LIST, STATUS_INSUFFICIENT_RESOURCES,
    STATUS_NOT_SUPPORTED,
};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, IRP, MDL};
use windows_sys::Wdk::System::SystemServices::{
    DeallocateObject, DMA_ADAPTER, DMA_OPERATIONS, SCATTER_GATHER_LIST as WdkSgList,
};

use super::irql_guard::at_dispatch;

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

const WAITING: u8 = 0;
const DELIVERED: u8 = 1;
const ABANDONED: u8 = 2;

/// What a callback delivers, and who owns it: the caller if the callback ran first (DELIVERED), the callback if
/// the caller gave up first (ABANDONED): then the callback gives the resource straight back.
struct Handshake {
    state: AtomicU8,
    adapter: PDMA_ADAPTER,
    write_to_device: bool,
    /// For AllocateAdapterChannel: whether the routine keeps the channel (KeepObject) or only the registers.
    keep_object: bool,
    delivered: usize,
}

impl Handshake {
    fn new(adapter: PDMA_ADAPTER, write_to_device: bool, keep_object: bool) -> *mut Handshake {
        let state = AtomicU8::new(WAITING);
        Box::into_raw(Box::new(Handshake { state, adapter, write_to_device, keep_object, delivered: 0 }))
    }

    /// After the DDI returned: the delivered value if the callback already ran; else None, and the callback will
    /// free the context and give the resource back when it runs.
    ///
    /// # Safety
    /// `this` came from `new` and the callback has not freed it (it frees only in the ABANDONED state).
    unsafe fn claim(this: *mut Handshake) -> Option<usize> {
        // SAFETY: the context is alive until one side frees it; only the side that loses the exchange reads it.
        let h = unsafe { &*this };
        match h.state.compare_exchange(WAITING, ABANDONED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => None,
            Err(_) => {
                let value = h.delivered;
                // SAFETY: DELIVERED: the callback is done with the context; this side frees it.
                drop(unsafe { Box::from_raw(this) });
                Some(value)
            }
        }
    }
}

/// AdapterListControl for GetScatterGatherList: runs at DISPATCH_LEVEL with the list.
unsafe extern "system" fn list_control(
    _device: *const DEVICE_OBJECT,
    _irp: *const IRP,
    list: *const WdkSgList,
    context: *const c_void,
) {
    let this = context as *mut Handshake;
    // SAFETY: `context` is the Handshake passed to GetScatterGatherList, alive until one side frees it.
    let h = unsafe { &mut *this };
    h.delivered = list as usize;
    if h.state.compare_exchange(WAITING, DELIVERED, Ordering::AcqRel, Ordering::Acquire).is_err() {
        // The caller gave up: the list is ours to put back, and the context ours to free (DISPATCH_LEVEL here).
        // SAFETY: the list was just handed to us for this adapter; put back once.
        unsafe { put_list(h.adapter, list as usize, h.write_to_device) };
        // SAFETY: ABANDONED: the caller no longer touches the context.
        drop(unsafe { Box::from_raw(this) });
    }
}

/// ExecutionRoutine for AllocateAdapterChannel: runs at DISPATCH_LEVEL with the map-register base.
unsafe extern "system" fn execution_routine(
    _device: *const DEVICE_OBJECT,
    _irp: *mut IRP,
    map_register_base: *const c_void,
    context: *const c_void,
) -> i32 {
    let this = context as *mut Handshake;
    // SAFETY: as in list_control.
    let h = unsafe { &mut *this };
    h.delivered = map_register_base as usize;
    let keep = h.keep_object;
    if h.state.compare_exchange(WAITING, DELIVERED, Ordering::AcqRel, Ordering::Acquire).is_err() {
        // SAFETY: ABANDONED: nobody else holds the context.
        drop(unsafe { Box::from_raw(this) });
        // The caller gave up: release the channel and the registers at once.
        return DeallocateObject;
    }
    if keep {
        IO_ALLOCATION_ACTION::KeepObject as i32
    } else {
        IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters as i32
    }
}

/// # Safety
/// `list` is a SCATTER_GATHER_LIST this adapter handed out and that has not been put back.
unsafe fn put_list(adapter: PDMA_ADAPTER, list: usize, write_to_device: bool) {
    // SAFETY: the caller's contract; PutScatterGatherList runs at DISPATCH_LEVEL (at_dispatch).
    if let Some(put) = unsafe { ops(adapter) }.PutScatterGatherList {
        at_dispatch(|| unsafe { put(adapter_ptr(adapter), list as *const WdkSgList, write_to_device) });
    }
}

/// # Safety
/// `adapter`, `device` and `mdl` are live kernel objects; the MDL describes locked or non-paged memory.
pub unsafe fn get_scatter_gather_list(
    adapter: PDMA_ADAPTER,
    device: PDEVICE_OBJECT,
    mdl: PMDL,
    current_va: PVOID,
    length: u32,
    write_to_device: bool,
) -> Result<SCATTER_GATHER_LIST, NTSTATUS> {
    // SAFETY: the caller's contract.
    let Some(get) = unsafe { ops(adapter) }.GetScatterGatherList else { return Err(STATUS_NOT_SUPPORTED) };
    let context = Handshake::new(adapter, write_to_device, false);
    // SAFETY: GetScatterGatherList at DISPATCH_LEVEL (Microsoft's rule), objects live per the contract; the
    // context outlives the call (freed by whichever side finishes last).
    let status = at_dispatch(|| unsafe {
        get(
            adapter_ptr(adapter),
            device.0 as *const DEVICE_OBJECT,
            mdl.0 as *const MDL,
            current_va.0 as *const c_void,
            length,
            Some(list_control),
            context as *const c_void,
            write_to_device,
        )
    });
    if status < 0 {
        // SAFETY: on failure the callback never runs: the context is still ours alone.
        drop(unsafe { Box::from_raw(context) });
        return Err(NTSTATUS(status));
    }
    // SAFETY: context from Handshake::new, not yet freed by us.
    match unsafe { Handshake::claim(context) } {
        Some(list) => Ok(copy_list(list)),
        // Windows queued the request until map registers free up: this interface wants the list now, so the
        // request is abandoned and the callback puts the list back when it comes.
        None => Err(STATUS_INSUFFICIENT_RESOURCES),
    }
}

fn copy_list(list: usize) -> SCATTER_GATHER_LIST {
    let raw = list as *const WdkSgList;
    // SAFETY: Windows hands the callback a valid list of NumberOfElements elements (a flexible array member).
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
/// `list` came from get_scatter_gather_list on this adapter and is put back once.
pub unsafe fn put_scatter_gather_list(adapter: PDMA_ADAPTER, list: PSCATTER_GATHER_LIST, write_to_device: bool) {
    // SAFETY: the caller's contract.
    unsafe { put_list(adapter, list.0 as usize, write_to_device) }
}

/// # Safety
/// Live adapter and device objects.
pub unsafe fn allocate_adapter_channel(
    adapter: PDMA_ADAPTER,
    device: PDEVICE_OBJECT,
    number_of_map_registers: u32,
    action: IO_ALLOCATION_ACTION,
) -> Result<MAP_REGISTER_BASE, NTSTATUS> {
    // SAFETY: the caller's contract.
    let Some(allocate) = unsafe { ops(adapter) }.AllocateAdapterChannel else { return Err(STATUS_NOT_SUPPORTED) };
    let context = Handshake::new(adapter, false, action == IO_ALLOCATION_ACTION::KeepObject);
    // SAFETY: AllocateAdapterChannel at DISPATCH_LEVEL; the context outlives the call as in the S/G case.
    let status = at_dispatch(|| unsafe {
        allocate(
            adapter_ptr(adapter),
            device.0 as *const DEVICE_OBJECT,
            number_of_map_registers,
            Some(execution_routine),
            context as *const c_void,
        )
    });
    if status < 0 {
        // SAFETY: on failure the routine never runs.
        drop(unsafe { Box::from_raw(context) });
        return Err(NTSTATUS(status));
    }
    // SAFETY: context from Handshake::new.
    match unsafe { Handshake::claim(context) } {
        Some(base) => Ok(MAP_REGISTER_BASE(base as u64)),
        None => Err(STATUS_INSUFFICIENT_RESOURCES),
    }
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
    table_call!(adapter, FreeAdapterChannel, (), |f| at_dispatch(|| unsafe { f(adapter_ptr(adapter)) }))
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
    table_call!(adapter, FreeMapRegisters, (), |f| at_dispatch(|| unsafe {
        f(adapter_ptr(adapter), base.0 as *mut c_void, count)
    }))
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
