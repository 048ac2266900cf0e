//! The vhca command transport (vhca-queues, the code vhca.sys runs too) bound to this program: its buffers are VFIO
//! DMA regions, its registers VFIO BARs, its waits sleep on the monotonic clock or until the queue's MSI-X message
//! (`completion_wait`, as each queue was set up), and each queue sits behind its own Mutex so `CommandTransport`'s
//! `&self` methods can reach them. The driver core's commands poll until it connects its interrupt, then sleep on
//! the KEVENT its DPC sets (`SignalledWaits`).
//!
//! Lock order: there is none, as no path holds two of the three locks. `commands` is held by a command for its
//! whole wait (up to the command timeout); `events` by one read of the event queue (the DPC's, or the control
//! path's when it polls); `doorbells` by one ring, until the device has fetched the records (the DPC's CQ arms,
//! the control path's posts). So the DPC, which takes the last two, never waits behind a command in flight.
//!
//! Each command and doorbell tells the NT model first (`device_kicked`): the race detector then orders the
//! interrupt the device answers with after what the driver did before it, as a real device's DMA is ordered.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use vhca_driver_core::{CommandTransport, CommandTransportError, CompletionSignal};
use vhca_proto::{Event, EVENT_SIZE, MAX_REQUEST_SIZE};
use vhca_queues::{DoorbellQueue, EventQueue, RingError, SignalledWaits};

use crate::completion_wait::CompletionWaits;

use crate::report::{progress, Report};
use crate::vfio::DmaAccess;
use crate::vfio_dma::{DmaError, DmaMapper, DmaMemory, DmaRegion, PAGE_SIZE};
use crate::virtio_pci::{QueueNotifier, TransportError};
use crate::virtqueue::SplitQueue;

/// Event buffers kept posted: more than the device ever queues between two polls in these scenarios.
const EVENT_BUFFERS: usize = 16;
/// Response room: the largest response header + body any command has, with slack for growth.
const RESPONSE_BUFFER: usize = PAGE_SIZE;

pub type CommandQueue = vhca_queues::CommandQueue<DmaRegion, QueueNotifier, CompletionWaits>;
pub type CommandError = vhca_queues::CommandError<TransportError>;
/// The driver core's command queue: polling until its interrupt path hands it the DPC's KEVENT.
type DriverCommandQueue = vhca_queues::CommandQueue<DmaRegion, QueueNotifier, SignalledWaits<CompletionWaits>>;

struct Queues {
    commands: Mutex<DriverCommandQueue>,
    /// Commands that waited on the driver's KEVENT, and that polled (before the interrupt path, after it).
    waited: [AtomicU64; 2],
    doorbells: Mutex<DoorbellQueue<DmaRegion, QueueNotifier, CompletionWaits>>,
    events: Mutex<EventQueue<DmaRegion, QueueNotifier>>,
    /// The model the driver runs on and the device's name there (weak: the model outlives no transport clone's
    /// need of it, and the transport is made before it).
    model: OnceLock<(Weak<vhca_ntmodel::NtModel>, u64)>,
}

