//! vhca-queues against a device played in process: the queues' memory is one heap arena the "device" reads and
//! writes by IOVA, and each notify runs the device over the avail ring at once, as a polled driver sees it.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::{Cell, RefCell};
use std::ptr::NonNull;
use std::rc::Rc;
use std::time::Duration;

use vhca_driver_core::CommandTransportError;
use vhca_proto::{
    CommandHeader, Event, Opcode, QueryDeviceResp, ResponseHeader, Status, EVENT_SIZE, MAX_REQUEST_SIZE,
    RESPONSE_HEADER_SIZE,
};
use vhca_queues::{CommandError, CommandQueue, DoorbellQueue, EventQueue, HcaQueues, Notify, WaitSource};
use vhca_virtio::{DmaMemory, PollWait, RingLayout, SplitQueue};
use zerocopy::{FromBytes, IntoBytes};

const IOVA_BASE: u64 = 0x10_0000_0000;
const ARENA: usize = 1 << 20;
const QUEUE_SIZE: u16 = 8;

/// Page-aligned memory the device reaches at IOVA_BASE + offset.
struct Arena {
    ptr: NonNull<u8>,
    next: Cell<usize>,
}

impl Arena {
    fn new() -> Rc<Arena> {
        let layout = Layout::from_size_align(ARENA, 4096).unwrap();
        // SAFETY: non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) }).unwrap();
        Rc::new(Arena { ptr, next: Cell::new(0) })
    }

    fn region(self: &Rc<Arena>, len: usize) -> Region {
        let offset = self.next.get();
        let rounded = len.div_ceil(4096) * 4096;
        assert!(offset + rounded <= ARENA);
        self.next.set(offset + rounded);
        Region { arena: self.clone(), offset, len }
    }

    fn at(&self, iova: u64, len: usize) -> *mut u8 {
        let offset = usize::try_from(iova - IOVA_BASE).unwrap();
        assert!(offset + len <= ARENA, "device access outside the arena");
        self.ptr.as_ptr().wrapping_add(offset)
    }

    fn read(&self, iova: u64, out: &mut [u8]) {
        // SAFETY: `at` checked the range lies inside the arena.
        unsafe { std::ptr::copy_nonoverlapping(self.at(iova, out.len()), out.as_mut_ptr(), out.len()) }
    }

    fn write(&self, iova: u64, bytes: &[u8]) {
        // SAFETY: `at` checked the range lies inside the arena.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.at(iova, bytes.len()), bytes.len()) }
    }

    fn u16_at(&self, iova: u64) -> u16 {
        let mut b = [0u8; 2];
        self.read(iova, &mut b);
        u16::from_le_bytes(b)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align(ARENA, 4096).unwrap()) }
    }
}

struct Region {
    arena: Rc<Arena>,
    offset: usize,
    len: usize,
}

