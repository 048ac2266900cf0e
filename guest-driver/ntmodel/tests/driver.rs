//! The driver core on the model, against a fake device: the seed's scenarios, each with the verifier off and on.

mod common;

use std::sync::Arc;

use common::*;
use vhca_driver_core::*;
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, HostDmaBackend, NtModel, NtModelConfig, VerifierFlags};
use vhca_proto::{ACCESS_LOCAL_WRITE, CQE_SIZE};

type Driver = Hca<NtModel, FakeDevice>;

fn open(k: &Arc<NtModel>, backend: &Arc<HostDmaBackend>, config: HcaConfig) -> (Driver, FakeDevice) {
    let dev = FakeDevice::new(k.clone(), backend.clone());
    (Hca::open(k.clone(), dev.clone(), PDO, config).expect("open"), dev)
}

fn with(flags: u32, map_registers: u32, max_contiguous_pages: Option<usize>) -> (Arc<NtModel>, Arc<HostDmaBackend>) {
    machine_with(NtModelConfig {
        verifier: VerifierFlags(flags),
        map_registers,
        max_contiguous_pages,
        ..Default::default()
    })
}

#[test]
fn create_cq_under_a_fast_mutex_is_e6_13_with_dma_checking_and_unchecked_by_irql_checking_alone() {
    for (flags, expected) in [
        (0x2, None),
        (0x80, Some(Bugcheck::e6(0x13, 1, PASSIVE_LEVEL as u64, APC_LEVEL as u64))),
        (0x209BB, Some(Bugcheck::e6(0x13, 1, PASSIVE_LEVEL as u64, APC_LEVEL as u64))),
    ] {
        let (k, b) = machine(flags);
        let (mut hca, _) = open(&k, &b, HcaConfig::default());
        let lock = ClMutex::new(k.clone(), ClMutexKind::FastMutex);
        let r = NtModel::run_guarded(|| {
            lock.acquire();
            let cq = hca.create_cq(256);
            lock.release();
            cq
        });
        assert_eq!(r.as_ref().err(), expected.as_ref(), "flags {flags:#x}: {r:?}");
    }
}

#[test]
fn create_cq_under_kmutex_or_eresource_is_clean_with_the_verifier_on() {
    for kind in [ClMutexKind::KMutex, ClMutexKind::EResource] {
        let (k, b) = machine(0x209BB);
        let (mut hca, dev) = open(&k, &b, HcaConfig::default());
        let lock = ClMutex::new(k.clone(), kind);
        let cq = NtModel::run_guarded(|| {
            lock.acquire();
            assert_eq!(k.KeGetCurrentIrql(), PASSIVE_LEVEL);
            let cq = hca.create_cq(256);
            lock.release();
            cq
        })
        .unwrap_or_else(|b| panic!("{kind:?}: {b}"))
        .unwrap();
        assert_eq!(dev.cq(cq).pages.len(), 2, "256 CQEs of 32 bytes span two pages");
    }
}

#[test]
fn create_cq_under_a_fast_mutex_works_without_the_verifier() {
    let (k, b) = machine(0);
    let (mut hca, _) = open(&k, &b, HcaConfig::default());
    let lock = ClMutex::new(k.clone(), ClMutexKind::FastMutex);
    lock.acquire();
    assert!(hca.create_cq(256).is_ok());
    lock.release();
}

#[test]
fn cq_ring_falls_back_from_one_contiguous_buffer_to_pieces_and_polls_across_them() {
    for (max, pieces) in [(None, vec![8]), (Some(4), vec![4, 4]), (Some(3), vec![2, 2, 2, 2]), (Some(1), vec![1; 8])] {
        let (k, b) = with(0x209BB, 64, max);
        let (mut hca, dev) = open(&k, &b, HcaConfig::default());
        let cq = hca.create_cq(1024).unwrap();
        assert_eq!(hca.cq_ring_pieces(cq).unwrap(), pieces, "max contiguous {max:?}");
        assert_eq!(dev.cq(cq).pages.len(), 8);
        // One CQE on each side of a page (and piece) boundary.
        let per_page = 4096 / CQE_SIZE as u32;
        for i in 0..=per_page {
            assert!(dev.write_cqe(cq, i, 100 + i as u64));
        }
        let got = hca.poll_cq(cq, 1000).unwrap();
        assert_eq!(got.len(), per_page as usize + 1);
        assert_eq!(got.last().unwrap().wr_id.get(), 100 + per_page as u64);
        assert!(hca.poll_cq(cq, 10).unwrap().is_empty(), "nothing new");
        hca.destroy_cq(cq).unwrap();
    }
}

