//! DPCs: KDPC objects and their target processors, each processor's queue, insert/remove/flush, the device's
//! DpcForIsr, and running a queue at DISPATCH_LEVEL when its processor's IRQL drops below DISPATCH_LEVEL, which is
//! when Windows' DPC interrupt fires, or on the processor's DPC thread when another processor queued it.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};

use vhca_ntapi::*;

use crate::bugcheck::Bugcheck;
use crate::interleaving::{PointKind, SyncObject, WaitChannel};
use crate::processor::{leave_processor, Context, Processor, ProcessorNumber, MAX_PROCESSORS};
use crate::verifier::{c4, VerifierFlags};
use crate::{lock, NtModel};

struct Dpc {
    routine: PKDEFERRED_ROUTINE,
    /// The routine's stand-in address in the driver's image, for bugcheck parameters.
    routine_address: u64,
    /// The processor whose queue holds it; None when it is not queued.
    queued: Option<ProcessorNumber>,
    /// KeSetTargetProcessorDpc(Ex)'s processor; None: the one that queues it.
    target: Option<ProcessorNumber>,
    arguments: (PVOID, PVOID),
}

pub(crate) struct DpcState {
    dpcs: HashMap<u64, Dpc>,
    /// Every processor a model can have; a model of N uses the first N.
    pub processors: Vec<Processor>,
    /// Each device's DpcForIsr (IoInitializeDpcRequest): Windows keeps it in the device object.
    for_isr: HashMap<PDEVICE_OBJECT, u64>,
}

/// DPC objects, queues and who runs each processor at DISPATCH_LEVEL under one lock, so a DPC's queued flag and
/// its place in a queue always agree, and a drain that ends and a processor given back are one step.
pub(crate) struct Dpcs {
    pub state: Mutex<DpcState>,
    /// A queue emptied, a drain ended or a processor given back: what KeFlushQueuedDpcs and a thread waiting for
    /// its processor wait for.
    pub idle: Condvar,
}

impl Dpcs {
    pub fn new() -> Dpcs {
        let processors = (0..MAX_PROCESSORS).map(|_| Processor::new()).collect();
        Dpcs {
            state: Mutex::new(DpcState { dpcs: HashMap::new(), processors, for_isr: HashMap::new() }),
            idle: Condvar::new(),
        }
    }
}

/// One DPC taken off its queue to run.
struct Run {
    dpc: PKDPC,
    routine: PKDEFERRED_ROUTINE,
    routine_address: u64,
    arguments: (PVOID, PVOID),
}

/// Ends a drain if its DPC unwinds (a bugcheck): the processor's queue is free for the next drain again.
struct Draining<'m> {
    model: &'m NtModel,
    cpu: ProcessorNumber,
}

impl Drop for Draining<'_> {
    fn drop(&mut self) {
        let me = std::thread::current().id();
        let mut st = lock(&self.model.dpcs.state);
        let p = &mut st.processors[self.cpu.index()];
        if p.draining == Some(me) {
            p.draining = None;
            leave_processor(p, me);
        }
        drop(st);
        self.model.wake(WaitChannel::Processors);
        self.model.dpcs.idle.notify_all();
    }
}

impl NtModel {
    pub(crate) fn dpc_initialize(&self, routine: PKDEFERRED_ROUTINE) -> PKDPC {
        let dpc = self.new_object();
        let d = Dpc {
            routine,
            routine_address: self.new_routine_address(),
            queued: None,
            target: None,
            arguments: Default::default(),
        };
        lock(&self.dpcs.state).dpcs.insert(dpc, d);
        PKDPC(dpc)
    }

    pub(crate) fn dpc_known(&self, dpc: PKDPC) -> bool {
        lock(&self.dpcs.state).dpcs.contains_key(&dpc.0)
    }

    /// KeSetTargetProcessorDpc(Ex): where `dpc` is queued from now on. A DPC already queued stays where it is,
    /// as Microsoft's page says the call does not move it.
    pub(crate) fn dpc_set_target(&self, dpc: PKDPC, cpu: ProcessorNumber) {
        let mut st = lock(&self.dpcs.state);
        let Some(d) = st.dpcs.get_mut(&dpc.0) else {
            drop(st);
            self.never_initialised(dpc.0)
        };
        d.target = Some(cpu);
    }

