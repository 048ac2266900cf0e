//! The Windows-layout MDLs the loader made for a driver binary (IoAllocateMdl), each with the NT model's MDL behind
//! it and its block's size for freeing: the MDL family's table, which `memory_thunks` fills and `dma_thunks` reads.

use std::collections::HashMap;
use std::sync::Mutex;

use vhca_ntapi::PMDL;
use windows_sys::Wdk::Foundation::MDL;

/// Windows MDL address -> (the model's MDL, the block's size).
#[derive(Default)]
pub struct MdlTable {
    mdls: Mutex<HashMap<usize, (PMDL, usize)>>,
}

impl MdlTable {
    /// The model's MDL behind the driver's; an MDL the loader never made goes to the model as is (it refuses it).
    pub fn model_mdl(&self, mdl: *const MDL) -> PMDL {
        crate::lock(&self.mdls).get(&(mdl as usize)).map_or(PMDL(mdl as u64), |(m, _)| *m)
    }

    /// Ties the Windows MDL at `mdl`, a block of `bytes`, to the model's `model`.
    pub fn insert(&self, mdl: *const MDL, model: PMDL, bytes: usize) {
        crate::lock(&self.mdls).insert(mdl as usize, (model, bytes));
    }

    /// How many MDLs the loader made that the driver has not freed.
    pub fn count(&self) -> usize {
        crate::lock(&self.mdls).len()
    }

    /// Calls `f` with each MDL the loader made and the driver has not freed, the table held: IoFreeMdl takes an MDL
    /// out of the table before it frees the block, so none of them is freed while `f` reads it (a process's exit
    /// looks for those still locked).
    pub fn for_each(&self, mut f: impl FnMut(*const MDL)) {
        for &mdl in crate::lock(&self.mdls).keys() {
            f(mdl as *const MDL);
        }
    }

    /// Unties `mdl`, giving the model's MDL and the block's size; None for an MDL the loader never made.
    pub fn remove(&self, mdl: *const MDL) -> Option<(PMDL, usize)> {
        crate::lock(&self.mdls).remove(&(mdl as usize))
    }
}
