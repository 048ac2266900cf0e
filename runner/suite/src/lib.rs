//! The pure logic of vhca-run's suites: suite files, what a finished run showed, verdicts, reports and timelines.
//! Nothing here starts processes or prints; the runner fills an `Observation`, this crate judges and renders.

mod event_log_reader;
mod expect;
mod iotlb;
mod junit;
mod observation;
mod report;
mod serial_scan;
mod stop_line;
mod suite;
mod suite_file;
mod table;
mod timeline;
mod toml_location;
mod verdict;
mod xml_text;

pub use event_log_reader::{parse_event_log, DeviceFault, EventLog, LogEvent, LogLineError};
pub use expect::{fault_cause_names, ExpectParseError, Expected, Param};
pub use iotlb::{iotlb_problems, COMMAND_QUEUE};
pub use junit::render_junit;
pub use observation::{GuestPanicked, HyperVCrash, Observation, ProcessExit};
pub use report::{reproducer, BootPath, RunReport, SuiteReport, Totals};
pub use serial_scan::{
    parse_linux_panic, parse_result_line, scan_serial, LinuxPanic, PanicKind, ResultLine, SerialFindings,
};
pub use stop_line::{bugcheck_name, parse_bugcheck, Bugcheck};
pub use suite::{
    ConcreteRun, DeviceOptions, DriverKind, GuestOptions, LockKind, Suite, SuiteRun, VerifierMode, DEFAULT_SILENCE_S,
    DEFAULT_TIMEOUT_S, DEFAULT_VERIFIER_FLAGS,
};
pub use suite_file::{Problem, SuiteError, SEED_SUITE, SEED_SUITE_NAME};
pub use table::render_table;
pub use timeline::render_timeline;
pub use verdict::{judge, judge_run, Actual, Outcome, Verdict};
