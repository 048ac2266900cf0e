//! State the front-end thread and the queue worker share, each piece under its own lock so that the front-end
//! thread can always apply IOTLB messages while the worker is busy (QEMU waits on those replies in its main loop).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use vm_memory::{GuestMemoryMmap, Permissions};
use vmm_sys_util::eventfd::EventFd;

use crate::event_log::{perm_name, EventLog, TransportEvent};
use crate::iommu::DeviceIommu;
use crate::memory::GuestMem;
use crate::miss_replies::{Miss, MissReplies};
use crate::vhost_user::backend::BackendChannel;
use crate::vring::{valid_queue_limit, VringState, MAX_QUEUE_SIZE};

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub struct Shared {
    pub vrings: Vec<Mutex<VringState>>,
    /// Each queue's call eventfd, apart from its vring: QEMU sends SET_VRING_CALL again whenever the guest masks or
    /// unmasks the queue's MSI-X vector, mid-traffic, and that must neither wait for the worker's pass nor stop it.
    pub calls: Vec<Mutex<Option<EventFd>>>,
    mem: RwLock<Arc<GuestMem>>,
    pub iommu: Arc<DeviceIommu>,
    pub events: Arc<EventLog>,
    backend: Mutex<Option<BackendChannel>>,
    /// QEMU's replies to the misses sent on `backend` (read by their own thread, `crate::miss_replies`).
    pub miss_replies: MissReplies,
    /// Wakes the worker: kick fds changed, an IOTLB update arrived, or shutdown.
    pub wake: EventFd,
    pub kicks_changed: AtomicBool,
    pub shutdown: AtomicBool,
    /// Set while the front-end thread waits for a vring lock the worker holds: a worker waiting on a miss gives up
    /// at once, and a pass stops taking chains (`with_vring` wakes the worker to serve them once it is done).
    pub control_pending: AtomicBool,
    /// IOTLB invalidations the worker still has to tell the HCA about (the front-end never touches the HCA).
    pub invalidations: Mutex<Vec<(u64, u64)>>,
    /// How long a miss may stay unanswered before the access counts as an IOMMU fault (at most `MAX_MISS_TIMEOUT`).
    pub miss_timeout: Duration,
    /// Largest size SET_VRING_NUM may give a queue.
    pub max_queue_size: u16,
}

/// Longest miss wait: deadlines are `Instant + miss_timeout`, which must never overflow (that would panic).
pub const MAX_MISS_TIMEOUT: Duration = Duration::from_secs(3600);

impl Shared {
    pub fn new(events: Arc<EventLog>, num_queues: u16, miss_timeout: Duration) -> std::io::Result<Shared> {
        Shared::with_queue_limit(events, num_queues, miss_timeout, MAX_QUEUE_SIZE)
    }

