//! What DMA checking does to data: S/G and MapTransfer mappings are double-buffered (the device writes a shadow
//! the CPU sees only at put/flush), common buffers and IoMapCommonBuffer mappings are shared in every mode.

mod common;

use common::*;
use vhca_ntapi::*;

const TAG: u32 = pool_tag(b"vhca");
const DATA: [u8; 4] = [0xDE, 0xAD, 0xBE, 0xEF];

fn adapter(k: &vhca_ntmodel::NtModel) -> PDMA_ADAPTER {
    let mut n = 0;
    k.IoGetDmaAdapter(PDO, &DEVICE_DESCRIPTION::bus_master_64(1 << 20), &mut n)
}

fn read4(k: &vhca_ntmodel::NtModel, va: PVOID) -> [u8; 4] {
    let mut b = [0u8; 4];
    k.RtlCopyFromVa(&mut b, va);
    b
}

#[test]
fn sg_list_device_write_is_invisible_until_put_under_dma_checking_and_visible_at_once_without() {
    for (flags, visible_before_put) in [(0u32, true), (0x80, false)] {
        let (k, backend) = machine(flags);
        let a = adapter(&k);
        let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 4096, TAG);
        let mdl = k.IoAllocateMdl(va, 4096, false, false);
        k.MmBuildMdlForNonPagedPool(mdl);
        k.KeRaiseIrql(DISPATCH_LEVEL);
        let sg = get_sg(&k, a, mdl, va, 4096, false).unwrap();
        backend.device_write(sg.Elements[0].Address.0 + 8, &DATA).unwrap();
        let before = read4(&k, va.offset(8).unwrap());
        assert_eq!(before == DATA, visible_before_put, "flags {flags:#x}: CPU saw {before:x?} before put");
        k.PutScatterGatherList(a, sg.Handle, false);
        assert_eq!(read4(&k, va.offset(8).unwrap()), DATA, "flags {flags:#x}: data after put");
    }
}

#[test]
fn sg_list_cpu_write_after_map_is_invisible_to_the_device_under_dma_checking() {
    for (flags, device_sees_update) in [(0u32, true), (0x80, false)] {
        let (k, backend) = machine(flags);
        let a = adapter(&k);
        let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 64, TAG);
        k.RtlCopyToVa(va, &[1, 1, 1, 1]);
        let mdl = k.IoAllocateMdl(va, 64, false, false);
        k.MmBuildMdlForNonPagedPool(mdl);
        k.KeRaiseIrql(DISPATCH_LEVEL);
        let sg = get_sg(&k, a, mdl, va, 64, true).unwrap();
        k.RtlCopyToVa(va, &DATA);
        let mut seen = [0u8; 4];
        backend.device_read(sg.Elements[0].Address.0, &mut seen).unwrap();
        assert_eq!(seen == DATA, device_sees_update, "flags {flags:#x}");
        assert!(seen == DATA || seen == [1, 1, 1, 1], "the device sees the data as of the map: {seen:x?}");
        k.PutScatterGatherList(a, sg.Handle, true);
    }
}

#[test]
fn map_transfer_device_write_is_invisible_until_flush_under_dma_checking() {
    for (flags, visible_before_flush) in [(0u32, true), (0x80, false)] {
        let (k, backend) = machine(flags);
        let a = adapter(&k);
        let any = PHYSICAL_ADDRESS(0);
        let va = k.MmAllocateContiguousMemorySpecifyCache(
            8192,
            any,
            PHYSICAL_ADDRESS(u64::MAX),
            any,
            MEMORY_CACHING_TYPE::MmCached,
        );
        let mdl = k.IoAllocateMdl(va, 8192, false, false);
        k.MmBuildMdlForNonPagedPool(mdl);
        k.KeRaiseIrql(DISPATCH_LEVEL);
        let base = alloc_channel(&k, a, 2, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters).unwrap();
        let mut len = 8192;
        let logical = k.MapTransfer(a, mdl, base, va, &mut len, false).unwrap();
        backend.device_write(logical.0 + 4096, &DATA).unwrap();
        let before = read4(&k, va.offset(4096).unwrap());
        assert_eq!(before == DATA, visible_before_flush, "flags {flags:#x}");
        assert!(k.FlushAdapterBuffers(a, mdl, base, va, len, false));
        assert_eq!(read4(&k, va.offset(4096).unwrap()), DATA);
        k.FreeMapRegisters(a, base, 2);
    }
}

#[test]
fn common_buffers_are_shared_with_and_without_dma_checking() {
    for flags in [0u32, 0x80, 0x209BB] {
        let (k, backend) = machine(flags);
        let a = adapter(&k);
        let mut la = PHYSICAL_ADDRESS(0);
        let va = k.AllocateCommonBuffer(a, 8192, &mut la, true);
        backend.device_write(la.0 + 5000, &DATA).unwrap();
        assert_eq!(read4(&k, va.offset(5000).unwrap()), DATA, "flags {flags:#x}");
        k.RtlCopyToVa(va, &[7, 7, 7, 7]);
        let mut seen = [0u8; 4];
        backend.device_read(la.0, &mut seen).unwrap();
        assert_eq!(seen, [7, 7, 7, 7]);
        k.FreeCommonBuffer(a, 8192, la, va, true);
    }
}

#[test]
fn io_map_common_buffer_shares_a_locked_user_buffer_under_dma_checking() {
    let (k, backend) = machine(0x80);
    let a = adapter(&k);
    let u = k.alloc_user_buffer(3 * 4096, 123);
    let mdl = k.IoAllocateMdl(u, 3 * 4096, false, false);
    assert_eq!(k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, LOCK_OPERATION::IoModifyAccess), STATUS_SUCCESS);
    let (h, sg) = k.IoMapCommonBuffer(a, mdl, 3 * 4096, true).unwrap();
    assert_eq!(sg.Elements[0].Address.0 % 4096, 123, "the device address keeps the buffer's page offset");
    backend.device_write(sg.Elements[0].Address.0 + 9000, &DATA).unwrap();
    assert_eq!(read4(&k, u.offset(9000).unwrap()), DATA);
    k.IoUnmapCommonBuffer(a, h);
    assert!(backend.device_write(sg.Elements[0].Address.0, &DATA).is_err(), "unmapped means the device faults");
    k.MmUnlockPages(mdl);
}

#[test]
fn io_map_common_buffer_refuses_an_unlocked_buffer() {
    let (k, _) = machine(0x80);
    let a = adapter(&k);
    let u = k.alloc_user_buffer(4096, 0);
    let mdl = k.IoAllocateMdl(u, 4096, false, false);
    assert_eq!(k.IoMapCommonBuffer(a, mdl, 4096, true).unwrap_err(), STATUS_INVALID_PARAMETER);
}
