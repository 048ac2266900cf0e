//! A test vhost-user front-end: spawns the device binary, talks to it over a real Unix socket (fds as
//! SCM_RIGHTS), shares a memfd as guest RAM and builds split virtqueues in it, playing QEMU and the guest at once.
#![allow(dead_code)]

pub mod verbs;

use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use vhost::vhost_user::message::{
    FrontendReq, VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::{VhostAccess, VhostIotlbType};
use virtio_bindings::virtio_config::{VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};

/// Request codes as the u32 the wire carries (and the robustness strategies match on), from the vhost crate; and
/// `SERVED`, all of them: the requests the device serves.
macro_rules! request_codes {
    ($($name:ident),*) => {
        $(pub const $name: u32 = FrontendReq::$name as u32;)*
        pub const SERVED: &[u32] = &[$($name),*];
    };
}
request_codes!(
    GET_FEATURES,
    SET_FEATURES,
    SET_OWNER,
    RESET_OWNER,
    SET_MEM_TABLE,
    SET_VRING_NUM,
    SET_VRING_ADDR,
    SET_VRING_BASE,
    GET_VRING_BASE,
    SET_VRING_KICK,
    SET_VRING_CALL,
    SET_VRING_ERR,
    GET_PROTOCOL_FEATURES,
    SET_PROTOCOL_FEATURES,
    GET_QUEUE_NUM,
    SET_VRING_ENABLE,
    SET_BACKEND_REQ_FD,
    IOTLB_MSG,
    GET_CONFIG,
    SET_CONFIG
);

pub const NEED_REPLY: u32 = VhostUserHeaderFlag::NEED_REPLY.bits();
/// Feature masks built from virtio-bindings' bit numbers.
pub const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
pub const ACCESS_PLATFORM: u64 = 1 << VIRTIO_F_ACCESS_PLATFORM;
pub const F_PROTOCOL_FEATURES: u64 = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
/// What QEMU needs with iommu_platform=on, and what the device offers.
pub const PROTOCOL_FEATURES: u64 = VhostUserProtocolFeatures::MQ
    .union(VhostUserProtocolFeatures::REPLY_ACK)
    .union(VhostUserProtocolFeatures::BACKEND_REQ)
    .union(VhostUserProtocolFeatures::CONFIG)
    .bits();

pub const IOTLB_MISS: u8 = VhostIotlbType::Miss as u8;
pub const IOTLB_UPDATE: u8 = VhostIotlbType::Update as u8;
pub const IOTLB_INVALIDATE: u8 = VhostIotlbType::Invalidate as u8;
pub const ACCESS_RO: u8 = VhostAccess::ReadOnly as u8;
pub const ACCESS_WO: u8 = VhostAccess::WriteOnly as u8;
pub const ACCESS_RW: u8 = VhostAccess::ReadWrite as u8;

pub const DESC_F_NEXT: u16 = VRING_DESC_F_NEXT as u16;
pub const DESC_F_WRITE: u16 = VRING_DESC_F_WRITE as u16;

/// Guest RAM: this many bytes of memfd, at guest-physical 0, "mapped in QEMU" at `UADDR`.
pub const MEM_SIZE: u64 = 0x10_0000;
pub const UADDR: u64 = 0x7f12_3400_0000;
/// The IOVA window the test maps onto guest RAM: deliberately unlike both the GPA and the QEMU address.
pub const IOVA: u64 = 0x8000_0000;
pub const QUEUE_SIZE: u16 = 16;
pub const PAGE: u64 = 0x1000;

/// Where queue `q`'s pieces live, as offsets into guest RAM (IOVA = IOVA + offset once mapped).
pub fn queue_base(q: u16) -> u64 {
    0x10000 * (u64::from(q) + 1)
}
pub fn desc_off(q: u16) -> u64 {
    queue_base(q)
}
pub fn avail_off(q: u16) -> u64 {
    queue_base(q) + PAGE
}
pub fn used_off(q: u16) -> u64 {
    queue_base(q) + 2 * PAGE
}
/// Whether `iova` is in one of the used-ring pages, which the device checks (and may miss on) as soon as a queue
/// is enabled, before the test maps anything.
pub fn is_used_ring(iova: u64) -> bool {
    (0..4).any(|q| iova & !(PAGE - 1) == IOVA + used_off(q))
}
pub fn buf_off(q: u16, n: u64) -> u64 {
    queue_base(q) + (3 + n) * PAGE
}
/// Guest RAM past the four queues' pages: rings and MR pages the HCA reaches through map registers.
pub const DATA_OFF: u64 = 0x50000;
/// MR addresses the tests register: deliberately not the IOVA, so a device mixing the two up is caught.
pub const MR_ADDR_BASE: u64 = 0x7000_0000_0000;

pub struct Device {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl Device {
    pub fn spawn(extra: &[&str]) -> Device {
        Device::spawn_logging(extra, "debug")
    }

    /// `spawn` with RUST_LOG at `level`: a test that sends thousands of messages keeps its stderr (a pipe read only
    /// at `finish`) below the pipe's capacity, or the device would block writing it.
    pub fn spawn_logging(extra: &[&str], level: &str) -> Device {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("vhca.sock");
        let log = dir.path().join("events.jsonl");
        let child = Command::new(env!("CARGO_BIN_EXE_vhca-device"))
            .arg("--socket-path")
            .arg(&socket)
            .arg("--event-log")
            .arg(&log)
            .args(extra)
            .env("RUST_LOG", level)
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn vhca-device");
        Device { child, dir, socket, log }
    }

    pub fn connect(&self) -> UnixStream {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(stream) = UnixStream::connect(&self.socket) {
                stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                return stream;
            }
            assert!(Instant::now() < deadline, "device never listened on {}", self.socket.display());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the device to exit; returns its status and everything it logged to stderr.
    pub fn finish(mut self) -> (ExitStatus, String, Vec<serde_json::Value>) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("device did not exit");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut stderr = String::new();
        self.child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
        let events = read_events(&self.log);
        assert!(!self.socket.exists(), "socket file must be removed on exit");
        (status, stderr, events)
    }
}

pub fn read_events(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("bad event line {line:?}: {e}")))
        .collect()
}

