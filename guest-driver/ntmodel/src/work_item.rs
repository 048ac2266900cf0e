//! Work items and the system worker threads that run them: IoAllocateWorkItem, IoQueueWorkItem, IoFreeWorkItem;
//! each routine runs once, at PASSIVE_LEVEL, on a worker thread of the model's own (a pool that grows while all
//! its threads are busy, as Windows' does), each worker on a processor of its own choosing: round robin by worker
//! index from processor 1 (mod N), so a run puts the same worker on the same processor every time, and the first
//! worker is not on the processor the driver's passive path starts on.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::ThreadId;

use vhca_ntapi::*;

use crate::bugcheck::{Bugcheck, BugcheckUnwind};
use crate::interleaving::{PointKind, SyncObject, WaitChannel};
use crate::low_resources::FaultableRoutine;
use crate::processor::{ModelGate, ModelRef, ProcessorNumber};
use crate::verifier::e4;
use crate::{lock, NtModel};

/// Worker threads the pool grows to; past them a queued item waits for one to come free.
const MAX_WORKERS: usize = 8;

struct WorkItem {
    device: PDEVICE_OBJECT,
    queued: bool,
    /// The queued routine's stand-in address in the driver's image, for bugcheck parameters.
    routine_address: u64,
}

struct Job {
    item: u64,
    device: PDEVICE_OBJECT,
    routine: PIO_WORKITEM_ROUTINE,
}

#[derive(Default)]
struct Pool {
    items: HashMap<u64, WorkItem>,
    jobs: VecDeque<Job>,
    workers: usize,
    /// Workers waiting for a job.
    idle: usize,
    /// Workers inside a routine now.
    running: HashSet<ThreadId>,
    /// Work items whose routine has run: what the unload's wait sees the end of.
    ran: HashSet<u64>,
    /// Workers started so far: the next one's index.
    started: u32,
    shutdown: bool,
}

#[derive(Default)]
struct Shared {
    pool: Mutex<Pool>,
    /// A job was queued, a routine returned, or the model is going.
    changed: Condvar,
}

/// The worker threads hold the shared half, and the model only through its gate: the routines they call reach the
/// kernel through the driver's own handle; the worker itself uses the model only around a routine (its processor,
/// its scheduling point and ordering edges), so a model dropped meanwhile waits for no routine.
#[derive(Default)]
pub(crate) struct SystemWorkers {
    shared: Arc<Shared>,
}

impl Drop for SystemWorkers {
    fn drop(&mut self) {
        lock(&self.shared.pool).shutdown = true;
        self.shared.changed.notify_all();
    }
}

/// A worker leaves its routine (also when the routine unwinds): unload may be waiting for it.
struct Running<'s> {
    shared: &'s Shared,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        lock(&self.shared.pool).running.remove(&std::thread::current().id());
        self.shared.changed.notify_all();
    }
}

/// The model's side of a worker, each step only while the gate is open.
struct WorkerModel {
    model: ModelRef,
    gate: Arc<ModelGate>,
    processor: ProcessorNumber,
}

impl WorkerModel {
    fn with(&self, f: impl FnOnce(&NtModel)) {
        if let Some(pass) = self.gate.enter() {
            f(self.model.get(&pass))
        }
    }
}

fn worker(shared: Arc<Shared>, model: WorkerModel) {
    model.with(|m| m.bind_thread(model.processor));
    loop {
        let job = {
            let mut pool = lock(&shared.pool);
            loop {
                if pool.shutdown {
                    pool.workers -= 1;
                    return;
                }
                if let Some(job) = pool.jobs.pop_front() {
                    break job;
                }
                pool.idle += 1;
                // Blocked under the pool's lock, after looking: a queuer adds its job under it and wakes after.
                let mut marked = false;
                model.with(|m| marked = m.block_on(WaitChannel::Workers));
                if !marked {
                    pool = shared.changed.wait(pool).unwrap_or_else(|e| e.into_inner());
                }
                pool.idle -= 1;
            }
        };
        {
            let mut pool = lock(&shared.pool);
            // Dequeued before the call, so the routine may free its own item.
            if let Some(item) = pool.items.get_mut(&job.item) {
                item.queued = false;
            }
            pool.running.insert(std::thread::current().id());
        }
        let _running = Running { shared: &shared };
        model.with(|m| {
            m.active();
            m.point(PointKind::WorkStart(job.item));
            m.hb_acquire(SyncObject::WorkItem(job.item));
        });
        let routine = job.routine;
        let item = job.item;
        // A bugcheck inside the routine was recorded when it was raised; the machine is stopped, this thread just
        // ends the routine. Anything else is a real panic and goes on up.
        if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| routine(job.device))) {
            if !payload.is::<BugcheckUnwind>() {
                std::panic::resume_unwind(payload)
            }
        }
        // Before `_running` goes, so the unload's wait that sees this routine end also sees what it did.
        model.with(|m| m.hb_release(SyncObject::WorkItem(item)));
        lock(&shared.pool).ran.insert(item);
        drop(_running);
        // A thread waiting for the routines to end (unload) is running from here.
        model.with(|m| m.wake(WaitChannel::Workers));
    }
}

