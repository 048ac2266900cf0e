//! `vhca.driver=sys`: the run's scenario by the signed vhca.sys from the initramfs instead of the driver core built
//! into this program. The PE loader maps it over the NT model (DMA through this VFIO container, the run's verifier
//! flags) and this module is the PCI bus driver below it: config space for IRP_MN_READ_CONFIG, the BARs as
//! START_DEVICE's resources and MmMapIoSpaceEx's mappings. With `vhca.completion=interrupt` it enables the MSI-X
//! messages the PnP manager would grant and hands each to the NT model (`message_interrupts`), and START_DEVICE
//! carries them. The driver's result line becomes the run's.

mod message_interrupts;
mod removable_bus;

use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use vhca_loader::driver_symbols::DriverSymbols;
use vhca_loader::io_manager::{BusDriver, IoManager};
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_loader::nt_thunks::NtThunks;
use vhca_loader::pnp_life::{run_life, LifeFailure};
use vhca_loader::windows_sys::Wdk::Foundation::IO_STACK_LOCATION;
use vhca_loader::windows_sys::Wdk::System::SystemServices::{
    IRP_MN_CANCEL_REMOVE_DEVICE, IRP_MN_CANCEL_STOP_DEVICE, IRP_MN_QUERY_REMOVE_DEVICE, IRP_MN_QUERY_STOP_DEVICE,
    IRP_MN_READ_CONFIG, IRP_MN_REMOVE_DEVICE, IRP_MN_START_DEVICE, IRP_MN_STOP_DEVICE, IRP_MN_SURPRISE_REMOVAL,
    IRP_MN_WRITE_CONFIG,
};
use vhca_loader::windows_sys::Win32::Foundation::{
    NTSTATUS, STATUS_DEVICE_DATA_ERROR, STATUS_INVALID_PARAMETER, STATUS_NOT_SUPPORTED, STATUS_SUCCESS,
};
use vhca_loader::{driver_fault, driver_stack, load, MappedImage};
use vhca_ntmodel::{InjectionMode, NtModel};

use self::message_interrupts::SysInterrupts;
use crate::bugcheck_handler::ConsoleBugcheck;
use crate::cmdline::{Completion, Options};
use crate::low_resources;
use crate::nt_backend::VfioDmaBackend;
use crate::report::{progress, CompletionPathView, Report};
use crate::vfio::{self, Region, CONFIG_REGION};
use crate::vfio_dma::DmaMapper;

/// Where the image build puts the package (images/linux/build.sh).
pub const DRIVER_IMAGE: &str = "/vhca/vhca.sys";
pub const DRIVER_PDB: &str = "/vhca/vhca.pdb";
/// The service's Parameters key, where the INF (and here the run) sets the scenario.
const PARAMETERS_KEY: &str = "\\Registry\\Machine\\System\\CurrentControlSet\\Services\\vhca\\Parameters";
/// PCI config space: the six BAR registers.
const BAR0: usize = 0x10;

/// One memory BAR: where it is on the bus, how long, and its VFIO region (mapped where vfio-pci allows).
struct Bar {
    address: u64,
    length: u64,
    region: Region,
}

/// The PCI bus driver for the one device, over its VFIO regions.
struct VfioBus {
    config: Region,
    bars: Vec<Bar>,
    /// MSI-X messages enabled through VFIO (0: the run polls).
    messages: u32,
}

impl VfioBus {
    fn open(device: &vfio::Device, messages: u32) -> anyhow::Result<VfioBus> {
        let config = device.region(CONFIG_REGION).context("config space")?;
        let mut raw = [0u8; 0x28];
        config.pread(0, &mut raw).context("config space")?;
        let mut bars = Vec::new();
        let mut index = 0;
        while index < 6 {
            let at = BAR0 + index * 4;
            let low = u32::from_le_bytes(raw[at..at + 4].try_into().expect("4 bytes"));
            let is_64 = low & 0x1 == 0 && (low >> 1) & 0x3 == 0x2;
            if low & 0x1 == 0 && low != 0 {
                let high = if is_64 { u32::from_le_bytes(raw[at + 4..at + 8].try_into().expect("4 bytes")) } else { 0 };
                let address = ((high as u64) << 32) | (low & !0xF) as u64;
                if let Ok(region) = device.region(index as u32) {
                    bars.push(Bar { address, length: region.info().size, region });
                }
            }
            index += if is_64 { 2 } else { 1 };
        }
        Ok(VfioBus { config, bars, messages })
    }
}

