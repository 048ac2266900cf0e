//! The vhost-user transport end to end against the real binary: negotiation, mem table, IOTLB-translated
//! command queue, invalidation faults, miss/update round trips, and malformed requests closing the connection.

mod common;

use std::io::Read;
use std::os::fd::AsRawFd;
use std::time::Duration;

use common::*;
use vhca_proto::{DeviceConfig, QueryDeviceResp, ResponseHeader, Status, CONFIG_MAGIC, RESPONSE_HEADER_SIZE};
use zerocopy::FromBytes;

const RESP_LEN: u32 = (RESPONSE_HEADER_SIZE + std::mem::size_of::<QueryDeviceResp>()) as u32;

fn check_query_device_response(ram: &GuestRam, head: u16, tag: u32) {
    let bytes = ram.read(buf_off(0, u64::from(head) + 1), RESP_LEN as usize);
    let (header, body) = ResponseHeader::read_from_prefix(&bytes).unwrap();
    assert_eq!(header.status.get(), Status::Ok as u32);
    assert_eq!(header.opcode.get(), 1);
    assert_eq!(header.tag.get(), tag);
    assert_eq!(header.body_len.get() as usize, std::mem::size_of::<QueryDeviceResp>());
    let resp = QueryDeviceResp::read_from_bytes(body).unwrap();
    assert_eq!(resp.abi_version.get(), 1);
    assert_eq!(resp.page_size.get(), 4096);
    assert_eq!(resp.map_registers_total.get(), 4096);
}

#[test]
fn negotiates_and_serves_config() {
    let mut session = Session::start(&[], false);
    let mut request = Vec::new();
    for v in [0u32, 12, 0] {
        request.extend_from_slice(&v.to_ne_bytes());
    }
    request.extend_from_slice(&[0u8; 12]);
    send(&session.stream, GET_CONFIG, 0, &request, &[]);
    let reply = recv_reply(&mut session.stream, GET_CONFIG);
    assert_eq!(reply.len(), 24);
    assert_eq!(&reply[..12], &request[..12], "the config header comes back unchanged");
    let config = DeviceConfig::read_from_bytes(&reply[12..]).unwrap();
    assert_eq!(config.magic.get(), CONFIG_MAGIC);
    assert_eq!(config.num_queues.get(), 4);
    assert_eq!(config.map_registers.get(), 4096);

    let (status, _stderr, events) = session.close();
    assert!(status.success(), "clean disconnect exits 0, got {status:?}");
    assert_eq!(events[0]["kind"], "start");
    assert_eq!(events[0]["schema"], 1);
    assert_eq!(kinds(&events, "connected").len(), 1);
    assert_eq!(kinds(&events, "disconnected").len(), 1);
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "seq is dense and monotonic: {seqs:?}");
}

#[test]
fn query_device_through_the_iotlb() {
    let mut session = Session::start(&[], true);
    session.post_query_device(0, 0, 0x1234, RESP_LEN);
    let misses = session.wait_call(0, false, Duration::from_secs(10));
    // Only the used rings may have missed, while the queues were enabled before the test's IOTLB update.
    assert!(misses.iter().all(|(iova, _)| is_used_ring(*iova)), "everything was mapped up front: {misses:x?}");
    assert_eq!(session.ram.used_idx(0), 1);
    assert_eq!(session.ram.used_elem(0, 0), (0, RESP_LEN));
    check_query_device_response(&session.ram, 0, 0x1234);
    // GET_VRING_BASE stops the ring and reports how far the device consumed it.
    send(&session.stream, GET_VRING_BASE, 0, &vring_state(0, 0), &[]);
    assert_eq!(recv_reply(&mut session.stream, GET_VRING_BASE), vring_state(0, 1));

    let (status, _stderr, events) = session.close();
    assert!(status.success());
    let update = &kinds(&events, "iotlb_update")[0];
    assert_eq!(
        (update["iova"].as_u64(), update["uaddr"].as_u64(), update["perm"].as_str()),
        (Some(IOVA), Some(UADDR), Some("rw"))
    );
    // Each descriptor the device touched is logged with its IOVA and where the IOTLB put it in QEMU's space.
    let descs: Vec<_> = kinds(&events, "desc").into_iter().filter(|e| e["queue"] == 0).collect();
    assert_eq!(descs.len(), 2, "{descs:?}");
    for (desc, offset, writable) in [(descs[0], buf_off(0, 0), false), (descs[1], buf_off(0, 1), true)] {
        assert_eq!(desc["iova"].as_u64(), Some(IOVA + offset));
        assert_eq!(desc["uaddr"].as_u64(), Some(UADDR + offset));
        assert_eq!(desc["writable"].as_bool(), Some(writable));
    }
    let commands = kinds(&events, "command");
    assert_eq!(commands.len(), 1);
    assert_eq!(commands[0]["status"], "OK");
}

/// True if the eventfd has a count to read (without reading it).
fn signalled(fd: &std::os::fd::OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one live pollfd, zero timeout.
    unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents & libc::POLLIN != 0 }
}

