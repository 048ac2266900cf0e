//! The queue worker: one thread that waits on the kick eventfds, pops descriptor chains through the
//! IOMMU-translated memory and hands their bytes to the HCA. A chain whose rings or buffers miss in the IOTLB is
//! parked (put back, untouched) until QEMU answers the miss, or refused as an IOMMU fault when it never does.
//! After a pass it writes the call eventfd of each queue that used buffers and whose driver wants it, within the
//! queue's rate bound (`notifications`); its timers are the parked chains' misses, the bound's deferred
//! notifications and the request the hold_completion knob holds, so nothing it waits for stops the other queues.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vhca_hca::Hca;
use vhca_proto::{
    EventKind, FaultCause, EVENT_SIZE, MAX_REQUEST_SIZE, QUEUE_COMMAND, QUEUE_DOORBELL, QUEUE_EVENT, QUEUE_RESERVED,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, Permissions};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;
use zerocopy::IntoBytes;

use crate::event_log::TransportEvent;
use crate::iommu::{FaultKind, TranslationFault};
use crate::iommu_dma::{fault_event, QueueDma};
use crate::memory::GuestMem;
use crate::notifications::{Decision, QueueNotifier, RateBound};
use crate::queue_polling::{allow_kicks, suppress_kicks, KickSuppression, Next, PollWindow};
use crate::shared::{lock, Shared};
use crate::vring::{Parked, VringState};

const WAKE_TOKEN: u64 = u64::MAX;
/// The queues that carry requests, and so are busy-polled. The event queue holds posted buffers that wait for
/// events, so its avail index always runs ahead of the device: it is neither polled nor has its kicks suppressed.
const REQUEST_QUEUES: [u16; 2] = [QUEUE_COMMAND, QUEUE_DOORBELL];

/// What became of one popped chain.
enum Outcome {
    /// Returned with this many bytes written.
    Used(u32),
    /// Malformed: returned with length 0, and the cause logged.
    Refused(String),
    /// Part of it is not in the IOTLB yet.
    Miss(TranslationFault),
    /// The IOMMU refused it for good.
    Fault(TranslationFault),
    /// Event queue only: a buffer is posted but there is no event for it.
    NoEvent,
}

enum Step {
    Empty,
    Used,
    Parked,
    /// Taken off the avail ring but impossible to return (a head past the table): logged, and the chains behind
    /// it are served on this same pass, since the driver will not kick again for them.
    Dropped,
}

pub struct Worker {
    shared: Arc<Shared>,
    hca: Hca,
    epoll: Epoll,
    /// Our own dups of the kick fds, so a registration never outlives its fd.
    kicks: Vec<EventFd>,
    /// An event taken from the HCA whose buffer missed in the IOTLB; goes out first next time.
    pending_event: Option<vhca_proto::Event>,
    desc_log: Vec<TransportEvent>,
    /// Head of the chain being served, for log lines written deep inside it.
    head: u16,
    /// How long the thread keeps polling after the last work (`queue_polling`); zero: it only sleeps.
    poll_window: Duration,
    /// Each queue's notifications: what it used since its last one, and its rate bound.
    notifiers: Vec<QueueNotifier>,
    /// The event the event-queue chain being served carries, for the cause of its notification.
    chain_event: Option<(EventKind, u32)>,
    /// When the request the hold_completion knob holds is released (`Hca::take_new_hold`).
    hold_until: Option<Instant>,
}

impl Worker {
    pub fn new(shared: Arc<Shared>, hca: Hca) -> io::Result<Worker> {
        let epoll = Epoll::new()?;
        let notifiers = (0..shared.vrings.len())
            .map(|queue| QueueNotifier::new(u16::try_from(queue).unwrap_or(u16::MAX), RateBound::default()))
            .collect();
        let mut worker = Worker {
            shared,
            hca,
            epoll,
            kicks: Vec::new(),
            pending_event: None,
            desc_log: Vec::new(),
            head: 0,
            poll_window: Duration::ZERO,
            notifiers,
            chain_event: None,
            hold_until: None,
        };
        worker.rebuild_epoll()?;
        Ok(worker)
    }

