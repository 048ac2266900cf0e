//! A few u64 words of NonPagedPoolNx that two driver contexts share (an ISR and the passive path, two requests, an
//! execution routine and the request it serves), read and written only through RtlCopyFromVa/RtlCopyToVa.
//!
//! Why through the kernel's copy routines and not a Rust atomic: those are the CPU accesses the NT model sees, so
//! its race detector watches these bytes as it watches a ring or a buffer (vhca.sys's copies are its own memcpy,
//! which the model cannot see: there only the result and the model's faults show the bug). The words are read and
//! written one step at a time, as a C driver's `entry->count++` is a load and a store.

use vhca_ntapi::*;

const TAG: u32 = pool_tag(b"VhSw");

/// `N` words at `va`, or what is left of them once freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedWords<const N: usize> {
    va: PVOID,
}

impl<const N: usize> SharedWords<N> {
    /// IRQL <= DISPATCH_LEVEL. Zeroed words, or None when the pool is out (or N is past the 8 words kept here).
    pub fn new<K: NtKernel + ?Sized>(kernel: &K) -> Option<SharedWords<N>> {
        if N > 8 {
            return None;
        }
        let va = kernel.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPoolNx, N * 8, TAG);
        if va.is_null() {
            return None;
        }
        kernel.RtlCopyToVa(va, &[0u8; 64][..N * 8]);
        Some(SharedWords { va })
    }

    /// The block's address, for reports.
    pub fn va(&self) -> PVOID {
        self.va
    }

    /// Any IRQL (non-paged). One load of word `i`. `track_caller`: the model names the scenario's line as the
    /// access's call site (a race report's), not this one.
    #[track_caller]
    pub fn get<K: NtKernel + ?Sized>(&self, kernel: &K, i: usize) -> u64 {
        let mut bytes = [0u8; 8];
        if let Some(at) = self.word(i) {
            kernel.RtlCopyFromVa(&mut bytes, at);
        }
        u64::from_le_bytes(bytes)
    }

    /// Any IRQL (non-paged). One store of word `i`.
    #[track_caller]
    pub fn set<K: NtKernel + ?Sized>(&self, kernel: &K, i: usize, value: u64) {
        if let Some(at) = self.word(i) {
            kernel.RtlCopyToVa(at, &value.to_le_bytes());
        }
    }

    /// IRQL <= DISPATCH_LEVEL. Whoever frees the words must know nothing touches them after.
    #[track_caller]
    pub fn free<K: NtKernel + ?Sized>(self, kernel: &K) {
        kernel.ExFreePoolWithTag(self.va, TAG);
    }

    fn word(&self, i: usize) -> Option<PVOID> {
        (i < N).then(|| self.va.offset(i as u64 * 8)).flatten()
    }
}
