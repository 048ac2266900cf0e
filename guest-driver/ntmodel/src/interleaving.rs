//! Systematic interleavings and race reports: the model's scheduling points (kernel calls, lock acquisitions and
//! releases, IRQL changes, DPC/ISR/work-item starts), a recording of them per thread, the bounded-preemption and
//! PCT-style modes that pause a thread at chosen points, and the happens-before race detector over driver-visible
//! objects. Everything here costs one load of the configuration's mode per hook while the mode is Off.
//!
//! The parts: `threads` (names and activity), `schedule` (the point log and which points pause), `pct` (its
//! change points), `engine` (the state and the pause), `vector_clock` and `race_detector` (happens-before), and
//! `call_scope` (the call site a point or an access is named by).
//!
//! What a race report can see: the driver's accesses that pass through the model (RtlCopyFromVa/RtlCopyToVa on
//! pool, contiguous memory and common buffers; the MDL, adapter, S/G list and common buffer routines) and the edges
//! the model's routines make. vhca.sys reads and writes its memory directly through the loader's host view: for it
//! the routines' objects are watched, and the pool blocks the loader's race watch traps (`binary_access`); an order
//! the platform makes outside the model (a thread started after setup, a join) is invisible unless it says so
//! (`platform_release`/`platform_acquire`).

mod call_scope;
pub(crate) mod engine;
mod pct;
mod race_detector;
mod schedule;
mod threads;
mod vector_clock;

use std::fmt;
use std::panic::Location;
use std::sync::atomic::Ordering;
use std::time::Duration;

use vhca_ntapi::KIRQL;

use crate::NtModel;
pub(crate) use call_scope::CallScope;
pub use pct::{change_points, DEFAULT_HORIZON};
use race_detector::{AccessInfo, LocationKey, Race, MAX_REPORTS};
pub(crate) use threads::WaitChannel;

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
    /// Every kernel call point also orders everything before it before any later interrupt delivery, as a
    /// doorbell would (`device_kicked`). For a driver binary whose own MMIO stores the platform does not trap:
    /// the model cannot be told when the device was told to act. The cost: a race between the passive path's
    /// writes and the ISR or DPC that follows any kernel call is hidden, whether or not a doorbell came between
    /// them. Ends at `trap_doorbells` (the PE loader traps vhca.sys's registers in every interleaving run).
    pub kicks_at_every_call: bool,
    /// The PCT mode draws its change points among the first this-many global points (`pct::DEFAULT_HORIZON`).
    pub pct_horizon: u32,
}

