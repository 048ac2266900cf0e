//! `vhca_ntapi::NtAsyncKernel` over the real kernel: each method calls the ntoskrnl.exe / HAL.dll routine of the
//! same name. KDPC, KTIMER, KEVENT and each interrupt connection's context live in boxes kept by the shim (non-paged
//! pool) until it is dropped; Windows calls back through kernel_callbacks.rs.
//!
//! Why the drop cancels, flushes and disconnects nothing: teardown is the driver's, in the order Microsoft gives
//! (the driver core's CompletionPath disconnects and flushes before its CQs go, a watchdog cancels its timer and
//! flushes), and a driver that forgets is the bug Windows must see: a timer still set when its memory goes back to
//! pool is 0xC7 at unload. A shim that cancelled on the driver's behalf would hide exactly the bugs the seed
//! scenarios reproduce (unload-timer-set) from vhca.sys.

use alloc::boxed::Box;
use core::ffi::c_void;

use vhca_ntapi::*;
use windows_sys::Wdk::Foundation::{
    DEVICE_OBJECT, KDPC, KEVENT, PIO_WORKITEM as KernelWorkItem, PKINTERRUPT as KernelInterrupt,
};
use windows_sys::Wdk::System::SystemServices as wdk;
use windows_sys::Win32::System::Kernel as kernel;

use super::kernel_callbacks::{self as callbacks, DpcObject, InterruptRoutines};
use super::kernel_imports::{KeAcquireSpinLockAtDpcLevel, KeReleaseSpinLockFromDpcLevel};
use super::wdk_kernel::{Owned, WdkKernel};

/// An asynchronous object the shim keeps for the driver core. Held, not read: the box keeps the object (and the
/// closure Windows calls back into) alive until the shim is dropped.
#[allow(dead_code)]
pub enum AsyncObject {
    Dpc(Box<DpcObject>),
    Timer(Box<wdk::KTIMER>),
    Event(Box<KEVENT>),
    Interrupt(Box<Connection>),
    /// A device object whose Dpc IoInitializeDpcRequest initialised (the KDPC is the device object's own).
    DpcForIsr(PDEVICE_OBJECT),
}

/// One IoConnectInterruptEx: its ServiceContext, and what IoDisconnectInterruptEx needs back.
pub struct Connection {
    routines: InterruptRoutines,
    /// Where IoConnectInterruptEx wrote its ConnectionContext: the PIO_INTERRUPT_MESSAGE_INFO (message-based) or
    /// the PKINTERRUPT (line-based).
    context: *mut c_void,
    /// The Version IoConnectInterruptEx returned.
    version: u32,
    /// The connection's interrupt object (message 0's, or the line's), by which `IoDisconnectInterruptEx` finds it.
    interrupt: PKINTERRUPT,
}

impl Connection {
    /// IRQL = PASSIVE_LEVEL. After it returns no ISR of the connection runs, so the box may go.
    fn disconnect(&self) {
        let mut parameters = wdk::IO_DISCONNECT_INTERRUPT_PARAMETERS { Version: self.version, ..Default::default() };
        parameters.ConnectionContext.Generic = self.context;
        // SAFETY: PASSIVE_LEVEL (stop, remove or the path's teardown), the device's interrupts already quiet (the
        // caller stopped asking for them); the Version and ConnectionContext IoConnectInterruptEx returned.
        unsafe { wdk::IoDisconnectInterruptEx(&parameters) };
    }
}

/// At the shim's drop, before the objects are freed: the DpcForIsr table forgets this shim's device objects (their
/// closures go with the shim). Nothing else is undone (the module's head says why).
pub fn release(owned: &[Owned]) {
    for object in owned {
        if let Owned::Async(AsyncObject::DpcForIsr(device)) = object {
            callbacks::unregister_dpc_for_isr(*device);
        }
    }
}

fn interrupt_mode(mode: wdk::KINTERRUPT_MODE) -> KINTERRUPT_MODE {
    if mode == wdk::Latched {
        KINTERRUPT_MODE::Latched
    } else {
        KINTERRUPT_MODE::LevelSensitive
    }
}

fn interrupt_polarity(polarity: wdk::KINTERRUPT_POLARITY) -> KINTERRUPT_POLARITY {
    match polarity {
        wdk::InterruptActiveHigh => KINTERRUPT_POLARITY::InterruptActiveHigh,
        wdk::InterruptActiveLow => KINTERRUPT_POLARITY::InterruptActiveLow,
        _ => KINTERRUPT_POLARITY::InterruptPolarityUnknown,
    }
}

