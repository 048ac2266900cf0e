//! Scatter/gather lists with several elements: a buffer on a fragmented machine gets one element per physically
//! contiguous run of its pages, each at a device address of its own, and no element is longer than the adapter's
//! MaximumLength; MapTransfer maps the first run and says how much in Length.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use vhca_ntapi::*;
use vhca_ntmodel::{HostDmaBackend, NtModel, NtModelConfig, VerifierFlags};

fn fragmented(flags: u32, run_pages: usize) -> (Arc<NtModel>, Arc<HostDmaBackend>) {
    machine_with(NtModelConfig {
        verifier: VerifierFlags(flags),
        max_contiguous_pages: Some(run_pages),
        ..NtModelConfig::default()
    })
}

fn adapter(k: &NtModel, maximum_length: u32) -> PDMA_ADAPTER {
    let mut n = 0;
    let a = k.IoGetDmaAdapter(PDO, &DEVICE_DESCRIPTION::bus_master_64(maximum_length), &mut n);
    assert!(!a.is_null());
    a
}

/// A locked user buffer of `bytes`, `offset` bytes into its first page, with its MDL.
fn user_buffer(k: &NtModel, bytes: u32, offset: u64) -> (PVOID, PMDL) {
    let va = k.alloc_user_buffer(bytes as u64, offset);
    let mdl = k.IoAllocateMdl(va, bytes, false, false);
    let status = k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, LOCK_OPERATION::IoModifyAccess);
    assert_eq!(status, STATUS_SUCCESS);
    (va, mdl)
}

/// GetScatterGatherList at DISPATCH_LEVEL, the list as AdapterListControl received it.
fn list(k: &NtModel, a: PDMA_ADAPTER, mdl: PMDL, va: PVOID, bytes: u32) -> SCATTER_GATHER_LIST {
    let got = Arc::new(Mutex::new(None));
    let routine: PDRIVER_LIST_CONTROL = {
        let got = got.clone();
        Box::new(move |_, l: &SCATTER_GATHER_LIST| *got.lock().unwrap() = Some(l.clone()))
    };
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(k.GetScatterGatherList(a, PDO, mdl, va, bytes, routine, false), STATUS_SUCCESS);
    k.KeLowerIrql(old);
    let l = got.lock().unwrap().take().expect("AdapterListControl ran at once");
    l
}

fn lengths(l: &SCATTER_GATHER_LIST) -> Vec<u32> {
    l.Elements.iter().map(|e| e.Length).collect()
}

#[test]
fn a_fragmented_buffer_gets_one_element_per_contiguous_run_and_the_device_reaches_each() {
    let (k, backend) = fragmented(0, 2);
    let a = adapter(&k, 1 << 20);
    // 0x100 into its first page, 4 pages and 0x80 bytes long: pages 0-1, 2-3 and 4 are the machine's runs.
    let bytes = 4 * 4096 - 0x80;
    let (va, mdl) = user_buffer(&k, bytes, 0x100);
    let l = list(&k, a, mdl, va, bytes);
    assert_eq!(lengths(&l), vec![0x2000 - 0x100, 0x2000, 0x80]);
    assert_eq!(l.Elements[0].Address.0 % 4096, 0x100, "the first element keeps the buffer's page offset");
    for pair in l.Elements.windows(2) {
        assert_eq!(pair[1].Address.0 % 4096, 0, "a run starts on a page");
        assert_ne!(pair[0].Address.0 + pair[0].Length as u64, pair[1].Address.0, "runs are not contiguous");
    }
    // The device writes each element where the driver asked; past an element's end is nobody's page.
    let mut at = 0u64;
    for (i, e) in l.Elements.iter().enumerate() {
        backend.device_write(e.Address.0, &[i as u8 + 1; 16]).expect("the element is mapped");
        let mut seen = [0u8; 16];
        k.RtlCopyFromVa(&mut seen, va.offset(at).unwrap());
        assert_eq!(seen, [i as u8 + 1; 16], "element {i} is bytes {at:#x}.. of the buffer");
        at += e.Length as u64;
    }
    let first = l.Elements[0];
    assert!(backend.device_write(first.Address.0 + first.Length as u64, &[0xAA]).is_err(), "a run ends in a guard");
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    k.PutScatterGatherList(a, l.Handle, false);
    k.KeLowerIrql(old);
    assert_eq!(backend.mapped_pages(), 0, "every run is unmapped at the put");
    assert!(k.bugchecks().is_empty());
}

