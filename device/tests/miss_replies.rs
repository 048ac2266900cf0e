//! Replies to IOTLB misses over the real sockets, the test playing QEMU's `backend_read`: a miss it refuses is an
//! IOMMU fault within milliseconds (not the miss timeout), on the queue worker's parked chain and in the HCA's DMA; a
//! miss it maps (UPDATE acked first, then reply 0) is served; a front-end that never replies costs the timeout; a
//! reply that is none closes the backend channel with a log line naming the cause.

mod common;

use std::io::Read;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::verbs::*;
use common::*;
use vhca_proto::status::WcStatus;
use vhca_proto::{FaultCause, QueryDeviceResp, RESPONSE_HEADER_SIZE};

const RESP_LEN: u32 = (RESPONSE_HEADER_SIZE + std::mem::size_of::<QueryDeviceResp>()) as u32;
/// Far above anything a reply takes, so that a fault seen well before it cannot have been the timeout's.
const LONG_TIMEOUT: &str = "5000";
/// What "within milliseconds" must beat on this loaded 2-core machine: a fifth of LONG_TIMEOUT.
const PROMPT: Duration = Duration::from_millis(1000);

/// What the fake QEMU does with one miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// `vhost_device_iotlb_miss` found a translation: UPDATE on the front-end socket (acked), then reply 0.
    Map,
    /// It found none (-EFAULT): reply 1.
    Refuse,
    /// An older front-end: no reply.
    Silent,
    /// Not a reply: a 4-byte payload.
    Garbage,
}

/// Pages the fake QEMU answers with `answer`; every other miss it maps. Settable once the test knows the pages.
#[derive(Clone)]
struct Policy(Arc<Mutex<(std::ops::Range<u64>, Answer)>>);

impl Policy {
    fn new(pages: std::ops::Range<u64>, answer: Answer) -> Policy {
        Policy(Arc::new(Mutex::new((pages, answer))))
    }

    fn set(&self, pages: std::ops::Range<u64>) {
        self.0.lock().unwrap().0 = pages;
    }

    fn answer(&self, page: u64) -> Answer {
        let policy = self.0.lock().unwrap();
        if policy.0.contains(&page) {
            policy.1
        } else {
            Answer::Map
        }
    }
}

/// QEMU's side of the backend channel, on a thread: `backend_read` answering each miss as the policy says. Drop it
/// before closing the session: it holds a handle on the front-end socket, which keeps the connection open.
struct FakeQemu {
    /// Shutting this down ends the thread's read.
    backend: UnixStream,
    /// Keeps the session's stand-in channel from reading as closed.
    _idle_peer: UnixStream,
    /// The front-end socket, shared by the thread's UPDATEs and the test's own IOTLB messages.
    frontend: Arc<Mutex<UnixStream>>,
    thread: Option<JoinHandle<Vec<(u64, u8)>>>,
}

impl FakeQemu {
    /// Takes over the session's backend channel right after its set-up, before the session could read a miss and
    /// leave it unanswered (QEMU replies to every one, and replies pair with misses in order); the misses the set-up
    /// left there are answered first. From here on IOTLB messages go through `iotlb`, not the session's socket.
    fn start(session: &mut Session, policy: Policy) -> FakeQemu {
        let (idle, idle_peer) = UnixStream::pair().unwrap();
        let mut backend = std::mem::replace(&mut session.backend, idle);
        let frontend = Arc::new(Mutex::new(session.stream.try_clone().unwrap()));
        let handle = backend.try_clone().unwrap();
        let updates = Arc::clone(&frontend);
        let thread = std::thread::spawn(move || {
            let mut seen = Vec::new();
            let mut msg = [0u8; MISS_MESSAGE_SIZE];
            while backend.read_exact(&mut msg).is_ok() {
                let (iova, perm) = parse_miss(&msg);
                seen.push((iova, perm));
                let page = iova & !(PAGE - 1);
                let status: &[u8] = match policy.answer(page) {
                    Answer::Map => {
                        let update = iotlb_payload(page, PAGE, UADDR + (page - IOVA), ACCESS_RW, IOTLB_UPDATE);
                        send_acked(&mut updates.lock().unwrap(), IOTLB_MSG, &update, &[]);
                        &[0; 8]
                    }
                    Answer::Refuse => &[1, 0, 0, 0, 0, 0, 0, 0],
                    Answer::Silent => continue,
                    Answer::Garbage => &[1, 0, 0, 0],
                };
                // QEMU's reply: the request's code, the reply flag in place of need_reply, and the status.
                if send_raw(&backend, 1, 0x1 | 0x4, status.len() as u32, status, &[]).is_err() {
                    break;
                }
            }
            seen
        });
        FakeQemu { backend: handle, _idle_peer: idle_peer, frontend, thread: Some(thread) }
    }