impl Default for InterleavingConfig {
    fn default() -> Self {
        InterleavingConfig {
            mode: InterleavingMode::Off,
            settle: Duration::from_millis(20),
            limit: Duration::from_millis(500),
            kicks_at_every_call: false,
            pct_horizon: DEFAULT_HORIZON,
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
    /// A driver binary is about to read (false) or write (true) watched memory at this address with an instruction
    /// of its own (the loader's race watch traps it): the point a C driver's `entry->count++` has between its load
    /// and its store.
    BinaryAccess { va: u64, write: bool },
    /// A driver binary is about to store to its device's registers (the loader's race watch traps it): a doorbell.
    Doorbell,
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
            PointKind::BinaryAccess { va, write: false } => write!(f, "load {va:#x}"),
            PointKind::BinaryAccess { va, write: true } => write!(f, "store {va:#x}"),
            PointKind::Doorbell => write!(f, "doorbell"),
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
    /// An execution routine queued on an adapter (AllocateAdapterChannel, GetScatterGatherList) then run by
    /// whichever thread frees the registers: what the caller did before queueing, the routine sees.
    AdapterQueue(u64),
    /// An order only the platform knows (a thread it starts after setting things up, one it joins): the guest
    /// program and the loader name it by a key of their own (`platform_release`, `platform_acquire`).
    Platform(u64),
}

/// What the platform runs at each of a thread's points, on that thread, before the point is taken (`observe_points`).
static POINT_OBSERVER: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Has `observer` run at every scheduling point of every thread, first thing (once per process; a second call is
/// ignored). The PE loader's race watch starts watching a block its allocating thread has initialised there.
pub fn observe_points(observer: fn()) {
    let _ = POINT_OBSERVER.set(observer);
}

/// `SyncObject::Device` for every device at once: what `kicks_at_every_call` releases and every delivery acquires.
const ANY_DEVICE: u64 = u64::MAX;

impl NtModel {
    /// Whether any hook does anything: callers that reshape a wait for the hooks keep the old shape when Off.
    pub(crate) fn interleaving_on(&self) -> bool {
        !matches!(self.config.interleaving.mode, InterleavingMode::Off)
    }

    fn engine(&self) -> &engine::Engine {
        &self.interleaving_engine
    }

    /// A kernel routine's entry: a point named after it, and the caller's location as the site its points and
    /// accesses report until it returns. Both personalities come here (the loader's thunks call the same
    /// NtKernel routines); vhca.sys's site is the loader's named image frames where its entry stub captured them
    /// (the faultable, lock, timer and event routines), else the thunk's location.
    #[track_caller]
    pub(crate) fn kernel_call(&self, name: &'static str) -> Option<CallScope> {
        if !self.interleaving_on() {
            return None;
        }
        let scope = call_scope::enter(Location::caller());
        self.point(PointKind::KernelCall(name));
        if self.config.interleaving.kicks_at_every_call && !self.doorbells_trapped.load(Ordering::Relaxed) {
            self.hb_release(SyncObject::Device(ANY_DEVICE));
        }
        Some(scope)
    }

    /// A scheduling point of the calling thread. Off: returns at once. Callers hold no model mutex: the thread
    /// may pause here.
    pub(crate) fn point(&self, kind: PointKind) {
        if !self.interleaving_on() {
            return;
        }
        if let Some(observer) = POINT_OBSERVER.get() {
            observer();
        }
        let config = &self.config.interleaving;
        let processor = self.current_processor().0;
        let site = call_scope::current_site();
        let mut locked = self.engine().lock(config);
        let me = locked.me;
        let state = locked.state();
        let contended = state.threads.other_active(me);
        let thread = &mut state.threads.known[me];
        thread.points += 1;
        thread.progressed = std::time::Instant::now();
        let id = PointId { thread: thread.name.clone(), index: thread.points };
        let point = SchedulePoint { id, kind: kind.to_string(), site, processor, contended };
        let pause = state.schedule.pass(point);
        drop(locked);
        self.engine().changed();
        if let Some(point) = pause {
            self.engine().pause(config, &point);
        }
    }

    /// The calling thread makes `object`'s state visible to whoever acquires it next (a lock release, an event
    /// set, a DPC or work item queued).
    pub(crate) fn hb_release(&self, object: SyncObject) {
        if !self.interleaving_on() {
            return;
        }
        let mut locked = self.engine().lock(&self.config.interleaving);
        let me = locked.me;
        locked.state().races.release(me, object);
    }

    /// The calling thread sees everything released to `object` before (a lock acquired, a wait satisfied, a DPC
    /// or work routine starting). A delivery from a device also sees every kernel call's implied kick.
    pub(crate) fn hb_acquire(&self, object: SyncObject) {
        if !self.interleaving_on() {
            return;
        }
        let mut locked = self.engine().lock(&self.config.interleaving);
        let me = locked.me;
        let races = &mut locked.state().races;
        races.acquire(me, object);
        if matches!(object, SyncObject::Device(_)) {
            races.acquire(me, SyncObject::Device(ANY_DEVICE));
        }
    }

    /// The calling thread touched a watched object; a race found is kept for `race_reports`. Called before the
    /// access is checked, so an access that then faults (a read of freed pool) still counts.
    pub(crate) fn watched_access(&self, object: Watched, access: Access) {
        if !self.interleaving_on() {
            return;
        }
        let (processor, locks) = self.with_thread(|t| (t.processor.0, t.held.clone()));
        let site = call_scope::current_site();
        let mut locked = self.engine().lock(&self.config.interleaving);
        let thread = locked.me;
        let info = AccessInfo { thread, processor, access, site: site.into(), locks };
        let races = locked.state().races.access(object, info);
        drop(locked);
        for race in races {
            self.report_race(race);
        }
    }

    /// A driver binary's own load or store of model memory at `va` (`len` bytes from there), trapped by the PE
    /// loader's race watch, at `site` (its RVA and symbol): a scheduling point, then a watched access, as
    /// RtlCopyFromVa/RtlCopyToVa are for the natively built driver. The caller holds no model mutex (it runs on the
    /// driver's thread, between two of its instructions): the thread may pause here. Off: returns at once.
    pub fn binary_access(&self, va: u64, len: u64, write: bool, site: &str) {
        if !self.interleaving_on() {
            return;
        }
        call_scope::with_label(site, || {
            self.point(PointKind::BinaryAccess { va, write });
            let access = if write { Access::Write } else { Access::Read };
            self.watched_access(Watched::Memory { va, len }, access);
        })
    }

    /// The binary's instruction at `site`, reported by `binary_access` as a read of `va`, also wrote there (a
    /// read-modify-write): the write, with no point of its own, as nothing comes between the two.
    pub fn binary_write_after_read(&self, va: u64, len: u64, site: &str) {
        if !self.interleaving_on() {
            return;
        }
        call_scope::with_label(site, || self.watched_access(Watched::Memory { va, len }, Access::Write))
    }

    /// From now on the PE loader traps the binary's stores to its device's registers and reports each
    /// (`binary_doorbell`): kernel calls no longer count as doorbells, whatever `kicks_at_every_call` says.
    pub fn trap_doorbells(&self) {
        self.doorbells_trapped.store(true, Ordering::Relaxed);
    }

    /// A driver binary's own store to `device`'s registers, trapped by the PE loader's race watch at `site`: a
    /// scheduling point (the device may act on it at once), then the device is told to act (`device_kicked`), so
    /// an interrupt delivered later is ordered after everything the storing thread did before. Off: returns at
    /// once.
    pub fn binary_doorbell(&self, device: u64, site: &str) {
        if !self.interleaving_on() {
            return;
        }
        call_scope::with_label(site, || {
            self.point(PointKind::Doorbell);
            self.device_kicked(device);
        })
    }

    /// Names a race's object (outside the engine's lock: naming memory looks at the model's books) and keeps it.
    fn report_race(&self, race: Race) {
        let object = match (race.at, race.object) {
            (LocationKey::Granule(va), _) => self.memory_name(va),
            (_, Watched::Mdl(a)) => format!("MDL {a:#x}"),
            (_, Watched::Adapter(a)) => format!("DMA adapter {a:#x}"),
            (_, Watched::SgList(a)) => format!("scatter/gather list {a:#x}"),
            (_, Watched::CommonBuffer(a)) => format!("common buffer {a:#x}"),
            (_, Watched::KernelObject(a)) => format!("kernel object {a:#x}"),
            (_, Watched::Memory { va, .. }) => self.memory_name(va),
        };
        let mut locked = self.engine().lock(&self.config.interleaving);
        let state = locked.state();
        if state.reports.len() >= MAX_REPORTS {
            return;
        }
        let side = |a: &AccessInfo| RaceAccess {
            thread: state.threads.known[a.thread].name.clone(),
            processor: a.processor,
            access: a.access,
            site: a.site.to_string(),
        };
        let report = RaceReport { object, earlier: side(&race.earlier), later: side(&race.later) };
        state.reports.push(report);
    }

    /// The calling thread leaves the model for the platform's own wait (the interrupt thread between messages):
    /// it counts as quiescent for a paused thread until `active` is called. A wait inside the model uses
    /// `block_on`, which its waker's `wake` ends.
    pub(crate) fn quiescent(&self) {
        self.set_active(false)
    }

    /// The calling thread runs again (a wait ended, a routine started).
    pub(crate) fn active(&self) {
        self.set_active(true)
    }

    fn set_active(&self, active: bool) {
        if !self.interleaving_on() {
            return;
        }
        let mut locked = self.engine().lock(&self.config.interleaving);
        let me = locked.me;
        let thread = &mut locked.state().threads.known[me];
        thread.active = active;
        thread.blocked_on = None;
        if active {
            thread.progressed = std::time::Instant::now();
        }
        drop(locked);
        self.engine().changed();
    }

    /// The calling thread is about to sleep on `channel` until a waker calls `wake(channel)`. True when this call
    /// marked it blocked (it was running, or was woken since it last blocked): the caller looks at its condition
    /// once more before it sleeps, as a wake may have come between its look and the mark. False when it is still
    /// marked from its last sleep and nothing woke it: it sleeps at once. Always false with the modes off.
    ///
    /// The engine's lock is a leaf, so a caller may hold the lock of the condition it sleeps on.
    pub(crate) fn block_on(&self, channel: WaitChannel) -> bool {
        if !self.interleaving_on() {
            return false;
        }
        let mut locked = self.engine().lock(&self.config.interleaving);
        let me = locked.me;
        let thread = &mut locked.state().threads.known[me];
        if thread.blocked_on == Some(channel) {
            return false;
        }
        thread.blocked_on = Some(channel);
        thread.active = false;
        drop(locked);
        self.engine().changed();
        true
    }

    /// The calling thread made a condition true that threads sleeping on `channel` wait for (after the change, so
    /// a sleeper that looks after its mark sees it): they count as active from now, before the OS runs them.
    pub(crate) fn wake(&self, channel: WaitChannel) {
        if !self.interleaving_on() {
            return;
        }
        let woke = self.engine().lock(&self.config.interleaving).state().threads.wake(channel);
        if woke {
            self.engine().changed();
        }
    }

    /// The model started `thread` (a DPC thread, a system worker): it counts as active from now, before it runs.
    pub(crate) fn thread_starting(&self, thread: &std::thread::Thread) {
        if !self.interleaving_on() {
            return;
        }
        self.engine().lock(&self.config.interleaving).state().threads.starting(thread);
    }

    /// The platform (not the driver) told the model the device was told to act: an interrupt delivered later is
    /// ordered after everything the calling thread did before. The guest's transports call it at a doorbell.
    pub fn device_kicked(&self, device: u64) {
        self.hb_release(SyncObject::Device(device))
    }

    /// The platform orders what the calling thread did so far before whatever a later `platform_acquire(key)`
    /// does (a thread it starts, a result it hands over): an order the model cannot see otherwise.
    pub fn platform_release(&self, key: u64) {
        self.hb_release(SyncObject::Platform(key))
    }

    /// The calling thread sees everything released with `key` (a thread the platform started, at its start).
    pub fn platform_acquire(&self, key: u64) {
        self.hb_acquire(SyncObject::Platform(key))
    }

    /// Every point the recording saw, grouped per thread in order of each thread's first point. At most
    /// 100 000 points per run are listed (`schedule_points_dropped` counts the rest): a long run passes millions,
    /// and the bounded modes expand only early ones.
    pub fn schedule_points(&self) -> Vec<SchedulePoint> {
        self.engine().peek(|st| st.schedule.points()).unwrap_or_default()
    }

    /// Points passed past the recording's cap.
    pub fn schedule_points_dropped(&self) -> u64 {
        self.engine().peek(|st| st.schedule.dropped()).unwrap_or(0)
    }

    /// Points every thread passed so far, listed or not: what a PCT run's horizon is drawn from (the suite passes
    /// a recording's count to the PCT runs it expands, so their change points fall inside the run).
    pub fn schedule_points_passed(&self) -> u64 {
        self.engine().peek(|st| st.schedule.passed()).unwrap_or(0)
    }

    /// Every pause taken, in order.
    pub fn preemptions(&self) -> Vec<Preemption> {
        self.engine().peek(|st| st.schedule.preemptions.clone()).unwrap_or_default()
    }

    /// Every race found, each pair of call sites once, at most 100 per run (`races_found` counts past that).
    pub fn race_reports(&self) -> Vec<RaceReport> {
        self.engine().peek(|st| st.reports.clone()).unwrap_or_default()
    }

    /// Distinct site pairs that raced, kept in `race_reports` or past its cap.
    pub fn races_found(&self) -> usize {
        self.engine().peek(|st| st.races.found).unwrap_or(0)
    }

    /// Locations the detector refused to watch once it watched a million (a long run over big buffers): races on
    /// them go unseen, so a run that has any says less than it seems.
    pub fn watched_locations_refused(&self) -> u64 {
        self.engine().peek(|st| st.races.refused_locations).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off: a point is the mode's one load and a return. Prints the cost; 20 ns is far above it (a fraction of a
    /// nanosecond on this host) and far below what the shortest real point costs (a locked map lookup, ~100 ns).
    #[test]
    fn off_costs_one_load_and_touches_nothing() {
        let (k, _) = NtModel::for_tests(crate::NtModelConfig::default());
        const CALLS: u32 = 10_000_000;
        let start = std::time::Instant::now();
        for i in 0..CALLS {
            k.point(std::hint::black_box(PointKind::Acquire(u64::from(i))));
        }
        let per_call = start.elapsed().as_secs_f64() * 1e9 / f64::from(CALLS);
        println!("Off: {per_call:.2} ns per point");
        assert!(per_call < 20.0, "{per_call} ns per point with the mode Off");
        k.watched_access(Watched::Memory { va: 0x1000, len: 8 }, Access::Write);
        k.hb_release(SyncObject::Lock(1));
        k.quiescent();
        assert!(k.engine().peek(|_| ()).is_none(), "no hook built the engine's state");
        let on = NtModel::for_tests(crate::NtModelConfig {
            interleaving: InterleavingConfig { mode: InterleavingMode::Record, ..InterleavingConfig::default() },
            ..crate::NtModelConfig::default()
        })
        .0;
        on.point(PointKind::Acquire(1));
        assert_eq!(on.schedule_points().len(), 1, "the control: Record lists the same point");
    }

    #[test]
    fn point_ids_round_trip_and_refuse_what_is_not_one() {
        let id = PointId { thread: "irq-0".into(), index: 17 };
        assert_eq!(PointId::parse(&id.to_string()), Some(id));
        assert_eq!(PointId::parse("passive#0"), None);
        assert_eq!(PointId::parse("#3"), None);
        assert_eq!(PointId::parse("passive"), None);
    }
}
