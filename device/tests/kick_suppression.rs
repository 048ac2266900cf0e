//! The kick-suppression protocol of the real device binary (docs/protocol.md "Kicks and polling"): while its queue
//! worker busy-polls it sets VRING_USED_F_NO_NOTIFY in the command queue's used ring, a driver that honours the flag
//! skips its kick, and no request is lost when the polling window closes under a request published without a kick.

mod common;

use std::time::{Duration, Instant};

use common::verbs::parse_response;
use common::*;
use vhca_proto::Status;

const NO_NOTIFY: u16 = 1;
/// How long one request may take before the device counts as having lost it.
const SERVE_TIMEOUT: Duration = Duration::from_secs(5);

/// A driver that follows virtio 1.2, 2.7.13: publish, full barrier (`GuestRam::read` starts with one), read the used
/// ring's flags, kick only if NO_NOTIFY is clear.
struct Driver {
    session: Session,
    slot: u16,
    kicked: u32,
    skipped: u32,
}

impl Driver {
    fn new(poll_window_us: &str) -> Driver {
        Driver { session: Session::start(&["--poll-window-us", poll_window_us], true), slot: 0, kicked: 0, skipped: 0 }
    }

    fn flags(&self) -> u16 {
        self.session.ram.read_u16(used_off(0))
    }

    /// One QUERY_DEVICE on queue 0, kicked only if the device wants it; waits for its used entry by polling the used
    /// index (a lost request shows as a timeout) and checks the response is this request's.
    fn query_device(&mut self) {
        let (slot, tag) = (self.slot, 0x7000 + u32::from(self.slot));
        let s = &self.session;
        let (req_off, resp_off) = (buf_off(0, 0), buf_off(0, 1));
        let mut request = Vec::new();
        for v in [vhca_proto::Opcode::QueryDevice as u32, tag, 0, 0] {
            request.extend_from_slice(&v.to_le_bytes());
        }
        s.ram.write(req_off, &request);
        s.ram.set_desc(0, 0, IOVA + req_off, 16, DESC_F_NEXT, 1);
        s.ram.set_desc(0, 1, IOVA + resp_off, 256, DESC_F_WRITE, 0);
        s.ram.publish(0, slot, 0);
        if self.flags() & NO_NOTIFY == 0 {
            signal(&s.kicks[0]);
            self.kicked += 1;
        } else {
            self.skipped += 1;
        }
        let deadline = Instant::now() + SERVE_TIMEOUT;
        while s.ram.used_idx(0) != slot.wrapping_add(1) {
            assert!(
                Instant::now() < deadline,
                "request {slot} never served (kicked {}, skipped {}, flags now {:#x})",
                self.kicked,
                self.skipped,
                self.flags()
            );
            std::hint::spin_loop();
        }
        let (head, len) = s.ram.used_elem(0, slot);
        assert_eq!(head, 0);
        let (status, echoed, _) = parse_response(&s.ram.read(resp_off, len as usize));
        assert_eq!((status, echoed), (Status::Ok, tag), "request {slot}");
        self.slot = slot.wrapping_add(1);
    }
}

/// Spins about `us` microseconds: a sleep's granularity would hide the window's edge.
fn spin_for(us: u64) {
    let until = Instant::now() + Duration::from_micros(us);
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// `count` requests with pseudo-random gaps of 0 to `max_gap_us` between them; returns (kicked, skipped).
fn requests_with_gaps(window_us: &str, count: u32, max_gap_us: u64) -> (u32, u32) {
    let mut driver = Driver::new(window_us);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..count {
        driver.query_device();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        spin_for(rng % (max_gap_us + 1));
    }
    let (kicked, skipped) = (driver.kicked, driver.skipped);
    eprintln!(
        "window {window_us} µs, {count} requests: {kicked} kicked, {skipped} published while it polled (no kick)"
    );
    let (status, stderr, _) = driver.session.close();
    assert!(status.success(), "{stderr}");
    (kicked, skipped)
}

#[test]
fn no_request_is_lost_when_the_window_closes_under_a_skipped_kick() {
    // A 20 µs window and gaps of 0 to 60 µs: many requests are published around the moment the window closes, some
    // after the driver read the flag as set and skipped its kick. Each must be served (`query_device` checks).
    let (kicked_fast, skipped_fast) = requests_with_gaps("20", 3000, 60);
    // The same at millisecond scale, so both paths are taken even when a loaded machine deschedules either side
    // for longer than the short window.
    let (kicked_slow, skipped_slow) = requests_with_gaps("2000", 300, 4000);
    assert!(skipped_fast + skipped_slow > 0, "the device never suppressed a kick");
    assert!(kicked_fast + kicked_slow > 2, "the window never closed between requests");
}

#[test]
fn the_flag_is_set_only_while_polling_and_cleared_before_sleeping() {
    // The longest window, so the flag is seen set however slowly this test is scheduled; the device must still clear
    // it when the window ends.
    let mut driver = Driver::new("10000");
    let mut seen_set = false;
    for _ in 0..5 {
        driver.query_device();
        let until = Instant::now() + Duration::from_millis(5);
        while Instant::now() < until && !seen_set {
            seen_set = driver.flags() & NO_NOTIFY != 0;
        }
        if seen_set {
            break;
        }
    }
    assert!(seen_set, "the device never set VRING_USED_F_NO_NOTIFY after serving a request");
    let deadline = Instant::now() + SERVE_TIMEOUT;
    while driver.flags() & NO_NOTIFY != 0 {
        assert!(Instant::now() < deadline, "the flag stayed set after the window");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Asleep now: the next request needs its kick, and gets served by it.
    driver.kicked = 0;
    driver.query_device();
    assert_eq!(driver.kicked, 1);
    let (status, stderr, _) = driver.session.close();
    assert!(status.success(), "{stderr}");
}

#[test]
fn window_zero_never_suppresses_a_kick() {
    let mut driver = Driver::new("0");
    for _ in 0..50 {
        driver.query_device();
        assert_eq!(driver.flags(), 0, "flags written with polling off");
    }
    assert_eq!((driver.kicked, driver.skipped), (50, 0));
    let (status, stderr, _) = driver.session.close();
    assert!(status.success(), "{stderr}");
}

#[test]
fn a_window_past_the_bound_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vhca-device"))
        .arg("--socket-path")
        .arg(dir.path().join("vhca.sock"))
        .arg("--event-log")
        .arg(dir.path().join("events.jsonl"))
        .args(["--poll-window-us", "10001"])
        .output()
        .expect("run vhca-device");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--poll-window-us") && stderr.contains("10001"), "{stderr}");
    assert!(!dir.path().join("events.jsonl").exists(), "nothing created before the arguments are checked");
}
