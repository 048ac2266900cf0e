//! Every verifier rule the model checks: the violation raises the exact code and parameters, and the legal
//! sequence next to it raises nothing.

mod common;

use common::*;
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, NtModel};

const IRQL: u32 = 0x2;
const POOL: u32 = 0x8;
const DEADLOCK: u32 = 0x20;
const DMA: u32 = 0x80;
const TAG: u32 = pool_tag(b"vhca");

fn stop(f: impl FnOnce()) -> Bugcheck {
    NtModel::run_guarded(f).expect_err("expected a bugcheck")
}

fn clean<T>(f: impl FnOnce() -> T) -> T {
    NtModel::run_guarded(f).unwrap_or_else(|b| panic!("unexpected bugcheck:\n{b}"))
}

fn adapter(k: &NtModel) -> (PDMA_ADAPTER, u32) {
    let mut n = 0;
    let a = k.IoGetDmaAdapter(PDO, &DEVICE_DESCRIPTION::bus_master_64(64 * 1024), &mut n);
    assert!(!a.is_null());
    (a, n)
}

/// Non-paged pool of `len` bytes with an MDL built for it.
fn nonpaged_mdl(k: &NtModel, len: u32) -> (PVOID, PMDL) {
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, len as usize, TAG);
    let mdl = k.IoAllocateMdl(va, len, false, false);
    k.MmBuildMdlForNonPagedPool(mdl);
    (va, mdl)
}

// ---- IRQL checking (0x2) ----

#[test]
fn fast_mutex_acquired_above_apc_is_c4_33() {
    let (k, _) = machine(IRQL);
    let m = k.ExInitializeFastMutex();
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(stop(|| k.ExAcquireFastMutex(m)), Bugcheck::c4(0x33, 2, m.0, 0));
}

#[test]
fn fast_mutex_released_below_apc_is_c4_34() {
    let (k, _) = machine(IRQL);
    let m = k.ExInitializeFastMutex();
    k.ExAcquireFastMutex(m);
    k.KeLowerIrql(PASSIVE_LEVEL);
    assert_eq!(stop(|| k.ExReleaseFastMutex(m)), Bugcheck::c4(0x34, 0, m.0, 0));
}

#[test]
fn fast_mutex_legal_use_runs_owner_at_apc() {
    let (k, _) = machine(0x209BB);
    let m = k.ExInitializeFastMutex();
    clean(|| {
        k.ExAcquireFastMutex(m);
        assert_eq!(k.KeGetCurrentIrql(), APC_LEVEL);
        k.ExReleaseFastMutex(m);
        assert_eq!(k.KeGetCurrentIrql(), PASSIVE_LEVEL);
    });
}

#[test]
fn without_verifier_nothing_is_checked() {
    let (k, _) = machine(0);
    let m = k.ExInitializeFastMutex();
    clean(|| {
        k.KeRaiseIrql(DISPATCH_LEVEL);
        k.ExAcquireFastMutex(m);
        k.ExReleaseFastMutex(m);
        let p = k.ExAllocatePoolWithTag(POOL_TYPE::PagedPool, 100, TAG);
        k.ExFreePoolWithTag(p, TAG);
        k.KeLowerIrql(PASSIVE_LEVEL);
    });
    assert!(k.bugchecks().is_empty());
}

#[test]
fn spin_lock_rules_are_c4_32_and_42() {
    let (k, _) = machine(IRQL);
    let l = k.KeInitializeSpinLock();
    assert_eq!(stop(|| k.KeReleaseSpinLock(l, PASSIVE_LEVEL)), Bugcheck::c4(0x32, 0, l.0, 0));
    let (k, _) = machine(IRQL);
    let l = k.KeInitializeSpinLock();
    k.KeRaiseIrql(5);
    assert_eq!(
        stop(|| {
            let _ = k.KeAcquireSpinLock(l);
        }),
        Bugcheck::c4(0x42, 5, l.0, 0)
    );
    let (k, _) = machine(IRQL);
    let l = k.KeInitializeSpinLock();
    clean(|| {
        let old = k.KeAcquireSpinLock(l);
        assert_eq!(k.KeGetCurrentIrql(), DISPATCH_LEVEL);
        k.KeReleaseSpinLock(l, old);
        assert_eq!(k.KeGetCurrentIrql(), PASSIVE_LEVEL);
    });
}

#[test]
fn raise_and_lower_irql_the_wrong_way_are_c4_30_and_31() {
    let (k, _) = machine(IRQL);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(
        stop(|| {
            let _ = k.KeRaiseIrql(PASSIVE_LEVEL);
        }),
        Bugcheck::c4(0x30, 2, 0, 0)
    );
    let (k, _) = machine(IRQL);
    assert_eq!(stop(|| k.KeLowerIrql(DISPATCH_LEVEL)), Bugcheck::c4(0x31, 0, 2, 0));
}

#[test]
fn pool_at_wrong_irql_is_c4_01_02_11() {
    let (k, _) = machine(IRQL);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(
        stop(|| {
            let _ = k.ExAllocatePoolWithTag(POOL_TYPE::PagedPool, 100, TAG);
        }),
        Bugcheck::c4(0x01, 2, 1, 100)
    );
    let (k, _) = machine(IRQL);
    k.KeRaiseIrql(5);
    let b = stop(|| {
        let _ = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 100, TAG);
    });
    assert_eq!(b, Bugcheck::c4(0x02, 5, 0, 100));
    let (k, _) = machine(IRQL);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::PagedPool, 100, TAG);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(stop(|| k.ExFreePoolWithTag(p, TAG)), Bugcheck::c4(0x11, 2, 1, p.0));
}

