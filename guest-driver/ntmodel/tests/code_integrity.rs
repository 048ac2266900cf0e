//! Code integrity checks (0x2000000) and pool types: an executable pool request is 0xC4/0x2000 with the driver's
//! address, the pool type and the tag, under the check only, through both ways of asking (POOL_TYPE and
//! POOL_FLAGS); NX and paged requests pass; with the rule disabled the executable block is handed out.

mod common;

use common::*;
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, NtModel, NtModelConfig, PoolRequest, RuleId, VerifierFlags};

const CODE_INTEGRITY: u32 = VerifierFlags::CODE_INTEGRITY.0;
const TAG: u32 = pool_tag(b"VhCi");
/// A return address in the driver's code, as the loader passes it.
const CALLER: u64 = 0x1_4000_2345;

fn stop(f: impl FnOnce()) -> Bugcheck {
    NtModel::run_guarded(f).expect_err("expected a bugcheck")
}

fn clean<T>(f: impl FnOnce() -> T) -> T {
    NtModel::run_guarded(f).unwrap_or_else(|b| panic!("unexpected bugcheck:\n{b}"))
}

#[test]
fn executable_pool_is_0xc4_0x2000_under_code_integrity_checks() {
    let (k, _) = machine(CODE_INTEGRITY | 0xAA);
    let flags = PoolRequest::from_pool_flags(POOL_FLAG_NON_PAGED_EXECUTE).unwrap();
    let b = stop(|| {
        k.allocate_pool(flags, 64, TAG, CALLER);
    });
    assert_eq!(b, Bugcheck::c4(0x2000, CALLER, 0, TAG as u64));
    let raw = PoolRequest::from_pool_type(4); // NonPagedPoolCacheAligned: executable too
    let b = stop(|| {
        k.allocate_pool(raw, 64, TAG, CALLER);
    });
    assert_eq!(b, Bugcheck::c4(0x2000, CALLER, 4, TAG as u64));

    // The native build's call: P2 names the call site (no code address), P3 NonPagedPool.
    let b = stop(|| {
        k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 64, TAG);
    });
    assert_eq!((b.code, b.params[0], b.params[2], b.params[3]), (0xC4, 0x2000, 0, TAG as u64));
    assert_ne!(b.params[1], 0);
}

#[test]
fn nx_and_paged_pool_pass_code_integrity_checks() {
    let (k, _) = machine(CODE_INTEGRITY | 0xAA);
    clean(|| {
        for request in [
            PoolRequest::from(POOL_TYPE::NonPagedPoolNx),
            PoolRequest::from(POOL_TYPE::PagedPool),
            PoolRequest::from_pool_flags(POOL_FLAG_NON_PAGED).unwrap(),
            PoolRequest::from_pool_flags(POOL_FLAG_PAGED).unwrap(),
        ] {
            let p = k.allocate_pool(request, 64, TAG, CALLER);
            assert!(!p.is_null(), "{request:?}");
            k.ExFreePoolWithTag(p, TAG);
        }
    });
}

#[test]
fn executable_pool_is_handed_out_without_the_check() {
    // Every other option on: executable pool is Windows' to give without memory integrity.
    let (k, _) = machine(VerifierFlags::STANDARD.0);
    clean(|| {
        let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 64, TAG);
        assert!(!p.is_null());
        k.ExFreePoolWithTag(p, TAG);
    });
}

#[test]
fn the_rule_disabled_lets_executable_pool_through() {
    let config = NtModelConfig {
        verifier: VerifierFlags(CODE_INTEGRITY),
        disabled_rules: vec![RuleId::parse("0xC4/0x2000").unwrap()],
        ..NtModelConfig::default()
    };
    let (k, _) = machine_with(config);
    clean(|| {
        let p = k.allocate_pool(PoolRequest::from(POOL_TYPE::NonPagedPool), 64, TAG, CALLER);
        assert!(!p.is_null());
        k.ExFreePoolWithTag(p, TAG);
    });
}
