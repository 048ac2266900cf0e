//! Suite files (TOML a user writes, or a CI job generates) through vhca-suite's public API: parse, expand into
//! concrete runs, and everything the runner derives from a run. Never panics; an expectation that parsed prints
//! back to itself.

use vhca_suite::{Expected, Suite};

/// One input: never panics, and the checks below hold.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(suite) = Suite::parse(text, "fuzz.toml") else { return };
    let _ = suite.unknown_scenarios(&["smoke", "verbs"]);
    let _ = suite.expand_filtered("a.*");
    for run in suite.expand() {
        let printed = run.expected.to_string();
        assert_eq!(Expected::parse(&printed).as_ref(), Ok(&run.expected), "{printed:?} does not read back");
        let _ = (run.guest_params(), run.device_args());
    }
}
