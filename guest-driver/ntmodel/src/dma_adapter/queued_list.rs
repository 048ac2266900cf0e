//! A GetScatterGatherList that waited for map registers is built when they come back, from its MDL as it is then:
//! an MDL freed or unlocked in between is DMA checking's 0xE6/0x0E, where the list used to be dropped unseen.

use vhca_ntapi::PMDL;

use super::Refusal;
use crate::bugcheck::Bugcheck;
use crate::mdl::Mdl;
use crate::memory::Memory;
use crate::verifier::e6;
use crate::NtModel;

impl NtModel {
    /// Runs `build` for a queued list over `mdl`, which was `at_call` when the driver asked. An MDL still there is
    /// built from as it is now (map_buffer's 0xE6/0x0E catches one unlocked since: "The driver tried a DMA
    /// transfer without locking the buffer", P2 the MDL). One freed since is 0xE6/0x0E too under DMA checking,
    /// with the same parameters: Microsoft's E6 page names no code for it, and 0x0E is the documented one for a
    /// transfer over a buffer nothing keeps locked. Without the check, the HAL reads the freed MDL, whose memory
    /// still holds its page frames: the list is built from the MDL as the call saw it and the routine runs, as
    /// it would on Windows until the pages are reused.
    pub(super) fn with_queued_mdl<T>(
        &self,
        m: &mut Memory,
        mdl: PMDL,
        at_call: &Mdl,
        build: impl FnOnce(&NtModel, &mut Memory) -> Result<T, Refusal>,
    ) -> Result<T, Refusal> {
        if m.mdls.contains_key(&mdl.0) {
            return build(self, m);
        }
        if self.dma_checking() {
            self.found(Bugcheck::e6(e6::PAGED_MEMORY, mdl.0, 0, 0))?;
        }
        m.mdls.insert(mdl.0, at_call.clone());
        let built = build(self, m);
        m.mdls.remove(&mdl.0);
        built
    }
}
