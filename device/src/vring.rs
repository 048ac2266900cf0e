//! The vring state a front-end sets (sizes, addresses, kick/call/err fds, enable and started) and the chain parked
//! on an IOTLB miss. The connection writes it; the queue worker reads it. Neither knows of the other.

use std::io;
use std::time::Instant;

use virtio_queue::{Queue, QueueT};
use vm_memory::Permissions;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// Largest queue QEMU may set up unless `DeviceOptions::max_queue_size` lowers it; the carrier uses 64.
pub const MAX_QUEUE_SIZE: u16 = 1024;

/// A queue-size limit the device can take: a power of two no larger than `MAX_QUEUE_SIZE` (Queue::new's only check
/// is the power of two).
pub fn valid_queue_limit(max_size: u16) -> bool {
    max_size.is_power_of_two() && max_size <= MAX_QUEUE_SIZE
}

/// A chain put back because part of it missed in the IOTLB; retried on the next IOTLB update.
#[derive(Debug, Clone, Copy)]
pub struct Parked {
    pub iova: u64,
    pub access: Permissions,
    pub since: Instant,
}

pub struct VringState {
    pub queue: Queue,
    pub kick: Option<EventFd>,
    pub err: Option<EventFd>,
    pub enabled: bool,
    /// Between SET_VRING_KICK and GET_VRING_BASE.
    pub started: bool,
    pub parked: Option<Parked>,
    /// This device set VRING_USED_F_NO_NOTIFY in the used ring (busy-polling, `queue_polling`) and has not cleared
    /// it yet. Kept across a stop, so a ring restarted over the same memory gets its flag cleared.
    pub kicks_suppressed: bool,
}

impl Default for VringState {
    fn default() -> Self {
        VringState::new(MAX_QUEUE_SIZE)
    }
}

impl VringState {
    /// A ring QEMU may size up to `max_size`, which `valid_queue_limit` accepted (callers check; `Shared::new` does).
    pub fn new(max_size: u16) -> VringState {
        let queue =
            Queue::new(max_size).unwrap_or_else(|_| unreachable!("queue limits are checked by valid_queue_limit"));
        VringState {
            queue,
            kick: None,
            err: None,
            enabled: false,
            started: false,
            parked: None,
            kicks_suppressed: false,
        }
    }

    pub fn start(&mut self) {
        self.started = true;
        self.queue.set_ready(true);
    }

    /// GET_VRING_BASE: the ring stops; its addresses and size stay until the front-end changes them.
    pub fn stop(&mut self) {
        self.started = false;
        self.queue.set_ready(false);
        self.kick = None;
        self.parked = None;
    }

    pub fn reset(&mut self) {
        *self = VringState::new(self.queue.max_size());
    }

    pub(crate) fn runnable(&self) -> bool {
        self.started && self.enabled && self.queue.ready()
    }
}

/// Whether the worker's epoll can watch `kick`: a regular file or a character device (a memfd, /dev/null) cannot
/// be polled, so a kick fd must be checked before it is taken.
pub fn check_pollable(kick: &EventFd) -> io::Result<()> {
    let epoll = Epoll::new()?;
    epoll.ctl(ControlOperation::Add, std::os::fd::AsRawFd::as_raw_fd(kick), EpollEvent::new(EventSet::IN, 0))
}
