//! The platform's DMA remapping and the addresses a device is handed: under remapping the device reaches a buffer
//! only at the adapter's logical address (MmGetPhysicalAddress's answer faults), without it the logical address is
//! the physical one and both work; a narrow device's bounce pages and common buffers lie below its limit either way.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use vhca_ntapi::*;
use vhca_ntmodel::{HostDmaBackend, NtModel, NtModelConfig};

const DATA: [u8; 4] = [0xC0, 0xFF, 0xEE, 0x42];
const FOUR_GIB: u64 = 1 << 32;

fn described(width: u32) -> DEVICE_DESCRIPTION {
    DEVICE_DESCRIPTION {
        Version: DEVICE_DESCRIPTION_VERSION3,
        DmaAddressWidth: width,
        Dma64BitAddresses: width > 32,
        ..DEVICE_DESCRIPTION::bus_master_64(1 << 16)
    }
}

/// A buffer of `bytes` of non-paged pool with its MDL.
fn pool_buffer(k: &NtModel, bytes: u32) -> (PVOID, PMDL) {
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, bytes as usize, pool_tag(b"vhca"));
    let mdl = k.IoAllocateMdl(va, bytes, false, false);
    k.MmBuildMdlForNonPagedPool(mdl);
    (va, mdl)
}

/// A device-to-memory list over `va` (the caller is at DISPATCH_LEVEL).
fn list(k: &NtModel, a: PDMA_ADAPTER, mdl: PMDL, va: PVOID, bytes: u32) -> SCATTER_GATHER_LIST {
    let got = Arc::new(Mutex::new(None));
    let routine: PDRIVER_LIST_CONTROL = {
        let got = got.clone();
        Box::new(move |_, l: &SCATTER_GATHER_LIST| *got.lock().unwrap() = Some(l.clone()))
    };
    assert_eq!(k.GetScatterGatherList(a, PDO, mdl, va, bytes, routine, false), STATUS_SUCCESS);
    let l = got.lock().unwrap().take().expect("AdapterListControl ran");
    l
}

fn read(k: &NtModel, va: PVOID) -> [u8; 4] {
    let mut b = [0u8; 4];
    k.RtlCopyFromVa(&mut b, va);
    b
}

fn machine_remapping(on: bool, max_contiguous_pages: Option<usize>) -> (Arc<NtModel>, Arc<HostDmaBackend>) {
    let (k, backend) = machine_with(NtModelConfig { max_contiguous_pages, ..NtModelConfig::default() });
    k.set_dma_remapping(on);
    (k, backend)
}

#[test]
fn remapping_is_on_by_default_as_dma_remapping_compatible_asks() {
    let (k, _) = machine(0);
    assert!(k.dma_remapping());
}

#[test]
fn under_remapping_a_physical_address_handed_to_the_device_faults_and_the_logical_one_works() {
    let (k, backend) = machine_remapping(true, None);
    let mut n = 0;
    let a = k.IoGetDmaAdapter(PDO, &described(64), &mut n);
    let (va, mdl) = pool_buffer(&k, 4096);
    let physical = k.mm_get_physical_address(va.0);
    assert!(physical >= FOUR_GIB, "the model's frames lie above 4 GiB: {physical:#x}");
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let l = list(&k, a, mdl, va, 4096);
    let logical = l.Elements[0].Address.0;
    assert_ne!(logical, physical, "an IOVA of the device's domain, not the frame");
    assert!(backend.device_write(physical, &DATA).is_err(), "nothing in the domain maps the physical address");
    backend.device_write(logical, &DATA).expect("the logical address is mapped");
    assert_eq!(read(&k, va), DATA);
    k.PutScatterGatherList(a, l.Handle, false);
    k.KeLowerIrql(old);
    assert!(k.bugchecks().is_empty(), "{:?}", k.bugchecks());
}

#[test]
fn without_remapping_the_logical_address_is_the_physical_address_and_both_reach_the_buffer() {
    let (k, backend) = machine_remapping(false, None);
    let mut n = 0;
    let a = k.IoGetDmaAdapter(PDO, &described(64), &mut n);
    let (va, mdl) = pool_buffer(&k, 4096);
    let physical = k.mm_get_physical_address(va.0);
    backend.device_write(physical, &DATA).expect("the identity domain maps every frame");
    assert_eq!(read(&k, va), DATA, "a driver handing the device the physical address works here");
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let l = list(&k, a, mdl, va, 4096);
    assert_eq!(l.Elements[0].Address.0, physical);
    k.PutScatterGatherList(a, l.Handle, false);
    k.KeLowerIrql(old);
    backend.device_write(physical + 8, &DATA).expect("the identity domain outlives the list");
    assert!(k.bugchecks().is_empty(), "{:?}", k.bugchecks());
}

#[test]
fn without_remapping_a_fragmented_buffers_elements_are_its_frames_and_runs_are_apart() {
    let (k, backend) = machine_remapping(false, Some(1));
    let mut n = 0;
    let a = k.IoGetDmaAdapter(PDO, &described(64), &mut n);
    let (va, mdl) = pool_buffer(&k, 3 * 4096);
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let l = list(&k, a, mdl, va, 3 * 4096);
    assert_eq!(l.Elements.len(), 3, "one element per one-page run");
    for (i, e) in l.Elements.iter().enumerate() {
        let page_va = va.offset(i as u64 * 4096).unwrap();
        assert_eq!(e.Address.0, k.mm_get_physical_address(page_va.0), "element {i}");
        backend.device_write(e.Address.0, &DATA).expect("mapped");
        assert_eq!(read(&k, page_va), DATA);
    }
    assert_ne!(l.Elements[1].Address.0, l.Elements[0].Address.0 + 4096, "the runs are not physically contiguous");
    k.PutScatterGatherList(a, l.Handle, false);
    k.KeLowerIrql(old);
}