#[test]
fn a_driver_that_declines_interrupts_gets_no_call_and_one_that_wants_them_does() {
    let mut session = Session::start(&[], true);
    // VRING_AVAIL_F_NO_INTERRUPT in queue 0's avail flags, as vhca's polling drivers set it.
    session.ram.write_u16(avail_off(0), 1);
    session.post_query_device(0, 0, 0x51, RESP_LEN);
    // Polled, as such a driver does (`wait_used` waits on the call).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while session.ram.used_idx(0) != 1 {
        assert!(std::time::Instant::now() < deadline, "the chain was never used");
        std::thread::sleep(Duration::from_millis(1));
    }
    check_query_device_response(&session.ram, 0, 0x51);
    // The call would have been written right after the used index; give a late one time to show.
    std::thread::sleep(Duration::from_millis(50));
    assert!(!signalled(&session.calls[0]), "the device signalled a driver that declined interrupts");
    // Flags 0 again: the next completion is signalled.
    session.ram.write_u16(avail_off(0), 0);
    session.post_query_device(1, 2, 0x52, RESP_LEN);
    session.wait_call(0, false, Duration::from_secs(10));
    assert_eq!(session.ram.used_idx(0), 2);
    let (status, stderr, _) = session.close();
    assert!(status.success(), "{stderr}");
}

#[test]
fn invalidated_buffer_faults_and_the_queue_keeps_serving() {
    let mut session = Session::start(&["--miss-timeout-ms", "200"], true);
    session.post_query_device(0, 0, 1, RESP_LEN);
    session.wait_call(0, false, Duration::from_secs(10));
    check_query_device_response(&session.ram, 0, 1);

    // Drop the translation of the next request's page; the device asks once, nobody answers, it faults.
    let req_page = IOVA + buf_off(0, 2);
    session.iotlb(IOTLB_INVALIDATE, req_page, PAGE, 0, 0);
    session.post_query_device(1, 2, 2, RESP_LEN);
    let misses: Vec<_> = session
        .wait_call(0, false, Duration::from_secs(10))
        .into_iter()
        .filter(|(iova, _)| !is_used_ring(*iova))
        .collect();
    assert_eq!(misses, vec![(req_page, ACCESS_RO)]);
    assert_eq!(session.ram.used_idx(0), 2);
    assert_eq!(session.ram.used_elem(0, 1), (2, 0), "refused chain is returned with length 0");
    assert_eq!(session.ram.read(buf_off(0, 3), 4), vec![0xaa; 4], "nothing written to the response");

    // Another chain on mapped pages still completes.
    session.post_query_device(2, 4, 3, RESP_LEN);
    session.wait_call(0, false, Duration::from_secs(10));
    check_query_device_response(&session.ram, 4, 3);

    let (status, _stderr, events) = session.close();
    assert!(status.success());
    let invalidate = &kinds(&events, "iotlb_invalidate")[0];
    assert_eq!(invalidate["iova"].as_u64(), Some(req_page));
    let miss = kinds(&events, "iotlb_miss").into_iter().find(|e| !is_used_ring(e["iova"].as_u64().unwrap())).unwrap();
    assert_eq!((miss["iova"].as_u64(), miss["perm"].as_str()), (Some(req_page), Some("r")));
    let fault = &kinds(&events, "dma_fault")[0];
    assert_eq!(
        (fault["iova"].as_u64(), fault["cause"].as_str(), fault["queue"].as_u64()),
        (Some(req_page), Some("iommu_unmapped"), Some(0))
    );
    assert!(kinds(&events, "chain_error").iter().any(|e| e["head"] == 2));
    assert_eq!(kinds(&events, "command").len(), 2, "the refused chain never reached the HCA");
}

#[test]
fn misses_answered_with_updates_complete_the_command() {
    // Like QEMU: only the used rings are mapped at start; everything else arrives on demand.
    let mut session = Session::start(&[], false);
    for q in 0..4 {
        session.iotlb(IOTLB_UPDATE, IOVA + used_off(q), PAGE, UADDR + used_off(q), ACCESS_RW);
    }
    session.post_query_device(0, 0, 0x77, RESP_LEN);
    let misses = session.wait_call(0, true, Duration::from_secs(10));
    let pages: Vec<u64> = misses.iter().map(|(iova, _)| iova & !(PAGE - 1)).collect();
    for needed in [avail_off(0), desc_off(0), buf_off(0, 0), buf_off(0, 1)] {
        assert!(pages.contains(&(IOVA + needed)), "no miss for offset {needed:#x}: {misses:x?}");
    }
    assert!(misses.contains(&(IOVA + buf_off(0, 1), ACCESS_WO)), "response buffer is asked for write: {misses:x?}");
    assert_eq!(session.ram.used_elem(0, 0), (0, RESP_LEN));
    check_query_device_response(&session.ram, 0, 0x77);

    let (status, _stderr, events) = session.close();
    assert!(status.success());
    assert!(kinds(&events, "dma_fault").is_empty(), "answered misses are not faults");
    assert_eq!(kinds(&events, "command").len(), 1, "the parked chain ran exactly once");
}

