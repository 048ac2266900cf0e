//! `NtAsyncKernel` for the model: each Windows routine forwards to the module that models it (interrupt, dpc,
//! locks, work_item, timer, dispatcher, clock), which checks its rules. Each is a scheduling point named by its
//! caller's location (`kernel_call`), as the `NtKernel` routines are (kernel.rs).

use std::panic::Location;

use vhca_ntapi::*;

use crate::low_resources::at_location;
use crate::NtModel;

impl NtAsyncKernel for NtModel {
    #[track_caller]
    fn IoConnectInterruptEx(
        &self,
        parameters: IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS,
    ) -> Result<INTERRUPT_CONNECTION, NTSTATUS> {
        let _call = self.kernel_call("IoConnectInterruptEx");
        self.interrupt_connect(parameters)
    }
    #[track_caller]
    fn IoDisconnectInterruptEx(&self, connection: &INTERRUPT_CONNECTION) {
        let _call = self.kernel_call("IoDisconnectInterruptEx");
        self.interrupt_disconnect(connection)
    }
    #[track_caller]
    fn KeSynchronizeExecution(&self, interrupt: PKINTERRUPT, routine: &mut dyn FnMut() -> bool) -> bool {
        let _call = self.kernel_call("KeSynchronizeExecution");
        self.interrupt_synchronize(interrupt, routine)
    }
    #[track_caller]
    fn KeAcquireInterruptSpinLock(&self, interrupt: PKINTERRUPT) -> KIRQL {
        let _call = self.kernel_call("KeAcquireInterruptSpinLock");
        self.interrupt_lock_acquire(interrupt)
    }
    #[track_caller]
    fn KeReleaseInterruptSpinLock(&self, interrupt: PKINTERRUPT, old_irql: KIRQL) {
        let _call = self.kernel_call("KeReleaseInterruptSpinLock");
        self.interrupt_lock_release(interrupt, old_irql)
    }

    #[track_caller]
    fn KeInitializeDpc(&self, routine: PKDEFERRED_ROUTINE) -> PKDPC {
        let _call = self.kernel_call("KeInitializeDpc");
        self.dpc_initialize(routine)
    }
    #[track_caller]
    fn KeInsertQueueDpc(&self, dpc: PKDPC, system_argument1: PVOID, system_argument2: PVOID) -> bool {
        let _call = self.kernel_call("KeInsertQueueDpc");
        self.dpc_insert_and_run(dpc, system_argument1, system_argument2)
    }
    #[track_caller]
    fn KeRemoveQueueDpc(&self, dpc: PKDPC) -> bool {
        let _call = self.kernel_call("KeRemoveQueueDpc");
        self.dpc_remove(dpc)
    }
    #[track_caller]
    fn KeFlushQueuedDpcs(&self) {
        let _call = self.kernel_call("KeFlushQueuedDpcs");
        self.dpc_flush()
    }
    #[track_caller]
    fn IoInitializeDpcRequest(&self, device_object: PDEVICE_OBJECT, routine: PIO_DPC_ROUTINE) {
        let _call = self.kernel_call("IoInitializeDpcRequest");
        self.dpc_request_initialize(device_object, routine)
    }
    #[track_caller]
    fn IoRequestDpc(&self, device_object: PDEVICE_OBJECT, context: PVOID) {
        let _call = self.kernel_call("IoRequestDpc");
        self.dpc_request(device_object, context)
    }

    #[track_caller]
    fn KeAcquireSpinLockAtDpcLevel(&self, lock: PKSPIN_LOCK) {
        let _call = self.kernel_call("KeAcquireSpinLockAtDpcLevel");
        self.spin_lock_acquire_at_dpc_level(lock)
    }
    #[track_caller]
    fn KeReleaseSpinLockFromDpcLevel(&self, lock: PKSPIN_LOCK) {
        let _call = self.kernel_call("KeReleaseSpinLockFromDpcLevel");
        self.spin_lock_release_from_dpc_level(lock)
    }

    #[track_caller]
    fn IoAllocateWorkItem(&self, device_object: PDEVICE_OBJECT) -> PIO_WORKITEM {
        let _call = self.kernel_call("IoAllocateWorkItem");
        at_location(Location::caller(), || self.work_item_allocate(device_object))
    }
    #[track_caller]
    fn IoQueueWorkItem(&self, item: PIO_WORKITEM, routine: PIO_WORKITEM_ROUTINE, queue_type: WORK_QUEUE_TYPE) {
        let _call = self.kernel_call("IoQueueWorkItem");
        self.work_item_queue(item, routine, queue_type)
    }
    #[track_caller]
    fn IoFreeWorkItem(&self, item: PIO_WORKITEM) {
        let _call = self.kernel_call("IoFreeWorkItem");
        self.work_item_free(item)
    }

