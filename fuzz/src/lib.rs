//! Fuzz harnesses over everything a guest or QEMU controls: the vhost-user connection, the HCA behind the real
//! IOTLB, and the runner's parsers of guest-controlled text. Each `run(data)` panics only on a broken invariant.

pub mod event_log;
pub mod hca_commands;
pub mod ioctl_dispatch;
pub mod qmp_events;
pub mod seeds;
pub mod serial_console;
pub mod suite_file;
pub mod vhost_user_connection;

/// A harness: one input in, a panic only on a broken invariant.
pub type Harness = fn(&[u8]);

/// The targets, by the names `cargo fuzz` and the corpus directories use.
pub const TARGETS: &[(&str, Harness)] = &[
    ("vhost_user_connection", vhost_user_connection::run),
    ("hca_commands", hca_commands::run),
    ("serial_console", serial_console::run),
    ("qmp_events", qmp_events::run),
    ("event_log", event_log::run),
    ("suite_file", suite_file::run),
    ("ioctl_dispatch", ioctl_dispatch::run),
];
