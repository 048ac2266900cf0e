//! What unload finds still pending on the asynchronous paths (0xC7 TIMER_OR_DPC_INVALID, the verifier's check
//! right after a driver unloads) and what the kernel meets when it later calls into the unloaded driver (0xD4: its
//! DPCs and ISRs run at raised IRQL).

use std::sync::atomic::Ordering;

use vhca_ntapi::*;

use crate::bugcheck::Bugcheck;
use crate::verifier::c7;
use crate::NtModel;

impl NtModel {
    /// Queued work items run first (IoQueueWorkItem's reference on the device object keeps the driver loaded until
    /// they return). Then, with any verifier flag (an automatic check), the first of: a timer still set (0xC7/0x0),
    /// a DPC still queued (0xC7/0x1), an interrupt still connected (0xC7/0x2, its ISR as the routine found: the
    /// model's reading, Microsoft lists no interrupt objects). P3/P4 are the range checked: the driver's objects for
    /// the first two, its image for the third (the model's stand-in ranges, `driver_object_range`,
    /// `driver_image_range`). From then on the driver is gone.
    pub(crate) fn async_unload_checks(&self) -> Result<(), Bugcheck> {
        self.wait_for_work_items();
        if self.verifier().enabled() {
            let (objects_start, objects_end) = self.driver_object_range();
            if let Some(timer) = self.set_timer() {
                self.found(Bugcheck::new(TIMER_OR_DPC_INVALID, c7::TIMER, timer, objects_start, objects_end))?;
            }
            if let Some(dpc) = self.queued_dpc() {
                self.found(Bugcheck::new(TIMER_OR_DPC_INVALID, c7::DPC_OBJECT, dpc, objects_start, objects_end))?;
            }
            if let Some(isr) = self.connected_isr() {
                let (image_start, image_end) = self.driver_image_range();
                self.found(Bugcheck::new(TIMER_OR_DPC_INVALID, c7::DPC_ROUTINE, isr, image_start, image_end))?;
            }
        }
        self.unloaded.store(true, Ordering::Release);
        Ok(())
    }

    /// The kernel is about to call `routine` of a driver that has unloaded, at `irql`: a DPC at DISPATCH_LEVEL or
    /// an ISR at DIRQL, so at raised IRQL, which is 0xD4, not 0xCE: 0xD4's page says the system "attempted to
    /// access the driver's former location at a raised IRQL" (0xCE is the same stop below it, and nothing of the
    /// driver's runs there after unload: queued work items are waited for). The memory manager's stop, not the
    /// verifier's, so in every mode. P1 the address touched, P2 that IRQL, P3 0 (a read: the instruction fetch),
    /// P4 the address that touched it, here the routine's own first instruction. Disabled, the routine runs.
    pub(crate) fn before_unloaded_routine(&self, routine: u64, irql: KIRQL) {
        if self.unloaded.load(Ordering::Acquire) {
            self.violation(Bugcheck::new(
                SYSTEM_SCAN_AT_RAISED_IRQL_CAUGHT_IMPROPER_DRIVER_UNLOAD,
                routine,
                irql as u64,
                0,
                routine,
            ));
        }
    }
}
