//! The low-resources simulation: each mode fails exactly the calls it says (randomized by seed and probability after
//! the delay, systematic on a site's first sighting, record never, fail point k only at point k), call sites are
//! stable, and the driver core survives every failure point while a driver path that ignores one is caught.

mod common;

use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use vhca_driver_core::*;
use vhca_ntapi::*;
use vhca_ntmodel::low_resources::pool_tag;
use vhca_ntmodel::{
    with_call_site, Bugcheck, CallSite, Failure, FaultableRoutine, HostDmaBackend, InjectedFault, InjectionMode,
    LowResourcesConfig, NtModel, NtModelConfig, SiteFrame, Systematic, VerifierFlags,
};
use vhca_proto::ACCESS_LOCAL_WRITE;

const TAG: u32 = u32::from_le_bytes(*b"vhca");
const SYSTEMATIC: u32 = 0x40000;
const RANDOMIZED: u32 = 0x4;

fn model(flags: u32, low_resources: LowResourcesConfig) -> (Arc<NtModel>, Arc<HostDmaBackend>) {
    machine_with(NtModelConfig { verifier: VerifierFlags(flags), low_resources, ..NtModelConfig::default() })
}

fn randomized(probability: u32, seed: u64) -> LowResourcesConfig {
    LowResourcesConfig { probability, seed, delay: Duration::ZERO, ..LowResourcesConfig::default() }
}

fn pool(k: &NtModel) -> PVOID {
    k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 64, TAG)
}

#[test]
fn flags_choose_the_mode_with_windows_values() {
    let c = LowResourcesConfig::default();
    assert_eq!(VerifierFlags::LOW_RESOURCES.0, 0x4);
    assert_eq!(VerifierFlags::SYSTEMATIC_LOW_RESOURCES.0, 0x40000);
    assert_eq!(InjectionMode::of(VerifierFlags(0x209BB), &c), InjectionMode::Off, "/standard has neither");
    assert_eq!(InjectionMode::of(VerifierFlags(0x4), &c), InjectionMode::Randomized);
    assert_eq!(InjectionMode::of(VerifierFlags(0x40000), &c), InjectionMode::Systematic);
    assert_eq!(InjectionMode::of(VerifierFlags(0x40004), &c), InjectionMode::Systematic);
    let record = LowResourcesConfig { systematic: Systematic::Record, ..c.clone() };
    assert_eq!(InjectionMode::of(VerifierFlags(0x40000), &record), InjectionMode::Record);
    let point = LowResourcesConfig { fail_point: Some(3), ..c.clone() };
    assert_eq!(InjectionMode::of(VerifierFlags(0), &point), InjectionMode::FailPoint(3));
    assert_eq!(c.probability, 600, "Windows' default: 6 %");
    assert_eq!(c.delay, Duration::from_secs(480), "Windows' default: 8 minutes");
    assert_eq!(VerifierFlags::parse("0x40000"), Some(VerifierFlags::SYSTEMATIC_LOW_RESOURCES));
}

#[test]
fn systematic_fails_each_site_the_first_time_only_and_logs_it_in_order() {
    let (k, _) = model(SYSTEMATIC, LowResourcesConfig::default());
    let mut first_site = Vec::new();
    for _ in 0..black_box(3) {
        first_site.push(pool(&k).is_null());
    }
    assert_eq!(first_site, [true, false, false]);
    let mut second_site = Vec::new();
    for _ in 0..black_box(2) {
        second_site.push(k.ExAllocatePoolWithTag(POOL_TYPE::PagedPool, 32, TAG).is_null());
    }
    assert_eq!(second_site, [true, false]);
    let line_of_second = line!() - 3;
    let log = k.injected_faults();
    assert_eq!(log.len(), 2);
    assert_eq!((log[0].sequence, log[0].point), (1, 1));
    assert_eq!((log[1].sequence, log[1].point), (2, 2));
    assert_eq!(log[1].routine, FaultableRoutine::ExAllocatePoolWithTag);
    assert_eq!(log[1].failure, Failure::Null);
    // The site is where this test calls the kernel: the driver's part of the stack, not the model's.
    match &log[1].site.frames()[0] {
        SiteFrame::Source { file, line, .. } => {
            assert!(file.ends_with("tests/low_resources.rs"), "{file}");
            assert_eq!(*line, line_of_second);
        }
        other => panic!("{other:?}"),
    }
    // `pool()` calls from one line: every call above through it is one site.
    assert!(log[0].site.to_string().contains("low_resources.rs:"));
    assert_eq!(k.fault_points().len(), 2);
}