#[test]
fn cq_ring_fails_cleanly_when_not_even_single_pages_are_left() {
    let (k, b) = with(0, 64, Some(0));
    let (mut hca, _) = open(&k, &b, HcaConfig::default());
    assert!(matches!(hca.create_cq(64), Err(DriverError::NoMemory { routine: "AllocateCommonBuffer", .. })));
}

#[test]
fn map_transfer_rings_cost_no_map_registers_without_verifier_and_wait_for_them_with_it() {
    let config = HcaConfig { ring_memory: RingMemory::ContiguousMapTransfer, ..HcaConfig::default() };
    // A 64-bit bus master without double buffering: MapTransfer needs no map registers, the pool never runs out.
    let (k, b) = with(0, 8, None);
    let (mut hca, _) = open(&k, &b, config);
    for _ in 0..4 {
        hca.create_cq(1024).unwrap();
    }
    assert_eq!(k.map_registers_free(hca.adapter()), Some(8));
    // More than IoGetDmaAdapter's per-request maximum is refused in every mode.
    let err = hca.create_cq(2048).unwrap_err();
    assert_eq!(err, DriverError::Kernel { routine: "AllocateAdapterChannel", status: STATUS_INSUFFICIENT_RESOURCES });

    // DMA checking double-buffers through map registers: the second ring's AdapterControl waits for them; the
    // driver gives it up, and when the first ring goes the late routine lets its registers go again.
    let (k, b) = with(0x80, 8, None);
    let (mut hca, _) = open(&k, &b, config);
    let first = hca.create_cq(1024).unwrap();
    let r = NtModel::run_guarded(|| hca.create_cq(1024)).expect("waiting for map registers is no violation");
    assert_eq!(r, Err(DriverError::DmaQueued { routine: "AllocateAdapterChannel" }));
    assert_eq!(k.map_registers_free(hca.adapter()), Some(0));
    hca.destroy_cq(first).unwrap();
    assert_eq!(k.map_registers_free(hca.adapter()), Some(8), "the late routine took nothing");
    assert_eq!(NtModel::run_guarded(|| hca.create_cq(2048)).unwrap_err(), Bugcheck::e6(0x0C, 16, 8, 0));
}

fn shared_mr(flags: u32, mapping: MrMapping, user: bool) -> (Arc<NtModel>, Driver, FakeDevice, PVOID, RegisteredMr) {
    let (k, b) = machine(flags);
    let (mut hca, dev) = open(&k, &b, HcaConfig::default());
    let pd = hca.alloc_pd().unwrap();
    let len = 3 * 4096;
    let source = if user {
        let va = k.alloc_user_buffer(len as u64, 512);
        MrSource::User { va, length: len, skip_lock: false }
    } else {
        let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, len as usize, pool_tag(b"vhmr"));
        MrSource::Kernel { va, length: len }
    };
    let va = match source {
        MrSource::User { va, .. } | MrSource::Kernel { va, .. } => va,
        MrSource::Common { va, .. } => va,
    };
    let mr = hca.reg_mr(pd, source, ACCESS_LOCAL_WRITE, mapping).unwrap();
    (k, hca, dev, va, mr)
}

#[test]
fn shared_sg_registered_buffer_works_without_verifier_and_reads_stale_with_it() {
    let (k, hca, dev, va, mr) = shared_mr(0, MrMapping::ScatterGather, false);
    assert!(dev.write_mr(mr.lkey, 5000, b"fresh"));
    let mut seen = [0u8; 5];
    k.RtlCopyFromVa(&mut seen, va.offset(5000).unwrap());
    assert_eq!(&seen, b"fresh");
    hca.close();

    let (k, mut hca, dev, va, mr) = shared_mr(0x80, MrMapping::ScatterGather, false);
    assert!(dev.write_mr(mr.lkey, 5000, b"fresh"));
    k.RtlCopyFromVa(&mut seen, va.offset(5000).unwrap());
    assert_eq!(seen, [0; 5], "the CPU reads the real pages; the device wrote the verifier's shadow");
    // Deregistered cleanly, nothing leaks: no verifier rule sees the stale read.
    NtModel::run_guarded(|| {
        hca.dereg_mr(mr.lkey).unwrap();
        hca.close();
        k.unload_driver();
    })
    .unwrap();
}

