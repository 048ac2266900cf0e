//! IoGetDmaAdapter and the DMA_ADAPTER it returns: a Windows-layout DMA_ADAPTER whose DMA_OPERATIONS table holds
//! `extern "win64"` routines over the NT model's adapter, so map registers, double-buffered S/G lists under DMA
//! checking and every 0xE6 rule are the native build's. The driver's AdapterControl and AdapterListControl routines
//! are called back from the model's queue at DISPATCH_LEVEL, the list in Windows' SCATTER_GATHER_LIST layout.
//! Which model object stands behind each Windows one is `dma_table`'s.
#![allow(non_snake_case)] // Thunks carry the names of the routines they implement.

mod physical_address;
mod unimplemented;
mod version3;

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ffi::c_void;
use std::mem::{offset_of, size_of};
use std::sync::OnceLock;

use vhca_ntapi::{
    NtKernel, DEVICE_DESCRIPTION, INTERFACE_TYPE, IO_ALLOCATION_ACTION, MAP_REGISTER_BASE, PDEVICE_OBJECT,
    PDMA_ADAPTER, PHYSICAL_ADDRESS, PSCATTER_GATHER_LIST, SCATTER_GATHER_LIST,
};
use windows_sys::Wdk::Foundation::MDL;
use windows_sys::Wdk::System::SystemServices::{
    DEVICE_DESCRIPTION as WDK_DEVICE_DESCRIPTION, DMA_ADAPTER, DMA_OPERATIONS, SCATTER_GATHER_ELEMENT,
    SCATTER_GATHER_LIST as WDK_SG_LIST,
};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_INVALID_PARAMETER, STATUS_SUCCESS};

use crate::driver_stack::{at_driver_site, site_entry};
use crate::kernel_context::kernel;

/// DRIVER_CONTROL and DRIVER_LIST_CONTROL as the driver compiled them.
type DriverControl = unsafe extern "win64" fn(*mut c_void, *mut c_void, *mut c_void, *mut c_void) -> i32;
type DriverListControl = unsafe extern "win64" fn(*mut c_void, *mut c_void, *mut WDK_SG_LIST, *mut c_void);

fn adapter_of(adapter: *mut DMA_ADAPTER) -> PDMA_ADAPTER {
    kernel().dma.model_adapter(adapter)
}

fn mdl_of(mdl: *const MDL) -> vhca_ntapi::PMDL {
    kernel().mdls.model_mdl(mdl)
}

/// IoGetDmaAdapter(PhysicalDeviceObject, DeviceDescription, NumberOfMapRegisters).
unsafe extern "win64" fn IoGetDmaAdapter(
    pdo: *mut c_void,
    description: *const WDK_DEVICE_DESCRIPTION,
    map_registers: *mut u32,
) -> *mut DMA_ADAPTER {
    if description.is_null() || map_registers.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the driver's DEVICE_DESCRIPTION, in Windows' layout.
    let d = unsafe { &*description };
    let description = DEVICE_DESCRIPTION {
        Version: d.Version,
        Master: d.Master,
        ScatterGather: d.ScatterGather,
        Dma32BitAddresses: d.Dma32BitAddresses,
        Dma64BitAddresses: d.Dma64BitAddresses,
        // The model describes PCI bus masters only (the HCA); any other bus is the driver's mistake to find.
        InterfaceType: INTERFACE_TYPE::PCIBus,
        MaximumLength: d.MaximumLength,
        DmaAddressWidth: d.DmaAddressWidth,
    };
    let k = kernel();
    let mut granted = 0u32;
    let model = k.model.IoGetDmaAdapter(PDEVICE_OBJECT(pdo as u64), &description, &mut granted);
    if model.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the driver's out parameter.
    unsafe { *map_registers = granted };
    let adapter = Box::into_raw(Box::new(DMA_ADAPTER {
        Version: 3,
        Size: size_of::<DMA_ADAPTER>() as u16,
        DmaOperations: operations(),
    }));
    k.dma.insert_adapter(adapter, model);
    adapter
}

/// Stores a Windows x64 routine in a windows-sys slot (typed `extern "system"`, the SysV convention on Linux): the
/// pointer as it is, for the driver to call as Windows x64.
///
/// # Safety
/// `routine` has the slot's Windows signature.
unsafe fn store<T>(slot: &mut Option<T>, routine: usize) {
    assert_eq!(size_of::<Option<T>>(), size_of::<usize>());
    // SAFETY: an Option of a function pointer is one pointer-sized word (asserted), NULL for None.
    unsafe { (slot as *mut Option<T>).cast::<usize>().write(routine) }
}

