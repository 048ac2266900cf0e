//! The happens-before race detector: vector clocks per thread and per synchronisation object, and FastTrack-style
//! shadow state per watched location (Flanagan & Freund, PLDI 2009: the last write's epoch and the reads since).
//!
//! Two accesses race when they come from different threads, one writes (or frees), neither happened before the
//! other, and they held no lock in common. Lock acquire and release are happens-before edges already, so the
//! lockset test only matters where an edge is missing: a lock taken along a path that reports no edge (the
//! loader's own bookkeeping, a wait-for-free), or two ERESOURCE holders in shared mode, which order nothing between
//! them. Keeping it means a report always names accesses under no common lock, which is what a reader fixes.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use super::vector_clock::{Epoch, ThreadIdx, VectorClock};
use super::{Access, SyncObject, Watched};

/// The most reports one run keeps; later races are counted.
pub(crate) const MAX_REPORTS: usize = 100;
/// The most locations one run watches: a run that touches more (a long soak over big buffers) stops adding new
/// ones, so its memory stays bounded; the count of refused ones says so.
pub(crate) const MAX_LOCATIONS: usize = 1 << 20;

/// One watched location: an 8-byte granule of memory or a whole object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum LocationKey {
    Granule(u64),
    Object(Watched),
}

/// What the detector keeps of an access, for a report.
#[derive(Debug)]
pub(crate) struct AccessInfo {
    pub thread: ThreadIdx,
    pub processor: u32,
    pub access: Access,
    pub site: Arc<str>,
    pub locks: Vec<u64>,
}

#[derive(Clone)]
struct Stamp {
    epoch: Epoch,
    info: Arc<AccessInfo>,
}

#[derive(Default)]
struct Shadow {
    write: Option<Stamp>,
    /// At most one per thread: its latest read since the last write.
    reads: Vec<Stamp>,
}

/// A race found: the earlier access, the later one, and where (the location the pair first met on).
pub(crate) struct Race {
    pub at: LocationKey,
    pub object: Watched,
    pub earlier: Arc<AccessInfo>,
    pub later: Arc<AccessInfo>,
}

#[derive(Default)]
pub(crate) struct RaceDetector {
    threads: Vec<VectorClock>,
    sync: HashMap<SyncObject, VectorClock>,
    shadows: HashMap<LocationKey, Shadow>,
    /// The granules `shadows` has, in order: a free of a block looks at the ones in it alone.
    granules: BTreeSet<u64>,
    /// Blocks freed over granules nothing had touched, by first granule (with the last): a later access there
    /// starts its history from the free. One entry a block instead of one shadow a granule: vhca.sys frees its
    /// 4 MiB heap at unload, half a million granules (0.3 s on the host, seconds under TCG, one at a time).
    freed: BTreeMap<u64, (u64, Stamp)>,
    /// Site pairs already reported (earlier, later).
    reported: HashSet<(Arc<str>, Arc<str>)>,
    pub found: usize,
    pub refused_locations: u64,
}

impl RaceDetector {
    fn clock(&mut self, t: ThreadIdx) -> &mut VectorClock {
        while self.threads.len() <= t {
            let next = self.threads.len();
            self.threads.push(VectorClock::for_thread(next));
        }
        &mut self.threads[t]
    }

    /// o.vc = join(o.vc, t.vc); then t's own component advances, so what t does next is not released yet.
    pub fn release(&mut self, t: ThreadIdx, object: SyncObject) {
        let vc = self.clock(t).clone();
        self.sync.entry(object).or_default().join(&vc);
        self.clock(t).tick(t);
    }

    /// t.vc = join(t.vc, o.vc).
    pub fn acquire(&mut self, t: ThreadIdx, object: SyncObject) {
        let Some(released) = self.sync.get(&object).cloned() else { return };
        self.clock(t).join(&released);
    }

    /// Checks one access against the locations' histories and records it; the races it makes, each site pair once
    /// per run.
    pub fn access(&mut self, object: Watched, info: AccessInfo) -> Vec<Race> {
        let t = info.thread;
        let vc = self.clock(t).clone();
        let stamp = Stamp { epoch: vc.epoch(t), info: Arc::new(info) };
        let mut races = Vec::new();
        let keys: Vec<LocationKey> = match object {
            Watched::Memory { va, len } if len > 0 && stamp.info.access == Access::Free => {
                let (first, last) = granule_span(va, len);
                self.forget_frees_within(first, last);
                self.freed.insert(first, (last, stamp.clone()));
                self.granules.range(first..=last).map(|g| LocationKey::Granule(*g)).collect()
            }
            _ => locations(object).collect(),
        };
        for key in keys {
            if !self.shadows.contains_key(&key) {
                if self.shadows.len() >= MAX_LOCATIONS {
                    self.refused_locations += 1;
                    continue;
                }
                let mut shadow = Shadow::default();
                if let LocationKey::Granule(g) = key {
                    shadow.write = self.freed_over(g).cloned();
                    self.granules.insert(g);
                }
                self.shadows.insert(key, shadow);
            }
            let shadow = self.shadows.get_mut(&key).expect("inserted above");
            let conflicting = |earlier: &Stamp| {
                earlier.epoch.thread != t
                    && !vc.has_seen(earlier.epoch)
                    && !earlier.info.locks.iter().any(|l| stamp.info.locks.contains(l))
            };
            let mut met: Vec<Arc<AccessInfo>> = Vec::new();
            if let Some(w) = shadow.write.as_ref().filter(|w| conflicting(w)) {
                met.push(Arc::clone(&w.info));
            }
            match stamp.info.access {
                Access::Read => {
                    shadow.reads.retain(|r| r.epoch.thread != t);
                    shadow.reads.push(stamp.clone());
                }
                Access::Write | Access::Free => {
                    met.extend(shadow.reads.iter().filter(|r| conflicting(r)).map(|r| Arc::clone(&r.info)));
                    shadow.reads.clear();
                    shadow.write = Some(stamp.clone());
                }
            }
            for earlier in met {
                if self.reported.insert((Arc::clone(&earlier.site), Arc::clone(&stamp.info.site))) {
                    self.found += 1;
                    races.push(Race { at: key, object, earlier, later: Arc::clone(&stamp.info) });
                }
            }
        }
        races
    }