#[test]
fn without_double_buffering_the_shared_sg_buffer_is_fresh_under_dma_checking() {
    // The same registration under DMA checking with the model's double buffering off: the stale read, and with it
    // shared-buffer-sg's verifier-on verdict, is the double buffering's doing.
    let config = NtModelConfig { verifier: VerifierFlags(0x80), double_buffering: false, ..Default::default() };
    let (k, b) = machine_with(config);
    let (mut hca, dev) = open(&k, &b, HcaConfig::default());
    let pd = hca.alloc_pd().unwrap();
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 3 * 4096, pool_tag(b"vhmr"));
    let source = MrSource::Kernel { va, length: 3 * 4096 };
    let mr = hca.reg_mr(pd, source, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather).unwrap();
    assert!(dev.write_mr(mr.lkey, 5000, b"fresh"));
    let mut seen = [0u8; 5];
    k.RtlCopyFromVa(&mut seen, va.offset(5000).unwrap());
    assert_eq!(&seen, b"fresh");
    assert_eq!(k.map_registers_free(hca.adapter()), Some(NtModelConfig::default().map_registers));
}

#[test]
fn dereg_of_a_shared_sg_buffer_delivers_the_device_data_late() {
    let (k, mut hca, dev, va, mr) = shared_mr(0x80, MrMapping::ScatterGather, false);
    assert!(dev.write_mr(mr.lkey, 0, b"late"));
    hca.dereg_mr(mr.lkey).unwrap();
    let mut seen = [0u8; 4];
    k.RtlCopyFromVa(&mut seen, va);
    assert_eq!(&seen, b"late");
    NtModel::run_guarded(|| hca.close()).unwrap();
}

#[test]
fn common_buffer_mr_is_shared_with_and_without_verifier() {
    for flags in [0u32, 0x209BB] {
        let (k, b) = machine(flags);
        let (mut hca, dev) = open(&k, &b, HcaConfig::default());
        let pd = hca.alloc_pd().unwrap();
        let mut la = PHYSICAL_ADDRESS(0);
        let va = k.AllocateCommonBuffer(hca.adapter(), 8192, &mut la, true);
        let mr = hca
            .reg_mr(
                pd,
                MrSource::Common { va, logical: la, length: 8192 },
                ACCESS_LOCAL_WRITE,
                MrMapping::ScatterGather,
            )
            .unwrap();
        assert!(dev.write_mr(mr.lkey, 4100, b"shared"));
        let mut seen = [0u8; 6];
        k.RtlCopyFromVa(&mut seen, va.offset(4100).unwrap());
        assert_eq!(&seen, b"shared", "flags {flags:#x}");
        NtModel::run_guarded(|| {
            hca.dereg_mr(mr.lkey).unwrap();
            k.FreeCommonBuffer(hca.adapter(), 8192, la, va, true);
            hca.close();
        })
        .unwrap();
    }
}

#[test]
fn io_map_common_buffer_fixes_the_shared_user_buffer_under_the_verifier() {
    let (k, mut hca, dev, va, mr) = shared_mr(0x209BB, MrMapping::IoMapCommonBuffer, true);
    assert_eq!(dev.mr(mr.lkey).first_page_offset, 512);
    assert!(dev.write_mr(mr.lkey, 8000, b"direct"));
    let mut seen = [0u8; 6];
    k.RtlCopyFromVa(&mut seen, va.offset(8000).unwrap());
    assert_eq!(&seen, b"direct");
    NtModel::run_guarded(|| {
        hca.dereg_mr(mr.lkey).unwrap();
        hca.close();
    })
    .unwrap();
}

