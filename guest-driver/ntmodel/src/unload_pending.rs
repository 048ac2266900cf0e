//! What unload finds still pending on the asynchronous paths (0xC7 TIMER_OR_DPC_INVALID, the verifier's check
//! right after a driver unloads) and what the kernel meets when it later calls into the unloaded driver (0xCE).

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

    /// The kernel is about to call `routine` (a DPC, an ISR) of a driver that has unloaded: 0xCE in every mode
    /// (the memory manager's, not the verifier's). P1 the address touched, P2 0 (a read: the instruction fetch),
    /// P3 the address that touched it, here the routine's own first instruction. Disabled, the routine runs.
    pub(crate) fn before_unloaded_routine(&self, routine: u64) {
        if self.unloaded.load(Ordering::Acquire) {
            self.violation(Bugcheck::new(
                DRIVER_UNLOADED_WITHOUT_CANCELLING_PENDING_OPERATIONS,
                routine,
                0,
                routine,
                0,
            ));
        }
    }
}