// The routines the low-resources simulation can fail (with `faults_dma`) enter through a stub that finds the
// driver's call site first.
site_entry!(AllocateCommonBuffer_entry => AllocateCommonBuffer);
site_entry!(GetScatterGatherList_entry => GetScatterGatherList);

/// The one DMA_OPERATIONS table, version 3 (every adapter gets it: a driver that asked for version 1 or 2 reads only
/// the slots its version has). No slot is NULL: the routines the model stands behind are here and in `version3`,
/// the rest are `unimplemented`'s stand-ins, which log their name and fail.
fn operations() -> *mut DMA_OPERATIONS {
    struct Table(*mut DMA_OPERATIONS);
    // SAFETY: the table is written once, before it is shared, and never again.
    unsafe impl Send for Table {}
    // SAFETY: as above.
    unsafe impl Sync for Table {}
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE
        .get_or_init(|| {
            // SAFETY: DMA_OPERATIONS is a Size and routine pointers: all-zero is a valid, empty table.
            let mut t: DMA_OPERATIONS = unsafe { std::mem::zeroed() };
            t.Size = size_of::<DMA_OPERATIONS>() as u32;
            // SAFETY (each slot): a routine with the slot's Windows x64 signature, stored as the pointer it is.
            unsafe {
                store(&mut t.PutDmaAdapter, PutDmaAdapter as *const () as usize);
                store(&mut t.AllocateCommonBuffer, AllocateCommonBuffer_entry as *const () as usize);
                store(&mut t.FreeCommonBuffer, FreeCommonBuffer as *const () as usize);
                store(&mut t.AllocateAdapterChannel, AllocateAdapterChannel as *const () as usize);
                store(&mut t.FlushAdapterBuffers, FlushAdapterBuffers as *const () as usize);
                store(&mut t.FreeAdapterChannel, FreeAdapterChannel as *const () as usize);
                store(&mut t.FreeMapRegisters, FreeMapRegisters as *const () as usize);
                store(&mut t.MapTransfer, MapTransfer as *const () as usize);
                store(&mut t.GetScatterGatherList, GetScatterGatherList_entry as *const () as usize);
                store(&mut t.PutScatterGatherList, PutScatterGatherList as *const () as usize);
                store(&mut t.CreateCommonBufferFromMdl, CreateCommonBufferFromMdl as *const () as usize);
                store(&mut t.GetDmaAlignment, version3::GetDmaAlignment as *const () as usize);
                let calculate = version3::CalculateScatterGatherList as *const () as usize;
                store(&mut t.CalculateScatterGatherList, calculate);
                store(&mut t.BuildScatterGatherList, version3::BuildScatterGatherList as *const () as usize);
                store(&mut t.GetDmaAdapterInfo, version3::GetDmaAdapterInfo as *const () as usize);
                store(&mut t.GetDmaTransferInfo, version3::GetDmaTransferInfo as *const () as usize);
                let initialize = version3::InitializeDmaTransferContext as *const () as usize;
                store(&mut t.InitializeDmaTransferContext, initialize);
                store(&mut t.AllocateCommonBufferEx, version3::AllocateCommonBufferEx as *const () as usize);
                store(&mut t.BuildScatterGatherListEx, version3::BuildScatterGatherListEx as *const () as usize);
                store(&mut t.GetScatterGatherListEx, version3::GetScatterGatherListEx as *const () as usize);
                store_stand_ins(&mut t);
            }
            Table(Box::into_raw(Box::new(t)))
        })
        .0
}

/// Fills every slot still NULL with `unimplemented`'s stand-in of the same name.
///
/// # Safety
/// `t` is the table being built; each stand-in has its slot's return type (`unimplemented` says why its missing
/// parameters are sound).
unsafe fn store_stand_ins(t: &mut DMA_OPERATIONS) {
    let slots = slot_names();
    let words = t as *mut DMA_OPERATIONS as *mut usize;
    for (name, routine) in unimplemented::all() {
        let at = slots.iter().position(|s| *s == name).expect("a stand-in names a DMA_OPERATIONS slot");
        // SAFETY: slot `at` is the pointer-sized word `at + 1` of the table (after Size, padded to a word).
        unsafe {
            let slot = words.add(at + 1);
            assert_eq!(*slot, 0, "{name} is implemented and stood in for");
            *slot = routine;
        }
    }
}