/// IO_INTERRUPT_MESSAGE_INFO read back as vhca-ntapi's value.
///
/// # Safety
/// `table` is the PIO_INTERRUPT_MESSAGE_INFO IoConnectInterruptEx returned: MessageCount entries follow its header.
unsafe fn message_info(table: *const wdk::IO_INTERRUPT_MESSAGE_INFO) -> IO_INTERRUPT_MESSAGE_INFO {
    // SAFETY: the caller's contract; MessageInfo is a C flexible array of MessageCount entries.
    unsafe {
        let entries = core::ptr::addr_of!((*table).MessageInfo).cast::<wdk::IO_INTERRUPT_MESSAGE_INFO_ENTRY>();
        let count = (*table).MessageCount as usize;
        let entries = (0..count)
            .map(|i| {
                let e = &*entries.add(i);
                IO_INTERRUPT_MESSAGE_INFO_ENTRY {
                    MessageAddress: PHYSICAL_ADDRESS(e.MessageAddress as u64),
                    TargetProcessorSet: e.TargetProcessorSet as u64,
                    InterruptObject: PKINTERRUPT(e.InterruptObject as u64),
                    MessageData: e.MessageData,
                    Vector: e.Vector,
                    Irql: e.Irql,
                    Mode: interrupt_mode(e.Mode),
                    Polarity: interrupt_polarity(e.Polarity),
                }
            })
            .collect();
        IO_INTERRUPT_MESSAGE_INFO { UnifiedIrql: (*table).UnifiedIrql, MessageInfo: entries }
    }
}

impl WdkKernel {
    fn keep_async(&self, object: AsyncObject) {
        self.keep(Owned::Async(object));
    }
}

impl NtAsyncKernel for WdkKernel {
    fn IoConnectInterruptEx(
        &self,
        parameters: IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS,
    ) -> Result<INTERRUPT_CONNECTION, NTSTATUS> {
        let has_fallback = parameters.FallBackServiceRoutine.is_some();
        let mut connection = Box::new(Connection {
            routines: InterruptRoutines {
                message: parameters.MessageServiceRoutine,
                line: parameters.FallBackServiceRoutine,
            },
            context: core::ptr::null_mut(),
            version: 0,
            interrupt: PKINTERRUPT::NULL,
        });
        let service_context = &connection.routines as *const InterruptRoutines as *mut c_void;
        let mut p = wdk::IO_CONNECT_INTERRUPT_PARAMETERS { Version: wdk::CONNECT_MESSAGE_BASED, ..Default::default() };
        p.Anonymous.MessageBased = wdk::IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS {
            PhysicalDeviceObject: parameters.PhysicalDeviceObject.0 as *mut DEVICE_OBJECT,
            ConnectionContext: wdk::IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS_0 {
                Generic: &mut connection.context,
            },
            MessageServiceRoutine: callbacks::message_service(),
            ServiceContext: service_context,
            SpinLock: parameters.SpinLock.0 as *mut usize,
            SynchronizeIrql: parameters.SynchronizeIrql,
            FloatingSave: parameters.FloatingSave,
            FallBackServiceRoutine: if has_fallback { callbacks::service() } else { None },
        };
        // SAFETY: PASSIVE_LEVEL (START_DEVICE's thread); the PDO START_DEVICE came for; the ConnectionContext slot
        // and the ServiceContext are in the boxed connection, which outlives the connection (kept until
        // IoDisconnectInterruptEx or the shim's drop).
        let status = unsafe { wdk::IoConnectInterruptEx(&mut p) };
        if status < 0 {
            return Err(NTSTATUS(status));
        }
        // On success Version says what was connected: CONNECT_LINE_BASED when the device had no messages and the
        // fallback routine was connected to its line interrupt instead.
        connection.version = p.Version;
        let connected = match p.Version {
            wdk::CONNECT_MESSAGE_BASED => {
                // SAFETY: the kernel's message table for this connection, valid until IoDisconnectInterruptEx.
                INTERRUPT_CONNECTION::MessageBased(unsafe {
                    message_info(connection.context as *const wdk::IO_INTERRUPT_MESSAGE_INFO)
                })
            }
            wdk::CONNECT_LINE_BASED => INTERRUPT_CONNECTION::LineBased(PKINTERRUPT(connection.context as u64)),
            // Success with another version is not documented for a CONNECT_MESSAGE_BASED request; give it back.
            _ => {
                connection.disconnect();
                return Err(STATUS_NOT_SUPPORTED);
            }
        };
        connection.interrupt = connected.InterruptObject();
        self.keep_async(AsyncObject::Interrupt(connection));
        Ok(connected)
    }

