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

    /// Every MDL the loader made and the driver has not freed (a process's exit looks for those still locked).
    pub fn addresses(&self) -> Vec<usize> {
        crate::lock(&self.mdls).keys().copied().collect()
    }

    /// Unties `mdl`, giving the model's MDL and the block's size; None for an MDL the loader never made.
    pub fn remove(&self, mdl: *const MDL) -> Option<(PMDL, usize)> {
        crate::lock(&self.mdls).remove(&(mdl as usize))
    }
}