    /// The worker thread; it busy-polls for `poll_window` after each piece of work (zero: never), and runs with
    /// scheduler slice `slice` (`thread_sched`; zero: the kernel's default).
    pub fn spawn(
        shared: Arc<Shared>,
        hca: Hca,
        poll_window: Duration,
        slice: Duration,
        notify_bound: RateBound,
    ) -> io::Result<JoinHandle<()>> {
        let mut worker = Worker::new(shared, hca)?.with_notify_bound(notify_bound);
        worker.poll_window = poll_window;
        crate::thread_sched::spawn("vhca-queues", slice, move || worker.run())
    }

    /// Every queue's notifications bounded by `bound` instead of `RateBound::default()`.
    pub fn with_notify_bound(mut self, bound: RateBound) -> Worker {
        for (queue, notifier) in self.notifiers.iter_mut().enumerate() {
            *notifier = QueueNotifier::new(u16::try_from(queue).unwrap_or(u16::MAX), bound);
        }
        self
    }

    /// One pass over every queue, as the thread makes after each wake-up. For single-threaded drivers of the
    /// device (the fuzzer), which interleave it with the connection's requests deterministically.
    pub fn serve_queues(&mut self) {
        self.serve_pass();
    }

    /// `serve_queues`; true when a chain was returned to a used ring.
    fn serve_pass(&mut self) -> bool {
        self.tell_hca_invalidations();
        let now = Instant::now();
        self.release_held_work(now);
        self.send_due_notifications(now);
        let mut served = false;
        // The event queue last: the events the others' work raised go out in the same pass.
        for queue in [QUEUE_COMMAND, QUEUE_DOORBELL, QUEUE_RESERVED, QUEUE_EVENT] {
            served |= self.process_queue(queue);
        }
        if let Some(hold) = self.hca.take_new_hold() {
            self.hold_until = Some(Instant::now() + hold);
        }
        served
    }

    /// Runs the request the hold_completion knob held, once its time is up. Its DMA is translated now, through the
    /// doorbell queue's path as when it was rung: an IOVA the driver unmapped meanwhile is refused with its cause.
    fn release_held_work(&mut self, now: Instant) {
        if self.hold_until.is_none_or(|until| now < until) {
            return;
        }
        self.hold_until = None;
        let shared = Arc::clone(&self.shared);
        let mem = shared.mem();
        self.hca.release_held_work(&QueueDma::new(&shared, &mem, QUEUE_DOORBELL));
    }

    /// Sends each deferred notification that is due, unless its ring stopped or its driver declines them now.
    fn send_due_notifications(&mut self, now: Instant) {
        let shared = Arc::clone(&self.shared);
        for (notifier_queue, (notifier, vring)) in (0u16..).zip(self.notifiers.iter_mut().zip(&shared.vrings)) {
            if notifier.due().is_none_or(|due| now < due) {
                continue;
            }
            let vring = lock(vring);
            let mem = shared.mem();
            if !vring.runnable() || driver_declines_interrupts(&mem, vring.queue.avail_ring()) {
                notifier.declined();
            } else if let Some(line) = notifier.take_due(now) {
                signal_call(&shared, notifier_queue, &line);
            }
        }
    }