#[test]
fn use_after_unmap_is_an_iommu_fault_e6_26_with_dma_checking() {
    for flags in [0u32, 0x80] {
        let (k, mut hca, dev, _, mr) = shared_mr(flags, MrMapping::ScatterGather, false);
        let stale = dev.mr(mr.lkey);
        hca.dereg_mr(mr.lkey).unwrap();
        let r = NtModel::run_guarded(|| dev.write_mr(mr.lkey, 0, b"x"));
        let iova = stale.pages[0];
        if flags == 0 {
            assert_eq!(r, Ok(false), "the DMA is refused, nothing stops");
        } else {
            assert_eq!(r, Err(Bugcheck::e6(0x26, PDO.0, iova, 4)));
        }
        assert_eq!(k.iommu_faults()[0].address, iova);
    }
}

#[test]
fn user_buffer_registration_without_the_lock_is_e6_0e_with_dma_checking() {
    for flags in [0u32, 0x80] {
        let (k, b) = machine(flags);
        let (mut hca, _) = open(&k, &b, HcaConfig::default());
        let pd = hca.alloc_pd().unwrap();
        let va = k.alloc_user_buffer(8192, 0);
        let source = MrSource::User { va, length: 8192, skip_lock: true };
        let r = NtModel::run_guarded(|| hca.reg_mr(pd, source, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather));
        if flags == 0 {
            assert!(r.unwrap().is_ok(), "without the verifier the unlocked buffer is mapped anyway");
        } else {
            let b = r.unwrap_err();
            assert_eq!((b.code, b.params[0], b.params[2], b.params[3]), (0xE6, 0x0E, 0, 0));
        }
        let locked = MrSource::User { va: k.alloc_user_buffer(8192, 0), length: 8192, skip_lock: false };
        assert!(NtModel::run_guarded(|| hca.reg_mr(pd, locked, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather))
            .unwrap()
            .is_ok());
    }
}

#[test]
fn post_send_writes_the_wqe_into_the_ring_and_rings_the_doorbell() {
    let (k, b) = machine(0x209BB);
    let (mut hca, dev) = open(&k, &b, HcaConfig::default());
    let pd = hca.alloc_pd().unwrap();
    let cq = hca.create_cq(64).unwrap();
    let qp = hca.create_qp(pd, cq, cq, 64, 64).unwrap();
    let wqe = vhca_proto::Wqe { wr_id: 77.into(), ..Default::default() };
    hca.post_send(qp, &wqe).unwrap();
    hca.post_send(qp, &wqe).unwrap();
    let dbs = dev.doorbells();
    assert_eq!(dbs.len(), 2);
    assert_eq!((dbs[1].handle.get(), dbs[1].index.get()), (qp, 2));
    NtModel::run_guarded(|| {
        hca.destroy_qp(qp).unwrap();
        hca.destroy_cq(cq).unwrap();
        hca.close();
        k.unload_driver();
    })
    .unwrap();
}

#[test]
fn abandon_after_a_surprise_removal_sends_the_device_nothing_and_leaves_nothing_behind() {
    let (k, b) = machine(0x209BB);
    let (mut hca, dev) = open(&k, &b, HcaConfig::default());
    let pd = hca.alloc_pd().unwrap();
    let cq = hca.create_cq(64).unwrap();
    hca.create_qp(pd, cq, cq, 64, 64).unwrap();
    let user = MrSource::User { va: k.alloc_user_buffer(8192, 0), length: 8192, skip_lock: false };
    NtModel::run_guarded(|| hca.reg_mr(pd, user, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather)).unwrap().unwrap();
    let sent = dev.commands().len();
    // The unload checks stop the machine on a list, map register, ring or adapter left behind.
    NtModel::run_guarded(|| {
        hca.abandon();
        k.unload_driver();
    })
    .unwrap();
    assert_eq!(dev.commands().len(), sent, "a gone device is sent nothing: {:?}", &dev.commands()[sent..]);
    assert_eq!(k.unreleased_resources(), Vec::<String>::new(), "the user's pages unlocked, nothing kept");
}

