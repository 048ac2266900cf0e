//! The sandbox end to end: on by default (a whole RDMA WRITE runs under it, and the device says so), a forbidden
//! system call ends the device at once with exit 3 and a line naming the call, and `--no-sandbox` turns it off.

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
    assert!(
        stderr.contains(&format!("vhca-device: sandbox: forbidden system call {socket} (seccomp)")),
        "stderr lacks the violation line: {stderr}"
    );
    assert_eq!(events.first().map(|e| e["kind"].clone()), Some("start".into()));
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