impl NtModel {
    pub(crate) fn work_item_allocate(&self, device: PDEVICE_OBJECT) -> PIO_WORKITEM {
        self.irql_at_most(DISPATCH_LEVEL);
        if self.inject(FaultableRoutine::IoAllocateWorkItem, None).is_some() {
            return PIO_WORKITEM(0);
        }
        let item = self.new_object();
        let w = WorkItem { device, queued: false, routine_address: 0 };
        lock(&self.workers.shared.pool).items.insert(item, w);
        PIO_WORKITEM(item)
    }

    /// The device object each work item not yet freed was allocated for: tests check whose item a driver asks
    /// for (IoAllocateWorkItem wants one of the caller's own device objects, which the model cannot tell apart).
    pub fn work_item_devices(&self) -> Vec<PDEVICE_OBJECT> {
        let pool = lock(&self.workers.shared.pool);
        let mut items: Vec<(u64, PDEVICE_OBJECT)> = pool.items.iter().map(|(id, w)| (*id, w.device)).collect();
        items.sort_by_key(|(id, _)| *id);
        items.into_iter().map(|(_, device)| device).collect()
    }

    /// IoQueueWorkItem. Queuing an item still queued is 0xE4/0x1 (P2 the item, P3 the queue number): the
    /// kernel's own check, raised in every mode.
    pub(crate) fn work_item_queue(&self, item: PIO_WORKITEM, routine: PIO_WORKITEM_ROUTINE, queue: WORK_QUEUE_TYPE) {
        self.irql_at_most(DISPATCH_LEVEL);
        let routine_address = self.new_routine_address();
        // Before the job is visible: a worker may take it at once. (One queued twice releases to nothing.)
        self.hb_release(SyncObject::WorkItem(item.0));
        let shared = &self.workers.shared;
        let mut pool = lock(&shared.pool);
        let Some(w) = pool.items.get_mut(&item.0) else {
            drop(pool);
            self.never_initialised(item.0)
        };
        if w.queued {
            drop(pool);
            self.violation(Bugcheck::new(WORKER_INVALID, e4::ACTIVE_ITEM_QUEUED, item.0, queue as u64, 0));
            return;
        }
        w.queued = true;
        w.routine_address = routine_address;
        let device = w.device;
        pool.jobs.push_back(Job { item: item.0, device, routine });
        // More jobs waiting than workers waiting for them: one more worker (one starting may be counted twice,
        // never none).
        if pool.jobs.len() > pool.idle && pool.workers < MAX_WORKERS {
            pool.workers += 1;
            let index = pool.started;
            pool.started += 1;
            let model = WorkerModel {
                model: ModelRef::new(self),
                gate: Arc::clone(&self.processor_threads.gate),
                processor: ProcessorNumber((1 + index) % self.processor_count()),
            };
            let shared = Arc::clone(shared);
            // Named by index, so its scheduling points have a name a later run finds again.
            let handle = std::thread::Builder::new()
                .name(format!("system-worker-{index}"))
                .spawn(move || worker(shared, model))
                .expect("spawn a system worker thread");
            self.thread_starting(handle.thread());
        }
        drop(pool);
        self.wake(WaitChannel::Workers);
        shared.changed.notify_all();
    }

    /// IoFreeWorkItem. Freeing an item still queued is 0xE4/0x2 (P2 the item, P3 its worker routine), in every
    /// mode; freeing one from its own routine is fine (it was dequeued first).
    pub(crate) fn work_item_free(&self, item: PIO_WORKITEM) {
        self.irql_at_most(DISPATCH_LEVEL);
        let queued = lock(&self.workers.shared.pool).items.get(&item.0).filter(|w| w.queued).map(|w| w.routine_address);
        if let Some(routine) = queued {
            self.violation(Bugcheck::new(WORKER_INVALID, e4::QUEUED_ITEM_FREED, item.0, routine, 0));
        }
        // Unchecked, the item goes anyway; its queued routine still runs (it is not the item's memory here).
        lock(&self.workers.shared.pool).items.remove(&item.0);
    }

    /// Returns when no work item is queued or running (but the caller's own, when it is a worker): IoQueueWorkItem
    /// holds a reference on the device object until the routine returns, and the I/O manager calls DriverUnload
    /// only once the driver's device objects are deleted and unreferenced, so neither the driver's unload routine
    /// nor the unload checks come before the last routine returned. A caller about to call DriverUnload waits here
    /// first (the PE loader); `unload_driver` waits again, which then returns at once.
    pub fn wait_for_work_items(&self) {
        let me = std::thread::current().id();
        let shared = &self.workers.shared;
        let busy = |pool: &Pool| !pool.jobs.is_empty() || pool.running.iter().any(|t| *t != me);
        let mut pool = lock(&shared.pool);
        if busy(&pool) {
            // Blocked on the workers: a worker paused at a scheduling point may go on at once instead of waiting
            // for this thread to settle.
            while busy(&pool) {
                if !self.block_on(WaitChannel::Workers) {
                    pool = shared.changed.wait(pool).unwrap_or_else(|e| e.into_inner());
                }
            }
            drop(pool);
            self.active();
            pool = lock(&shared.pool);
        }
        let ran: Vec<u64> = pool.ran.iter().copied().collect();
        drop(pool);
        ran.into_iter().for_each(|item| self.hb_acquire(SyncObject::WorkItem(item)));
    }
}
