//! The modelled processors, each with its own DPC queue as Windows keeps one per processor. The model has one
//! processor today; the number is a type of its own so a model with several only changes who runs where.

use std::collections::VecDeque;
use std::thread::ThreadId;

/// A processor's number, as KeGetCurrentProcessorNumber gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProcessorNumber(pub u32);

impl ProcessorNumber {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Processors a model has. Every thread runs on processor 0: per-thread IRQL already lets threads run side by side,
/// and one queue keeps DPCs in one order.
pub(crate) const PROCESSORS: u32 = 1;

pub(crate) struct Processor {
    /// KDPC addresses in the order they run.
    pub dpc_queue: VecDeque<u64>,
    /// The thread running this processor's DPCs now: one at a time, as one processor runs them.
    pub draining: Option<ThreadId>,
}

impl Processor {
    pub fn new() -> Processor {
        Processor { dpc_queue: VecDeque::new(), draining: None }
    }

    /// No DPC waits and none runs, except on `me` (a flush from inside a drain cannot wait for itself).
    pub fn idle_for(&self, me: ThreadId) -> bool {
        self.dpc_queue.is_empty() && self.draining.is_none_or(|t| t == me)
    }
}

impl crate::NtModel {
    /// The processor the calling thread runs on.
    pub(crate) fn current_processor(&self) -> ProcessorNumber {
        ProcessorNumber(0)
    }
}
