//! The runner's reading of guest serial output (untrusted: the guest writes it, a kill may cut it anywhere):
//! result lines, STOP lines, Linux panics, and the verdict judged from them. Never panics; what it finds is
//! consistent with a line-by-line reading.

use vhca_suite::{judge, parse_bugcheck, parse_linux_panic, parse_result_line, scan_serial, Expected, Observation};

/// One input: never panics, and the checks below hold.
pub fn run(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let found = scan_serial(&text);
    let lines = text.lines().count();
    for result in &found.results {
        assert!(result.line >= 1 && result.line <= lines, "result line {} of {lines}", result.line);
        if let Ok(value) = &result.parsed {
            assert!(value.is_object(), "a result that is not an object was accepted");
        }
    }
    // The Linux panics scan_serial reports are the panic lines in order, except where a line is a result that parses
    // or a STOP line: a panic cutting into a result line that then fails to parse still counts.
    let panics: Vec<_> = text
        .lines()
        .filter(|line| match parse_result_line(line) {
            Some(parsed) => parsed.is_err(),
            None => parse_bugcheck(line).is_none(),
        })
        .filter_map(parse_linux_panic)
        .collect();
    assert_eq!(found.panics, panics, "scan_serial and parse_linux_panic disagree");
    let results = text.lines().filter_map(parse_result_line).count();
    assert_eq!(found.results.len(), results, "scan_serial and parse_result_line disagree");
    for line in text.lines() {
        if let Some(bugcheck) = parse_bugcheck(line) {
            let _ = bugcheck.param1();
        }
    }
    let mut observation = Observation::default();
    observation.add_serial(&text);
    for expected in ["pass", "bugcheck 0xE6 0x13 0x1 0x0 0x1", "bugcheck 0xE6 0x26 * * 0x5", "guest-panic", "hang"] {
        let expected = Expected::parse(expected).expect("a valid expectation");
        let verdict = judge(&expected, &observation);
        let _ = format!("{verdict:?}");
    }
}
