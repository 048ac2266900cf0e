//! DmaAddressWidth honoured: a device narrower than the logical address of the memory it is handed gets the
//! transfer through map registers (a bounce the CPU sees only at the put) instead of the buffer's own pages; a
//! device that reaches the address gets them directly. The host backend's device addresses start at 4 GiB, so a
//! 32-bit device reaches none of them and a 40-bit one all.

mod common;

use common::*;
use vhca_ntapi::*;
use vhca_ntmodel::{HostDmaBackend, NtModel};

const DATA: [u8; 4] = [0xDE, 0xAD, 0xBE, 0xEF];

fn described(version: u32, width: u32, dma64: bool) -> DEVICE_DESCRIPTION {
    DEVICE_DESCRIPTION {
        Version: version,
        DmaAddressWidth: width,
        Dma64BitAddresses: dma64,
        ..DEVICE_DESCRIPTION::bus_master_64(1 << 16)
    }
}

/// Maps one page of non-paged pool for a device-to-memory list on an adapter so described, has the device write
/// DATA through the list, and tells whether the CPU saw it before the put, whether the put made it visible, and
/// how many map registers the list held.
fn device_write_seen(description: DEVICE_DESCRIPTION) -> (bool, bool, u32) {
    let (k, backend) = machine(0);
    let mut n = 0;
    let a = k.IoGetDmaAdapter(PDO, &description, &mut n);
    let free = k.map_registers_free(a).unwrap();
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 4096, pool_tag(b"vhca"));
    let mdl = k.IoAllocateMdl(va, 4096, false, false);
    k.MmBuildMdlForNonPagedPool(mdl);
    let list = std::sync::Arc::new(std::sync::Mutex::new(None));
    let routine: PDRIVER_LIST_CONTROL = {
        let list = list.clone();
        Box::new(move |_, l: &SCATTER_GATHER_LIST| *list.lock().unwrap() = Some(l.clone()))
    };
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(k.GetScatterGatherList(a, PDO, mdl, va, 4096, routine, false), STATUS_SUCCESS);
    let l = list.lock().unwrap().take().expect("AdapterListControl ran");
    let held = free - k.map_registers_free(a).unwrap();
    write(&backend, &l);
    let before = read(&k, va) == DATA;
    k.PutScatterGatherList(a, l.Handle, false);
    k.KeLowerIrql(old);
    let after = read(&k, va) == DATA;
    assert!(k.bugchecks().is_empty(), "{:?}", k.bugchecks());
    (before, after, held)
}

fn write(backend: &HostDmaBackend, l: &SCATTER_GATHER_LIST) {
    backend.device_write(l.Elements[0].Address.0 + 8, &DATA).expect("the element is mapped");
}

fn read(k: &NtModel, va: PVOID) -> [u8; 4] {
    let mut b = [0u8; 4];
    k.RtlCopyFromVa(&mut b, va.offset(8).unwrap());
    b
}

#[test]
fn a_32_bit_device_gets_memory_above_4_gib_through_map_registers() {
    let (before, after, held) = device_write_seen(described(DEVICE_DESCRIPTION_VERSION3, 32, true));
    assert!(!before, "the device wrote a bounce page, not the buffer");
    assert!(after, "the put copied the bounce back");
    assert_eq!(held, 1, "one map register for the page");
}

#[test]
fn a_device_that_reaches_the_address_gets_the_buffers_own_pages() {
    for description in
        [described(DEVICE_DESCRIPTION_VERSION3, 40, true), described(DEVICE_DESCRIPTION_VERSION3, 64, true)]
    {
        let (before, after, _) = device_write_seen(description);
        assert!(before && after, "{description:?}: a direct mapping, the CPU sees the write at once");
    }
    let (_, _, held) = device_write_seen(described(DEVICE_DESCRIPTION_VERSION3, 64, true));
    assert_eq!(held, 0, "a 64-bit device costs no map registers");
}

#[test]
fn before_version_3_the_width_is_the_flags_and_dma_address_width_is_not_read() {
    let (before, _, _) = device_write_seen(described(DEVICE_DESCRIPTION_VERSION2, 64, false));
    assert!(!before, "version 2 without Dma64BitAddresses is a 32-bit device, whatever DmaAddressWidth says");
    let (before, _, _) = device_write_seen(described(DEVICE_DESCRIPTION_VERSION2, 32, true));
    assert!(before, "version 2 with Dma64BitAddresses reaches 64 bits");
    let (before, _, _) = device_write_seen(described(DEVICE_DESCRIPTION_VERSION3, 0, false));
    assert!(!before, "version 3 without a width: the flags, 32 bits");
}