// SAFETY: a page-aligned slice of the arena, which lives as long as any region of it (Rc).
unsafe impl DmaMemory for Region {
    fn host_ptr(&self) -> NonNull<u8> {
        NonNull::new(self.arena.ptr.as_ptr().wrapping_add(self.offset)).unwrap()
    }
    fn iova(&self) -> u64 {
        IOVA_BASE + self.offset as u64
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// One descriptor of a chain as the device reads it.
#[derive(Debug, Clone, Copy)]
struct Desc {
    iova: u64,
    len: u32,
    device_writes: bool,
}

/// The device's side of one queue: what it does with each chain (None: it never completes it).
type Handler = Box<dyn Fn(&Arena, &[Desc]) -> Option<u32>>;

struct DeviceQueue {
    arena: Rc<Arena>,
    ring: u64,
    layout: RingLayout,
    last_avail: Cell<u16>,
    handler: Handler,
}

/// The notifier: runs the device over every chain made available since the last notify.
#[derive(Clone)]
struct DeviceNotify(Rc<DeviceQueue>);

impl Notify for DeviceNotify {
    type Error = String;
    fn notify(&self) -> Result<(), String> {
        let q = &self.0;
        let size = q.layout.size as u64;
        let avail = q.ring + q.layout.avail as u64;
        let used = q.ring + q.layout.used as u64;
        while q.last_avail.get() != q.arena.u16_at(avail + 2) {
            let head = q.arena.u16_at(avail + 4 + 2 * (q.last_avail.get() as u64 % size));
            let mut chain = Vec::new();
            let mut index = head;
            loop {
                let mut raw = [0u8; 16];
                q.arena.read(q.ring + q.layout.desc as u64 + 16 * index as u64, &mut raw);
                let flags = u16::from_le_bytes([raw[12], raw[13]]);
                chain.push(Desc {
                    iova: u64::from_le_bytes(raw[..8].try_into().unwrap()),
                    len: u32::from_le_bytes(raw[8..12].try_into().unwrap()),
                    device_writes: flags & 2 != 0,
                });
                if flags & 1 == 0 {
                    break;
                }
                index = u16::from_le_bytes([raw[14], raw[15]]);
            }
            q.last_avail.set(q.last_avail.get().wrapping_add(1));
            if let Some(written) = (q.handler)(&q.arena, &chain) {
                let used_idx = q.arena.u16_at(used + 2);
                let mut element = [0u8; 8];
                element[..4].copy_from_slice(&(head as u32).to_le_bytes());
                element[4..].copy_from_slice(&written.to_le_bytes());
                q.arena.write(used + 4 + 8 * (used_idx as u64 % size), &element);
                q.arena.write(used + 2, &used_idx.wrapping_add(1).to_le_bytes());
            }
        }
        Ok(())
    }
}

fn queue(arena: &Rc<Arena>, handler: Handler) -> (SplitQueue<Region>, DeviceNotify) {
    let layout = RingLayout::new(QUEUE_SIZE).unwrap();
    let memory = arena.region(layout.bytes);
    let ring = memory.iova();
    let split = SplitQueue::new(QUEUE_SIZE, memory).unwrap();
    let device = DeviceQueue { arena: arena.clone(), ring, layout, last_avail: Cell::new(0), handler };
    (split, DeviceNotify(Rc::new(device)))
}

/// A few polls, no sleeping: a completion that is not there at once never comes.
struct Polls;
struct FewPolls(u32);

impl PollWait for FewPolls {
    fn pause(&mut self) -> bool {
        self.0 = self.0.saturating_sub(1);
        self.0 > 0
    }
    fn limit(&self) -> Duration {
        Duration::from_millis(1)
    }
}

impl WaitSource for Polls {
    type Wait = FewPolls;
    fn wait(&self) -> FewPolls {
        FewPolls(3)
    }
}

fn command_queue(arena: &Rc<Arena>, handler: Handler) -> CommandQueue<Region, DeviceNotify, Polls> {
    let (split, notify) = queue(arena, handler);
    CommandQueue::new(split, notify, arena.region(MAX_REQUEST_SIZE), arena.region(4096), Polls)
}

/// Answers every command Ok with a QUERY_DEVICE body, after checking the response buffer came poisoned.
fn answering_device(written: Option<u32>) -> Handler {
    Box::new(move |arena, chain| {
        assert_eq!(chain.len(), 2, "request and response");
        assert!(!chain[0].device_writes && chain[1].device_writes);
        let mut request = vec![0u8; chain[0].len as usize];
        arena.read(chain[0].iova, &mut request);
        let header = CommandHeader::read_from_prefix(&request).unwrap().0;
        let mut poisoned = vec![0u8; chain[1].len as usize];
        arena.read(chain[1].iova, &mut poisoned);
        assert!(poisoned.iter().all(|&b| b == 0xa5), "the response buffer is poisoned before each command");
        let body = QueryDeviceResp { abi_version: 1.into(), page_size: 4096.into(), ..Default::default() };
        let response = ResponseHeader {
            status: (Status::Ok as u32).into(),
            opcode: header.opcode,
            tag: header.tag,
            body_len: (body.as_bytes().len() as u32).into(),
        };
        let mut bytes = response.as_bytes().to_vec();
        bytes.extend_from_slice(body.as_bytes());
        arena.write(chain[1].iova, &bytes);
        Some(written.unwrap_or(bytes.len() as u32))
    })
}

#[test]
fn query_device_goes_through_the_rings_and_is_checked() {
    let arena = Arena::new();
    let mut commands = command_queue(&arena, answering_device(None));
    let (resp, response) = commands.query_device().unwrap();
    assert_eq!(resp.page_size.get(), 4096);
    assert_eq!(response.header.opcode.get(), Opcode::QueryDevice as u32);
    // A second command carries the next tag, on the descriptors the first gave back.
    let (_, second) = commands.query_device().unwrap();
    assert_eq!(second.header.tag.get(), response.header.tag.get() + 1);
}

#[test]
fn a_device_that_writes_less_than_a_header_is_refused() {
    let arena = Arena::new();
    let mut commands = command_queue(&arena, answering_device(Some(4)));
    match commands.execute(Opcode::QueryDevice, &[]) {
        Err(CommandError::ShortResponse { written: 4, need, .. }) => assert_eq!(need, RESPONSE_HEADER_SIZE),
        other => panic!("expected ShortResponse, got {other:?}"),
    }
}

#[test]
fn a_silent_device_is_a_timeout_for_the_core() {
    let arena = Arena::new();
    let commands = command_queue(&arena, Box::new(|_, _| None));
    let (events, event_notify) = queue(&arena, Box::new(|_, _| None));
    let events = EventQueue::new(events, event_notify, arena.region(4096), 4).unwrap();
    let (doorbells, doorbell_notify) = queue(&arena, Box::new(|_, _| None));
    let doorbells = DoorbellQueue::new(doorbells, doorbell_notify, arena.region(4096), Polls);
    let mut queues = HcaQueues { commands, doorbells, events };
    let notes = RefCell::new(Vec::new());
    let note = |m: std::fmt::Arguments<'_>| notes.borrow_mut().push(m.to_string());
    let request = [0u8; 16];
    assert_eq!(queues.execute(&request, 64, &note), Err(CommandTransportError::Timeout));
    assert_eq!(queues.ring_doorbell(&[1, 2, 3, 4], &note), Err(CommandTransportError::Timeout));
    assert_eq!(
        queues.ring_doorbell(&[], &note),
        Err(CommandTransportError::Refused(0)),
        "an empty doorbell is refused"
    );
    assert_eq!(queues.poll_event(&note), None);
}

#[test]
fn events_arrive_in_order_and_their_buffers_go_back() {
    let arena = Arena::new();
    // Five events for four buffers: the fifth arrives only if a buffer that was read is posted again.
    let filled = Rc::new(Cell::new(0u32));
    let counter = filled.clone();
    let (split, notify) = queue(
        &arena,
        Box::new(move |arena, chain| {
            assert_eq!((chain.len(), chain[0].len as usize, chain[0].device_writes), (1, EVENT_SIZE, true));
            if counter.get() >= 5 {
                return None;
            }
            counter.set(counter.get() + 1);
            let event = Event { kind: 3.into(), handle: counter.get().into(), ..Default::default() };
            arena.write(chain[0].iova, event.as_bytes());
            Some(EVENT_SIZE as u32)
        }),
    );
    let mut events = EventQueue::new(split, notify, arena.region(4096), 4).unwrap();
    let note = |m: std::fmt::Arguments<'_>| panic!("unexpected note: {m}");
    let handles: Vec<u32> = std::iter::from_fn(|| events.poll(&note)).map(|e| e.handle.get()).collect();
    assert_eq!(handles, [1, 2, 3, 4, 5], "in order, the fifth in a reposted buffer");
    assert_eq!(filled.get(), 5);
}

#[test]
fn doorbell_records_reach_the_device_whole() {
    let arena = Arena::new();
    let seen = Rc::new(RefCell::new(Vec::new()));
    let sink = seen.clone();
    let (split, notify) = queue(
        &arena,
        Box::new(move |arena, chain| {
            let mut bytes = vec![0u8; chain[0].len as usize];
            arena.read(chain[0].iova, &mut bytes);
            sink.borrow_mut().push(bytes);
            Some(0)
        }),
    );
    let mut doorbells = DoorbellQueue::new(split, notify, arena.region(4096), Polls);
    let note = |m: std::fmt::Arguments<'_>| panic!("unexpected note: {m}");
    doorbells.ring(&[7; 24], &note).unwrap();
    doorbells.ring(&[9; 48], &note).unwrap();
    assert_eq!(*seen.borrow(), vec![vec![7u8; 24], vec![9u8; 48]]);
    assert_eq!(doorbells.ring(&[0; 8192], &note), Err(CommandTransportError::Refused(8192)), "larger than the buffer");
}

/// A signal that records its calls and lets its deadline pass after two sleeps.
#[derive(Default)]
struct CountedSignal(std::sync::Mutex<Vec<&'static str>>);

impl vhca_driver_core::CompletionSignal for CountedSignal {
    fn begin(&self, _limit: Duration) {
        self.0.lock().unwrap().push("begin");
    }
    fn sleep(&self) -> bool {
        let mut calls = self.0.lock().unwrap();
        calls.push("sleep");
        calls.iter().filter(|c| **c == "sleep").count() < 2
    }
    fn end(&self) {
        self.0.lock().unwrap().push("end");
    }
}

#[test]
fn a_command_on_a_signalled_queue_sleeps_on_the_signal_between_polls_and_ends_its_wait_on_every_path() {
    let arena = Arena::new();
    let silent = command_queue(&arena, Box::new(|_, _| None));
    let mut commands = silent.map_waits(vhca_queues::SignalledWaits::new);
    let signal = std::sync::Arc::new(CountedSignal::default());
    commands.waits_mut().attach(Some(signal.clone()));
    let note = |_: std::fmt::Arguments<'_>| {};
    // The device never answers: the wait sleeps until the signal's deadline, and the core hears a timeout.
    assert_eq!(commands.execute_for_core(&[0u8; 16], 64, &note), Err(CommandTransportError::Timeout));
    assert_eq!(*signal.0.lock().unwrap(), ["begin", "sleep", "sleep", "end"]);
    // An answering device: the first poll finds the response, and the wait still ends.
    let mut answering = command_queue(&arena, answering_device(None)).map_waits(vhca_queues::SignalledWaits::new);
    let signal = std::sync::Arc::new(CountedSignal::default());
    answering.waits_mut().attach(Some(signal.clone()));
    answering.query_device().expect("query_device");
    assert_eq!(*signal.0.lock().unwrap(), ["begin", "end"], "answered before any sleep");
    // Detached: polling again, the signal is left alone.
    answering.waits_mut().attach(None);
    answering.query_device().expect("query_device");
    assert_eq!(signal.0.lock().unwrap().len(), 2);
}
