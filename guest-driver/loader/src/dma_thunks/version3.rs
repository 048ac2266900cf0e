//! The version 2 and 3 DMA_OPERATIONS routines the model stands behind (its `dma_v3`), called as the driver calls
//! them: Windows x64, Windows layouts of DMA_ADAPTER_INFO, DMA_TRANSFER_INFO and the driver's list buffer.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement.

use std::ffi::c_void;

use vhca_ntapi::{DMA_TRANSFER_INFO_VERSION2, PDEVICE_OBJECT, PHYSICAL_ADDRESS, PVOID, SCATTER_GATHER_LIST};
use vhca_ntmodel::ListRequest;
use windows_sys::Wdk::Foundation::MDL;
use windows_sys::Wdk::System::SystemServices::{DMA_ADAPTER, SCATTER_GATHER_LIST as WDK_SG_LIST};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_INVALID_PARAMETER, STATUS_SUCCESS};

use super::{adapter_of, mdl_of, windows_list, write_windows_list, DriverListControl};
use crate::kernel_context::kernel;

/// DMA_ADAPTER_INFO as wdm.h declares it: a union whose first member is `{ ULONG Version; DMA_ADAPTER_INFO_V1 V1; }`,
/// so V1 starts 4 bytes in. (windows-sys puts V1 in a union with the 8-aligned crash-dump member, 8 bytes in: the
/// driver's header, not windows-sys, is what the binary was compiled against.)
const ADAPTER_INFO_V1_OFFSET: usize = 4;
/// DMA_TRANSFER_INFO: `ULONG Version;` then the union of V1 and V2 (all ULONGs), 4 bytes in.
const TRANSFER_INFO_V_OFFSET: usize = 4;
/// DMA_TRANSFER_CONTEXT_SIZE_V1: the opaque context InitializeDmaTransferContext fills.
const TRANSFER_CONTEXT_BYTES: usize = 128;

/// GetDmaAdapterInfo(DmaAdapter, AdapterInfo).
pub(super) unsafe extern "win64" fn GetDmaAdapterInfo(adapter: *mut DMA_ADAPTER, info: *mut u8) -> NTSTATUS {
    if info.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    // SAFETY: the driver's DMA_ADAPTER_INFO; Version is its first ULONG.
    let version = unsafe { (info as *const u32).read_unaligned() };
    match kernel().model.get_dma_adapter_info(adapter_of(adapter), version) {
        Ok(v1) => {
            let fields = [v1.ReadDmaCounterAvailable, v1.ScatterGatherLimit, v1.DmaAddressWidth, v1.Flags];
            let fields = fields.into_iter().chain([v1.MinimumTransferUnit]);
            for (i, value) in fields.enumerate() {
                // SAFETY: DMA_ADAPTER_INFO holds the five ULONGs of V1 at ADAPTER_INFO_V1_OFFSET.
                unsafe { (info.add(ADAPTER_INFO_V1_OFFSET + 4 * i) as *mut u32).write_unaligned(value) };
            }
            STATUS_SUCCESS
        }
        Err(status) => status.0,
    }
}

/// GetDmaTransferInfo(DmaAdapter, Mdl, Offset, Length, WriteOnly, TransferInfo).
pub(super) unsafe extern "win64" fn GetDmaTransferInfo(
    adapter: *mut DMA_ADAPTER,
    mdl: *const MDL,
    offset: u64,
    length: u32,
    _write_only: u8,
    info: *mut u8,
) -> NTSTATUS {
    if info.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    // SAFETY: the driver's DMA_TRANSFER_INFO; Version is its first ULONG.
    let version = unsafe { (info as *const u32).read_unaligned() };
    match kernel().model.get_dma_transfer_info(adapter_of(adapter), mdl_of(mdl), offset, length, version) {
        Ok(t) => {
            let mut fields = vec![t.MapRegisterCount, t.ScatterGatherElementCount, t.ScatterGatherListSize];
            if version == DMA_TRANSFER_INFO_VERSION2 {
                fields.push(t.LogicalPageCount);
            }
            for (i, value) in fields.into_iter().enumerate() {
                // SAFETY: the version the driver set says how many ULONGs follow Version.
                unsafe { (info.add(TRANSFER_INFO_V_OFFSET + 4 * i) as *mut u32).write_unaligned(value) };
            }
            STATUS_SUCCESS
        }
        Err(status) => status.0,
    }
}