pub fn kinds<'a>(events: &'a [serde_json::Value], kind: &str) -> Vec<&'a serde_json::Value> {
    events.iter().filter(|e| e["kind"] == kind).collect()
}

/// Sends one vhost-user message with `fds` attached as SCM_RIGHTS.
pub fn send(stream: &UnixStream, request: u32, flags: u32, payload: &[u8], fds: &[RawFd]) {
    send_raw(stream, request, 0x1 | flags, payload.len() as u32, payload, fds).expect("sendmsg");
}
/// Sends one message whose header says `size` (the payload's length unless lying); errors instead of panicking.
pub fn send_raw(
    stream: &UnixStream,
    request: u32,
    flags: u32,
    size: u32,
    payload: &[u8],
    fds: &[RawFd],
) -> std::io::Result<()> {
    let mut bytes = Vec::with_capacity(12 + payload.len());
    for v in [request, flags, size] {
        bytes.extend_from_slice(&v.to_ne_bytes());
    }
    bytes.extend_from_slice(payload);
    let fds: Vec<BorrowedFd<'_>> = fds
        .iter()
        // SAFETY: the caller's fds stay open for this call; they are only borrowed for the sendmsg.
        .map(|fd| unsafe { BorrowedFd::borrow_raw(*fd) })
        .collect();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("more fds than the control buffer holds"));
    }
    // MSG_NOSIGNAL turns a closed peer into EPIPE.
    let sent = sendmsg(stream, &[IoSlice::new(&bytes)], &mut control, SendFlags::NOSIGNAL)?;
    let rest = &bytes[sent..];
    if !rest.is_empty() {
        let n = rustix::net::send(stream, rest, SendFlags::NOSIGNAL)?;
        if n != rest.len() {
            return Err(std::io::Error::other("short send"));
        }
    }
    Ok(())
}