#[test]
fn each_routine_fails_with_its_windows_result() {
    let (k, _) = model(SYSTEMATIC, LowResourcesConfig { dma_routines: true, ..LowResourcesConfig::default() });
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 4096, TAG);
    assert!(va.is_null());
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 4096, TAG);
    assert!(va.is_null(), "a different line is a different site");
    let any = PHYSICAL_ADDRESS(0);
    let c = k.MmAllocateContiguousMemorySpecifyCache(
        4096,
        any,
        PHYSICAL_ADDRESS(u64::MAX),
        any,
        MEMORY_CACHING_TYPE::MmCached,
    );
    assert!(c.is_null());
    let user = k.alloc_user_buffer(4096, 0);
    let mdls: Vec<PMDL> = (0..black_box(2)).map(|_| k.IoAllocateMdl(user, 4096, false, false)).collect();
    assert!(mdls[0].is_null() && !mdls[1].is_null(), "one site: the first call fails, the second passes");
    let mdl = mdls[1];
    let status = k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, LOCK_OPERATION::IoModifyAccess);
    assert_eq!(status, STATUS_INSUFFICIENT_RESOURCES);
    let mut granted = 0;
    let adapter = k.IoGetDmaAdapter(PDO, &DEVICE_DESCRIPTION::bus_master_64(1 << 20), &mut granted);
    let mut logical = PHYSICAL_ADDRESS(0);
    assert!(k.AllocateCommonBuffer(adapter, 4096, &mut logical, true).is_null());
    let items: Vec<PIO_WORKITEM> = (0..black_box(2)).map(|_| k.IoAllocateWorkItem(PDO)).collect();
    assert!(items[0].is_null() && !items[1].is_null(), "IoAllocateWorkItem: NULL the first time at its site");
    k.IoFreeWorkItem(items[1]);
    let routines: Vec<_> = k.injected_faults().iter().map(|f| (f.routine, f.failure)).collect();
    assert_eq!(
        routines,
        [
            (FaultableRoutine::ExAllocatePoolWithTag, Failure::Null),
            (FaultableRoutine::ExAllocatePoolWithTag, Failure::Null),
            (FaultableRoutine::MmAllocateContiguousMemorySpecifyCache, Failure::Null),
            (FaultableRoutine::IoAllocateMdl, Failure::Null),
            (FaultableRoutine::MmProbeAndLockPages, Failure::Status(STATUS_INSUFFICIENT_RESOURCES)),
            (FaultableRoutine::AllocateCommonBuffer, Failure::Null),
            (FaultableRoutine::IoAllocateWorkItem, Failure::Null),
        ]
    );
    k.IoFreeMdl(mdl);
}

#[test]
fn dma_routines_fail_only_when_asked_for() {
    let (k, _) = model(SYSTEMATIC, LowResourcesConfig::default());
    let mut granted = 0;
    let adapter = k.IoGetDmaAdapter(PDO, &DEVICE_DESCRIPTION::bus_master_64(1 << 20), &mut granted);
    let mut logical = PHYSICAL_ADDRESS(0);
    let va = k.AllocateCommonBuffer(adapter, 4096, &mut logical, true);
    assert!(!va.is_null(), "not on Microsoft's list: untouched by default");
    assert!(k.injected_faults().is_empty());
    assert!(k.fault_points().is_empty(), "nor counted as a point");
    k.FreeCommonBuffer(adapter, 4096, logical, va, true);
}

