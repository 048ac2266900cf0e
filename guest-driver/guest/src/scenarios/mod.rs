//! The driver scenarios: the driver core (`vhca-driver`) on the NT model (`vhca-ntmodel`) over VFIO, against the
//! real device. Each scenario is one module; this one opens the HCA, runs it, drains events and unloads the driver.

mod cq_fallback;
mod create_cq_lock;
mod map_registers;
mod pool_exhaustion;
mod shared_buffer;
mod smoke;
mod use_after_unmap;
mod user_buffer;
mod verbs;
mod verbs_loopback;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{json, Value};
use vhca_driver::{ClMutexKind, Hca, HcaConfig};
use vhca_ntapi::PDEVICE_OBJECT;
use vhca_ntmodel::{NtModel, NtModelConfig};
use vhca_proto::{Cqe, Event, EventKind, FaultCause};

use crate::kmsg;

use crate::bugcheck_handler::ConsoleBugcheck;
use crate::cmdline::{lock_name, Options};
use crate::nt_backend::VfioDmaBackend;
use crate::report::{progress, Report};
use crate::vfio_dma::DmaMapper;
use crate::virtio_channel::VirtioChannel;

/// The physical device object the driver's DMA adapter is for (a stand-in address, as the model's objects are).
pub const PDO: PDEVICE_OBJECT = PDEVICE_OBJECT(0xFFFF_C000_0000_1000);

pub type Driver = Hca<NtModel, VirtioChannel>;

/// One scenario: its name (the suite's), the HCA configuration it needs, and what it does.
pub struct Scenario {
    pub name: &'static str,
    pub config: fn(&Options) -> HcaConfig,
    pub run: fn(&mut Ctx) -> anyhow::Result<()>,
}

fn default_config(_: &Options) -> HcaConfig {
    HcaConfig::default()
}

const fn scenario(name: &'static str, run: fn(&mut Ctx) -> anyhow::Result<()>) -> Scenario {
    Scenario { name, config: default_config, run }
}

pub const SCENARIOS: &[Scenario] = &[
    scenario("verbs-loopback", verbs_loopback::run),
    scenario("device-pool-exhaustion", pool_exhaustion::run),
    scenario("fast-mutex-create-cq", create_cq_lock::fast_mutex),
    scenario("fixed-lock-create-cq", create_cq_lock::fixed_lock),
    Scenario { name: "contiguous-cq-fallback", config: cq_fallback::config, run: cq_fallback::run },
    Scenario { name: "map-register-exhaustion", config: map_registers::config, run: map_registers::run },
    scenario("shared-buffer-sg", shared_buffer::sg),
    scenario("shared-buffer-common", shared_buffer::common),
    scenario("use-after-unmap", use_after_unmap::run),
    scenario("user-buffer-probe-lock", user_buffer::probe_lock),
    scenario("user-buffer-no-lock", user_buffer::no_lock),
    scenario("io-map-common-buffer", shared_buffer::io_map_common_buffer),
];

/// smoke under the verifier: the driver core on the NT model (bring-up runs it instead of the transport's smoke
/// when verifier flags are set). Not in SCENARIOS: `vhca.scenario=smoke` names the transport's check.
pub const SMOKE: Scenario = scenario("smoke", smoke::run);

pub fn find(name: &str) -> Option<&'static Scenario> {
    SCENARIOS.iter().find(|s| s.name == name)
}

/// What a scenario works with: the HCA, the kernel under it, the options, and the report it adds details to.
pub struct Ctx<'a> {
    pub hca: Driver,
    pub kernel: Arc<NtModel>,
    pub options: &'a Options,
    report: Arc<Mutex<Report>>,
    timeout: Duration,
    events: Vec<Value>,
    /// A failure that must not stop the run before the driver unloads (the unload's checks come first).
    deferred: Option<String>,
}

