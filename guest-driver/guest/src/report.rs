//! The run's result as the runner reads it: one `VHCA-RESULT {json}` line on the console, plus the human progress
//! lines (`vhca-guest: ...`). The only module that decides how output looks.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use vhca_proto::{DeviceConfig, QueryDeviceResp, CONFIG_MAGIC};

use crate::completion_times::CompletionTimes;

pub const RESULT_PREFIX: &str = "VHCA-RESULT ";
pub const PROGRESS_PREFIX: &str = "vhca-guest: ";

/// What one entropy request to the rng target device brought back (`rng::read_entropy`): a part of the result line,
/// so it lives here and the rng module fills it in.
#[derive(Debug, Clone, Serialize)]
pub struct EntropyRead {
    pub iova: u64,
    pub used_len: u32,
    pub bytes_hex: String,
}

/// A human progress line; stdout is the console (ttyS0) when this runs as the initramfs' init.
pub fn progress(message: impl std::fmt::Display) {
    println!("{PROGRESS_PREFIX}{message}");
}

#[derive(Debug, Clone, Serialize)]
pub struct QueryDeviceView {
    pub abi_version: u32,
    pub vendor_id: u32,
    pub max_pd: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_mr: u32,
    pub map_registers_total: u32,
    pub map_registers_free: u32,
    pub page_size: u32,
    pub fw_version: u64,
    pub node_guid: u64,
    pub status: &'static str,
    pub tag: u32,
    pub used_len: u32,
}

impl QueryDeviceView {
    pub fn new(r: &QueryDeviceResp, tag: u32, used_len: u32) -> QueryDeviceView {
        QueryDeviceView {
            abi_version: r.abi_version.get(),
            vendor_id: r.vendor_id.get(),
            max_pd: r.max_pd.get(),
            max_cq: r.max_cq.get(),
            max_cqe: r.max_cqe.get(),
            max_qp: r.max_qp.get(),
            max_qp_wr: r.max_qp_wr.get(),
            max_sge: r.max_sge.get(),
            max_mr: r.max_mr.get(),
            map_registers_total: r.map_registers_total.get(),
            map_registers_free: r.map_registers_free.get(),
            page_size: r.page_size.get(),
            fw_version: r.fw_version.get(),
            node_guid: r.node_guid.get(),
            status: "OK",
            tag,
            used_len,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ConfigView {
    pub magic: u32,
    pub magic_ok: bool,
    pub abi_version: u16,
    pub num_queues: u16,
    pub map_registers: u32,
}

impl From<&DeviceConfig> for ConfigView {
    fn from(c: &DeviceConfig) -> ConfigView {
        ConfigView {
            magic: c.magic.get(),
            magic_ok: c.magic.get() == CONFIG_MAGIC,
            abi_version: c.abi_version.get(),
            num_queues: c.num_queues.get(),
            map_registers: c.map_registers.get(),
        }
    }
}

/// A bugcheck as the result line carries it: code and parameters in hex, as Windows prints them.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct BugcheckView {
    pub code: String,
    pub params: [String; 4],
    pub name: &'static str,
}

impl From<&vhca_ntmodel::Bugcheck> for BugcheckView {
    fn from(b: &vhca_ntmodel::Bugcheck) -> BugcheckView {
        BugcheckView {
            code: format!("{:#010X}", b.code).replace("0X", "0x"),
            params: b.params.map(|p| format!("{p:#X}").replace("0X", "0x")),
            name: b.name(),
        }
    }
}

/// The native driver's interrupt path (`vhca.completion=interrupt`): how often its ISR and DPC ran.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct CompletionPathView {
    pub isr_calls: u64,
    pub dpc_calls: u64,
    /// DPC runs that stopped at their CQE budget and queued themselves again.
    pub dpc_requeues: u64,
    /// CQEs the DPC handed to completion callbacks.
    pub cqes: u64,
}

impl From<vhca_driver_core::CompletionCounts> for CompletionPathView {
    fn from(c: vhca_driver_core::CompletionCounts) -> CompletionPathView {
        CompletionPathView {
            isr_calls: c.isr_calls,
            dpc_calls: c.dpc_calls,
            dpc_requeues: c.dpc_requeues,
            cqes: c.cqes,
        }
    }
}

/// When the native driver's ISR and DPC ran (`completion_times`), written as µs before the result line itself was
/// written: the one instant the runner also sees (the line's arrival), so it can place them on the device's clock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompletionTimesView {
    pub isr: Vec<Instant>,
    pub dpc: Vec<Instant>,
    /// Runs counted past the ones timed.
    pub isr_untimed: u64,
    pub dpc_untimed: u64,
}

