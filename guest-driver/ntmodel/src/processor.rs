//! The modelled processors: how many (1 to 64, Windows' group 0), which processor each model thread runs on, who
//! runs a processor at DISPATCH_LEVEL and above, and the model's own processor threads with the gate that keeps
//! them off a model that is going away.
//!
//! Why IRQL stays a field of the thread: Windows keeps IRQL per processor, and the thread running there is what
//! sets it. Here a processor runs one context at DISPATCH_LEVEL or above (a second thread of it raising that far
//! waits, `move_processor_irql`), so the IRQL of that context is the processor's, and threads below DISPATCH_LEVEL
//! take turns on it as Windows' scheduler would give them the processor.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{JoinHandle, ThreadId};

use vhca_ntapi::{DISPATCH_LEVEL, KIRQL};

use crate::bugcheck::Bugcheck;
use crate::interleaving::WaitChannel;
use crate::verifier::{c4, VerifierFlags};
use crate::{lock, NtModel};

/// A processor's number, as KeGetCurrentProcessorNumber gives it (group 0: the model has no other group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcessorNumber(pub u32);

impl ProcessorNumber {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Windows' processor group holds 64 processors (a KAFFINITY's bits); the model has one group.
pub(crate) const MAX_PROCESSORS: u32 = 64;

/// The processor count a configuration asks for, as the model runs it: 0 or past 64 is a configuration error the
/// constructor clamps (to 1, to 64) rather than refuses, so a mistyped suite option still gives a run.
pub(crate) fn clamped(processors: u32) -> u32 {
    processors.clamp(1, MAX_PROCESSORS)
}

/// One context a processor runs at DISPATCH_LEVEL or above.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Context {
    pub thread: ThreadId,
    pub irql: KIRQL,
}

pub(crate) struct Processor {
    /// KDPC addresses in the order they run.
    pub dpc_queue: VecDeque<u64>,
    /// The thread running this processor's DPCs now: one at a time, as one processor runs them.
    pub draining: Option<ThreadId>,
    /// The contexts running at DISPATCH_LEVEL or above, oldest first: at most one raised context, with the ISRs
    /// that interrupted it above it.
    pub contexts: Vec<Context>,
}

impl Processor {
    pub fn new() -> Processor {
        Processor { dpc_queue: VecDeque::new(), draining: None, contexts: Vec::new() }
    }

    /// No DPC waits and none runs, except on `me` (a flush from inside a drain cannot wait for itself).
    pub fn idle_for(&self, me: ThreadId) -> bool {
        self.dpc_queue.is_empty() && self.draining.is_none_or(|t| t == me)
    }

    /// Another thread runs this processor at DISPATCH_LEVEL or above.
    pub fn held_by_other(&self, me: ThreadId) -> bool {
        self.contexts.iter().any(|c| c.thread != me)
    }

    /// The IRQL of the processor's running context other than `me`'s: an interrupt at or below it is masked.
    fn masking_irql(&self, me: ThreadId) -> Option<KIRQL> {
        self.contexts.iter().rev().find(|c| c.thread != me).map(|c| c.irql)
    }
}

/// The model's address, for its own threads. They dereference it only through a `GatePass`, so never once the
/// model's drop has begun ending them.
#[derive(Clone, Copy)]
pub(crate) struct ModelRef(*const NtModel);

// SAFETY: NtModel is Sync (all its state is behind locks and atomics); the pointer is read only under a GatePass.
unsafe impl Send for ModelRef {}
// SAFETY: as above.
unsafe impl Sync for ModelRef {}

impl ModelRef {
    pub fn new(model: &NtModel) -> ModelRef {
        ModelRef(model as *const NtModel)
    }

    /// The model, while `pass` keeps it.
    pub fn get<'p>(&self, _pass: &'p GatePass) -> &'p NtModel {
        // SAFETY: the gate was open when `pass` was taken, so the model's first field (ProcessorThreads) has not
        // dropped, and its drop waits for every pass to go before any other field goes. The model does not move
        // while a thread of its own lives: every constructor's model is put in an Arc before its first kernel
        // call, and its own threads start only from kernel calls.
        unsafe { &*self.0 }
    }
}

