//! The memory and DMA routines a driver binary calls, called here as the binary calls them (the bound addresses,
//! the Windows x64 convention, Windows-layout DMA_ADAPTER / MDL / SCATTER_GATHER_LIST) over the NT model with DMA
//! checking and the in-process host backend standing in for the device: what the driver writes through the
//! addresses it gets is what the device reads at the logical addresses it gets. One kernel per process.

mod common;

use std::ffi::c_void;
use std::sync::Mutex;

use common::{routine, NoBus};
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_ntmodel::{NtModel, NtModelConfig, VerifierFlags};
use windows_sys::Wdk::Foundation::MDL;
use windows_sys::Wdk::System::SystemServices::{
    DEVICE_DESCRIPTION, DMA_ADAPTER, DMA_OPERATIONS, SCATTER_GATHER_ELEMENT, SCATTER_GATHER_LIST,
};
use windows_sys::Win32::Foundation::NTSTATUS;

/// IoFreeMdl, as the driver calls it.
unsafe fn free_mdl_now(mdl: *mut MDL) {
    let free: unsafe extern "win64" fn(*mut MDL) = routine("IoFreeMdl");
    // SAFETY: an MDL IoAllocateMdl made, freed once.
    unsafe { free(mdl) }
}

/// A DMA_OPERATIONS slot as the routine the driver calls.
fn slot<T: Copy, F: Copy>(entry: Option<T>) -> F {
    let routine = entry.expect("the table has the routine");
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<F>());
    // SAFETY: both are one function pointer; F is the slot's Windows x64 signature.
    unsafe { std::mem::transmute_copy::<T, F>(&routine) }
}

/// What the AdapterListControl routine received: (IRQL, list address, elements).
type Delivery = (u8, usize, Vec<(i64, u32)>);
static DELIVERED: Mutex<Vec<Delivery>> = Mutex::new(Vec::new());

unsafe extern "win64" fn list_control(
    _d: *mut c_void,
    _irp: *mut c_void,
    list: *mut SCATTER_GATHER_LIST,
    _c: *mut c_void,
) {
    let irql: unsafe extern "win64" fn() -> u8 = routine("KeGetCurrentIrql");
    // SAFETY: the list the adapter delivered, NumberOfElements elements after the header.
    let elements = unsafe {
        let first = std::ptr::addr_of!((*list).Elements) as *const SCATTER_GATHER_ELEMENT;
        (0..(*list).NumberOfElements as usize).map(|i| ((*first.add(i)).Address, (*first.add(i)).Length)).collect()
    };
    // SAFETY: the thunk.
    DELIVERED.lock().unwrap().push((unsafe { irql() }, list as usize, elements));
}

