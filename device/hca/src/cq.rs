//! Completion queues: a ring of CQEs in guest memory the device writes by DMA, its producer index and its arming.
//! Where a CQE goes and which owner value it carries is decided here; the write itself is the DMA engine's.

use vhca_proto::{cqe_owner, CQE_SIZE};

use crate::mapped_pages::MappedPages;

pub struct Cq {
    pub entries: u32,
    pub registers: MappedPages,
    /// Count of CQEs ever written (monotonic, wraps at 2^32 like the driver's consumer index).
    pub producer: u32,
    /// Armed for one notification; `Some(true)` only for solicited completions.
    pub armed: Option<bool>,
}

impl Cq {
    /// The next CQE's slot as a byte offset into the ring, and the owner value it must carry.
    pub fn next_slot(&self) -> (u64, u32) {
        let slot = self.producer % self.entries.max(1);
        (u64::from(slot) * CQE_SIZE as u64, cqe_owner(self.producer, self.entries))
    }

    /// Whether a completion (solicited or an error) fires the armed notification; disarms when it does.
    pub fn take_notification(&mut self, solicited: bool, error: bool) -> bool {
        match self.armed {
            Some(solicited_only) if !solicited_only || solicited || error => {
                self.armed = None;
                true
            }
            _ => false,
        }
    }
}