#[derive(Debug, thiserror::Error)]
pub enum ChannelSetupError {
    #[error(transparent)]
    Dma(#[from] DmaError),
    #[error(transparent)]
    Events(#[from] RingError<TransportError>),
}

/// The command queue over VFIO memory: a request buffer of `MAX_REQUEST_SIZE`, a page for the response. Each command
/// may take `timeout`, waited for as the queue says (polling, or its interrupt: `SplitQueue::wait_by_interrupt`).
pub fn command_queue(
    queue: SplitQueue<DmaRegion>,
    notifier: QueueNotifier,
    mapper: &DmaMapper,
    timeout: Duration,
) -> Result<CommandQueue, ChannelSetupError> {
    let request = mapper.alloc(MAX_REQUEST_SIZE, DmaAccess::READ_WRITE)?;
    let response = mapper.alloc(RESPONSE_BUFFER, DmaAccess::READ_WRITE)?;
    let waits = queue.completion_waits(timeout);
    Ok(CommandQueue::new(queue.into_inner(), notifier, request, response, waits))
}

/// Puts the command buffers' IOVAs, and their guest-physical addresses where the kernel reveals them, in the report.
pub fn report_command_buffers(commands: &CommandQueue, report: &mut Report) {
    let (request, response) = commands.buffers();
    report.iovas.cmd = Some(request.iova());
    report.iovas.resp = Some(response.iova());
    (report.gpas.cmd, report.gpas.resp) = (request.guest_physical().ok(), response.guest_physical().ok());
}

fn note(message: std::fmt::Arguments<'_>) {
    progress(message);
}

/// The three queues the driver core talks through. Clones share them: the program keeps one so their memory
/// outlives the driver until the device is reset.
#[derive(Clone)]
pub struct VfioCommandTransport {
    queues: Arc<Queues>,
}

fn lock<T>(queue: &Mutex<T>) -> MutexGuard<'_, T> {
    queue.lock().unwrap_or_else(|e| e.into_inner())
}

impl VfioCommandTransport {
    /// Queue 0 as made by `command_queue`, polling until the driver's interrupt path is connected (its waits are
    /// the NT model's then, never the program's own message wait); queue 1 stocked with `EVENT_BUFFERS` event
    /// buffers; queue 2 with a page for doorbell records.
    pub fn new(
        commands: CommandQueue,
        (events, event_notifier): (SplitQueue<DmaRegion>, QueueNotifier),
        (doorbells, doorbell_notifier): (SplitQueue<DmaRegion>, QueueNotifier),
        mapper: &DmaMapper,
        timeout: Duration,
    ) -> Result<VfioCommandTransport, ChannelSetupError> {
        let count = EVENT_BUFFERS.min(events.size() as usize);
        let slots = mapper.alloc(count * EVENT_SIZE, DmaAccess::READ_WRITE)?;
        let events = EventQueue::new(events.into_inner(), event_notifier, slots, count)?;
        let buffer = mapper.alloc(PAGE_SIZE, DmaAccess::READ_WRITE)?;
        let waits = doorbells.completion_waits(timeout);
        let doorbells = DoorbellQueue::new(doorbells.into_inner(), doorbell_notifier, buffer, waits);
        let commands = commands.map_waits(|w| SignalledWaits::new(CompletionWaits::polling(w.limit)));
        let queues = Queues {
            commands: Mutex::new(commands),
            waited: Default::default(),
            doorbells: Mutex::new(doorbells),
            events: Mutex::new(events),
            model: OnceLock::new(),
        };
        Ok(VfioCommandTransport { queues: Arc::new(queues) })
    }

    /// From now on each command and doorbell tells `kernel` that `device` was told to act.
    pub fn tell_model(&self, kernel: &Arc<vhca_ntmodel::NtModel>, device: u64) {
        let _ = self.queues.model.set((Arc::downgrade(kernel), device));
    }

    fn kick(&self) {
        if let Some((model, device)) = self.queues.model.get() {
            if let Some(kernel) = model.upgrade() {
                kernel.device_kicked(*device);
            }
        }
    }

    /// (commands that waited on the driver's KEVENT, commands that polled) so far.
    pub fn command_waits(&self) -> (u64, u64) {
        let [kevent, poll] = &self.queues.waited;
        (kevent.load(Ordering::Relaxed), poll.load(Ordering::Relaxed))
    }
}

impl CommandTransport for VfioCommandTransport {
    fn execute(&self, request: &[u8], response_capacity: usize) -> Result<Vec<u8>, CommandTransportError> {
        let mut commands = lock(&self.queues.commands);
        let way = if commands.waits_mut().is_signalled() { 0 } else { 1 };
        self.queues.waited[way].fetch_add(1, Ordering::Relaxed);
        self.kick();
        commands.execute_for_core(request, response_capacity, &note)
    }

    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError> {
        let mut doorbells = lock(&self.queues.doorbells);
        self.kick();
        doorbells.ring(records, &note)
    }

    fn poll_event(&self) -> Option<Event> {
        lock(&self.queues.events).poll(&note)
    }

    /// Silent: the interrupt path's own lines say when its KEVENT starts and stops serving the commands
    /// (driver_run.rs), and every console byte costs the run time.
    fn wait_for_interrupts(&self, signal: Option<Arc<dyn CompletionSignal>>) {
        lock(&self.queues.commands).waits_mut().attach(signal);
    }
}
