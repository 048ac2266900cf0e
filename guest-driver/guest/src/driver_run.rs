//! The Linux guest's side of a driver scenario: the NT model over VFIO as the kernel, the command transport, and the
//! scenario host (`vhca_scenarios::ScenarioHost`) that sends progress to the console, details to the report, and
//! the vIOMMU's DMAR fault records from the kernel log to the NT model. The scenarios themselves are vhca-scenarios,
//! the same code vhca.sys runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vhca_driver_core::{CompletionCounts, CompletionWaits, CqCompletions, PathDevices, DEFAULT_CQE_BUDGET};
use vhca_ntapi::{PDEVICE_OBJECT, PVOID};
use vhca_ntmodel::{InjectionMode, InterleavingConfig, InterruptResources, NtModel, NtModelConfig, VerifierFlags};
use vhca_scenarios::{Scenario, ScenarioHost, ScenarioOptions};

use crate::bugcheck_handler::ConsoleBugcheck;
use crate::cmdline::Options;
use crate::completion_times::CompletionTimes;
use crate::kmsg;
use crate::low_resources;
use crate::model_interrupts::{ModelDelivery, ModelInterrupts};
use crate::nt_backend::VfioDmaBackend;
use crate::report::{progress, Report};
use crate::vfio_command_transport::VfioCommandTransport;
use crate::vfio_dma::DmaMapper;

/// The physical device object the driver's DMA adapter is for (a stand-in address, as the model's objects are).
pub const PDO: PDEVICE_OBJECT = PDEVICE_OBJECT(0xFFFF_C000_0000_1000);

/// The scenario a name picks in the Linux guest: any but smoke, which names the transport's own check there (bring-up
/// runs the driver's smoke instead when verifier flags are set).
pub fn find(name: &str) -> Option<Scenario> {
    Scenario::DRIVER.into_iter().find(|s| s.name() == name)
}

/// What a scenario run asks of the scenario itself, from the command line.
pub fn scenario_options(options: &Options) -> ScenarioOptions {
    ScenarioOptions { lock: options.lock, break_fix: options.break_fix }
}

/// Keeps the NT model (and with it every buffer it mapped for the device) alive until the device is reset; with
/// interrupts, its delivery and clock threads too (field order is drop order: they stop first).
pub struct DriverRun {
    pub delivery: Option<ModelDelivery>,
    pub kernel: Arc<NtModel>,
    pub backend: Arc<VfioDmaBackend>,
}

/// The run's MSI-X messages for the model (`vhca.completion=interrupt`): their sink and how many there are.
pub struct ModelMessages {
    pub sink: Arc<ModelInterrupts>,
    pub count: u32,
}

/// The Linux guest as a scenario's host.
struct GuestHost {
    kernel: Arc<NtModel>,
    backend: Arc<VfioDmaBackend>,
    report: Arc<Mutex<Report>>,
    /// NT pages still mapped for the device when the scenario finished, for the unload's progress line.
    mapped_at_finish: AtomicUsize,
    /// The transport the interrupt path's DPC reads events and rings CQ-arm doorbells through, when the run is
    /// interrupt-driven (a clone: the same queues the driver core's control path uses).
    interrupt_transport: Option<VfioCommandTransport>,
    /// When the interrupt path's ISR and DPC ran, recorded by the driver core's observer from the connection on;
    /// the report holds it live (its `completion_times`).
    times: Arc<CompletionTimes>,
}

