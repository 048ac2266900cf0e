//! Which MSI-X table entry each virtio interrupt source signals, from how many entries the device has, and its
//! programming through the common config. Platform-free: the Linux guest program enables the entries through VFIO.

use alloc::vec::Vec;

use crate::transport::{Registers, TransportError, VirtioPci};

/// The MSI-X entry of configuration changes and of each queue (queue i at index i).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MsixPlan {
    pub config: u16,
    pub queues: Vec<u16>,
}

impl MsixPlan {
    /// Assigns `table_entries` entries to the config and `queues` queues, as Linux's virtio-pci does (vp_find_vqs):
    /// an entry each when the table has room for all (config 0, queue i at i + 1); else config on 0 and every queue
    /// shares 1. A one-entry table (QEMU's vhost-user-snd-pci, the vhca carrier, has exactly one) shares entry 0
    /// among all, where Linux would give up on MSI-X: a waiter polls its used ring after every message anyway, so
    /// a message meant for another source costs one empty poll. None without an MSI-X table.
    pub fn new(table_entries: u16, queues: u16) -> Option<MsixPlan> {
        let queues: Vec<u16> = match table_entries {
            0 => return None,
            n if n > queues => (1..=queues).collect(),
            1 => (0..queues).map(|_| 0).collect(),
            _ => (0..queues).map(|_| 1).collect(),
        };
        Some(MsixPlan { config: 0, queues })
    }

    /// The entry queue `index` signals, if the plan covers that queue.
    pub fn queue(&self, index: u16) -> Option<u16> {
        self.queues.get(index as usize).copied()
    }

    /// How many table entries the plan uses (entries 0 up to the highest it names): how many to enable.
    pub fn entries_used(&self) -> u16 {
        self.queues.iter().copied().chain([self.config]).max().map_or(0, |highest| highest + 1)
    }

    /// Writes the plan into the device's vector registers, each read back (a refusal is the transport's error).
    /// Before the queues are enabled (virtio 1.2, 4.1.5.1.3 step 3) and after the platform enabled MSI-X: a device
    /// may refuse entries while MSI-X is off (QEMU does not; the spec lets it).
    pub fn program<R: Registers + Clone>(&self, transport: &VirtioPci<R>) -> Result<(), TransportError<R::Error>> {
        transport.set_config_msix_vector(self.config)?;
        for (index, vector) in (0u16..).zip(&self.queues) {
            transport.set_queue_msix_vector(index, *vector)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entry_each_when_the_table_has_room_else_shared() {
        assert_eq!(MsixPlan::new(5, 4), Some(MsixPlan { config: 0, queues: vec![1, 2, 3, 4] }));
        assert_eq!(MsixPlan::new(64, 1), Some(MsixPlan { config: 0, queues: vec![1] }));
        assert_eq!(MsixPlan::new(4, 4), Some(MsixPlan { config: 0, queues: vec![1, 1, 1, 1] }));
        assert_eq!(MsixPlan::new(2, 1), Some(MsixPlan { config: 0, queues: vec![1] }));
        assert_eq!(MsixPlan::new(1, 4), Some(MsixPlan { config: 0, queues: vec![0, 0, 0, 0] }));
        assert_eq!(MsixPlan::new(0, 4), None);
    }

    #[test]
    fn entries_used_counts_up_to_the_highest_named_entry() {
        assert_eq!(MsixPlan::new(5, 4).unwrap().entries_used(), 5);
        assert_eq!(MsixPlan::new(64, 4).unwrap().entries_used(), 5, "a large table is not enabled whole");
        assert_eq!(MsixPlan::new(3, 4).unwrap().entries_used(), 2);
        assert_eq!(MsixPlan::new(1, 4).unwrap().entries_used(), 1);
        assert_eq!(MsixPlan::new(1, 0).unwrap().entries_used(), 1, "config alone");
        let plan = MsixPlan::new(5, 4).unwrap();
        assert_eq!((plan.queue(0), plan.queue(3), plan.queue(4)), (Some(1), Some(4), None));
    }
}
