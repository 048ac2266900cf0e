//! vhca-run: boots guests against vhca-device under QEMU, runs suites and gives verdicts. What a run showed is judged
//! by vhca-suite; this crate starts, watches and stops processes, gathers evidence and shows progress.

pub mod accel;
pub mod artifacts;
pub mod bench;
pub mod cache_in_use;
pub mod debug_instructions;
pub mod device;
pub mod evidence;
pub mod finished_runs;
pub mod image;
pub mod leftovers;
pub mod paths;
pub mod phase_hook;
pub mod proc_usage;
pub mod qemu_cmd;
pub mod qmp;
pub mod restore;
pub mod run;
pub mod serial_capture;
pub mod snapshot;
pub mod soak;
pub mod suite_run;
pub mod supervise;
pub mod ui;
pub mod warm_guest;
pub mod windows_guest;