    fn run(mut self) {
        let mut events = vec![EpollEvent::default(); 16];
        let mut window = PollWindow::new(self.poll_window);
        let mut serve_now = false;
        loop {
            if self.shared.stopping() {
                break;
            }
            if self.shared.kicks_changed.swap(false, Ordering::AcqRel) {
                if let Err(err) = self.rebuild_epoll() {
                    tracing::error!("queue worker: cannot watch kick fds: {err}");
                    break;
                }
                // A ring (re)started: one that stopped mid-window may still carry this device's flag. A chain the
                // driver published under the flag, without a kick, is served now: the epoll wait below may be
                // forever, and no kick will come for it (a queue set up late, mid-window, lost requests so).
                serve_now |= window.close(&mut RequestRings(&self.shared));
            } else if !window.is_open() {
                // A ring stopped with the flag set and enabled again since: clear it before sleeping on its kicks,
                // and serve at once what was published under it.
                serve_now |= RequestRings(&self.shared).allow();
            }
            let timeout = if window.is_open() || serve_now { 0 } else { self.timeout_ms() };
            let count = match self.epoll.wait(timeout, &mut events) {
                Ok(count) => count,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => 0,
                Err(err) => {
                    tracing::error!("queue worker: epoll failed: {err}");
                    break;
                }
            };
            for event in &events[..count] {
                // Both are non-blocking counters; reading just resets them, and an empty read is harmless.
                if event.data() == WAKE_TOKEN {
                    let _ = self.shared.wake.read();
                } else if let Some(kick) = self.kicks.get(event.data() as usize) {
                    let _ = kick.read();
                }
            }
            if self.shared.stopping() {
                break;
            }
            let served = self.serve_pass();
            serve_now = match window.after_pass(served, Instant::now(), &mut RequestRings(&self.shared)) {
                Next::Poll => {
                    // No sched_yield here: on a loaded host a yielding worker lost its core for milliseconds, could
                    // not close its window, and the driver skipped kicks all that time (docs/bench.md section 5).
                    std::hint::spin_loop();
                    false
                }
                Next::Serve => true,
                Next::Sleep => false,
            };
        }
        // Whatever the driver sees of this device from now on, it must kick.
        RequestRings(&self.shared).allow();
        tracing::info!("queue worker stopped");
    }

