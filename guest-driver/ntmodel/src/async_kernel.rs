//! `NtAsyncKernel` for the model: each Windows routine forwards to the module that models it (interrupt, dpc,
//! locks, work_item, timer, dispatcher, clock), which checks its rules.

use vhca_ntapi::*;

use crate::NtModel;

impl NtAsyncKernel for NtModel {
    fn IoConnectInterruptEx(
        &self,
        parameters: IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS,
    ) -> Result<INTERRUPT_CONNECTION, NTSTATUS> {
        self.interrupt_connect(parameters)
    }
    fn IoDisconnectInterruptEx(&self, connection: &INTERRUPT_CONNECTION) {
        self.interrupt_disconnect(connection)
    }
    fn KeSynchronizeExecution(&self, interrupt: PKINTERRUPT, routine: &mut dyn FnMut() -> bool) -> bool {
        self.interrupt_synchronize(interrupt, routine)
    }
    fn KeAcquireInterruptSpinLock(&self, interrupt: PKINTERRUPT) -> KIRQL {
        self.interrupt_lock_acquire(interrupt)
    }
    fn KeReleaseInterruptSpinLock(&self, interrupt: PKINTERRUPT, old_irql: KIRQL) {
        self.interrupt_lock_release(interrupt, old_irql)
    }

    fn KeInitializeDpc(&self, routine: PKDEFERRED_ROUTINE) -> PKDPC {
        self.dpc_initialize(routine)
    }
    fn KeInsertQueueDpc(&self, dpc: PKDPC, system_argument1: PVOID, system_argument2: PVOID) -> bool {
        self.dpc_insert_and_run(dpc, system_argument1, system_argument2)
    }
    fn KeRemoveQueueDpc(&self, dpc: PKDPC) -> bool {
        self.dpc_remove(dpc)
    }
    fn KeFlushQueuedDpcs(&self) {
        self.dpc_flush()
    }
    fn IoInitializeDpcRequest(&self, device_object: PDEVICE_OBJECT, routine: PIO_DPC_ROUTINE) {
        self.dpc_request_initialize(device_object, routine)
    }
    fn IoRequestDpc(&self, device_object: PDEVICE_OBJECT, context: PVOID) {
        self.dpc_request(device_object, context)
    }

    fn KeAcquireSpinLockAtDpcLevel(&self, lock: PKSPIN_LOCK) {
        self.spin_lock_acquire_at_dpc_level(lock)
    }
    fn KeReleaseSpinLockFromDpcLevel(&self, lock: PKSPIN_LOCK) {
        self.spin_lock_release_from_dpc_level(lock)
    }

    fn IoAllocateWorkItem(&self, device_object: PDEVICE_OBJECT) -> PIO_WORKITEM {
        self.work_item_allocate(device_object)
    }
    fn IoQueueWorkItem(&self, item: PIO_WORKITEM, routine: PIO_WORKITEM_ROUTINE, queue_type: WORK_QUEUE_TYPE) {
        self.work_item_queue(item, routine, queue_type)
    }
    fn IoFreeWorkItem(&self, item: PIO_WORKITEM) {
        self.work_item_free(item)
    }

    fn KeInitializeTimerEx(&self, timer_type: TIMER_TYPE) -> PKTIMER {
        self.timer_initialize(timer_type)
    }
    fn KeSetTimerEx(&self, timer: PKTIMER, due_time: i64, period_ms: u32, dpc: PKDPC) -> bool {
        self.timer_set(timer, due_time, period_ms, dpc)
    }
    fn KeCancelTimer(&self, timer: PKTIMER) -> bool {
        self.timer_cancel(timer)
    }

    fn KeInitializeEvent(&self, event_type: EVENT_TYPE, state: bool) -> PKEVENT {
        let reset = match event_type {
            EVENT_TYPE::NotificationEvent => crate::dispatcher::Reset::Notification,
            EVENT_TYPE::SynchronizationEvent => crate::dispatcher::Reset::Synchronization,
        };
        PKEVENT(self.new_dispatcher_object(reset, state))
    }
    fn KeSetEvent(&self, event: PKEVENT, _increment: KPRIORITY, wait: bool) -> i32 {
        self.event_set(event, wait)
    }
    fn KeClearEvent(&self, event: PKEVENT) {
        self.event_clear(event)
    }
    fn KeWaitForSingleObject(
        &self,
        object: DISPATCHER_OBJECT,
        _wait_reason: KWAIT_REASON,
        _wait_mode: KPROCESSOR_MODE,
        _alertable: bool,
        timeout: Option<i64>,
    ) -> NTSTATUS {
        self.wait_for_single_object(object, timeout)
    }

    fn KeGetCurrentProcessorNumber(&self) -> u32 {
        self.current_processor().0
    }
    fn KeGetCurrentProcessorNumberEx(&self, number: Option<&mut PROCESSOR_NUMBER>) -> u32 {
        let n = self.current_processor().0;
        if let Some(number) = number {
            // One group: the system-wide index is the number in group 0.
            *number = PROCESSOR_NUMBER { Group: 0, Number: n as u8, Reserved: 0 };
        }
        n
    }
    fn KeQueryActiveProcessorCountEx(&self, group: u16) -> u32 {
        match group {
            0 | ALL_PROCESSOR_GROUPS => self.processor_count(),
            _ => 0,
        }
    }
    fn KeQueryActiveProcessorCount(&self, active: Option<&mut KAFFINITY>) -> u32 {
        let n = self.processor_count();
        if let Some(active) = active {
            *active = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
        }
        n
    }
    fn KeSetTargetProcessorDpc(&self, dpc: PKDPC, number: CCHAR) {
        // Windows 7 and later: a number past group 0's active processors leaves the target unchanged.
        if let Ok(n) = u32::try_from(number) {
            if n < self.processor_count() {
                self.dpc_set_target(dpc, crate::processor::ProcessorNumber(n));
            }
        }
    }
    fn KeSetTargetProcessorDpcEx(&self, dpc: PKDPC, number: &PROCESSOR_NUMBER) -> NTSTATUS {
        if number.Group != 0 || u32::from(number.Number) >= self.processor_count() || number.Reserved != 0 {
            return STATUS_INVALID_PARAMETER;
        }
        self.dpc_set_target(dpc, crate::processor::ProcessorNumber(u32::from(number.Number)));
        STATUS_SUCCESS
    }
    fn KeStallExecutionProcessor(&self, microseconds: u32) {
        self.stall(microseconds)
    }
}