#[test]
fn kmutex_wait_at_dispatch_is_c4_121() {
    let (k, _) = machine(IRQL);
    let m = k.KeInitializeMutex(0);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(
        stop(|| {
            let _ = k.KeWaitForMutexObject(m);
        }),
        Bugcheck::c4(0x121, 2, m.0, 0)
    );
}

#[test]
fn eresource_without_critical_region_is_c4_37() {
    let (k, _) = machine(IRQL);
    let r = k.ExInitializeResourceLite();
    assert_eq!(
        stop(|| {
            let _ = k.ExAcquireResourceExclusiveLite(r, true);
        }),
        Bugcheck::c4(0x37, 0, 0, r.0)
    );
    let (k, _) = machine(IRQL | DEADLOCK);
    let r = k.ExInitializeResourceLite();
    clean(|| {
        k.KeEnterCriticalRegion();
        assert!(k.ExAcquireResourceExclusiveLite(r, true));
        assert!(k.ExAcquireResourceExclusiveLite(r, true), "exclusive owner may recurse");
        k.ExReleaseResourceLite(r);
        k.ExReleaseResourceLite(r);
        k.KeLeaveCriticalRegion();
    });
}

#[test]
fn io_get_dma_adapter_above_passive_is_ddi_rule_irql_io_passive5() {
    let (k, _) = machine(IRQL);
    k.KeRaiseIrql(APC_LEVEL);
    assert_eq!(
        stop(|| {
            let _ = adapter(&k);
        }),
        Bugcheck::c4(0x2000E, 0, 0, 0)
    );
}

#[test]
fn paged_memory_touched_at_dispatch_is_d1_unless_locked() {
    let (k, _) = machine(IRQL);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::PagedPool, 64, TAG);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let mut b = [0u8; 8];
    assert_eq!(stop(|| k.RtlCopyFromVa(&mut b, p)), Bugcheck::new(0xD1, p.0, 2, 0, 0));

    let (k, _) = machine(IRQL);
    let u = k.alloc_user_buffer(64, 0);
    let mdl = k.IoAllocateMdl(u, 64, false, false);
    assert_eq!(k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, LOCK_OPERATION::IoModifyAccess), STATUS_SUCCESS);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    clean(|| k.RtlCopyToVa(u, &[1, 2, 3]));
}

#[test]
fn probe_and_lock_pageable_at_dispatch_is_0a_and_above_dispatch_c4_70() {
    let (k, _) = machine(IRQL);
    let u = k.alloc_user_buffer(64, 16);
    let mdl = k.IoAllocateMdl(u, 64, false, false);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let b = stop(|| {
        let _ = k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, LOCK_OPERATION::IoWriteAccess);
    });
    assert_eq!(b, Bugcheck::new(0x0A, u.0, 2, 1, 0));
    let (k, _) = machine(IRQL);
    let u = k.alloc_user_buffer(64, 0);
    let mdl = k.IoAllocateMdl(u, 64, false, false);
    k.KeRaiseIrql(5);
    let b = stop(|| {
        let _ = k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, LOCK_OPERATION::IoWriteAccess);
    });
    assert_eq!(b, Bugcheck::c4(0x70, 5, mdl.0, 1));
}

#[test]
fn unlock_pages_above_dispatch_is_c4_78() {
    let (k, _) = machine(IRQL);
    let u = k.alloc_user_buffer(64, 0);
    let mdl = k.IoAllocateMdl(u, 64, false, false);
    k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, LOCK_OPERATION::IoReadAccess);
    k.KeRaiseIrql(5);
    assert_eq!(stop(|| k.MmUnlockPages(mdl)), Bugcheck::c4(0x78, 5, mdl.0, 0));
}

// ---- Automatic checks (any verifier flag) ----

#[test]
fn mdl_misuse_is_c4_7c_7d_7f_b0() {
    let (k, _) = machine(POOL);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::PagedPool, 64, TAG);
    let mdl = k.IoAllocateMdl(p, 64, false, false);
    assert_eq!(stop(|| k.MmBuildMdlForNonPagedPool(mdl)), Bugcheck::c4(0x7F, 0, mdl.0, 0));

    let (k, _) = machine(POOL);
    let (_, mdl) = nonpaged_mdl(&k, 64);
    let flags = (MDL_SOURCE_IS_NONPAGED_POOL | MDL_MAPPED_TO_SYSTEM_VA) as u64;
    let b = stop(|| {
        let _ = k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::KernelMode, LOCK_OPERATION::IoReadAccess);
    });
    assert_eq!(b, Bugcheck::c4(0xB0, mdl.0, flags, 4));
    assert_eq!(stop(|| k.MmUnlockPages(mdl)), Bugcheck::c4(0x7D, mdl.0, flags, 0));

    let (k, _) = machine(POOL);
    let u = k.alloc_user_buffer(64, 0);
    let mdl = k.IoAllocateMdl(u, 64, false, false);
    assert_eq!(stop(|| k.MmUnlockPages(mdl)), Bugcheck::c4(0x7C, mdl.0, 0, 0));
}

#[test]
fn bad_pool_frees_are_c4_00_10_13() {
    let (k, _) = machine(POOL);
    assert_eq!(
        stop(|| {
            let _ = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 0, TAG);
        }),
        Bugcheck::c4(0x00, 0, 0, 0)
    );
    assert_eq!(stop(|| k.ExFreePoolWithTag(PVOID(0x1234), TAG)), Bugcheck::c4(0x10, 0x1234, 0, 0));
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 8, TAG);
    clean(|| k.ExFreePoolWithTag(p, TAG));
    assert_eq!(stop(|| k.ExFreePoolWithTag(p, TAG)), Bugcheck::c4(0x13, 0, p.0, 0));
}

// ---- Pool tracking (0x8) ----