#[test]
fn no_element_is_longer_than_the_adapters_maximum_length_and_cuts_fall_on_pages() {
    let (k, _) = machine(0);
    let a = adapter(&k, 8192);
    let pool = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 6 * 4096, pool_tag(b"vhca"));
    let va = pool.offset(0x200).unwrap();
    let bytes = 5 * 4096;
    let mdl = k.IoAllocateMdl(va, bytes, false, false);
    k.MmBuildMdlForNonPagedPool(mdl);
    let l = list(&k, a, mdl, va, bytes);
    assert_eq!(lengths(&l), vec![0x2000 - 0x200, 0x2000, 0x1200]);
    assert!(l.Elements[1..].iter().all(|e| e.Address.0 % 4096 == 0), "no two elements share a page");
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    k.PutScatterGatherList(a, l.Handle, false);
    k.KeLowerIrql(old);
}

#[test]
fn under_dma_checking_the_shadow_is_one_run_cut_only_by_the_maximum_length() {
    let (k, backend) = fragmented(VerifierFlags::DMA_CHECKING.0, 2);
    let a = adapter(&k, 1 << 20);
    let (va, mdl) = user_buffer(&k, 4 * 4096, 0);
    let l = list(&k, a, mdl, va, 4 * 4096);
    assert_eq!(lengths(&l), vec![4 * 4096], "the verifier's bounce pages are contiguous");
    backend.device_write(l.Elements[0].Address.0 + 3 * 4096, &[7; 8]).unwrap();
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    k.PutScatterGatherList(a, l.Handle, false);
    k.KeLowerIrql(old);
    let mut seen = [0u8; 8];
    k.RtlCopyFromVa(&mut seen, va.offset(3 * 4096).unwrap());
    assert_eq!(seen, [7; 8], "copied back at the put");
    assert!(k.bugchecks().is_empty());
}

#[test]
fn map_transfer_over_a_fragmented_buffer_maps_the_first_run_and_says_so_in_length() {
    let (k, _) = fragmented(0, 2);
    let a = adapter(&k, 1 << 20);
    let (va, mdl) = user_buffer(&k, 4 * 4096, 0x300);
    let base = Arc::new(Mutex::new(None));
    let routine: PDRIVER_CONTROL = {
        let base = base.clone();
        Box::new(move |_, b| {
            *base.lock().unwrap() = Some(b);
            IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters
        })
    };
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(k.AllocateAdapterChannel(a, PDO, 6, routine), STATUS_SUCCESS);
    let base = base.lock().unwrap().take().expect("AdapterControl ran");
    let mut length = 4 * 4096;
    let first = k.MapTransfer(a, mdl, base, va, &mut length, false).expect("mapped");
    assert_eq!((first.0 % 4096, length), (0x300, 0x2000 - 0x300), "pages 0-1 are the first run");
    let rest = va.offset(length as u64).unwrap();
    let mut left = 4 * 4096 - length;
    let second = k.MapTransfer(a, mdl, base, rest, &mut left, false).expect("mapped");
    assert_eq!((second.0 % 4096, left), (0, 0x2000), "the next call maps the next run");
    assert!(k.FlushAdapterBuffers(a, mdl, base, va, 0x2000 - 0x300, false));
    assert!(k.FlushAdapterBuffers(a, mdl, base, rest, 0x2000, false));
    k.FreeMapRegisters(a, base, 6);
    k.KeLowerIrql(old);
    assert!(k.bugchecks().is_empty());
}
