//! The native twin of vhca.sys's sleep and resume (`vhca.power=sleep-resume[:N]`): the device powered up again over
//! VFIO as vhca.sys does at D0 (the virtio bring-up, every queue, the MSI-X routing, DRIVER_OK), then proved working.

use std::time::Duration;

use anyhow::Context;
use vhca_proto::QUEUE_COMMAND;

use crate::bring_up::{setup_queue, Queue};
use crate::queue_interrupts::QueueInterrupts;
use crate::report::progress;
use crate::vfio_command_transport::{command_queue, CommandQueue};
use crate::vfio_dma::DmaMapper;
use crate::virtio_pci::{VirtioPci, F_ACCESS_PLATFORM, F_VERSION_1, STATUS_ACKNOWLEDGE, STATUS_DRIVER};

/// What D0 gives back: every queue set up again, the command queue taken for the check.
pub struct PoweredUp {
    pub queues: Vec<Option<Queue>>,
    pub commands: CommandQueue,
}

/// D0 after the caller's D3 (the device reset, then its rings and buffers unmapped): the device really initialised
/// again (nothing of the first bring-up is reused but the BAR mappings and the MSI-X vectors VFIO enabled, as
/// vhca.sys keeps its BARs and interrupt resources), then QUERY_DEVICE answered on the new command queue.
pub fn power_up(
    transport: &VirtioPci,
    mapper: &DmaMapper,
    mut interrupts: Option<&mut QueueInterrupts>,
    queue_count: u16,
    timeout: Duration,
) -> anyhow::Result<PoweredUp> {
    transport.reset(timeout).context("D0: reset")?;
    transport.add_status(STATUS_ACKNOWLEDGE)?;
    transport.add_status(STATUS_DRIVER)?;
    transport.negotiate(F_VERSION_1 | F_ACCESS_PLATFORM, 0).context("D0: features")?;
    // The reset put every source back on VIRTIO_MSI_NO_VECTOR: the routing is written again before any queue runs.
    if let Some(interrupts) = interrupts.as_deref_mut() {
        interrupts.reprogram(transport).context("D0: MSI-X vectors")?;
    }
    let mut queues = Vec::new();
    for index in 0..queue_count {
        let (mut queue, notifier) = setup_queue(transport, mapper, index).context("D0: queues")?;
        if let Some(interrupts) = interrupts.as_deref_mut() {
            interrupts.attach(index, &mut queue);
        }
        queues.push(Some((queue, notifier)));
    }
    transport.driver_ok().context("D0: DRIVER_OK")?;
    let (queue, notifier) = queues[QUEUE_COMMAND as usize].take().context("D0: no command queue")?;
    let mut commands = command_queue(queue, notifier, mapper, timeout)?;
    let (resp, _) = commands.query_device().context("QUERY_DEVICE after D0")?;
    progress(format_args!("D0: device initialised again, QUERY_DEVICE answered (abi {})", resp.abi_version.get()));
    Ok(PoweredUp { queues, commands })
}