#[test]
fn unload_with_pool_allocations_is_c4_60() {
    let (k, _) = machine(POOL);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 100, TAG);
    let q = k.ExAllocatePoolWithTag(POOL_TYPE::PagedPool, 30, TAG);
    assert_eq!(k.pool_allocations().len(), 2);
    assert_eq!(stop(|| k.unload_driver()), Bugcheck::c4(0x60, 30, 100, 2));
    k.ExFreePoolWithTag(p, TAG);
    k.ExFreePoolWithTag(q, TAG);
    clean(|| k.unload_driver());
}

// ---- Deadlock detection (0x20) ----

#[test]
fn recursive_fast_mutex_is_c4_1000_but_kmutex_may_recurse() {
    let (k, _) = machine(DEADLOCK);
    let m = k.ExInitializeFastMutex();
    k.ExAcquireFastMutex(m);
    assert_eq!(stop(|| k.ExAcquireFastMutex(m)), Bugcheck::c4(0x1000, m.0, 0, 0));
    let (k, _) = machine(DEADLOCK | IRQL);
    let km = k.KeInitializeMutex(0);
    clean(|| {
        k.KeWaitForMutexObject(km);
        k.KeWaitForMutexObject(km);
        k.KeReleaseMutex(km, false);
        k.KeReleaseMutex(km, false);
    });
}

#[test]
fn lock_order_inversion_is_c4_1001() {
    let (k, _) = machine(DEADLOCK);
    let a = k.KeInitializeMutex(0);
    let b = k.KeInitializeMutex(0);
    clean(|| {
        k.KeWaitForMutexObject(a);
        k.KeWaitForMutexObject(b);
        k.KeReleaseMutex(b, false);
        k.KeReleaseMutex(a, false);
        k.KeWaitForMutexObject(a);
        k.KeWaitForMutexObject(b);
        k.KeReleaseMutex(b, false);
        k.KeReleaseMutex(a, false);
    });
    k.KeWaitForMutexObject(b);
    assert_eq!(
        stop(|| {
            let _ = k.KeWaitForMutexObject(a);
        }),
        Bugcheck::c4(0x1001, a.0, 0, 0)
    );
}

#[test]
fn release_by_another_thread_is_c4_1004_and_unacquired_c4_1007() {
    let (k, _) = machine(DEADLOCK);
    let m = k.KeInitializeMutex(0);
    let k2 = k.clone();
    std::thread::spawn(move || {
        let _ = k2.KeWaitForMutexObject(m);
    })
    .join()
    .unwrap();
    let b = stop(|| {
        let _ = k.KeReleaseMutex(m, false);
    });
    assert_eq!((b.code, b.params[0], b.params[1]), (0xC4, 0x1004, m.0));
    assert!(b.params[2] != 0 && b.params[3] != 0 && b.params[2] != b.params[3], "owner and releaser differ: {b}");
    let l = k.KeInitializeSpinLock();
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(stop(|| k.KeReleaseSpinLock(l, PASSIVE_LEVEL)), Bugcheck::c4(0x1007, l.0, 0, 0));
}

#[test]
fn locks_really_block_other_threads() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let (k, _) = machine(0x209BB);
    let m = k.ExInitializeFastMutex();
    k.ExAcquireFastMutex(m);
    let entered = Arc::new(AtomicBool::new(false));
    let (k2, e2) = (k.clone(), entered.clone());
    let t = std::thread::spawn(move || {
        k2.ExAcquireFastMutex(m);
        e2.store(true, Ordering::SeqCst);
        k2.ExReleaseFastMutex(m);
    });
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(!entered.load(Ordering::SeqCst), "second thread got a held fast mutex");
    k.ExReleaseFastMutex(m);
    t.join().unwrap();
    assert!(entered.load(Ordering::SeqCst));
}

// ---- DMA checking (0x80) ----

#[test]
fn double_frees_are_e6_03_04_05_06() {
    let (k, _) = machine(DMA);
    let (a, _) = adapter(&k);
    let mut la = PHYSICAL_ADDRESS(0);
    let va = k.AllocateCommonBuffer(a, 4096, &mut la, true);
    clean(|| k.FreeCommonBuffer(a, 4096, la, va, true));
    assert_eq!(stop(|| k.FreeCommonBuffer(a, 4096, la, va, true)), Bugcheck::e6(0x03, 1, 0, 0));

    k.KeRaiseIrql(DISPATCH_LEVEL);
    alloc_channel(&k, a, 2, IO_ALLOCATION_ACTION::KeepObject).unwrap();
    clean(|| k.FreeAdapterChannel(a));
    assert_eq!(stop(|| k.FreeAdapterChannel(a)), Bugcheck::e6(0x04, 1, 0, 0));

    let base = alloc_channel(&k, a, 2, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters).unwrap();
    clean(|| k.FreeMapRegisters(a, base, 2));
    assert_eq!(stop(|| k.FreeMapRegisters(a, base, 2)), Bugcheck::e6(0x05, 2, 0, 0));

    let (va, mdl) = nonpaged_mdl(&k, 256);
    let sg = get_sg(&k, a, mdl, va, 256, true).unwrap();
    clean(|| k.PutScatterGatherList(a, sg.Handle, true));
    assert_eq!(stop(|| k.PutScatterGatherList(a, sg.Handle, true)), Bugcheck::e6(0x06, 1, 2, 0));
}

