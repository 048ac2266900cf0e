//! Memory regions: a registered byte range `[addr, addr + length)` backed by map registers, one per page, with
//! access rights. Keys are never reused, so a key of a deregistered MR is recognised (freed map registers).

use std::collections::{BTreeMap, HashSet, VecDeque};

use vhca_proto::{FaultCause, PAGE_SIZE};

use crate::handles::HandleAllocator;
use crate::mapped_pages::MappedPages;

pub struct Mr {
    pub key: u32,
    pub pd: u32,
    pub access: u32,
    pub addr: u64,
    pub length: u64,
    pub first_page_offset: u64,
    pub registers: MappedPages,
}

impl Mr {
    /// Byte offset from the start of the first registered page for `[addr, addr + len)`, if the range lies inside.
    pub fn locate(&self, addr: u64, len: u64) -> Option<u64> {
        let start = addr.checked_sub(self.addr)?;
        let end = start.checked_add(len)?;
        if end > self.length {
            return None;
        }
        start.checked_add(self.first_page_offset)
    }

    pub fn pages(&self) -> u64 {
        self.registers.len() as u64
    }
}

/// What a key names.
pub enum KeyLookup<'a> {
    Live(&'a Mr),
    /// Deregistered: its registers went back to the pool while the driver still used the key.
    Retired,
    Unknown,
}

/// Keys of deregistered MRs remembered for fault reports; older ones are reported as unknown keys.
const RETIRED_KEYS_REMEMBERED: usize = 4096;

pub struct MrTable {
    mrs: BTreeMap<u32, Mr>,
    retired: HashSet<u32>,
    retired_order: VecDeque<u32>,
    handles: HandleAllocator,
}

impl MrTable {
    pub fn new(max: u32) -> MrTable {
        MrTable {
            mrs: BTreeMap::new(),
            retired: HashSet::new(),
            retired_order: VecDeque::new(),
            // Keys start high so that a zeroed SGE (lkey 0) never names an MR.
            handles: HandleAllocator::new(0x100, max),
        }
    }

    pub fn allocate_key(&mut self) -> Option<u32> {
        self.handles.allocate()
    }

    /// Gives back a key taken by `allocate_key` whose registration then failed.
    pub fn forget_key(&mut self) {
        self.handles.release();
    }

    pub fn insert(&mut self, mr: Mr) {
        self.mrs.insert(mr.key, mr);
    }

    pub fn remove(&mut self, key: u32) -> Option<Mr> {
        let mr = self.mrs.remove(&key)?;
        self.handles.release();
        if self.retired_order.len() >= RETIRED_KEYS_REMEMBERED {
            if let Some(old) = self.retired_order.pop_front() {
                self.retired.remove(&old);
            }
        }
        self.retired.insert(key);
        self.retired_order.push_back(key);
        Some(mr)
    }

    pub fn lookup(&self, key: u32) -> KeyLookup<'_> {
        match self.mrs.get(&key) {
            Some(mr) => KeyLookup::Live(mr),
            None if self.retired.contains(&key) => KeyLookup::Retired,
            None => KeyLookup::Unknown,
        }
    }

    pub fn get(&self, key: u32) -> Option<&Mr> {
        self.mrs.get(&key)
    }

    pub fn any_in_pd(&self, pd: u32) -> bool {
        self.mrs.values().any(|m| m.pd == pd)
    }
}

/// Where an access lands in an MR, once key, PD, range and rights are checked.
#[derive(Debug, Clone, Copy)]
pub struct MrAccess {
    pub key: u32,
    pub offset: u64,
}

/// Checks one access of `len` bytes at `addr` through `key` by a QP of `pd` needing `need` rights (0: local read,
/// which every MR allows).
pub fn check_access(
    table: &MrTable,
    key: u32,
    pd: u32,
    addr: u64,
    len: u64,
    need: u32,
) -> Result<MrAccess, FaultCause> {
    let mr = match table.lookup(key) {
        KeyLookup::Live(mr) => mr,
        KeyLookup::Retired => return Err(FaultCause::FreedMapRegister),
        KeyLookup::Unknown => return Err(FaultCause::OutsideMr),
    };
    if mr.pd != pd {
        return Err(FaultCause::OutsideMr);
    }
    let offset = mr.locate(addr, len).ok_or(FaultCause::OutsideMr)?;
    if mr.access & need != need {
        return Err(FaultCause::AccessRight);
    }
    debug_assert!(offset.saturating_add(len) <= mr.pages() * PAGE_SIZE);
    Ok(MrAccess { key, offset })
}