#[test]
fn a_rule_check_comes_before_the_injection() {
    let (k, _) = model(SYSTEMATIC | 0x2, LowResourcesConfig::default());
    let r = NtModel::run_guarded(|| {
        let old = k.KeRaiseIrql(DISPATCH_LEVEL);
        let p = k.ExAllocatePoolWithTag(POOL_TYPE::PagedPool, 64, TAG);
        k.KeLowerIrql(old);
        p
    });
    assert_eq!(r.unwrap_err().params[0], 0x01, "paged allocation at DISPATCH_LEVEL: 0xC4/0x01, injected or not");
    assert!(k.injected_faults().is_empty());
}

#[test]
fn record_mode_fails_nothing_and_lists_every_point() {
    let config = LowResourcesConfig { systematic: Systematic::Record, ..LowResourcesConfig::default() };
    let (k, _) = model(SYSTEMATIC, config);
    for _ in 0..black_box(3) {
        assert!(!pool(&k).is_null());
    }
    assert!(!k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 8, TAG).is_null());
    assert!(k.injected_faults().is_empty());
    let points = k.fault_points();
    assert_eq!(points.iter().map(|p| p.point).collect::<Vec<_>>(), [1, 2]);
}

#[test]
fn fail_point_k_fails_only_the_first_call_at_point_k() {
    for k_point in 1..=3u32 {
        let (k, _) = model(0, LowResourcesConfig { fail_point: Some(k_point), ..LowResourcesConfig::default() });
        let mut failed = Vec::new();
        for round in 0..black_box(2) {
            failed.push((round, 1, pool(&k).is_null()));
            failed.push((round, 2, k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 8, TAG).is_null()));
            failed.push((round, 3, k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 16, TAG).is_null()));
        }
        let which: Vec<_> = failed.iter().filter(|f| f.2).map(|f| (f.0, f.1)).collect();
        assert_eq!(which, [(0, k_point)], "fail point {k_point}");
        assert_eq!(k.injected_faults()[0].point, k_point);
    }
}

#[test]
fn randomized_is_reproducible_by_seed_and_follows_the_probability() {
    // One named site for every draw: the decision depends on the seed, the site and its call count only (each
    // `draws(..)` line below would otherwise be a stack of its own).
    fn draws(seed: u64, probability: u32) -> Vec<bool> {
        let (k, _) = model(RANDOMIZED, randomized(probability, seed));
        let site = CallSite::image("vhca.sys", 0x1000, 0x1000, &[0x1234]);
        (0..black_box(2000))
            .map(|_| {
                let p = with_call_site(site.clone(), || pool(&k));
                if !p.is_null() {
                    k.ExFreePoolWithTag(p, TAG);
                }
                p.is_null()
            })
            .collect()
    }
    let a = draws(7, 600);
    assert_eq!(a, draws(7, 600), "same seed, same failures");
    assert_ne!(a, draws(8, 600), "another seed, other failures");
    let failed = a.iter().filter(|f| **f).count();
    // 6 % of 2000 is 120; a binomial draw lands within 70..170 with overwhelming probability.
    assert!((70..170).contains(&failed), "{failed} of 2000 failed at 6 %");
    assert!(draws(7, 10_000).iter().all(|f| *f));
    assert!(draws(7, 0).iter().all(|f| !*f));
}

#[test]
fn randomized_waits_out_the_delay() {
    let config = LowResourcesConfig { delay: Duration::from_millis(300), ..randomized(10_000, 1) };
    let (k, _) = model(RANDOMIZED, config);
    assert!(!pool(&k).is_null(), "inside the delay nothing fails");
    std::thread::sleep(Duration::from_millis(350));
    assert!(pool(&k).is_null(), "after it, probability 100 % fails every call");
}

#[test]
fn randomized_with_pool_tags_fails_only_those_tags() {
    let config = LowResourcesConfig { pool_tags: vec![pool_tag("Vhca").unwrap()], ..randomized(10_000, 1) };
    let (k, _) = model(RANDOMIZED, config);
    assert!(k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 8, pool_tag("Vhca").unwrap()).is_null());
    assert!(!k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 8, pool_tag("Othr").unwrap()).is_null());
    let user = k.alloc_user_buffer(4096, 0);
    assert!(!k.IoAllocateMdl(user, 4096, false, false).is_null(), "tags limit the simulation to pool");
    assert_eq!(pool_tag("Vh"), Some(u32::from_le_bytes(*b"Vh  ")));
    assert_eq!(pool_tag("toolong"), None);
}

