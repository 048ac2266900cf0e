//! Reading a CQ's ring: where each slot is in CPU memory and the consumer index, shared between the control path's
//! poll_cq and the interrupt path's DPC, so both read the same lap of the ring.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU32, Ordering};

use vhca_ntapi::{NtKernel, PVOID};
use vhca_proto::{cqe_owner, Cqe, CQE_SIZE};
use zerocopy::FromBytes;

use crate::error::DriverError;
use crate::ring::Ring;

/// A CQ's slots and consumer index. Cloning shares the consumer index: a clone is another view of the same CQ.
/// Valid while the CQ's ring is allocated, so a holder (the completion path) lets go before destroy_cq frees it.
#[derive(Clone)]
pub struct CqReader {
    entries: u32,
    /// CPU address of each slot, computed once: the DPC reads the ring without walking its pieces.
    slots: Arc<Vec<PVOID>>,
    /// The next CQE to take. Atomic because two paths may hold the reader; they never poll at once (the control
    /// path polls only CQs the interrupt path does not watch), so a plain load/store pair is enough.
    consumer: Arc<AtomicU32>,
}

impl CqReader {
    pub(crate) fn new(ring: &Ring, entries: u32) -> Result<CqReader, DriverError> {
        let slots = (0..entries as u64)
            .map(|i| ring.va(i * CQE_SIZE as u64).ok_or(DriverError::InvalidParameter("CQ slot outside its ring")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CqReader { entries, slots: Arc::new(slots), consumer: Arc::new(AtomicU32::new(0)) })
    }

    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Zeroes every slot (the device must not be writing the ring): no owner matches zero, so nothing reads as new.
    pub fn clear<K: NtKernel + ?Sized>(&self, kernel: &K) {
        for slot in self.slots.iter() {
            kernel.RtlCopyToVa(*slot, &[0u8; CQE_SIZE]);
        }
    }

    pub fn consumer(&self) -> u32 {
        self.consumer.load(Ordering::Acquire)
    }

    /// Takes up to `max` new completions: a CQE is new when its owner field matches this lap of the ring.
    pub fn poll<K: NtKernel + ?Sized>(&self, kernel: &K, max: usize) -> Vec<Cqe> {
        let mut consumer = self.consumer();
        let mut out = Vec::new();
        while out.len() < max {
            let mut bytes = [0u8; CQE_SIZE];
            kernel.RtlCopyFromVa(&mut bytes, self.slots[(consumer % self.entries) as usize]);
            let Ok(cqe) = Cqe::read_from_bytes(&bytes) else { break };
            if cqe.owner.get() != cqe_owner(consumer, self.entries) {
                break;
            }
            out.push(cqe);
            consumer = consumer.wrapping_add(1);
        }
        self.consumer.store(consumer, Ordering::Release);
        out
    }
}