    fn rebuild_epoll(&mut self) -> io::Result<()> {
        self.epoll = Epoll::new()?;
        self.kicks.clear();
        self.epoll.ctl(
            ControlOperation::Add,
            std::os::fd::AsRawFd::as_raw_fd(&self.shared.wake),
            EpollEvent::new(EventSet::IN, WAKE_TOKEN),
        )?;
        for (index, vring) in self.shared.vrings.iter().enumerate() {
            let vring = lock(vring);
            let Some(kick) = vring.kick.as_ref() else { continue };
            let token = self.kicks.len() as u64;
            let watched = kick.try_clone().and_then(|copy| {
                let fd = std::os::fd::AsRawFd::as_raw_fd(&copy);
                self.epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token))?;
                Ok(copy)
            });
            match watched {
                Ok(copy) => {
                    tracing::debug!("watching kick fd of queue {index}");
                    self.kicks.push(copy);
                }
                // One queue's bad kick fd must not stop the worker that serves the others.
                Err(err) => tracing::error!("queue {index}: cannot watch its kick fd, kicks are not seen: {err}"),
            }
        }
        Ok(())
    }

    /// Sleep until the earliest parked chain's miss times out, a deferred notification is due or a held request
    /// is released; or forever.
    fn timeout_ms(&self) -> i32 {
        let now = Instant::now();
        let deadline = self
            .shared
            .vrings
            .iter()
            .filter_map(|vring| lock(vring).parked.map(|parked| parked.since + self.shared.miss_timeout))
            .chain(self.notifiers.iter().filter_map(QueueNotifier::due))
            .chain(self.hold_until)
            .min();
        match deadline {
            None => -1,
            Some(deadline) => {
                let ms = deadline.saturating_duration_since(now).as_millis() + 1;
                i32::try_from(ms).unwrap_or(i32::MAX)
            }
        }
    }

    /// Hands the HCA every invalidation the front-end has applied to the IOTLB so far. Called per wake-up and again
    /// right before each chain reaches the HCA: a chain the guest published after QEMU's (acknowledged) invalidation
    /// may be popped in the same pass that started before the invalidation arrived, and its DMA must already meet
    /// the stale register, as it would on an HCA whose translation cache QEMU had flushed.
    fn tell_hca_invalidations(&mut self) {
        let pending = std::mem::take(&mut *lock(&self.shared.invalidations));
        for (iova, size) in pending {
            self.hca.iotlb_invalidated(iova, size);
        }
    }

    /// Serves one queue until it is empty or parked; true when a chain went back to the used ring.
    fn process_queue(&mut self, queue: u16) -> bool {
        let shared = Arc::clone(&self.shared);
        let Some(vring) = shared.vrings.get(usize::from(queue)) else { return false };
        let mem = shared.mem();
        let mut vring = lock(vring);
        if !vring.runnable() {
            return false;
        }
        let mut used = false;
        while !shared.stopping() && !shared.control_pending.load(Ordering::Acquire) {
            match self.next_chain(&shared, &mem, queue, &mut vring) {
                Step::Used => used = true,
                Step::Dropped => {}
                Step::Empty | Step::Parked => break,
            }
        }
        if used {
            self.notify(&shared, &mem, queue, &mut vring);
        }
        used
    }

    /// After a pass that used `queue`'s buffers: a notification if its driver wants one, within its rate bound.
    fn notify(&mut self, shared: &Shared, mem: &GuestMem, queue: u16, vring: &mut VringState) {
        let Some(notifier) = self.notifiers.get_mut(usize::from(queue)) else { return };
        match vring.queue.needs_notification(mem) {
            Ok(true) if driver_declines_interrupts(mem, vring.queue.avail_ring()) => notifier.declined(),
            Ok(true) => match notifier.wanted(Instant::now()) {
                Decision::Notify(line) => signal_call(shared, queue, &line),
                Decision::Deferred { bounded: Some(line) } => {
                    tracing::warn!("queue {queue}: notifications bounded, the excess is coalesced");
                    shared.events.record(&line);
                }
                Decision::Deferred { bounded: None } => {}
            },
            // Only with VIRTIO_F_EVENT_IDX, which is not offered.
            Ok(false) => notifier.declined(),
            Err(err) => tracing::error!("queue {queue}: cannot decide on notification: {err}"),
        }
    }

    fn next_chain(&mut self, shared: &Shared, mem: &GuestMem, queue: u16, vring: &mut VringState) -> Step {
        let iommu = &shared.iommu;
        iommu.clear_fault();
        // The used ring must be writable before any chain is taken, so a chain is never lost for want of it.
        let size = vring.queue.size();
        let used_len = 4 + 8 * usize::from(size);
        if !mem.check_range(GuestAddress(vring.queue.used_ring()), used_len, Permissions::Write) {
            let fault = iommu.take_fault();
            return self.ring_fault(shared, queue, vring, fault, "used ring");
        }
        let popped = vring.queue.iter(mem).map(|mut avail| avail.next());
        let chain = match popped {
            Ok(Some(chain)) => chain,
            Ok(None) => {
                return match iommu.take_fault() {
                    Some(fault) => self.ring_fault(shared, queue, vring, Some(fault), "available ring"),
                    None => {
                        // Rings translate and no chain waits: whatever this queue parked on was answered. A stale
                        // park would keep `timeout_ms` at its past deadline and wake the worker every millisecond.
                        vring.parked = None;
                        Step::Empty
                    }
                };
            }
            Err(err) => {
                let fault = iommu.take_fault();
                if fault.is_some() {
                    return self.ring_fault(shared, queue, vring, fault, "available ring");
                }
                // The guest's avail index is nonsense (ran ahead by more than the queue size).
                tracing::error!("queue {queue}: {err}");
                shared.events.record(&TransportEvent::ChainError { queue, head: 0, cause: err.to_string() });
                vring.stop();
                return Step::Empty;
            }
        };
        let head = chain.head_index();
        self.head = head;
        self.chain_event = None;
        let descs: Vec<Descriptor> = chain.collect();
        let outcome = match iommu.take_fault() {
            Some(fault) if fault.kind == FaultKind::Unmapped => Outcome::Miss(fault),
            Some(fault) => Outcome::Fault(fault),
            None => match check_chain(&descs, size) {
                Err(cause) => Outcome::Refused(cause),
                Ok(()) => {
                    self.desc_log.clear();
                    match queue {
                        QUEUE_COMMAND => self.command(shared, mem, queue, &descs),
                        QUEUE_DOORBELL => self.doorbell(shared, mem, queue, &descs),
                        QUEUE_EVENT => self.event(shared, mem, queue, &descs),
                        _ => Outcome::Refused(format!("queue {queue} is reserved and carries no requests")),
                    }
                }
            },
        };
        self.finish(shared, mem, queue, vring, head, outcome)
    }

    fn finish(
        &mut self,
        shared: &Shared,
        mem: &GuestMem,
        queue: u16,
        vring: &mut VringState,
        head: u16,
        outcome: Outcome,
    ) -> Step {
        let len = match outcome {
            Outcome::Used(len) => {
                vring.parked = None;
                for event in self.desc_log.drain(..) {
                    shared.events.record(&event);
                }
                len
            }
            Outcome::NoEvent => {
                vring.queue.go_to_previous_position();
                return Step::Empty;
            }
            Outcome::Miss(fault) => match self.park(shared, queue, vring, fault) {
                true => {
                    vring.queue.go_to_previous_position();
                    return Step::Parked;
                }
                false => {
                    refuse(shared, queue, head, format!("iova {:#x} is not mapped by the IOMMU", fault.iova));
                    0
                }
            },
            Outcome::Fault(fault) => {
                fault_event(shared, queue, fault.iova, cause_of(fault));
                refuse(shared, queue, head, format!("IOMMU refused {} at iova {:#x}", access_name(fault), fault.iova));
                0
            }
            Outcome::Refused(cause) => {
                refuse(shared, queue, head, cause);
                0
            }
        };
        let event = self.chain_event.take();
        if let Err(err) = vring.queue.add_used(mem, head, len) {
            tracing::error!("queue {queue}: cannot return chain {head}: {err}");
            shared.events.record(&TransportEvent::ChainError {
                queue,
                head,
                cause: format!("cannot return chain to the used ring: {err}"),
            });
            // A used ring that stopped translating is caught by the check at the top of the next chain.
            return Step::Dropped;
        }
        if let Some(notifier) = self.notifiers.get_mut(usize::from(queue)) {
            notifier.buffer_used(event);
        }
        Step::Used
    }

    /// A ring (not a chain) failed to translate: park on a miss, otherwise report and stop this pass.
    fn ring_fault(
        &mut self,
        shared: &Shared,
        queue: u16,
        vring: &mut VringState,
        fault: Option<TranslationFault>,
        what: &str,
    ) -> Step {
        match fault {
            Some(fault) if fault.kind == FaultKind::Unmapped => {
                if self.park(shared, queue, vring, fault) {
                    Step::Parked
                } else {
                    tracing::error!("queue {queue}: {what} at iova {:#x} is not mapped", fault.iova);
                    Step::Empty
                }
            }
            Some(fault) => {
                fault_event(shared, queue, fault.iova, cause_of(fault));
                tracing::error!("queue {queue}: IOMMU refuses the {what}");
                Step::Empty
            }
            None => {
                tracing::error!("queue {queue}: {what} lies outside guest memory");
                Step::Empty
            }
        }
    }

    /// Parks the queue on a miss (asking QEMU once). False when the miss has gone unanswered for too long or
    /// cannot be asked, in which case a `dma_fault` is logged and the caller refuses the access.
    fn park(&mut self, shared: &Shared, queue: u16, vring: &mut VringState, fault: TranslationFault) -> bool {
        let now = Instant::now();
        if let Some(parked) = vring.parked {
            if parked.iova == fault.iova && parked.access == fault.access {
                // Still waiting, unless QEMU replied that no mapping exists (crate::miss_replies).
                let refused = shared.miss_refused(fault.iova, fault.access);
                if !refused && now.duration_since(parked.since) < shared.miss_timeout {
                    return true;
                }
                vring.parked = None;
                fault_event(shared, queue, fault.iova, FaultCause::IommuUnmapped);
                return false;
            }
        }
        if !shared.send_miss(fault.iova, fault.access) {
            vring.parked = None;
            fault_event(shared, queue, fault.iova, FaultCause::IommuUnmapped);
            return false;
        }
        vring.parked = Some(Parked { iova: fault.iova, access: fault.access, since: now });
        true
    }

    /// Queue 0: request bytes in, `Hca::execute`, response bytes out.
    fn command(&mut self, shared: &Shared, mem: &GuestMem, queue: u16, descs: &[Descriptor]) -> Outcome {
        let (readable, writable) = match split_chain(descs) {
            Ok(parts) => parts,
            Err(cause) => return Outcome::Refused(cause),
        };
        let request = match self.gather(shared, mem, queue, readable) {
            Ok(request) => request,
            Err(outcome) => return outcome,
        };
        if let Err(outcome) = self.prepare_writes(shared, queue, writable) {
            return outcome;
        }
        self.tell_hca_invalidations();
        let response = self.hca.execute(&QueueDma::new(shared, mem, queue), &request);
        self.scatter(shared, mem, queue, writable, &response)
    }

    /// Queue 2: doorbell records in; nothing written back.
    fn doorbell(&mut self, shared: &Shared, mem: &GuestMem, queue: u16, descs: &[Descriptor]) -> Outcome {
        let (readable, _writable) = match split_chain(descs) {
            Ok(parts) => parts,
            Err(cause) => return Outcome::Refused(cause),
        };
        let records = match self.gather(shared, mem, queue, readable) {
            Ok(records) => records,
            Err(outcome) => return outcome,
        };
        self.tell_hca_invalidations();
        self.hca.doorbell(&QueueDma::new(shared, mem, queue), &records);
        Outcome::Used(0)
    }

    /// Queue 1: one pending HCA event into one posted buffer.
    fn event(&mut self, shared: &Shared, mem: &GuestMem, queue: u16, descs: &[Descriptor]) -> Outcome {
        let (readable, writable) = match split_chain(descs) {
            Ok(parts) => parts,
            Err(cause) => return Outcome::Refused(cause),
        };
        if !readable.is_empty() {
            return Outcome::Refused("event buffers must be device-writable only".into());
        }
        let capacity: u64 = writable.iter().map(|d| u64::from(d.len())).sum();
        if capacity < EVENT_SIZE as u64 {
            return Outcome::Refused(format!("event buffer of {capacity} bytes, an event needs {EVENT_SIZE}"));
        }
        let Some(event) = self.pending_event.take().or_else(|| self.hca.pop_async_event()) else {
            return Outcome::NoEvent;
        };
        if let Err(outcome) = self.prepare_writes(shared, queue, writable) {
            // Keep the event for the next buffer that translates.
            self.pending_event = Some(event);
            return outcome;
        }
        self.chain_event = EventKind::from_u32(event.kind.get()).map(|kind| (kind, event.handle.get()));
        self.scatter(shared, mem, queue, writable, event.as_bytes())
    }

    /// Reads the device-readable descriptors into one buffer, bounded by `MAX_REQUEST_SIZE`.
    fn gather(
        &mut self,
        shared: &Shared,
        mem: &GuestMem,
        queue: u16,
        readable: &[Descriptor],
    ) -> Result<Vec<u8>, Outcome> {
        let total: u64 = readable.iter().map(|d| u64::from(d.len())).sum();
        if total > MAX_REQUEST_SIZE as u64 {
            return Err(Outcome::Refused(format!(
                "request of {total} bytes exceeds the {MAX_REQUEST_SIZE}-byte limit"
            )));
        }
        // total <= MAX_REQUEST_SIZE, so every length below fits in usize.
        let mut bytes = vec![0u8; total as usize];
        let mut offset = 0usize;
        for desc in readable {
            let len = desc.len() as usize;
            let iova = desc.addr().0;
            let uaddr = translate(shared, iova, len, Permissions::Read)?;
            let end = offset + len;
            if let Err(err) = mem.read_slice(&mut bytes[offset..end], desc.addr()) {
                return Err(access_failure(shared, iova, &err));
            }
            self.desc_log.push(TransportEvent::Desc { queue, iova, len: desc.len(), writable: false, uaddr });
            offset = end;
        }
        Ok(bytes)
    }

    /// Translates every device-writable descriptor before the HCA acts, so a miss can still put the chain back.
    fn prepare_writes(&mut self, shared: &Shared, queue: u16, writable: &[Descriptor]) -> Result<(), Outcome> {
        for desc in writable {
            let iova = desc.addr().0;
            let uaddr = translate(shared, iova, desc.len() as usize, Permissions::Write)?;
            self.desc_log.push(TransportEvent::Desc { queue, iova, len: desc.len(), writable: true, uaddr });
        }
        Ok(())
    }

    /// Writes `bytes` across the writable descriptors; the used length is what actually landed.
    fn scatter(
        &mut self,
        shared: &Shared,
        mem: &GuestMem,
        queue: u16,
        writable: &[Descriptor],
        bytes: &[u8],
    ) -> Outcome {
        let mut written = 0usize;
        for desc in writable {
            let n = (bytes.len() - written).min(desc.len() as usize);
            if n == 0 {
                break;
            }
            shared.iommu.clear_fault();
            if let Err(err) = mem.write_slice(&bytes[written..written + n], desc.addr()) {
                // The translation checked a moment ago was invalidated since: a stale-translation fault.
                let iova = shared.iommu.take_fault().map_or(desc.addr().0, |f| f.iova);
                fault_event(shared, queue, iova, FaultCause::IommuUnmapped);
                tracing::warn!("queue {queue}: response write failed: {err}");
                break;
            }
            written += n;
        }
        if written < bytes.len() {
            shared.events.record(&TransportEvent::ChainError {
                queue,
                head: self.head,
                cause: format!("response truncated: {written} of {} bytes written", bytes.len()),
            });
        }
        // written <= bytes.len(), which the HCA bounds far below u32::MAX.
        Outcome::Used(u32::try_from(written).unwrap_or(u32::MAX))
    }
}

