//! The low-resources simulation in a run: its settings from the options (a randomized run without a seed picks one
//! and says which), one `VHCA-FAULT {json}` console line per injected failure as it happens (so a bugcheck right
//! after still shows it), and the failure points and the injection log in the result, as `!verifier 4` lists them.

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use vhca_ntmodel::{FaultPoint, InjectedFault, InjectionMode, LowResourcesConfig, NtModel};

use crate::cmdline::Options;
use crate::report::{progress, Report};

/// The marker of a failure-injection line on the console; the runner reads the lines after it.
pub const FAULT_PREFIX: &str = "VHCA-FAULT ";

/// The simulation's settings for this run. A randomized run with no `vhca.faults_seed` takes its seed from the clock
/// (printed, and in the result, so the run can be repeated with it).
pub fn config(options: &Options) -> LowResourcesConfig {
    let mut config = options.low_resources.clone();
    if !options.faults_seed_given {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        config.seed = nanos;
    }
    config
}

pub fn mode_name(mode: InjectionMode) -> String {
    match mode {
        InjectionMode::Off => "off".into(),
        InjectionMode::Randomized => "randomized".into(),
        InjectionMode::Systematic => "systematic".into(),
        InjectionMode::Record => "record".into(),
        InjectionMode::FailPoint(k) => format!("fail-point {k}"),
    }
}

pub fn point_view(p: &FaultPoint) -> Value {
    json!({"point": p.point, "routine": p.routine.name(), "site": p.site.to_string()})
}

pub fn fault_view(f: &InjectedFault) -> Value {
    json!({"sequence": f.sequence, "point": f.point, "routine": f.routine.name(), "result": f.failure.to_string(),
           "site": f.site.to_string()})
}

/// Says what the simulation does in this run, and from now on prints and records every failure it injects.
pub fn start(kernel: &NtModel, config: &LowResourcesConfig, report: &Arc<Mutex<Report>>) {
    let mode = kernel.injection_mode();
    let mut settings = json!({"mode": mode_name(mode), "dma_routines": config.dma_routines});
    if mode == InjectionMode::Randomized {
        settings["seed"] = json!(config.seed);
        settings["probability"] = json!(config.probability);
        settings["delay_ms"] = json!(config.delay.as_millis() as u64);
        progress(format_args!(
            "low resources simulation: randomized, seed {} (vhca.faults_seed={} repeats it), probability {}/10000, \
             delay {} ms",
            config.seed,
            config.seed,
            config.probability,
            config.delay.as_millis()
        ));
    } else if mode != InjectionMode::Off {
        progress(format_args!("low resources simulation: {}", mode_name(mode)));
    }
    {
        let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
        r.details.insert("low_resources".into(), settings);
    }
    if mode == InjectionMode::Off {
        return;
    }
    let report = report.clone();
    kernel.observe_injected_faults(Arc::new(move |fault: &InjectedFault| {
        let view = fault_view(fault);
        println!("{FAULT_PREFIX}{view}");
        let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
        let log = r.details.entry("injected_faults").or_insert_with(|| json!([]));
        if let Some(list) = log.as_array_mut() {
            list.push(view);
        }
    }));
}

/// Puts every failure point seen into the result (the recording run's list is what the runner expands).
pub fn record_points(kernel: &NtModel, report: &Arc<Mutex<Report>>) {
    if kernel.injection_mode() == InjectionMode::Off {
        return;
    }
    let points: Vec<Value> = kernel.fault_points().iter().map(point_view).collect();
    let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
    r.details.insert("fault_points".into(), json!(points));
}