#[test]
fn without_ring_fallback_a_fragmented_cq_fails_instead_of_splitting() {
    let (k, b) = with(0, 64, Some(4));
    let (mut hca, _) = open(&k, &b, HcaConfig { ring_fallback: false, ..HcaConfig::default() });
    assert!(matches!(hca.create_cq(1024), Err(DriverError::NoMemory { routine: "AllocateCommonBuffer", .. })));
    assert_eq!(hca.create_cq(512).map(|cq| hca.cq_ring_pieces(cq)), Ok(Some(vec![4])), "4 pages still fit");
}

#[test]
fn batched_posts_ring_one_doorbell_with_the_last_index() {
    let (k, b) = machine(0x209BB);
    let (mut hca, dev) = open(&k, &b, HcaConfig::default());
    let pd = hca.alloc_pd().unwrap();
    let cq = hca.create_cq(64).unwrap();
    let qp = hca.create_qp(pd, cq, cq, 64, 64).unwrap();
    let wqes: Vec<_> = (0..10).map(|i| vhca_proto::Wqe { wr_id: i.into(), ..Default::default() }).collect();
    hca.post_send_many(qp, &wqes).unwrap();
    let dbs = dev.doorbells();
    assert_eq!(dbs.len(), 1);
    assert_eq!((dbs[0].handle.get(), dbs[0].index.get()), (qp, 10));
    let too_many = vec![vhca_proto::Wqe::default(); 65];
    assert!(matches!(hca.post_send_many(qp, &too_many), Err(DriverError::InvalidParameter(_))));
}

#[test]
fn releasing_an_mr_buffer_early_leaves_the_registration_and_the_device_faults() {
    for flags in [0u32, 0x80] {
        let (k, mut hca, dev, _, mr) = shared_mr(flags, MrMapping::ScatterGather, false);
        hca.release_mr_buffer_early(mr.lkey).unwrap();
        assert_eq!(hca.registered_mrs(), vec![mr.lkey], "still registered");
        let r = NtModel::run_guarded(|| dev.write_mr(mr.lkey, 0, b"late"));
        if flags == 0 {
            assert_eq!(r, Ok(false));
        } else {
            assert_eq!(r.unwrap_err().params[0], 0x26);
        }
        assert_eq!(k.iommu_faults().len(), 1);
        // Deregistration now only deregisters: nothing is put twice (no 0xE6/0x06).
        NtModel::run_guarded(|| hca.dereg_mr(mr.lkey).unwrap()).unwrap();
        assert!(hca.registered_mrs().is_empty());
    }
}

#[test]
fn an_sg_mr_whose_list_is_queued_keeps_its_mdl_until_the_late_routine_has_put_the_list_back() {
    // DMA checking double-buffers an S/G list through map registers: with 4, a second 3-page MR's list waits for
    // them, reg_mr gives it up, and the routine runs when the first MR's registers come back, over the second's MDL.
    let (k, b) = with(0x80 | 0x8, 4, None);
    let (mut hca, _dev) = open(&k, &b, HcaConfig::default());
    let pd = hca.alloc_pd().unwrap();
    let len = 3 * 4096;
    let buffers = [0, 1].map(|_| k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, len as usize, pool_tag(b"vhmr")));
    let mr = |hca: &mut Driver, va| {
        hca.reg_mr(pd, MrSource::Kernel { va, length: len }, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather)
    };
    let first = mr(&mut hca, buffers[0]).unwrap();
    let second = NtModel::run_guarded(|| mr(&mut hca, buffers[1])).expect("waiting for map registers is no violation");
    assert_eq!(second.unwrap_err(), DriverError::DmaQueued { routine: "GetScatterGatherList" });
    // The first MR's registers come back: the queued routine runs now and must find its MDL still there.
    let dereg = NtModel::run_guarded(|| hca.dereg_mr(first.lkey));
    assert_eq!(dereg, Ok(Ok(())), "the late list's MDL was freed under it");
    assert_eq!(k.map_registers_free(hca.adapter()), Some(4), "the late routine put its list back");
    hca.dealloc_pd(pd).unwrap();
    hca.close();
    buffers.iter().for_each(|va| k.ExFreePoolWithTag(*va, pool_tag(b"vhmr")));
    assert!(k.unreleased_resources().is_empty(), "the late routine freed the MDL: {:?}", k.unreleased_resources());
}