/// The request queues as the poll window sees them.
struct RequestRings<'a>(&'a Shared);

impl KickSuppression for RequestRings<'_> {
    fn suppress(&mut self) {
        let mem = self.0.mem();
        for queue in REQUEST_QUEUES {
            if let Some(vring) = self.0.vrings.get(usize::from(queue)) {
                suppress_kicks(queue, &mut lock(vring), &mem);
            }
        }
    }

    fn allow(&mut self) -> bool {
        let mem = self.0.mem();
        let mut pending = false;
        for queue in REQUEST_QUEUES {
            if let Some(vring) = self.0.vrings.get(usize::from(queue)) {
                pending |= allow_kicks(queue, &mut lock(vring), &mem);
            }
        }
        pending
    }
}

/// Where `iova` lands in QEMU's address space, or the outcome that stops the chain.
fn translate(shared: &Shared, iova: u64, len: usize, access: Permissions) -> Result<u64, Outcome> {
    shared.iommu.clear_fault();
    match shared.iommu.first_target(iova, len, access) {
        Some(uaddr) => Ok(uaddr),
        None => Err(match shared.iommu.take_fault() {
            Some(fault) if fault.kind == FaultKind::Unmapped => Outcome::Miss(fault),
            Some(fault) => Outcome::Fault(fault),
            None => Outcome::Refused(format!("iova {iova:#x} did not translate")),
        }),
    }
}

