//! A PASSIVE_LEVEL wait on a notification KEVENT with a timeout, answered as "was it set in time": the shape the
//! several-processor scenarios (adapter-routine, two-requests) wait for their other processor's routine in.
//!
//! One place for it so each scenario's text says what it waits for, not how KeWaitForSingleObject is called.

use core::time::Duration;

use vhca_ntapi::*;

use crate::dpc_consumer::relative;

/// PASSIVE_LEVEL (a zero timeout: any IRQL <= DISPATCH_LEVEL). Whether `event` was set within `timeout`.
pub fn set_within<K: NtAsyncKernel>(k: &K, event: PKEVENT, timeout: Duration) -> bool {
    let status = k.KeWaitForSingleObject(
        event.into(),
        KWAIT_REASON::Executive,
        KPROCESSOR_MODE::KernelMode,
        false,
        Some(relative(timeout)),
    );
    status == STATUS_SUCCESS
}