/// InitializeDmaTransferContext(DmaAdapter, DmaTransferContext): the context is opaque to the driver and the model
/// keeps nothing in it (no AllocateAdapterChannelEx or CancelAdapterChannel reads it), so it is zeroed.
pub(super) unsafe extern "win64" fn InitializeDmaTransferContext(
    _adapter: *mut DMA_ADAPTER,
    context: *mut u8,
) -> NTSTATUS {
    if context.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    // SAFETY: the driver allocated DMA_TRANSFER_CONTEXT_SIZE_V1 bytes, as the page requires.
    unsafe { context.write_bytes(0, TRANSFER_CONTEXT_BYTES) };
    STATUS_SUCCESS
}

/// AllocateCommonBufferEx(DmaAdapter, MaximumAddress, Length, LogicalAddress, CacheEnabled, PreferredNode).
pub(super) unsafe extern "win64" fn AllocateCommonBufferEx(
    adapter: *mut DMA_ADAPTER,
    maximum: *const i64,
    length: u32,
    logical: *mut i64,
    _cache_enabled: u8,
    _preferred_node: u32,
) -> *mut c_void {
    let k = kernel();
    // SAFETY: the driver's optional in parameter.
    let maximum = (!maximum.is_null()).then(|| PHYSICAL_ADDRESS(unsafe { *maximum } as u64));
    let mut address = PHYSICAL_ADDRESS(0);
    let va = k.model.allocate_common_buffer_ex(adapter_of(adapter), maximum, length, &mut address);
    if !logical.is_null() {
        // SAFETY: the driver's out parameter.
        unsafe { *logical = address.0 as i64 };
    }
    let at = k.addresses.to_host(&k.model, va);
    k.race_watch.insert_common_buffer(at, length as usize, va.0);
    at as *mut c_void
}

/// CalculateScatterGatherList(DmaAdapter, Mdl, CurrentVa, Length, ScatterGatherListSize, NumberOfMapRegisters).
pub(super) unsafe extern "win64" fn CalculateScatterGatherList(
    adapter: *mut DMA_ADAPTER,
    mdl: *const MDL,
    current_va: *mut c_void,
    length: u32,
    size: *mut u32,
    registers: *mut u32,
) -> NTSTATUS {
    if size.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    let k = kernel();
    let mdl = (!mdl.is_null()).then(|| mdl_of(mdl));
    match k.model.calculate_scatter_gather_list(adapter_of(adapter), mdl, k.addresses.model_va(current_va), length) {
        Ok((bytes, needed)) => {
            // SAFETY: the driver's out parameters (the second optional).
            unsafe {
                *size = bytes;
                if !registers.is_null() {
                    *registers = needed;
                }
            }
            STATUS_SUCCESS
        }
        Err(status) => status.0,
    }
}

/// GetDmaAlignment(DmaAdapter).
pub(super) unsafe extern "win64" fn GetDmaAlignment(adapter: *mut DMA_ADAPTER) -> u32 {
    kernel().model.get_dma_alignment(adapter_of(adapter))
}

/// Where a list goes in Windows' layout: the driver's buffer (BuildScatterGatherList(Ex)) or, when the driver gave
/// none (GetScatterGatherListEx), a block of the loader's, as GetScatterGatherList's.
struct DriverBuffer {
    /// 0: the loader allocates.
    buffer: usize,
    length: u32,
}

