//! Used-buffer notifications of the real device binary: a call eventfd write per pass that used a queue's buffers
//! when its driver wants one (none when it set VRING_AVAIL_F_NO_INTERRUPT), each one a `notify` line naming its
//! cause; the per-queue bound that a doorbell storm meets; and the hold_completion knob's late completion.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use common::verbs::*;
use common::*;
use vhca_proto::status::WcStatus;
use vhca_proto::{DoorbellKind, FaultCause, Opcode};

/// VRING_AVAIL_F_NO_INTERRUPT (virtio 1.2, 2.7.7).
const NO_INTERRUPT: u16 = 1;

/// How many times the device wrote `call` since the last read (an eventfd adds each write to its counter).
fn calls_since(call: &OwnedFd) -> u64 {
    let mut value = [0u8; 8];
    // SAFETY: reads 8 bytes into a live buffer from our non-blocking eventfd; EAGAIN (nothing written) returns -1.
    let n = unsafe { libc::read(call.as_raw_fd(), value.as_mut_ptr().cast(), 8) };
    if n == 8 {
        u64::from_ne_bytes(value)
    } else {
        0
    }
}

/// Waits up to `timeout` for `call` to be written; the count.
fn wait_calls(call: &OwnedFd, timeout: Duration) -> u64 {
    let mut fd = libc::pollfd { fd: call.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut fd, 1, timeout.as_millis() as i32) };
    calls_since(call)
}

fn notify_lines(events: &[serde_json::Value], queue: u64) -> Vec<&serde_json::Value> {
    kinds(events, "notify").into_iter().filter(|l| l["queue"] == queue).collect()
}