#[test]
fn a_loaded_image_names_its_sites_by_offset_wherever_it_loads() {
    let a = CallSite::image("vhca.sys", 0x1_4000_0000, 0x8000, &[0xFFFF_F800_0000_1234, 0x1_4000_1010, 0x1_4000_2020]);
    let b = CallSite::image("vhca.sys", 0x7FF0_0000, 0x8000, &[0xFFFF_F800_0000_9999, 0x7FF0_1010, 0x7FF0_2020]);
    assert_eq!(a, b, "kernel frames drop out; image frames are offsets");
    assert_eq!(a.to_string(), "vhca.sys+0x1010 < vhca.sys+0x2020");
    // The loader's site wins over the thunk's own `#[track_caller]` location.
    let (k, _) = model(SYSTEMATIC, LowResourcesConfig::default());
    assert!(with_call_site(a.clone(), || pool(&k)).is_null());
    assert!(!with_call_site(b, || k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 8, TAG)).is_null(), "same site");
    assert_eq!(k.injected_faults()[0].site, a);
    assert!(pool(&k).is_null(), "outside the loader's scope the native site counts again");
}

// ---- the driver core under every failure point ----

/// What a driver test does: create and destroy what the seed scenarios use, undoing what was made on any error.
fn workload(hca: &mut Hca<NtModel, FakeDevice>, k: &NtModel) -> Result<(), DriverError> {
    let pd = hca.alloc_pd()?;
    let cq = hca.create_cq(256)?;
    let qp = match hca.create_qp(pd, cq, cq, 64, 64) {
        Ok(qp) => qp,
        Err(e) => {
            hca.destroy_cq(cq)?;
            return Err(e);
        }
    };
    let len = 3 * 4096;
    let buffer = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, len as usize, TAG);
    let mut result = Ok(());
    if buffer.is_null() {
        result = Err(DriverError::NoMemory { routine: "ExAllocatePoolWithTag", bytes: len as u64 });
    } else {
        match hca.reg_mr(pd, MrSource::Kernel { va: buffer, length: len }, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather)
        {
            Ok(mr) => hca.dereg_mr(mr.lkey)?,
            Err(e) => result = Err(e),
        }
        k.ExFreePoolWithTag(buffer, TAG);
    }
    let user = k.alloc_user_buffer(len as u64, 100);
    if result.is_ok() {
        let source = MrSource::User { va: user, length: len, skip_lock: false };
        match hca.reg_mr(pd, source, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather) {
            Ok(mr) => hca.dereg_mr(mr.lkey)?,
            Err(e) => result = Err(e),
        }
    }
    k.free_user_buffer(user);
    hca.destroy_qp(qp)?;
    hca.destroy_cq(cq)?;
    hca.dealloc_pd(pd)?;
    result
}

/// One driver life (open, workload, close, unload) under `config`: the bugcheck if one stopped it, the workload's
/// outcome, and the injected faults.
type Life = (Result<Result<(), DriverError>, Bugcheck>, Vec<InjectedFault>, usize);

fn driver_life(config: LowResourcesConfig, hca_config: HcaConfig) -> Life {
    let flags = SYSTEMATIC | 0x80 | 0x8 | 0x2;
    let (k, b) = model(flags, config);
    let dev = FakeDevice::new(k.clone(), b.clone());
    let r = NtModel::run_guarded(|| {
        let mut hca = Hca::open(k.clone(), dev.clone(), PDO, hca_config).expect("open takes no faultable call");
        let r = workload(&mut hca, &k);
        hca.close();
        k.unload_driver();
        r
    });
    assert_eq!(k.unreleased_resources(), Vec::<String>::new(), "{:?}", k.injected_faults());
    (r, k.injected_faults(), k.fault_points().len())
}