/// Reads one reply; checks it answers `request` and carries the reply flag.
pub fn recv_reply(stream: &mut UnixStream, request: u32) -> Vec<u8> {
    let mut header = [0u8; 12];
    stream.read_exact(&mut header).expect("reply header");
    let code = u32::from_ne_bytes(header[0..4].try_into().unwrap());
    let flags = u32::from_ne_bytes(header[4..8].try_into().unwrap());
    let size = u32::from_ne_bytes(header[8..12].try_into().unwrap()) as usize;
    assert_eq!(code, request, "reply to the wrong request");
    assert_eq!(flags & 0x7, 0x5, "reply must carry version 1 and the reply flag");
    let mut payload = vec![0u8; size];
    stream.read_exact(&mut payload).unwrap();
    payload
}

pub fn u64_payload(bytes: &[u8]) -> u64 {
    u64::from_ne_bytes(bytes.try_into().expect("8-byte payload"))
}

/// Sends a request that expects an ack and asserts it is 0.
pub fn send_acked(stream: &mut UnixStream, request: u32, payload: &[u8], fds: &[RawFd]) {
    send(stream, request, NEED_REPLY, payload, fds);
    let ack = recv_reply(stream, request);
    assert_eq!(u64_payload(&ack), 0, "request {request} was not acked with success");
}

pub fn get_u64(stream: &mut UnixStream, request: u32) -> u64 {
    send(stream, request, 0, &[], &[]);
    u64_payload(&recv_reply(stream, request))
}

pub fn vring_state(index: u32, num: u32) -> Vec<u8> {
    [index.to_ne_bytes(), num.to_ne_bytes()].concat()
}

pub fn iotlb_payload(iova: u64, size: u64, uaddr: u64, perm: u8, kind: u8) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&iova.to_ne_bytes());
    bytes.extend_from_slice(&size.to_ne_bytes());
    bytes.extend_from_slice(&uaddr.to_ne_bytes());
    bytes.extend_from_slice(&[perm, kind, 0, 0, 0, 0, 0, 0]);
    bytes
}

pub fn eventfd() -> OwnedFd {
    // SAFETY: eventfd has no memory-safety preconditions; the result is checked before use.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(fd >= 0);
    // SAFETY: fd was just created and is owned by nobody else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

pub fn signal(fd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live buffer to an eventfd.
    let n = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), 8) };
    assert_eq!(n, 8);
}

/// Guest RAM shared with the device through a memfd.
pub struct GuestRam {
    pub fd: OwnedFd,
    ptr: *mut u8,
}

impl GuestRam {
    pub fn new() -> GuestRam {
        // SAFETY: the name is a valid C string; the fd is checked.
        let fd = unsafe { libc::memfd_create(c"vhca-test-ram".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fd is a fresh memfd owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), MEM_SIZE as libc::off_t) }, 0);
        // SAFETY: a fresh shared mapping of the whole memfd; checked against MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MEM_SIZE as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        GuestRam { fd, ptr: ptr.cast() }
    }

    pub fn write(&self, offset: u64, bytes: &[u8]) {
        assert!(offset + bytes.len() as u64 <= MEM_SIZE);
        // SAFETY: bounds checked above; the mapping lives as long as self. The device only touches these bytes
        // after the kick that follows, so there is no concurrent access.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset as usize), bytes.len()) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    pub fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        assert!(offset + len as u64 <= MEM_SIZE);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let mut out = vec![0u8; len];
        // SAFETY: bounds checked above; the mapping lives as long as self.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset as usize), out.as_mut_ptr(), len) };
        out
    }

    pub fn write_u16(&self, offset: u64, v: u16) {
        self.write(offset, &v.to_le_bytes());
    }

    pub fn read_u16(&self, offset: u64) -> u16 {
        u16::from_le_bytes(self.read(offset, 2).try_into().unwrap())
    }

    pub fn read_u32(&self, offset: u64) -> u32 {
        u32::from_le_bytes(self.read(offset, 4).try_into().unwrap())
    }

    /// Descriptor `index` of queue `q`: addr is an IOVA.
    pub fn set_desc(&self, q: u16, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = Vec::with_capacity(16);
        d.extend_from_slice(&addr.to_le_bytes());
        d.extend_from_slice(&len.to_le_bytes());
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&next.to_le_bytes());
        self.write(desc_off(q) + 16 * u64::from(index), &d);
    }

    /// Makes chain `head` available as avail entry `slot` and publishes idx = slot + 1.
    pub fn publish(&self, q: u16, slot: u16, head: u16) {
        self.write_u16(avail_off(q) + 4 + 2 * u64::from(slot % QUEUE_SIZE), head);
        self.write_u16(avail_off(q) + 2, slot.wrapping_add(1));
    }

    pub fn used_idx(&self, q: u16) -> u16 {
        self.read_u16(used_off(q) + 2)
    }

    /// (id, len) of used entry `slot`.
    pub fn used_elem(&self, q: u16, slot: u16) -> (u32, u32) {
        let off = used_off(q) + 4 + 8 * u64::from(slot % QUEUE_SIZE);
        (self.read_u32(off), self.read_u32(off + 4))
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in new().
        unsafe { libc::munmap(self.ptr.cast(), MEM_SIZE as usize) };
    }
}

