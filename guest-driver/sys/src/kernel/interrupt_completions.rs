//! vhca.sys's interrupt path as the scenarios hold it: the driver core's `CompletionWaits` over the WDK shim and
//! the channel, which at disconnect first routes the device's MSI-X sources to no vector, then disconnects.
//!
//! Why the routing goes first: Microsoft's IoDisconnectInterruptEx page asks the driver to disable its device's
//! interrupts before the call, so no message arrives for an interrupt object being torn down. A virtio device is
//! told with VIRTIO_MSI_NO_VECTOR in its config and queue vector registers (virtio 1.2, 4.1.4.3), as Linux's
//! virtio-pci does when it lets go of a queue; the reset at stop or remove clears them again anyway.

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::time::Duration;

use vhca_driver_core::{CompletionCounts, CompletionHooks, CompletionWaits, CqCompletions, CqReader};
use vhca_proto::{Cqe, Event};
use vhca_virtio::{MsixPlan, VirtioPci, NO_VECTOR};

use super::debug_print::print_line;
use super::mmio_registers::MmioBar;
use super::sys_command_transport::SysCommandTransport;
use super::wdk_kernel::WdkKernel;

pub struct InterruptCompletions {
    /// Taken only by `disconnect`, which consumes the value.
    waits: Option<CompletionWaits<WdkKernel, SysCommandTransport>>,
    /// The device's registers, for the vector routing; the started device outlives the scenario holding this.
    transport: Arc<VirtioPci<MmioBar>>,
    /// The routing written after the connection (None: none was, nothing to clear).
    plan: Option<MsixPlan>,
}

impl InterruptCompletions {
    pub fn new(
        waits: CompletionWaits<WdkKernel, SysCommandTransport>,
        transport: Arc<VirtioPci<MmioBar>>,
        plan: Option<MsixPlan>,
    ) -> InterruptCompletions {
        InterruptCompletions { waits: Some(waits), transport, plan }
    }

    fn waits(&self) -> &CompletionWaits<WdkKernel, SysCommandTransport> {
        self.waits.as_ref().expect("the waits are taken only by disconnect, which consumes the value")
    }

    /// PASSIVE_LEVEL. Every source the plan routed, to no vector. A register the device does not take is noted, not
    /// fatal: the disconnect that follows is what must happen.
    fn route_to_no_vector(&mut self) {
        let Some(plan) = self.plan.take() else { return };
        let t = &self.transport;
        let config = t.set_config_msix_vector(NO_VECTOR).err();
        let queues =
            (0u16..).zip(&plan.queues).filter_map(|(index, _)| t.set_queue_msix_vector(index, NO_VECTOR).err());
        for e in config.into_iter().chain(queues) {
            print_line(&alloc::format!("vhca: MSI-X routing not cleared before disconnect: {e}"));
        }
    }
}

impl CqCompletions for InterruptCompletions {
    fn watch(&self, cq: u32, reader: CqReader) {
        self.waits().watch(cq, reader)
    }
    fn unwatch(&self, cq: u32) {
        self.waits().unwatch(cq)
    }
    fn is_watched(&self, cq: u32) -> bool {
        self.waits().is_watched(cq)
    }
    fn kick(&self, cq: u32) {
        self.waits().kick(cq)
    }
    fn take(&self, cq: u32, max: usize) -> Vec<Cqe> {
        self.waits().take(cq, max)
    }
    fn wait(&self, cq: u32, timeout: Duration) -> bool {
        self.waits().wait(cq, timeout)
    }
    fn take_event(&self) -> Option<Event> {
        self.waits().take_event()
    }
    fn wait_event(&self, timeout: Duration) -> bool {
        self.waits().wait_event(timeout)
    }
    fn counts(&self) -> CompletionCounts {
        self.waits().counts()
    }
    /// The scenarios' interrupt-path variants (their own consumers and ISR work) reach the path through these, on
    /// vhca.sys as in the Linux guest.
    fn hooks(&self) -> Option<&dyn CompletionHooks> {
        self.waits().hooks()
    }
    /// The device's interrupts off, then IoDisconnectInterruptEx and KeFlushQueuedDpcs (`CompletionPath`), before
    /// the scenario destroys any CQ the DPC reads.
    fn disconnect(mut self: Box<Self>) -> CompletionCounts {
        self.route_to_no_vector();
        let waits = self.waits.take().expect("disconnect runs once: it consumes the value");
        Box::new(waits).disconnect()
    }
}

impl Drop for InterruptCompletions {
    /// Dropped without `disconnect` (a way out that skipped it): the interrupts off first here too, then the waits'
    /// own drop disconnects and flushes (`CompletionPath`'s drop).
    fn drop(&mut self) {
        self.route_to_no_vector();
    }
}