#[test]
fn the_driver_core_survives_every_failure_point_one_at_a_time() {
    for ring_memory in [RingMemory::CommonBuffer, RingMemory::ContiguousMapTransfer] {
        let hca_config = HcaConfig { ring_memory, ..HcaConfig::default() };
        let record = LowResourcesConfig { systematic: Systematic::Record, dma_routines: true, ..Default::default() };
        let (r, injected, points) = driver_life(record, hca_config);
        assert_eq!(r, Ok(Ok(())), "the recording run fails nothing");
        assert!(injected.is_empty());
        assert!(points >= 5, "rings, the pool buffer, MDLs, S/G lists, probe-and-lock: {points} ({ring_memory:?})");
        for k_point in 1..=points as u32 {
            let config = LowResourcesConfig { fail_point: Some(k_point), dma_routines: true, ..Default::default() };
            let (r, injected, _) = driver_life(config, hca_config);
            assert_eq!(injected.len(), 1, "point {k_point}: exactly one failure");
            let site = &injected[0].site;
            let outcome = r.unwrap_or_else(|b| panic!("point {k_point} ({site}) stopped the machine: {b:?}"));
            // A ring's allocation falls back to smaller pieces and may still succeed; anything else reaches the caller.
            if let Err(e) = outcome {
                assert!(
                    matches!(e, DriverError::NoMemory { .. } | DriverError::Kernel { .. }),
                    "point {k_point} ({site}): {e:?}"
                );
            }
        }
    }
}

/// A deliberately broken path: takes pool for a CQ's shadow copy and uses it without looking at the result.
fn broken_shadow_copy(k: &NtModel) {
    let shadow = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 64, TAG);
    k.RtlCopyToVa(shadow, &[0u8; 64]);
    k.ExFreePoolWithTag(shadow, TAG);
}

#[test]
fn a_path_that_ignores_an_allocation_failure_is_caught_at_its_point() {
    let record = LowResourcesConfig { systematic: Systematic::Record, ..Default::default() };
    let (k, _) = model(SYSTEMATIC | 0x8, record);
    NtModel::run_guarded(|| broken_shadow_copy(&k)).expect("without a failure the path works");
    assert_eq!(k.fault_points().len(), 1);
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let (k, _) = model(0x8, LowResourcesConfig { fail_point: Some(1), ..Default::default() });
    let log = seen.clone();
    k.observe_injected_faults(Arc::new(move |f| log.lock().unwrap().push(f.site.to_string())));
    let stop = NtModel::run_guarded(|| broken_shadow_copy(&k)).expect_err("the NULL is written through");
    assert_eq!(stop.code, PAGE_FAULT_IN_NONPAGED_AREA);
    assert_eq!(stop.params[0], 0, "at the NULL the failed allocation returned");
    let sites = seen.lock().unwrap().clone();
    assert_eq!(sites.len(), 1, "the observer heard the failure before the stop");
    assert!(sites[0].contains("tests/low_resources.rs:"), "{sites:?}");
}

/// A caller that gives up half way (as a scenario's `?` does after an injected failure) leaves CQs, QPs and MRs
/// behind: the driver's close must release them, or the verifier's unload checks stop the machine.
#[test]
fn close_releases_what_an_aborted_caller_left_behind() {
    let (k, b) = machine(0x80 | 0x8 | 0x2);
    let dev = FakeDevice::new(k.clone(), b.clone());
    let r = NtModel::run_guarded(|| {
        let mut hca = Hca::open(k.clone(), dev.clone(), PDO, HcaConfig::default()).expect("open");
        let pd = hca.alloc_pd().expect("pd");
        let cq = hca.create_cq(256).expect("cq");
        hca.create_qp(pd, cq, cq, 64, 64).expect("qp");
        let user = k.alloc_user_buffer(8192, 0);
        let source = MrSource::User { va: user, length: 8192, skip_lock: false };
        hca.reg_mr(pd, source, ACCESS_LOCAL_WRITE, MrMapping::ScatterGather).expect("mr");
        hca.close();
        k.unload_driver();
    });
    assert_eq!(r, Ok(()));
    assert_eq!(k.unreleased_resources(), Vec::<String>::new());
}