    /// Queues `dpc` on its target processor (the current one unless KeSetTargetProcessorDpc said otherwise); FALSE
    /// when it is already queued. Does not run it on this processor: callers decide (KeInsertQueueDpc below
    /// DISPATCH_LEVEL runs it at once, a timer's expiry leaves it to its caller). Queued for another processor, it
    /// runs there: that processor's DPC thread is told.
    pub(crate) fn dpc_insert(&self, dpc: PKDPC, argument1: PVOID, argument2: PVOID) -> bool {
        let current = self.current_processor();
        // Before the DPC is visible: another processor may run it at once. Windows queues with interlocked
        // operations, so an insert that finds it queued is ordered before its run too.
        self.hb_release(SyncObject::Dpc(dpc.0));
        let mut st = lock(&self.dpcs.state);
        let Some(d) = st.dpcs.get_mut(&dpc.0) else {
            drop(st);
            self.never_initialised(dpc.0)
        };
        if d.queued.is_some() {
            return false;
        }
        let cpu = d.target.unwrap_or(current);
        d.queued = Some(cpu);
        d.arguments = (argument1, argument2);
        st.processors[cpu.index()].dpc_queue.push_back(dpc.0);
        drop(st);
        if cpu != current {
            self.wake_dpc_thread(cpu);
        }
        true
    }

    /// KeInsertQueueDpc: queued on this processor, and run before this returns when the caller is below
    /// DISPATCH_LEVEL (the DPC interrupt is not masked there).
    pub(crate) fn dpc_insert_and_run(&self, dpc: PKDPC, argument1: PVOID, argument2: PVOID) -> bool {
        let queued = self.dpc_insert(dpc, argument1, argument2);
        if self.irql() < DISPATCH_LEVEL {
            self.run_queued_dpcs();
        }
        queued
    }

    pub(crate) fn dpc_remove(&self, dpc: PKDPC) -> bool {
        let mut st = lock(&self.dpcs.state);
        let Some(d) = st.dpcs.get_mut(&dpc.0) else {
            drop(st);
            self.never_initialised(dpc.0)
        };
        let Some(cpu) = d.queued.take() else { return false };
        st.processors[cpu.index()].dpc_queue.retain(|queued| *queued != dpc.0);
        drop(st);
        self.wake(WaitChannel::Processors);
        self.dpcs.idle.notify_all();
        true
    }

    /// KeFlushQueuedDpcs: PASSIVE_LEVEL only (0xC4/0xE5 otherwise); runs what waits on this processor, has each
    /// other processor's DPC thread run what waits there, and waits for every drain to end. The flusher then sees
    /// everything every DPC that ran did.
    pub(crate) fn dpc_flush(&self) {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql != PASSIVE_LEVEL {
            self.violation(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0));
        }
        let me = std::thread::current().id();
        let current = self.current_processor();
        // Processors whose DPC thread this flush has told already: told once, they are waited for, not retold.
        let mut told = 0u64;
        loop {
            if irql < DISPATCH_LEVEL {
                self.run_queued_dpcs();
            }
            let mut st = lock(&self.dpcs.state);
            // Other processors' queues nobody drains or holds: their DPC threads run them.
            let undrained: Vec<ProcessorNumber> = (0..self.processor_count())
                .map(ProcessorNumber)
                .filter(|cpu| *cpu != current && told & (1 << cpu.0) == 0)
                .filter(|cpu| {
                    let p = &st.processors[cpu.index()];
                    p.draining.is_none() && !p.dpc_queue.is_empty() && p.contexts.is_empty()
                })
                .collect();
            if !undrained.is_empty() {
                drop(st);
                for cpu in undrained {
                    told |= 1 << cpu.0;
                    self.wake_dpc_thread(cpu);
                }
                st = lock(&self.dpcs.state);
            }
            loop {
                if st.processors.iter().all(|p| p.idle_for(me)) {
                    let ran: Vec<u64> = st.dpcs.keys().copied().collect();
                    drop(st);
                    ran.into_iter().for_each(|dpc| self.hb_acquire(SyncObject::Dpc(dpc)));
                    return;
                }
                // This processor's queue, free again (its DPCs were queued at DISPATCH_LEVEL by a thread that has
                // dropped since), or another's nobody drains: look again.
                let own = &st.processors[current.index()];
                let own_free = own.draining.is_none() && !own.dpc_queue.is_empty() && !own.held_by_other(me);
                let other_free = (0..self.processor_count()).map(ProcessorNumber).any(|cpu| {
                    let p = &st.processors[cpu.index()];
                    cpu != current
                        && told & (1 << cpu.0) == 0
                        && p.draining.is_none()
                        && !p.dpc_queue.is_empty()
                        && p.contexts.is_empty()
                });
                if (irql < DISPATCH_LEVEL && own_free) || other_free {
                    break;
                }
                st = self.dpcs.idle.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
    }

    pub(crate) fn dpc_request_initialize(&self, device: PDEVICE_OBJECT, routine: PIO_DPC_ROUTINE) {
        let dpc = self.dpc_initialize(std::sync::Arc::new(move |dpc, _irp, context| routine(dpc, device, context)));
        lock(&self.dpcs.state).for_isr.insert(device, dpc.0);
    }

    /// IoRequestDpc: at DIRQL (0xC4/0xE5 below it under IRQL checking); queues the device's DpcForIsr with
    /// SystemArgument1 the (absent) IRP and SystemArgument2 the context, as Windows' IoRequestDpc does.
    pub(crate) fn dpc_request(&self, device: PDEVICE_OBJECT, context: PVOID) {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql < DIRQL_MIN {
            self.violation(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0));
        }
        let dpc = lock(&self.dpcs.state).for_isr.get(&device).copied();
        // Without IoInitializeDpcRequest the device object's KDPC was never initialised.
        let dpc = dpc.unwrap_or_else(|| self.never_initialised(device.0));
        self.dpc_insert_and_run(PKDPC(dpc), PVOID::NULL, context);
    }