#[test]
fn adapter_released_with_outstanding_resources_is_e6_07_to_0a() {
    let (k, _) = machine(DMA);
    let (a, _) = adapter(&k);
    let mut la = PHYSICAL_ADDRESS(0);
    let va = k.AllocateCommonBuffer(a, 4096, &mut la, true);
    assert_eq!(stop(|| k.PutDmaAdapter(a)), Bugcheck::e6(0x07, a.0, 1, 0));
    k.FreeCommonBuffer(a, 4096, la, va, true);

    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    alloc_channel(&k, a, 1, IO_ALLOCATION_ACTION::KeepObject).unwrap();
    k.KeLowerIrql(old);
    assert_eq!(stop(|| k.PutDmaAdapter(a)), Bugcheck::e6(0x08, a.0, 1, 0));
    k.KeRaiseIrql(DISPATCH_LEVEL);
    k.FreeAdapterChannel(a);

    let base = alloc_channel(&k, a, 3, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters).unwrap();
    k.KeLowerIrql(old);
    assert_eq!(stop(|| k.PutDmaAdapter(a)), Bugcheck::e6(0x09, a.0, 3, 0));
    k.KeRaiseIrql(DISPATCH_LEVEL);
    k.FreeMapRegisters(a, base, 3);
    k.KeLowerIrql(old);

    let (bva, mdl) = nonpaged_mdl(&k, 128);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let sg = get_sg(&k, a, mdl, bva, 128, true).unwrap();
    k.KeLowerIrql(old);
    assert_eq!(stop(|| k.PutDmaAdapter(a)), Bugcheck::e6(0x0A, a.0, 1, 0));
    assert_eq!(stop(|| k.unload_driver()), Bugcheck::e6(0x0A, a.0, 1, 0));
    k.KeRaiseIrql(DISPATCH_LEVEL);
    k.PutScatterGatherList(a, sg.Handle, true);
    k.KeLowerIrql(old);
    clean(|| k.PutDmaAdapter(a));
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(
        stop(|| {
            let _ = get_sg(&k, a, mdl, bva, 128, true);
        }),
        Bugcheck::e6(0x18, a.0, 0, 0)
    );
}

fn machine_with_registers(flags: u32, map_registers: u32) -> std::sync::Arc<NtModel> {
    machine_with(vhca_ntmodel::NtModelConfig {
        verifier: vhca_ntmodel::VerifierFlags(flags),
        map_registers,
        ..Default::default()
    })
    .0
}

#[test]
fn map_register_limits_are_e6_0b_0c_and_a_clean_failure_without_verifier() {
    for flags in [0, DMA] {
        let k = machine_with_registers(flags, 8);
        let (a, granted) = adapter(&k);
        assert_eq!(granted, 8, "granted is capped by the HAL's registers");
        k.KeRaiseIrql(DISPATCH_LEVEL);
        let too_many = NtModel::run_guarded(|| alloc_channel(&k, a, 9, IO_ALLOCATION_ACTION::KeepObject));
        k.AllocateAdapterChannel(a, PDO, 1, channel_routine(&k, IO_ALLOCATION_ACTION::KeepObject).1);
        let second_channel =
            NtModel::run_guarded(|| alloc_channel(&k, a, 1, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters));
        if flags == 0 {
            assert_eq!(too_many, Ok(Err(STATUS_INSUFFICIENT_RESOURCES)));
            assert_eq!(second_channel, Ok(Err(STATUS_PENDING)), "queued until the channel is freed");
        } else {
            assert_eq!(too_many, Err(Bugcheck::e6(0x0C, 9, 8, 0)));
            assert_eq!(second_channel, Err(Bugcheck::e6(0x0B, 1, 0, 0)));
        }
    }
}

#[test]
fn a_64_bit_bus_master_uses_no_map_registers_without_dma_checking() {
    let k = machine_with_registers(0, 8);
    let (a, _) = adapter(&k);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let action = IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters;
    let bases: Vec<_> = (0..4).map(|_| alloc_channel(&k, a, 6, action)).collect();
    assert!(bases.iter().all(|b| b.is_ok()), "4 × 6 registers from a pool of 8, none consumed: {bases:?}");
    assert_eq!(k.map_registers_free(a), Some(8));
}

#[test]
fn a_32_bit_adapter_uses_map_registers_and_queues_without_dma_checking() {
    let k = machine_with_registers(0, 8);
    let mut n = 0;
    let description = DEVICE_DESCRIPTION { Dma64BitAddresses: false, ..DEVICE_DESCRIPTION::bus_master_64(64 * 1024) };
    let a = k.IoGetDmaAdapter(PDO, &description, &mut n);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let action = IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters;
    let first = alloc_channel(&k, a, 6, action).unwrap();
    assert_eq!(k.map_registers_free(a), Some(2));
    let (late, routine) = channel_routine(&k, action);
    assert_eq!(k.AllocateAdapterChannel(a, PDO, 4, routine), STATUS_SUCCESS);
    assert!(late.lock().unwrap().is_none(), "queued: only 2 registers free");
    k.FreeMapRegisters(a, first, 6);
    let (_, irql) = late.lock().unwrap().take().expect("AdapterControl ran once the registers came back");
    assert_eq!(irql, DISPATCH_LEVEL);
    assert_eq!(k.map_registers_free(a), Some(4));
}

#[test]
fn execution_routines_run_at_dispatch_level_whatever_the_caller() {
    // Without the verifier nothing stops a caller at PASSIVE_LEVEL; Windows still calls AdapterControl and
    // AdapterListControl at DISPATCH_LEVEL, and the caller's IRQL is back afterwards.
    let k = machine_with_registers(0, 8);
    let (a, _) = adapter(&k);
    let (va, mdl) = nonpaged_mdl(&k, 64);
    let (list, routine) = list_routine(&k);
    assert_eq!(k.GetScatterGatherList(a, PDO, mdl, va, 64, routine, true), STATUS_SUCCESS);
    assert_eq!(list.lock().unwrap().as_ref().map(|(_, irql)| *irql), Some(DISPATCH_LEVEL));
    let (base, routine) = channel_routine(&k, IO_ALLOCATION_ACTION::DeallocateObject);
    assert_eq!(k.AllocateAdapterChannel(a, PDO, 1, routine), STATUS_SUCCESS);
    assert_eq!(base.lock().unwrap().as_ref().map(|(_, irql)| *irql), Some(DISPATCH_LEVEL));
    assert_eq!(k.KeGetCurrentIrql(), PASSIVE_LEVEL);
}

