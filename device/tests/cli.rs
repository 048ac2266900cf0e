//! The command line's HCA knobs end to end: each reaches the model over the real socket, shows in the `start`
//! line, and a bad value stops the device with exit 2 before it creates its socket or event log.

mod common;

use std::process::Command;

use common::verbs::*;
use common::*;
use vhca_device::thread_sched;
use vhca_proto::status::WcStatus;
use vhca_proto::{Opcode, QueryDeviceResp, Status, ACCESS_ALL};
use zerocopy::FromBytes;

fn alloc_pd(s: &mut Session) -> u32 {
    handle_of(&s.command_ok(Opcode::AllocPd, &[], &[]))
}

#[test]
fn fail_reg_mr_fails_the_nth_registration() {
    let mut s = Session::start(&["--inject", "fail_reg_mr=2"], true);
    let pd = alloc_pd(&mut s);
    let statuses: Vec<Status> = (0..3).map(|_| s.reg_mr(pd, ACCESS_ALL, 1).0).collect();
    assert_eq!(statuses, vec![Status::Ok, Status::Injected, Status::Ok]);

    let (status, stderr, events) = s.close();
    assert!(status.success());
    assert!(stderr.contains("fault injection: fail_reg_mr=2"), "{stderr}");
    assert_eq!(events[0]["kind"], "start");
    assert_eq!(events[0]["injection"]["fail_reg_mr"], 2);
    let injected = kinds(&events, "injected");
    assert_eq!(injected.len(), 1);
    assert_eq!((injected[0]["what"].as_str(), injected[0]["n"].as_u64()), (Some("fail_reg_mr"), Some(2)));
}

#[test]
fn drop_completion_loses_the_nth_cqe_but_not_the_data() {
    let mut s = Session::start(&["--inject", "drop_completion=1"], true);
    let lb = s.loopback(1);
    let data = pattern(256, 8);
    s.ram.write(lb.src.off, &data);
    s.post_send(&lb, 0, &rdma_write_wqe(1, lb.src.addr, lb.src.key, 256, lb.dst.addr, lb.dst.key));
    assert!(s.cqe(&lb, 0).is_none(), "the first completion is dropped");
    assert_eq!(s.ram.read(lb.dst.off, 256), data, "the write itself happened");
    s.post_send(&lb, 1, &rdma_write_wqe(2, lb.src.addr, lb.src.key, 16, lb.dst.addr, lb.dst.key));
    let cqe = s.cqe(&lb, 0).expect("the second completion takes CQE index 0");
    assert_eq!((cqe.wr_id.get(), cqe_status(&cqe)), (2, WcStatus::Success));

    let (status, _stderr, events) = s.close();
    assert!(status.success());
    let injected = kinds(&events, "injected");
    assert_eq!((injected[0]["what"].as_str(), injected[0]["n"].as_u64()), (Some("drop_completion"), Some(1)));
}

#[test]
fn inject_config_file_and_flags_combine() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("inject.json");
    std::fs::write(&config, r#"{"fail_ring_map": 1, "fail_reg_mr": 1}"#).unwrap();
    let config = config.to_str().unwrap();
    // The flag overrides the file's fail_reg_mr; fail_ring_map stays from the file.
    let mut s = Session::start(&["--inject-config", config, "--inject", "fail_reg_mr=2"], true);
    let body = create_cq_body(64, 1);
    let cq_off = s.alloc(1);
    let (status, _) = s.command(Opcode::CreateCq, &body, &Session::page_list(cq_off, 1));
    assert_eq!(status, Status::Injected, "the first ring mapping fails");
    let (status, _) = s.command(Opcode::CreateCq, &body, &Session::page_list(cq_off, 1));
    assert_eq!(status, Status::Ok);
    let pd = alloc_pd(&mut s);
    assert_eq!(s.reg_mr(pd, ACCESS_ALL, 1).0, Status::Ok);
    assert_eq!(s.reg_mr(pd, ACCESS_ALL, 1).0, Status::Injected);

    let (status, _stderr, events) = s.close();
    assert!(status.success());
    assert_eq!(events[0]["injection"]["fail_ring_map"], 1);
    assert_eq!(events[0]["injection"]["fail_reg_mr"], 2);
}

