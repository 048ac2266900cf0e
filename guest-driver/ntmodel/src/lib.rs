//! A user-space model of the NT kernel services the vhca driver core needs (`vhca_ntapi::NtKernel`,
//! `NtAsyncKernel`), with per-thread IRQL, real blocking locks, map-register accounting, a contiguous-memory knob,
//! interrupts, DPCs, work items, timers and events on a clock of its own, and a Driver Verifier.

mod address_width;
mod async_kernel;
pub mod backend;
pub mod bugcheck;
mod clock;
mod dispatcher;
mod dma_adapter;
mod dpc;
mod exec_context;
pub mod interleaving;
mod interrupt;
mod kernel;
mod locks;
pub mod low_resources;
mod mdl;
mod memory;
pub mod pool_types;
mod processor;
mod sg_split;
mod timer;
pub mod timing;
mod unload_pending;
pub mod verifier;
mod watchdog;
mod work_item;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use vhca_ntapi::{DISPATCH_LEVEL, KIRQL, PASSIVE_LEVEL, PDEVICE_OBJECT, PVOID};

pub use backend::{BackendError, DmaBackend, HostDmaBackend, HostMemId};
pub use bugcheck::{Bugcheck, BugcheckHandler, BugcheckUnwind, CaptureBugchecks, PrintAndExit};
pub use dma_adapter::ListRequest;
pub use interleaving::{observe_points, InterleavingConfig, InterleavingMode, PointId, RaceReport};
pub use interrupt::{InterruptResources, DEVICE_DIRQL};
pub use low_resources::{
    with_call_site, CallSite, Failure, FaultPoint, FaultableRoutine, InjectedFault, InjectionMode, LowResourcesConfig,
    SiteFrame, Systematic,
};
pub use pool_types::PoolRequest;
pub use processor::ProcessorNumber;
pub use timing::{ClockSource, TimingConfig, TIMING_OPTION_KEYS};
pub use verifier::{RuleId, SpecialPoolAlignment, VerifierFlags};

pub(crate) const PAGE: u64 = vhca_ntapi::PAGE_SIZE;

/// The knobs of one modelled machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NtModelConfig {
    pub verifier: VerifierFlags,
    /// Map registers the HAL has for each adapter: what adapters that need map registers (DMA checking's double
    /// buffering, 32-bit adapters) draw from; requests short of them wait (AllocateAdapterChannel and
    /// GetScatterGatherList queue their execution routines).
    pub map_registers: u32,
    /// Longest physically contiguous run, in pages, that contiguous allocations (AllocateCommonBuffer,
    /// MmAllocateContiguousMemorySpecifyCache) can still find: the fragmentation knob. None: any length.
    pub max_contiguous_pages: Option<usize>,
    /// Rules the verifier skips even though their flag is on: the model then behaves as if that one check were
    /// absent (the unchecked path runs).
    pub disabled_rules: Vec<RuleId>,
    /// DMA checking double-buffers S/G lists and MapTransfer mappings, as Windows' verifier does. Off only to show
    /// what depends on it (the shared-buffer scenario's stale read): the device then sees the buffer's own pages.
    pub double_buffering: bool,
    /// The low-resources simulation's knobs (flags 0x4 and 0x40000 choose the mode; `fail_point` the rig's own).
    pub low_resources: LowResourcesConfig,
    /// Logical processors, each with its own IRQL, DPC queue and current thread (1 to 64; Windows' group 0). The
    /// constructor clamps 0 to 1 and anything past 64 to 64.
    pub processors: u32,
    /// The systematic interleaving modes and the race detector (Off by default).
    pub interleaving: InterleavingConfig,
}

impl Default for NtModelConfig {
    fn default() -> Self {
        NtModelConfig {
            verifier: VerifierFlags::NONE,
            map_registers: 64,
            max_contiguous_pages: None,
            disabled_rules: Vec::new(),
            double_buffering: true,
            low_resources: LowResourcesConfig::default(),
            processors: 2,
            interleaving: InterleavingConfig::default(),
        }
    }
}

