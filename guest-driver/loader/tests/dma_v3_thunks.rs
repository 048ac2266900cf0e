//! The version 3 slots of the loader's DMA_OPERATIONS, called through the table as a driver binary calls them
//! (Windows x64, Windows layouts of DMA_ADAPTER_INFO, DMA_TRANSFER_INFO and a driver-supplied list buffer), over the
//! NT model with DMA checking: no slot is NULL, each implemented routine answers as its page says, and a slot the
//! loader does not implement fails with its documented status. One kernel per process.

mod common;

use std::ffi::c_void;
use std::sync::Mutex;

use common::{routine, NoBus};
use vhca_loader::dma_thunks::slot_names;
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_ntmodel::{NtModel, NtModelConfig, VerifierFlags};
use windows_sys::Wdk::Foundation::MDL;
use windows_sys::Wdk::System::SystemServices::{
    DEVICE_DESCRIPTION, DMA_ADAPTER, DMA_OPERATIONS, SCATTER_GATHER_ELEMENT, SCATTER_GATHER_LIST,
};
use windows_sys::Win32::Foundation::NTSTATUS;

const STATUS_NOT_SUPPORTED: u32 = 0xC000_00BB;
const STATUS_BUFFER_TOO_SMALL: u32 = 0xC000_0023;
const STATUS_INVALID_PARAMETER: u32 = 0xC000_000D;

/// The table's routine slot `name` as the routine the driver calls.
fn slot<F: Copy>(ops: &DMA_OPERATIONS, name: &str) -> F {
    let at = slot_names().iter().position(|s| *s == name).expect("a DMA_OPERATIONS slot");
    // SAFETY: slot `at` is the word after Size and `at` routine words; F is its Windows x64 signature.
    let address = unsafe { *(ops as *const DMA_OPERATIONS as *const usize).add(at + 1) };
    assert_ne!(address, 0, "{name} is not NULL");
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<usize>());
    // SAFETY: as above.
    unsafe { std::mem::transmute_copy::<usize, F>(&address) }
}

/// Elements of a Windows list, as the device would be handed them.
unsafe fn elements(list: *const SCATTER_GATHER_LIST) -> Vec<(i64, u32)> {
    // SAFETY: the caller's list, NumberOfElements elements after the header.
    unsafe {
        let first = std::ptr::addr_of!((*list).Elements) as *const SCATTER_GATHER_ELEMENT;
        (0..(*list).NumberOfElements as usize).map(|i| ((*first.add(i)).Address, (*first.add(i)).Length)).collect()
    }
}

/// What AdapterListControl received: (IRQL, list address, its context).
static DELIVERED: Mutex<Vec<(u8, usize, usize)>> = Mutex::new(Vec::new());

unsafe extern "win64" fn list_control(
    _d: *mut c_void,
    _irp: *mut c_void,
    list: *mut SCATTER_GATHER_LIST,
    c: *mut c_void,
) {
    let irql: unsafe extern "win64" fn() -> u8 = routine("KeGetCurrentIrql");
    // SAFETY: the thunk.
    DELIVERED.lock().unwrap().push((unsafe { irql() }, list as usize, c as usize));
}

type BuildEx = unsafe extern "win64" fn(
    *mut DMA_ADAPTER,
    *mut c_void,
    *mut u8,
    *mut MDL,
    u64,
    u32,
    u32,
    usize,
    *mut c_void,
    u8,
    *mut u8,
    u32,
    usize,
    *mut c_void,
    *mut *mut SCATTER_GATHER_LIST,
) -> NTSTATUS;

type GetEx = unsafe extern "win64" fn(
    *mut DMA_ADAPTER,
    *mut c_void,
    *mut u8,
    *mut MDL,
    u64,
    u32,
    u32,
    usize,
    *mut c_void,
    u8,
    usize,
    *mut c_void,
    *mut *mut SCATTER_GATHER_LIST,
) -> NTSTATUS;