fn access_failure(shared: &Shared, iova: u64, err: &vm_memory::GuestMemoryError) -> Outcome {
    match shared.iommu.take_fault() {
        Some(fault) if fault.kind == FaultKind::Unmapped => Outcome::Miss(fault),
        Some(fault) => Outcome::Fault(fault),
        None => Outcome::Refused(format!("buffer at iova {iova:#x} is outside guest memory: {err}")),
    }
}

fn refuse(shared: &Shared, queue: u16, head: u16, cause: String) {
    tracing::warn!("queue {queue}: chain {head} refused: {cause}");
    shared.events.record(&TransportEvent::ChainError { queue, head, cause });
}

fn cause_of(fault: TranslationFault) -> FaultCause {
    match fault.kind {
        FaultKind::Unmapped => FaultCause::IommuUnmapped,
        FaultKind::Permission => FaultCause::IommuPermission,
    }
}

fn access_name(fault: TranslationFault) -> &'static str {
    if fault.access.has_write() {
        "a write"
    } else {
        "a read"
    }
}

/// A walk that ended while the last descriptor still pointed on was cut short: a next index past the table, or a
/// loop longer than the queue.
fn check_chain(descs: &[Descriptor], queue_size: u16) -> Result<(), String> {
    match descs.last() {
        None => Err(format!("empty chain (head index not below queue size {queue_size})")),
        Some(last) if last.has_next() => {
            Err(format!("chain cut short after {} descriptors: bad next index or a loop", descs.len()))
        }
        Some(_) => Ok(()),
    }
}