/// IoMapCommonBuffer (CreateCommonBufferFromMdl as vhca.sys reaches it) gives the device one logical range. Under
/// remapping a fragmented buffer still gets one; without it "the MDL must represent physically contiguous memory"
/// (PCREATE_COMMON_BUFFER_FROM_MDL): refused with STATUS_INVALID_PARAMETER, never a range across the holes. One
/// contiguous run is still mapped without remapping, at its frame.
#[test]
fn without_remapping_io_map_common_buffer_refuses_a_fragmented_buffer_and_maps_a_contiguous_one() {
    for remapping in [true, false] {
        let (k, backend) = machine_remapping(remapping, Some(1));
        let mut n = 0;
        let a = k.IoGetDmaAdapter(PDO, &described(64), &mut n);
        let (va, mdl) = pool_buffer(&k, 3 * 4096);
        let mapped = k.IoMapCommonBuffer(a, mdl, 3 * 4096, true);
        if remapping {
            let (h, sg) = mapped.expect("one logical range under remapping");
            assert_eq!(sg.Elements.len(), 1);
            let last_page = sg.Elements[0].Address.0 + 2 * 4096;
            backend.device_write(last_page, &DATA).expect("the range's last page is the buffer's");
            assert_eq!(read(&k, va.offset(2 * 4096).unwrap()), DATA);
            k.IoUnmapCommonBuffer(a, h);
        } else {
            assert_eq!(mapped.unwrap_err(), STATUS_INVALID_PARAMETER, "three one-page runs are not one range");
        }
        let (one, one_mdl) = pool_buffer(&k, 4096);
        let (h, sg) = k.IoMapCommonBuffer(a, one_mdl, 4096, true).expect("one page is contiguous");
        if !remapping {
            assert_eq!(sg.Elements[0].Address.0, k.mm_get_physical_address(one.0), "the identity domain's frame");
        }
        backend.device_write(sg.Elements[0].Address.0, &DATA).expect("mapped");
        assert_eq!(read(&k, one), DATA);
        k.IoUnmapCommonBuffer(a, h);
        assert!(k.bugchecks().is_empty(), "{:?}", k.bugchecks());
    }
}

/// A 32-bit device's list over memory above 4 GiB: the element lies below 4 GiB (a bounce page), the device's
/// write reaches the buffer at the put.
fn bounce_below_the_limit(remapping: bool, flags: u32) {
    let (k, backend) =
        machine_with(NtModelConfig { verifier: vhca_ntmodel::VerifierFlags(flags), ..Default::default() });
    k.set_dma_remapping(remapping);
    let mut n = 0;
    let a = k.IoGetDmaAdapter(PDO, &described(32), &mut n);
    let (va, mdl) = pool_buffer(&k, 2 * 4096);
    assert!(k.mm_get_physical_address(va.0) >= FOUR_GIB, "the buffer lies above 4 GiB");
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let l = list(&k, a, mdl, va, 2 * 4096);
    for e in &l.Elements {
        assert!(e.Address.0 + e.Length as u64 <= FOUR_GIB, "remapping {remapping}: {:#x}+{:#x}", e.Address.0, e.Length);
    }
    backend.device_write(l.Elements[0].Address.0 + 4096, &DATA).expect("the bounce page is mapped");
    assert_ne!(read(&k, va.offset(4096).unwrap()), DATA, "a bounce: the CPU sees it at the put");
    k.PutScatterGatherList(a, l.Handle, false);
    k.KeLowerIrql(old);
    assert_eq!(read(&k, va.offset(4096).unwrap()), DATA);
    assert!(k.bugchecks().is_empty(), "{:?}", k.bugchecks());
}

#[test]
fn a_32_bit_devices_bounce_pages_lie_below_4_gib_with_and_without_remapping() {
    bounce_below_the_limit(true, 0);
    bounce_below_the_limit(false, 0);
}

#[test]
fn the_verifiers_double_buffer_for_a_32_bit_device_lies_below_4_gib_too() {
    bounce_below_the_limit(true, 0x80);
    bounce_below_the_limit(false, 0x80);
}

#[test]
fn a_32_bit_devices_common_buffer_lies_below_4_gib_and_a_64_bit_ones_need_not() {
    for remapping in [true, false] {
        let (k, backend) = machine_remapping(remapping, None);
        let mut n = 0;
        let narrow = k.IoGetDmaAdapter(PDO, &described(32), &mut n);
        let wide = k.IoGetDmaAdapter(PDO, &described(64), &mut n);
        let mut logical = PHYSICAL_ADDRESS(0);
        let va = k.AllocateCommonBuffer(narrow, 8192, &mut logical, false);
        assert!(!va.is_null());
        assert!(logical.0 + 8192 <= FOUR_GIB, "remapping {remapping}: {:#x}", logical.0);
        backend.device_write(logical.0 + 4096, &DATA).expect("mapped");
        assert_eq!(read(&k, va.offset(4096).unwrap()), DATA, "a common buffer is the device's own pages");
        let mut high = PHYSICAL_ADDRESS(0);
        let wide_va = k.AllocateCommonBuffer(wide, 4096, &mut high, false);
        assert!(high.0 >= FOUR_GIB, "remapping {remapping}: {:#x}", high.0);
        k.FreeCommonBuffer(narrow, 8192, logical, va, false);
        k.FreeCommonBuffer(wide, 4096, high, wide_va, false);
        assert!(backend.device_write(logical.0, &DATA).is_err(), "freed: the device's view went with it");
    }
}
