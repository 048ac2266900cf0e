//! The sandbox end to end: on by default (a whole RDMA WRITE runs under it, and the device says so), a forbidden
//! system call ends the device at once with exit 3 and a line naming the call and where it was made, an open is
//! refused with EPERM and the device goes on serving, and `--no-sandbox` turns it off.

mod common;

use common::*;
use vhca_proto::Opcode;

#[test]
fn on_by_default_and_the_data_path_runs_under_it() {
    let mut s = Session::start(&[], true);
    let lb = s.loopback(1);
    s.command_ok(Opcode::QueryDevice, &[], &[]);
    assert!(lb.qpn != 0);
    let (status, stderr, _) = s.close();
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("sandbox on:"), "{stderr}");
    assert!(!stderr.contains("forbidden system call"), "{stderr}");
}

#[test]
fn a_forbidden_system_call_ends_the_device_with_a_line_naming_it() {
    let device = Device::spawn(&["--debug-forbidden-syscall"]);
    let _stream = device.connect();
    let (status, stderr, events) = device.finish();
    assert_eq!(status.code(), Some(3), "{stderr}");
    let socket = libc::SYS_socket;
    let line = stderr
        .lines()
        .find(|l| l.starts_with(&format!("vhca-device: sandbox: forbidden system call {socket} at 0x")))
        .unwrap_or_else(|| panic!("stderr lacks the violation line: {stderr}"));
    assert!(line.contains("(on_forbidden_syscall 0x") && line.contains(", libc write 0x"), "{line}");
    assert!(line.ends_with("(seccomp); exiting. Run with --no-sandbox to debug."), "{line}");
    assert_eq!(events.first().map(|e| e["kind"].clone()), Some("start".into()));
}

#[test]
fn an_open_is_refused_with_eperm_and_the_device_goes_on_serving() {
    let mut s = Session::start(&["--debug-refused-open"], true);
    // The refusal happened at lockdown, before any of this: the data path still runs.
    let lb = s.loopback(1);
    s.command_ok(Opcode::QueryDevice, &[], &[]);
    assert!(lb.qpn != 0);
    let (status, stderr, _) = s.close();
    assert!(status.success(), "{stderr}");
    let openat = libc::SYS_openat;
    let line = stderr
        .lines()
        .find(|l| l.starts_with(&format!("vhca-device: sandbox: refused system call {openat} at 0x")))
        .unwrap_or_else(|| panic!("stderr lacks the refusal line: {stderr}"));
    let (_, stack) = line.split_once("it returned EPERM, going on; stack").unwrap_or_else(|| panic!("{line}"));
    // The interrupted stack's first words, each in hex: what places the open's callers afterwards.
    assert_eq!(stack.split_whitespace().filter(|w| w.starts_with("0x")).count(), 12, "{line}");
    assert!(stderr.contains("debug: the open was refused: Operation not permitted"), "{stderr}");
    assert!(!stderr.contains("forbidden system call"), "{stderr}");
}

#[test]
fn no_sandbox_lets_the_same_call_through() {
    let device = Device::spawn(&["--no-sandbox", "--debug-forbidden-syscall"]);
    let stream = device.connect();
    drop(stream);
    let (status, stderr, _) = device.finish();
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("sandbox off (--no-sandbox)"), "{stderr}");
    assert!(!stderr.contains("forbidden system call"), "{stderr}");
}