/// DMA_OPERATIONS' routine slots in their order (learn.microsoft.com's ns-wdm-_dma_operations; windows-sys's
/// struct, which `the_table_has_no_null_slot` holds to the same order).
pub fn slot_names() -> [&'static str; 39] {
    [
        "PutDmaAdapter",
        "AllocateCommonBuffer",
        "FreeCommonBuffer",
        "AllocateAdapterChannel",
        "FlushAdapterBuffers",
        "FreeAdapterChannel",
        "FreeMapRegisters",
        "MapTransfer",
        "GetDmaAlignment",
        "ReadDmaCounter",
        "GetScatterGatherList",
        "PutScatterGatherList",
        "CalculateScatterGatherList",
        "BuildScatterGatherList",
        "BuildMdlFromScatterGatherList",
        "GetDmaAdapterInfo",
        "GetDmaTransferInfo",
        "InitializeDmaTransferContext",
        "AllocateCommonBufferEx",
        "AllocateAdapterChannelEx",
        "ConfigureAdapterChannel",
        "CancelAdapterChannel",
        "MapTransferEx",
        "GetScatterGatherListEx",
        "BuildScatterGatherListEx",
        "FlushAdapterBuffersEx",
        "FreeAdapterObject",
        "CancelMappedTransfer",
        "AllocateDomainCommonBuffer",
        "FlushDmaBuffer",
        "JoinDmaDomain",
        "LeaveDmaDomain",
        "GetDmaDomain",
        "AllocateCommonBufferWithBounds",
        "AllocateCommonBufferVector",
        "GetCommonBufferFromVectorByIndex",
        "FreeCommonBufferFromVector",
        "FreeCommonBufferVector",
        "CreateCommonBufferFromMdl",
    ]
}

unsafe extern "win64" fn PutDmaAdapter(adapter: *mut DMA_ADAPTER) {
    let k = kernel();
    let model = adapter_of(adapter);
    k.model.PutDmaAdapter(model);
    // The DMA_ADAPTER stays allocated: a driver using it after PutDmaAdapter is the model's to catch, not a
    // use-after-free in the loader.
}

unsafe extern "win64" fn AllocateCommonBuffer(
    adapter: *mut DMA_ADAPTER,
    length: u32,
    logical: *mut i64,
    cache_enabled: u8,
) -> *mut c_void {
    let k = kernel();
    let mut address = PHYSICAL_ADDRESS(0);
    let va =
        at_driver_site(|| k.model.AllocateCommonBuffer(adapter_of(adapter), length, &mut address, cache_enabled != 0));
    if !logical.is_null() {
        // SAFETY: the driver's out parameter.
        unsafe { *logical = address.0 as i64 };
    }
    let at = k.addresses.to_host(&k.model, va);
    k.race_watch.insert_common_buffer(at, length as usize, va.0);
    at as *mut c_void
}

unsafe extern "win64" fn FreeCommonBuffer(
    adapter: *mut DMA_ADAPTER,
    length: u32,
    logical: i64,
    va: *mut c_void,
    cache_enabled: u8,
) {
    let k = kernel();
    if let Some(handle) = k.dma.remove_mdl_buffer(adapter, va as usize) {
        // A common buffer CreateCommonBufferFromMdl made: the model's IoUnmapCommonBuffer ends it.
        k.model.IoUnmapCommonBuffer(adapter_of(adapter), handle);
        return;
    }
    k.race_watch.remove(va as usize);
    k.model.FreeCommonBuffer(
        adapter_of(adapter),
        length,
        PHYSICAL_ADDRESS(logical as u64),
        k.addresses.model_va(va),
        cache_enabled != 0,
    );
    k.addresses.forget(va as usize);
}

unsafe extern "win64" fn AllocateAdapterChannel(
    adapter: *mut DMA_ADAPTER,
    device: *mut c_void,
    map_registers: u32,
    routine: usize,
    context: *mut c_void,
) -> NTSTATUS {
    let (device_address, context) = (device as usize, context as usize);
    let control = Box::new(move |_device: PDEVICE_OBJECT, base: MAP_REGISTER_BASE| {
        // SAFETY: the driver's DRIVER_CONTROL with its context, called at DISPATCH_LEVEL as Windows calls it.
        let action = unsafe {
            std::mem::transmute::<usize, DriverControl>(routine)(
                device_address as *mut c_void,
                std::ptr::null_mut(),
                base.0 as *mut c_void,
                context as *mut c_void,
            )
        };
        match action {
            1 => IO_ALLOCATION_ACTION::KeepObject,
            3 => IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters,
            _ => IO_ALLOCATION_ACTION::DeallocateObject,
        }
    });
    let k = kernel();
    k.model.AllocateAdapterChannel(adapter_of(adapter), PDEVICE_OBJECT(device as u64), map_registers, control).0
}