#[test]
fn adapter_control_returning_deallocate_object_gives_the_registers_back() {
    let k = machine_with_registers(DMA, 8);
    let (a, _) = adapter(&k);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    clean(|| alloc_channel(&k, a, 8, IO_ALLOCATION_ACTION::DeallocateObject)).unwrap();
    assert_eq!(k.map_registers_free(a), Some(8));
    clean(|| alloc_channel(&k, a, 8, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters)).unwrap();
    assert_eq!(k.map_registers_free(a), Some(0));
}

#[test]
fn under_dma_checking_requests_short_of_map_registers_wait_for_them_instead_of_failing() {
    let k = machine_with_registers(DMA, 8);
    let (a, _) = adapter(&k);
    let (va, mdl) = nonpaged_mdl(&k, 6 * 4096);
    let (vb, mdl_b) = nonpaged_mdl(&k, 4 * 4096);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let first = clean(|| get_sg(&k, a, mdl, va, 6 * 4096, true)).unwrap();
    let (late, routine) = list_routine(&k);
    assert_eq!(clean(|| k.GetScatterGatherList(a, PDO, mdl_b, vb, 4 * 4096, routine, true)), STATUS_SUCCESS);
    assert!(late.lock().unwrap().is_none(), "4 pages need 4 of the 2 free registers: queued");
    let (channel, channel_routine) = channel_routine(&k, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters);
    k.AllocateAdapterChannel(a, PDO, 1, channel_routine);
    assert!(channel.lock().unwrap().is_none(), "queued behind the list, in order");
    clean(|| k.PutScatterGatherList(a, first.Handle, true));
    let (list, irql) = late.lock().unwrap().take().expect("AdapterListControl ran when the first list was put");
    assert_eq!((list.Elements[0].Length, irql), (4 * 4096, DISPATCH_LEVEL));
    assert!(channel.lock().unwrap().is_some(), "the channel came next");
    assert_eq!(k.map_registers_free(a), Some(3));
}

#[test]
fn a_list_needing_more_registers_than_granted_is_e6_0c_or_insufficient_resources() {
    for flags in [0x0, DMA] {
        let k = machine_with_registers(flags, 8);
        let mut n = 0;
        let description = DEVICE_DESCRIPTION { Dma64BitAddresses: false, ..DEVICE_DESCRIPTION::bus_master_64(4096) };
        let a = k.IoGetDmaAdapter(PDO, &description, &mut n);
        assert_eq!(n, 2);
        let (va, mdl) = nonpaged_mdl(&k, 3 * 4096);
        k.KeRaiseIrql(DISPATCH_LEVEL);
        let r = NtModel::run_guarded(|| get_sg(&k, a, mdl, va, 3 * 4096, true));
        if flags == 0 {
            assert_eq!(r, Ok(Err(STATUS_INSUFFICIENT_RESOURCES)));
        } else {
            assert_eq!(r, Err(Bugcheck::e6(0x0C, 3, 2, 0)));
        }
    }
}

#[test]
fn flushing_what_was_never_mapped_is_e6_16() {
    let (k, _) = machine(DMA);
    let (a, _) = adapter(&k);
    let (va, mdl) = nonpaged_mdl(&k, 64);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let base = alloc_channel(&k, a, 1, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters).unwrap();
    assert_eq!(stop(|| assert!(!k.FlushAdapterBuffers(a, mdl, base, va, 64, true))), Bugcheck::e6(0x16, base.0, 0, 0));
    let (k, _) = machine(0);
    let (a, _) = adapter(&k);
    let (va, mdl) = nonpaged_mdl(&k, 64);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let base = alloc_channel(&k, a, 1, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters).unwrap();
    assert!(!clean(|| k.FlushAdapterBuffers(a, mdl, base, va, 64, true)));
}

#[test]
fn map_transfer_past_its_registers_is_e6_15_or_a_clean_failure() {
    for flags in [0, DMA] {
        let (k, _) = machine(flags);
        let (a, _) = adapter(&k);
        let va = k.MmAllocateContiguousMemorySpecifyCache(
            4 * 4096,
            PHYSICAL_ADDRESS(0),
            PHYSICAL_ADDRESS(u64::MAX),
            PHYSICAL_ADDRESS(0),
            MEMORY_CACHING_TYPE::MmCached,
        );
        let mdl = k.IoAllocateMdl(va, 4 * 4096, false, false);
        k.MmBuildMdlForNonPagedPool(mdl);
        k.KeRaiseIrql(DISPATCH_LEVEL);
        let base = alloc_channel(&k, a, 2, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters).unwrap();
        let mut len = 4 * 4096;
        let r = NtModel::run_guarded(|| k.MapTransfer(a, mdl, base, va, &mut len, true));
        if flags == 0 {
            assert_eq!(r, Ok(Err(STATUS_INSUFFICIENT_RESOURCES)));
            let mut len = 2 * 4096;
            clean(|| {
                assert!(k.MapTransfer(a, mdl, base, va, &mut len, true).is_ok());
                assert!(k.FlushAdapterBuffers(a, mdl, base, va, len, true));
                k.FreeMapRegisters(a, base, 2);
            });
        } else {
            assert_eq!(r, Err(Bugcheck::e6(0x15, 4, 2, 0)));
        }
    }
}

