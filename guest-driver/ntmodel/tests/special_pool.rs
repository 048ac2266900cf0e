//! Special Pool (0x1) as the native driver meets it through the model's checked accesses: an overrun onto the guard
//! page is 0xD6, an underrun with Verify Start too, a freed block 0xD5, a changed pattern 0xC1 at the free; without
//! 0x1 none of them.

use std::sync::Arc;

use vhca_ntapi::*;
use vhca_ntmodel::VerifierFlags;
use vhca_ntmodel::{Bugcheck, CaptureBugchecks, HostDmaBackend, NtModel, NtModelConfig, SpecialPoolAlignment};

const TAG: u32 = pool_tag(b"Vhsp");

fn machine(flags: u32) -> NtModel {
    let config = NtModelConfig { verifier: VerifierFlags(flags), ..NtModelConfig::default() };
    NtModel::new(config, Arc::new(HostDmaBackend::default()), Arc::new(CaptureBugchecks))
}

fn allocate(k: &NtModel, bytes: usize) -> PVOID {
    let p = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, bytes, TAG);
    assert!(!p.is_null());
    p
}

#[test]
fn one_byte_written_past_the_end_is_0xd6_with_the_address_and_write() {
    let k = machine(0x1);
    let p = allocate(&k, 64);
    k.RtlCopyToVa(p, &[1; 64]);
    let past = NtModel::run_guarded(|| k.RtlCopyToVa(PVOID(p.0 + 64), &[1])).expect_err("an overrun");
    assert_eq!(past, Bugcheck::new(0xD6, p.0 + 64, 1, 0, 0));
    let read = NtModel::run_guarded(|| k.RtlCopyFromVa(&mut [0; 65], p)).expect_err("a read across the end");
    assert_eq!(read, Bugcheck::new(0xD6, p.0 + 64, 0, 0, 0));
}

#[test]
fn verify_start_puts_the_guard_before_the_block_so_an_underrun_is_0xd6() {
    let k = machine(0x1);
    k.set_special_pool_alignment(SpecialPoolAlignment::VerifyStart);
    let p = allocate(&k, 64);
    assert_eq!(p.0 % PAGE_SIZE, 0, "the block starts its page");
    let under = NtModel::run_guarded(|| k.RtlCopyToVa(PVOID(p.0 - 1), &[1])).expect_err("an underrun");
    assert_eq!(under, Bugcheck::new(0xD6, p.0 - 1, 1, 0, 0));
}

#[test]
fn a_read_after_the_free_is_0xd5() {
    let k = machine(0x1);
    let p = allocate(&k, 64);
    k.ExFreePoolWithTag(p, TAG);
    let late = NtModel::run_guarded(|| k.RtlCopyFromVa(&mut [0; 4], PVOID(p.0 + 8))).expect_err("use after free");
    assert_eq!(late, Bugcheck::new(0xD5, p.0 + 8, 0, 0, 0));
}

#[test]
fn a_changed_pattern_is_0xc1_at_the_free_0x24_after_the_end_and_0x23_before_it() {
    let k = machine(0x1);
    // 13 bytes: the block starts 16 bytes before the guard, three pattern bytes follow it.
    let p = allocate(&k, 13);
    k.RtlCopyToVa(PVOID(p.0 + 13), &[0]);
    let after = NtModel::run_guarded(|| k.ExFreePoolWithTag(p, TAG)).expect_err("an overrun into the pattern");
    assert_eq!(after, Bugcheck::new(0xC1, p.0, p.0 + 13, 0, 0x24));
    let q = allocate(&k, 64);
    k.RtlCopyToVa(PVOID(q.0 - 2), &[0]);
    let before = NtModel::run_guarded(|| k.ExFreePoolWithTag(q, TAG)).expect_err("an underrun into the pattern");
    assert_eq!(before, Bugcheck::new(0xC1, q.0, q.0 - 2, 0, 0x23));
}

#[test]
fn without_special_pool_the_same_misuse_meets_no_check() {
    let k = machine(0x8);
    let p = allocate(&k, 64);
    k.RtlCopyToVa(PVOID(p.0 + 64), &[1]);
    k.RtlCopyToVa(p, &[1; 64]);
    k.ExFreePoolWithTag(p, TAG);
    assert_eq!(k.special_pool_guard(p), None);
}