/// An IOMMU fault the platform reported: the device touched an address nothing maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IommuFault {
    pub device: PDEVICE_OBJECT,
    pub address: u64,
    pub fault_type: u64,
}

/// What the kernel knows about one thread.
#[derive(Debug, Clone)]
pub(crate) struct ThreadState {
    /// A stand-in for the ETHREAD address, used in bugcheck parameters.
    pub ethread: u64,
    pub irql: KIRQL,
    /// Critical and guarded regions entered and KMUTEXes held: Windows' KernelApcDisable, counted upwards.
    pub apc_disable: u32,
    /// Locks held, in acquisition order (for deadlock detection and wrong-thread release).
    pub held: Vec<u64>,
    /// What the DPC watchdog counts for the thread's current context.
    pub watch: watchdog::ThreadWatch,
    /// The processor the thread runs on: 0 from its first model call unless the platform or the model bound it
    /// first (`run_on_processor`, the model's DPC and worker threads). Its IRQL is that processor's while it runs.
    pub processor: ProcessorNumber,
}

/// One modelled machine: memory from a `DmaBackend`, a verifier configuration and a bugcheck handler.
pub struct NtModel {
    /// First, so it drops first: the model's own threads end before anything they use goes.
    processor_threads: processor::ProcessorThreads,
    config: NtModelConfig,
    backend: Arc<dyn DmaBackend>,
    handler: Arc<dyn BugcheckHandler>,
    threads: Mutex<HashMap<ThreadId, ThreadState>>,
    memory: Mutex<memory::Memory>,
    locks: Mutex<locks::LockTable>,
    next_object: AtomicU64,
    bugchecks: Mutex<Vec<Bugcheck>>,
    /// Held while a bugcheck stops the machine: the first processor to stop reports, the others wait behind it.
    stopping: Mutex<()>,
    iommu_faults: Mutex<Vec<IommuFault>>,
    low_resources: Mutex<low_resources::LowResources>,
    timing: TimingConfig,
    clock: clock::ModelClock,
    dpcs: dpc::Dpcs,
    dispatcher: dispatcher::Dispatcher,
    /// The scheduling points' log, the pauses and the race detector (built at the first hook of a run whose
    /// interleaving mode is not Off).
    interleaving_engine: interleaving::engine::Engine,
    /// The PE loader traps the binary's stores to its device's registers (`binary_doorbell`): kernel calls stop
    /// counting as doorbells (`InterleavingConfig::kicks_at_every_call`).
    doorbells_trapped: std::sync::atomic::AtomicBool,
    timers: timer::Timers,
    interrupts: interrupt::Interrupts,
    workers: work_item::SystemWorkers,
    next_routine: AtomicU64,
    /// `unload_driver` ran: the kernel calling the driver's routines from now on is 0xD4.
    unloaded: AtomicBool,
}

/// Fake kernel addresses for objects the model hands out (MDLs, adapters, locks, S/G lists, KDPCs, KTIMERs...):
/// the driver's objects, up to ETHREAD_BASE.
const OBJECT_BASE: u64 = 0xFFFF_A000_0000_0000;
const ETHREAD_BASE: u64 = 0xFFFF_B000_0000_0000;
/// Stand-in addresses of the driver's routines the kernel calls back (DPC routines, ISRs, work routines), 16 bytes
/// apart in a 16 MiB "image": what bugcheck parameters name a routine by.
const DRIVER_IMAGE_BASE: u64 = 0xFFFF_F806_1000_0000;
const DRIVER_IMAGE_SIZE: u64 = 0x0100_0000;