/// A negotiated, fully set-up connection: 4 queues at IOVAs, kick/call eventfds, backend channel.
pub struct Session {
    pub device: Device,
    pub stream: UnixStream,
    pub backend: UnixStream,
    pub ram: GuestRam,
    pub kicks: Vec<OwnedFd>,
    pub calls: Vec<OwnedFd>,
    /// Next avail slot per queue, for the helpers that post chains (`command`, `ring`, `post_event_buffers`).
    pub next_slot: [u16; 4],
    pub next_tag: u32,
    /// Next free page offset in the data area.
    pub next_data: u64,
    /// Event buffers posted so far on queue 1 (descriptor i is buffer i).
    pub event_buffers: u16,
    /// Whether `wait_used` answers IOTLB misses (identity over the IOVA window) while it waits, as QEMU would for
    /// pages its vIOMMU maps.
    pub answer_misses: bool,
}

/// An MR the test registered: its key, the address SGEs use, and where its bytes are in guest RAM.
#[derive(Debug, Clone, Copy)]
pub struct TestMr {
    pub key: u32,
    pub addr: u64,
    pub len: u64,
    pub off: u64,
}

/// A QP looped back to itself in RTS, with one CQ for both queues and two MRs: what an RDMA_WRITE test needs.
#[derive(Debug, Clone, Copy)]
pub struct Loopback {
    pub pd: u32,
    pub cq: u32,
    pub cq_entries: u32,
    pub cq_off: u64,
    pub qpn: u32,
    pub sq_off: u64,
    pub sq_entries: u32,
    pub src: TestMr,
    pub dst: TestMr,
}

impl Session {
    /// Negotiates and sets up all four queues; `map_all` also sends one IOTLB update covering all of RAM.
    pub fn start(extra: &[&str], map_all: bool) -> Session {
        Session::start_logging(extra, map_all, "debug")
    }

