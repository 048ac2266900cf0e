//! What stands behind the DMA objects a driver binary holds: each DMA_ADAPTER's model adapter, each list's model list
//! (in the loader's block or the driver's own buffer), each MDL-made common buffer. The DMA family's table.

use std::collections::HashMap;
use std::sync::Mutex;

use vhca_ntapi::{HANDLE, PDMA_ADAPTER, PSCATTER_GATHER_LIST};
use windows_sys::Wdk::System::SystemServices::{DMA_ADAPTER, SCATTER_GATHER_LIST};

/// What the loader keeps per adapter, list and MDL-made common buffer.
#[derive(Default)]
pub struct DmaObjects {
    /// Windows DMA_ADAPTER -> the model's adapter.
    adapters: Mutex<HashMap<usize, PDMA_ADAPTER>>,
    /// Windows SCATTER_GATHER_LIST -> (the model's list handle, the block's size).
    lists: Mutex<HashMap<usize, (PSCATTER_GATHER_LIST, usize)>>,
    /// (adapter, process address) of a common buffer made from an MDL -> the model's IoMapCommonBuffer handle.
    mdl_buffers: Mutex<HashMap<(usize, usize), HANDLE>>,
    /// A list BuildScatterGatherList(Ex) wrote into the driver's own buffer -> the model's list handle.
    driver_lists: Mutex<HashMap<usize, PSCATTER_GATHER_LIST>>,
}

impl DmaObjects {
    pub fn insert_adapter(&self, adapter: *const DMA_ADAPTER, model: PDMA_ADAPTER) {
        crate::lock(&self.adapters).insert(adapter as usize, model);
    }

    /// The model's adapter behind the driver's; one the loader never made goes to the model as is (it refuses it).
    pub fn model_adapter(&self, adapter: *const DMA_ADAPTER) -> PDMA_ADAPTER {
        crate::lock(&self.adapters).get(&(adapter as usize)).copied().unwrap_or(PDMA_ADAPTER(adapter as u64))
    }

    /// Ties the Windows list at `list`, a block of `bytes`, to the model's list `handle`.
    pub fn insert_list(&self, list: *const SCATTER_GATHER_LIST, handle: PSCATTER_GATHER_LIST, bytes: usize) {
        crate::lock(&self.lists).insert(list as usize, (handle, bytes));
    }

    /// Unties `list`, giving the model's handle and the block's size; None for a list the loader did not deliver.
    pub fn remove_list(&self, list: *const SCATTER_GATHER_LIST) -> Option<(PSCATTER_GATHER_LIST, usize)> {
        crate::lock(&self.lists).remove(&(list as usize))
    }

    /// Ties the list in the driver's buffer at `list` to the model's list `handle`.
    pub fn insert_driver_list(&self, list: *const SCATTER_GATHER_LIST, handle: PSCATTER_GATHER_LIST) {
        crate::lock(&self.driver_lists).insert(list as usize, handle);
    }

    /// Unties a list in the driver's buffer, giving the model's handle; None for any other list.
    pub fn remove_driver_list(&self, list: *const SCATTER_GATHER_LIST) -> Option<PSCATTER_GATHER_LIST> {
        crate::lock(&self.driver_lists).remove(&(list as usize))
    }

    /// Records the common buffer at process address `va` that `adapter` made from an MDL.
    pub fn insert_mdl_buffer(&self, adapter: *const DMA_ADAPTER, va: usize, handle: HANDLE) {
        crate::lock(&self.mdl_buffers).insert((adapter as usize, va), handle);
    }

    /// Forgets that common buffer, giving its IoMapCommonBuffer handle; None for a buffer not made from an MDL.
    pub fn remove_mdl_buffer(&self, adapter: *const DMA_ADAPTER, va: usize) -> Option<HANDLE> {
        crate::lock(&self.mdl_buffers).remove(&(adapter as usize, va))
    }
}
