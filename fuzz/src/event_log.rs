//! The runner's reading of the device's event log (JSON lines; their content is shaped by what the guest did, and a
//! killed device leaves a cut last line): parsing, faults, the IOTLB cross-check, the timeline and a verdict.
//! Never panics; every line is either an event or a reported bad line.

use vhca_suite::{iotlb_problems, judge, parse_event_log, render_timeline, Expected, Observation};

/// One input: never panics, and the checks below hold.
pub fn run(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let log = parse_event_log(&text);
    let nonblank = text.lines().filter(|l| !l.trim().is_empty()).count();
    assert_eq!(log.events.len() + log.errors.len(), nonblank, "a line neither parsed nor reported");
    let faults = log.faults();
    assert!(faults.len() <= log.events.len());
    let _ = log.map_register_total();
    for event in &log.events {
        let _ = (event.in_use(), event.is_fault(), event.u64_field("iova"), event.str_field("cause"));
    }
    let _ = iotlb_problems(&log, None);
    let _ = render_timeline("fuzz", &log, Some((0xE6, "DRIVER_VERIFIER_DMA_VIOLATION")));
    let mut observation = Observation::default();
    observation.add_event_log(&log);
    assert_eq!(observation.device_faults.len(), faults.len());
    let verdict = judge(&Expected::parse("pass").expect("a valid expectation"), &observation);
    let _ = format!("{verdict:?}");
}