#[test]
fn unflushed_and_freed_while_mapped_are_e6_0d_and_10() {
    let (k, _) = machine(DMA);
    let (a, _) = adapter(&k);
    let (va1, mdl1) = nonpaged_mdl(&k, 100);
    let (va2, mdl2) = nonpaged_mdl(&k, 100);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let base = alloc_channel(&k, a, 4, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters).unwrap();
    let mut len = 100;
    k.MapTransfer(a, mdl1, base, va1, &mut len, true).unwrap();
    assert_eq!(
        stop(|| {
            let _ = k.MapTransfer(a, mdl2, base, va2, &mut len, true);
        }),
        Bugcheck::e6(0x0D, 100, 4 * 4096, 0)
    );
    assert_eq!(stop(|| k.FreeMapRegisters(a, base, 4)), Bugcheck::e6(0x10, 1, 0, 0));
    clean(|| {
        assert!(k.FlushAdapterBuffers(a, mdl1, base, va1, 100, true));
        let mut len = 100;
        k.MapTransfer(a, mdl2, base, va2, &mut len, true).unwrap();
        assert!(k.FlushAdapterBuffers(a, mdl2, base, va2, 100, true));
        k.FreeMapRegisters(a, base, 4);
    });
}

#[test]
fn dma_on_unlocked_paged_memory_is_e6_0e() {
    let (k, _) = machine(DMA);
    let (a, _) = adapter(&k);
    let u = k.alloc_user_buffer(8192, 0);
    let mdl = k.IoAllocateMdl(u, 8192, false, false);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(
        stop(|| {
            let _ = get_sg(&k, a, mdl, u, 8192, false);
        }),
        Bugcheck::e6(0x0E, mdl.0, 0, 0)
    );
    k.KeLowerIrql(PASSIVE_LEVEL);
    k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, LOCK_OPERATION::IoModifyAccess);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let sg = clean(|| get_sg(&k, a, mdl, u, 8192, false)).unwrap();
    k.PutScatterGatherList(a, sg.Handle, false);
    k.KeLowerIrql(PASSIVE_LEVEL);
    k.MmUnlockPages(mdl);
}

#[test]
fn device_writing_past_the_buffer_is_e6_0f_at_put() {
    let (k, backend) = machine(DMA);
    let (a, _) = adapter(&k);
    let (va, mdl) = nonpaged_mdl(&k, 4096);
    let buf = va.offset(100).unwrap();
    let sub = k.IoAllocateMdl(buf, 200, false, false);
    k.MmBuildMdlForNonPagedPool(sub);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let sg = get_sg(&k, a, sub, buf, 200, false).unwrap();
    let dev = sg.Elements[0].Address.0;
    backend.device_write(dev + 200, &[0xAA]).unwrap();
    assert_eq!(stop(|| k.PutScatterGatherList(a, sg.Handle, false)), Bugcheck::e6(0x0F, 5, buf.0, buf.0 + 200));
    let sg = get_sg(&k, a, sub, buf, 200, false).unwrap();
    backend.device_write(sg.Elements[0].Address.0 - 1, &[0xAA]).unwrap();
    assert_eq!(stop(|| k.PutScatterGatherList(a, sg.Handle, false)), Bugcheck::e6(0x0F, 4, buf.0, buf.0 - 1));
    let _ = mdl;
}

#[test]
fn dma_routines_at_wrong_irql_are_e6_13_and_14() {
    let (k, _) = machine(DMA);
    let (a, _) = adapter(&k);
    let (va, mdl) = nonpaged_mdl(&k, 64);
    assert_eq!(
        stop(|| {
            let _ = get_sg(&k, a, mdl, va, 64, true);
        }),
        Bugcheck::e6(0x13, 1, 2, 0),
        "GetScatterGatherList is a DISPATCH_LEVEL routine, PASSIVE_LEVEL is not enough"
    );
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let sg = get_sg(&k, a, mdl, va, 64, true).unwrap();
    k.KeLowerIrql(PASSIVE_LEVEL);
    assert_eq!(stop(|| k.PutScatterGatherList(a, sg.Handle, true)), Bugcheck::e6(0x13, 1, 2, 0));
    k.KeRaiseIrql(5);
    assert_eq!(
        stop(|| {
            let _ = get_sg(&k, a, mdl, va, 64, true);
        }),
        Bugcheck::e6(0x13, 1, 2, 5)
    );
    let (k, _) = machine(DMA);
    let (a, _) = adapter(&k);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let base = alloc_channel(&k, a, 1, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters).unwrap();
    k.KeLowerIrql(PASSIVE_LEVEL);
    assert_eq!(stop(|| k.FreeMapRegisters(a, base, 1)), Bugcheck::e6(0x13, 1, 2, 0));
    assert_eq!(
        stop(|| {
            let _ = alloc_channel(&k, a, 1, IO_ALLOCATION_ACTION::KeepObject);
        }),
        Bugcheck::e6(0x13, 1, 2, 0)
    );
    k.KeRaiseIrql(APC_LEVEL);
    assert_eq!(stop(|| k.PutDmaAdapter(a)), Bugcheck::e6(0x14, 0, 0, 0));
}

#[test]
fn mapping_a_mapped_range_is_e6_1d_and_zero_length_e6_21() {
    let (k, _) = machine(DMA);
    let (a, _) = adapter(&k);
    let (va, mdl) = nonpaged_mdl(&k, 512);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    let sg = get_sg(&k, a, mdl, va, 512, true).unwrap();
    let inner = va.offset(256).unwrap();
    let b = stop(|| {
        let _ = get_sg(&k, a, mdl, inner, 128, true);
    });
    assert_eq!(b, Bugcheck::e6(0x1D, inner.0, inner.0 + 128, inner.0));
    assert_eq!(
        stop(|| {
            let _ = get_sg(&k, a, mdl, va, 0, true);
        }),
        Bugcheck::e6(0x21, 0, 0, 0)
    );
    k.PutScatterGatherList(a, sg.Handle, true);
}