    /// `start` with the device's RUST_LOG at `level` (`Device::spawn_logging`).
    pub fn start_logging(extra: &[&str], map_all: bool, level: &str) -> Session {
        let device = Device::spawn_logging(extra, level);
        let mut stream = device.connect();
        send(&stream, SET_OWNER, 0, &[], &[]);
        let features = get_u64(&mut stream, GET_FEATURES);
        let wanted = VERSION_1 | ACCESS_PLATFORM | F_PROTOCOL_FEATURES;
        assert_eq!(features & wanted, wanted);
        send(&stream, SET_FEATURES, 0, &wanted.to_ne_bytes(), &[]);
        let protocol = get_u64(&mut stream, GET_PROTOCOL_FEATURES);
        assert_eq!(protocol & PROTOCOL_FEATURES, PROTOCOL_FEATURES);
        send(&stream, SET_PROTOCOL_FEATURES, 0, &PROTOCOL_FEATURES.to_ne_bytes(), &[]);
        assert_eq!(get_u64(&mut stream, GET_QUEUE_NUM), 4);
        let (backend, theirs) = UnixStream::pair().unwrap();
        backend.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        send_acked(&mut stream, SET_BACKEND_REQ_FD, &[], &[theirs.as_raw_fd()]);
        drop(theirs);

        let ram = GuestRam::new();
        let mut table = Vec::new();
        table.extend_from_slice(&1u32.to_ne_bytes());
        table.extend_from_slice(&0u32.to_ne_bytes());
        for v in [0u64, MEM_SIZE, UADDR, 0] {
            table.extend_from_slice(&v.to_ne_bytes());
        }
        send_acked(&mut stream, SET_MEM_TABLE, &table, &[ram.fd.as_raw_fd()]);

        let (mut kicks, mut calls) = (Vec::new(), Vec::new());
        for q in 0..4u16 {
            let index = u32::from(q);
            send_acked(&mut stream, SET_VRING_NUM, &vring_state(index, u32::from(QUEUE_SIZE)), &[]);
            let mut addr = Vec::new();
            addr.extend_from_slice(&index.to_ne_bytes());
            addr.extend_from_slice(&0u32.to_ne_bytes());
            for v in [IOVA + desc_off(q), IOVA + used_off(q), IOVA + avail_off(q), 0] {
                addr.extend_from_slice(&v.to_ne_bytes());
            }
            send_acked(&mut stream, SET_VRING_ADDR, &addr, &[]);
            send_acked(&mut stream, SET_VRING_BASE, &vring_state(index, 0), &[]);
            let call = eventfd();
            send_acked(&mut stream, SET_VRING_CALL, &u64::from(q).to_ne_bytes(), &[call.as_raw_fd()]);
            let kick = eventfd();
            send_acked(&mut stream, SET_VRING_KICK, &u64::from(q).to_ne_bytes(), &[kick.as_raw_fd()]);
            send_acked(&mut stream, SET_VRING_ENABLE, &vring_state(index, 1), &[]);
            kicks.push(kick);
            calls.push(call);
        }
        let session = Session {
            device,
            stream,
            backend,
            ram,
            kicks,
            calls,
            next_slot: [0; 4],
            next_tag: 1,
            next_data: DATA_OFF,
            event_buffers: 0,
            answer_misses: false,
        };
        if map_all {
            let mut session = session;
            session.iotlb(IOTLB_UPDATE, IOVA, MEM_SIZE, UADDR, ACCESS_RW);
            return session;
        }
        session
    }

    pub fn iotlb(&mut self, kind: u8, iova: u64, size: u64, uaddr: u64, perm: u8) {
        send_acked(&mut self.stream, IOTLB_MSG, &iotlb_payload(iova, size, uaddr, perm, kind), &[]);
    }

    /// Puts a QUERY_DEVICE chain (request, then writable response) at `head`/`head+1` and publishes it.
    pub fn post_query_device(&self, slot: u16, head: u16, tag: u32, resp_len: u32) {
        let q = 0;
        let req_off = buf_off(q, u64::from(head));
        let resp_off = buf_off(q, u64::from(head) + 1);
        let mut request = Vec::new();
        for v in [1u32, tag, 0, 0] {
            request.extend_from_slice(&v.to_le_bytes());
        }
        self.ram.write(req_off, &request);
        self.ram.write(resp_off, &vec![0xaa; resp_len as usize]);
        self.ram.set_desc(q, head, IOVA + req_off, 16, DESC_F_NEXT, head + 1);
        self.ram.set_desc(q, head + 1, IOVA + resp_off, resp_len, DESC_F_WRITE, 0);
        self.ram.publish(q, slot, head);
        signal(&self.kicks[usize::from(q)]);
    }

