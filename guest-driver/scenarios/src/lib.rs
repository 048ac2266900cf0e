//! The seed scenarios, written once: the driver core (`vhca-driver-core`) over the NT interface (`vhca-ntapi`) and a
//! `CommandTransport`, no_std. The Linux guest program runs them on the NT model over VFIO, vhca.sys on the WDK shim;
//! what each needs beyond the kernel and the channel (details, a clock, user buffers, IOMMU reports) is its
//! `ScenarioHost`. Names are the suite's (runner/suite/suites/seed.toml).
#![cfg_attr(not(test), no_std)]

extern crate alloc;

mod context;
mod host;

mod adapter_routine;
mod cq_fallback;
mod cq_growth;
mod cq_poll_dpc;
mod cq_reset;
mod create_cq_lock;
mod device_read;
mod dma32;
mod dpc_consumer;
mod dpc_wait;
mod event_wait;
mod health_watchdog;
mod isr_passive;
mod isr_state;
mod late_completion;
mod map_registers;
mod own_list;
mod paged_context;
mod physical_address;
mod pool_executable;
mod pool_exhaustion;
mod pool_overrun;
mod sg_fragmented;
mod sg_queued;
mod shared_buffer;
mod shared_words;
mod smoke;
mod two_requests;
mod unload_timer;
mod use_after_unmap;
mod user_buffer;
mod verbs;
mod verbs_loopback;

use alloc::sync::Arc;
use core::time::Duration;

use vhca_driver_core::{ClMutexKind, Hca, HcaConfig};
use vhca_ntapi::PDEVICE_OBJECT;

pub use context::Ctx;
pub use host::ScenarioHost;

/// What a run asks of its scenario beyond its name (the guest's `vhca.*` words, vhca.sys's registry values).
/// Options of the kernel under the driver (verifier, fault injection) are the host's, set when it made the kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScenarioOptions {
    /// The kernel lock the control path holds (`vhca.lock`); None: the scenario's own choice.
    pub lock: Option<ClMutexKind>,
    /// The fixed scenarios take their buggy path again (`vhca.break_fix=1`): proves their checks can fail.
    pub break_fix: bool,
}

/// The `vhca.lock` spelling of a lock kind, for reports.
pub fn lock_name(kind: ClMutexKind) -> &'static str {
    match kind {
        ClMutexKind::FastMutex => "fast_mutex",
        ClMutexKind::KMutex => "kmutex",
        ClMutexKind::EResource => "eresource",
    }
}

/// The lock kind a `vhca.lock` spelling names.
pub fn lock_kind(name: &str) -> Option<ClMutexKind> {
    [ClMutexKind::FastMutex, ClMutexKind::KMutex, ClMutexKind::EResource].into_iter().find(|k| lock_name(*k) == name)
}

/// One scenario of the seed suite (and the verbs suite's own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// Every kind of object created and destroyed once, one RDMA write: the verifier must stay silent.
    Smoke,
    VerbsLoopback,
    DevicePoolExhaustion,
    FastMutexCreateCq,
    FixedLockCreateCq,
    ContiguousCqFallback,
    MapRegisterExhaustion,
    SharedBufferSg,
    SharedBufferCommon,
    UseAfterUnmap,
    UserBufferProbeLock,
    UserBufferNoLock,
    IoMapCommonBuffer,
    IoMapCommonBufferUnchecked,
    UnloadTimerSet,
    UnloadTimerCancelled,
    TimeoutFreesBuffer,
    TimeoutFlushesQp,
    DpcGrowsCq,
    WorkItemGrowsCq,
    DpcReadsPagedContext,
    DpcReadsNonpagedContext,
    IsrTakesSpinLock,
    IsrSynchronizesState,
    DpcWaitsForDevice,
    DpcSpinsOnCompletion,
    DpcBoundedBatch,
    PoolExecutable,
    PoolNonExecutable,
    PoolOverrun,
    PoolOverrunFixed,
    PoolUseAfterFree,
    PoolUseAfterFreeFixed,
    DpcPollsDestroyedCq,
    DestroyCqFlushesDpcs,
    LateAdapterRoutine,
    AdapterRoutineAwaited,
    TwoRequestsRace,
    TwoRequestsLocked,
    IsrPassiveUnsynchronized,
    IsrPassiveSynchronized,
    Dma32AboveFourGib,
    Dma32AboveFourGibFixed,
    SgFragmented,
    SgFragmentedFixed,
    SgQueuedFreedMdl,
    SgQueuedMdlKept,
    PhysicalAddressToDevice,
    LogicalAddressToDevice,
    StaleCompletionAfterReset,
    ResetClearsCq,
}

