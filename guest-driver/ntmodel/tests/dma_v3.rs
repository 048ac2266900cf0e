//! The version 3 routines the model stands behind: GetDmaAdapterInfo, GetDmaTransferInfo, AllocateCommonBufferEx
//! and BuildScatterGatherList(Ex), each with its documented IRQL under DMA checking (0xE6/0x13) and its statuses.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, ListRequest, NtModel, NtModelConfig, VerifierFlags};

const DMA: u32 = VerifierFlags::DMA_CHECKING.0;

fn adapter(k: &NtModel, description: DEVICE_DESCRIPTION) -> PDMA_ADAPTER {
    let mut n = 0;
    let a = k.IoGetDmaAdapter(PDO, &description, &mut n);
    assert!(!a.is_null());
    a
}

fn v3(width: u32) -> DEVICE_DESCRIPTION {
    DEVICE_DESCRIPTION { DmaAddressWidth: width, ..DEVICE_DESCRIPTION::bus_master_64(1 << 20) }
}

fn nonpaged(k: &NtModel, bytes: u32) -> (PVOID, PMDL) {
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, bytes as usize, pool_tag(b"vhca"));
    let mdl = k.IoAllocateMdl(va, bytes, false, false);
    k.MmBuildMdlForNonPagedPool(mdl);
    (va, mdl)
}

fn request(mdl: PMDL, va: PVOID, length: u32, flags: u32, routine: Option<PDRIVER_LIST_CONTROL>) -> ListRequest {
    ListRequest {
        device: PDO,
        mdl,
        va,
        length,
        flags,
        routine,
        write_to_device: true,
        buffer_length: 4096,
        up_to_dispatch: false,
    }
}

#[test]
fn get_dma_adapter_info_reports_the_width_and_refuses_an_unknown_version() {
    let (k, _) = machine(0);
    let a = adapter(&k, v3(36));
    let info = k.get_dma_adapter_info(a, DMA_ADAPTER_INFO_VERSION1).unwrap();
    assert_eq!((info.DmaAddressWidth, info.MinimumTransferUnit), (36, 1));
    assert_eq!(k.get_dma_adapter_info(a, 2), Err(STATUS_NOT_SUPPORTED));
}

#[test]
fn get_dma_transfer_info_counts_what_the_list_gets() {
    let (k, _) = machine_with(NtModelConfig { max_contiguous_pages: Some(2), ..Default::default() });
    let a = adapter(&k, v3(64));
    let (va, mdl) = nonpaged(&k, 5 * 4096);
    let info = k.get_dma_transfer_info(a, mdl, 0x100, 4 * 4096, DMA_TRANSFER_INFO_VERSION2).unwrap();
    assert_eq!(info.ScatterGatherElementCount, 3, "pages 0-1, 2-3 and 4 are the runs");
    assert_eq!(info.ScatterGatherListSize, 16 + 3 * 24);
    assert_eq!((info.MapRegisterCount, info.LogicalPageCount), (0, 5), "a 64-bit device pays no registers");
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let list = k.build_scatter_gather_list(a, request(mdl, va.offset(0x100).unwrap(), 4 * 4096, 1, None));
    let list = list.unwrap().expect("synchronous without a routine: the list comes back");
    assert_eq!(list.Elements.len(), 3);
    k.PutScatterGatherList(a, list.Handle, true);
    k.KeLowerIrql(old);
    assert_eq!(k.get_dma_transfer_info(a, mdl, 5 * 4096, 1, 1), Err(STATUS_INVALID_PARAMETER), "offset past it");
    assert_eq!(k.get_dma_transfer_info(a, mdl, 0, 4096, 3), Err(STATUS_NOT_SUPPORTED));
}