/// Locks a model mutex. A bugcheck unwinds through callers, never while one of these is held, but a panicking
/// test may poison one; the data stays consistent because every update completes before any unwind point.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl NtModel {
    pub fn new(config: NtModelConfig, backend: Arc<dyn DmaBackend>, handler: Arc<dyn BugcheckHandler>) -> NtModel {
        let low_resources = low_resources::LowResources::new(config.verifier, config.low_resources.clone());
        let config = NtModelConfig { processors: processor::clamped(config.processors), ..config };
        NtModel {
            processor_threads: processor::ProcessorThreads::default(),
            config,
            backend,
            handler,
            threads: Mutex::new(HashMap::new()),
            memory: Mutex::new(memory::Memory::default()),
            locks: Mutex::new(locks::LockTable::default()),
            next_object: AtomicU64::new(1),
            bugchecks: Mutex::new(Vec::new()),
            stopping: Mutex::new(()),
            iommu_faults: Mutex::new(Vec::new()),
            low_resources: Mutex::new(low_resources),
            timing: TimingConfig::default(),
            clock: clock::ModelClock::new(ClockSource::Host),
            dpcs: dpc::Dpcs::new(),
            dispatcher: dispatcher::Dispatcher::new(),
            interleaving_engine: interleaving::engine::Engine::default(),
            doorbells_trapped: std::sync::atomic::AtomicBool::new(false),
            timers: timer::Timers::new(),
            interrupts: interrupt::Interrupts::default(),
            workers: work_item::SystemWorkers::default(),
            next_routine: AtomicU64::new(0),
            unloaded: AtomicBool::new(false),
        }
    }

    /// The model with these timing knobs instead of the defaults (clock source, tick, DPC watchdog limits): set
    /// before the model is shared, so nothing has been timed on the old clock. A setting of its own rather than a
    /// field of `NtModelConfig`, which its users build field by field.
    pub fn with_timing(mut self, timing: TimingConfig) -> NtModel {
        self.clock = clock::ModelClock::new(timing.clock);
        self.timing = timing;
        self
    }

    /// Like `for_tests`, with these timing knobs (a manual clock, for deterministic timers and watchdog counts).
    pub fn for_tests_with_timing(config: NtModelConfig, timing: TimingConfig) -> (Arc<NtModel>, Arc<HostDmaBackend>) {
        let backend = Arc::new(HostDmaBackend::default());
        let model = NtModel::new(config, backend.clone(), Arc::new(CaptureBugchecks)).with_timing(timing);
        (Arc::new(model), backend)
    }

    pub fn timing(&self) -> &TimingConfig {
        &self.timing
    }

    /// A model over host memory that captures bugchecks: what the tests use.
    pub fn for_tests(config: NtModelConfig) -> (Arc<NtModel>, Arc<HostDmaBackend>) {
        let backend = Arc::new(HostDmaBackend::default());
        let model = Arc::new(NtModel::new(config, backend.clone(), Arc::new(CaptureBugchecks)));
        (model, backend)
    }

    pub fn config(&self) -> &NtModelConfig {
        &self.config
    }

    pub fn verifier(&self) -> VerifierFlags {
        self.config.verifier
    }

    pub(crate) fn checks(&self, flag: VerifierFlags) -> bool {
        self.config.verifier.contains(flag)
    }

    pub(crate) fn backend(&self) -> &dyn DmaBackend {
        &*self.backend
    }

    /// Runs `f`; a bugcheck raised inside (with a capturing handler) comes back as `Err`.
    pub fn run_guarded<T>(f: impl FnOnce() -> T) -> Result<T, Bugcheck> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(v) => Ok(v),
            Err(payload) => match payload.downcast::<BugcheckUnwind>() {
                Ok(b) => Err(b.0),
                Err(other) => std::panic::resume_unwind(other),
            },
        }
    }

    /// Every bugcheck raised so far (a capturing handler lets a test look after the fact).
    pub fn bugchecks(&self) -> Vec<Bugcheck> {
        lock(&self.bugchecks).clone()
    }

    pub fn iommu_faults(&self) -> Vec<IommuFault> {
        lock(&self.iommu_faults).clone()
    }

    /// What the low-resources simulation does in this run.
    pub fn injection_mode(&self) -> InjectionMode {
        lock(&self.low_resources).mode()
    }

    /// Calls `observer` with each failure the low-resources simulation injects, as it happens.
    pub fn observe_injected_faults(&self, observer: low_resources::FaultObserver) {
        lock(&self.low_resources).set_observer(observer)
    }

    /// Every failure point seen so far (a call site and its routine), in order of first sighting.
    pub fn fault_points(&self) -> Vec<FaultPoint> {
        lock(&self.low_resources).points().to_vec()
    }

    /// Every failure injected so far, in order: the `!verifier 4` log.
    pub fn injected_faults(&self) -> Vec<InjectedFault> {
        lock(&self.low_resources).injected().to_vec()
    }

    /// The low-resources simulation's verdict on this call: the failure to give the driver, or None to go on.
    /// Called after the routine's rule checks, so a call that breaks a rule stops the machine either way.
    pub(crate) fn inject(&self, routine: FaultableRoutine, tag: Option<u32>) -> Option<Failure> {
        lock(&self.low_resources).decide(routine, tag)
    }

    /// Stops the machine. Callers must hold no model mutex guard.
    ///
    /// One stop at a time: KeBugCheckEx freezes the other processors, so a second processor that finds a violation
    /// meanwhile (the clock interrupt and the DPC itself both seeing one overrun: 0x133) never reports it. A
    /// handler that stops the machine never returns and keeps the others waiting here; one that unwinds (the tests')
    /// lets the next through.
    pub(crate) fn raise(&self, bugcheck: Bugcheck) -> ! {
        let _stopping = lock(&self.stopping);
        lock(&self.bugchecks).push(bugcheck);
        self.handler.bugcheck(&bugcheck)
    }

    /// Whether a violation of this rule stops the machine (its rule is not in `disabled_rules`).
    pub(crate) fn enforced(&self, bugcheck: &Bugcheck) -> bool {
        !self.config.disabled_rules.iter().any(|r| r.matches(bugcheck))
    }

    /// A check found `bugcheck`: Err to stop the machine, Ok (carry on as if unchecked) when the rule is disabled.
    pub(crate) fn found(&self, bugcheck: Bugcheck) -> Result<(), Bugcheck> {
        if self.enforced(&bugcheck) {
            Err(bugcheck)
        } else {
            Ok(())
        }
    }

    /// Raises `bugcheck` unless its rule is disabled; then the caller carries on as if unchecked.
    pub(crate) fn violation(&self, bugcheck: Bugcheck) {
        if self.enforced(&bugcheck) {
            self.raise(bugcheck)
        }
    }

    /// Unwraps a check's outcome, raising the bugcheck it found.
    pub(crate) fn ok<T>(&self, r: Result<T, Bugcheck>) -> T {
        match r {
            Ok(v) => v,
            Err(b) => self.raise(b),
        }
    }

    pub(crate) fn new_object(&self) -> u64 {
        OBJECT_BASE + self.next_object.fetch_add(1, Ordering::Relaxed) * 0x40
    }

    /// A stand-in address for a driver routine the kernel will call back (wraps inside the image, which a run
    /// never fills: a million routines).
    pub(crate) fn new_routine_address(&self) -> u64 {
        let n = self.next_routine.fetch_add(1, Ordering::Relaxed);
        DRIVER_IMAGE_BASE + (n * 0x10) % DRIVER_IMAGE_SIZE
    }

    /// The memory the model's driver objects (KDPC, KTIMER, KEVENT, locks...) live in, [start, end): what the
    /// unload checks name as the range checked for a timer or DPC object (0xC7 P3/P4).
    pub fn driver_object_range(&self) -> (u64, u64) {
        (OBJECT_BASE, ETHREAD_BASE)
    }

    /// The driver image the stand-in routine addresses lie in, [start, end) (0xC7 P3/P4 for a routine).
    pub fn driver_image_range(&self) -> (u64, u64) {
        (DRIVER_IMAGE_BASE, DRIVER_IMAGE_BASE + DRIVER_IMAGE_SIZE)
    }

    /// A pointer the driver hands over that was never initialised as the object the routine takes (a KDPC, a
    /// KTIMER, a KEVENT, a KINTERRUPT, a work item): 0xC4/0x1002 as for locks, always (the model cannot go on).
    pub(crate) fn never_initialised(&self, addr: u64) -> ! {
        self.raise(Bugcheck::c4(0x1002, addr, 0, 0))
    }

    /// Runs `f` on the calling thread's state, creating it (at PASSIVE_LEVEL) on first use.
    pub(crate) fn with_thread<T>(&self, f: impl FnOnce(&mut ThreadState) -> T) -> T {
        let mut threads = lock(&self.threads);
        let n = threads.len() as u64;
        let state = threads.entry(std::thread::current().id()).or_insert_with(|| ThreadState {
            ethread: ETHREAD_BASE + n * 0x1000,
            irql: PASSIVE_LEVEL,
            apc_disable: 0,
            held: Vec::new(),
            watch: watchdog::ThreadWatch::default(),
            processor: ProcessorNumber(0),
        });
        f(state)
    }

    pub(crate) fn irql(&self) -> KIRQL {
        self.with_thread(|t| t.irql)
    }

    /// Moves the calling thread's IRQL, and so its processor's: raising to DISPATCH_LEVEL waits for the processor
    /// (`move_processor_irql`). Dropping below DISPATCH_LEVEL ends a stretch the DPC watchdog counts
    /// and, as Windows' DPC interrupt fires then, runs the processor's queued DPCs. Callers hold no model guard.
    pub(crate) fn set_irql(&self, irql: KIRQL) {
        self.point(interleaving::PointKind::Irql(irql));
        self.move_processor_irql(self.irql(), irql);
        let now = self.clock.now();
        let (old, stretch) = self.with_thread(|t| {
            let old = std::mem::replace(&mut t.irql, irql);
            (old, t.watch.irql_changed(old, irql, now))
        });
        if let Some(since) = stretch {
            let r = self.dispatch_overran(since);
            self.ok(r);
        }
        if old >= DISPATCH_LEVEL && irql < DISPATCH_LEVEL {
            self.run_queued_dpcs();
        }
    }

    /// 0xC4/0xE5 (IRQL checking) when the caller is above `max`: a kernel API the driver imports by name, called
    /// at an IRQL its page does not allow.
    pub(crate) fn irql_at_most(&self, max: KIRQL) {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > max {
            self.violation(Bugcheck::c4(verifier::c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0));
        }
    }

    /// The platform's IOMMU refused the device's access to `address` (in the guest: a DMAR fault record the vIOMMU
    /// logged; `fault_type` is its hardware-specific reason). With DMA checking this is bugcheck 0xE6/0x26 (P2 the
    /// device object, P3 the faulting address, P4 the fault type), as Microsoft's 0xE6 page gives it.
    pub fn report_iommu_fault(&self, device: PDEVICE_OBJECT, address: u64, fault_type: u64) {
        lock(&self.iommu_faults).push(IommuFault { device, address, fault_type });
        if self.checks(VerifierFlags::DMA_CHECKING) {
            self.violation(Bugcheck::e6(verifier::e6::IOMMU_VIOLATION, device.0, address, fault_type));
        }
    }

    /// The driver unloads: its queued work items run first; with any verifier flag a timer still set, a DPC still
    /// queued or an interrupt still connected is 0xC7; with pool tracking, leaked pool is 0xC4/0x60; with DMA
    /// checking, an adapter never put back with resources outstanding is 0xE6/0x07..0x0A. After it, the kernel
    /// calling a routine of the driver (a DPC, an ISR: at raised IRQL) is 0xD4.
    pub fn unload_driver(&self) {
        let r = self.async_unload_checks().and_then(|()| self.unload_checks());
        self.ok(r)
    }

    /// The region holding model address `va`, seen from this process: the PE loader hands a driver binary these
    /// addresses (it dereferences what it gets) while the model keeps its own view of the same pages. None outside
    /// any region, or when the backend's memory is not plain memory (`DmaBackend::host_address`).
    pub fn host_view(&self, va: PVOID) -> Option<HostView> {
        let m = lock(&self.memory);
        let r = m.region_of(va.0)?;
        let host = self.backend.host_address(r.mem)?;
        Some(HostView { model_base: r.base, bytes: r.pages as u64 * PAGE, host_base: host as usize })
    }
}

/// One model region as the process sees it: `bytes` at `model_base` in the model are `bytes` at `host_base` here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostView {
    pub model_base: u64,
    pub bytes: u64,
    pub host_base: usize,
}
