//! The pure logic of vhca-run's suites: suite files, what a finished run showed, verdicts, reports and timelines.
//! Nothing here starts processes or prints; the runner fills an `Observation`, this crate judges and renders.

mod bugcheck_params;
mod completion_seen;
mod event_log_reader;
mod expect;
mod fail_points;
mod interleavings;
mod iotlb;
mod junit;
mod observation;
mod report;
mod report_html;
mod report_merge;
mod report_page;
mod serial_scan;
mod shard;
mod stop_line;
mod suite;
mod suite_file;
mod svg_inline;
mod table;
mod timeline;
mod toml_location;
mod verdict;
mod xml_text;

pub use bugcheck_params::{bugcheck_meaning, BugcheckMeaning};
pub use completion_seen::{completion_seen, path_marks, CompletionSeen, PathMarks};
pub use event_log_reader::{parse_event_log, DeviceFault, EventLog, LogEvent, LogLineError};
pub use expect::{fault_cause_names, ExpectParseError, Expected, Param};
pub use fail_points::{
    expand_recording, fault_points, injected_faults, judge_fail_point, FaultPointSeen, InjectedFaultSeen,
};
pub use interleavings::{
    expand_interleavings, judge_interleaving, races, reachable_points, schedule_points, schedule_points_dropped,
    schedule_points_passed, spec_suffix, unreached_timing_counted_points, Expanded, Expansion, InterleavingPlan,
    InterleavingsScope, RaceSeen, RunInterleaving, SchedulePointSeen, DEFAULT_MAX_INTERLEAVINGS, INTERLEAVING_INFIX,
    PCT_INFIX,
};
pub use iotlb::{iotlb_problems, COMMAND_QUEUE};
pub use junit::render_junit;
pub use observation::{GuestPanicked, HyperVCrash, Observation, ProcessExit};
pub use report::{fail_point_reproducer, reproducer, BootPath, RunReport, SuiteReport, Totals};
pub use report_html::{render_report_html, RunArtifacts};
pub use report_merge::{merge_json, merge_junit, MergeError, Merged};
pub use report_page::{write_report_html, REPORT_HTML};
pub use serial_scan::{
    parse_linux_panic, parse_result_line, scan_serial, LinuxPanic, PanicKind, ResultLine, SerialFindings,
};
pub use shard::{durations_from_report, shard_runs, Shard, ShardParseError};
pub use stop_line::{bugcheck_name, parse_bugcheck, Bugcheck};
pub use suite::{
    split_fail_point, ConcreteRun, DeviceOptions, GuestKind, GuestOptions, LockKind, Personality, Suite, SuiteRun,
    VerifierMode, DEFAULT_SILENCE_S, DEFAULT_TIMEOUT_S, DEFAULT_VERIFIER_FLAGS, FAIL_POINT_INFIX,
    SYSTEMATIC_LOW_RESOURCES,
};
pub use suite_file::{Problem, SuiteError, SEED_SUITE, SEED_SUITE_NAME};
pub use table::render_table;
pub use timeline::{render_timeline, render_timeline_with};
pub use verdict::{judge, judge_run, Actual, Outcome, Verdict};
