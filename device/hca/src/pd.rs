//! Protection domains: a set of live PD handles. MRs and QPs name their PD; an SGE or rkey only works on an MR of
//! the QP's own PD. Whether a PD is still in use is asked of the MR and QP tables, so no count can drift.

use std::collections::BTreeSet;

use crate::handles::HandleAllocator;

pub struct PdTable {
    live: BTreeSet<u32>,
    handles: HandleAllocator,
}

impl PdTable {
    pub fn new(max: u32) -> PdTable {
        PdTable { live: BTreeSet::new(), handles: HandleAllocator::new(1, max) }
    }

    pub fn alloc(&mut self) -> Option<u32> {
        let pd = self.handles.allocate()?;
        self.live.insert(pd);
        Some(pd)
    }

    pub fn contains(&self, pd: u32) -> bool {
        self.live.contains(&pd)
    }

    pub fn remove(&mut self, pd: u32) -> bool {
        let removed = self.live.remove(&pd);
        if removed {
            self.handles.release();
        }
        removed
    }
}