impl DriverBuffer {
    /// Writes `list` where it goes and ties it to the model's list for PutScatterGatherList.
    fn take(&self, list: &SCATTER_GATHER_LIST) -> *mut WDK_SG_LIST {
        if self.buffer == 0 {
            let (raw, bytes) = windows_list(list);
            kernel().dma.insert_list(raw, list.Handle, bytes);
            return raw;
        }
        let raw = self.buffer as *mut WDK_SG_LIST;
        // SAFETY: the model refused a buffer shorter than the most elements the transfer may take
        // (STATUS_BUFFER_TOO_SMALL); write_windows_list needs no alignment.
        unsafe { write_windows_list(raw, list) };
        kernel().dma.insert_driver_list(raw, list.Handle);
        raw
    }
}

#[allow(clippy::too_many_arguments)]
fn build(
    adapter: *mut DMA_ADAPTER,
    device: *mut c_void,
    mdl: *const MDL,
    va: PVOID,
    length: u32,
    flags: u32,
    routine: usize,
    context: *mut c_void,
    write_to_device: u8,
    buffer: DriverBuffer,
    out_list: *mut *mut WDK_SG_LIST,
) -> NTSTATUS {
    // Both pages: the call fails when neither a routine nor a ScatterGatherList pointer takes the list.
    if routine == 0 && out_list.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    let (device_address, context, length_given) = (device as usize, context as usize, buffer.length);
    // Only GetScatterGatherListEx leaves the list's memory to the loader, and only it runs up to DISPATCH_LEVEL.
    let get_ex = buffer.buffer == 0;
    let buffer = std::sync::Arc::new(buffer);
    let routine = (routine != 0).then(|| {
        let buffer = buffer.clone();
        Box::new(move |_device: PDEVICE_OBJECT, list: &SCATTER_GATHER_LIST| {
            let raw = buffer.take(list);
            // SAFETY: the driver's DRIVER_LIST_CONTROL with its context, at DISPATCH_LEVEL as Windows calls it; the
            // list is in the driver's buffer and the driver's until it gives it to PutScatterGatherList.
            unsafe {
                std::mem::transmute::<usize, DriverListControl>(routine)(
                    device_address as *mut c_void,
                    std::ptr::null_mut(),
                    raw,
                    context as *mut c_void,
                )
            }
        }) as vhca_ntapi::PDRIVER_LIST_CONTROL
    });
    let request = ListRequest {
        device: PDEVICE_OBJECT(device as u64),
        mdl: mdl_of(mdl),
        va,
        length,
        flags,
        routine,
        write_to_device: write_to_device != 0,
        buffer_length: length_given,
        up_to_dispatch: get_ex,
    };
    match kernel().model.build_scatter_gather_list(adapter_of(adapter), request) {
        Ok(Some(list)) => {
            let raw = buffer.take(&list);
            if !out_list.is_null() {
                // SAFETY: the driver's out parameter; the list is the buffer it gave, as the page says.
                unsafe { *out_list = raw };
            }
            STATUS_SUCCESS
        }
        Ok(None) => STATUS_SUCCESS,
        Err(status) => status.0,
    }
}

/// BuildScatterGatherListEx(DmaAdapter, DeviceObject, DmaTransferContext, Mdl, Offset, Length, Flags,
/// ExecutionRoutine, Context, WriteToDevice, ScatterGatherBuffer, ScatterGatherBufferLength, DmaCompletionRoutine,
/// CompletionContext, ScatterGatherList). DmaCompletionRoutine is "Not used" (its page) and ignored.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe extern "win64" fn BuildScatterGatherListEx(
    adapter: *mut DMA_ADAPTER,
    device: *mut c_void,
    _transfer_context: *mut c_void,
    mdl: *const MDL,
    offset: u64,
    length: u32,
    flags: u32,
    routine: usize,
    context: *mut c_void,
    write_to_device: u8,
    buffer: *mut c_void,
    buffer_length: u32,
    _completion: usize,
    _completion_context: *mut c_void,
    out_list: *mut *mut WDK_SG_LIST,
) -> NTSTATUS {
    if buffer.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    // SAFETY: the driver's MDL, as the caller's contract.
    let Some(va) = (unsafe { model_va_at(mdl, offset) }) else { return STATUS_INVALID_PARAMETER };
    let buffer = DriverBuffer { buffer: buffer as usize, length: buffer_length };
    build(adapter, device, mdl, va, length, flags, routine, context, write_to_device, buffer, out_list)
}

