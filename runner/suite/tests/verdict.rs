//! The verdict logic as a table: observation → actual → outcome against an expectation, mismatches included.

use serde_json::json;
use vhca_suite::{judge, parse_event_log, Actual, Expected, Observation, Outcome, ProcessExit};

const STOP_E6_26: &str = "*** STOP: 0x000000E6 (0x0000000000000026,0x0000000000002000,0x0000000000000000,0x0000000000000000)\nDRIVER_VERIFIER_DMA_VIOLATION\n";
const STOP_E6_0E: &str = "*** STOP: 0x000000E6 (0x000000000000000E,0x0,0x0,0x0)\n";
const STOP_C4: &str = "*** STOP: 0x000000C4 (0x0000000000000033,0x1,0x0,0x0) DRIVER_VERIFIER_DETECTED_VIOLATION\n";
const OK: &str = "VHCA-RESULT {\"ok\":true,\"scenario\":\"x\"}\n";
const FAILED: &str = "VHCA-RESULT {\"ok\":false,\"error\":\"create_cq returned 0xC000009A\"}\n";
const FAULT_LOG: &str =
    r#"{"seq":1,"t_us":10,"kind":"fault","cause":"iommu_unmapped","dir":"write","purpose":"cqe","iova":4096}"#;

fn expect(text: &str) -> Expected {
    Expected::parse(text).unwrap()
}

/// An observation of a run that ended with QEMU powering off and the device exiting cleanly.
fn clean(serial: &str) -> Observation {
    let mut o = Observation {
        qemu_exit: ProcessExit::Exited { code: 0 },
        device_exit: ProcessExit::Exited { code: 0 },
        ..Default::default()
    };
    o.add_serial(serial);
    o
}

fn with_fault(mut o: Observation) -> Observation {
    o.add_event_log(&parse_event_log(FAULT_LOG));
    o
}

fn timed_out(serial: &str) -> Observation {
    let mut o = clean(serial);
    o.qemu_exit = ProcessExit::KilledByRunner;
    o.device_exit = ProcessExit::KilledByRunner;
    o.timed_out = true;
    o.timeout_s = Some(30);
    o.silent_for_s = Some(27.5);
    o
}

/// What kind of actual a case must produce (the variant name as serialised).
fn kind(a: &Actual) -> String {
    serde_json::to_value(a).unwrap()["kind"].as_str().unwrap().to_string()
}

struct Case {
    what: &'static str,
    expected: &'static str,
    observation: Observation,
    actual_kind: &'static str,
    /// `None`: must pass; `Some(words)`: must fail with a reason containing `words`.
    failure: Option<&'static str>,
}

