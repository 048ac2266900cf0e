//! A run's interrupts (`vhca.completion=interrupt`, the default): the device's MSI-X entries enabled through VFIO,
//! the vector plan written into its common config, and the interrupt thread delivering each message to the queues'
//! waits and to the NT model.
//!
//! Only queue 0 waits by interrupt (vhca's command queue, virtio-rng's request queue): on the message itself where
//! no driver runs (the transport's own checks, virtio-rng), on the KEVENT the native driver's DPC sets once it has
//! connected its interrupt (`vfio_command_transport`). Queue 1 (vhca's events) asks for interrupts without
//! waiting: its completion events are what the driver's ISR and DPC hear of, through the NT model
//! (`model_interrupts`); the doorbell queue keeps declining them (the DPC rings it, and polls it, at DISPATCH_LEVEL).

use std::sync::Arc;

use anyhow::Context;
use vhca_virtio::MsixPlan;

use crate::cmdline::Completion;
use crate::completion_wait::MessageSignals;
use crate::interrupt_thread::{InterruptThread, MessageInterruptSink, MessageSource};
use crate::model_interrupts::ModelInterrupts;
use crate::msix_vectors::{self, MsixVectors};
use crate::report::{progress, InterruptsView, Report};
use crate::vfio::Device;
use crate::vfio_dma::DmaRegion;
use crate::virtio_pci::VirtioPci;
use crate::virtqueue::SplitQueue;

/// The queues that ask for interrupts and wait for them.
const WAITING_QUEUES: [u16; 1] = [0];
/// The queues that ask for interrupts for the NT model's ISR, and poll.
const ASKING_QUEUES: [u16; 1] = [1];

/// Each message to the program's own waits (a command of the transport's own checks, an entropy read) and to the
/// NT model, whose ISR and DPC wake the driver's waits.
struct QueuesThenModel {
    signals: Arc<MessageSignals>,
    model: Arc<ModelInterrupts>,
}

impl MessageInterruptSink for QueuesThenModel {
    fn message(&self, id: u32) {
        self.signals.message(id);
        self.model.message(id);
    }
}

/// Field order is drop order: the thread is joined before MSI-X is disabled and the eventfds close.
pub struct QueueInterrupts<'d> {
    thread: InterruptThread,
    vectors: MsixVectors<'d>,
    signals: Arc<MessageSignals>,
    model: Arc<ModelInterrupts>,
    plan: MsixPlan,
    table_entries: u32,
    waiting: Vec<u16>,
}

impl<'d> QueueInterrupts<'d> {
    /// Sets the run up for `completion` and notes the mode in the report: None when it polls. With interrupts, call
    /// after FEATURES_OK and before the queues are set up (their vectors are programmed here, before queue_enable).
    pub fn for_run(
        completion: Completion,
        device: &'d Device,
        transport: &VirtioPci,
        queues: u16,
        report: &mut Report,
    ) -> anyhow::Result<Option<QueueInterrupts<'d>>> {
        report.completion = Some(completion.name());
        match completion {
            Completion::Poll => Ok(None),
            Completion::Interrupt => QueueInterrupts::enable(device, transport, queues).map(Some),
        }
    }

    fn enable(device: &'d Device, transport: &VirtioPci, queues: u16) -> anyhow::Result<QueueInterrupts<'d>> {
        let table_entries = msix_vectors::table_entries(device).context("MSI-X")?.count;
        let plan = MsixPlan::new(u16::try_from(table_entries).unwrap_or(u16::MAX), queues)
            .context("the device has no MSI-X table")?;
        let vectors = MsixVectors::enable(device, u32::from(plan.entries_used())).context("MSI-X through VFIO")?;
        let signals = MessageSignals::new(vectors.len());
        let sources = (0u32..)
            .zip(vectors.eventfds())
            .map(|(id, fd)| fd.try_clone().map(|eventfd| MessageSource { id, eventfd }))
            .collect::<std::io::Result<Vec<_>>>()
            .context("eventfds for the interrupt thread")?;
        let model = Arc::new(ModelInterrupts::default());
        let sink = Arc::new(QueuesThenModel { signals: signals.clone(), model: model.clone() });
        let thread = InterruptThread::start(sources, sink).context("interrupt thread")?;
        plan.program(transport).context("MSI-X vectors in the common config")?;
        progress(format_args!(
            "MSI-X: {} of {table_entries} entries enabled, config on {}, queues on {:?}",
            vectors.len(),
            plan.config,
            plan.queues
        ));
        Ok(QueueInterrupts { thread, vectors, signals, model, plan, table_entries, waiting: Vec::new() })
    }

    /// Makes queue `index` wait by interrupt if it is one of `WAITING_QUEUES`, or ask for them if it is one of
    /// `ASKING_QUEUES`; before its first chain.
    pub fn attach(&mut self, index: u16, queue: &mut SplitQueue<DmaRegion>) {
        if ASKING_QUEUES.contains(&index) && self.plan.queue(index).is_some() {
            queue.ask_for_interrupts();
            return;
        }
        let Some(vector) = self.plan.queue(index).filter(|_| WAITING_QUEUES.contains(&index)) else { return };
        queue.wait_by_interrupt(self.signals.clone(), u32::from(vector));
        self.waiting.push(index);
    }

    /// Writes the MSI-X routing into the device again, after a reset put every source on VIRTIO_MSI_NO_VECTOR
    /// (sleep_resume.rs's D0).
    pub fn reprogram(&self, transport: &VirtioPci) -> anyhow::Result<()> {
        Ok(self.plan.program(transport)?)
    }

    /// The NT model's end of the messages, for the native driver's run to attach its model to.
    pub fn model_sink(&self) -> Arc<ModelInterrupts> {
        self.model.clone()
    }

    /// MSI-X messages enabled: what the PnP manager would give the driver (`NtModel::assign_interrupts`).
    pub fn message_count(&self) -> u32 {
        self.vectors.len() as u32
    }

    /// Stops the thread, turns MSI-X off, and says what each vector delivered. After the device is reset, so no
    /// message of the run is missed.
    pub fn finish(self) -> InterruptsView {
        let QueueInterrupts { thread, vectors, plan, table_entries, waiting, .. } = self;
        let counts = thread.stop();
        drop(vectors);
        InterruptsView {
            table_entries,
            config_vector: plan.config,
            queue_vectors: plan.queues,
            waiting_queues: waiting,
            per_vector: counts.0.into_iter().map(|(_, n)| n).collect(),
        }
    }
}
