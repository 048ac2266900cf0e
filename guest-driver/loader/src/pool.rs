//! The driver's pool: real memory, since a driver binary dereferences its pool pointers (the NT model's pool hands
//! out model addresses only its own accessors can reach). Tags are kept so unload can report leaks as the verifier's
//! pool tracking does; a free of a block the pool never gave out is BAD_POOL_CALLER as on Windows.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::sync::Mutex;

/// Pool blocks are 16-byte aligned on x64 Windows (ExAllocatePool2's documented alignment).
const POOL_ALIGN: usize = 16;

#[derive(Default)]
pub struct Pool {
    blocks: Mutex<HashMap<usize, (usize, u32)>>,
}

impl Pool {
    /// ExAllocatePool2: zeroed memory, or null when none is left.
    pub(crate) fn allocate(&self, bytes: usize, tag: u32) -> *mut u8 {
        let Ok(layout) = Layout::from_size_align(bytes.max(1), POOL_ALIGN) else {
            return std::ptr::null_mut();
        };
        // SAFETY: a non-zero size with a valid alignment.
        let p = unsafe { alloc_zeroed(layout) };
        if !p.is_null() {
            crate::lock(&self.blocks).insert(p as usize, (bytes.max(1), tag));
        }
        p
    }

    /// ExFreePoolWithTag: false when `p` is not a live block (the caller stops the machine).
    pub(crate) fn free(&self, p: *mut u8) -> bool {
        let Some((bytes, _)) = crate::lock(&self.blocks).remove(&(p as usize)) else {
            return false;
        };
        // SAFETY: a live block from `allocate` with this size, freed once (removed from the table above).
        unsafe { dealloc(p, Layout::from_size_align(bytes, POOL_ALIGN).expect("pool layout")) };
        true
    }

    /// Blocks still allocated: (address, bytes, tag).
    pub fn outstanding(&self) -> Vec<(usize, usize, u32)> {
        let mut v: Vec<_> = crate::lock(&self.blocks).iter().map(|(a, (b, t))| (*a, *b, *t)).collect();
        v.sort();
        v
    }
}
