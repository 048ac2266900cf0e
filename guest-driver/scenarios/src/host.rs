//! What a scenario needs from the program it runs in, beyond the NT kernel and the command transport: where its
//! progress and result details go, a clock, user buffers, and the platform's IOMMU fault reports. The Linux guest
//! program (NT model over VFIO) and vhca.sys (the WDK shim) each implement it once.

use alloc::boxed::Box;
use core::fmt;
use core::time::Duration;

use serde_json::Value;
use vhca_driver_core::{CommandTransport, CompletionCounts, CqCompletions};
use vhca_ntapi::{NtAsyncKernel, PDEVICE_OBJECT, PVOID};

pub trait ScenarioHost {
    /// NtAsyncKernel: scenarios drive timers and DPCs themselves (the driver's own watchdog timer, its teardown),
    /// and every kernel they run on has them (the NT model, vhca.sys's ntoskrnl.exe).
    type Kernel: NtAsyncKernel + 'static;
    type Channel: CommandTransport;

    /// A progress line (the guest's console, the kernel debugger).
    fn say(&self, message: fmt::Arguments<'_>);
    /// Adds `key: value` to the result's details at once, so a machine that stops later still reports it.
    fn detail(&self, key: &str, value: Value);
    /// The lock the control path took (`lock_name`), a top-level field of the result.
    fn lock_chosen(&self, name: &'static str);

    /// A monotonic clock from any origin.
    fn now(&self) -> Duration;
    /// Waits about `duration` before the next poll (PASSIVE_LEVEL).
    fn sleep(&self, duration: Duration);

    /// A user process's pageable buffer of `len` bytes starting `in_page_offset` bytes into its first page; NULL
    /// when it cannot be allocated.
    fn alloc_user_buffer(&self, len: u32, in_page_offset: u64) -> PVOID;
    fn free_user_buffer(&self, va: PVOID);

    /// Waits up to `wait` for the platform's IOMMU fault reports about this device and hands them to the kernel
    /// (with DMA checking the machine stops there). Returns how many there were, or None where the platform reports
    /// them to its own kernel without the driver seeing them (Windows).
    fn report_platform_iommu_faults(&self, wait: Duration) -> Option<usize>;
    /// Whether the verifier checks DMA, where the driver can know it (for messages only).
    fn dma_checking(&self) -> Option<bool>;

    /// The driver's own device object, for the routines that want "the caller's driver object or one of the
    /// caller's device objects" (IoAllocateWorkItem: its reference keeps the work routine's driver loaded). None:
    /// the driver has none of its own (the native driver core, which the NT model runs as the PDO's driver), and
    /// the PDO stands in.
    fn own_device(&self) -> Option<PDEVICE_OBJECT> {
        None
    }
    /// The interrupt-driven completion path, connected, when the run asks for it (`vhca.completion=interrupt`) and
    /// the kernel can (an NtAsyncKernel): the scenario's completion waits sleep on its events. None: they poll.
    fn connect_completions(&self) -> anyhow::Result<Option<Box<dyn CqCompletions>>> {
        Ok(None)
    }
    /// The completion path was disconnected: what its ISR and DPC did, for the result.
    fn completion_counts(&self, _counts: CompletionCounts) {}

    /// The scenario returned and its events were drained; the driver is still open.
    fn scenario_finished(&self) {}
    /// Whether a failed scenario stopped on the driver's error path (a failure the kernel injected): then the run
    /// gives back the scenario's buffers, closes and unloads as after a success, and judges that instead.
    fn error_path(&self, _error: &anyhow::Error) -> bool {
        false
    }
    /// The driver closed: where the kernel can, it unloads the driver and runs the verifier's unload checks. An
    /// error fails the run (e.g. resources the driver never released).
    fn driver_closed(&self) -> anyhow::Result<()> {
        Ok(())
    }
}