    /// Waits for queue `q`'s call eventfd, answering IOTLB misses on the backend channel meanwhile (identity
    /// over the IOVA window) when `answer_misses` is set. Returns the misses seen as (iova, perm).
    pub fn wait_call(&mut self, q: u16, answer_misses: bool, timeout: Duration) -> Vec<(u64, u8)> {
        let deadline = Instant::now() + timeout;
        let mut misses = Vec::new();
        loop {
            let mut fds = [
                libc::pollfd { fd: self.calls[usize::from(q)].as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.backend.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "queue {q}: no call within {timeout:?}; misses so far {misses:x?}");
            // SAFETY: fds is a live array of 2 pollfds.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, left.as_millis() as i32) };
            assert!(n >= 0);
            if fds[0].revents & libc::POLLIN != 0 {
                let mut value = [0u8; 8];
                // SAFETY: reads 8 bytes into a live buffer from our eventfd.
                unsafe { libc::read(fds[0].fd, value.as_mut_ptr().cast(), 8) };
                // Collect misses already queued so they are not mistaken for the next request's.
                while self.backend_readable() {
                    misses.push(self.read_miss());
                }
                return misses;
            }
            if fds[1].revents & libc::POLLIN != 0 {
                let (iova, perm) = self.read_miss();
                misses.push((iova, perm));
                if answer_misses {
                    let page = iova & !(PAGE - 1);
                    assert!((IOVA..IOVA + MEM_SIZE).contains(&page), "miss outside the IOVA window: {iova:#x}");
                    self.iotlb(IOTLB_UPDATE, page, PAGE, UADDR + (page - IOVA), ACCESS_RW);
                }
            }
        }
    }

    fn backend_readable(&self) -> bool {
        let mut fd = libc::pollfd { fd: self.backend.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one live pollfd, zero timeout.
        unsafe { libc::poll(&mut fd, 1, 0) == 1 && fd.revents & libc::POLLIN != 0 }
    }

    /// Reads one backend-channel message and checks it is an IOTLB MISS (left unanswered: an older front-end).
    pub fn read_miss(&mut self) -> (u64, u8) {
        let mut msg = [0u8; MISS_MESSAGE_SIZE];
        self.backend.read_exact(&mut msg).expect("backend message");
        parse_miss(&msg)
    }

    fn take_slot(&mut self, q: u16) -> u16 {
        let slot = self.next_slot[usize::from(q)];
        self.next_slot[usize::from(q)] = slot.wrapping_add(1);
        slot
    }

    /// Waits until queue `q` has returned the chain published in avail slot `slot`.
    pub fn wait_used(&mut self, q: u16, slot: u16) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.ram.used_idx(q).wrapping_sub(slot) == 0 || self.ram.used_idx(q).wrapping_sub(slot) > QUEUE_SIZE {
            assert!(Instant::now() < deadline, "queue {q}: slot {slot} never used");
            self.wait_call(q, self.answer_misses, Duration::from_secs(10));
        }
    }

    /// Guest pages for rings and MRs, with an unused guard page after them; returns their offset in guest RAM.
    pub fn alloc(&mut self, pages: u64) -> u64 {
        let off = self.next_data;
        self.next_data += (pages + 1) * PAGE;
        assert!(self.next_data <= MEM_SIZE, "test guest RAM exhausted");
        off
    }

    /// IOVAs of `pages` pages from offset `off`.
    pub fn page_list(off: u64, pages: u64) -> Vec<u64> {
        (0..pages).map(|p| IOVA + off + p * PAGE).collect()
    }

    /// Runs one command on queue 0 (request in buffer 0, response in buffer 1) and waits for its used entry.
    pub fn command(&mut self, opcode: vhca_proto::Opcode, body: &[u8], pages: &[u64]) -> (vhca_proto::Status, Vec<u8>) {
        let tag = self.next_tag;
        self.next_tag += 1;
        let req = verbs::request(opcode, tag, body, pages);
        assert!(req.len() <= PAGE as usize, "request must fit its one-page buffer");
        let (req_off, resp_off) = (buf_off(0, 0), buf_off(0, 1));
        const RESP: u32 = 256;
        self.ram.write(req_off, &req);
        self.ram.write(resp_off, &[0xaa; RESP as usize]);
        self.ram.set_desc(0, 0, IOVA + req_off, req.len() as u32, DESC_F_NEXT, 1);
        self.ram.set_desc(0, 1, IOVA + resp_off, RESP, DESC_F_WRITE, 0);
        let slot = self.take_slot(0);
        self.ram.publish(0, slot, 0);
        signal(&self.kicks[0]);
        self.wait_used(0, slot);
        let (head, len) = self.ram.used_elem(0, slot);
        assert_eq!(head, 0);
        assert!(len as usize >= vhca_proto::RESPONSE_HEADER_SIZE, "{opcode:?}: response of {len} bytes");
        let (status, echoed, body) = verbs::parse_response(&self.ram.read(resp_off, len as usize));
        assert_eq!(echoed, tag, "response to the wrong command");
        (status, body)
    }

    /// A command that must succeed; returns its body.
    pub fn command_ok(&mut self, opcode: vhca_proto::Opcode, body: &[u8], pages: &[u64]) -> Vec<u8> {
        let (status, body) = self.command(opcode, body, pages);
        assert_eq!(status, vhca_proto::Status::Ok, "{opcode:?}");
        body
    }

    /// Registers `pages` fresh pages as an MR; the status, and the MR when it was accepted.
    pub fn reg_mr(&mut self, pd: u32, access: u32, pages: u64) -> (vhca_proto::Status, Option<TestMr>) {
        let off = self.alloc(pages);
        let len = pages * PAGE;
        let addr = MR_ADDR_BASE + off;
        let body = verbs::reg_mr_body(pd, access, addr, len, pages as u32);
        let (status, resp) = self.command(vhca_proto::Opcode::RegMr, &body, &Session::page_list(off, pages));
        let mr = (status == vhca_proto::Status::Ok).then(|| {
            let key = <vhca_proto::RegMrResp as zerocopy::FromBytes>::read_from_bytes(&resp).unwrap().lkey.get();
            TestMr { key, addr, len, off }
        });
        (status, mr)
    }

    /// PD, a 64-entry CQ, a QP (16/16) looped back to itself in RTS with all rights, and two MRs of `mr_pages`.
    pub fn loopback(&mut self, mr_pages: u64) -> Loopback {
        use vhca_proto::{Opcode, ACCESS_ALL, CQE_SIZE, WQE_SIZE};
        let pd = verbs::handle_of(&self.command_ok(Opcode::AllocPd, &[], &[]));
        let cq_entries = 64;
        let cq_pages = vhca_proto::ring_pages(cq_entries, CQE_SIZE);
        let cq_off = self.alloc(cq_pages);
        let body = verbs::create_cq_body(cq_entries, cq_pages as u32);
        let cq = verbs::handle_of(&self.command_ok(Opcode::CreateCq, &body, &Session::page_list(cq_off, cq_pages)));
        let sq_entries = 16;
        let ring = vhca_proto::ring_pages(sq_entries, WQE_SIZE);
        let sq_off = self.alloc(ring);
        let rq_off = self.alloc(ring);
        let mut pages = Session::page_list(sq_off, ring);
        pages.extend(Session::page_list(rq_off, ring));
        let body = verbs::create_qp_body(pd, cq, sq_entries, sq_entries);
        let qpn = verbs::handle_of(&self.command_ok(Opcode::CreateQp, &body, &pages));
        for body in verbs::bring_up_bodies(qpn, qpn, ACCESS_ALL) {
            self.command_ok(Opcode::ModifyQp, &body, &[]);
        }
        let src = self.reg_mr(pd, ACCESS_ALL, mr_pages).1.expect("source MR");
        let dst = self.reg_mr(pd, ACCESS_ALL, mr_pages).1.expect("destination MR");
        Loopback { pd, cq, cq_entries, cq_off, qpn, sq_off, sq_entries, src, dst }
    }

    /// Publishes one chain of doorbell records on queue 2 and waits for the device to consume it.
    pub fn ring(&mut self, records: &[u8]) {
        let off = buf_off(2, 0);
        self.ram.write(off, records);
        self.ram.set_desc(2, 0, IOVA + off, records.len() as u32, 0, 0);
        let slot = self.take_slot(2);
        self.ram.publish(2, slot, 0);
        signal(&self.kicks[2]);
        self.wait_used(2, slot);
    }

    /// Writes WQE `index` into the SQ ring (as the driver does) and rings the SQ doorbell with producer index+1.
    pub fn post_send(&mut self, lb: &Loopback, index: u32, wqe: &vhca_proto::Wqe) {
        let slot = u64::from(index % lb.sq_entries);
        self.ram.write(lb.sq_off + slot * vhca_proto::WQE_SIZE as u64, zerocopy::IntoBytes::as_bytes(wqe));
        self.ring(&verbs::doorbell(vhca_proto::DoorbellKind::SendQueue, lb.qpn, index + 1, 0));
    }

    /// The CQE at ring index `index` if the device has written it (owner word valid for that lap).
    pub fn cqe(&self, lb: &Loopback, index: u32) -> Option<vhca_proto::Cqe> {
        let slot = u64::from(index % lb.cq_entries);
        let raw = self.ram.read(lb.cq_off + slot * vhca_proto::CQE_SIZE as u64, vhca_proto::CQE_SIZE);
        verbs::valid_cqe(&raw, index, lb.cq_entries)
    }

    /// Posts `n` more 32-byte device-writable buffers on the event queue (queue 1).
    pub fn post_event_buffers(&mut self, n: u16) {
        for _ in 0..n {
            let i = self.event_buffers;
            assert!(i < 12, "out of event buffer pages (queue 1 has 12 buffer pages)");
            self.event_buffers += 1;
            self.ram.write(buf_off(1, u64::from(i)), &[0u8; vhca_proto::EVENT_SIZE]);
            self.ram.set_desc(1, i, IOVA + buf_off(1, u64::from(i)), vhca_proto::EVENT_SIZE as u32, DESC_F_WRITE, 0);
            let slot = self.take_slot(1);
            self.ram.publish(1, slot, i);
        }
        signal(&self.kicks[1]);
    }

    /// Waits until the device has filled `n` event buffers in total.
    pub fn wait_events(&mut self, n: u16) {
        if n > 0 {
            self.wait_used(1, n - 1);
        }
    }

    /// The events the device has put on queue 1 so far, in order.
    pub fn events_delivered(&self) -> Vec<vhca_proto::Event> {
        (0..self.ram.used_idx(1))
            .map(|slot| {
                let (head, len) = self.ram.used_elem(1, slot);
                assert_eq!(len as usize, vhca_proto::EVENT_SIZE, "an event fills its buffer");
                let raw = self.ram.read(buf_off(1, u64::from(head)), vhca_proto::EVENT_SIZE);
                <vhca_proto::Event as zerocopy::FromBytes>::read_from_bytes(&raw).unwrap()
            })
            .collect()
    }

    /// Closes the front-end socket and waits for the device to exit.
    pub fn close(self) -> (ExitStatus, String, Vec<serde_json::Value>) {
        let Session { device, stream, backend, ram, .. } = self;
        drop(stream);
        drop(backend);
        let result = device.finish();
        drop(ram);
        result
    }
}

/// Header and `vhost_iotlb_msg` of a miss on the backend channel.
pub const MISS_MESSAGE_SIZE: usize = 12 + 32;

/// (iova, perm) of a miss, checked as such: BACKEND_IOTLB_MSG asking for a reply (the session negotiates REPLY_ACK).
pub fn parse_miss(msg: &[u8; MISS_MESSAGE_SIZE]) -> (u64, u8) {
    assert_eq!(u32::from_ne_bytes(msg[0..4].try_into().unwrap()), 1, "BACKEND_IOTLB_MSG");
    assert_eq!(u32::from_ne_bytes(msg[4..8].try_into().unwrap()), 0x1 | NEED_REPLY, "version 1 and need_reply");
    assert_eq!(u32::from_ne_bytes(msg[8..12].try_into().unwrap()), 32);
    assert_eq!(msg[12 + 25], IOTLB_MISS);
    (u64::from_ne_bytes(msg[12..20].try_into().unwrap()), msg[12 + 24])
}

pub fn write_all(stream: &mut UnixStream, bytes: &[u8]) {
    stream.write_all(bytes).unwrap();
}