/// Splits a chain into its device-readable head and device-writable tail, as virtio requires them ordered.
fn split_chain(descs: &[Descriptor]) -> Result<(&[Descriptor], &[Descriptor]), String> {
    let first_writable = descs.iter().position(|d| d.is_write_only()).unwrap_or(descs.len());
    let (readable, writable) = descs.split_at(first_writable);
    if writable.iter().any(|d| !d.is_write_only()) {
        return Err("device-readable descriptor after a device-writable one".into());
    }
    Ok((readable, writable))
}

/// Writes the queue's call eventfd and logs `line` (its `notify` line) once it is written. A ring without a call fd
/// (QEMU polls it, or none was set yet) is not notified and logs nothing.
fn signal_call(shared: &Shared, queue: u16, line: &TransportEvent) {
    let Some(slot) = shared.calls.get(usize::from(queue)) else { return };
    let call = lock(slot);
    let Some(call) = call.as_ref() else { return };
    match call.write(1) {
        Ok(()) => shared.events.record(line),
        Err(err) => tracing::error!("cannot signal call eventfd ({line:?}): {err}"),
    }
}

/// Whether the driver set VRING_AVAIL_F_NO_INTERRUPT (virtio 1.2, 2.7.7) in the avail ring's flags, which
/// virtio-queue's `needs_notification` does not look at. Without VIRTIO_F_EVENT_IDX (never offered) the flag is the
/// driver's whole say; a polling driver sets it (vhca's on every queue with `vhca.completion=poll`, on the doorbell
/// queue always), so a completion then costs no call eventfd write (and under TCG no wake-up of QEMU's main loop,
/// which reads that eventfd). Read again before a notification the rate bound held back goes out. A flags read that
/// fails counts as wanting the notification.
fn driver_declines_interrupts(mem: &GuestMem, avail_ring: u64) -> bool {
    let no_interrupt = virtio_bindings::virtio_ring::VRING_AVAIL_F_NO_INTERRUPT as u16;
    mem.read_obj::<u16>(GuestAddress(avail_ring)).is_ok_and(|flags| u16::from_le(flags) & no_interrupt != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};

    fn desc(flags: u32) -> Descriptor {
        Descriptor::new(0x1000, 16, flags as u16, 0)
    }

    #[test]
    fn split_chain_wants_readable_before_writable() {
        let chain = [desc(VRING_DESC_F_NEXT), desc(VRING_DESC_F_NEXT | VRING_DESC_F_WRITE), desc(VRING_DESC_F_WRITE)];
        let (r, w) = split_chain(&chain).unwrap();
        assert_eq!((r.len(), w.len()), (1, 2));
        let bad = [desc(VRING_DESC_F_WRITE | VRING_DESC_F_NEXT), desc(0)];
        assert!(split_chain(&bad).unwrap_err().contains("after a device-writable"));
    }

    #[test]
    fn cut_short_chains_are_detected() {
        assert!(check_chain(&[], 64).is_err());
        assert!(check_chain(&[desc(VRING_DESC_F_NEXT)], 64).unwrap_err().contains("cut short"));
        assert!(check_chain(&[desc(VRING_DESC_F_NEXT), desc(0)], 64).is_ok());
    }
}