impl BusDriver for VfioBus {
    fn pnp(&self, stack: &IO_STACK_LOCATION) -> NTSTATUS {
        match stack.MinorFunction as u32 {
            IRP_MN_START_DEVICE
            | IRP_MN_STOP_DEVICE
            | IRP_MN_SURPRISE_REMOVAL
            | IRP_MN_REMOVE_DEVICE
            | IRP_MN_QUERY_STOP_DEVICE
            | IRP_MN_CANCEL_STOP_DEVICE
            | IRP_MN_QUERY_REMOVE_DEVICE
            | IRP_MN_CANCEL_REMOVE_DEVICE => STATUS_SUCCESS,
            minor @ (IRP_MN_READ_CONFIG | IRP_MN_WRITE_CONFIG) => {
                // SAFETY: a config IRP's parameters, filled by the driver (its buffer of Length bytes).
                let (buffer, offset, length) = unsafe {
                    let p = stack.Parameters.ReadWriteConfig;
                    (p.Buffer as *mut u8, p.Offset as u64, p.Length as usize)
                };
                if buffer.is_null() {
                    return STATUS_INVALID_PARAMETER;
                }
                // SAFETY: as above.
                let bytes = unsafe { std::slice::from_raw_parts_mut(buffer, length) };
                let done = if minor == IRP_MN_READ_CONFIG {
                    self.config.pread(offset, bytes)
                } else {
                    self.config.pwrite(offset, bytes)
                };
                match done {
                    Ok(()) => STATUS_SUCCESS,
                    Err(e) => {
                        progress(format_args!("config space at {offset:#x}+{length}: {e}"));
                        STATUS_DEVICE_DATA_ERROR
                    }
                }
            }
            _ => STATUS_NOT_SUPPORTED,
        }
    }

    fn memory_resources(&self) -> Vec<(u64, u32)> {
        self.bars.iter().map(|b| (b.address, b.length as u32)).collect()
    }

    fn message_interrupts(&self) -> u32 {
        self.messages
    }

    fn map_io_space(&self, physical: u64, length: usize) -> Option<*mut u8> {
        let bar = self.bars.iter().find(|b| physical >= b.address && physical - b.address < b.length)?;
        let offset = physical - bar.address;
        if offset + length as u64 > bar.length {
            return None;
        }
        // SAFETY: inside the BAR's mapping (checked above).
        bar.region.mapped_ptr().map(|p| unsafe { p.add(offset as usize) })
    }

    fn alias_io_space(&self, base: *mut u8, length: usize) -> Option<*mut u8> {
        let bar = self.bars.iter().find(|b| {
            b.region.mapped_ptr().is_some_and(|p| (base as usize).wrapping_sub(p as usize) < b.length as usize)
        })?;
        let offset = base as usize - bar.region.mapped_ptr()? as usize;
        bar.region.second_mapping(offset as u64, length)
    }
}

/// Windows' side of an IOMMU fault, which the driver is never told of: while vhca.sys runs, the vIOMMU's fault
/// records about this device (DMAR lines in the kernel log) reach the NT model as the platform's report, as the
/// native run's host reports them (with DMA checking, 0xE6/0x26 with the device object, the address and VT-d's
/// fault reason). Windows reports asynchronously, from its fault interrupt: so does this thread, polling the log.
struct PlatformIommuWatch {
    watch: Arc<Watch>,
}

/// How often the kernel log is read for new DMAR faults while the driver runs.
const IOMMU_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// One run's watch: the log followed from the driver's load on, whom to tell, and whether the run is over.
struct Watch {
    log: Mutex<crate::kmsg::KmsgFollower>,
    model: Arc<NtModel>,
    address: Option<String>,
    stopped: std::sync::atomic::AtomicBool,
}

impl Watch {
    /// The watch thread's look: none once the run is over. `stopped` is read under the log's lock, which the last
    /// look takes after setting it, so no look of this thread reports anything after the last one has.
    fn look_while_running(&self) -> bool {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if self.stopped.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        self.report(&mut log);
        true
    }

    /// The last look, on the run's thread.
    fn last_look(&self) {
        self.stopped.store(true, std::sync::atomic::Ordering::Release);
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        self.report(&mut log);
    }