/// Publishes one doorbell chain without waiting for a call: the storm's driver polls the used index instead.
fn ring_polled(s: &mut Session, slot: u16, records: &[u8]) {
    let off = buf_off(2, 0);
    s.ram.write(off, records);
    s.ram.set_desc(2, 0, IOVA + off, records.len() as u32, 0, 0);
    s.ram.publish(2, slot, 0);
    signal(&s.kicks[2]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.ram.used_idx(2) != slot.wrapping_add(1) {
        assert!(Instant::now() < deadline, "doorbell chain {slot} never used");
        std::hint::spin_loop();
    }
}

#[test]
fn each_notification_is_a_line_with_its_cause_and_a_declining_driver_gets_none() {
    let mut s = Session::start(&[], true);
    s.post_event_buffers(2);
    let lb = s.loopback(1);
    s.ring(&doorbell(DoorbellKind::CqArm, lb.cq, 0, 0));
    s.post_send(&lb, 0, &rdma_write_wqe(0x61, lb.src.addr, lb.src.key, 64, lb.dst.addr, lb.dst.key));
    s.wait_events(1);
    calls_since(&s.calls[0]);

    // The driver declines interrupts on the command queue: its commands are served without a call.
    s.ram.write_u16(avail_off(0), NO_INTERRUPT);
    let declined_tag = s.next_tag;
    let slot = s.next_slot[0];
    s.next_slot[0] += 1;
    s.next_tag += 1;
    s.post_query_device(slot, 0, declined_tag, 256);
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.ram.used_idx(0) != slot.wrapping_add(1) {
        assert!(Instant::now() < deadline, "the declined command was never served");
        std::hint::spin_loop();
    }
    assert_eq!(wait_calls(&s.calls[0], Duration::from_millis(50)), 0, "a call though the driver declined it");
    s.ram.write_u16(avail_off(0), 0);
    s.command_ok(Opcode::QueryDevice, &[], &[]);

    let (status, stderr, events) = s.close();
    assert!(status.success(), "{stderr}");
    let commands = kinds(&events, "command").len();
    let on_queue0 = notify_lines(&events, 0);
    assert_eq!(on_queue0.len(), commands - 1, "one per command but the declined one: {on_queue0:?}");
    assert!(on_queue0.iter().all(|l| l["cause"] == "used_buffer" && l["buffers"] == 1 && l.get("cq").is_none()));
    let doorbells = notify_lines(&events, 2);
    assert_eq!(doorbells.len(), 2, "the CQ arm and the SQ doorbell: {doorbells:?}");
    let cq_event = notify_lines(&events, 1);
    assert_eq!(cq_event.len(), 1, "{cq_event:?}");
    assert_eq!((cq_event[0]["cause"].as_str(), cq_event[0]["cq"].as_u64()), (Some("cq_event"), Some(u64::from(lb.cq))));
    assert!(kinds(&events, "notify_bounded").is_empty(), "a paced driver never meets the bound");
    assert_eq!(events[0]["max_notifications_per_ms"], 256, "the start line carries the bound");
}

#[test]
fn a_doorbell_storm_meets_the_bound_and_loses_no_notification() {
    const CHAINS: u16 = 300;
    let mut s = Session::start(&["--max-notifications-per-ms", "2"], true);
    let lb = s.loopback(1);
    calls_since(&s.calls[2]);
    let start = Instant::now();
    for i in 0..CHAINS {
        let slot = s.next_slot[2];
        s.next_slot[2] += 1;
        ring_polled(&mut s, slot, &doorbell(DoorbellKind::CqArm, lb.cq, u32::from(i), 0));
        // Long enough for the worker to find the ring empty and end its pass: one chain, one pass, one
        // notification wanted (chains published back to back are served in one pass and notified once).
        let gap = Instant::now() + Duration::from_micros(40);
        while Instant::now() < gap {
            std::hint::spin_loop();
        }
    }
    let elapsed = start.elapsed();
    let during = calls_since(&s.calls[2]);
    // The burst of 2, then one a half millisecond (the bound's spacing), and one just due.
    let allowed = 2 + 2 * elapsed.as_millis() as u64 + 2;
    assert!(during <= allowed, "{during} calls for {CHAINS} chains in {elapsed:?}; the bound allows {allowed}");
    assert!(during < u64::from(CHAINS) / 2, "the bound never engaged: {during} calls");
    // The notification held back (if the last chain met the bound) comes within the bound's spacing.
    assert!(wait_calls(&s.calls[2], Duration::from_millis(100)) <= 1, "one coalesced notification at most");
    s.command_ok(Opcode::QueryDevice, &[], &[]);

    let (status, stderr, events) = s.close();
    assert!(status.success(), "{stderr}");
    let lines = notify_lines(&events, 2);
    let buffers: u64 = lines.iter().map(|l| l["buffers"].as_u64().unwrap()).sum();
    // The loopback set-up rang no doorbell: every buffer of queue 2 is the storm's.
    assert_eq!(buffers, u64::from(CHAINS), "every used buffer is told of by some notification");
    assert!(
        lines.iter().any(|l| l["coalesced"].as_u64() >= Some(2)),
        "no notification stood for held-back ones: {lines:?}"
    );
    // (The set-up's commands meet the tiny bound too, on queue 0.)
    let bounded: Vec<_> = kinds(&events, "notify_bounded").into_iter().filter(|l| l["queue"] == 2).collect();
    assert!(
        !bounded.is_empty() && bounded.iter().all(|l| l["queue"] == 2 && l["limit"] == 2 && l["window_us"] == 1000)
    );
    // One line per engagement, not per notification held back. How often the bound engages depends on the host's
    // scheduling (a storm thread descheduled past the bound's spacing lets the next notification out at once, which
    // ends the engagement), so the check is relative: each engagement follows a notification that went out, and the
    // lines are far fewer than the notifications they stand for (CI under load once saw 21 engagements here).
    let sent = lines.len() as u64;
    let held_back = u64::from(CHAINS).saturating_sub(sent);
    assert!(
        bounded.len() as u64 <= sent && (bounded.len() as u64) * 4 < held_back,
        "one line per engagement, not per notification held back: {} lines, {sent} notifications, {held_back} held back",
        bounded.len()
    );
}

#[test]
fn a_held_completion_arrives_late_while_the_other_queues_are_served() {
    const HOLD_MS: u64 = 300;
    let mut s = Session::start(&["--inject", "hold_completion_ms=300"], true);
    s.post_event_buffers(2);
    let lb = s.loopback(1);
    let data = pattern(256, 5);
    s.ram.write(lb.src.off, &data);
    s.ring(&doorbell(DoorbellKind::CqArm, lb.cq, 0, 0));
    let posted = Instant::now();
    s.post_send(&lb, 0, &rdma_write_wqe(0x71, lb.src.addr, lb.src.key, 256, lb.dst.addr, lb.dst.key));
    // Commands go on while the request is held.
    for _ in 0..5 {
        s.command_ok(Opcode::QueryDevice, &[], &[]);
    }
    let served_in = posted.elapsed();
    assert!(served_in < Duration::from_millis(HOLD_MS), "commands waited for the hold: {served_in:?}");
    assert!(s.cqe(&lb, 0).is_none(), "completed within the hold");
    assert_eq!(s.ram.read(lb.dst.off, 256), vec![0u8; 256], "written within the hold");

    s.wait_events(1);
    assert!(posted.elapsed() >= Duration::from_millis(HOLD_MS), "released early: {:?}", posted.elapsed());
    let cqe = s.cqe(&lb, 0).expect("the late CQE");
    assert_eq!((cqe.wr_id.get(), cqe_status(&cqe)), (0x71, WcStatus::Success));
    assert_eq!(s.ram.read(lb.dst.off, 256), data);

    let (status, stderr, events) = s.close();
    assert!(status.success(), "{stderr}");
    let held: Vec<_> = kinds(&events, "injected").into_iter().filter(|l| l["what"] == "hold_completion").collect();
    let released = kinds(&events, "hold_released");
    assert_eq!((held.len(), released.len()), (1, 1), "{held:?} {released:?}");
    assert_eq!(released[0]["reason"], "timer");
    let held_us = released[0]["t_us"].as_u64().unwrap() - held[0]["t_us"].as_u64().unwrap();
    assert!(held_us >= HOLD_MS * 1000, "held {held_us} µs");
    assert_eq!(notify_lines(&events, 1).len(), 1, "the late CQ event is notified");
}

#[test]
fn a_late_dma_into_pages_unmapped_meanwhile_is_refused_with_its_cause() {
    let mut s =
        Session::start(&["--inject", "hold_completion_ms=200", "--revalidate-stale", "--miss-timeout-ms", "100"], true);
    s.post_event_buffers(4);
    let lb = s.loopback(1);
    s.post_send(&lb, 0, &rdma_write_wqe(0x72, lb.src.addr, lb.src.key, 64, lb.dst.addr, lb.dst.key));
    // The driver timed out and unmapped the destination: QEMU's invalidation reaches the device.
    s.iotlb(IOTLB_INVALIDATE, IOVA + lb.dst.off, PAGE, 0, 0);
    let deadline = Instant::now() + Duration::from_secs(5);
    let cqe = loop {
        if let Some(cqe) = s.cqe(&lb, 0) {
            break cqe;
        }
        assert!(Instant::now() < deadline, "no CQE after the hold");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(
        (cqe.wr_id.get(), cqe_status(&cqe), cqe.vendor_err.get()),
        (0x72, WcStatus::RemAccessErr, FaultCause::IommuUnmapped as u32)
    );
    s.command_ok(Opcode::QueryDevice, &[], &[]);

    let (status, stderr, events) = s.close();
    assert!(status.success(), "{stderr}");
    let fault = kinds(&events, "fault");
    assert_eq!(fault.len(), 1, "{fault:?}");
    assert_eq!(
        (fault[0]["cause"].as_str(), fault[0]["purpose"].as_str(), fault[0]["iova"].as_u64()),
        (Some("iommu_unmapped"), Some("rdma_write_remote"), Some(IOVA + lb.dst.off))
    );
    let dma_fault = kinds(&events, "dma_fault");
    assert_eq!((dma_fault.len(), dma_fault[0]["queue"].as_u64()), (1, Some(2)), "{dma_fault:?}");
    let released = kinds(&events, "hold_released");
    assert!(released[0]["seq"].as_u64() < fault[0]["seq"].as_u64(), "the DMA came after the release");
}

#[test]
fn a_bound_or_hold_out_of_range_is_a_usage_error() {
    for (args, named) in [
        (["--max-notifications-per-ms", "0"], "--max-notifications-per-ms"),
        (["--max-notifications-per-ms", "1001"], "--max-notifications-per-ms"),
        (["--inject", "hold_completion_ms=0"], "hold_completion_ms"),
        (["--inject", "hold_completion_ms=60001"], "hold_completion_ms"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_vhca-device"))
            .arg("--socket-path")
            .arg(dir.path().join("vhca.sock"))
            .arg("--event-log")
            .arg(dir.path().join("events.jsonl"))
            .args(args)
            .output()
            .expect("run vhca-device");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?}: {stderr}");
        assert!(
            !dir.path().join("events.jsonl").exists(),
            "{args:?}: nothing created before the arguments are checked"
        );
    }
}
