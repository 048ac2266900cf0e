//! vhca-run: boots guests against vhca-device under QEMU, runs scenarios and gives verdicts.
//! Each module has one job; `main.rs` is the CLI and `ui` the only place that formats output.

pub mod accel;
pub mod device;
pub mod events;
pub mod image;
pub mod outcome;
pub mod paths;
pub mod qemu_cmd;
pub mod qmp;
pub mod run;
pub mod serial;
pub mod suite;
pub mod supervise;
pub mod ui;
pub mod verdict;