    /// Reads the records logged since the last look and reports this device's DMAR faults to the NT model.
    fn report(&self, log: &mut crate::kmsg::KmsgFollower) {
        let faults = crate::kmsg::dmar_faults(&log.new_iommu_lines(), self.address.as_deref());
        for fault in &faults {
            progress(format_args!(
                "IOMMU fault from the platform: address {:#x}, reason {:#x}",
                fault.address, fault.reason
            ));
            let pdo = kernel().io.pdo().unwrap_or(0) as u64;
            self.model.report_iommu_fault(vhca_ntapi::PDEVICE_OBJECT(pdo), fault.address, fault.reason);
        }
    }
}

/// A watch thread started ahead of its run, waiting for its job (`preload`): measured in restored guests, the first
/// thread a run starts costs it 11-25 ms under TCG (the guest kernel's thread creation runs untranslated after every
/// restore), while a thread already in the snapshot only has to be woken.
static IDLE_WATCHER: Mutex<Option<std::sync::mpsc::Sender<Arc<Watch>>>> = Mutex::new(None);

fn spawn_watcher() -> std::sync::mpsc::Sender<Arc<Watch>> {
    let (jobs, job) = std::sync::mpsc::channel::<Arc<Watch>>();
    std::thread::spawn(move || {
        if let Ok(watch) = job.recv() {
            while watch.look_while_running() {
                std::thread::park_timeout(IOMMU_POLL);
            }
        }
    });
    jobs
}

impl PlatformIommuWatch {
    fn start(model: Arc<NtModel>, address: Option<String>) -> PlatformIommuWatch {
        // Faults logged before the driver loaded (boot, another device) are not this run's.
        let log = Mutex::new(crate::kmsg::KmsgFollower::from_now());
        let watch = Arc::new(Watch { log, model, address, stopped: false.into() });
        let idle = IDLE_WATCHER.lock().unwrap_or_else(|e| e.into_inner()).take();
        let jobs = idle.unwrap_or_else(spawn_watcher);
        // A thread that cannot take its job has ended: the last look in `stop` still reads the whole run's log.
        let _ = jobs.send(watch.clone());
        PlatformIommuWatch { watch }
    }

    /// The last look (a fault from the driver's last DMA), on the caller's thread so the run need not wait for the
    /// watch thread to wake and end: it finds `stopped` at its next wake and returns.
    fn stop(self) {
        self.watch.last_look();
    }
}

/// vhca.sys read and loaded (parsed, mapped, relocated, bound, protected) ahead of its run. The resident agent
/// does it before it announces itself, so the snapshot holds the loaded image and no restored run pays for it
/// again: under TCG the read of the 289 KB file, the load and its unwind data cost a run 35-45 ms. None of it
/// depends on the run: the imports bind to thunks that find the run's NT model when called, and nothing of the
/// driver runs until DriverEntry. Each restore starts from the same untouched image, as each cold boot does.
static PRELOADED: Mutex<Option<anyhow::Result<LoadedDriver>>> = Mutex::new(None);

/// vhca.sys mapped, with what a fault inside it and the low-resources simulation's stack walk need (its symbols,
/// its unwind data registered).
struct LoadedDriver {
    mapped: MappedImage,
    symbols: DriverSymbols,
}

/// Loads vhca.sys for a run to come (see `PRELOADED`), and starts the thread that will watch the platform's IOMMU
/// faults during it (`IDLE_WATCHER`); a refusal is kept and becomes that run's error.
pub fn preload() {
    *IDLE_WATCHER.lock().unwrap_or_else(|e| e.into_inner()) = Some(spawn_watcher());
    let loaded = read_and_load();
    *PRELOADED.lock().unwrap_or_else(|e| e.into_inner()) = Some(loaded);
}

/// In a run's process forked by the agent (`run_process`): the idle watcher is a thread of the agent, which the
/// fork did not copy. Its handle is forgotten, not dropped (the channel's other end belongs to a thread that is
/// not in this process), and the run starts its own watcher when it needs one.
pub fn forget_idle_watcher() {
    std::mem::forget(IDLE_WATCHER.lock().unwrap_or_else(|e| e.into_inner()).take());
}

fn read_and_load() -> anyhow::Result<LoadedDriver> {
    let bytes = std::fs::read(DRIVER_IMAGE).with_context(|| format!("{DRIVER_IMAGE}: not in this image"))?;
    progress(format_args!("vhca.sys: {} bytes", bytes.len()));
    let mapped = load(&bytes, &NtThunks).context("vhca.sys refused")?;
    let symbols = DriverSymbols::load(Path::new(DRIVER_PDB), mapped.image.entry_rva);
    driver_stack::register(&mapped, "vhca.sys");
    Ok(LoadedDriver { mapped, symbols })
}