unsafe extern "win64" fn FlushAdapterBuffers(
    adapter: *mut DMA_ADAPTER,
    mdl: *const MDL,
    base: *mut c_void,
    current_va: *mut c_void,
    length: u32,
    write_to_device: u8,
) -> u8 {
    let k = kernel();
    k.model.FlushAdapterBuffers(
        adapter_of(adapter),
        mdl_of(mdl),
        MAP_REGISTER_BASE(base as u64),
        k.addresses.model_va(current_va),
        length,
        write_to_device != 0,
    ) as u8
}

unsafe extern "win64" fn FreeAdapterChannel(adapter: *mut DMA_ADAPTER) {
    kernel().model.FreeAdapterChannel(adapter_of(adapter))
}

unsafe extern "win64" fn FreeMapRegisters(adapter: *mut DMA_ADAPTER, base: *mut c_void, count: u32) {
    kernel().model.FreeMapRegisters(adapter_of(adapter), MAP_REGISTER_BASE(base as u64), count)
}

unsafe extern "win64" fn MapTransfer(
    adapter: *mut DMA_ADAPTER,
    mdl: *const MDL,
    base: *mut c_void,
    current_va: *mut c_void,
    length: *mut u32,
    write_to_device: u8,
) -> i64 {
    if length.is_null() {
        return 0;
    }
    let k = kernel();
    // SAFETY: the driver's in/out length.
    let length = unsafe { &mut *length };
    match k.model.MapTransfer(
        adapter_of(adapter),
        mdl_of(mdl),
        MAP_REGISTER_BASE(base as u64),
        k.addresses.model_va(current_va),
        length,
        write_to_device != 0,
    ) {
        Ok(address) => address.0 as i64,
        // Windows' MapTransfer cannot fail; the model's refusal leaves nothing mapped: length 0 says so.
        Err(_) => {
            *length = 0;
            0
        }
    }
}

/// A Windows-layout SCATTER_GATHER_LIST for the model's list: NumberOfElements, Reserved, then the elements.
fn windows_list(list: &SCATTER_GATHER_LIST) -> (*mut WDK_SG_LIST, usize) {
    let bytes = windows_list_bytes(list.Elements.len().max(1));
    let layout = Layout::from_size_align(bytes, 16).expect("list layout");
    // SAFETY: a non-zero size.
    let raw = unsafe { alloc_zeroed(layout) } as *mut WDK_SG_LIST;
    assert!(!raw.is_null(), "out of memory for a scatter/gather list");
    // SAFETY: a fresh block with room for every element after the header.
    unsafe { write_windows_list(raw, list) };
    (raw, bytes)
}

/// Bytes of a Windows SCATTER_GATHER_LIST of `elements` elements.
fn windows_list_bytes(elements: usize) -> usize {
    offset_of!(WDK_SG_LIST, Elements) + elements * size_of::<SCATTER_GATHER_ELEMENT>()
}

