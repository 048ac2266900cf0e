//! Systematic interleavings and race reports: the model's scheduling points (kernel calls, lock acquisitions and
//! releases, IRQL changes, DPC/ISR/work-item starts), a recording of them per thread, the bounded-preemption and
//! PCT-style modes that pause a thread at chosen points, and the happens-before race detector over driver-visible
//! objects. Everything here costs one relaxed load per point while the mode is Off.

use std::fmt;
use std::time::Duration;

use vhca_ntapi::KIRQL;

use crate::NtModel;

/// A scheduling point named so a later run can find it again: the thread's stable name (the OS thread's name, or
/// `thread-N` in order of first sighting) and the point's index among that thread's points, counted from 1.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PointId {
    pub thread: String,
    pub index: u32,
}

impl fmt::Display for PointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.thread, self.index)
    }
}

impl PointId {
    /// Reads `thread#index` (the form Display writes); None for anything else.
    pub fn parse(text: &str) -> Option<PointId> {
        let (thread, index) = text.rsplit_once('#')?;
        let index: u32 = index.parse().ok().filter(|i| *i > 0)?;
        (!thread.is_empty()).then(|| PointId { thread: thread.to_string(), index })
    }
}

/// What the interleaving machinery does in a run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum InterleavingMode {
    /// No points are taken and no races looked for: the default, and what every run without the option does.
    #[default]
    Off,
    /// Every point is listed per thread (with whether another thread was active then: a preemption candidate),
    /// and races are reported. Nothing is paused.
    Record,
    /// Bounded preemption: the thread that reaches each of these points (one or two: bound 1 and 2) pauses there
    /// until every other thread is quiescent (blocked in the model, idle between routines, or gone), or none passed
    /// a point for `settle`, or `limit` passed. Races are reported.
    Preempt(Vec<PointId>),
    /// PCT-style priority schedule: `depth - 1` change points drawn with `seed` among the points a thread reaches;
    /// at each, the thread pauses as a preemption does. The seed is printed with the run so it can be replayed.
    Pct { seed: u64, depth: u32 },
}

/// The interleaving knobs of one modelled machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterleavingConfig {
    pub mode: InterleavingMode,
    /// Other threads that passed no point for this long count as quiescent.
    pub settle: Duration,
    /// The longest one pause lasts, whatever the others do.
    pub limit: Duration,
}

impl Default for InterleavingConfig {
    fn default() -> Self {
        InterleavingConfig {
            mode: InterleavingMode::Off,
            settle: Duration::from_millis(20),
            limit: Duration::from_millis(500),
        }
    }
}

/// The kind of a scheduling point, as the recording names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointKind {
    /// Entry into a kernel routine the driver called, by name.
    KernelCall(&'static str),
    /// A lock (spin lock, interrupt spin lock, fast/guarded mutex, KMUTEX, ERESOURCE) is about to be taken.
    Acquire(u64),
    /// A lock was just given back.
    Release(u64),
    /// The thread's IRQL moved to this level.
    Irql(KIRQL),
    /// A DPC (its KDPC) is about to run.
    DpcStart(u64),
    /// An ISR is about to run for this message.
    IsrStart(u32),
    /// A work item's routine (its IO_WORKITEM) is about to run.
    WorkStart(u64),
}

impl fmt::Display for PointKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PointKind::KernelCall(name) => write!(f, "call {name}"),
            PointKind::Acquire(lock) => write!(f, "acquire {lock:#x}"),
            PointKind::Release(lock) => write!(f, "release {lock:#x}"),
            PointKind::Irql(irql) => write!(f, "irql {irql}"),
            PointKind::DpcStart(dpc) => write!(f, "dpc {dpc:#x}"),
            PointKind::IsrStart(message) => write!(f, "isr message {message}"),
            PointKind::WorkStart(item) => write!(f, "work item {item:#x}"),
        }
    }
}

/// One point the recording saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulePoint {
    pub id: PointId,
    pub kind: String,
    /// The driver's call site (as the low-resources simulation names sites), or empty when none is known.
    pub site: String,
    /// The processor the thread ran on.
    pub processor: u32,
    /// Another thread was active (inside a routine or on a driver path, not blocked) when this one got here: a
    /// preemption here can change what the others see. The bounded modes expand only these.
    pub contended: bool,
}