impl Serialize for CompletionTimesView {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let now = Instant::now();
        let before = |times: &[Instant]| -> Vec<u64> {
            times
                .iter()
                .map(|t| u64::try_from(now.saturating_duration_since(*t).as_micros()).unwrap_or(u64::MAX))
                .collect()
        };
        let mut map = s.serialize_map(Some(4))?;
        map.serialize_entry("isr_us_before_result", &before(&self.isr))?;
        map.serialize_entry("dpc_us_before_result", &before(&self.dpc))?;
        map.serialize_entry("isr_untimed", &self.isr_untimed)?;
        map.serialize_entry("dpc_untimed", &self.dpc_untimed)?;
        map.end()
    }
}

/// The run's MSI-X interrupts (`vhca.completion=interrupt`): how vectors were routed and what each delivered.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct InterruptsView {
    /// Entries of the device's MSI-X table, as VFIO reports them.
    pub table_entries: u32,
    /// The entry configuration changes signal.
    pub config_vector: u16,
    /// The entry each queue signals, queue i at index i.
    pub queue_vectors: Vec<u16>,
    /// The queues that asked for interrupts and waited for them; the others declined and polled.
    pub waiting_queues: Vec<u16>,
    /// MSI-X messages delivered per enabled entry, entry i at index i.
    pub per_vector: Vec<u64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Iovas {
    pub cmd: Option<u64>,
    pub resp: Option<u64>,
    /// Per queue: descriptor table, avail ring, used ring.
    pub rings: Vec<[u64; 3]>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Gpas {
    pub cmd: Option<u64>,
    pub resp: Option<u64>,
}

/// Everything the runner may want from one run. Filled in as the run goes, so a failure still reports how far it got.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub scenario: String,
    pub ok: bool,
    pub error: Option<String>,
    pub device: Option<String>,
    pub pci_address: Option<String>,
    pub iommu_group: Option<u32>,
    /// "mmap" when BAR registers are mapped, "pread" when every access is a syscall.
    pub mmio: Option<&'static str>,
    pub features: Option<String>,
    pub num_queues: Option<u16>,
    /// How the native driver's queues waited for completions: "poll" or "interrupt" (`vhca.completion`).
    pub completion: Option<&'static str>,
    /// With interrupts, their routing and counts; null when the run polled (no vector was enabled).
    pub interrupts: Option<InterruptsView>,
    /// With interrupts, the native driver's ISR and DPC counts; null when it polled.
    pub completion_path: Option<CompletionPathView>,
    /// With interrupts, when the ISR and DPC ran; null when it polled or nothing timed them. The live record, read
    /// when the line is written: a run that stops on a bugcheck in its ISR or DPC still shows them on the timeline.
    #[serde(serialize_with = "live_times")]
    pub completion_times: Option<Arc<CompletionTimes>>,
    pub query_device: Option<QueryDeviceView>,
    pub rng: Option<EntropyRead>,
    pub iovas: Iovas,
    /// Guest-physical addresses of the same command buffers: the device must never see these.
    pub gpas: Gpas,
    pub config: Option<ConfigView>,
    /// DMAR fault and vfio lines from the kernel log.
    pub kernel_log: Vec<String>,
    /// How many of those are IOMMU (DMAR) faults.
    pub iommu_faults: usize,
    /// In a negative control, the error the device was expected to cause, and did.
    pub expected_failure: Option<String>,
    pub warnings: Vec<String>,
    /// Driver Verifier flags of the NT model, e.g. "0xaa" ("0x0" when off).
    pub verifier: Option<String>,
    /// The lock the control path held, when the scenario takes one.
    pub lock: Option<String>,
    /// What a driver scenario saw: data checks, statuses, pieces, registers, events.
    pub details: serde_json::Map<String, serde_json::Value>,
    /// The bugcheck that stopped the machine, also printed above in Windows' `*** STOP:` form.
    pub bugcheck: Option<BugcheckView>,
    pub elapsed_ms: u64,
    /// Where the time went: (phase, milliseconds) in order.
    pub phases_ms: Vec<(&'static str, f64)>,
    /// Time since the kernel started, when the result was printed: boot to result.
    pub uptime_ms: Option<u64>,
}

fn live_times<S: Serializer>(times: &Option<Arc<CompletionTimes>>, s: S) -> Result<S::Ok, S::Error> {
    times.as_ref().map(|t| t.view()).serialize(s)
}

impl Report {
    /// The result line, without its newline.
    pub fn line(&self) -> String {
        let json = serde_json::to_string(self)
            .unwrap_or_else(|e| format!(r#"{{"scenario":"?","ok":false,"error":"report serialisation: {e}"}}"#));
        format!("{RESULT_PREFIX}{json}")
    }

    /// Prints the result line in one write, so kernel messages cannot land inside it.
    pub fn print(&self) {
        let mut out = self.line().into_bytes();
        out.push(b'\n');
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(&out);
        let _ = stdout.flush();
    }
}

/// Milliseconds since boot, from /proc/uptime.
pub fn uptime_ms() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/uptime").ok()?;
    let seconds: f64 = text.split_whitespace().next()?.parse().ok()?;
    Some((seconds * 1000.0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completion_times::PathRoutine;

    #[test]
    fn interrupt_counts_are_in_the_result_line_per_vector() {
        let interrupts = InterruptsView {
            table_entries: 1,
            config_vector: 0,
            queue_vectors: vec![0, 0, 0, 0],
            waiting_queues: vec![0],
            per_vector: vec![3],
        };
        let report = Report { completion: Some("interrupt"), interrupts: Some(interrupts), ..Report::default() };
        let json: serde_json::Value = serde_json::from_str(report.line().strip_prefix(RESULT_PREFIX).unwrap()).unwrap();
        assert_eq!(json["completion"], "interrupt");
        assert_eq!(json["interrupts"]["per_vector"], serde_json::json!([3]));
        assert_eq!(json["interrupts"]["queue_vectors"][0], 0);
        assert_eq!(json["interrupts"]["waiting_queues"], serde_json::json!([0]));
    }

    #[test]
    fn isr_and_dpc_times_are_written_back_from_the_result_line() {
        let ran = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let times = Arc::new(CompletionTimes::default());
        times.ran_at(PathRoutine::Isr, ran);
        let report = Report { completion_times: Some(times.clone()), ..Report::default() };
        // Runs recorded after the record went into the report are in the line too.
        for _ in 0..crate::completion_times::KEPT + 3 {
            times.ran_at(PathRoutine::Isr, ran);
        }
        let json: serde_json::Value = serde_json::from_str(report.line().strip_prefix(RESULT_PREFIX).unwrap()).unwrap();
        let before = json["completion_times"]["isr_us_before_result"][0].as_u64().unwrap();
        assert!((2_000..60_000_000).contains(&before), "{before} µs before the line");
        assert_eq!(json["completion_times"]["dpc_us_before_result"], serde_json::json!([]));
        assert_eq!(json["completion_times"]["isr_untimed"], 4);
        let timed = json["completion_times"]["isr_us_before_result"].as_array().unwrap().len();
        assert_eq!(timed, crate::completion_times::KEPT, "the first runs timed, the rest counted");
        assert!(Report::default().line().contains("\"completion_times\":null"));
    }

    #[test]
    fn result_line_is_one_line_of_json_with_the_contract_fields() {
        let report = Report {
            scenario: "smoke".into(),
            error: Some("line one\nline two".into()),
            device: Some("1af4:1059".into()),
            iovas: Iovas { cmd: Some(1), resp: Some(2), rings: vec![[3, 4, 5]] },
            ..Report::default()
        };
        let line = report.line();
        assert!(!line.contains('\n'));
        let json: serde_json::Value = serde_json::from_str(line.strip_prefix(RESULT_PREFIX).unwrap()).unwrap();
        assert_eq!(json["scenario"], "smoke");
        assert_eq!(json["ok"], false);
        assert_eq!(json["error"], "line one\nline two");
        assert_eq!(json["device"], "1af4:1059");
        assert!(json["query_device"].is_null());
        assert!(json["interrupts"].is_null(), "a polling run enables no vector");
        assert_eq!(json["iovas"]["rings"][0][2], 5);
        assert!(json["elapsed_ms"].is_u64());
    }
}