    /// An IOTLB INVALIDATE on the front-end socket, acked.
    fn invalidate(&self, iova: u64, size: u64) {
        let payload = iotlb_payload(iova, size, 0, 0, IOTLB_INVALIDATE);
        send_acked(&mut self.frontend.lock().unwrap(), IOTLB_MSG, &payload, &[]);
    }

    /// Ends the thread (the session then sees a backend channel that stays silent); the misses it saw.
    fn stop(&mut self) -> Vec<(u64, u8)> {
        let _ = self.backend.shutdown(Shutdown::Both);
        self.thread.take().map(|thread| thread.join().expect("fake QEMU thread")).unwrap_or_default()
    }
}

/// A QUERY_DEVICE whose request page QEMU invalidated, posted as the first chain on queue 0; how long until it is
/// returned, and the session.
fn query_from_unmapped_page(extra: &[&str], answer: Answer) -> (Session, FakeQemu, u64, Duration) {
    let mut s = Session::start(extra, true);
    let req_page = IOVA + buf_off(0, 0);
    let qemu = FakeQemu::start(&mut s, Policy::new(req_page..req_page + PAGE, answer));
    qemu.invalidate(req_page, PAGE);
    let start = Instant::now();
    s.post_query_device(0, 0, 7, RESP_LEN);
    s.wait_used(0, 0);
    (s, qemu, req_page, start.elapsed())
}

#[test]
fn a_refused_miss_faults_the_parked_chain_at_once() {
    let (s, mut qemu, req_page, took) = query_from_unmapped_page(&["--miss-timeout-ms", LONG_TIMEOUT], Answer::Refuse);
    assert_eq!(s.ram.used_elem(0, 0), (0, 0), "the chain is returned refused, with length 0");
    assert!(took < PROMPT, "refused chain returned after {took:?}: the miss timeout, not the reply");
    let seen = qemu.stop();
    assert!(seen.contains(&(req_page, ACCESS_RO)), "{seen:x?}");
    drop(qemu);

    let (status, stderr, events) = s.close();
    assert!(status.success(), "{stderr}");
    let faults = kinds(&events, "dma_fault");
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(
        (faults[0]["iova"].as_u64(), faults[0]["cause"].as_str(), faults[0]["queue"].as_u64()),
        (Some(req_page), Some("iommu_unmapped"), Some(0))
    );
    assert!(stderr.contains(&format!("refused the IOTLB miss at {req_page:#x} (r)")), "{stderr}");
    assert!(kinds(&events, "command").is_empty(), "the refused chain never reached the HCA");
}

#[test]
fn a_mapped_miss_is_served_after_the_update_it_acks() {
    let (s, mut qemu, req_page, took) = query_from_unmapped_page(&["--miss-timeout-ms", LONG_TIMEOUT], Answer::Map);
    assert_eq!(s.ram.used_elem(0, 0), (0, RESP_LEN));
    assert!(took < PROMPT, "served after {took:?}");
    assert!(qemu.stop().contains(&(req_page, ACCESS_RO)));
    drop(qemu);
    let (status, stderr, events) = s.close();
    assert!(status.success(), "{stderr}");
    assert!(kinds(&events, "dma_fault").is_empty(), "{stderr}");
    assert_eq!(kinds(&events, "command").len(), 1);
    assert!(!stderr.contains("refused the IOTLB miss"), "{stderr}");
}

