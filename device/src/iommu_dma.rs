//! The HCA's view of guest memory: `vhca_hca::Dma` over the IOMMU-translated memory. A miss is asked of QEMU and
//! waited for (on the worker thread, bounded); what stays refused becomes a `DmaError` and a `dma_fault` line.

use std::sync::atomic::Ordering;
use std::time::Instant;

use vhca_hca::{Dma, DmaError};
use vhca_proto::FaultCause;
use vm_memory::{Bytes, GuestAddress, Permissions};

use crate::event_log::TransportEvent;
use crate::iommu::FaultKind;
use crate::memory::GuestMem;
use crate::shared::Shared;

/// DMA on behalf of one queue's request; `queue` only labels the fault lines.
pub struct QueueDma<'a> {
    shared: &'a Shared,
    mem: &'a GuestMem,
    queue: u16,
}

impl<'a> QueueDma<'a> {
    pub fn new(shared: &'a Shared, mem: &'a GuestMem, queue: u16) -> QueueDma<'a> {
        QueueDma { shared, mem, queue }
    }

    fn access(
        &self,
        iova: u64,
        access: Permissions,
        mut op: impl FnMut(&GuestMem) -> Result<(), vm_memory::GuestMemoryError>,
    ) -> Result<(), DmaError> {
        let deadline = Instant::now() + self.shared.miss_timeout;
        let mut asked: Option<u64> = None;
        loop {
            let iommu = &self.shared.iommu;
            let generation = iommu.generation();
            iommu.clear_fault();
            let err = match op(self.mem) {
                Ok(()) => return Ok(()),
                Err(err) => err,
            };
            let Some(fault) = iommu.take_fault() else {
                // The IOTLB translated, but to a QEMU address outside the mem table.
                tracing::error!("DMA at iova {iova:#x}: translated outside guest memory: {err}");
                return Err(fault_event(self.shared, self.queue, iova, FaultCause::IommuUnmapped));
            };
            if fault.kind == FaultKind::Permission {
                return Err(fault_event(self.shared, self.queue, fault.iova, FaultCause::IommuPermission));
            }
            let may_wait = Instant::now() < deadline
                && !self.shared.stopping()
                && !self.shared.control_pending.load(Ordering::Acquire);
            if !may_wait {
                return Err(fault_event(self.shared, self.queue, fault.iova, FaultCause::IommuUnmapped));
            }
            if asked != Some(fault.iova) {
                if !self.shared.send_miss(fault.iova, access) {
                    return Err(fault_event(self.shared, self.queue, fault.iova, FaultCause::IommuUnmapped));
                }
                asked = Some(fault.iova);
            }
            // An unchanged generation after the deadline means QEMU had no mapping to give: loop once more to
            // report the fault with the address that is still missing.
            iommu.wait_for_change(generation, deadline);
        }
    }
}

/// Logs a refused DMA and returns the error the HCA sees.
pub fn fault_event(shared: &Shared, queue: u16, iova: u64, cause: FaultCause) -> DmaError {
    shared.events.record(&TransportEvent::DmaFault { iova, cause: cause.name(), queue });
    tracing::warn!("queue {queue}: DMA to iova {iova:#x} refused: {}", cause.name());
    DmaError { iova, cause }
}

impl Dma for QueueDma<'_> {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        if buf.is_empty() {
            return Ok(());
        }
        self.access(iova, Permissions::Read, |mem| mem.read_slice(buf, GuestAddress(iova)))
    }

    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaError> {
        if buf.is_empty() {
            return Ok(());
        }
        self.access(iova, Permissions::Write, |mem| mem.write_slice(buf, GuestAddress(iova)))
    }
}