    fn IoDisconnectInterruptEx(&self, connection: &INTERRUPT_CONNECTION) {
        let interrupt = connection.InterruptObject();
        let found = self.forget(|o| matches!(o, Owned::Async(AsyncObject::Interrupt(c)) if c.interrupt == interrupt));
        if let Some(Owned::Async(AsyncObject::Interrupt(c))) = found {
            // Its ServiceContext is freed only after this returned: no ISR runs after IoDisconnectInterruptEx.
            c.disconnect();
        }
    }

    fn KeSynchronizeExecution(&self, interrupt: PKINTERRUPT, routine: &mut dyn FnMut() -> bool) -> bool {
        let mut routine = routine;
        let context = &mut routine as *mut &mut dyn FnMut() -> bool as *const c_void;
        // SAFETY: IRQL <= the connection's synchronize IRQL (the caller's); `context` lives on this stack for the
        // whole call, which runs the routine at that IRQL with the interrupt spin lock held and returns after it.
        unsafe { wdk::KeSynchronizeExecution(interrupt.0 as KernelInterrupt, callbacks::synchronize(), context) }
    }

    fn KeAcquireInterruptSpinLock(&self, interrupt: PKINTERRUPT) -> KIRQL {
        // SAFETY: IRQL <= the connection's DIRQL; raises to it and takes the interrupt spin lock.
        unsafe { wdk::KeAcquireInterruptSpinLock(interrupt.0 as KernelInterrupt) }
    }

    fn KeReleaseInterruptSpinLock(&self, interrupt: PKINTERRUPT, old_irql: KIRQL) {
        // SAFETY: the DIRQL, holding the lock this processor took with KeAcquireInterruptSpinLock.
        unsafe { wdk::KeReleaseInterruptSpinLock(interrupt.0 as KernelInterrupt, old_irql) }
    }

    fn KeInitializeDpc(&self, routine: PKDEFERRED_ROUTINE) -> PKDPC {
        // SAFETY: an all-zero KDPC is the uninitialised state KeInitializeDpc expects.
        let mut object = Box::new(DpcObject { dpc: unsafe { core::mem::zeroed() }, routine });
        let context = &*object as *const DpcObject as *const c_void;
        // SAFETY: any IRQL; the KDPC is resident (the Rust heap is non-paged pool) and kept until the shim's drop,
        // after quiesce removed and flushed it.
        unsafe { wdk::KeInitializeDpc(&mut object.dpc, callbacks::deferred(), context) };
        let dpc = PKDPC(&object.dpc as *const KDPC as u64);
        self.keep_async(AsyncObject::Dpc(object));
        dpc
    }

    fn KeInsertQueueDpc(&self, dpc: PKDPC, system_argument1: PVOID, system_argument2: PVOID) -> bool {
        // SAFETY: any IRQL, the ISR's DIRQL included; a KDPC initialised above (no table lookup: an ISR must not
        // take the shim's spin lock).
        unsafe {
            wdk::KeInsertQueueDpc(
                dpc.0 as *mut KDPC,
                system_argument1.0 as *const c_void,
                system_argument2.0 as *const c_void,
            )
        }
    }

    fn KeRemoveQueueDpc(&self, dpc: PKDPC) -> bool {
        // SAFETY: any IRQL; a KDPC initialised above.
        unsafe { wdk::KeRemoveQueueDpc(dpc.0 as *mut KDPC) }
    }

    fn KeFlushQueuedDpcs(&self) {
        // SAFETY: PASSIVE_LEVEL (the caller's: a teardown).
        unsafe { wdk::KeFlushQueuedDpcs() }
    }

    /// wdm.h's inline: KeInitializeDpc(&DeviceObject->Dpc, (PKDEFERRED_ROUTINE)DpcRoutine, DeviceObject).
    fn IoInitializeDpcRequest(&self, device_object: PDEVICE_OBJECT, routine: PIO_DPC_ROUTINE) {
        callbacks::register_dpc_for_isr(device_object, routine);
        let device = device_object.0 as *mut DEVICE_OBJECT;
        // SAFETY: any IRQL; the caller's own device object (from AddDevice), whose Dpc is resident with it.
        unsafe { wdk::KeInitializeDpc(&mut (*device).Dpc, callbacks::deferred_dpc_for_isr(), device as *const c_void) };
        let known = self.forget(|o| matches!(o, Owned::Async(AsyncObject::DpcForIsr(d)) if *d == device_object));
        drop(known);
        self.keep_async(AsyncObject::DpcForIsr(device_object));
    }