#[derive(Default)]
struct GateState {
    closed: bool,
    /// Passes held now, per thread.
    inside: HashMap<ThreadId, u32>,
}

/// Who may still use the model from one of its own threads: open until the model drops.
#[derive(Default)]
pub(crate) struct ModelGate {
    state: Mutex<GateState>,
    left: Condvar,
}

/// Held while a model thread uses the model.
pub(crate) struct GatePass {
    gate: Arc<ModelGate>,
}

impl Drop for GatePass {
    fn drop(&mut self) {
        let me = std::thread::current().id();
        let mut st = lock(&self.gate.state);
        if let Some(n) = st.inside.get_mut(&me) {
            *n -= 1;
            if *n == 0 {
                st.inside.remove(&me);
            }
        }
        drop(st);
        self.gate.left.notify_all();
    }
}

impl ModelGate {
    /// A pass, or None once the model is going.
    pub fn enter(self: &Arc<Self>) -> Option<GatePass> {
        let mut st = lock(&self.state);
        if st.closed {
            return None;
        }
        *st.inside.entry(std::thread::current().id()).or_insert(0) += 1;
        Some(GatePass { gate: Arc::clone(self) })
    }

    /// Closes the gate and waits for every other thread's pass to go. A model thread that drops the model while
    /// it holds a pass (a DPC routine that held the last reference) would go on using it after: the process stops
    /// there instead, saying why, rather than touch freed memory.
    fn close(&self) {
        let me = std::thread::current().id();
        let mut st = lock(&self.state);
        if st.inside.contains_key(&me) {
            eprintln!("vhca-ntmodel: the model was dropped from inside one of its own DPC drains; stopping");
            std::process::abort();
        }
        st.closed = true;
        while st.inside.keys().any(|t| *t != me) {
            st = self.left.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[derive(Default)]
struct DpcThreadState {
    /// Processors whose DPC thread was told of work since it last looked (a bit per processor).
    pending: u64,
    /// Processors with a DPC thread started.
    started: u64,
    shutdown: bool,
}

#[derive(Default)]
struct DpcThreadsShared {
    state: Mutex<DpcThreadState>,
    changed: Condvar,
}

/// The model's own threads: one DPC thread per processor ("dpc-<n>", started when a DPC is first queued for a
/// processor from another one), and the gate they and the system workers pass to use the model. The first field
/// of NtModel, so it drops first: the threads end before anything they use goes.
#[derive(Default)]
pub(crate) struct ProcessorThreads {
    pub gate: Arc<ModelGate>,
    shared: Arc<DpcThreadsShared>,
    handles: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for ProcessorThreads {
    fn drop(&mut self) {
        lock(&self.shared.state).shutdown = true;
        self.shared.changed.notify_all();
        self.gate.close();
        let me = std::thread::current().id();
        for handle in lock(&self.handles).drain(..) {
            if handle.thread().id() != me {
                let _ = handle.join();
            }
        }
    }
}

/// A DPC thread's life: wait (outside the gate) to be told of work for its processor, then drain that processor's
/// queue in its context, until the model goes.
fn dpc_thread(model: ModelRef, gate: Arc<ModelGate>, shared: Arc<DpcThreadsShared>, cpu: ProcessorNumber) {
    let bit = 1u64 << cpu.0;
    let mut first = true;
    loop {
        {
            let mut st = lock(&shared.state);
            while st.pending & bit == 0 && !st.shutdown {
                st = shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.shutdown {
                return;
            }
            st.pending &= !bit;
        }
        let Some(pass) = gate.enter() else { return };
        let m = model.get(&pass);
        if first {
            m.bind_thread(cpu);
            first = false;
        }
        m.active();
        // A bugcheck in a DPC was recorded when raised; the machine is stopped and this thread only ends the drain.
        // Anything else is a real panic and goes on up.
        if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.run_queued_dpcs())) {
            if !payload.is::<crate::bugcheck::BugcheckUnwind>() {
                std::panic::resume_unwind(payload)
            }
        }
        // Blocked only when nothing came for it during the drain, decided under the lock its wakers set the bit
        // under: either this sees the bit, or their wake comes after this mark.
        let st = lock(&shared.state);
        if st.pending & bit == 0 {
            m.block_on(WaitChannel::DpcThread(cpu.0));
        }
    }
}

impl NtModel {
    /// Logical processors this model has (the configuration's count, clamped by the constructor).
    pub fn processor_count(&self) -> u32 {
        self.config.processors
    }

    /// The processor the calling thread runs on.
    pub(crate) fn current_processor(&self) -> ProcessorNumber {
        self.with_thread(|t| t.processor)
    }

    /// Binds the calling thread to `cpu` from now on (a model thread's own processor).
    pub(crate) fn bind_thread(&self, cpu: ProcessorNumber) {
        self.with_thread(|t| t.processor = cpu);
    }

    /// Runs `f` with the calling thread on processor `processor` (the platform's interrupt thread for the processor
    /// a message targets; `deliver` uses it itself), then puts the thread back where it was. A thread changes
    /// processor only below DISPATCH_LEVEL, where Windows may switch it; above, it would leave its processor
    /// held. Panics on a processor the model does not have, or when called at DISPATCH_LEVEL or above.
    pub fn run_on_processor<T>(&self, processor: u32, f: impl FnOnce() -> T) -> T {
        assert!(processor < self.processor_count(), "processor {processor} of {}", self.processor_count());
        let (before, irql) = self.with_thread(|t| (t.processor, t.irql));
        if before.0 == processor {
            return f();
        }
        assert!(irql < DISPATCH_LEVEL, "a thread changes processor only below DISPATCH_LEVEL (at {irql})");
        struct Back<'m>(&'m NtModel, ProcessorNumber);
        impl Drop for Back<'_> {
            fn drop(&mut self) {
                self.0.bind_thread(self.1);
            }
        }
        self.bind_thread(ProcessorNumber(processor));
        let _back = Back(self, before);
        f()
    }

    /// Follows the calling thread's IRQL move from `old` to `new` on its processor (before the move is written):
    /// raising to DISPATCH_LEVEL or above waits until no other context runs the processor there, then holds it;
    /// dropping below gives it back. Callers hold no model guard.
    pub(crate) fn move_processor_irql(&self, old: KIRQL, new: KIRQL) {
        if old < DISPATCH_LEVEL && new < DISPATCH_LEVEL {
            return;
        }
        let cpu = self.current_processor();
        let me = std::thread::current().id();
        let mut st = lock(&self.dpcs.state);
        match (old >= DISPATCH_LEVEL, new >= DISPATCH_LEVEL) {
            (false, true) => {
                if st.processors[cpu.index()].held_by_other(me) {
                    // Not running until the processor is free: blocked in the model, for the interleaving modes.
                    while st.processors[cpu.index()].held_by_other(me) {
                        if !self.block_on(WaitChannel::Processors) {
                            st = self.dpcs.idle.wait(st).unwrap_or_else(|e| e.into_inner());
                        }
                    }
                    st.processors[cpu.index()].contexts.push(Context { thread: me, irql: new });
                    drop(st);
                    self.active();
                    return;
                }
                st.processors[cpu.index()].contexts.push(Context { thread: me, irql: new });
            }
            (true, true) => {
                let contexts = &mut st.processors[cpu.index()].contexts;
                if let Some(c) = contexts.iter_mut().rev().find(|c| c.thread == me) {
                    c.irql = new;
                } else {
                    // Raised without the processor (a context lent at DISPATCH_LEVEL): hold it from here.
                    contexts.push(Context { thread: me, irql: new });
                }
            }
            _ => {
                leave_processor(&mut st.processors[cpu.index()], me);
                drop(st);
                self.wake(WaitChannel::Processors);
                self.dpcs.idle.notify_all();
            }
        }
    }

    /// An interrupt at `irql` comes to `cpu`, whose calling thread will run the ISR: it waits while the processor
    /// runs at `irql` or above (the interrupt is masked there, pending), then runs on top of whatever context the
    /// processor runs, without waiting for it to drop: it interrupts it. Held until the guard goes.
    pub(crate) fn interrupt_processor(&self, cpu: ProcessorNumber, irql: KIRQL) -> Interrupting<'_> {
        let me = std::thread::current().id();
        let masked = |p: &Processor| p.masking_irql(me).is_some_and(|masking| masking >= irql);
        let mut st = lock(&self.dpcs.state);
        let waited = masked(&st.processors[cpu.index()]);
        while masked(&st.processors[cpu.index()]) {
            if !self.block_on(WaitChannel::Processors) {
                st = self.dpcs.idle.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
        st.processors[cpu.index()].contexts.push(Context { thread: me, irql });
        drop(st);
        if waited {
            self.active();
        }
        Interrupting { model: self, cpu }
    }

    /// The deadlock an ISR walks into on Windows: the context it interrupted on its own processor holds `lock`,
    /// which the ISR now wants, and that context cannot run again to release it before the ISR returns. Reported
    /// as the deadlock detection reports a thread taking a lock it holds (0xC4/0x1000, P2 the lock), since the
    /// processor is the one that holds it. Called before every lock acquisition (locks.rs's `before_acquire`, which
    /// the interrupt spin lock's take in `deliver` passes too). The model's own threads, apart, would only wait.
    pub(crate) fn interrupt_deadlock_check(&self, lock_addr: u64) -> Result<(), Bugcheck> {
        if !self.checks(VerifierFlags::DEADLOCK_DETECTION) {
            return Ok(());
        }
        let cpu = self.current_processor();
        let me = std::thread::current().id();
        let interrupted: Vec<ThreadId> = {
            let st = lock(&self.dpcs.state);
            let contexts = &st.processors[cpu.index()].contexts;
            match contexts.iter().position(|c| c.thread == me) {
                Some(mine) => contexts[..mine].iter().map(|c| c.thread).filter(|t| *t != me).collect(),
                None => Vec::new(),
            }
        };
        let holds = {
            let threads = lock(&self.threads);
            interrupted.iter().any(|t| threads.get(t).is_some_and(|s| s.held.contains(&lock_addr)))
        };
        if holds {
            self.found(Bugcheck::c4(c4::SELF_DEADLOCK, lock_addr, 0, 0))?;
        }
        Ok(())
    }

    /// Tells `cpu`'s DPC thread there is work for it, starting it the first time.
    pub(crate) fn wake_dpc_thread(&self, cpu: ProcessorNumber) {
        let threads = &self.processor_threads;
        let bit = 1u64 << cpu.0;
        let mut st = lock(&threads.shared.state);
        if st.shutdown {
            return;
        }
        st.pending |= bit;
        if st.started & bit == 0 {
            st.started |= bit;
            let (model, gate, shared) = (ModelRef::new(self), Arc::clone(&threads.gate), Arc::clone(&threads.shared));
            // Named, so its scheduling points have a name a later run finds again.
            let handle = std::thread::Builder::new()
                .name(format!("dpc-{}", cpu.0))
                .spawn(move || dpc_thread(model, gate, shared, cpu))
                .expect("spawn a DPC thread");
            self.thread_starting(handle.thread());
            lock(&threads.handles).push(handle);
        }
        drop(st);
        self.wake(WaitChannel::DpcThread(cpu.0));
        threads.shared.changed.notify_all();
    }
}

/// Gives `me`'s latest context on `p` back.
pub(crate) fn leave_processor(p: &mut Processor, me: ThreadId) {
    if let Some(i) = p.contexts.iter().rposition(|c| c.thread == me) {
        p.contexts.remove(i);
    }
}

/// An ISR's hold on its processor, given back when the ISR ends (also when a bugcheck unwinds it).
pub(crate) struct Interrupting<'m> {
    model: &'m NtModel,
    cpu: ProcessorNumber,
}

impl Drop for Interrupting<'_> {
    fn drop(&mut self) {
        let me = std::thread::current().id();
        let mut st = lock(&self.model.dpcs.state);
        leave_processor(&mut st.processors[self.cpu.index()], me);
        drop(st);
        self.model.wake(WaitChannel::Processors);
        self.model.dpcs.idle.notify_all();
    }
}