fn cases() -> Vec<Case> {
    let mut qemu_abort = clean(OK);
    qemu_abort.qemu_exit = ProcessExit::from_rc(-6);
    let mut device_segv = clean(STOP_E6_26);
    device_segv.device_exit = ProcessExit::Signaled { signal: 11 };
    let mut hv_panic = clean("");
    hv_panic.add_qmp_event(&json!({"event":"GUEST_PANICKED","data":{"action":"pause","info":{"type":"hyper-v","arg1":0xE6,"arg2":0x26,"arg3":0,"arg4":0,"arg5":0}}}));
    let mut pvpanic = clean("");
    pvpanic.add_qmp_event(&json!({"event":"GUEST_PANICKED","data":{"action":"poweroff"}}));
    let mut interrupted = clean("");
    interrupted.qemu_exit = ProcessExit::KilledByRunner;
    let mut no_ok = clean("VHCA-RESULT {\"scenario\":\"x\"}\n");
    no_ok.device_exit = ProcessExit::Running;

    vec![
        Case { what: "plain pass", expected: "pass", observation: clean(OK), actual_kind: "pass", failure: None },
        Case {
            what: "pass expected, verifier stopped it",
            expected: "pass",
            observation: clean(&format!("{STOP_C4}{OK}")),
            actual_kind: "bugcheck",
            failure: Some("expected pass, got bugcheck 0xC4 (0x33, 0x1, 0x0, 0x0) DRIVER_VERIFIER_DETECTED_VIOLATION"),
        },
        Case {
            what: "bugcheck code only",
            expected: "bugcheck 0xC4 0x33 0x1 0x0 0x0",
            observation: clean(STOP_C4),
            actual_kind: "bugcheck",
            failure: None,
        },
        Case {
            what: "bugcheck expected, got pass",
            expected: "bugcheck 0xC4 0x33 0x1 0x0 0x0",
            observation: clean(OK),
            actual_kind: "pass",
            failure: Some("expected bugcheck 0xC4 0x33 0x1 0x0 0x0, got pass"),
        },
        Case {
            what: "bugcheck wrong code",
            expected: "bugcheck 0xC4 0x33 0x1 0x0 0x0",
            observation: clean(STOP_E6_26),
            actual_kind: "bugcheck",
            failure: Some("expected bugcheck 0xC4 0x33 0x1 0x0 0x0, got bugcheck 0xE6"),
        },
        Case {
            what: "bugcheck with subcode",
            expected: "bugcheck 0xE6 0x26 * 0x0 0x0",
            observation: clean(STOP_E6_26),
            actual_kind: "bugcheck",
            failure: None,
        },
        Case {
            what: "bugcheck wrong subcode",
            expected: "bugcheck 0xE6 0x26 * 0x0 0x0",
            observation: clean(STOP_E6_0E),
            actual_kind: "bugcheck",
            failure: Some("parameter 1 is 0xE, not 0x26"),
        },
        Case {
            what: "bugcheck with a wrong parameter 4",
            expected: "bugcheck 0xE6 0x26 * 0x0 0x5",
            observation: clean(STOP_E6_26),
            actual_kind: "bugcheck",
            failure: Some("parameter 4 is 0x0, not 0x5"),
        },
        Case {
            what: "bugcheck with a wrong address where none is marked *",
            expected: "bugcheck 0xE6 0x26 0x1000 0x0 0x0",
            observation: clean(STOP_E6_26),
            actual_kind: "bugcheck",
            failure: Some("parameter 2 is 0x2000, not 0x1000"),
        },
        Case {
            what: "guest-failed with the word in its error",
            expected: "guest-failed 0xC000009A",
            observation: clean(FAILED),
            actual_kind: "guest-failed",
            failure: None,
        },
        Case {
            what: "guest-failed without the word",
            expected: "guest-failed stale",
            observation: clean(FAILED),
            actual_kind: "guest-failed",
            failure: Some("expected guest-failed stale, got guest-failed"),
        },
        Case {
            what: "bugcheck beats the device fault seen before it",
            expected: "bugcheck 0xE6 0x26 * 0x0 0x0",
            observation: with_fault(clean(STOP_E6_26)),
            actual_kind: "bugcheck",
            failure: None,
        },
        Case {
            what: "bugcheck from QMP hyper-v parameters",
            expected: "bugcheck 0xE6 0x26 * 0x0 0x0",
            observation: hv_panic,
            actual_kind: "bugcheck",
            failure: None,
        },
        Case {
            what: "device fault expected",
            expected: "device-fault iommu_unmapped",
            observation: with_fault(clean(OK)),
            actual_kind: "device-fault",
            failure: None,
        },
        Case {
            what: "device fault beats a failed result",
            expected: "device-fault iommu_unmapped",
            observation: with_fault(clean(FAILED)),
            actual_kind: "device-fault",
            failure: None,
        },
        Case {
            what: "device fault with another cause",
            expected: "device-fault outside_mr",
            observation: with_fault(clean(OK)),
            actual_kind: "device-fault",
            failure: Some("expected device-fault outside_mr, got device-fault iommu_unmapped"),
        },
        Case {
            what: "device fault expected, driver passed cleanly",
            expected: "device-fault iommu_unmapped",
            observation: clean(OK),
            actual_kind: "pass",
            failure: Some("expected device-fault iommu_unmapped, got pass"),
        },
        Case {
            what: "unexpected device fault fails a pass",
            expected: "pass",
            observation: with_fault(clean(OK)),
            actual_kind: "device-fault",
            failure: Some("got device-fault iommu_unmapped"),
        },
        Case {
            what: "guest result ok=false",
            expected: "pass",
            observation: clean(FAILED),
            actual_kind: "guest-failed",
            failure: Some("expected pass, got guest-failed: create_cq returned 0xC000009A"),
        },
        Case {
            what: "result without ok",
            expected: "pass",
            observation: no_ok,
            actual_kind: "guest-failed",
            failure: Some("no boolean \"ok\""),
        },
        Case {
            what: "malformed result only",
            expected: "pass",
            observation: clean("VHCA-RESULT {\"ok\":tr\n"),
            actual_kind: "guest-failed",
            failure: Some("serial line 1: VHCA-RESULT JSON does not parse"),
        },
        Case {
            what: "poweroff without result",
            expected: "pass",
            observation: clean("booted\n"),
            actual_kind: "unexpected-poweroff",
            failure: Some("expected pass, got unexpected-poweroff (no VHCA-RESULT line)"),
        },
        Case {
            what: "hang expected",
            expected: "hang",
            observation: timed_out("last words\n"),
            actual_kind: "hang",
            failure: None,
        },
        Case {
            what: "hang unexpected",
            expected: "pass",
            observation: timed_out("last words\n"),
            actual_kind: "hang",
            failure: Some("got hang (no output for 27.5 s, timeout 30 s)"),
        },
        Case {
            what: "a result before the timeout still counts",
            expected: "pass",
            observation: timed_out(OK),
            actual_kind: "pass",
            failure: None,
        },
        Case {
            what: "linux panic",
            expected: "guest-panic",
            observation: clean("[    2.1] Kernel panic - not syncing: Attempted to kill init!\n"),
            actual_kind: "guest-panic",
            failure: None,
        },
        Case {
            what: "linux oops fails a pass",
            expected: "pass",
            observation: clean(&format!(
                "[ 1.0] BUG: kernel NULL pointer dereference, address: 0000000000000008\n{OK}"
            )),
            actual_kind: "guest-panic",
            failure: Some("got guest-panic: BUG: kernel NULL pointer dereference"),
        },
        Case {
            what: "pvpanic via QMP",
            expected: "guest-panic",
            observation: pvpanic,
            actual_kind: "guest-panic",
            failure: None,
        },
        Case {
            what: "QEMU abort is a device failure even with a good result",
            expected: "pass",
            observation: qemu_abort,
            actual_kind: "device-failure",
            failure: Some("got device-failure: QEMU killed by signal 6 (SIGABRT)"),
        },
        Case {
            what: "device crash beats the expected bugcheck",
            expected: "bugcheck 0xE6 0x26 * 0x0 0x0",
            observation: device_segv,
            actual_kind: "device-failure",
            failure: Some("vhca-device killed by signal 11 (SIGSEGV)"),
        },
        Case {
            what: "stopped by the runner without a timeout",
            expected: "pass",
            observation: interrupted,
            actual_kind: "no-result",
            failure: Some("got no-result: QEMU stopped by the runner before a VHCA-RESULT line"),
        },
    ]
}

