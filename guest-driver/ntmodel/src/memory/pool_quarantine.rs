//! Freed pool whose pages are not given back yet: Windows without Special Pool returns a freed block to the pool
//! allocator, still mapped and holding what was written, so a late reader meets stale data, not a fault.
//!
//! Why a bounded quarantine rather than keeping every freed page: a run frees pool for as long as it works (each
//! block at least a page of the backend's memory), and the guest has 512 MiB. The oldest block is really released
//! first, because the frees a late reader trips over are the newest: the teardown's, which come last in a run.

use std::collections::VecDeque;

use crate::{HostMemId, PAGE};

/// 16 MiB: the biggest pool block a driver here frees is vhca.sys's Rust heap (4 MiB, `pool_allocator.rs`'s
/// HEAP_BYTES), given back last in DriverUnload; four times that keeps it and the rest of a teardown's frees (rings,
/// buffers, objects) whole, at a cost of at most 3 % of the guest's memory. A block bigger than the cap on its own
/// is released at once, as it would push everything else out.
pub(crate) const CAP_BYTES: u64 = 16 << 20;

/// Freed pool still backed, oldest first, and the bytes it holds.
#[derive(Default)]
pub(crate) struct PoolQuarantine {
    held: VecDeque<(HostMemId, u64)>,
    bytes: u64,
}

impl PoolQuarantine {
    /// Holds `mem`'s `pages`; returns what leaves the quarantine to keep it under the cap, oldest first, for the
    /// caller to give back to the backend.
    pub fn hold(&mut self, mem: HostMemId, pages: usize) -> Vec<HostMemId> {
        let bytes = pages as u64 * PAGE;
        self.held.push_back((mem, bytes));
        self.bytes += bytes;
        let mut released = Vec::new();
        while self.bytes > CAP_BYTES {
            let Some((old, old_bytes)) = self.held.pop_front() else { break };
            self.bytes -= old_bytes;
            released.push(old);
        }
        released
    }

    /// Everything still held, for release when the model goes away.
    pub fn drain(&mut self) -> Vec<HostMemId> {
        self.bytes = 0;
        self.held.drain(..).map(|(mem, _)| mem).collect()
    }

    /// Whether `mem` is still held (not yet given back).
    pub fn holds(&self, mem: HostMemId) -> bool {
        self.held.iter().any(|(m, _)| *m == mem)
    }

    /// Bytes held now (never above `CAP_BYTES`).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB_PAGES: usize = (1 << 20) / PAGE as usize;

    #[test]
    fn the_oldest_block_leaves_first_once_the_cap_is_passed() {
        let mut q = PoolQuarantine::default();
        for id in 0..16 {
            assert!(q.hold(HostMemId(id), MIB_PAGES).is_empty(), "16 MiB fit");
        }
        assert_eq!(q.hold(HostMemId(16), 2 * MIB_PAGES), vec![HostMemId(0), HostMemId(1)]);
        assert_eq!(q.bytes(), CAP_BYTES);
    }

    #[test]
    fn a_block_bigger_than_the_cap_is_released_with_everything_before_it() {
        let mut q = PoolQuarantine::default();
        q.hold(HostMemId(1), 1);
        assert_eq!(q.hold(HostMemId(2), 17 * MIB_PAGES), vec![HostMemId(1), HostMemId(2)]);
        assert_eq!(q.bytes(), 0);
        assert!(q.drain().is_empty());
    }
}