    #[track_caller]
    fn KeInitializeTimerEx(&self, timer_type: TIMER_TYPE) -> PKTIMER {
        let _call = self.kernel_call("KeInitializeTimerEx");
        self.timer_initialize(timer_type)
    }
    #[track_caller]
    fn KeSetTimerEx(&self, timer: PKTIMER, due_time: i64, period_ms: u32, dpc: PKDPC) -> bool {
        let _call = self.kernel_call("KeSetTimerEx");
        self.timer_set(timer, due_time, period_ms, dpc)
    }
    #[track_caller]
    fn KeCancelTimer(&self, timer: PKTIMER) -> bool {
        let _call = self.kernel_call("KeCancelTimer");
        self.timer_cancel(timer)
    }

    #[track_caller]
    fn KeInitializeEvent(&self, event_type: EVENT_TYPE, state: bool) -> PKEVENT {
        let _call = self.kernel_call("KeInitializeEvent");
        let reset = match event_type {
            EVENT_TYPE::NotificationEvent => crate::dispatcher::Reset::Notification,
            EVENT_TYPE::SynchronizationEvent => crate::dispatcher::Reset::Synchronization,
        };
        PKEVENT(self.new_dispatcher_object(reset, state))
    }
    #[track_caller]
    fn KeSetEvent(&self, event: PKEVENT, _increment: KPRIORITY, wait: bool) -> i32 {
        let _call = self.kernel_call("KeSetEvent");
        self.event_set(event, wait)
    }
    #[track_caller]
    fn KeClearEvent(&self, event: PKEVENT) {
        let _call = self.kernel_call("KeClearEvent");
        self.event_clear(event)
    }
    #[track_caller]
    fn KeWaitForSingleObject(
        &self,
        object: DISPATCHER_OBJECT,
        _wait_reason: KWAIT_REASON,
        _wait_mode: KPROCESSOR_MODE,
        _alertable: bool,
        timeout: Option<i64>,
    ) -> NTSTATUS {
        let _call = self.kernel_call("KeWaitForSingleObject");
        self.wait_for_single_object(object, timeout)
    }

    #[track_caller]
    fn KeGetCurrentProcessorNumber(&self) -> u32 {
        let _call = self.kernel_call("KeGetCurrentProcessorNumber");
        self.current_processor().0
    }
    #[track_caller]
    fn KeGetCurrentProcessorNumberEx(&self, number: Option<&mut PROCESSOR_NUMBER>) -> u32 {
        let _call = self.kernel_call("KeGetCurrentProcessorNumberEx");
        let n = self.current_processor().0;
        if let Some(number) = number {
            // One group: the system-wide index is the number in group 0.
            *number = PROCESSOR_NUMBER { Group: 0, Number: n as u8, Reserved: 0 };
        }
        n
    }
    #[track_caller]
    fn KeQueryActiveProcessorCountEx(&self, group: u16) -> u32 {
        let _call = self.kernel_call("KeQueryActiveProcessorCountEx");
        match group {
            0 | ALL_PROCESSOR_GROUPS => self.processor_count(),
            _ => 0,
        }
    }
    #[track_caller]
    fn KeQueryActiveProcessorCount(&self, active: Option<&mut KAFFINITY>) -> u32 {
        let _call = self.kernel_call("KeQueryActiveProcessorCount");
        let n = self.processor_count();
        if let Some(active) = active {
            *active = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
        }
        n
    }
    #[track_caller]
    fn KeSetTargetProcessorDpc(&self, dpc: PKDPC, number: CCHAR) {
        let _call = self.kernel_call("KeSetTargetProcessorDpc");
        // Windows 7 and later: a number past group 0's active processors leaves the target unchanged.
        if let Ok(n) = u32::try_from(number) {
            if n < self.processor_count() {
                self.dpc_set_target(dpc, crate::processor::ProcessorNumber(n));
            }
        }
    }
    #[track_caller]
    fn KeSetTargetProcessorDpcEx(&self, dpc: PKDPC, number: &PROCESSOR_NUMBER) -> NTSTATUS {
        let _call = self.kernel_call("KeSetTargetProcessorDpcEx");
        if number.Group != 0 || u32::from(number.Number) >= self.processor_count() || number.Reserved != 0 {
            return STATUS_INVALID_PARAMETER;
        }
        self.dpc_set_target(dpc, crate::processor::ProcessorNumber(u32::from(number.Number)));
        STATUS_SUCCESS
    }
    #[track_caller]
    fn KeStallExecutionProcessor(&self, microseconds: u32) {
        let _call = self.kernel_call("KeStallExecutionProcessor");
        self.stall(microseconds)
    }
}