#[test]
fn verdict_table() {
    let mut wrong = Vec::new();
    for case in cases() {
        let verdict = judge(&expect(case.expected), &case.observation);
        let got_kind = kind(&verdict.actual);
        let outcome_ok = match (&verdict.outcome, case.failure) {
            (Outcome::Pass, None) => true,
            (Outcome::Fail { reason }, Some(words)) => reason.contains(words) && !reason.contains('\n'),
            _ => false,
        };
        if got_kind != case.actual_kind || !outcome_ok {
            wrong.push(format!("{}: actual {got_kind} ({}), outcome {:?}", case.what, verdict.actual, verdict.outcome));
        }
    }
    assert!(wrong.is_empty(), "cases that judged wrong:\n{}", wrong.join("\n"));
}

#[test]
fn notes_keep_what_the_actual_hides() {
    let mut o = with_fault(clean(&format!("{STOP_E6_26}{STOP_C4}")));
    o.add_qmp_event(&json!({"event":"GUEST_PANICKED","data":{"action":"pause","info":{"type":"hyper-v","arg1":0xC4,"arg2":0x33,"arg3":0,"arg4":0,"arg5":0}}}));
    let v = judge(&expect("bugcheck 0xE6 0x26 * 0x0 0x0"), &o);
    assert_eq!(v.outcome, Outcome::Pass);
    let notes = v.notes.join("\n");
    assert!(notes.contains("2 STOP lines"), "{notes}");
    assert!(notes.contains("QMP GUEST_PANICKED reports bugcheck 0xC4"), "{notes}");
    assert!(notes.contains("device fault iommu_unmapped at t=10 µs (event log line 1)"), "{notes}");

    // The device fault is the verdict over a failed result, and the guest's own failure stays in the notes.
    let v = judge(&expect("device-fault iommu_unmapped"), &with_fault(clean(FAILED)));
    assert_eq!(v.outcome, Outcome::Pass);
    assert!(
        v.notes.iter().any(|n| n == "the guest's own checks failed as well: create_cq returned 0xC000009A"),
        "{:?}",
        v.notes
    );
    let v = judge(&expect("device-fault iommu_unmapped"), &with_fault(clean(OK)));
    assert!(!v.notes.iter().any(|n| n.contains("own checks")), "{:?}", v.notes);

    let v = judge(&expect("pass"), &timed_out(OK));
    assert!(v.notes.iter().any(|n| n.contains("timed the run out after 30 s")), "{:?}", v.notes);
}