#[test]
fn iommu_fault_is_e6_26_with_dma_checking_and_only_recorded_without() {
    let (k, _) = machine(DMA);
    assert_eq!(stop(|| k.report_iommu_fault(PDO, 0xdead000, 4)), Bugcheck::e6(0x26, PDO.0, 0xdead000, 4));
    let (k, _) = machine(0);
    clean(|| k.report_iommu_fault(PDO, 0xdead000, 4));
    assert_eq!(k.iommu_faults().len(), 1);
}

#[test]
fn full_legal_dma_lifecycle_under_standard_raises_nothing() {
    let (k, backend) = machine(0x209BB);
    clean(|| {
        let (a, _) = adapter(&k);
        let mut la = PHYSICAL_ADDRESS(0);
        let cb = k.AllocateCommonBuffer(a, 3 * 4096, &mut la, true);
        assert!(!cb.is_null());
        let (va, mdl) = nonpaged_mdl(&k, 300);
        let old = k.KeRaiseIrql(DISPATCH_LEVEL);
        let sg = get_sg(&k, a, mdl, va, 300, false).unwrap();
        let base = alloc_channel(&k, a, 2, IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters).unwrap();
        let (v2, m2) = nonpaged_mdl(&k, 5000);
        let mut len = 5000;
        k.MapTransfer(a, m2, base, v2, &mut len, true).unwrap();
        assert!(k.FlushAdapterBuffers(a, m2, base, v2, len, true));
        k.FreeMapRegisters(a, base, 2);
        k.PutScatterGatherList(a, sg.Handle, false);
        k.KeLowerIrql(old);
        k.FreeCommonBuffer(a, 3 * 4096, la, cb, true);
        k.PutDmaAdapter(a);
        k.IoFreeMdl(mdl);
        k.IoFreeMdl(m2);
        k.ExFreePoolWithTag(va, TAG);
        k.ExFreePoolWithTag(v2, TAG);
        k.unload_driver();
    });
    assert!(k.bugchecks().is_empty());
    assert_eq!(backend.mapped_pages(), 0, "every device mapping was taken down");
}

#[test]
fn bugcheck_prints_in_windows_form() {
    let b = Bugcheck::e6(0x26, 0xFFFFC00000001000, 0x1_0000_0000, 4);
    assert_eq!(
        b.to_string(),
        "*** STOP: 0x000000E6 (0x0000000000000026,0xFFFFC00000001000,0x0000000100000000,0x0000000000000004)\n\
         DRIVER_VERIFIER_DMA_VIOLATION"
    );
    assert_eq!(Bugcheck::c4(0x33, 2, 0, 0).name(), "DRIVER_VERIFIER_DETECTED_VIOLATION");
}

// ---- The remaining rows of docs/verifier.md ----

#[test]
fn remaining_irql_rules() {
    let (k, _) = machine(IRQL);
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 8, TAG);
    k.KeRaiseIrql(5);
    assert_eq!(stop(|| k.ExFreePoolWithTag(p, TAG)), Bugcheck::c4(0x12, 5, 0, p.0));
    assert_eq!(stop(|| k.KeEnterCriticalRegion()), Bugcheck::c4(0x11A, 5, 0, 0));
    assert_eq!(stop(|| k.KeLeaveCriticalRegion()), Bugcheck::c4(0x11B, 5, 0, 0));
    let m = k.KeInitializeMutex(0);
    assert_eq!(
        stop(|| {
            let _ = k.KeWaitForMutexObject(m);
        }),
        Bugcheck::c4(0x120, 5, m.0, 0)
    );
    assert_eq!(
        stop(|| {
            let _ = k.KeReleaseMutex(m, false);
        }),
        Bugcheck::c4(0xE5, 5, 0, 0)
    );
    assert_eq!(
        stop(|| {
            let _ = k.IoAllocateMdl(p, 8, false, false);
        }),
        Bugcheck::c4(0xE5, 5, 0, 0)
    );
    let g = k.KeInitializeGuardedMutex();
    assert_eq!(stop(|| k.KeAcquireGuardedMutex(g)), Bugcheck::c4(0xE5, 5, 0, 0));
    let any = PHYSICAL_ADDRESS(0);
    let contiguous = || k.MmAllocateContiguousMemorySpecifyCache(4096, any, any, any, MEMORY_CACHING_TYPE::MmCached);
    assert_eq!(
        stop(|| {
            let _ = contiguous();
        }),
        Bugcheck::c4(0xE5, 5, 0, 0)
    );
    k.KeLowerIrql(PASSIVE_LEVEL);
    let c = contiguous();
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(stop(|| k.MmFreeContiguousMemory(c)), Bugcheck::c4(0xE5, 2, 0, 0));
    k.KeLowerIrql(PASSIVE_LEVEL);

    let r = k.ExInitializeResourceLite();
    k.KeEnterCriticalRegion();
    k.ExAcquireResourceSharedLite(r, true);
    k.KeLeaveCriticalRegion();
    assert_eq!(stop(|| k.ExReleaseResourceLite(r)), Bugcheck::c4(0x38, 0, 0, r.0));
    clean(|| {
        k.KeAcquireGuardedMutex(g);
        k.KeReleaseGuardedMutex(g);
        k.MmFreeContiguousMemory(c);
    });
}

#[test]
fn remaining_automatic_rules() {
    let (k, _) = machine(POOL);
    assert_eq!(stop(|| k.KeLeaveCriticalRegion()), Bugcheck::c4(0x3E, 0, 0, 0));
    assert_eq!(stop(|| k.ExAcquireFastMutex(PFAST_MUTEX(0x42))), Bugcheck::c4(0x1002, 0x42, 0, 0));
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 8, TAG);
    k.ExFreePoolWithTag(p, TAG);
    let mut b = [0u8; 1];
    assert_eq!(stop(|| k.RtlCopyFromVa(&mut b, p)), Bugcheck::new(0x50, p.0, 0, 0, 0));
    assert_eq!(stop(|| k.RtlCopyToVa(p, &b)), Bugcheck::new(0x50, p.0, 1, 0, 0));
}

