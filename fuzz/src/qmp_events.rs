//! The runner's reading of QMP events (QEMU relays GUEST_PANICKED data the guest chose, e.g. Hyper-V crash
//! parameters): each line as the runner's QMP reader takes it, into the observation and a verdict. Never panics,
//! and only a GUEST_PANICKED event (or bare panic data) is taken as a panic.

use vhca_suite::{judge, Expected, GuestPanicked, Observation};

/// One input: never panics, and the checks below hold.
pub fn run(data: &[u8]) {
    let mut observation = Observation::default();
    for line in data.split(|&b| b == b'\n') {
        let text = String::from_utf8_lossy(line);
        let Ok(event) = serde_json::from_str::<serde_json::Value>(text.trim()) else { continue };
        let panicked = GuestPanicked::from_qmp(&event);
        if let Some(name) = event.get("event") {
            if name != "GUEST_PANICKED" {
                assert!(panicked.is_none(), "a {name} event was taken as a panic");
            }
        }
        if let Some(crash) = panicked.as_ref().and_then(|p| p.hyperv.as_ref()) {
            let _ = crash.bugcheck();
        }
        assert_eq!(observation.add_qmp_event(&event), panicked.is_some());
    }
    for expected in ["pass", "guest-panic", "bugcheck 0x7E 0xC0000005 * * *"] {
        let verdict = judge(&Expected::parse(expected).expect("a valid expectation"), &observation);
        let _ = format!("{verdict:?}");
    }
}