#[test]
fn malformed_chain_is_refused_and_logged() {
    let mut session = Session::start(&[], true);
    // Writable descriptor first, then a readable one: not a valid virtio chain.
    session.ram.set_desc(0, 0, IOVA + buf_off(0, 0), 16, DESC_F_WRITE | DESC_F_NEXT, 1);
    session.ram.set_desc(0, 1, IOVA + buf_off(0, 1), 16, 0, 0);
    session.ram.publish(0, 0, 0);
    signal(&session.kicks[0]);
    session.wait_call(0, false, Duration::from_secs(10));
    assert_eq!(session.ram.used_elem(0, 0), (0, 0));
    // A next index past the table.
    session.ram.set_desc(0, 2, IOVA + buf_off(0, 2), 16, DESC_F_NEXT, 500);
    session.ram.publish(0, 1, 2);
    signal(&session.kicks[0]);
    session.wait_call(0, false, Duration::from_secs(10));
    assert_eq!(session.ram.used_elem(0, 1), (2, 0));
    session.post_query_device(2, 4, 9, RESP_LEN);
    session.wait_call(0, false, Duration::from_secs(10));
    check_query_device_response(&session.ram, 4, 9);

    let (status, _stderr, events) = session.close();
    assert!(status.success());
    let errors = kinds(&events, "chain_error");
    assert!(errors[0]["cause"].as_str().unwrap().contains("after a device-writable"), "{errors:?}");
    assert!(errors[1]["cause"].as_str().unwrap().contains("cut short"), "{errors:?}");
}

/// Sends `bytes` (and `fds`) right after connecting, then expects the device to close the connection, exit 2, and
/// name `cause` on stderr and in a protocol_error event.
fn expect_rejected(request: u32, payload: &[u8], fds: &[i32], cause: &str) {
    let device = Device::spawn(&[]);
    let mut stream = device.connect();
    send(&stream, SET_OWNER, 0, &[], &[]);
    send(&stream, request, NEED_REPLY, payload, fds);
    let mut rest = Vec::new();
    let read = stream.read_to_end(&mut rest);
    assert!(matches!(read, Ok(0)), "connection must be closed without a reply: {read:?} {rest:?}");
    let (status, stderr, events) = device.finish();
    assert_eq!(status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains(cause), "stderr lacks {cause:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let errors = kinds(&events, "protocol_error");
    assert_eq!(errors.len(), 1, "{events:?}");
    assert!(errors[0]["cause"].as_str().unwrap().contains(cause), "{errors:?}");
    assert_eq!(kinds(&events, "disconnected").len(), 1);
}

#[test]
fn bad_payload_size_closes_the_connection() {
    expect_rejected(SET_FEATURES, &[0u8; 4], &[], "SET_FEATURES: bad payload size 4, expected 8");
}

#[test]
fn unknown_request_code_closes_the_connection() {
    expect_rejected(999, &[], &[], "unknown request code 999");
}

#[test]
fn wrong_fd_count_closes_the_connection() {
    // A call fd announced (no NOFD flag) but not attached.
    expect_rejected(SET_VRING_CALL, &0u64.to_ne_bytes(), &[], "SET_VRING_CALL: wrong fd count 0, expected 1");
    // An fd attached to a request that takes none.
    let stray = eventfd();
    expect_rejected(GET_FEATURES, &[], &[stray.as_raw_fd()], "GET_FEATURES: wrong fd count 1, expected 0");
}

#[test]
fn out_of_range_queue_and_bad_region_close_the_connection() {
    expect_rejected(SET_VRING_NUM, &vring_state(7, 16), &[], "queue index 7 out of range");
    expect_rejected(SET_VRING_NUM, &vring_state(0, 24), &[], "size 24 is not a power of two");
    expect_rejected(SET_VRING_NUM, &vring_state(0, 2048), &[], "size 2048 is not a power of two from 1 to 1024");
    let ram = GuestRam::new();
    let mut table = Vec::new();
    table.extend_from_slice(&1u32.to_ne_bytes());
    table.extend_from_slice(&0u32.to_ne_bytes());
    for v in [0u64, MEM_SIZE * 4, UADDR, 0] {
        table.extend_from_slice(&v.to_ne_bytes());
    }
    expect_rejected(SET_MEM_TABLE, &table, &[ram.fd.as_raw_fd()], "bad region");
}

#[test]
fn iotlb_message_without_access_platform_is_refused() {
    let payload = iotlb_payload(IOVA, PAGE, UADDR, ACCESS_RW, IOTLB_UPDATE);
    expect_rejected(IOTLB_MSG, &payload, &[], "IOTLB_MSG before VIRTIO_F_ACCESS_PLATFORM was negotiated");
}
