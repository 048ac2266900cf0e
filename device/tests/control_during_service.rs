//! QEMU's messages for one ring arrive while the worker serves another: a guest that unmasks an MSI-X vector makes
//! QEMU re-send SET_VRING_CALL for that vector's queues, at any moment and from its own thread. Every request the
//! driver kicked must still be served. (Once, the worker gave up its pass for any ring's message and slept on a kick
//! it had already read: the request sat untaken until the driver's 10 s command timeout.)

mod common;

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::verbs::parse_response;
use common::*;
use vhca_proto::Status;

/// Far below the driver's 10 s: a served QUERY_DEVICE takes microseconds.
const SERVE_TIMEOUT: Duration = Duration::from_secs(2);
const REQUESTS: u16 = 200;
/// SET_VRING_CALL messages sent right behind each kick: the front-end thread works through them while the worker
/// wakes for the kick.
const CALLS_PER_KICK: usize = 8;

/// `REQUESTS` QUERY_DEVICEs on the command queue, each kicked and followed by a burst of SET_VRING_CALL for the
/// event queue (queue 1) and SET_VRING_ERR for the command queue; returns the requests that were never served. Window 0: the worker sleeps as soon as a pass finds
/// nothing, so a lost pass is not rescued by polling.
fn lost_requests(poll_window_us: &str) -> Vec<u16> {
    // Info, not debug: a debug line per front-end message would fill the stderr pipe the harness reads only at the end.
    let s = Session::start_logging(&["--poll-window-us", poll_window_us], true, "info");
    let call = eventfd();
    let mut lost = Vec::new();
    for slot in 0..REQUESTS {
        let tag = 0x5000 + u32::from(slot);
        let head = (slot % (QUEUE_SIZE / 2)) * 2;
        s.post_query_device(slot, head, tag, 256);
        for i in 0..CALLS_PER_KICK {
            // The event queue's call fd (another ring), and the command queue's own error fd: a message for the
            // ring being served, which takes its lock from the worker mid-pass.
            let (request, queue) = if i % 2 == 0 { (SET_VRING_CALL, 1u64) } else { (SET_VRING_ERR, 0u64) };
            send(&s.stream, request, 0, &queue.to_ne_bytes(), &[call.as_raw_fd()]);
        }
        let deadline = Instant::now() + SERVE_TIMEOUT;
        while s.ram.used_idx(0) != slot.wrapping_add(1) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(50));
        }
        if s.ram.used_idx(0) != slot.wrapping_add(1) {
            lost.push(slot);
            if lost.len() == 3 {
                // Each loss costs the whole timeout: three say enough.
                break;
            }
            // Kick again so the next request starts from a served ring, as the driver's own retry would not.
            signal(&s.kicks[0]);
            let deadline = Instant::now() + SERVE_TIMEOUT;
            while s.ram.used_idx(0) != slot.wrapping_add(1) {
                assert!(Instant::now() < deadline, "request {slot} not served even after a second kick");
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        let (used_head, len) = s.ram.used_elem(0, slot);
        assert_eq!(used_head, u32::from(head), "request {slot}");
        let resp_off = buf_off(0, u64::from(head) + 1);
        let (status, echoed, _) = parse_response(&s.ram.read(resp_off, len as usize));
        assert_eq!((status, echoed), (Status::Ok, tag), "request {slot}");
    }
    let (status, stderr, _) = s.close();
    assert!(status.success(), "{stderr}");
    lost
}

#[test]
fn a_kicked_request_is_served_while_qemu_reconfigures_another_ring() {
    for window in ["0", "50"] {
        let lost = lost_requests(window);
        assert!(
            lost.is_empty(),
            "poll window {window} µs: {} of {REQUESTS} kicked requests never served: {lost:?}",
            lost.len()
        );
    }
}
