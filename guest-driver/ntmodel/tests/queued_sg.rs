//! A GetScatterGatherList queued for map registers whose MDL is freed or unlocked before its AdapterListControl
//! runs: DMA checking's 0xE6/0x0E when the registers come back (the list used to be dropped, the routine never
//! called, nothing said); without the check the list is built from the MDL as the call saw it and the routine runs.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use vhca_ntapi::*;
use vhca_ntmodel::{Bugcheck, NtModel, NtModelConfig, RuleId, VerifierFlags};

const DMA: u32 = VerifierFlags::DMA_CHECKING.0;

fn model(flags: u32, disabled_rules: Vec<RuleId>) -> Arc<NtModel> {
    let config =
        NtModelConfig { verifier: VerifierFlags(flags), map_registers: 4, disabled_rules, ..Default::default() };
    machine_with(config).0
}

/// A 32-bit adapter: it pays map registers per page with or without DMA checking, so a request can wait.
fn adapter(k: &NtModel) -> PDMA_ADAPTER {
    let mut n = 0;
    let description = DEVICE_DESCRIPTION { Dma64BitAddresses: false, ..DEVICE_DESCRIPTION::bus_master_64(4 * 4096) };
    k.IoGetDmaAdapter(PDO, &description, &mut n)
}

fn nonpaged(k: &NtModel, bytes: u32) -> (PVOID, PMDL) {
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, bytes as usize, pool_tag(b"vhca"));
    let mdl = k.IoAllocateMdl(va, bytes, false, false);
    k.MmBuildMdlForNonPagedPool(mdl);
    (va, mdl)
}

type Delivered = Arc<Mutex<Option<SCATTER_GATHER_LIST>>>;

fn routine() -> (Delivered, PDRIVER_LIST_CONTROL) {
    let got: Delivered = Arc::new(Mutex::new(None));
    let sink = got.clone();
    (got, Box::new(move |_, l: &SCATTER_GATHER_LIST| *sink.lock().unwrap() = Some(l.clone())))
}

/// Takes all four registers with a first list, queues a second over `mdl`, lets `meanwhile` run, then puts the
/// first back: what the queued routine received, or the bugcheck the put stopped with.
fn queue_then(
    k: &NtModel,
    mdl: PMDL,
    va: PVOID,
    bytes: u32,
    meanwhile: impl FnOnce(),
) -> Result<Option<SCATTER_GATHER_LIST>, Bugcheck> {
    let a = adapter(k);
    let (first_va, first_mdl) = nonpaged(k, 4 * 4096);
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let (first, first_routine) = routine();
    assert_eq!(k.GetScatterGatherList(a, PDO, first_mdl, first_va, 4 * 4096, first_routine, false), STATUS_SUCCESS);
    let first = first.lock().unwrap().take().expect("the first list holds every register");
    let (queued, queued_routine) = routine();
    assert_eq!(k.GetScatterGatherList(a, PDO, mdl, va, bytes, queued_routine, false), STATUS_SUCCESS);
    assert!(queued.lock().unwrap().is_none(), "the second list waits for registers");
    k.KeLowerIrql(old);
    meanwhile();
    let old = k.KeRaiseIrql(DISPATCH_LEVEL);
    let put = NtModel::run_guarded(|| k.PutScatterGatherList(a, first.Handle, false));
    k.KeLowerIrql(old);
    put.map(|()| queued.lock().unwrap().take())
}

#[test]
fn an_mdl_freed_before_the_queued_routine_runs_is_e6_0e_under_dma_checking() {
    let k = model(DMA, Vec::new());
    let (va, mdl) = nonpaged(&k, 2 * 4096);
    let r = queue_then(&k, mdl, va, 2 * 4096, || k.IoFreeMdl(mdl));
    assert_eq!(r, Err(Bugcheck::e6(0x0E, mdl.0, 0, 0)));
}

#[test]
fn an_mdl_unlocked_before_the_queued_routine_runs_is_e6_0e_under_dma_checking() {
    let k = model(DMA, Vec::new());
    let va = k.alloc_user_buffer(2 * 4096, 0);
    let mdl = k.IoAllocateMdl(va, 2 * 4096, false, false);
    assert_eq!(k.MmProbeAndLockPages(mdl, KPROCESSOR_MODE::UserMode, LOCK_OPERATION::IoWriteAccess), STATUS_SUCCESS);
    let r = queue_then(&k, mdl, va, 2 * 4096, || k.MmUnlockPages(mdl));
    assert_eq!(r, Err(Bugcheck::e6(0x0E, mdl.0, 0, 0)));
}

#[test]
fn with_the_rule_disabled_or_without_the_verifier_the_routine_runs_on_the_mdl_the_call_saw() {
    for k in [model(DMA, vec![RuleId::parse("0xE6/0x0E").unwrap()]), model(0, Vec::new())] {
        let (va, mdl) = nonpaged(&k, 2 * 4096);
        let list = queue_then(&k, mdl, va, 2 * 4096, || k.IoFreeMdl(mdl)).expect("no stop");
        let list = list.expect("the queued AdapterListControl ran");
        assert_eq!(list.Elements.iter().map(|e| e.Length).sum::<u32>(), 2 * 4096);
        assert!(k.bugchecks().is_empty());
    }
}

#[test]
fn a_queued_request_whose_mdl_is_intact_runs_cleanly() {
    let k = model(DMA, Vec::new());
    let (va, mdl) = nonpaged(&k, 2 * 4096);
    let list = queue_then(&k, mdl, va, 2 * 4096, || {}).expect("no stop").expect("the routine ran");
    assert_eq!(list.Elements.iter().map(|e| e.Length).sum::<u32>(), 2 * 4096);
}