#[test]
fn build_scatter_gather_list_ex_checks_the_buffer_the_flags_and_waits_like_get_scatter_gather_list() {
    let config = NtModelConfig { verifier: VerifierFlags(DMA), map_registers: 4, ..Default::default() };
    let (k, _) = machine_with(config);
    let a = adapter(&k, v3(64));
    let (va, mdl) = nonpaged(&k, 4 * 4096);
    let (vb, mdl_b) = nonpaged(&k, 2 * 4096);
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let small = ListRequest { buffer_length: 16 + 24 - 1, ..request(mdl, va, 4 * 4096, 1, None) };
    assert_eq!(k.build_scatter_gather_list(a, small), Err(STATUS_BUFFER_TOO_SMALL));
    assert_eq!(k.build_scatter_gather_list(a, request(mdl, va, 4096, 0, None)), Err(STATUS_INVALID_PARAMETER));
    let first = k.build_scatter_gather_list(a, request(mdl, va, 4 * 4096, 1, None)).unwrap().unwrap();
    assert_eq!(k.map_registers_free(a), Some(0), "DMA checking double-buffers through the four registers");
    let ran = Arc::new(Mutex::new(false));
    let sync_routine: PDRIVER_LIST_CONTROL = {
        let ran = ran.clone();
        Box::new(move |_, _| *ran.lock().unwrap() = true)
    };
    let sync = request(mdl_b, vb, 2 * 4096, DMA_SYNCHRONOUS_CALLBACK, Some(sync_routine));
    assert_eq!(k.build_scatter_gather_list(a, sync), Err(STATUS_INSUFFICIENT_RESOURCES), "registers short now");
    assert!(!*ran.lock().unwrap(), "a synchronous request short of registers never runs its routine");
    let late: Arc<Mutex<Option<SCATTER_GATHER_LIST>>> = Arc::new(Mutex::new(None));
    let sink = late.clone();
    let queued: PDRIVER_LIST_CONTROL =
        Box::new(move |_, l: &SCATTER_GATHER_LIST| *sink.lock().unwrap() = Some(l.clone()));
    assert_eq!(k.build_scatter_gather_list(a, request(mdl_b, vb, 2 * 4096, 0, Some(queued))), Ok(None));
    assert!(late.lock().unwrap().is_none(), "without DMA_SYNCHRONOUS_CALLBACK it waits for registers");
    k.PutScatterGatherList(a, first.Handle, true);
    let late = late.lock().unwrap().take().expect("the queued routine ran when the registers came back");
    k.PutScatterGatherList(a, late.Handle, true);
    k.KeLowerIrql(old);
    assert!(k.bugchecks().is_empty(), "{:?}", k.bugchecks());
}

#[test]
fn each_v3_routine_has_its_documented_irql_under_dma_checking() {
    let (k, _) = machine(DMA);
    let a = adapter(&k, v3(64));
    let (va, mdl) = nonpaged(&k, 4096);
    let stop = |f: &dyn Fn()| NtModel::run_guarded(f).expect_err("a stop");
    let old = k.KeRaiseIrql(DIRQL_MIN);
    assert_eq!(
        stop(&|| {
            let _ = k.get_dma_adapter_info(a, 1);
        }),
        Bugcheck::e6(0x13, 0x02, 2, DIRQL_MIN as u64)
    );
    assert_eq!(
        stop(&|| {
            let _ = k.get_dma_transfer_info(a, mdl, 0, 64, 1);
        }),
        Bugcheck::e6(0x13, 0x02, 2, 3)
    );
    k.KeLowerIrql(old);
    let build = || drop(k.build_scatter_gather_list(a, request(mdl, va, 64, 1, None)));
    assert_eq!(stop(&build), Bugcheck::e6(0x13, 0x01, 2, 0), "BuildScatterGatherListEx: DISPATCH_LEVEL");
    let get_ex = |va| ListRequest { up_to_dispatch: true, buffer_length: u32::MAX, ..request(mdl, va, 64, 1, None) };
    let list = k.build_scatter_gather_list(a, get_ex(va)).expect("GetScatterGatherListEx at PASSIVE_LEVEL").unwrap();
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    k.PutScatterGatherList(a, list.Handle, true);
    k.KeRaiseIrql(DIRQL_MIN);
    let get_ex_high = || drop(k.build_scatter_gather_list(a, get_ex(va)));
    assert_eq!(stop(&get_ex_high), Bugcheck::e6(0x13, 0x02, 2, 3), "GetScatterGatherListEx: <= DISPATCH_LEVEL");
    k.KeLowerIrql(old);
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let allocate = || {
        let _ = k.allocate_common_buffer_ex(a, None, 4096, &mut PHYSICAL_ADDRESS(0));
    };
    assert_eq!(stop(&allocate), Bugcheck::e6(0x13, 0x01, 0, 2), "AllocateCommonBufferEx: PASSIVE_LEVEL");
    k.KeLowerIrql(old);
}