/// The model's address of the byte `offset` into `mdl`'s buffer, as the Ex routines name a transfer (an MDL and an
/// offset where the older ones take a CurrentVa); None for a NULL MDL or an offset past its ByteCount.
///
/// # Safety
/// `mdl` is NULL or a live MDL of the driver's.
unsafe fn model_va_at(mdl: *const MDL, offset: u64) -> Option<PVOID> {
    if mdl.is_null() {
        return None;
    }
    // SAFETY: a live MDL (the caller's contract); Offset counts from the start of its buffer.
    let (start, count) = unsafe { ((*mdl).StartVa as usize + (*mdl).ByteOffset as usize, (*mdl).ByteCount) };
    if offset >= count as u64 {
        return None;
    }
    Some(kernel().addresses.model_va((start + offset as usize) as *mut c_void))
}

/// GetScatterGatherListEx(DmaAdapter, DeviceObject, DmaTransferContext, Mdl, Offset, Length, Flags,
/// ExecutionRoutine, Context, WriteToDevice, DmaCompletionRoutine, CompletionContext, ScatterGatherList):
/// BuildScatterGatherListEx with the list in a block of the loader's, freed at PutScatterGatherList.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe extern "win64" fn GetScatterGatherListEx(
    adapter: *mut DMA_ADAPTER,
    device: *mut c_void,
    _transfer_context: *mut c_void,
    mdl: *const MDL,
    offset: u64,
    length: u32,
    flags: u32,
    routine: usize,
    context: *mut c_void,
    write_to_device: u8,
    _completion: usize,
    _completion_context: *mut c_void,
    out_list: *mut *mut WDK_SG_LIST,
) -> NTSTATUS {
    // SAFETY: the driver's MDL, as the caller's contract.
    let Some(va) = (unsafe { model_va_at(mdl, offset) }) else { return STATUS_INVALID_PARAMETER };
    let buffer = DriverBuffer { buffer: 0, length: u32::MAX };
    build(adapter, device, mdl, va, length, flags, routine, context, write_to_device, buffer, out_list)
}

/// BuildScatterGatherList(DmaAdapter, DeviceObject, Mdl, CurrentVa, Length, ExecutionRoutine, Context,
/// WriteToDevice, ScatterGatherBuffer, ScatterGatherLength): GetScatterGatherList into the driver's buffer.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe extern "win64" fn BuildScatterGatherList(
    adapter: *mut DMA_ADAPTER,
    device: *mut c_void,
    mdl: *const MDL,
    current_va: *mut c_void,
    length: u32,
    routine: usize,
    context: *mut c_void,
    write_to_device: u8,
    buffer: *mut c_void,
    buffer_length: u32,
) -> NTSTATUS {
    if routine == 0 {
        return STATUS_INVALID_PARAMETER;
    }
    if buffer.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    let va = kernel().addresses.model_va(current_va);
    let buffer = DriverBuffer { buffer: buffer as usize, length: buffer_length };
    let out = std::ptr::null_mut();
    build(adapter, device, mdl, va, length, 0, routine, context, write_to_device, buffer, out)
}

#[cfg(test)]
mod tests {
    use std::mem::{offset_of, size_of};

    use windows_sys::Wdk::System::SystemServices::{DMA_TRANSFER_INFO, SCATTER_GATHER_ELEMENT};

    use super::*;

    #[test]
    fn the_layouts_the_model_sizes_lists_by_are_windows_x64s() {
        assert_eq!(offset_of!(WDK_SG_LIST, Elements) as u32, vhca_ntapi::SCATTER_GATHER_LIST_HEADER_BYTES);
        assert_eq!(size_of::<SCATTER_GATHER_ELEMENT>() as u32, vhca_ntapi::SCATTER_GATHER_ELEMENT_BYTES);
        assert_eq!(offset_of!(DMA_TRANSFER_INFO, Anonymous), TRANSFER_INFO_V_OFFSET);
        assert_eq!(vhca_ntapi::DMA_ADAPTER_INFO_VERSION1, 1);
    }
}