impl Scenario {
    /// Every scenario but smoke, whose name the Linux guest gives to the transport's own check when the verifier
    /// is off.
    pub const DRIVER: [Scenario; 50] = [
        Scenario::VerbsLoopback,
        Scenario::DevicePoolExhaustion,
        Scenario::FastMutexCreateCq,
        Scenario::FixedLockCreateCq,
        Scenario::ContiguousCqFallback,
        Scenario::MapRegisterExhaustion,
        Scenario::SharedBufferSg,
        Scenario::SharedBufferCommon,
        Scenario::UseAfterUnmap,
        Scenario::UserBufferProbeLock,
        Scenario::UserBufferNoLock,
        Scenario::IoMapCommonBuffer,
        Scenario::IoMapCommonBufferUnchecked,
        Scenario::UnloadTimerSet,
        Scenario::UnloadTimerCancelled,
        Scenario::TimeoutFreesBuffer,
        Scenario::TimeoutFlushesQp,
        Scenario::DpcGrowsCq,
        Scenario::WorkItemGrowsCq,
        Scenario::DpcReadsPagedContext,
        Scenario::DpcReadsNonpagedContext,
        Scenario::IsrTakesSpinLock,
        Scenario::IsrSynchronizesState,
        Scenario::DpcWaitsForDevice,
        Scenario::DpcSpinsOnCompletion,
        Scenario::DpcBoundedBatch,
        Scenario::PoolExecutable,
        Scenario::PoolNonExecutable,
        Scenario::PoolOverrun,
        Scenario::PoolOverrunFixed,
        Scenario::PoolUseAfterFree,
        Scenario::PoolUseAfterFreeFixed,
        Scenario::DpcPollsDestroyedCq,
        Scenario::DestroyCqFlushesDpcs,
        Scenario::LateAdapterRoutine,
        Scenario::AdapterRoutineAwaited,
        Scenario::TwoRequestsRace,
        Scenario::TwoRequestsLocked,
        Scenario::IsrPassiveUnsynchronized,
        Scenario::IsrPassiveSynchronized,
        Scenario::Dma32AboveFourGib,
        Scenario::Dma32AboveFourGibFixed,
        Scenario::SgFragmented,
        Scenario::SgFragmentedFixed,
        Scenario::SgQueuedFreedMdl,
        Scenario::SgQueuedMdlKept,
        Scenario::PhysicalAddressToDevice,
        Scenario::LogicalAddressToDevice,
        Scenario::StaleCompletionAfterReset,
        Scenario::ResetClearsCq,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Smoke => "smoke",
            Scenario::VerbsLoopback => "verbs-loopback",
            Scenario::DevicePoolExhaustion => "device-pool-exhaustion",
            Scenario::FastMutexCreateCq => "fast-mutex-create-cq",
            Scenario::FixedLockCreateCq => "fixed-lock-create-cq",
            Scenario::ContiguousCqFallback => "contiguous-cq-fallback",
            Scenario::MapRegisterExhaustion => "map-register-exhaustion",
            Scenario::SharedBufferSg => "shared-buffer-sg",
            Scenario::SharedBufferCommon => "shared-buffer-common",
            Scenario::UseAfterUnmap => "use-after-unmap",
            Scenario::UserBufferProbeLock => "user-buffer-probe-lock",
            Scenario::UserBufferNoLock => "user-buffer-no-lock",
            Scenario::IoMapCommonBuffer => "io-map-common-buffer",
            Scenario::IoMapCommonBufferUnchecked => "io-map-common-buffer-unchecked",
            Scenario::UnloadTimerSet => "unload-timer-set",
            Scenario::UnloadTimerCancelled => "unload-timer-cancelled",
            Scenario::TimeoutFreesBuffer => "timeout-frees-buffer",
            Scenario::TimeoutFlushesQp => "timeout-flushes-qp",
            Scenario::DpcGrowsCq => "dpc-grows-cq",
            Scenario::WorkItemGrowsCq => "work-item-grows-cq",
            Scenario::DpcReadsPagedContext => "dpc-reads-paged-context",
            Scenario::DpcReadsNonpagedContext => "dpc-reads-nonpaged-context",
            Scenario::IsrTakesSpinLock => "isr-takes-spin-lock",
            Scenario::IsrSynchronizesState => "isr-synchronizes-state",
            Scenario::DpcWaitsForDevice => "dpc-waits-for-device",
            Scenario::DpcSpinsOnCompletion => "dpc-spins-on-completion",
            Scenario::DpcBoundedBatch => "dpc-bounded-batch",
            Scenario::PoolExecutable => "pool-executable",
            Scenario::PoolNonExecutable => "pool-non-executable",
            Scenario::PoolOverrun => "pool-overrun",
            Scenario::PoolOverrunFixed => "pool-overrun-fixed",
            Scenario::PoolUseAfterFree => "pool-use-after-free",
            Scenario::PoolUseAfterFreeFixed => "pool-use-after-free-fixed",
            Scenario::DpcPollsDestroyedCq => "dpc-polls-destroyed-cq",
            Scenario::DestroyCqFlushesDpcs => "destroy-cq-flushes-dpcs",
            Scenario::LateAdapterRoutine => "late-adapter-routine",
            Scenario::AdapterRoutineAwaited => "adapter-routine-awaited",
            Scenario::TwoRequestsRace => "two-requests-race",
            Scenario::TwoRequestsLocked => "two-requests-locked",
            Scenario::IsrPassiveUnsynchronized => "isr-passive-unsynchronized",
            Scenario::IsrPassiveSynchronized => "isr-passive-synchronized",
            Scenario::Dma32AboveFourGib => "dma32-above-4g",
            Scenario::Dma32AboveFourGibFixed => "dma32-above-4g-fixed",
            Scenario::SgFragmented => "sg-fragmented",
            Scenario::SgFragmentedFixed => "sg-fragmented-fixed",
            Scenario::SgQueuedFreedMdl => "sg-queued-freed-mdl",
            Scenario::SgQueuedMdlKept => "sg-queued-mdl-kept",
            Scenario::PhysicalAddressToDevice => "physical-address-to-device",
            Scenario::LogicalAddressToDevice => "logical-address-to-device",
            Scenario::StaleCompletionAfterReset => "stale-completion-after-reset",
            Scenario::ResetClearsCq => "reset-clears-cq",
        }
    }

    /// The scenario of that name, smoke included.
    pub fn find(name: &str) -> Option<Scenario> {
        core::iter::once(Scenario::Smoke).chain(Scenario::DRIVER).find(|s| s.name() == name)
    }

    /// The HCA configuration the scenario needs.
    pub fn config(self, options: &ScenarioOptions) -> HcaConfig {
        match self {
            Scenario::ContiguousCqFallback => cq_fallback::config(options),
            Scenario::MapRegisterExhaustion => map_registers::config(options),
            _ => HcaConfig::default(),
        }
    }

    /// How long the system runs on after the driver unloaded, for scenarios whose bug shows only then (a timer
    /// left set expires later); the others end at the unload.
    pub fn runs_on_after_unload(self) -> Option<Duration> {
        match self {
            Scenario::UnloadTimerSet | Scenario::UnloadTimerCancelled => Some(unload_timer::RUNS_ON),
            _ => None,
        }
    }

    fn body<H: ScenarioHost>(self, ctx: &mut Ctx<H>) -> anyhow::Result<()> {
        match self {
            Scenario::Smoke => smoke::run(ctx),
            Scenario::VerbsLoopback => verbs_loopback::run(ctx),
            Scenario::DevicePoolExhaustion => pool_exhaustion::run(ctx),
            Scenario::FastMutexCreateCq => create_cq_lock::fast_mutex(ctx),
            Scenario::FixedLockCreateCq => create_cq_lock::fixed_lock(ctx),
            Scenario::ContiguousCqFallback => cq_fallback::run(ctx),
            Scenario::MapRegisterExhaustion => map_registers::run(ctx),
            Scenario::SharedBufferSg => shared_buffer::sg(ctx),
            Scenario::SharedBufferCommon => shared_buffer::common(ctx),
            Scenario::UseAfterUnmap => use_after_unmap::run(ctx),
            Scenario::UserBufferProbeLock => user_buffer::probe_lock(ctx),
            Scenario::UserBufferNoLock => user_buffer::no_lock(ctx),
            Scenario::IoMapCommonBuffer => shared_buffer::io_map_common_buffer(ctx),
            Scenario::IoMapCommonBufferUnchecked => shared_buffer::io_map_common_buffer_unchecked(ctx),
            Scenario::UnloadTimerSet => unload_timer::timer_set(ctx),
            Scenario::UnloadTimerCancelled => unload_timer::timer_cancelled(ctx),
            Scenario::TimeoutFreesBuffer => late_completion::frees_buffer(ctx),
            Scenario::TimeoutFlushesQp => late_completion::flushes_qp(ctx),
            Scenario::DpcGrowsCq => cq_growth::in_dpc(ctx),
            Scenario::WorkItemGrowsCq => cq_growth::by_work_item(ctx),
            Scenario::DpcReadsPagedContext => paged_context::paged(ctx),
            Scenario::DpcReadsNonpagedContext => paged_context::nonpaged(ctx),
            Scenario::IsrTakesSpinLock => isr_state::spin_lock(ctx),
            Scenario::IsrSynchronizesState => isr_state::synchronized(ctx),
            Scenario::DpcWaitsForDevice => dpc_wait::waits(ctx),
            Scenario::DpcSpinsOnCompletion => dpc_wait::spins(ctx),
            Scenario::DpcBoundedBatch => dpc_wait::bounded_batch(ctx),
            Scenario::PoolExecutable => pool_executable::executable(ctx),
            Scenario::PoolNonExecutable => pool_executable::non_executable(ctx),
            Scenario::PoolOverrun => pool_overrun::overrun(ctx),
            Scenario::PoolOverrunFixed => pool_overrun::overrun_fixed(ctx),
            Scenario::PoolUseAfterFree => pool_overrun::use_after_free(ctx),
            Scenario::PoolUseAfterFreeFixed => pool_overrun::use_after_free_fixed(ctx),
            Scenario::DpcPollsDestroyedCq => cq_poll_dpc::polls_destroyed(ctx),
            Scenario::DestroyCqFlushesDpcs => cq_poll_dpc::flushes_dpcs(ctx),
            Scenario::LateAdapterRoutine => adapter_routine::late(ctx),
            Scenario::AdapterRoutineAwaited => adapter_routine::awaited(ctx),
            Scenario::TwoRequestsRace => two_requests::race(ctx),
            Scenario::TwoRequestsLocked => two_requests::locked(ctx),
            Scenario::IsrPassiveUnsynchronized => isr_passive::unsynchronized(ctx),
            Scenario::IsrPassiveSynchronized => isr_passive::synchronized(ctx),
            Scenario::Dma32AboveFourGib => dma32::ignores_width(ctx),
            Scenario::Dma32AboveFourGibFixed => dma32::honours_width(ctx),
            Scenario::SgFragmented => sg_fragmented::first_element_only(ctx),
            Scenario::SgFragmentedFixed => sg_fragmented::every_element(ctx),
            Scenario::SgQueuedFreedMdl => sg_queued::freed_mdl(ctx),
            Scenario::SgQueuedMdlKept => sg_queued::mdl_kept(ctx),
            Scenario::PhysicalAddressToDevice => physical_address::physical(ctx),
            Scenario::LogicalAddressToDevice => physical_address::logical(ctx),
            Scenario::StaleCompletionAfterReset => cq_reset::stale(ctx),
            Scenario::ResetClearsCq => cq_reset::cleared(ctx),
        }
    }
}