#[test]
fn limits_and_probe_pages_reach_the_model() {
    let mut s =
        Session::start(&["--max-mr", "1", "--map-registers", "8", "--probe-pages", "--miss-timeout-ms", "100"], true);
    let pd = alloc_pd(&mut s);
    let resp = QueryDeviceResp::read_from_bytes(&s.command_ok(Opcode::QueryDevice, &[], &[])).unwrap();
    assert_eq!((resp.max_mr.get(), resp.map_registers_total.get()), (1, 8));
    // probe_pages: a page QEMU no longer maps fails the registration itself, not a later work request.
    let off = s.alloc(1);
    s.iotlb(IOTLB_INVALIDATE, IOVA + off, PAGE, 0, 0);
    let body = reg_mr_body(pd, ACCESS_ALL, MR_ADDR_BASE, PAGE, 1);
    assert_eq!(s.command(Opcode::RegMr, &body, &Session::page_list(off, 1)).0, Status::IommuFault);
    assert_eq!(s.reg_mr(pd, ACCESS_ALL, 1).0, Status::Ok);
    assert_eq!(s.reg_mr(pd, ACCESS_ALL, 1).0, Status::NoResources, "--max-mr 1");

    let (status, _stderr, events) = s.close();
    assert!(status.success());
    let start = &events[0];
    assert_eq!((start["max_mr"].as_u64(), start["map_registers"].as_u64()), (Some(1), Some(8)));
    assert_eq!((start["probe_pages"].as_bool(), start["revalidate_stale"].as_bool()), (Some(true), Some(false)));
    assert_eq!(start["miss_timeout_ms"], 100);
    assert!(kinds(&events, "fault").iter().any(|f| f["purpose"] == "page_probe"));
}

/// Runs the device with `args`; it must refuse them at once: exit 2, stderr naming `needle`, no files created.
fn expect_usage_error(args: &[&str], needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vhca.sock");
    let log = dir.path().join("events.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_vhca-device"))
        .arg("--socket-path")
        .arg(&socket)
        .arg("--event-log")
        .arg(&log)
        .args(args)
        .output()
        .expect("run vhca-device");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(needle), "{args:?}: stderr lacks {needle:?}: {stderr}");
    assert!(!socket.exists() && !log.exists(), "{args:?}: nothing may be created before the arguments are checked");
}

#[test]
fn bad_values_exit_2_naming_flag_and_value() {
    expect_usage_error(
        &["--inject", "fail_reg_mr=x"],
        "--inject fail_reg_mr=x: injection fail_reg_mr: 'x' is not a number",
    );
    expect_usage_error(
        &["--inject", "fail_reg_mr=0"],
        "--inject fail_reg_mr=0: injection fail_reg_mr: counts are 1-based",
    );
    expect_usage_error(&["--inject", "bogus=1"], "--inject bogus=1: unknown injection key 'bogus'");
    expect_usage_error(
        &["--inject", "drop_completion"],
        "--inject drop_completion: injection 'drop_completion' is not KEY=VALUE",
    );
    expect_usage_error(&["--inject", "contiguous_policy=maybe"], "--inject contiguous_policy=maybe");
    expect_usage_error(
        &["--inject-config", "/nonexistent/inject.json"],
        "--inject-config /nonexistent/inject.json: cannot read",
    );
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"fail_reg_mr": 1, "typo_knob": 3}"#).unwrap();
    expect_usage_error(&["--inject-config", bad.to_str().unwrap()], "unknown field `typo_knob`");
    expect_usage_error(&["--map-registers", "0"], "'--map-registers <MAP_REGISTERS>'");
    expect_usage_error(&["--map-registers", "2000000"], "2000000");
    expect_usage_error(&["--max-mr", "lots"], "--max-mr");
    expect_usage_error(&["--miss-timeout-ms", "99999999999"], "--miss-timeout-ms");
    expect_usage_error(&["--thread-slice-us", "100001"], "--thread-slice-us");
}