#[test]
fn version_3_slots_answer_through_the_windows_abi_and_none_is_null() {
    let flags = VerifierFlags::DMA_CHECKING.0 | VerifierFlags::IRQL_CHECKING.0;
    let config = NtModelConfig { verifier: VerifierFlags(flags), max_contiguous_pages: Some(2), ..Default::default() };
    let (model, backend) = NtModel::for_tests(config);
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
            DmaAddressWidth: 48,
            ..std::mem::zeroed()
        };
        let mut map_registers = 0u32;
        let adapter = get_adapter(pdo, &description, &mut map_registers);
        assert!(!adapter.is_null());
        let ops: &DMA_OPERATIONS = &*(*adapter).DmaOperations;
        let words = std::mem::size_of::<DMA_OPERATIONS>() / 8;
        assert_eq!(words, slot_names().len() + 1, "Size and one word per slot, in the order slot_names gives");
        for (i, name) in slot_names().iter().enumerate() {
            let address = *(ops as *const DMA_OPERATIONS as *const usize).add(i + 1);
            assert_ne!(address, 0, "{name} is NULL");
        }

        // GetDmaAdapterInfo: DMA_ADAPTER_INFO_VERSION1 gets V1, 4 bytes in (wdm.h's layout); version 2 is refused.
        let info_of: unsafe extern "win64" fn(*mut DMA_ADAPTER, *mut u32) -> NTSTATUS = slot(ops, "GetDmaAdapterInfo");
        let mut info = [0u32; 8];
        info[0] = 1;
        assert_eq!(info_of(adapter, info.as_mut_ptr()), 0);
        assert_eq!((info[2], info[3], info[5]), (u32::MAX, 48, 1), "ScatterGatherLimit, DmaAddressWidth, unit");
        info[0] = 2;
        assert_eq!(info_of(adapter, info.as_mut_ptr()) as u32, STATUS_NOT_SUPPORTED);

        // GetDmaTransferInfo over a fragmented pool buffer (runs of 2 pages): 3 elements, their bytes, the pages.
        let pool: unsafe extern "win64" fn(u64, usize, u32) -> *mut u8 = routine("ExAllocatePool2");
        let data = pool(0x40, 5 * 4096, u32::from_le_bytes(*b"vhca"));
        let allocate_mdl: unsafe extern "win64" fn(*mut u8, u32, u8, u8, *mut c_void) -> *mut MDL =
            routine("IoAllocateMdl");
        let build_mdl: unsafe extern "win64" fn(*mut MDL) = routine("MmBuildMdlForNonPagedPool");
        let mdl = allocate_mdl(data, 5 * 4096, 0, 0, std::ptr::null_mut());
        build_mdl(mdl);
        let transfer_info: unsafe extern "win64" fn(*mut DMA_ADAPTER, *mut MDL, u64, u32, u8, *mut u32) -> NTSTATUS =
            slot(ops, "GetDmaTransferInfo");
        let mut t = [2u32, 0, 0, 0, 0];
        assert_eq!(transfer_info(adapter, mdl, 0x100, 4 * 4096, 1, t.as_mut_ptr()), 0);
        // Under DMA checking every page costs a map register (double buffering).
        assert_eq!(t[1..], [5, 3, 16 + 3 * 24, 5], "MapRegisterCount, elements, ListSize, LogicalPageCount");

        // CalculateScatterGatherList (version 2): the actual size with the MDL, the most without it.
        type Calculate =
            unsafe extern "win64" fn(*mut DMA_ADAPTER, *mut MDL, *mut u8, u32, *mut u32, *mut u32) -> NTSTATUS;
        let calculate: Calculate = slot(ops, "CalculateScatterGatherList");
        let (mut size, mut registers) = (0u32, 99u32);
        assert_eq!(calculate(adapter, mdl, data.add(0x100), 4 * 4096, &mut size, &mut registers), 0);
        assert_eq!((size, registers), (16 + 3 * 24, 5));
        assert_eq!(
            calculate(adapter, std::ptr::null_mut(), data.add(0x100), 4 * 4096, &mut size, std::ptr::null_mut()),
            0
        );
        assert_eq!(size, 16 + 5 * 24);

        // BuildScatterGatherListEx into the driver's buffer: too small is refused; DMA_SYNCHRONOUS_CALLBACK without
        // a routine hands the list back in the buffer; with a routine it runs at DISPATCH_LEVEL on the buffer.
        let init: unsafe extern "win64" fn(*mut DMA_ADAPTER, *mut u8) -> NTSTATUS =
            slot(ops, "InitializeDmaTransferContext");
        let mut context = [0xAAu8; 128];
        assert_eq!(init(adapter, context.as_mut_ptr()), 0);
        assert!(context.iter().all(|b| *b == 0));
        let build_ex: BuildEx = slot(ops, "BuildScatterGatherListEx");
        let put: unsafe extern "win64" fn(*mut DMA_ADAPTER, *mut SCATTER_GATHER_LIST, u8) =
            slot(ops, "PutScatterGatherList");
        let raise: unsafe extern "win64" fn(u8) -> u8 = routine("KfRaiseIrql");
        let lower: unsafe extern "win64" fn(u8) = routine("KeLowerIrql");
        let mut buffer = vec![0u64; 64];
        let buffer_ptr = buffer.as_mut_ptr() as *mut u8;
        let mut out: *mut SCATTER_GATHER_LIST = std::ptr::null_mut();
        let null = std::ptr::null_mut();
        let old = raise(2);
        let status = build_ex(
            adapter,
            pdo,
            context.as_mut_ptr(),
            mdl,
            0x100,
            4 * 4096,
            1,
            0,
            null,
            1,
            buffer_ptr,
            39,
            0,
            null,
            &mut out,
        );
        assert_eq!(status as u32, STATUS_BUFFER_TOO_SMALL);
        let status = build_ex(
            adapter,
            pdo,
            context.as_mut_ptr(),
            mdl,
            0x100,
            4 * 4096,
            0,
            0,
            null,
            1,
            buffer_ptr,
            512,
            0,
            null,
            &mut out,
        );
        assert_eq!(status as u32, STATUS_INVALID_PARAMETER, "no routine and not synchronous");
        let status = build_ex(
            adapter,
            pdo,
            context.as_mut_ptr(),
            mdl,
            0x100,
            4 * 4096,
            1,
            0,
            null,
            1,
            buffer_ptr,
            512,
            0,
            null,
            &mut out,
        );
        assert_eq!(status, 0);
        assert_eq!(out as usize, buffer_ptr as usize, "the list is the driver's buffer");
        let list = elements(out);
        assert_eq!(list.iter().map(|(_, l)| *l).sum::<u32>(), 4 * 4096);
        let mut seen = vec![0u8; 4096];
        backend.device_read(list[0].0 as u64, &mut seen).expect("the device reads the first element");
        put(adapter, out, 1);
        let ctx = 0x5EED as *mut c_void;
        let routine_address = list_control as *const () as usize;
        let status = build_ex(
            adapter,
            pdo,
            context.as_mut_ptr(),
            mdl,
            0,
            4096,
            0,
            routine_address,
            ctx,
            1,
            buffer_ptr,
            512,
            0,
            null,
            null as _,
        );
        assert_eq!(status, 0);
        let (irql, delivered, c) = DELIVERED.lock().unwrap().pop().expect("AdapterListControl ran");
        assert_eq!((irql, delivered, c), (2, buffer_ptr as usize, 0x5EED), "at DISPATCH_LEVEL, on the buffer");
        put(adapter, delivered as *mut SCATTER_GATHER_LIST, 1);

        // GetScatterGatherListEx: the same request with the list in a block of the loader's, freed at the put.
        let get_ex: GetEx = slot(ops, "GetScatterGatherListEx");
        let mut got: *mut SCATTER_GATHER_LIST = std::ptr::null_mut();
        let status = get_ex(adapter, pdo, context.as_mut_ptr(), mdl, 0x100, 4 * 4096, 1, 0, null, 1, 0, null, &mut got);
        assert_eq!(status, 0);
        assert!(!got.is_null() && !std::ptr::eq(got as *const u8, buffer_ptr), "a list of the loader's");
        assert_eq!(elements(got).iter().map(|(_, l)| *l).sum::<u32>(), 4 * 4096);
        put(adapter, got, 1);
        lower(old);

        // AllocateCommonBufferEx: placed below a 4 GiB maximum; nothing is left below 16 MiB (the model's low frames
        // start at 3 GiB); without a maximum it works.
        let allocate_ex: unsafe extern "win64" fn(*mut DMA_ADAPTER, *const i64, u32, *mut i64, u8, u32) -> *mut u8 =
            slot(ops, "AllocateCommonBufferEx");
        let free_common: unsafe extern "win64" fn(*mut DMA_ADAPTER, u32, i64, *mut u8, u8) =
            slot(ops, "FreeCommonBuffer");
        let mut logical = 0i64;
        let below = 0xFFFF_FFFFi64;
        let low = allocate_ex(adapter, &below, 4096, &mut logical, 1, 0);
        assert!(!low.is_null() && logical as u64 + 4096 <= 1 << 32, "{logical:#x}");
        free_common(adapter, 4096, logical, low, 1);
        assert!(allocate_ex(adapter, &0xFF_FFFF, 4096, &mut logical, 1, 0).is_null());
        let common = allocate_ex(adapter, std::ptr::null(), 4096, &mut logical, 1, 0);
        assert!(!common.is_null() && logical != 0);
        *common.add(8) = 0x5A;
        let mut byte = [0u8; 1];
        backend.device_read(logical as u64 + 8, &mut byte).unwrap();
        assert_eq!(byte, [0x5A], "the device sees the CPU's write at the logical address");
        free_common(adapter, 4096, logical, common, 1);

        // The slots the loader does not implement fail as their return types allow, and say so.
        let configure: unsafe extern "win64" fn(*mut DMA_ADAPTER, u32, *mut c_void) -> NTSTATUS =
            slot(ops, "ConfigureAdapterChannel");
        assert_eq!(configure(adapter, 0, null) as u32, STATUS_NOT_SUPPORTED);
        let cancel: unsafe extern "win64" fn(*mut DMA_ADAPTER, *mut c_void, *mut u8) -> u8 =
            slot(ops, "CancelAdapterChannel");
        assert_eq!(cancel(adapter, pdo, context.as_mut_ptr()), 0, "FALSE: nothing was cancelled");
        let domain: unsafe extern "win64" fn(*mut DMA_ADAPTER) -> *mut c_void = slot(ops, "GetDmaDomain");
        assert!(domain(adapter).is_null());
        let alignment: unsafe extern "win64" fn(*mut DMA_ADAPTER) -> u32 = slot(ops, "GetDmaAlignment");
        assert_eq!(alignment(adapter), 1);

        let free_mdl: unsafe extern "win64" fn(*mut MDL) = routine("IoFreeMdl");
        let free_pool: unsafe extern "win64" fn(*mut u8, u32) = routine("ExFreePoolWithTag");
        let put_adapter: unsafe extern "win64" fn(*mut DMA_ADAPTER) = slot(ops, "PutDmaAdapter");
        free_mdl(mdl);
        free_pool(data, u32::from_le_bytes(*b"vhca"));
        put_adapter(adapter);
    }
    let k = kernel();
    assert!(k.model.bugchecks().is_empty(), "{:?}", k.model.bugchecks());
    k.model.unload_driver();
}