#[test]
fn actual_serialises_with_hex_codes() {
    let v = judge(&expect("bugcheck 0xE6 0x26 * 0x0 0x0"), &clean(STOP_E6_26));
    let json = serde_json::to_value(&v).unwrap();
    assert_eq!(json["actual"]["kind"], "bugcheck");
    assert_eq!(json["actual"]["code"], "0xE6");
    assert_eq!(json["actual"]["params"][0], "0x26");
    assert_eq!(json["actual"]["name"], "DRIVER_VERIFIER_DMA_VIOLATION");
    assert_eq!(json["actual"]["source"], "serial");
    assert_eq!(json["outcome"]["result"], "pass");
}

#[test]
fn rig_problems_are_a_device_failure_above_everything_else() {
    let mut o = clean(&format!("{STOP_C4}{OK}"));
    o.rig_problems.push("command-queue descriptor at IOVA 0x1000+16: no IOTLB update from QEMU covers it".into());
    let v = judge(&expect("bugcheck 0xC4 0x33 0x1 0x0 0x0"), &o);
    assert_eq!(kind(&v.actual), "device-failure");
    assert!(v.actual.to_string().contains("no IOTLB update"), "{}", v.actual);
    assert!(!v.outcome.passed());
}

/// A concrete run of a one-run suite, with `events` as written in the file.
fn run_requiring(events: &str, expected: &str) -> vhca_suite::ConcreteRun {
    let text =
        format!("name = \"t\"\n[[run]]\nname = \"a\"\nmodes = [\"on\"]\nexpect = \"{expected}\"\nevents = {events}\n");
    vhca_suite::Suite::parse(&text, "t.toml").unwrap().expand().remove(0)
}

#[test]
fn required_events_fail_a_matching_run_and_note_a_failing_one() {
    let exhausted = r#"{"seq":3,"t_us":30,"kind":"map_registers_exhausted","owner":"mr","wanted":1,"free":0}"#;
    let run = run_requiring("[\"map_registers_exhausted\"]", "pass");
    let mut seen = clean(OK);
    seen.add_event_log(&parse_event_log(exhausted));
    assert!(seen.event_kinds.contains("map_registers_exhausted"));
    assert_eq!(vhca_suite::judge_run(&run, &seen).outcome, Outcome::Pass);

    let unseen = clean(OK);
    let v = vhca_suite::judge_run(&run, &unseen);
    match &v.outcome {
        Outcome::Fail { reason } => {
            assert!(reason.contains("got pass but") && reason.contains("map_registers_exhausted"), "{reason}")
        }
        Outcome::Pass => panic!("a run without its required event passed"),
    }

    // A run that fails for another reason keeps that reason; the missing kind is a note.
    let v = vhca_suite::judge_run(&run, &clean(FAILED));
    assert!(matches!(&v.outcome, Outcome::Fail { reason } if reason.contains("guest-failed")), "{:?}", v.outcome);
    assert!(v.notes.iter().any(|n| n.contains("map_registers_exhausted")), "{:?}", v.notes);

    // The off mode of `events = { on = [...] }` requires nothing.
    let text = "name = \"t\"\n[[run]]\nname = \"a\"\nexpect = \"pass\"\nevents = { on = [\"map\"] }\n";
    let runs = vhca_suite::Suite::parse(text, "t.toml").unwrap().expand();
    assert!(runs[0].events.is_empty());
    assert_eq!(runs[1].events, ["map"]);
    assert_eq!(vhca_suite::judge_run(&runs[0], &clean(OK)).outcome, Outcome::Pass);
    assert!(!vhca_suite::judge_run(&runs[1], &clean(OK)).outcome.passed());
}
