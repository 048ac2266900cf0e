//! The one kernel a loaded driver runs on, reachable from the `extern "win64"` thunks (which get no context argument
//! from the driver): the NT model and its verifier, the I/O manager, each thunk family's table. One per process.
//! The arrows run one way: thunk files -> this context -> the tables (`*_table`, `address_space`, `io_manager`,
//! `debug_log`), which import neither; a new family adds its table here and keeps its thunks in a file of its own.

use std::sync::{Arc, OnceLock};

use vhca_ntapi::{NtAsyncKernel, NtKernel, PKDPC, PKEVENT, PKTIMER};
use vhca_ntmodel::{NtModel, VerifierFlags};

use crate::address_space::AddressSpace;
use crate::debug_log::DebugLog;
use crate::dma_table::DmaObjects;
use crate::interrupt_table::InterruptConnections;
use crate::io_manager::IoManager;
use crate::lock_table::LockObjects;
use crate::mdl_table::MdlTable;
use crate::object_table::ObjectTable;
use crate::pageable_pool::PageablePool;
use crate::race_watch::RaceWatch;
use crate::registry_table::Registry;
use crate::remove_lock_table::RemoveLocks;

pub struct LoaderKernel {
    pub model: Arc<NtModel>,
    pub io: IoManager,
    pub addresses: AddressSpace,
    pub mdls: MdlTable,
    pub dma: DmaObjects,
    pub locks: LockObjects,
    pub registry: Registry,
    pub remove_locks: RemoveLocks,
    /// The model's DPC, timer and event behind each KDPC, KTIMER and KEVENT in driver memory.
    pub dpcs: ObjectTable<PKDPC>,
    pub timers: ObjectTable<PKTIMER>,
    pub events: ObjectTable<PKEVENT>,
    pub interrupts: InterruptConnections,
    /// The driver's paged pool blocks, trimmed under IRQL checking when IRQL is raised.
    pub pageable: PageablePool,
    /// The pool blocks whose loads and stores an interleaving run traps for the race detector (none by default).
    pub race_watch: RaceWatch,
    /// Every DbgPrintEx line, in order; also written to stdout as the guest's console shows kernel messages.
    pub debug_log: DebugLog,
    /// Whether the driver's own `VHCA-RESULT` lines go to stdout too; off where the caller reports the run itself
    /// (the guest program merges the driver's result into its one result line).
    pub echo_results: bool,
}

impl LoaderKernel {
    pub fn new(model: Arc<NtModel>, io: IoManager) -> LoaderKernel {
        LoaderKernel {
            model,
            io,
            addresses: AddressSpace::default(),
            mdls: MdlTable::default(),
            dma: DmaObjects::default(),
            locks: LockObjects::default(),
            registry: Registry::default(),
            remove_locks: RemoveLocks::default(),
            dpcs: ObjectTable::default(),
            timers: ObjectTable::default(),
            events: ObjectTable::default(),
            interrupts: InterruptConnections::default(),
            pageable: PageablePool::default(),
            race_watch: RaceWatch::new(Default::default()),
            debug_log: DebugLog::default(),
            echo_results: true,
        }
    }

    /// The mapped driver's pageable sections (PAGE*) join the pageable memory Force IRQL checking trims.
    pub fn register_pageable_sections(&self, mapped: &crate::MappedImage) {
        for (at, bytes, resident) in mapped.pageable_sections() {
            self.pageable.insert_section(at, bytes, resident);
        }
    }

    /// IRQL went to DISPATCH_LEVEL or above on the driver's behalf (a raise, a spin lock, a DPC, an ISR,
    /// KeSynchronizeExecution): under IRQL checking the verifier trims pageable memory then, so a touch of paged
    /// pool at raised IRQL faults (0xD1) as on Windows.
    pub fn raised(&self) {
        if self.model.verifier().contains(VerifierFlags::IRQL_CHECKING) {
            self.pageable.trim();
        }
    }

    /// Signals the KEVENT at `event` as KeSetEvent does (an IRP's UserEvent at completion); an event the driver
    /// never initialized through the kernel gets its DISPATCHER_HEADER's SignalState set, as before.
    pub fn signal_event(&self, event: usize) {
        match self.events.get(event) {
            Some(e) => {
                self.model.KeSetEvent(e, 0, false);
            }
            // SAFETY: the driver's KEVENT: SignalState is the DISPATCHER_HEADER's i32 at offset 4.
            None => unsafe { ((event + 4) as *mut i32).write_volatile(1) },
        }
    }

    /// The driver's last `VHCA-RESULT` line, its JSON after the marker.
    pub fn result_json(&self) -> Option<String> {
        self.debug_log.last_result()
    }
}

static KERNEL: OnceLock<LoaderKernel> = OnceLock::new();

/// Installs the kernel; false when one is already installed (one per process).
pub fn install(kernel: LoaderKernel) -> bool {
    KERNEL.set(kernel).is_ok()
}

/// The installed kernel. A thunk runs only after `install`: the loader installs before binding any import.
pub fn kernel() -> &'static LoaderKernel {
    KERNEL.get().expect("the loader installs its kernel before any driver code runs")
}

/// The installed kernel, if any (code that may run before `install`, or in a process that never installs one).
pub fn installed() -> Option<&'static LoaderKernel> {
    KERNEL.get()
}

/// Stops the machine through the model's bugcheck handler (the STOP line, then the end of the run).
pub fn bugcheck(code: u32, p1: u64, p2: u64, p3: u64, p4: u64) -> ! {
    kernel().model.KeBugCheckEx(code, p1, p2, p3, p4)
}
