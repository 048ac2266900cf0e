//! vhca-device: the emulated HCA and the vhost-user transport that connects it to QEMU.
//! `serve` runs one front-end connection to its end; the binary adds the CLI, the socket and the event log file.

pub mod config;
pub mod event_log;
pub mod iommu;
pub mod iommu_dma;
pub mod memory;
pub mod miss_replies;
pub mod notifications;
pub mod queue_polling;
pub mod queue_worker;
pub mod sandbox;
pub mod shared;
pub mod thread_sched;
pub mod translation_cache;
pub mod vhost_user;
pub mod vring;

use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use vhca_hca::{EventSink, Hca, HcaConfig};
use vhca_proto::NUM_QUEUES;
use zerocopy::IntoBytes;

use crate::event_log::{EventLog, TransportEvent};
use crate::queue_worker::Worker;
use crate::shared::Shared;
use crate::vhost_user::connection::{Frontend, ProtocolError};

#[derive(Debug, Clone)]
pub struct DeviceOptions {
    /// The HCA model's configuration: map registers, limits, checks and fault injection.
    pub hca: HcaConfig,
    /// How long an IOTLB miss may stay unanswered before the access is an IOMMU fault.
    pub miss_timeout: Duration,
    /// How long the queue worker busy-polls after its last work, kicks suppressed (`queue_polling`); zero: never.
    pub poll_window: Duration,
    /// Scheduler slice of the device's threads (`thread_sched`); zero: the kernel's default.
    pub thread_slice: Duration,
    /// Each queue's bound on used-buffer notifications (`notifications`).
    pub notify_bound: notifications::RateBound,
    /// Largest queue SET_VRING_NUM may set up: a power of two up to `vring::MAX_QUEUE_SIZE` (the default). The
    /// fuzz harness lowers it to the carrier's 64 so that one input's rings cost it 64², not 1024², descriptor reads.
    pub max_queue_size: u16,
    /// Offer VIRTIO_F_ACCESS_PLATFORM (bit 33). Off (`--no-access-platform`, with QEMU's iommu_platform=off) stands
    /// for a device that bypasses the IOMMU, which a driver behind an active IOMMU must refuse at start.
    pub access_platform: bool,
}

/// How long a miss may go unanswered by default. QEMU answers every miss it is asked (an UPDATE, or a reply that
/// its vIOMMU has no mapping, which faults at once: crate::miss_replies), so this limit only decides for a front-end
/// that does not answer; it must outlast a QEMU whose main loop is busy. On a loaded 2-core host QEMU answered the
/// rings' first misses 1.9 s late (its vCPU thread was still starting the rings), and the old 1 s limit made that a
/// device fault in a run that was right.
pub const DEFAULT_MISS_TIMEOUT_MS: u64 = 10_000;

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions {
            hca: HcaConfig::default(),
            miss_timeout: Duration::from_millis(DEFAULT_MISS_TIMEOUT_MS),
            poll_window: Duration::from_micros(DEFAULT_POLL_WINDOW_US),
            thread_slice: thread_sched::SHORTEST,
            notify_bound: notifications::RateBound::default(),
            max_queue_size: vring::MAX_QUEUE_SIZE,
            access_platform: true,
        }
    }
}

/// `vhca-device --poll-window-us` unless given: off. On the 2-core hosts this was measured on (docs/bench.md section
/// 5) a polling worker competes with QEMU's threads, and once preempted mid-window it leaves kicks suppressed with
/// nobody polling: the median round trip got worse, not better. Polling pays on a host with a core to spare.
pub const DEFAULT_POLL_WINDOW_US: u64 = 0;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("cannot start the queue worker: {0}")]
    Worker(std::io::Error),
    #[error("cannot start the backend channel's reply reader: {0}")]
    Reader(std::io::Error),
    #[error("cannot lock the device down: {0}")]
    Lockdown(String),
    #[error("invalid device options: {0}")]
    Options(String),
}

/// Serves one front-end connection until it closes (`Ok`) or misbehaves (`Err`, already logged and evented).
/// The queue worker is stopped and joined before this returns.
pub fn serve(stream: UnixStream, events: Arc<EventLog>, options: &DeviceOptions) -> Result<(), ServeError> {
    serve_locked_down(stream, events, options, || Ok(()))
}

/// `serve`, calling `lockdown` once everything the connection needs exists (the queue worker runs) and before the
/// first request is read: where the binary installs its seccomp filter. A lockdown that fails ends the connection.
pub fn serve_locked_down(
    stream: UnixStream,
    events: Arc<EventLog>,
    options: &DeviceOptions,
    lockdown: impl FnOnce() -> Result<(), String>,
) -> Result<(), ServeError> {
    let (shared, hca, config) = device_parts(&events, options)?;
    // Both threads start before the lockdown: the sandbox forbids starting one.
    let reader = miss_replies::spawn_reader(Arc::clone(&shared), options.thread_slice).map_err(ServeError::Reader)?;
    let worker = match Worker::spawn(
        Arc::clone(&shared),
        hca,
        options.poll_window,
        options.thread_slice,
        options.notify_bound,
    ) {
        Ok(worker) => worker,
        Err(err) => {
            miss_replies::stop_reader(&shared, reader);
            return Err(ServeError::Worker(err));
        }
    };

    let result = match lockdown() {
        Ok(()) => Ok(Frontend::new(stream, Arc::clone(&shared), config)
            .offering(crate::vhost_user::connection::offered_features(options.access_platform))
            .serve()),
        Err(cause) => Err(ServeError::Lockdown(cause)),
    };

    shared.shutdown.store(true, Ordering::Release);
    shared.iommu.wake_waiters();
    shared.wake_worker();
    if worker.join().is_err() {
        tracing::error!("queue worker panicked");
    }
    miss_replies::stop_reader(&shared, reader);
    connection_ended(&events, result?)
}

/// What one connection runs on: the state the front-end and the worker share, the HCA, and its config space.
pub fn device_parts(
    events: &Arc<EventLog>,
    options: &DeviceOptions,
) -> Result<(Arc<Shared>, Hca, Vec<u8>), ServeError> {
    if !vring::valid_queue_limit(options.max_queue_size) {
        return Err(ServeError::Options(format!(
            "queue size limit {} is not a power of two from 1 to {}",
            options.max_queue_size,
            vring::MAX_QUEUE_SIZE
        )));
    }
    let sink: Arc<dyn EventSink> = events.clone();
    let hca = Hca::new(options.hca.clone(), sink);
    let config = hca.device_config().as_bytes().to_vec();
    let shared = Shared::with_queue_limit(Arc::clone(events), NUM_QUEUES, options.miss_timeout, options.max_queue_size)
        .map_err(ServeError::Worker)?;
    Ok((Arc::new(shared), hca, config))
}

/// Logs how a connection ended (a `disconnected` line, after a `protocol_error` naming the cause if it misbehaved).
pub fn connection_ended(events: &EventLog, result: Result<(), ProtocolError>) -> Result<(), ServeError> {
    match result {
        Ok(()) => {
            tracing::info!("front-end closed the connection");
            events.record(&TransportEvent::Disconnected { reason: "front-end closed the connection".into() });
            Ok(())
        }
        Err(err) => {
            let cause = err.to_string();
            tracing::error!("closing the connection: {cause}");
            events.record(&TransportEvent::ProtocolError { cause: cause.clone() });
            events.record(&TransportEvent::Disconnected { reason: format!("protocol error: {cause}") });
            Err(ServeError::Protocol(err))
        }
    }
}