    /// wdm.h's inline: KeInsertQueueDpc(&DeviceObject->Dpc, Irp, Context); the driver core queues no IRP.
    fn IoRequestDpc(&self, device_object: PDEVICE_OBJECT, context: PVOID) {
        // SAFETY: DIRQL (the ISR's) or below; the device object's Dpc, initialised by IoInitializeDpcRequest.
        unsafe {
            wdk::KeInsertQueueDpc(
                &mut (*(device_object.0 as *mut DEVICE_OBJECT)).Dpc,
                core::ptr::null(),
                context.0 as *const c_void,
            )
        };
    }

    fn KeAcquireSpinLockAtDpcLevel(&self, lock: PKSPIN_LOCK) {
        // SAFETY: DISPATCH_LEVEL or above (the DPC's), a KSPIN_LOCK the shim made (resident).
        unsafe { KeAcquireSpinLockAtDpcLevel(lock.0 as *mut usize) }
    }

    fn KeReleaseSpinLockFromDpcLevel(&self, lock: PKSPIN_LOCK) {
        // SAFETY: DISPATCH_LEVEL, held by this processor.
        unsafe { KeReleaseSpinLockFromDpcLevel(lock.0 as *mut usize) }
    }

    fn IoAllocateWorkItem(&self, device_object: PDEVICE_OBJECT) -> PIO_WORKITEM {
        // SAFETY: IRQL <= DISPATCH_LEVEL; the caller's device object.
        let item = unsafe { wdk::IoAllocateWorkItem(device_object.0 as *const DEVICE_OBJECT) };
        self.noting(PIO_WORKITEM(item as u64), item == 0)
    }

    fn IoQueueWorkItem(&self, item: PIO_WORKITEM, routine: PIO_WORKITEM_ROUTINE, queue_type: WORK_QUEUE_TYPE) {
        let context = callbacks::work_item_context(routine);
        // SAFETY: IRQL <= DISPATCH_LEVEL; an item from IoAllocateWorkItem, not queued (the caller's contract). The
        // context is taken back by the routine, which Windows calls exactly once; the queued item holds a reference
        // on its device object, so the image stays loaded until it ran.
        unsafe { wdk::IoQueueWorkItem(item.0 as KernelWorkItem, callbacks::work_item(), queue_type as i32, context) }
    }

    fn IoFreeWorkItem(&self, item: PIO_WORKITEM) {
        // SAFETY: IRQL <= DISPATCH_LEVEL; an item from IoAllocateWorkItem that is not queued.
        unsafe { wdk::IoFreeWorkItem(item.0 as KernelWorkItem) }
    }

    fn KeInitializeTimerEx(&self, timer_type: TIMER_TYPE) -> PKTIMER {
        // SAFETY: an all-zero KTIMER is the uninitialised state KeInitializeTimerEx expects.
        let mut timer: Box<wdk::KTIMER> = Box::new(unsafe { core::mem::zeroed() });
        let kind = match timer_type {
            TIMER_TYPE::NotificationTimer => kernel::NotificationTimer,
            TIMER_TYPE::SynchronizationTimer => kernel::SynchronizationTimer,
        };
        // SAFETY: IRQL <= DISPATCH_LEVEL; a resident KTIMER, kept until the shim's drop cancelled it.
        unsafe { wdk::KeInitializeTimerEx(&mut *timer, kind) };
        let p = PKTIMER(&*timer as *const wdk::KTIMER as u64);
        self.keep_async(AsyncObject::Timer(timer));
        p
    }

    fn KeSetTimerEx(&self, timer: PKTIMER, due_time: i64, period_ms: u32, dpc: PKDPC) -> bool {
        // Windows' Period is a LONG.
        let period = period_ms.min(i32::MAX as u32) as i32;
        // SAFETY: IRQL <= DISPATCH_LEVEL; a KTIMER and (if not NULL) a KDPC initialised above.
        unsafe { wdk::KeSetTimerEx(timer.0 as *mut wdk::KTIMER, due_time, period, dpc.0 as *const KDPC) }
    }

    fn KeCancelTimer(&self, timer: PKTIMER) -> bool {
        // SAFETY: IRQL <= DISPATCH_LEVEL; a KTIMER initialised above.
        unsafe { wdk::KeCancelTimer(timer.0 as *mut wdk::KTIMER) }
    }