/// How a pause ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resumed {
    /// Every other thread was quiescent.
    Quiescent,
    /// No other thread passed a point for `settle`.
    Settled,
    /// `limit` passed.
    Limit,
}

/// A pause a preempting mode took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preemption {
    pub id: PointId,
    pub kind: String,
    pub site: String,
    pub paused: Duration,
    pub resumed: Resumed,
}

/// What an access to a driver-visible object did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    Write,
    /// The object's end (a free, a put-back, a destroy): a write that nothing may follow.
    Free,
}

/// A driver-visible object the race detector watches: what a report names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Watched {
    /// Bytes of model memory (a pool block, a common buffer, a contiguous allocation: rings and CQs live here),
    /// watched in 8-byte granules from this address.
    Memory { va: u64, len: u64 },
    /// An MDL.
    Mdl(u64),
    /// A DMA adapter's channel and map-register state.
    Adapter(u64),
    /// A scatter/gather list.
    SgList(u64),
    /// A common buffer's bookkeeping (its allocation and free, apart from its bytes).
    CommonBuffer(u64),
    /// A dispatcher or DPC object the driver owns (KDPC, KTIMER, KEVENT, IO_WORKITEM).
    KernelObject(u64),
}

/// One side of a race: who touched the object, on which processor, how, and from where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaceAccess {
    pub thread: String,
    pub processor: u32,
    pub access: Access,
    pub site: String,
}

/// Two accesses to the same object from different threads, at least one a write or free, with no lock held in
/// common and no happens-before order between them (lock release to acquire, event set to wait, DPC/work item
/// queued to run, DPC flush, KeSynchronizeExecution, an interrupt's delivery after the device was told to act).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaceReport {
    pub object: String,
    pub earlier: RaceAccess,
    pub later: RaceAccess,
}

/// A happens-before edge's endpoint: the object whose release a later acquire sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SyncObject {
    /// A lock of any kind, by address.
    Lock(u64),
    /// A dispatcher object (event, timer, KMUTEX's signal state) set and waited on.
    Dispatcher(u64),
    /// A DPC queued then run, or a DPC's run then a flush that waited for it.
    Dpc(u64),
    /// A work item queued then run, or run then waited for.
    WorkItem(u64),
    /// A device told to act (a doorbell, a command) then its interrupt delivered.
    Device(u64),
}

// The hooks below are placed by the kernel routines as they learn to report their points and edges.
#[allow(dead_code)]
impl NtModel {
    /// A scheduling point of the calling thread. Off: returns at once.
    pub(crate) fn point(&self, _kind: PointKind) {}

    /// The calling thread makes `object`'s state visible to whoever acquires it next (a lock release, an event
    /// set, a DPC or work item queued).
    pub(crate) fn hb_release(&self, _object: SyncObject) {}

    /// The calling thread sees everything released to `object` before (a lock acquired, a wait satisfied, a DPC
    /// or work routine starting).
    pub(crate) fn hb_acquire(&self, _object: SyncObject) {}

    /// The calling thread touched a watched object; a race found is kept for `race_reports`.
    pub(crate) fn watched_access(&self, _object: Watched, _access: Access) {}

    /// The calling thread is about to block in the model (a lock, a wait) or leaves a routine for the platform's
    /// idle loop: it counts as quiescent for a paused thread until `active` is called.
    pub(crate) fn quiescent(&self) {}

    /// The calling thread runs again (a wait ended, a routine started).
    pub(crate) fn active(&self) {}

    /// The platform (not the driver) told the model the device was told to act: an interrupt delivered later is
    /// ordered after everything the calling thread did before. The guest's transports call it at a doorbell.
    pub fn device_kicked(&self, _device: u64) {}

    /// Every point the recording saw, in order of first sighting per thread.
    pub fn schedule_points(&self) -> Vec<SchedulePoint> {
        Vec::new()
    }

    /// Every pause taken, in order.
    pub fn preemptions(&self) -> Vec<Preemption> {
        Vec::new()
    }

    /// Every race found, each pair once.
    pub fn race_reports(&self) -> Vec<RaceReport> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn point_ids_round_trip_and_refuse_what_is_not_one() {
        let id = PointId { thread: "irq-0".into(), index: 17 };
        assert_eq!(PointId::parse(&id.to_string()), Some(id));
        assert_eq!(PointId::parse("passive#0"), None);
        assert_eq!(PointId::parse("#3"), None);
        assert_eq!(PointId::parse("passive"), None);
    }
}