/// Opens the HCA on `pdo`, runs the scenario, drains events, and after a success closes the HCA and lets the host
/// unload the driver (the verifier's leak checks). After a failure the driver stays open: its state is the
/// evidence, and a close could stop the machine before the failure is reported. A bugcheck anywhere never returns.
/// PASSIVE_LEVEL, no lock held.
pub fn run<H: ScenarioHost>(
    scenario: Scenario,
    host: &H,
    kernel: Arc<H::Kernel>,
    channel: H::Channel,
    pdo: PDEVICE_OBJECT,
    options: &ScenarioOptions,
    timeout: Duration,
) -> anyhow::Result<()> {
    // The interrupt first, as a Windows driver connects it in START_DEVICE before it talks to the device: the path
    // needs only the transport and the device object, so Hca::open's QUERY_DEVICE already waits on the DPC's
    // KEVENT, as every command after it does.
    let completions = host.connect_completions()?;
    let hca = match Hca::open(kernel.clone(), channel, pdo, scenario.config(options)) {
        Ok(hca) => hca,
        Err(e) => {
            if let Some(completions) = completions {
                host.completion_counts(completions.disconnect());
            }
            anyhow::bail!("Hca::open: {e}");
        }
    };
    host.say(format_args!(
        "driver open: adapter map registers {}, device map registers {} free",
        hca.map_registers(),
        hca.attributes().map_registers_free.get()
    ));
    let own_device = host.own_device().unwrap_or(pdo);
    let mut ctx = Ctx::new(hca, kernel.clone(), host, options, timeout, completions, (own_device, pdo));
    let mut on_error_path = false;
    let result = match scenario.body(&mut ctx) {
        Err(e) if host.error_path(&e) => {
            host.say(format_args!("scenario stopped on the error path ({e:#}); unloading through it"));
            ctx.detail("error_path", alloc::format!("{e:#}"));
            on_error_path = true;
            Ok(())
        }
        r => r,
    };
    ctx.drain_events();
    let completions = ctx.completions.take();
    let deferred = ctx.deferred.take();
    host.scenario_finished();
    let result = result.map(|()| {
        // After the error path, what the stopped scenario held goes back: common buffers while the adapter is
        // still there, the rest after the close. A scenario that ran to its end has freed everything itself.
        let (common, rest) = if on_error_path { ctx.take_leftovers() } else { Default::default() };
        let adapter = ctx.hca.adapter();
        common.into_iter().for_each(|b| b.give_back(&*kernel, host, adapter));
        // The DPC lets go of every CQ before the close frees their rings; the interrupt stays connected, so the
        // close's commands wait on the DPC's KEVENT too.
        if let Some(completions) = &completions {
            completions.unwatch_all();
        }
        ctx.hca.close();
        rest.into_iter().for_each(|b| b.give_back(&*kernel, host, adapter));
    });
    // After the close's last command and before the unload (an interrupt still connected there is the verifier's
    // 0xC7). After a failure the driver stays open, its CQs with it, so nothing the DPC reads is gone before this.
    if let Some(completions) = completions {
        host.completion_counts(completions.disconnect());
    }
    let result = result.and_then(|()| {
        host.driver_closed()?;
        if let Some(runs_on) = scenario.runs_on_after_unload() {
            // Windows runs on after an unload: what the driver left behind meets the kernel now.
            host.say(format_args!("driver unloaded; the system runs on for {runs_on:?}"));
            host.sleep(runs_on);
        }
        Ok(())
    });
    match (result, deferred) {
        (Ok(()), Some(why)) => Err(anyhow::Error::msg(why)),
        (r, _) => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_find_their_scenario() {
        let all: Vec<Scenario> = core::iter::once(Scenario::Smoke).chain(Scenario::DRIVER).collect();
        let mut names: Vec<&str> = all.iter().map(|s| s.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        for s in all {
            assert_eq!(Scenario::find(s.name()), Some(s));
        }
        assert_eq!(Scenario::find("unmapped"), None);
        for kind in [ClMutexKind::FastMutex, ClMutexKind::KMutex, ClMutexKind::EResource] {
            assert_eq!(lock_kind(lock_name(kind)), Some(kind));
        }
        assert_eq!(lock_kind("spin_lock"), None);
    }

    /// The two scenarios that need their own HCA configuration get it; break_fix takes the CQ fallback away.
    #[test]
    fn configurations_follow_the_options() {
        let fixed = Scenario::ContiguousCqFallback.config(&ScenarioOptions::default());
        let broken = Scenario::ContiguousCqFallback.config(&ScenarioOptions { break_fix: true, lock: None });
        assert!(fixed.ring_fallback && !broken.ring_fallback);
        let map_transfer = Scenario::MapRegisterExhaustion.config(&ScenarioOptions::default());
        assert_eq!(map_transfer.ring_memory, vhca_driver_core::RingMemory::ContiguousMapTransfer);
        assert_eq!(Scenario::Smoke.config(&ScenarioOptions::default()), HcaConfig::default());
    }
}