impl Ctx<'_> {
    /// Adds `key: value` to the result's details (kept if the machine bugchecks later).
    pub fn detail(&self, key: &str, value: impl Serialize) {
        let value = serde_json::to_value(value).unwrap_or_else(|e| Value::String(format!("unserialisable: {e}")));
        let mut r = self.report.lock().unwrap_or_else(|e| e.into_inner());
        r.details.insert(key.to_string(), value);
    }

    /// Fails the run after the driver has unloaded, so the verifier's unload checks still get their say.
    pub fn defer_failure(&mut self, why: String) {
        progress(format_args!("failure, reported after unload: {why}"));
        self.deferred.get_or_insert(why);
    }

    pub fn say(&self, message: impl std::fmt::Display) {
        progress(message);
    }

    /// The lock the control path takes: `vhca.lock` if given, else the scenario's choice; `vhca.break_fix`
    /// swaps a fixed choice for the seed's FAST_MUTEX.
    pub fn lock_kind(&self, scenario_choice: ClMutexKind) -> ClMutexKind {
        let kind = self.options.lock.unwrap_or(scenario_choice);
        let kind = if self.options.break_fix { ClMutexKind::FastMutex } else { kind };
        let mut r = self.report.lock().unwrap_or_else(|e| e.into_inner());
        r.lock = Some(lock_name(kind).into());
        kind
    }

    /// Takes every event the device has delivered. A DMA fault event is the device's own diagnostic, for the
    /// report: an IOMMU fault reaches the kernel from the platform (`report_platform_iommu_faults`), not from here.
    pub fn drain_events(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        while let Some(event) = self.hca.poll_event() {
            out.push(event);
        }
        for event in &out {
            let view = event_view(event);
            progress(format_args!("event: {view}"));
            self.events.push(view);
            self.detail("events", &self.events);
        }
        out
    }

    /// Waits up to `wait` for the vIOMMU's fault records about this device to reach the kernel log, then hands each
    /// to the NT model as the platform's IOMMU fault report (with DMA checking: 0xE6/0x26, the faulting address
    /// and VT-d's fault reason as parameters 3 and 4). Returns the faults seen.
    pub fn report_platform_iommu_faults(&mut self, wait: Duration) -> Vec<kmsg::DmarFault> {
        let address = self.report.lock().unwrap_or_else(|e| e.into_inner()).pci_address.clone();
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
        self.detail("dmar_faults", &view);
        for fault in &faults {
            progress(format_args!(
                "IOMMU fault from the platform: address {:#x}, reason {:#x}",
                fault.address, fault.reason
            ));
            self.kernel.report_iommu_fault(PDO, fault.address, fault.reason);
        }
        faults
    }

    /// Waits (polling) for an event of `kind`; every event seen on the way is drained as above.
    pub fn wait_event(&mut self, kind: EventKind, wait: Duration) -> Option<Event> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(e) = self.drain_events().into_iter().find(|e| e.kind.get() == kind as u32) {
                return Some(e);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Polls `cq` until `want` completions arrived, or fails naming how many did.
    pub fn poll_cq(&mut self, cq: u32, want: usize) -> anyhow::Result<Vec<Cqe>> {
        let deadline = Instant::now() + self.timeout;
        let mut got = Vec::new();
        while got.len() < want {
            got.extend(self.hca.poll_cq(cq, want - got.len()).map_err(|e| anyhow::anyhow!("poll_cq: {e}"))?);
            if got.len() >= want {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "CQ {cq}: {} of {want} completions within {:?}",
                got.len(),
                self.timeout
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(got)
    }
}

fn event_view(e: &Event) -> Value {
    let kind = match EventKind::from_u32(e.kind.get()) {
        Some(EventKind::CqCompletion) => "cq_completion",
        Some(EventKind::QpFatal) => "qp_fatal",
        Some(EventKind::DmaFault) => "dma_fault",
        Some(EventKind::MapRegistersExhausted) => "map_registers_exhausted",
        None => "unknown",
    };
    let cause = FaultCause::from_u32(e.cause.get()).map_or("unknown", FaultCause::name);
    json!({"kind": kind, "handle": e.handle.get(), "cause": cause, "detail": e.detail.get(),
           "addr": format!("{:#x}", e.addr.get())})
}

/// Keeps the NT model (and with it every buffer it mapped for the device) alive until the device is reset.
pub struct DriverRun {
    pub kernel: Arc<NtModel>,
    pub backend: Arc<VfioDmaBackend>,
}

/// Opens the HCA on a fresh NT model, runs the scenario, drains events, closes the HCA and unloads the driver
/// (the verifier's leak checks). A bugcheck anywhere never returns: the handler reports and powers off.
pub fn run(
    scenario: &Scenario,
    options: &Options,
    channel: VirtioChannel,
    mapper: Arc<DmaMapper>,
    report: Arc<Mutex<Report>>,
    timeout: Duration,
) -> (Option<DriverRun>, anyhow::Result<()>) {
    let backend = Arc::new(VfioDmaBackend::new(mapper));
    let config = NtModelConfig {
        verifier: options.verifier,
        map_registers: options.map_registers.unwrap_or(NtModelConfig::default().map_registers),
        max_contiguous_pages: options.fragmentation,
        disabled_rules: options.disabled_rules.clone(),
        double_buffering: options.double_buffering,
    };
    {
        let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
        r.verifier = Some(format!("{:#x}", options.verifier.0));
        r.details.insert("adapter_map_registers".into(), json!(config.map_registers));
        r.details.insert("max_contiguous_pages".into(), json!(config.max_contiguous_pages));
        let rules: Vec<String> = config.disabled_rules.iter().map(|r| r.to_string()).collect();
        r.details.insert("disabled_rules".into(), json!(rules));
        r.details.insert("break_fix".into(), json!(options.break_fix));
        r.details.insert("double_buffering".into(), json!(config.double_buffering));
    }
    let handler = Arc::new(ConsoleBugcheck::new(report.clone(), options.poweroff));
    let kernel = Arc::new(NtModel::new(config, backend.clone(), handler));
    let keep = DriverRun { kernel: kernel.clone(), backend: backend.clone() };
    let hca = match Hca::open(kernel.clone(), channel, PDO, (scenario.config)(options)) {
        Ok(hca) => hca,
        Err(e) => return (Some(keep), Err(anyhow::anyhow!("Hca::open: {e}"))),
    };
    progress(format_args!(
        "driver open: verifier {:#x}, adapter map registers {}, device map registers {} free",
        options.verifier.0,
        hca.map_registers(),
        hca.attributes().map_registers_free.get()
    ));
    let mut ctx = Ctx { hca, kernel: kernel.clone(), options, report, timeout, events: Vec::new(), deferred: None };
    let result = (scenario.run)(&mut ctx);
    ctx.drain_events();
    let deferred = ctx.deferred.take();
    let (mapped, peak) = backend.mapped_pages();
    ctx.detail("nt_mapped_pages_peak", peak);
    if result.is_ok() {
        // The driver unloads: the verifier checks the adapter (0xE6/0x07..0x0A) and the pool (0xC4/0x60).
        ctx.hca.close();
        kernel.unload_driver();
        progress(format_args!("driver unloaded; {mapped} NT pages still mapped for the device at unload"));
    }
    let result = match (result, deferred) {
        (Ok(()), Some(why)) => Err(anyhow::anyhow!(why)),
        (r, _) => r,
    };
    (Some(keep), result)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The seed suite (the runner's file) names only scenarios this program knows.
    #[test]
    fn every_seed_suite_scenario_is_known() {
        let suite = include_str!("../../../../runner/suite/suites/seed.toml");
        let mut names = Vec::new();
        let mut in_run = false;
        for line in suite.lines().map(str::trim) {
            if line.starts_with('[') {
                in_run = line == "[[run]]";
            } else if let Some(rest) = line.strip_prefix("name = \"").filter(|_| in_run) {
                names.push(rest.trim_end_matches('"').to_string());
            }
        }
        assert!(names.len() >= 10, "parsed {names:?}");
        let unknown: Vec<_> = names.iter().filter(|n| *n != "smoke" && find(n).is_none()).collect();
        assert!(unknown.is_empty(), "seed.toml runs the guest does not know: {unknown:?}");
    }

    #[test]
    fn scenario_names_are_unique() {
        let mut names: Vec<_> = SCENARIOS.iter().map(|s| s.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), SCENARIOS.len());
    }
}