    /// The free that ended the block over granule `g`, if its history starts there.
    fn freed_over(&self, g: u64) -> Option<&Stamp> {
        let (_, (last, stamp)) = self.freed.range(..=g).next_back()?;
        (g <= *last).then_some(stamp)
    }

    /// A new free of [first, last] covers the older ones inside it: the nearest entry below a granule must be
    /// the one that covers it.
    fn forget_frees_within(&mut self, first: u64, last: u64) {
        let inside: Vec<u64> =
            self.freed.range(first..=last).filter(|(_, (end, _))| *end <= last).map(|(start, _)| *start).collect();
        for start in inside {
            self.freed.remove(&start);
        }
    }
}

/// The first and last 8-byte granules of `len` > 0 bytes at `va`.
fn granule_span(va: u64, len: u64) -> (u64, u64) {
    (va & !7, va.saturating_add(len - 1) & !7)
}

/// The locations an access covers: memory in 8-byte granules, anything else whole.
fn locations(object: Watched) -> impl Iterator<Item = LocationKey> {
    let (first, count) = match object {
        Watched::Memory { va, len } if len > 0 => {
            let (first, last) = granule_span(va, len);
            (first, (last - first) / 8 + 1)
        }
        Watched::Memory { .. } => (0, 0),
        _ => (0, 1),
    };
    (0..count).map(move |i| match object {
        Watched::Memory { .. } => LocationKey::Granule(first + i * 8),
        other => LocationKey::Object(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(thread: ThreadIdx, access: Access, site: &str, locks: &[u64]) -> AccessInfo {
        AccessInfo { thread, processor: 0, access, site: site.into(), locks: locks.to_vec() }
    }

    const BYTES: Watched = Watched::Memory { va: 0x1004, len: 8 };

    #[test]
    fn unordered_writes_race_once_per_site_pair_and_an_edge_orders_them() {
        let mut d = RaceDetector::default();
        assert!(d.access(BYTES, info(0, Access::Write, "a", &[])).is_empty());
        let races = d.access(BYTES, info(1, Access::Write, "b", &[]));
        assert_eq!(races.len(), 1, "two granules, one pair of sites");
        assert_eq!(d.access(BYTES, info(0, Access::Write, "a", &[])).len(), 1, "b then a is another pair");
        assert!(d.access(BYTES, info(1, Access::Write, "b", &[])).is_empty(), "reported already");
        let mut ordered = RaceDetector::default();
        ordered.access(BYTES, info(0, Access::Write, "a", &[]));
        ordered.release(0, SyncObject::Dispatcher(1));
        ordered.acquire(1, SyncObject::Dispatcher(1));
        assert!(ordered.access(BYTES, info(1, Access::Write, "b", &[])).is_empty());
    }

    #[test]
    fn a_common_lock_or_two_reads_are_no_race_and_a_write_after_a_read_is() {
        let mut d = RaceDetector::default();
        d.access(BYTES, info(0, Access::Write, "a", &[7]));
        assert!(d.access(BYTES, info(1, Access::Write, "b", &[7, 8])).is_empty());
        let mut reads = RaceDetector::default();
        reads.access(BYTES, info(0, Access::Read, "a", &[]));
        assert!(reads.access(BYTES, info(1, Access::Read, "b", &[])).is_empty());
        assert_eq!(reads.access(BYTES, info(2, Access::Free, "c", &[])).len(), 2, "each reader's site with the free");
    }

    #[test]
    fn a_free_of_untouched_bytes_is_one_entry_and_a_later_unordered_access_races_with_it() {
        let block = Watched::Memory { va: 0x10_0000, len: 4 << 20 };
        let mut d = RaceDetector::default();
        d.access(Watched::Memory { va: 0x10_0040, len: 8 }, info(0, Access::Write, "a", &[]));
        assert!(d.access(block, info(0, Access::Free, "free", &[])).is_empty(), "one thread: ordered");
        assert_eq!(d.shadows.len(), 1, "the free shadows no granule it did not find");
        let late = d.access(Watched::Memory { va: 0x30_0000, len: 8 }, info(1, Access::Read, "late", &[]));
        assert_eq!(late.len(), 1, "an untouched granule's history starts at the free");
        assert_eq!((&*late[0].earlier.site, &*late[0].later.site), ("free", "late"));
        let touched = d.access(Watched::Memory { va: 0x10_0040, len: 8 }, info(1, Access::Write, "late2", &[]));
        assert_eq!(touched.len(), 1, "a touched granule's free is its last write");
        let outside = d.access(Watched::Memory { va: 0x50_0000, len: 8 }, info(1, Access::Read, "outside", &[]));
        assert!(outside.is_empty(), "past the block, nothing was freed");
    }
}
