//! QMP GUEST_PANICKED with Hyper-V crash parameters, in the shapes QEMU's source emits (qapi/run-state.json
//! `GuestPanicInformationHyperV`: `arg1`..`arg5`, all uint64; `qemu_system_guest_panicked` in system/runstate.c sends
//! action "pause", "poweroff" (the default `-action panic=shutdown`) or "run" (`-action panic=none`); QEMU before 6.0
//! sent "pause" then "poweroff"). The event texts below are written as QEMU's JSON writer prints them; none came from a
//! Windows guest (no Windows image on the machines this is developed on).

use serde_json::json;
use vhca_suite::{judge, parse_bugcheck, Actual, Expected, GuestPanicked, Observation};

/// What Windows writes to the crash MSRs on a bugcheck: P0 = the code, P1..P4 = its four parameters.
fn hyperv_event(action: &str) -> serde_json::Value {
    let text = format!(
        r#"{{"timestamp": {{"seconds": 1764480000, "microseconds": 12}}, "event": "GUEST_PANICKED", "data": {{"action": "{action}", "info": {{"type": "hyper-v", "arg1": 230, "arg2": 10, "arg3": 18446735290806851192, "arg4": 0, "arg5": 0}}}}}}"#
    );
    serde_json::from_str(&text).unwrap()
}

#[test]
fn every_action_qemu_sends_carries_the_bugcheck() {
    for action in ["pause", "poweroff", "run"] {
        let p = GuestPanicked::from_qmp(&hyperv_event(action)).unwrap();
        assert_eq!(p.action, action);
        assert_eq!(p.info_type.as_deref(), Some("hyper-v"));
        let b = p.hyperv.unwrap().bugcheck().unwrap();
        assert_eq!((b.code, b.params.clone()), (0xE6, vec![0x0A, 0xFFFF_F803_1234_5678, 0, 0]));
        assert_eq!(b.name.as_deref(), Some("DRIVER_VERIFIER_DMA_VIOLATION"));
    }
}

#[test]
fn the_qmp_bugcheck_becomes_the_same_stop_line_and_verdict_as_a_serial_one() {
    let qmp = GuestPanicked::from_qmp(&hyperv_event("run")).unwrap().hyperv.unwrap().bugcheck().unwrap();
    let line = qmp.stop_line();
    assert_eq!(
        line,
        "*** STOP: 0x000000E6 (0x000000000000000A,0xFFFFF80312345678,0x0000000000000000,0x0000000000000000) \
         DRIVER_VERIFIER_DMA_VIOLATION"
    );
    assert_eq!(parse_bugcheck(&line).unwrap(), qmp);

    let mut from_qmp = Observation::default();
    assert!(from_qmp.add_qmp_event(&hyperv_event("poweroff")));
    let mut from_serial = Observation::default();
    from_serial.add_serial(&format!("{line}\n"));
    // All four parameters are compared; `*` takes any value (the address in P2).
    for expected in ["bugcheck 0xE6 0x0A * 0x0 0x0", "bugcheck 0xE6 * * * *"] {
        let e = Expected::parse(expected).unwrap();
        let (q, s) = (judge(&e, &from_qmp), judge(&e, &from_serial));
        assert!(q.outcome.passed() && s.outcome.passed(), "{expected}: {q:?} / {s:?}");
        assert!(matches!(q.actual, Actual::Bugcheck { source: "qmp", .. }));
    }
    let wrong = judge(&Expected::parse("bugcheck 0xE6 0x26 * * *").unwrap(), &from_qmp);
    assert!(!wrong.outcome.passed());
    let pass = judge(&Expected::Pass, &from_qmp);
    assert!(!pass.outcome.passed(), "a Windows bugcheck must fail a run expected to pass");
}

#[test]
fn a_panic_without_crash_msrs_or_with_a_truncated_info_is_a_guest_panic_not_a_guessed_bugcheck() {
    // hv-crash off: QEMU sends no `info`.
    let mut o = Observation::default();
    o.add_qmp_event(&json!({"event": "GUEST_PANICKED", "data": {"action": "poweroff"}}));
    assert!(matches!(judge(&Expected::GuestPanic, &o).actual, Actual::GuestPanic { .. }));
    let truncated =
        json!({"event": "GUEST_PANICKED", "data": {"action": "run", "info": {"type": "hyper-v", "arg1": 230}}});
    assert_eq!(GuestPanicked::from_qmp(&truncated).unwrap().hyperv, None);
    let negative = json!({"event": "GUEST_PANICKED", "data": {"action": "run", "info": {"type": "hyper-v", "arg1": -1, "arg2": 0, "arg3": 0, "arg4": 0, "arg5": 0}}});
    assert_eq!(GuestPanicked::from_qmp(&negative).unwrap().hyperv, None);
}