    /// Runs the current processor's queue, in order, at DISPATCH_LEVEL in a context borrowed from the calling
    /// thread (below DISPATCH_LEVEL), holding the processor; returns at once when the queue is empty, another
    /// thread is running it (that one runs what is queued meanwhile too), or another context holds the processor
    /// at DISPATCH_LEVEL or above (that one runs the queue as it drops below).
    pub(crate) fn run_queued_dpcs(&self) {
        let cpu = self.current_processor();
        let me = std::thread::current().id();
        {
            let mut st = lock(&self.dpcs.state);
            let p = &mut st.processors[cpu.index()];
            if p.draining.is_some() || p.dpc_queue.is_empty() || p.held_by_other(me) {
                return;
            }
            p.draining = Some(me);
            p.contexts.push(Context { thread: me, irql: DISPATCH_LEVEL });
        }
        let _draining = Draining { model: self, cpu };
        self.in_borrowed_context(DISPATCH_LEVEL, || {
            while let Some(run) = self.next_dpc(cpu) {
                self.run_dpc(run);
            }
        });
    }

    /// The next DPC of `cpu`'s queue; when there is none, the drain ends and the processor is given back in the
    /// same step, so a DPC queued just after is seen by the drain its queuer starts.
    fn next_dpc(&self, cpu: ProcessorNumber) -> Option<Run> {
        let mut st = lock(&self.dpcs.state);
        let Some(dpc) = st.processors[cpu.index()].dpc_queue.pop_front() else {
            let p = &mut st.processors[cpu.index()];
            p.draining = None;
            leave_processor(p, std::thread::current().id());
            return None;
        };
        let d = st.dpcs.get_mut(&dpc).expect("a queued DPC is initialised");
        d.queued = None;
        Some(Run {
            dpc: PKDPC(dpc),
            routine: d.routine.clone(),
            routine_address: d.routine_address,
            arguments: d.arguments,
        })
    }

    fn run_dpc(&self, run: Run) {
        self.before_unloaded_routine(run.routine_address, DISPATCH_LEVEL);
        // Each DPC starts at DISPATCH_LEVEL whatever the one before it left (through set_irql, so one that left
        // the processor takes it back).
        if self.irql() != DISPATCH_LEVEL {
            self.set_irql(DISPATCH_LEVEL);
        }
        self.point(PointKind::DpcStart(run.dpc.0));
        self.hb_acquire(SyncObject::Dpc(run.dpc.0));
        let ((), started) = self.timed_routine(|| (run.routine)(run.dpc, run.arguments.0, run.arguments.1));
        self.hb_release(SyncObject::Dpc(run.dpc.0));
        let r = self.routine_overran(started).and_then(|()| self.watchdog_check_current());
        self.ok(r);
    }

    /// The DPC that would run first of those still queued (for the unload checks).
    pub(crate) fn queued_dpc(&self) -> Option<u64> {
        lock(&self.dpcs.state).processors.iter().find_map(|p| p.dpc_queue.front().copied())
    }
}