    /// `new` with queues no larger than `max_queue_size`, which must pass `valid_queue_limit`.
    pub fn with_queue_limit(
        events: Arc<EventLog>,
        num_queues: u16,
        miss_timeout: Duration,
        max_queue_size: u16,
    ) -> std::io::Result<Shared> {
        if !valid_queue_limit(max_queue_size) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("queue size limit {max_queue_size} is not a power of two from 1 to {MAX_QUEUE_SIZE}"),
            ));
        }
        let mem = GuestMem::new(GuestMemoryMmap::new(), DeviceIommu::new(), true, ());
        let iommu = Arc::clone(mem.iommu());
        Ok(Shared {
            vrings: (0..num_queues).map(|_| Mutex::new(VringState::new(max_queue_size))).collect(),
            calls: (0..num_queues).map(|_| Mutex::new(None)).collect(),
            mem: RwLock::new(Arc::new(mem)),
            iommu,
            events,
            backend: Mutex::new(None),
            miss_replies: MissReplies::new(),
            wake: EventFd::new(libc::EFD_NONBLOCK)?,
            kicks_changed: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            control_pending: AtomicBool::new(false),
            invalidations: Mutex::new(Vec::new()),
            miss_timeout: miss_timeout.min(MAX_MISS_TIMEOUT),
            max_queue_size,
        })
    }

    /// The memory as of now; a SET_MEM_TABLE swaps it, and the old mappings go when the last user drops them.
    pub fn mem(&self) -> Arc<GuestMem> {
        Arc::clone(&self.mem.read().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    pub fn replace_memory(&self, backend: GuestMemoryMmap<()>) {
        let mut mem = self.mem.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        *mem = Arc::new(mem.with_replaced_backend(backend));
    }

    /// A new backend channel; with `reply_ack` negotiated, misses on it are sent with NEED_REPLY and QEMU's replies
    /// read (vhost-user allows NEED_REPLY only with REPLY_ACK, which QEMU requires for iommu_platform anyway).
    pub fn set_backend(&self, channel: BackendChannel, reply_ack: bool) {
        let mut backend = lock(&self.backend);
        let reader = reply_ack.then(|| channel.reader()).and_then(|reader| {
            reader
                .map_err(|err| {
                    tracing::error!("backend channel: cannot read replies ({err}); misses wait for the timeout")
                })
                .ok()
        });
        self.miss_replies.attach(reader);
        *backend = Some(channel);
    }

    /// Closes backend channel `epoch` (QEMU sent something that is no reply to a miss), unless a newer one replaced
    /// it: a miss can no longer be asked, so the next one is an IOMMU fault at once, as without a channel.
    pub fn close_backend(&self, epoch: u64) {
        let mut backend = lock(&self.backend);
        if self.miss_replies.lost(epoch) {
            if let Some(channel) = backend.take() {
                channel.close();
            }
        }
    }

    pub fn has_backend(&self) -> bool {
        lock(&self.backend).is_some()
    }

    /// Sends an IOTLB miss to QEMU and logs it. False when there is no channel or the send failed.
    pub fn send_miss(&self, iova: u64, access: Permissions) -> bool {
        let mut backend = lock(&self.backend);
        let Some(channel) = backend.as_mut() else {
            return false;
        };
        self.events.record(&TransportEvent::IotlbMiss { iova, perm: perm_name(access) });
        let miss = Miss { iova, access };
        let need_reply = self.miss_replies.ask(miss);
        match channel.send_miss(iova, access, need_reply) {
            Ok(()) => true,
            Err(err) => {
                if need_reply {
                    self.miss_replies.unask(miss);
                }
                tracing::error!("backend channel: sending IOTLB miss for {iova:#x} failed: {err}");
                false
            }
        }
    }

    /// Whether QEMU refused the latest miss sent for `iova` and `access` (its vIOMMU has no mapping): the access is an
    /// IOMMU fault now rather than at the miss timeout. Takes the refusal.
    pub fn miss_refused(&self, iova: u64, access: Permissions) -> bool {
        self.miss_replies.take_refusal(Miss { iova, access })
    }

    pub fn wake_worker(&self) {
        if let Err(err) = self.wake.write(1) {
            tracing::error!("cannot wake the queue worker: {err}");
        }
    }

    pub fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// Runs `f` on vring `index` from the front-end thread. A vring the worker holds is taken by interrupting the
    /// worker (its miss wait gives up, its pass stops taking chains), since QEMU may be waiting for this request's
    /// reply before it answers the miss the worker waits on; the worker is then woken, so the chains its pass left
    /// are served now: their kick is already read and no other comes. A free vring is taken without disturbing the
    /// worker, which may be serving another queue (once, every such message cost the request it was serving a 10 s
    /// command timeout in the driver, and a miss wait on another queue a spurious IOMMU fault).
    pub fn with_vring<R>(&self, index: usize, f: impl FnOnce(&mut VringState) -> R) -> Option<R> {
        let vring = self.vrings.get(index)?;
        let result = match vring.try_lock() {
            Ok(mut free) => f(&mut free),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => f(&mut poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => {
                self.control_pending.store(true, Ordering::Release);
                self.iommu.wake_waiters();
                let result = f(&mut lock(vring));
                self.control_pending.store(false, Ordering::Release);
                self.wake_worker();
                result
            }
        };
        Some(result)
    }

    /// Sets or clears queue `index`'s call eventfd (SET_VRING_CALL); false for a queue that does not exist.
    pub fn set_call(&self, index: usize, call: Option<EventFd>) -> bool {
        let Some(slot) = self.calls.get(index) else { return false };
        *lock(slot) = call;
        true
    }
}

#[cfg(test)]
mod tests {
    use virtio_queue::QueueT;

    use super::*;

    #[test]
    fn miss_timeout_is_clamped_so_deadlines_cannot_overflow() {
        let events = Arc::new(EventLog::to_writer(Box::new(std::io::sink())));
        let shared = Shared::new(events, 4, Duration::MAX).unwrap();
        assert_eq!(shared.miss_timeout, MAX_MISS_TIMEOUT);
        assert!(std::time::Instant::now().checked_add(shared.miss_timeout).is_some());
    }

    #[test]
    fn a_lowered_queue_limit_bounds_every_ring_and_survives_a_reset() {
        let events = Arc::new(EventLog::to_writer(Box::new(std::io::sink())));
        for bad in [0, 48, 2048] {
            let refused = Shared::with_queue_limit(Arc::clone(&events), 4, Duration::ZERO, bad).err();
            assert!(refused.is_some_and(|err| err.to_string().contains("not a power of two")), "limit {bad}");
        }
        let shared = Shared::with_queue_limit(events, 4, Duration::ZERO, 64).unwrap();
        assert_eq!(shared.max_queue_size, 64);
        let mut vring = lock(&shared.vrings[0]);
        assert_eq!(vring.queue.max_size(), 64);
        assert!(vring.queue.try_set_size(128).is_err(), "a ring above the limit is refused");
        vring.reset();
        assert_eq!(vring.queue.max_size(), 64, "a reset keeps the limit");
    }
}