    fn KeInitializeEvent(&self, event_type: EVENT_TYPE, state: bool) -> PKEVENT {
        // SAFETY: an all-zero KEVENT is the uninitialised state KeInitializeEvent expects.
        let mut event: Box<KEVENT> = Box::new(unsafe { core::mem::zeroed() });
        let kind = match event_type {
            EVENT_TYPE::NotificationEvent => kernel::NotificationEvent,
            EVENT_TYPE::SynchronizationEvent => kernel::SynchronizationEvent,
        };
        // SAFETY: any IRQL; a resident KEVENT (a DPC sets it), kept until the shim's drop.
        unsafe { wdk::KeInitializeEvent(&mut *event, kind, state) };
        let p = PKEVENT(&*event as *const KEVENT as u64);
        self.keep_async(AsyncObject::Event(event));
        p
    }

    fn KeSetEvent(&self, event: PKEVENT, increment: KPRIORITY, wait: bool) -> i32 {
        // SAFETY: IRQL <= DISPATCH_LEVEL (Wait = FALSE; the DPC's) or <= APC_LEVEL (Wait = TRUE); initialised above.
        unsafe { wdk::KeSetEvent(event.0 as *mut KEVENT, increment, wait) }
    }

    fn KeClearEvent(&self, event: PKEVENT) {
        // SAFETY: IRQL <= DISPATCH_LEVEL; initialised above.
        unsafe { wdk::KeClearEvent(event.0 as *mut KEVENT) }
    }

    fn KeWaitForSingleObject(
        &self,
        object: DISPATCHER_OBJECT,
        wait_reason: KWAIT_REASON,
        wait_mode: KPROCESSOR_MODE,
        alertable: bool,
        timeout: Option<i64>,
    ) -> NTSTATUS {
        let due = timeout.as_ref().map_or(core::ptr::null(), |t| t as *const i64);
        // SAFETY: IRQL <= APC_LEVEL, or DISPATCH_LEVEL with a zero timeout (the caller's); a KEVENT or KTIMER the
        // shim made; `due` points at the caller's timeout for the whole call.
        NTSTATUS(unsafe {
            wdk::KeWaitForSingleObject(
                object.address() as *const c_void,
                wait_reason as i32,
                wait_mode as i8,
                alertable,
                due,
            )
        })
    }

    fn KeGetCurrentProcessorNumber(&self) -> u32 {
        // SAFETY: any IRQL; the group-relative number is not wanted (NULL), the system-wide index is returned.
        unsafe { wdk::KeGetCurrentProcessorNumberEx(core::ptr::null_mut()) }
    }

    fn KeGetCurrentProcessorNumberEx(&self, number: Option<&mut PROCESSOR_NUMBER>) -> u32 {
        let mut n = kernel::PROCESSOR_NUMBER { Group: 0, Number: 0, Reserved: 0 };
        // SAFETY: any IRQL; `n` is ours, written before the call returns.
        let index = unsafe { wdk::KeGetCurrentProcessorNumberEx(&mut n) };
        if let Some(number) = number {
            *number = PROCESSOR_NUMBER { Group: n.Group, Number: n.Number, Reserved: n.Reserved };
        }
        index
    }

    fn KeQueryActiveProcessorCountEx(&self, group: u16) -> u32 {
        // SAFETY: any IRQL; takes a value.
        unsafe { wdk::KeQueryActiveProcessorCountEx(group) }
    }

    fn KeQueryActiveProcessorCount(&self, active: Option<&mut KAFFINITY>) -> u32 {
        let mut set: usize = 0;
        // SAFETY: any IRQL; `set` is ours (KAFFINITY is pointer-sized on x64).
        let count = unsafe { wdk::KeQueryActiveProcessorCount(&mut set) };
        if let Some(active) = active {
            *active = set as KAFFINITY;
        }
        count
    }

    fn KeSetTargetProcessorDpc(&self, dpc: PKDPC, number: CCHAR) {
        // SAFETY: any IRQL; a KDPC initialised by KeInitializeDpc above.
        unsafe { wdk::KeSetTargetProcessorDpc(dpc.0 as *mut KDPC, number) }
    }

    fn KeSetTargetProcessorDpcEx(&self, dpc: PKDPC, number: &PROCESSOR_NUMBER) -> NTSTATUS {
        let n = kernel::PROCESSOR_NUMBER { Group: number.Group, Number: number.Number, Reserved: number.Reserved };
        // SAFETY: any IRQL; a KDPC initialised by KeInitializeDpc above and our PROCESSOR_NUMBER.
        NTSTATUS(unsafe { wdk::KeSetTargetProcessorDpcEx(dpc.0 as *mut KDPC, &n) })
    }

    fn KeStallExecutionProcessor(&self, microseconds: u32) {
        // SAFETY: any IRQL; the caller keeps it short (Microsoft: at most 50 µs per call).
        unsafe { wdk::KeStallExecutionProcessor(microseconds) }
    }
}