/// The slice of each of `pid`'s threads named in `names` (each must exist once), read from outside
/// (`thread_sched::slice_of`), and that of its main thread.
fn thread_slices(pid: u32, names: &[&str]) -> (Vec<(String, u64)>, u64) {
    let slice_of = |tid: i32| thread_sched::slice_of(tid).unwrap().as_nanos() as u64;
    let mut found: Vec<(String, u64)> =
        names.iter().map(|name| (name.to_string(), slice_of(thread_id(pid, name) as i32))).collect();
    found.sort();
    (found, slice_of(pid as i32))
}

/// The thread id of `pid`'s only thread called `name`.
fn thread_id(pid: u32, name: &str) -> u32 {
    let ids: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map(|task| task.unwrap().path())
        .filter(|task| std::fs::read_to_string(task.join("comm")).unwrap().trim() == name)
        .map(|task| task.file_name().unwrap().to_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(ids.len(), 1, "threads called {name}: {ids:?}");
    ids[0]
}

/// The queue worker and the IOTLB reply reader run with the slice asked for, in the real binary with its sandbox
/// on (the request is made before the seccomp filter, which forbids it); 0 leaves the kernel's default. The event
/// log's writer runs ten nicer than the process either way.
#[test]
fn the_device_threads_run_with_the_scheduler_slice_asked_for() {
    let names = ["vhca-queues", "vhca-replies"];
    for (flags, slice_ns) in [
        (&[][..], Some(100_000)),
        (&["--thread-slice-us", "2500"][..], Some(2_500_000)),
        (&["--thread-slice-us", "0"][..], None),
    ] {
        let mut s = Session::start(flags, true);
        s.command_ok(Opcode::QueryDevice, &[], &[]);
        let (threads, main_thread) = thread_slices(s.device.child.id(), &names);
        if thread_sched::kernel_grants_slices() {
            let want = slice_ns.unwrap_or(main_thread);
            for (name, slice) in &threads {
                assert_eq!(*slice, want, "{flags:?}: {name}");
            }
            if slice_ns.is_some() {
                assert_ne!(main_thread, 100_000, "the main thread keeps the kernel's default");
            }
        }
        let pid = s.device.child.id();
        let writer = thread_id(pid, "event-log");
        // SAFETY: getpriority only reads the nice values of the child this test started and of one of its threads.
        let (writer_nice, main_nice) =
            unsafe { (libc::getpriority(libc::PRIO_PROCESS, writer), libc::getpriority(libc::PRIO_PROCESS, pid)) };
        assert_eq!(writer_nice, (main_nice + 10).min(19), "{flags:?}: the event log's writer runs ten nicer");
        let (status, stderr, _) = s.close();
        assert!(status.success(), "{flags:?}: {stderr}");
        assert!(!stderr.contains("refused") && !stderr.contains("cannot lower"), "{flags:?}: {stderr}");
    }
}

/// The event log is buffered, but a device told to stop (SIGTERM) writes every line first: here the `start` and
/// `connected` lines, which no flush point had written yet (nothing after them within the flush interval).
#[test]
fn sigterm_flushes_the_buffered_event_log() {
    use std::os::unix::process::ExitStatusExt;
    let mut device = Device::spawn(&[]);
    let stream = device.connect();
    // `connected` is logged right after accept; give the device that moment, well inside the 20 ms flush window.
    std::thread::sleep(std::time::Duration::from_millis(5));
    // SAFETY: kill(2) on the child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(device.child.id() as i32, libc::SIGTERM) }, 0);
    let status = device.child.wait().unwrap();
    drop(stream);
    assert_eq!(status.signal(), Some(libc::SIGTERM), "the signal's default action still ends the device");
    let text = std::fs::read_to_string(&device.log).unwrap();
    let events: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["kind"].as_str()).collect();
    assert_eq!(kinds.first(), Some(&"start"), "{kinds:?}");
    assert!(kinds.contains(&"connected"), "{kinds:?}");
}