#[test]
fn spin_lock_recursion_is_c4_1000() {
    let (k, _) = machine(DEADLOCK);
    let l = k.KeInitializeSpinLock();
    k.KeAcquireSpinLock(l);
    assert_eq!(
        stop(|| {
            let _ = k.KeAcquireSpinLock(l);
        }),
        Bugcheck::c4(0x1000, l.0, 0, 0)
    );
}

#[test]
fn remaining_dma_irql_rules() {
    let (k, _) = machine(DMA);
    let (a, _) = adapter(&k);
    let mut la = PHYSICAL_ADDRESS(0);
    let va = k.AllocateCommonBuffer(a, 4096, &mut la, true);
    k.KeRaiseIrql(DISPATCH_LEVEL);
    assert_eq!(stop(|| k.FreeCommonBuffer(a, 4096, la, va, true)), Bugcheck::e6(0x13, 1, 0, 2));
    let (bva, mdl) = nonpaged_mdl(&k, 64);
    let base = alloc_channel(&k, a, 1, IO_ALLOCATION_ACTION::KeepObject).unwrap();
    k.KeRaiseIrql(5);
    let mut len = 64;
    assert_eq!(
        stop(|| {
            let _ = k.MapTransfer(a, mdl, base, bva, &mut len, true);
        }),
        Bugcheck::e6(0x13, 2, 2, 5)
    );
    assert_eq!(
        stop(|| {
            let _ = k.FlushAdapterBuffers(a, mdl, base, bva, 64, true);
        }),
        Bugcheck::e6(0x13, 2, 2, 5)
    );
    assert_eq!(stop(|| k.FreeAdapterChannel(a)), Bugcheck::e6(0x13, 1, 2, 5));
    k.KeLowerIrql(DISPATCH_LEVEL);
    k.MapTransfer(a, mdl, base, bva, &mut len, true).unwrap();
    assert_eq!(stop(|| k.FreeAdapterChannel(a)), Bugcheck::e6(0x10, 1, 0, 0));
    clean(|| {
        assert!(k.FlushAdapterBuffers(a, mdl, base, bva, 64, true));
        k.FreeAdapterChannel(a);
    });
}

// ---- Disabled rules (vhca.disable_rule): the check is skipped, the next rule in line still fires ----

fn machine_without(
    flags: u32,
    rules: &[&str],
) -> (std::sync::Arc<NtModel>, std::sync::Arc<vhca_ntmodel::HostDmaBackend>) {
    machine_with(vhca_ntmodel::NtModelConfig {
        verifier: vhca_ntmodel::VerifierFlags(flags),
        disabled_rules: rules.iter().map(|r| vhca_ntmodel::RuleId::parse(r).unwrap()).collect(),
        ..Default::default()
    })
}

#[test]
fn rule_ids_parse_with_and_without_a_subcode() {
    let r = vhca_ntmodel::RuleId::parse("0xE6/0x26").unwrap();
    assert_eq!((r.code, r.subcode), (0xE6, Some(0x26)));
    assert_eq!(r.to_string(), "0xE6/0x26");
    assert_eq!(vhca_ntmodel::RuleId::parse("c4").unwrap().subcode, None);
    assert!(vhca_ntmodel::RuleId::parse("0xE6/zz").is_none());
    assert!(vhca_ntmodel::RuleId::parse("0x1_0000_0000").is_none());
}

#[test]
fn common_buffer_at_apc_is_e6_13_under_dma_checking_and_unchecked_by_irql_checking() {
    // AllocateCommonBuffer is reached through the adapter's DMA_OPERATIONS, not imported: IRQL checking's thunks
    // never see it, DMA checking's wrapped table does.
    for (flags, expected) in
        [(IRQL, None), (DMA, Some(Bugcheck::e6(0x13, 1, 0, 1))), (0x209BB, Some(Bugcheck::e6(0x13, 1, 0, 1)))]
    {
        let (k, _) = machine(flags);
        let (a, _) = adapter(&k);
        let m = k.ExInitializeFastMutex();
        k.ExAcquireFastMutex(m);
        let mut la = PHYSICAL_ADDRESS(0);
        let r = NtModel::run_guarded(|| {
            k.AllocateCommonBuffer(a, 4096, &mut la, true);
        });
        assert_eq!(r.err(), expected, "flags {flags:#x}");
    }
}

#[test]
fn disabling_every_rule_on_the_path_makes_it_run_as_if_unchecked() {
    let (k, _) = machine_without(IRQL | DMA, &["0xC4", "0xE6/0x13"]);
    let (a, _) = adapter(&k);
    let m = k.ExInitializeFastMutex();
    k.ExAcquireFastMutex(m);
    let mut la = PHYSICAL_ADDRESS(0);
    let va = clean(|| k.AllocateCommonBuffer(a, 4096, &mut la, true));
    assert!(!va.is_null());
}

#[test]
fn a_disabled_iommu_rule_only_records_the_fault() {
    let (k, _) = machine_without(DMA, &["0xE6/0x26"]);
    clean(|| k.report_iommu_fault(PDO, 0x1000, 4));
    assert_eq!(k.iommu_faults().len(), 1);
    let (k, _) = machine_without(DMA, &["0xE6/0x0E"]);
    assert_eq!(stop(|| k.report_iommu_fault(PDO, 0x1000, 4)), Bugcheck::e6(0x26, PDO.0, 0x1000, 4));
}