impl GuestHost {
    fn report(&self) -> std::sync::MutexGuard<'_, Report> {
        self.report.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ScenarioHost for GuestHost {
    type Kernel = NtModel;
    type Channel = VfioCommandTransport;

    fn say(&self, message: std::fmt::Arguments<'_>) {
        progress(message);
    }

    fn detail(&self, key: &str, value: Value) {
        self.report().details.insert(key.to_string(), value);
    }

    fn lock_chosen(&self, name: &'static str) {
        self.report().lock = Some(name.into());
    }

    fn now(&self) -> Duration {
        static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        ORIGIN.get_or_init(Instant::now).elapsed()
    }

    fn sleep(&self, duration: Duration) {
        std::thread::sleep(duration);
    }

    fn alloc_user_buffer(&self, len: u32, in_page_offset: u64) -> PVOID {
        self.kernel.alloc_user_buffer(len as u64, in_page_offset)
    }

    fn free_user_buffer(&self, va: PVOID) {
        self.kernel.free_user_buffer(va);
    }

    /// Waits up to `wait` for the vIOMMU's fault records about this device to reach the kernel log, then hands each
    /// to the NT model as the platform's IOMMU fault report (with DMA checking: 0xE6/0x26, the faulting address
    /// and VT-d's fault reason as parameters 3 and 4).
    fn report_platform_iommu_faults(&self, wait: Duration) -> Option<usize> {
        let address = self.report().pci_address.clone();
        let deadline = Instant::now() + wait;
        let faults = loop {
            let faults = kmsg::dmar_faults(&kmsg::iommu_lines(64), address.as_deref());
            if !faults.is_empty() || Instant::now() >= deadline {
                break faults;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let view: Vec<Value> = faults
            .iter()
            .map(|f| json!({"address": format!("{:#x}", f.address), "reason": f.reason, "write": f.write}))
            .collect();
        self.detail("dmar_faults", Value::Array(view));
        for fault in &faults {
            progress(format_args!(
                "IOMMU fault from the platform: address {:#x}, reason {:#x}",
                fault.address, fault.reason
            ));
            self.kernel.report_iommu_fault(PDO, fault.address, fault.reason);
        }
        Some(faults.len())
    }

    fn dma_checking(&self) -> Option<bool> {
        Some(self.kernel.verifier().contains(VerifierFlags::DMA_CHECKING))
    }

    /// A scenario stopped by a failure the low-resources simulation injected is on the driver's error path: that is
    /// what the run tests, so it judges how the driver comes out of it (unload checks, leaks, bugchecks), not the
    /// scenario's own verdict.
    fn error_path(&self, _error: &anyhow::Error) -> bool {
        !self.kernel.injected_faults().is_empty()
    }

    fn connect_completions(&self) -> anyhow::Result<Option<Box<dyn CqCompletions>>> {
        let Some(transport) = &self.interrupt_transport else { return Ok(None) };
        let (kernel, transport, observer) = (self.kernel.clone(), Arc::new(transport.clone()), self.times.observer());
        let waits =
            CompletionWaits::connect(kernel, transport, PathDevices::pdo_only(PDO), DEFAULT_CQE_BUDGET, Some(observer))
                .map_err(|e| anyhow::anyhow!("interrupt path: {e}"))?;
        progress(format_args!("interrupt path connected: {}", waits_kind(&waits)));
        self.report().completion_times = Some(self.times.clone());
        Ok(Some(Box::new(waits)))
    }

    /// One console line for the path's whole story: each byte the guest prints costs the run 1.5-8 us under TCG
    /// (a 2 KB result line took 3-16 ms to print: the UART interrupts every 16 bytes, and QEMU writes every byte
    /// to the console socket on its own), so the interrupt path says in one line what it once said in four
    /// (docs/bench.md section 6).
    fn completion_counts(&self, counts: CompletionCounts) {
        // The path connects before Hca::open's first command and disconnects after the close's last (as a Windows
        // driver connects in START_DEVICE before it talks to the device), so every command sleeps on the DPC's
        // KEVENT: a command that polled ran outside that window.
        let waits = self.interrupt_transport.as_ref().map(|t| t.command_waits());
        let commands =
            waits.map_or(String::new(), |(kevent, poll)| format!("; commands: {kevent} on the KEVENT, {poll} polled"));
        progress(format_args!(
            "interrupt path disconnected: {} ISR calls, {} DPC calls ({} re-queued), {} CQEs{commands}",
            counts.isr_calls, counts.dpc_calls, counts.dpc_requeues, counts.cqes
        ));
        if let Some((kevent, poll)) = waits {
            self.detail("command_waits", json!({"kevent": kevent, "poll": poll}));
        }
        self.report().completion_path = Some(counts.into());
    }

    fn scenario_finished(&self) {
        let (mapped, peak) = self.backend.mapped_pages();
        self.mapped_at_finish.store(mapped, Ordering::Relaxed);
        self.detail("nt_mapped_pages_peak", json!(peak));
    }

    /// The driver unloads: the verifier checks the adapter (0xE6/0x07..0x0A) and the pool (0xC4/0x60). Under the
    /// low-resources simulation the model's leak census runs too (what the verifier itself does not catch), so a
    /// driver whose error path forgets an object fails the run.
    fn driver_closed(&self) -> anyhow::Result<()> {
        self.kernel.unload_driver();
        let mapped = self.mapped_at_finish.load(Ordering::Relaxed);
        progress(format_args!("driver unloaded; {mapped} NT pages still mapped for the device at unload"));
        if self.kernel.injection_mode() == InjectionMode::Off {
            return Ok(());
        }
        let leaks = self.kernel.unreleased_resources();
        anyhow::ensure!(leaks.is_empty(), "the driver never released: {}", leaks.join("; "));
        Ok(())
    }
}

/// Makes a fresh NT model over VFIO, runs the scenario on it (vhca-scenarios: open, run, drain events, close and
/// unload after a success). A bugcheck anywhere never returns: the handler reports and powers off.
pub fn run(
    scenario: Scenario,
    options: &Options,
    channel: VfioCommandTransport,
    mapper: Arc<DmaMapper>,
    report: Arc<Mutex<Report>>,
    timeout: Duration,
    messages: Option<ModelMessages>,
) -> (Option<DriverRun>, anyhow::Result<()>) {
    let backend = Arc::new(VfioDmaBackend::new(mapper));
    let config = model_config(options);
    {
        let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
        r.verifier = Some(format!("{:#x}", options.verifier.0));
        r.details.insert("adapter_map_registers".into(), json!(config.map_registers));
        r.details.insert("max_contiguous_pages".into(), json!(config.max_contiguous_pages));
        let rules: Vec<String> = config.disabled_rules.iter().map(|r| r.to_string()).collect();
        r.details.insert("disabled_rules".into(), json!(rules));
        r.details.insert("break_fix".into(), json!(options.break_fix));
        r.details.insert("double_buffering".into(), json!(config.double_buffering));
        r.details.insert("dma_remapping".into(), json!(options.dma_remapping));
    }
    let handler = Arc::new(ConsoleBugcheck::new(report.clone(), options.poweroff));
    let kernel = Arc::new(
        NtModel::new(config.clone(), backend.clone(), handler.clone())
            .with_timing(options.timing)
            .with_special_pool_alignment(options.special_pool),
    );
    kernel.set_dma_remapping(options.dma_remapping);
    handler.witness().attach(&kernel, &options.interleaving, options.processors);
    // The doorbells and commands the transport sends order the device's later interrupts after them.
    channel.tell_model(&kernel, PDO.0);
    low_resources::start(&kernel, &config.low_resources, &report);
    let mut delivery = None;
    if let Some(messages) = &messages {
        // The PnP manager's part: the device starts with the messages VFIO enabled.
        kernel.assign_interrupts(PDO, InterruptResources::Messages(messages.count));
        match messages.sink.attach(kernel.clone(), PDO) {
            Ok(d) => delivery = Some(d),
            Err(e) => return (None, Err(anyhow::anyhow!("NT model interrupt threads: {e}"))),
        }
    }
    let interrupt_transport = messages.as_ref().map(|_| channel.clone());
    let keep = DriverRun { delivery, kernel: kernel.clone(), backend: backend.clone() };
    progress(format_args!("NT model: verifier {:#x}", options.verifier.0));
    let host = GuestHost {
        kernel: kernel.clone(),
        backend,
        report: report.clone(),
        mapped_at_finish: AtomicUsize::new(0),
        interrupt_transport,
        times: Arc::new(CompletionTimes::default()),
    };
    let scenario_options = scenario_options(options);
    let result = vhca_scenarios::run(scenario, &host, kernel.clone(), channel, PDO, &scenario_options, timeout);
    // The failure points seen (a recording run's list is what the runner expands into runs of their own).
    low_resources::record_points(&kernel, &report);
    crate::interleaving::record(&kernel, &options.interleaving, options.processors, &report);
    (Some(keep), result)
}

/// How IoConnectInterruptEx connected, for the progress line.
fn waits_kind<C: vhca_driver_core::CommandTransport + Send + Sync + 'static>(
    waits: &CompletionWaits<NtModel, C>,
) -> &'static str {
    match waits.connection() {
        Some(vhca_ntapi::INTERRUPT_CONNECTION::MessageBased(_)) => "message-based",
        Some(vhca_ntapi::INTERRUPT_CONNECTION::LineBased(_)) => "line-based",
        None => "not connected",
    }
}

/// The NT model a run's options ask for, the same for the native driver and vhca.sys (whose faultable imports name
/// its call sites as RVAs, vhca_loader::driver_stack, so the low-resources simulation works there too).
pub(crate) fn model_config(options: &Options) -> NtModelConfig {
    NtModelConfig {
        verifier: options.verifier,
        map_registers: options.map_registers.unwrap_or(NtModelConfig::default().map_registers),
        max_contiguous_pages: options.fragmentation,
        disabled_rules: options.disabled_rules.clone(),
        double_buffering: options.double_buffering,
        low_resources: low_resources::config(options),
        processors: options.processors,
        interleaving: InterleavingConfig {
            mode: options.interleaving.clone(),
            // vhca.sys rings its doorbells by its own stores to the BARs, which no transport of this program sees:
            // the loader's race watch traps them in every interleaving run (sys_driver.rs) and the model then
            // stops counting kernel calls as kicks (`trap_doorbells`). Until it does, and should the BAR not be
            // trapped, every kernel call stands in for a kick, so its interrupts are not all reported as racing the
            // passive path (the native transport calls device_kicked at each doorbell instead).
            kicks_at_every_call: options.driver == crate::cmdline::Personality::Sys,
            pct_horizon: options.pct_horizon.unwrap_or(vhca_ntmodel::interleaving::DEFAULT_HORIZON),
            ..InterleavingConfig::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seed suite (the runner's file) names only scenarios this program knows.
    #[test]
    fn only_vhca_sys_counts_every_kernel_call_as_a_kick() {
        let native = Options::parse("vhca.interleave=record vhca.processors=3");
        let config = model_config(&native);
        assert_eq!((config.processors, &config.interleaving.mode), (3, &vhca_ntmodel::InterleavingMode::Record));
        assert!(!config.interleaving.kicks_at_every_call, "the native transport kicks at its doorbells");
        assert!(model_config(&Options::parse("vhca.driver=sys")).interleaving.kicks_at_every_call);
    }

    #[test]
    fn every_seed_suite_scenario_is_known() {
        let suite = include_str!("../../../runner/suite/suites/seed.toml");
        let mut names: Vec<String> = Vec::new();
        let mut in_run = false;
        for line in suite.lines().map(str::trim) {
            if line.starts_with('[') {
                in_run = line == "[[run]]";
            } else if let Some(rest) = line.strip_prefix("name = \"").filter(|_| in_run) {
                names.push(rest.trim_end_matches('"').to_string());
            } else if let Some((_, rest)) = line.split_once("scenario = \"").filter(|_| in_run) {
                // `guest = { scenario = "..." }` names the scenario instead of the run's name.
                if let (Some(last), Some(name)) = (names.last_mut(), rest.split('"').next()) {
                    *last = name.to_string();
                }
            }
        }
        assert!(names.len() >= 10, "parsed {names:?}");
        let unknown: Vec<_> = names.iter().filter(|n| *n != "smoke" && find(n).is_none()).collect();
        assert!(unknown.is_empty(), "seed.toml runs the guest does not know: {unknown:?}");
    }
}
