//! A vhca.sys run's MSI-X (`vhca.completion=interrupt`): the messages the PnP manager grants the device, enabled
//! through VFIO as for a native run, each delivered to the NT model as the PDO's message on the interrupt thread
//! that took it (`model_interrupts`), where the model runs vhca.sys's ISR and DPC. vhca.sys routes the virtio
//! sources itself.
//!
//! The grant follows Microsoft ("Enabling Message-Signaled Interrupts in the Registry"): the INF's
//! MessageNumberLimit when the device's MSI-X table has that many entries, else exactly one message. The limit is
//! read from vhca.inf itself, so the run grants what Windows would for the INF that ships.

use std::sync::Arc;

use anyhow::Context;
use vhca_ntapi::PDEVICE_OBJECT;
use vhca_ntmodel::NtModel;

use crate::interrupt_thread::{InterruptThread, MessageSource};
use crate::model_interrupts::{ModelDelivery, ModelInterrupts};
use crate::msix_vectors::{self, MsixVectors};
use crate::report::{progress, InterruptsView};
use crate::vfio::Device;

const INF: &str = include_str!("../../../sys/vhca.inf");

/// The INF's MessageNumberLimit (its AddReg line under MessageSignaledInterruptProperties); None when it has none.
pub fn message_number_limit(inf: &str) -> Option<u32> {
    let line = inf.lines().map(str::trim).find(|l| !l.starts_with(';') && l.contains(",MessageNumberLimit,"))?;
    line.rsplit(',').next()?.trim().parse().ok()
}

/// How many messages the PnP manager grants a device whose MSI-X table has `table_entries`, asked for `limit`.
pub fn granted(table_entries: u32, limit: u32) -> u32 {
    match table_entries {
        0 => 0,
        n if n >= limit => limit,
        _ => 1,
    }
}

/// Field order is drop order: the model's delivery stops first, then the interrupt thread, then MSI-X goes off.
pub struct SysInterrupts<'d> {
    delivery: Option<ModelDelivery>,
    thread: InterruptThread,
    vectors: MsixVectors<'d>,
    sink: Arc<ModelInterrupts>,
    table_entries: u32,
}

impl<'d> SysInterrupts<'d> {
    /// Enables the granted messages and starts the thread that takes them; they reach no ISR until `deliver_to`.
    pub fn enable(device: &'d Device) -> anyhow::Result<SysInterrupts<'d>> {
        let table_entries = msix_vectors::table_entries(device).context("MSI-X")?.count;
        let limit = message_number_limit(INF).context("vhca.inf has no MessageNumberLimit")?;
        let vectors = MsixVectors::enable(device, granted(table_entries, limit)).context("MSI-X through VFIO")?;
        let sources = (0u32..)
            .zip(vectors.eventfds())
            .map(|(id, fd)| fd.try_clone().map(|eventfd| MessageSource { id, eventfd }))
            .collect::<std::io::Result<Vec<_>>>()
            .context("eventfds for the interrupt thread")?;
        let sink = Arc::new(ModelInterrupts::default());
        let thread = InterruptThread::start(sources, sink.clone()).context("interrupt thread")?;
        progress(format_args!(
            "MSI-X for vhca.sys: {} of {table_entries} entries (MessageNumberLimit {limit})",
            vectors.len()
        ));
        Ok(SysInterrupts { delivery: None, thread, vectors, sink, table_entries })
    }

    /// What START_DEVICE's resource lists and the model's assignment carry.
    pub fn messages(&self) -> u32 {
        self.vectors.len() as u32
    }

    /// From here each message runs `pdo`'s ISR in `model` (and the model's clock ticks), before START_DEVICE.
    pub fn deliver_to(&mut self, model: Arc<NtModel>, pdo: PDEVICE_OBJECT) -> anyhow::Result<()> {
        self.delivery = Some(self.sink.attach(model, pdo).context("NT model interrupt threads")?);
        Ok(())
    }

    /// Stops delivery and the thread, turns MSI-X off, and says what each message delivered. The routing is
    /// vhca.sys's own (it writes the virtio vector registers), so the view names none.
    pub fn finish(self) -> InterruptsView {
        let SysInterrupts { delivery, thread, vectors, table_entries, .. } = self;
        drop(delivery);
        let counts = thread.stop();
        drop(vectors);
        InterruptsView {
            table_entries,
            per_vector: counts.0.into_iter().map(|(_, n)| n).collect(),
            ..InterruptsView::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_inf_asks_for_five_and_a_short_table_gets_one() {
        assert_eq!(message_number_limit(INF), Some(5));
        assert_eq!(message_number_limit("; ,MessageNumberLimit,0x00010001,9\n"), None, "a comment is not a value");
        assert_eq!((granted(64, 5), granted(5, 5), granted(4, 5), granted(1, 5), granted(0, 5)), (5, 5, 1, 1, 0));
    }
}
