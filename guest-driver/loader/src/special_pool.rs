//! Special Pool (0x1) on a driver binary's own loads and stores: the model places each block against a guard page
//! (`NtModel::special_pool_guard`); here the guard, and a freed block's pages, are made inaccessible in this process
//! (mprotect), and a fault there is named as Special Pool's (0xD6 / 0xD5 from driver code, 0xCD / 0xCC otherwise).
//!
//! Only memory the backend hands out as mappings of their own can be protected page by page (the guest's VFIO
//! backend: one anonymous mapping per allocation); a block not on a page boundary (a test's Vec-backed memory) is
//! left as it is and only the model's own checks see its misuse.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use vhca_ntapi::{
    DRIVER_PAGE_FAULT_BEYOND_END_OF_ALLOCATION, DRIVER_PAGE_FAULT_IN_FREED_SPECIAL_POOL,
    PAGE_FAULT_BEYOND_END_OF_ALLOCATION, PAGE_FAULT_IN_FREED_SPECIAL_POOL,
};

const PAGE: usize = 4096;

/// Freed ranges remembered to name a fault (newest last); an older freed range that faults is a plain 0x50.
const FREED_REMEMBERED: usize = 8192;

/// What a fault in special pool touched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialPoolFault {
    /// A live block's guard page: past its end (Verify End) or before its start (Verify Start).
    GuardPage,
    /// A block the driver freed.
    Freed,
}

impl SpecialPoolFault {
    /// The bugcheck (code, parameters) for a touch of `address`, by the instruction at `rip`, with the x86 page-fault
    /// error code; `in_driver` whether `rip` is the driver's own code. Microsoft's pages give P1 the address, P2 0 read
    /// / 1 write, P3 the instruction, P4 reserved; the D-codes are for "the driver" (0xD6, 0xD5), the C-codes for "the
    /// system" touching a driver's special pool (0xCD, 0xCC): here a loader or CRT routine the driver called.
    pub fn bugcheck(self, address: u64, rip: u64, error_code: u64, in_driver: bool) -> (u32, [u64; 4]) {
        let code = match (self, in_driver) {
            (SpecialPoolFault::GuardPage, true) => DRIVER_PAGE_FAULT_BEYOND_END_OF_ALLOCATION,
            (SpecialPoolFault::GuardPage, false) => PAGE_FAULT_BEYOND_END_OF_ALLOCATION,
            (SpecialPoolFault::Freed, true) => DRIVER_PAGE_FAULT_IN_FREED_SPECIAL_POOL,
            (SpecialPoolFault::Freed, false) => PAGE_FAULT_IN_FREED_SPECIAL_POOL,
        };
        (code, [address, (error_code >> 1) & 1, rip, 0])
    }
}

#[derive(Default)]
struct Books {
    /// Guard pages of live blocks, by process address.
    guards: BTreeMap<usize, ()>,
    /// Freed blocks made inaccessible: start -> end.
    freed: BTreeMap<usize, usize>,
    freed_order: VecDeque<usize>,
}

/// The driver's special pool pages this process protects.
#[derive(Default)]
pub struct SpecialPoolPages {
    books: Mutex<Books>,
}

/// Makes `bytes` at `at` inaccessible.
///
/// # Safety
/// `at..at + bytes` is whole pages of one special pool block (its guard page, or the whole freed block) the model
/// holds for the driver, which nothing of this process but the driver touches.
unsafe fn protect_none(at: usize, bytes: usize) -> bool {
    // SAFETY: the caller's contract.
    unsafe { libc::mprotect(at as *mut libc::c_void, bytes, libc::PROT_NONE) == 0 }
}

impl SpecialPoolPages {
    /// The guard page of a block just handed to the driver, at process address `guard`.
    pub fn guard(&self, guard: usize) {
        if guard == 0 || !guard.is_multiple_of(PAGE) {
            return;
        }
        let mut books = crate::lock(&self.books);
        // Its pages may be a freed block's, given back and reused: that range is live now.
        let stale: Vec<usize> =
            books.freed.range(..guard + PAGE).filter(|(_, end)| **end > guard).map(|(s, _)| *s).collect();
        for start in stale {
            books.freed.remove(&start);
        }
        // SAFETY: the guard page of the block the model just gave out, part of its own backend allocation.
        if unsafe { protect_none(guard, PAGE) } {
            books.guards.insert(guard, ());
        }
    }

    /// The block at `start..start + bytes` (its guard page included) was freed and the model still holds its pages:
    /// all of it inaccessible from now on. The caller holds the model's memory lock (`with_freed_special_pool`), so
    /// the pages cannot be given back meanwhile.
    pub fn freed(&self, start: usize, bytes: usize) {
        if !start.is_multiple_of(PAGE) || !bytes.is_multiple_of(PAGE) {
            return;
        }
        let mut books = crate::lock(&self.books);
        let guards: Vec<usize> = books.guards.range(start..start + bytes).map(|(g, _)| *g).collect();
        for g in guards {
            books.guards.remove(&g);
        }
        // SAFETY: the freed block's whole pages, which the model holds (quarantine) for nothing but this.
        if unsafe { protect_none(start, bytes) } {
            if books.freed_order.len() >= FREED_REMEMBERED {
                if let Some(old) = books.freed_order.pop_front() {
                    books.freed.remove(&old);
                }
            }
            books.freed.insert(start, start + bytes);
            books.freed_order.push_back(start);
        }
    }

    /// What special pool page a fault at `address` touched, if any.
    pub fn fault(&self, address: usize) -> Option<SpecialPoolFault> {
        let books = crate::lock(&self.books);
        let page = address - address % PAGE;
        if books.guards.contains_key(&page) {
            return Some(SpecialPoolFault::GuardPage);
        }
        books.freed.range(..=address).next_back().filter(|(_, end)| address < **end).map(|_| SpecialPoolFault::Freed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_follow_microsofts_pages_and_the_code_follows_who_touched() {
        let guard = SpecialPoolFault::GuardPage;
        assert_eq!(guard.bugcheck(0x7000, 0x1234, 0x6, true), (0xD6, [0x7000, 1, 0x1234, 0]));
        assert_eq!(guard.bugcheck(0x7000, 0x1234, 0x4, false), (0xCD, [0x7000, 0, 0x1234, 0]));
        assert_eq!(SpecialPoolFault::Freed.bugcheck(0x7000, 0x1, 0x4, true).0, 0xD5);
        assert_eq!(SpecialPoolFault::Freed.bugcheck(0x7000, 0x1, 0x6, false), (0xCC, [0x7000, 1, 0x1, 0]));
    }
}
