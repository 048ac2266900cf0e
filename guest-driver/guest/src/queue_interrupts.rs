//! A run's interrupts (`vhca.completion=interrupt`): the device's MSI-X entries enabled through VFIO, the vector plan
//! written into its common config, and the interrupt thread delivering each message to the queues' waits.
//!
//! Only queue 0 waits by interrupt in this step (vhca's command queue, virtio-rng's request queue); the event and
//! doorbell queues keep declining them until the driver core itself is interrupt-driven.

use std::sync::Arc;

use anyhow::Context;
use vhca_virtio::MsixPlan;

use crate::cmdline::Completion;
use crate::completion_wait::MessageSignals;
use crate::interrupt_thread::{InterruptThread, MessageSource};
use crate::msix_vectors::{self, MsixVectors};
use crate::report::{progress, InterruptsView, Report};
use crate::vfio::Device;
use crate::vfio_dma::DmaRegion;
use crate::virtio_pci::VirtioPci;
use crate::virtqueue::SplitQueue;

/// The queues that ask for interrupts and wait for them.
const WAITING_QUEUES: [u16; 1] = [0];

/// Field order is drop order: the thread is joined before MSI-X is disabled and the eventfds close.
pub struct QueueInterrupts<'d> {
    thread: InterruptThread,
    vectors: MsixVectors<'d>,
    signals: Arc<MessageSignals>,
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
        let thread = InterruptThread::start(sources, signals.clone()).context("interrupt thread")?;
        plan.program(transport).context("MSI-X vectors in the common config")?;
        progress(format_args!(
            "MSI-X: {} of {table_entries} entries enabled, config on {}, queues on {:?}",
            vectors.len(),
            plan.config,
            plan.queues
        ));
        Ok(QueueInterrupts { thread, vectors, signals, plan, table_entries, waiting: Vec::new() })
    }

    /// Makes queue `index` wait by interrupt if it is one of `WAITING_QUEUES`; before its first chain.
    pub fn attach(&mut self, index: u16, queue: &mut SplitQueue<DmaRegion>) {
        let Some(vector) = self.plan.queue(index).filter(|_| WAITING_QUEUES.contains(&index)) else { return };
        queue.wait_by_interrupt(self.signals.clone(), u32::from(vector));
        self.waiting.push(index);
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