#[test]
fn common_buffers_and_scatter_gather_lists_reach_the_device() {
    let flags = VerifierFlags::DMA_CHECKING.0 | VerifierFlags::IRQL_CHECKING.0 | VerifierFlags::POOL_TRACKING.0;
    let (model, backend) = NtModel::for_tests(NtModelConfig { verifier: VerifierFlags(flags), ..Default::default() });
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    let pdo = 0xFFFF_C000_0000_1000usize as *mut c_void;

    // SAFETY (all calls below): the thunks and table routines with their Windows signatures and live arguments.
    unsafe {
        let get_adapter: unsafe extern "win64" fn(
            *mut c_void,
            *const DEVICE_DESCRIPTION,
            *mut u32,
        ) -> *mut DMA_ADAPTER = routine("IoGetDmaAdapter");
        let description = DEVICE_DESCRIPTION {
            Version: 3,
            Master: true,
            ScatterGather: true,
            Dma32BitAddresses: true,
            Dma64BitAddresses: true,
            InterfaceType: 5,
            MaximumLength: 64 * 1024,
            ..std::mem::zeroed()
        };
        let mut map_registers = 0u32;
        let adapter = get_adapter(pdo, &description, &mut map_registers);
        assert!(!adapter.is_null());
        assert!(map_registers > 0);
        let ops: &DMA_OPERATIONS = &*(*adapter).DmaOperations;
        assert_eq!(ops.Size as usize, std::mem::size_of::<DMA_OPERATIONS>());

        // A common buffer: the driver's writes are the device's reads at the logical address, and back.
        let allocate: unsafe extern "win64" fn(*mut DMA_ADAPTER, u32, *mut i64, u8) -> *mut u8 =
            slot(ops.AllocateCommonBuffer);
        let mut logical = 0i64;
        let buffer = allocate(adapter, 4096, &mut logical, 1);
        assert!(!buffer.is_null() && logical != 0);
        std::ptr::copy_nonoverlapping(b"ring entry".as_ptr(), buffer.add(64), 10);
        let mut seen = [0u8; 10];
        backend.device_read(logical as u64 + 64, &mut seen).expect("device reads the common buffer");
        assert_eq!(&seen, b"ring entry");
        backend.device_write(logical as u64 + 128, b"completion").expect("device writes the common buffer");
        assert_eq!(std::slice::from_raw_parts(buffer.add(128), 10), b"completion");

        // Pool described by an MDL, mapped by GetScatterGatherList at DISPATCH_LEVEL: the list arrives in
        // Windows' layout at DISPATCH_LEVEL, and the device reads the data (a shadow, under DMA checking).
        let pool: unsafe extern "win64" fn(u64, usize, u32) -> *mut u8 = routine("ExAllocatePool2");
        let data = pool(0x40, 8192, u32::from_le_bytes(*b"vhca"));
        for i in 0..8192 {
            *data.add(i) = (i % 251) as u8;
        }
        let allocate_mdl: unsafe extern "win64" fn(*mut u8, u32, u8, u8, *mut c_void) -> *mut MDL =
            routine("IoAllocateMdl");
        let build: unsafe extern "win64" fn(*mut MDL) = routine("MmBuildMdlForNonPagedPool");
        let mdl = allocate_mdl(data, 8192, 0, 0, std::ptr::null_mut());
        build(mdl);
        assert_eq!(((*mdl).StartVa as usize + (*mdl).ByteOffset as usize, (*mdl).ByteCount), (data as usize, 8192));
        let raise: unsafe extern "win64" fn(u8) -> u8 = routine("KfRaiseIrql");
        let lower: unsafe extern "win64" fn(u8) = routine("KeLowerIrql");
        type GetSg = unsafe extern "win64" fn(
            *mut DMA_ADAPTER,
            *mut c_void,
            *mut MDL,
            *mut u8,
            u32,
            usize,
            *mut c_void,
            u8,
        ) -> NTSTATUS;
        let get_sg: GetSg = slot(ops.GetScatterGatherList);
        let put_sg: unsafe extern "win64" fn(*mut DMA_ADAPTER, *mut SCATTER_GATHER_LIST, u8) =
            slot(ops.PutScatterGatherList);
        let old = raise(2);
        let status = get_sg(adapter, pdo, mdl, data, 8192, list_control as *const () as usize, std::ptr::null_mut(), 1);
        assert_eq!(status, 0);
        let (irql, list, elements) = DELIVERED.lock().unwrap().pop().expect("AdapterListControl ran");
        assert_eq!(irql, 2, "AdapterListControl runs at DISPATCH_LEVEL");
        assert_eq!(elements.iter().map(|(_, l)| *l as usize).sum::<usize>(), 8192);
        let mut device_view = vec![0u8; 8192];
        let mut at = 0;
        for (address, length) in &elements {
            backend.device_read(*address as u64, &mut device_view[at..at + *length as usize]).expect("mapped");
            at += *length as usize;
        }
        assert!(device_view.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8), "the device sees the data");
        put_sg(adapter, list as *mut SCATTER_GATHER_LIST, 1);
        lower(old);
        assert!(backend.device_read(elements[0].0 as u64, &mut [0u8; 1]).is_err(), "unmapped after the put");

        // CreateCommonBufferFromMdl refuses an MDL that is not page-aligned whole pages (Microsoft's page:
        // STATUS_INVALID_PARAMETER for an incompatible MDL), and takes one that is.
        type FromMdl = unsafe extern "win64" fn(*mut DMA_ADAPTER, *mut MDL, *const c_void, u32, *mut i64) -> NTSTATUS;
        let from_mdl: FromMdl = slot(ops.CreateCommonBufferFromMdl);
        let mut from_mdl_logical = 0i64;
        let unaligned = allocate_mdl(data.add(0x230), 4096, 0, 0, std::ptr::null_mut());
        assert_ne!((data as usize + 0x230) % 4096, 0);
        build(unaligned);
        let status = from_mdl(adapter, unaligned, std::ptr::null(), 0, &mut from_mdl_logical);
        assert_eq!(status as u32, 0xC000_000D, "an MDL starting 0x230 into its page is refused");
        free_mdl_now(unaligned);
        let partial = allocate_mdl(data, 4000, 0, 0, std::ptr::null_mut());
        build(partial);
        let status = from_mdl(adapter, partial, std::ptr::null(), 0, &mut from_mdl_logical);
        assert_eq!(status as u32, 0xC000_000D, "an MDL of 4000 bytes (not whole pages) is refused");
        free_mdl_now(partial);
        let block = pool(0x40, 3 * 4096, u32::from_le_bytes(*b"vhca"));
        let pages = block.add(block.align_offset(4096));
        let whole = allocate_mdl(pages, 8192, 0, 0, std::ptr::null_mut());
        build(whole);
        assert_eq!(from_mdl(adapter, whole, std::ptr::null(), 0, &mut from_mdl_logical), 0, "two whole pages");
        let free_common_mdl: unsafe extern "win64" fn(*mut DMA_ADAPTER, u32, i64, *mut u8, u8) =
            slot(ops.FreeCommonBuffer);
        free_common_mdl(adapter, 8192, from_mdl_logical, pages, 1);
        free_mdl_now(whole);
        let free_block: unsafe extern "win64" fn(*mut u8, u32) = routine("ExFreePoolWithTag");
        free_block(block, u32::from_le_bytes(*b"vhca"));

        let free_mdl: unsafe extern "win64" fn(*mut MDL) = routine("IoFreeMdl");
        let free_pool: unsafe extern "win64" fn(*mut u8, u32) = routine("ExFreePoolWithTag");
        let free_common: unsafe extern "win64" fn(*mut DMA_ADAPTER, u32, i64, *mut u8, u8) = slot(ops.FreeCommonBuffer);
        let put_adapter: unsafe extern "win64" fn(*mut DMA_ADAPTER) = slot(ops.PutDmaAdapter);
        free_mdl(mdl);
        free_pool(data, u32::from_le_bytes(*b"vhca"));
        free_common(adapter, 4096, logical, buffer, 1);
        put_adapter(adapter);
    }
    let k = kernel();
    assert!(k.model.bugchecks().is_empty(), "{:?}", k.model.bugchecks());
    // Nothing left: the model's unload checks (pool tracking, DMA checking) pass.
    k.model.unload_driver();
}
