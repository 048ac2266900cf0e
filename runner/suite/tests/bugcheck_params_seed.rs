//! Every bugcheck the seed suite expects has its parameters named in reports: a meaning for its code and, where P1
//! selects the check that fired, that check's row. A code or subcode the rig starts raising without a row fails here.

use vhca_ntapi::{
    DPC_WATCHDOG_VIOLATION, DRIVER_VERIFIER_DETECTED_VIOLATION, DRIVER_VERIFIER_DMA_VIOLATION,
    DRIVER_VERIFIER_IOMANAGER_VIOLATION, TIMER_OR_DPC_INVALID, WORKER_INVALID,
};
use vhca_suite::{bugcheck_meaning, Expected, Param, Suite};

/// Codes whose P1 selects the check, so an expectation must name P1 and the check must have a row. Listed here,
/// not asked of the table, so that a code dropped from the table's selectors fails too.
const P1_SELECTS: [u32; 6] = [
    DRIVER_VERIFIER_DETECTED_VIOLATION,
    DRIVER_VERIFIER_DMA_VIOLATION,
    DRIVER_VERIFIER_IOMANAGER_VIOLATION,
    DPC_WATCHDOG_VIOLATION,
    TIMER_OR_DPC_INVALID,
    WORKER_INVALID,
];

/// What is missing for one expected bugcheck, or None when its parameters are all named as far as they can be.
fn missing(code: u32, p1: &Param) -> Option<String> {
    let p1 = match p1 {
        Param::Is(v) => Some(*v),
        Param::Any => None,
    };
    let meaning = bugcheck_meaning(code, p1);
    if meaning.params.iter().all(Option::is_none) {
        return Some(format!("no meaning for code {code:#X}"));
    }
    if P1_SELECTS.contains(&code) {
        let Some(p1) = p1 else {
            return Some(format!("code {code:#X} with P1 '*': its rule cannot be named"));
        };
        if meaning.rule.is_none() {
            return Some(format!("no rule for {code:#X}/{p1:#X}"));
        }
        if meaning.params[1..].iter().all(Option::is_none) && !takes_no_parameters(code, p1) {
            return Some(format!("rule {code:#X}/{p1:#X} names none of P2..P4"));
        }
    }
    None
}

/// Rules whose P2..P4 Windows leaves unused, so an empty row is right for them.
fn takes_no_parameters(code: u32, p1: u64) -> bool {
    matches!(
        (code, p1),
        (DRIVER_VERIFIER_DMA_VIOLATION, 0x14 | 0x21 | 0x25) | (DRIVER_VERIFIER_DETECTED_VIOLATION, 0x3E)
    )
}

#[test]
fn every_seed_bugcheck_has_its_code_and_rule_named() {
    let suite = Suite::seed().expect("the seed suite parses");
    let mut expected = Vec::new();
    for run in &suite.runs {
        for (mode, e) in &run.expect {
            if let Expected::Bugcheck { code, params } = e {
                expected.push((format!("{} ({})", run.name, mode.as_str()), *code, params[0]));
            }
        }
    }
    // The seed's interrupt, DMA and I/O scenarios expect bugchecks; none found means the walk above is wrong.
    let codes: Vec<u32> = expected.iter().map(|(_, c, _)| *c).collect();
    for code in [DRIVER_VERIFIER_DETECTED_VIOLATION, DRIVER_VERIFIER_DMA_VIOLATION, DPC_WATCHDOG_VIOLATION] {
        assert!(codes.contains(&code), "the seed suite expects no {code:#X} any more: {codes:X?}");
    }
    let gaps: Vec<String> =
        expected.iter().filter_map(|(run, code, p1)| missing(*code, p1).map(|m| format!("{run}: {m}"))).collect();
    assert!(gaps.is_empty(), "bugcheck_params.rs lacks rows the seed suite needs:\n{}", gaps.join("\n"));
}

#[test]
fn the_check_tells_a_missing_row_from_a_present_one() {
    // A code and subcodes nobody raises are reported missing, so the seed test above can fail.
    assert!(missing(0xABCD, &Param::Is(0)).is_some());
    assert!(missing(DRIVER_VERIFIER_DETECTED_VIOLATION, &Param::Is(0xFFFF)).is_some());
    assert!(missing(DRIVER_VERIFIER_IOMANAGER_VIOLATION, &Param::Is(0x999)).is_some());
    assert!(missing(DPC_WATCHDOG_VIOLATION, &Param::Any).is_some());
    // Rows the rig raises, each form of the selector codes included.
    for (code, p1) in [
        (DRIVER_VERIFIER_DETECTED_VIOLATION, 0x40),
        (DRIVER_VERIFIER_DETECTED_VIOLATION, 0x111),
        (DRIVER_VERIFIER_DETECTED_VIOLATION, 0x122),
        (DRIVER_VERIFIER_DETECTED_VIOLATION, 0x1002),
        (DRIVER_VERIFIER_DETECTED_VIOLATION, vhca_ntmodel::pool_types::C4_EXECUTABLE_POOL),
        (DRIVER_VERIFIER_DMA_VIOLATION, 0x25),
        (DRIVER_VERIFIER_IOMANAGER_VIOLATION, 0x07),
        (DRIVER_VERIFIER_IOMANAGER_VIOLATION, 0x23D),
        (DPC_WATCHDOG_VIOLATION, 0x0),
        (DPC_WATCHDOG_VIOLATION, 0x1),
        (TIMER_OR_DPC_INVALID, 0x2),
        (WORKER_INVALID, 0x2),
    ] {
        assert_eq!(missing(code, &Param::Is(p1)), None, "{code:#X}/{p1:#X}");
    }
    for code in [0x35, 0x44, 0xB8, 0xD4, 0xD6, 0xCD, 0xD5, 0xCC, 0xC1] {
        assert_eq!(missing(code, &Param::Any), None, "{code:#X}");
    }
}
