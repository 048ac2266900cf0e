//! Model addresses and process addresses of the same memory. The NT model hands out model virtual addresses for
//! pool, contiguous memory and common buffers; a driver binary dereferences what it gets, so each such address goes
//! to the driver as where the backend keeps that page in this process (`NtModel::host_view`), and comes back to the
//! model translated again. Memory the model never gave out (the driver's stack, its image) is passed through as is,
//! so the model's own checks see an address it does not know and say so. Special Pool's inaccessible pages are
//! kept here too (`special_pool`): they are a view of the same addresses.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

use vhca_ntapi::PVOID;
use vhca_ntmodel::{HostView, NtModel};

use crate::special_pool::SpecialPoolPages;

#[derive(Default)]
pub struct AddressSpace {
    /// host base -> the region's view
    by_host: Mutex<BTreeMap<usize, HostView>>,
    /// Special Pool's guard pages and freed blocks, made inaccessible at their process addresses.
    pub special_pool: SpecialPoolPages,
}

impl AddressSpace {
    /// The process address of model address `va` (null for NULL). A model address in memory the backend does not
    /// keep as plain memory cannot be handed to a driver binary: that is a loader set-up error, and panics.
    pub fn to_host(&self, model: &NtModel, va: PVOID) -> usize {
        if va.is_null() {
            return 0;
        }
        let view = model.host_view(va).unwrap_or_else(|| panic!("model address {:#x} has no process address", va.0));
        crate::lock(&self.by_host).insert(view.host_base, view);
        view.host_base + (va.0 - view.model_base) as usize
    }

    /// The model address of process address `host`; `host` itself when the model never gave it out.
    pub fn to_model(&self, host: usize) -> PVOID {
        let by_host = crate::lock(&self.by_host);
        match by_host.range(..=host).next_back() {
            Some((base, view)) if ((host - base) as u64) < view.bytes => PVOID(view.model_base + (host - base) as u64),
            _ => PVOID(host as u64),
        }
    }

    /// The model address a pointer the driver passes stands for (MDL current VAs, common buffer addresses).
    pub fn model_va(&self, host: *const c_void) -> PVOID {
        self.to_model(host as usize)
    }

    /// The region at `host` was freed: its process address may be reused for another.
    pub fn forget(&self, host: usize) {
        let mut by_host = crate::lock(&self.by_host);
        let base = match by_host.range(..=host).next_back() {
            Some((base, view)) if ((host - base) as u64) < view.bytes => *base,
            _ => return,
        };
        by_host.remove(&base);
    }
}