/// Loads vhca.sys (or takes the preloaded image) and runs its PnP life on the device behind `session`, with the
/// run's scenario and verifier.
pub fn run(session: &vfio::Session, options: &Options, report: &mut Report) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let preloaded = PRELOADED.lock().unwrap_or_else(|e| e.into_inner()).take();
    let LoadedDriver { mapped, symbols } = match preloaded {
        Some(loaded) => loaded?,
        None => read_and_load()?,
    };
    // MSI-X before START_DEVICE, as the PCI bus driver has it set up when the device starts; no ISR runs until
    // vhca.sys connects one (messages before that find nothing connected in the model).
    report.completion = Some(options.completion.name());
    let mut interrupts = match options.completion {
        Completion::Interrupt => Some(SysInterrupts::enable(&session.device)?),
        Completion::Poll => None,
    };
    let bus = VfioBus::open(&session.device, interrupts.as_ref().map_or(0, SysInterrupts::messages))?;
    progress(format_args!(
        "vhca.sys: BARs {}",
        bus.bars
            .iter()
            .map(|b| format!("{:#x}+{:#x}{}", b.address, b.length, if b.region.is_mapped() { "" } else { " (pread)" }))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    // The race watch runs trapped instructions through a second mapping of each watched block, which only shared
    // memory can have: shared from before the model hands out its first page.
    let watching = options.interleaving != vhca_ntmodel::InterleavingMode::Off && !options.race_watch.is_empty();
    if watching {
        crate::vfio_dma::share_host_memory();
    }
    let mapper = Arc::new(DmaMapper::new(session.container.clone()));
    let config = crate::driver_run::model_config(options);
    report.verifier = Some(format!("{:#x}", options.verifier.0));
    // A bugcheck prints the STOP lines and the run's result as far as it got, then powers off, as natively.
    let sink = Arc::new(Mutex::new(report.clone()));
    let handler = Arc::new(ConsoleBugcheck::new(sink.clone(), options.poweroff));
    // The native run's timing (the clock's tick, the DPC watchdog's allotment), so the watchdog judges alike.
    let model = Arc::new(
        NtModel::new(config.clone(), Arc::new(VfioDmaBackend::new(mapper)), handler.clone())
            .with_timing(options.timing)
            .with_special_pool_alignment(options.special_pool),
    );
    // Before the driver maps anything: the layout of what is mapped does not change later.
    model.set_dma_remapping(options.dma_remapping);
    handler.witness().attach(&model, &options.interleaving, options.processors);
    low_resources::start(&model, &config.low_resources, &sink);
    let model_for_faults = model.clone();
    let model_for_interrupts = model.clone();
    let (bus, bus_hold) = removable_bus::RemovableBus::new(bus);
    let mut kernel_state = LoaderKernel::new(model, IoManager::new(Box::new(bus)));
    kernel_state.echo_results = false;
    // The race watch traps only where something reads what it sees: an interleaving mode's detector and scheduler.
    // There it always traps the device registers, so the binary's own stores are its doorbells and an interrupt
    // is ordered after what its thread did before the doorbell, not before its latest kernel call (which would
    // order, and hide, a store made after the doorbell).
    if options.interleaving != vhca_ntmodel::InterleavingMode::Off {
        kernel_state.race_watch = vhca_loader::race_watch::RaceWatch::with_doorbells(options.race_watch.clone());
    }
    // The run's scenario and its options, as the runner's guest script sets them on Windows (Lock with the
    // guest's vhca.lock spellings, BreakFix 0 or 1).
    let registry = &kernel_state.registry;
    registry.set_string(PARAMETERS_KEY, "Scenario", &options.scenario);
    if let Some(kind) = options.lock {
        registry.set_string(PARAMETERS_KEY, "Lock", vhca_scenarios::lock_name(kind));
    }
    registry.set_string(PARAMETERS_KEY, "BreakFix", if options.break_fix { "1" } else { "0" });
    if !install(kernel_state) {
        bail!("a driver kernel is already installed in this process");
    }
    driver_fault::install(mapped.base(), mapped.size(), "vhca.sys", symbols);
    kernel().register_pageable_sections(&mapped);
    if let Some(interrupts) = interrupts.as_mut() {
        let pdo = vhca_ntapi::PDEVICE_OBJECT(kernel().io.device_pdo() as u64);
        interrupts.deliver_to(model_for_interrupts, pdo)?;
    }
    progress(format_args!("vhca.sys mapped at {:#x}, {} imports bound", mapped.base(), mapped.image.imports.len()));

    // Set-up, the read of the file and the load; then the PnP life, where the scenario runs.
    report.phases_ms.push(("sys_load", started.elapsed().as_secs_f64() * 1000.0));
    let life_started = std::time::Instant::now();
    let watcher = PlatformIommuWatch::start(model_for_faults, report.pci_address.clone());
    // Sleep and resume between START_DEVICE and REMOVE_DEVICE, as the power manager sends it (`vhca.power`).
    vhca_loader::power_life::plan_sleep_resume(options.sleep_resume);
    vhca_loader::power_life::plan_d0_at_dispatch(options.d0_at_dispatch);
    // Then the PnP manager's sequence (`vhca.pnp`): a rebalance, a cancelled query or disable/enable.
    vhca_loader::pnp_sequence::plan(options.pnp);
    // A user process after the start (`vhca.user`): the interface opened, its IOCTLs, its exit.
    if let Some(program) = options.user.program() {
        vhca_loader::user_process::plan(program);
    }
    // Or the process whose RDMA write is in flight when the machine sleeps (`vhca.power=sleep-during-traffic`).
    if options.sleep_during_traffic {
        vhca_loader::user_process::plan(Box::new(crate::user_sleep_traffic::sleep_during_traffic));
    }
    // Or the one whose write is in flight when the device is rebalanced (`vhca.pnp=rebalance-during-traffic`).
    if options.pnp == vhca_loader::pnp_sequence::PnpSequence::RebalanceDuringTraffic {
        vhca_loader::user_process::plan(Box::new(crate::user_sleep_traffic::rebalance_during_traffic));
    }
    // Or the one whose write is in flight when the HCA is hot-unplugged (`vhca.pnp=hot-unplug-during-traffic`).
    if options.pnp == vhca_loader::pnp_sequence::PnpSequence::HotUnplugDuringTraffic {
        vhca_loader::user_process::plan(Box::new(crate::user_sleep_traffic::surprise_removal_during_traffic));
    }
    let life = run_life(&mapped, true);
    // After a hot-unplug the program lets go of the device once the driver's REMOVE is done, so the kernel can
    // finish its removal (hot_unplug.rs); any other run keeps it until the process ends, as before.
    use vhca_loader::pnp_sequence::PnpSequence;
    if matches!(options.pnp, PnpSequence::HotUnplug | PnpSequence::HotUnplugDuringTraffic) {
        bus_hold.release();
    }
    let pnp = vhca_loader::pnp_sequence::outcome();
    let power = vhca_loader::power_life::outcome();
    // Windows runs on after an unload: for the scenarios whose bug shows only then (a timer left set expires later,
    // its DPC in an unloaded driver), the model's clock keeps ticking for as long as the native run gives it.
    let runs_on = crate::driver_run::find(&options.scenario).and_then(|s| s.runs_on_after_unload());
    if let (Some(runs_on), Some(_)) = (runs_on, interrupts.as_ref()) {
        progress(format_args!("vhca.sys unloaded; the system runs on for {runs_on:?}"));
        std::thread::sleep(runs_on);
    }
    watcher.stop();
    if options.interleaving != vhca_ntmodel::InterleavingMode::Off {
        let (aliased, opened) = vhca_loader::race_watch::step_counts();
        let (doorbells, copies) = (vhca_loader::race_watch::doorbells(), vhca_loader::race_watch::copied());
        progress(format_args!(
            "race watch: {aliased} accesses through aliases ({copies} as copies), {opened} with their block open; \
             {doorbells} doorbells"
        ));
    }
    report.interrupts = interrupts.map(SysInterrupts::finish);
    report.phases_ms.push(("sys_life", life_started.elapsed().as_secs_f64() * 1000.0));
    let model = kernel().model.clone();
    // The simulation's log, as natively: the failure points and every failure injected (the runner expands a
    // recording into fail-point runs from these).
    low_resources::record_points(&model, &sink);
    crate::interleaving::record(&model, &options.interleaving, options.processors, &sink);
    let simulation = sink.lock().unwrap_or_else(|e| e.into_inner()).details.clone();
    // After an injected failure, vhca.sys refusing the load (DriverEntry) or the start (START_DEVICE) with an error
    // status is its error path, as a scenario stopped by a shortage is natively (driver_run.rs, error_path): the run
    // is judged on what the driver left behind (the unload checks already ran, the leak census below).
    let injected = !model.injected_faults().is_empty();
    let mut error_path = None;
    let mut scenario_error = None;
    // The driver's own result line is the run's: its verdict, error and details.
    if let Some(json) = kernel().result_json() {
        let value: serde_json::Value = serde_json::from_str(&json).context("vhca.sys's result line")?;
        if let Some(details) = value.get("details").and_then(|d| d.as_object()) {
            report.details = details.clone();
        }
        // How vhca.sys waited (it polls where it could not connect) and what its ISR and DPC did, in the fields a
        // native run reports them in.
        match value.get("completion").and_then(|c| c.as_str()) {
            Some("interrupt") => report.completion = Some("interrupt"),
            Some("poll") => report.completion = Some("poll"),
            _ => {}
        }
        if let Some(path) = value.get("completion_path").filter(|p| p.is_object()) {
            let count = |key: &str| path.get(key).and_then(|v| v.as_u64()).unwrap_or(0);
            report.completion_path = Some(CompletionPathView {
                isr_calls: count("isr_calls"),
                dpc_calls: count("dpc_calls"),
                dpc_requeues: count("dpc_requeues"),
                cqes: count("cqes"),
            });
        }
        match value.get("error").and_then(|e| e.as_str()) {
            Some(error) if injected && error.starts_with("START_DEVICE:") => error_path = Some(error.to_string()),
            Some(error) => scenario_error = Some(error.to_string()),
            None => {}
        }
    }
    // Whether or not the driver got as far as a result line.
    report.details.insert("driver".into(), "sys".into());
    report.details.insert("dma_remapping".into(), options.dma_remapping.into());
    let interleaving = crate::interleaving::RESULT_KEYS;
    for key in ["low_resources", "fault_points", "injected_faults"].into_iter().chain(interleaving) {
        if let Some(value) = simulation.get(key) {
            report.details.insert(key.into(), value.clone());
        }
    }
    if let Some(error) = scenario_error {
        bail!("{error}");
    }
    if let Some(pnp) = pnp.filter(|p| !p.steps.is_empty()) {
        let steps: Vec<String> =
            pnp.steps.iter().map(|(s, status)| format!("{} {:#x}", s.name(), *status as u32)).collect();
        report.details.insert("pnp".into(), serde_json::json!({ "steps": steps, "refused": pnp.refused }));
        if let Some(why) = &pnp.failure {
            bail!("PnP sequence: {why}");
        }
    }
    if let Some(user) = vhca_loader::user_process::outcome() {
        // What the program answered: "exited" after its work, or why it stopped (the run fails on that).
        let said = user.as_ref().map_or_else(|why| why.clone(), |()| "exited".to_string());
        report.details.insert("user_process".into(), said.into());
        if let Err(why) = user {
            bail!("user process: {why}");
        }
    }
    if options.sleep_resume > 0 {
        report.details.insert(
            "power".into(),
            serde_json::json!({ "sleep_resume_cycles": power.cycles, "device_irps": power.device_irps }),
        );
        match &power.failure {
            // Under the simulation a power-up that failed cleanly is the driver's error path, as a failed start is:
            // judged on what the driver left behind (the unload checks and the leak census below).
            Some(why) if injected && power.power_up_failed => {
                error_path = Some(format!("sleep/resume: {why}"));
            }
            Some(why) => bail!("sleep/resume: {why}"),
            None => {}
        }
    }
    match life {
        Err(failure @ (LifeFailure::DriverEntry(_) | LifeFailure::StartDevice(_))) if injected => {
            error_path = Some(format!("{}{failure}", error_path.map_or(String::new(), |e| format!("{e}; "))));
        }
        Err(failure) => bail!("vhca.sys: {failure}"),
        Ok(()) => {}
    }
    if let Some(why) = &error_path {
        progress(format_args!("vhca.sys stopped on the error path ({why}); judged on what it left behind"));
        report.details.insert("error_path".into(), why.clone().into());
    }
    // Under the simulation, what the verifier's unload checks do not see (contiguous memory, MDLs, locked pages)
    // fails the run too, as natively (driver_run.rs, driver_closed).
    if model.injection_mode() != InjectionMode::Off {
        let leaks = model.unreleased_resources();
        anyhow::ensure!(leaks.is_empty(), "the driver never released: {}", leaks.join("; "));
    }
    if error_path.is_some() {
        std::mem::forget(mapped);
        return Ok(());
    }
    if kernel().result_json().is_none() {
        bail!("vhca.sys printed no result line");
    }
    // Nothing of the driver runs after its unload; the mapping goes with this process.
    std::mem::forget(mapped);
    Ok(())
}