/// Writes the model's list at `raw` in Windows' layout.
///
/// # Safety
/// `raw` is writable for `windows_list_bytes(list.Elements.len())` bytes. It need not be aligned: a driver's own
/// list buffer (BuildScatterGatherList) is wherever the driver put it, so every field is written unaligned.
unsafe fn write_windows_list(raw: *mut WDK_SG_LIST, list: &SCATTER_GATHER_LIST) {
    let base = raw as *mut u8;
    // SAFETY: per the contract, room for the header and every element after it; unaligned writes throughout.
    unsafe {
        base.add(offset_of!(WDK_SG_LIST, NumberOfElements)).cast::<u32>().write_unaligned(list.Elements.len() as u32);
        base.add(offset_of!(WDK_SG_LIST, Reserved)).cast::<usize>().write_unaligned(0);
        let first = base.add(offset_of!(WDK_SG_LIST, Elements)) as *mut SCATTER_GATHER_ELEMENT;
        for (i, e) in list.Elements.iter().enumerate() {
            let element = SCATTER_GATHER_ELEMENT { Address: e.Address.0 as i64, Length: e.Length, Reserved: 0 };
            first.add(i).write_unaligned(element);
        }
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "win64" fn GetScatterGatherList(
    adapter: *mut DMA_ADAPTER,
    device: *mut c_void,
    mdl: *const MDL,
    current_va: *mut c_void,
    length: u32,
    routine: usize,
    context: *mut c_void,
    write_to_device: u8,
) -> NTSTATUS {
    let (device_address, context) = (device as usize, context as usize);
    let list_control = Box::new(move |_device: PDEVICE_OBJECT, list: &SCATTER_GATHER_LIST| {
        let (raw, bytes) = windows_list(list);
        kernel().dma.insert_list(raw, list.Handle, bytes);
        // SAFETY: the driver's DRIVER_LIST_CONTROL with its context, at DISPATCH_LEVEL as Windows calls it; the
        // list is the driver's until it gives it to PutScatterGatherList.
        unsafe {
            std::mem::transmute::<usize, DriverListControl>(routine)(
                device_address as *mut c_void,
                std::ptr::null_mut(),
                raw,
                context as *mut c_void,
            )
        }
    });
    let k = kernel();
    at_driver_site(|| {
        k.model.GetScatterGatherList(
            adapter_of(adapter),
            PDEVICE_OBJECT(device as u64),
            mdl_of(mdl),
            k.addresses.model_va(current_va),
            length,
            list_control,
            write_to_device != 0,
        )
    })
    .0
}

unsafe extern "win64" fn PutScatterGatherList(adapter: *mut DMA_ADAPTER, list: *mut WDK_SG_LIST, write_to_device: u8) {
    let k = kernel();
    if let Some(handle) = k.dma.remove_driver_list(list) {
        // A list BuildScatterGatherList(Ex) wrote into the driver's buffer: the buffer stays the driver's.
        k.model.PutScatterGatherList(adapter_of(adapter), handle, write_to_device != 0);
        return;
    }
    let Some((handle, bytes)) = k.dma.remove_list(list) else {
        // Not a list this adapter delivered (or put twice): the model judges the handle it is given.
        k.model.PutScatterGatherList(adapter_of(adapter), PSCATTER_GATHER_LIST(list as u64), write_to_device != 0);
        return;
    };
    k.model.PutScatterGatherList(adapter_of(adapter), handle, write_to_device != 0);
    // SAFETY: the block windows_list made with this size, freed once (removed from the table above).
    unsafe { dealloc(list as *mut u8, Layout::from_size_align(bytes, 16).expect("list layout")) };
}

/// CreateCommonBufferFromMdl(DmaAdapter, Mdl, ExtendedConfigs, ExtendedConfigsCount, LogicalAddress): the MDL's
/// pages become a common buffer, through the model's IoMapCommonBuffer (the seed's prototype, which this DDI is
/// the shipped form of). The buffer ends with FreeCommonBuffer, as Microsoft's page says.
unsafe extern "win64" fn CreateCommonBufferFromMdl(
    adapter: *mut DMA_ADAPTER,
    mdl: *const MDL,
    _configs: *const c_void,
    _count: u32,
    logical: *mut i64,
) -> NTSTATUS {
    if mdl.is_null() || logical.is_null() {
        return STATUS_INVALID_PARAMETER;
    }
    let k = kernel();
    // SAFETY: the driver's MDL.
    let (va, length) = unsafe { ((*mdl).StartVa as usize + (*mdl).ByteOffset as usize, (*mdl).ByteCount) };
    // Microsoft's page: "The MDL must represent a page-aligned region and be a multiple of PAGE_SIZE"; an
    // incompatible MDL is STATUS_INVALID_PARAMETER (a returned status: no 0xE6 rule names it). The model's
    // IoMapCommonBuffer, the seed's prototype, takes any buffer, so the DDI's rule is checked here.
    if !va.is_multiple_of(vhca_ntapi::PAGE_SIZE as usize)
        || length == 0
        || !(length as u64).is_multiple_of(vhca_ntapi::PAGE_SIZE)
    {
        return STATUS_INVALID_PARAMETER;
    }
    match k.model.IoMapCommonBuffer(adapter_of(adapter), mdl_of(mdl), length, true) {
        Ok((handle, list)) => {
            k.dma.insert_mdl_buffer(adapter, va, handle);
            // SAFETY: the driver's out parameter.
            unsafe { *logical = list.Elements.first().map_or(0, |e| e.Address.0 as i64) };
            STATUS_SUCCESS
        }
        Err(status) => status.0,
    }
}

pub fn dma_thunks() -> [(&'static str, usize); 2] {
    [
        ("IoGetDmaAdapter", IoGetDmaAdapter as *const () as usize),
        ("MmGetPhysicalAddress", physical_address::MmGetPhysicalAddress as *const () as usize),
    ]
}