#[test]
fn a_reply_that_is_none_closes_the_backend_channel() {
    // The miss awaiting that reply then waits for the (short) timeout; the next one cannot be asked: a fault at once.
    let (mut s, mut qemu, req_page, _) = query_from_unmapped_page(&["--miss-timeout-ms", "200"], Answer::Garbage);
    assert_eq!(s.ram.used_elem(0, 0), (0, 0));
    let next_page = IOVA + buf_off(0, 2);
    qemu.invalidate(next_page, PAGE);
    qemu.stop();
    let start = Instant::now();
    s.post_query_device(1, 2, 8, RESP_LEN);
    s.wait_used(0, 1);
    assert!(start.elapsed() < PROMPT, "no channel: no wait");
    assert_eq!(s.ram.used_elem(0, 1), (2, 0));
    drop(qemu);

    let (status, stderr, events) = s.close();
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("backend channel: closing it: reply of 4 bytes, expected an 8-byte status"), "{stderr}");
    let faults: Vec<_> = kinds(&events, "dma_fault").iter().map(|f| f["iova"].as_u64().unwrap()).collect();
    assert_eq!(faults, vec![req_page, next_page]);
}

/// An RDMA_WRITE from MR pages QEMU invalidated, with the register trusted again (`--revalidate-stale`): the HCA's
/// DMA itself misses and waits in `QueueDma`. The misses QEMU saw, and how long the doorbell took.
fn write_from_unmapped_pages(timeout_ms: &str, answer: Answer) -> (Session, Loopback, Vec<(u64, u8)>, Duration) {
    let mut s = Session::start(&["--revalidate-stale", "--miss-timeout-ms", timeout_ms], true);
    let policy = Policy::new(0..0, answer);
    let mut qemu = FakeQemu::start(&mut s, policy.clone());
    s.post_event_buffers(4);
    let lb = s.loopback(2);
    let len = 2 * PAGE as u32;
    s.ram.write(lb.src.off, &pattern(len as usize, 5));
    policy.set(IOVA + lb.src.off..IOVA + lb.src.off + 2 * PAGE);
    qemu.invalidate(IOVA + lb.src.off, 2 * PAGE);
    let start = Instant::now();
    s.post_send(&lb, 0, &rdma_write_wqe(0x99, lb.src.addr, lb.src.key, len, lb.dst.addr, lb.dst.key));
    let took = start.elapsed();
    let seen = qemu.stop();
    let cqe = s.cqe(&lb, 0).expect("an error CQE");
    assert_eq!(cqe_status(&cqe), WcStatus::LocAccessErr);
    assert_eq!((cqe.wr_id.get(), cqe.vendor_err.get()), (0x99, FaultCause::IommuUnmapped as u32));
    assert_eq!(s.ram.read(lb.dst.off, len as usize), vec![0u8; len as usize], "nothing was written");
    (s, lb, seen, took)
}

fn check_one_dma_fault(s: Session, page: u64) -> String {
    let (status, stderr, events) = s.close();
    assert!(status.success(), "{stderr}");
    let faults = kinds(&events, "dma_fault");
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!((faults[0]["iova"].as_u64(), faults[0]["cause"].as_str()), (Some(page), Some("iommu_unmapped")));
    stderr
}

#[test]
fn a_refused_miss_faults_the_hca_dma_at_once() {
    let (s, lb, seen, took) = write_from_unmapped_pages(LONG_TIMEOUT, Answer::Refuse);
    let page = IOVA + lb.src.off;
    assert!(took < PROMPT, "the DMA waited {took:?}: the miss timeout, not the reply");
    assert!(seen.contains(&(page, ACCESS_RO)), "{seen:x?}");
    let stderr = check_one_dma_fault(s, page);
    assert!(stderr.contains(&format!("refused the IOTLB miss at {page:#x} (r)")), "{stderr}");
}

#[test]
fn a_front_end_that_never_replies_costs_the_timeout_as_before() {
    let (s, lb, seen, took) = write_from_unmapped_pages("300", Answer::Silent);
    let page = IOVA + lb.src.off;
    assert!(took >= Duration::from_millis(300), "faulted after {took:?}, before the miss timeout");
    assert!(seen.contains(&(page, ACCESS_RO)), "the miss was asked: {seen:x?}");
    let stderr = check_one_dma_fault(s, page);
    assert!(!stderr.contains("refused the IOTLB miss"), "{stderr}");
}