#[test]
fn allocate_common_buffer_ex_honours_the_maximum_address() {
    let (k, _) = machine(0);
    let a = adapter(&k, v3(64));
    let mut logical = PHYSICAL_ADDRESS(0);
    let va = k.allocate_common_buffer_ex(a, Some(PHYSICAL_ADDRESS(0xFFFF_FFFF)), 4096, &mut logical);
    assert!(!va.is_null() && logical.0 + 4096 <= 1 << 32, "placed below the maximum address: {:#x}", logical.0);
    k.FreeCommonBuffer(a, 4096, logical, va, true);
    let va = k.allocate_common_buffer_ex(a, None, 4096, &mut logical);
    assert!(!va.is_null() && logical.0 >= 1 << 32, "the host backend's own addresses start at 4 GiB");
    k.FreeCommonBuffer(a, 4096, logical, va, true);
    let narrow = adapter(&k, v3(32));
    let va = k.allocate_common_buffer_ex(narrow, None, 4096, &mut logical);
    assert!(!va.is_null() && logical.0 + 4096 <= 1 << 32, "within a 32-bit device's reach: {:#x}", logical.0);
    k.FreeCommonBuffer(narrow, 4096, logical, va, true);
    let low = k.allocate_common_buffer_ex(a, Some(PHYSICAL_ADDRESS(0xFF_FFFF)), 4096, &mut logical);
    assert!(low.is_null(), "nothing below 16 MiB: the model's low frames start at 3 GiB");
}

#[test]
fn an_unknown_device_description_version_is_e6_25_under_dma_checking() {
    let description = DEVICE_DESCRIPTION { Version: 4, ..DEVICE_DESCRIPTION::bus_master_64(4096) };
    let (k, _) = machine(DMA);
    let mut n = 0;
    assert_eq!(NtModel::run_guarded(|| k.IoGetDmaAdapter(PDO, &description, &mut n)), Err(Bugcheck::e6(0x25, 0, 0, 0)));
    let (k, _) = machine(0);
    assert!(k.IoGetDmaAdapter(PDO, &description, &mut n).is_null());
}

#[test]
fn calculate_scatter_gather_list_gives_the_lists_size_with_the_mdl_and_the_most_without() {
    let (k, _) = machine_with(NtModelConfig { max_contiguous_pages: Some(2), ..Default::default() });
    let a = adapter(&k, v3(64));
    let (va, mdl) = nonpaged(&k, 5 * 4096);
    let at = va.offset(0x100).unwrap();
    assert_eq!(k.calculate_scatter_gather_list(a, Some(mdl), at, 4 * 4096), Ok((16 + 3 * 24, 0)), "three runs");
    assert_eq!(k.calculate_scatter_gather_list(a, None, at, 4 * 4096), Ok((16 + 5 * 24, 0)), "a page each");
    let past = k.calculate_scatter_gather_list(a, Some(mdl), at, 5 * 4096);
    assert_eq!(past, Err(STATUS_BUFFER_TOO_SMALL), "the MDL's buffer does not hold it");
    let (k, _) = machine(DMA);
    let mut n = 0;
    let a = k.IoGetDmaAdapter(PDO, &DEVICE_DESCRIPTION::bus_master_64(4096), &mut n);
    let (va, _) = nonpaged(&k, 4 * 4096);
    let many = k.calculate_scatter_gather_list(a, None, va, 4 * 4096);
    assert_eq!(many, Err(STATUS_INSUFFICIENT_RESOURCES), "4 registers of the 2 granted");
}
