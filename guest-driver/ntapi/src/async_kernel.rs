//! The asynchronous half of the NT interface: interrupts, DPCs, work items, timers, events and waits, with Windows'
//! names, types, calling conventions and IRQL rules (each method's doc gives the IRQL Windows documents).

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec::Vec;

use crate::kernel::NtKernel;
use crate::types::*;

opaque_pointer!(
    /// A KINTERRUPT: one per message of a message-based connection, or the one line-based interrupt.
    PKINTERRUPT,
    /// A KDPC.
    PKDPC,
    /// A KTIMER.
    PKTIMER,
    /// A KEVENT.
    PKEVENT,
    /// An IO_WORKITEM from IoAllocateWorkItem.
    PIO_WORKITEM,
);

pub const STATUS_TIMEOUT: NTSTATUS = NTSTATUS(0x0000_0102);
pub const STATUS_NOT_FOUND: NTSTATUS = NTSTATUS(0xC000_0225_u32 as i32);

// ---- Interrupts ----

/// IO_CONNECT_INTERRUPT_PARAMETERS.Version values (wdm.h).
pub const CONNECT_FULLY_SPECIFIED: u32 = 0x1;
pub const CONNECT_LINE_BASED: u32 = 0x2;
pub const CONNECT_MESSAGE_BASED: u32 = 0x3;

/// The driver's InterruptMessageService routine (KMESSAGE_SERVICE_ROUTINE) with its ServiceContext captured: called
/// with the message's interrupt object and MessageID at the connection's IRQL, the interrupt spin lock held;
/// returns whether its device interrupted (it may be called when it did not).
pub type PKMESSAGE_SERVICE_ROUTINE = Arc<dyn Fn(PKINTERRUPT, u32) -> bool + Send + Sync>;

/// The driver's InterruptService routine (KSERVICE_ROUTINE) with its ServiceContext captured: the line-based
/// fallback, called like the message routine without a MessageID.
pub type PKSERVICE_ROUTINE = Arc<dyn Fn(PKINTERRUPT) -> bool + Send + Sync>;

/// IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS, the MessageBased member of IO_CONNECT_INTERRUPT_PARAMETERS
/// (Version = CONNECT_MESSAGE_BASED). ServiceContext lives in the routines' closures; ConnectionContext is what
/// IoConnectInterruptEx returns.
#[derive(Clone)]
pub struct IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS {
    pub PhysicalDeviceObject: PDEVICE_OBJECT,
    pub MessageServiceRoutine: PKMESSAGE_SERVICE_ROUTINE,
    /// NULL: the system allocates the interrupt spin lock.
    pub SpinLock: PKSPIN_LOCK,
    /// Used only when above the highest DIRQL of the messages; drivers almost always pass PASSIVE_LEVEL.
    pub SynchronizeIrql: KIRQL,
    pub FloatingSave: bool,
    /// Connected instead when the device has a line-based interrupt and no messages; None: no fallback.
    pub FallBackServiceRoutine: Option<PKSERVICE_ROUTINE>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KINTERRUPT_MODE {
    LevelSensitive = 0,
    Latched = 1,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KINTERRUPT_POLARITY {
    InterruptPolarityUnknown = 0,
    InterruptActiveHigh = 1,
    InterruptActiveLow = 2,
}

/// IO_INTERRUPT_MESSAGE_INFO_ENTRY: one message of a message-based connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IO_INTERRUPT_MESSAGE_INFO_ENTRY {
    pub MessageAddress: PHYSICAL_ADDRESS,
    /// KAFFINITY: the processors the message is delivered to.
    pub TargetProcessorSet: u64,
    pub InterruptObject: PKINTERRUPT,
    pub MessageData: u32,
    pub Vector: u32,
    /// The message's DIRQL.
    pub Irql: KIRQL,
    pub Mode: KINTERRUPT_MODE,
    pub Polarity: KINTERRUPT_POLARITY,
}

/// IO_INTERRUPT_MESSAGE_INFO. Windows' MessageCount is `MessageInfo.len()`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IO_INTERRUPT_MESSAGE_INFO {
    /// The IRQL the message routine runs at and the interrupt spin lock is taken at, for every message.
    pub UnifiedIrql: KIRQL,
    pub MessageInfo: Vec<IO_INTERRUPT_MESSAGE_INFO_ENTRY>,
}

/// What IoConnectInterruptEx connected: its ConnectionContext, and by its variant the Version it sets on return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum INTERRUPT_CONNECTION {
    /// Version = CONNECT_MESSAGE_BASED.
    MessageBased(IO_INTERRUPT_MESSAGE_INFO),
    /// Version = CONNECT_LINE_BASED: the fallback routine was connected.
    LineBased(PKINTERRUPT),
}

impl INTERRUPT_CONNECTION {
    /// The Version IoConnectInterruptEx returns, and IoDisconnectInterruptEx takes.
    pub fn Version(&self) -> u32 {
        match self {
            INTERRUPT_CONNECTION::MessageBased(_) => CONNECT_MESSAGE_BASED,
            INTERRUPT_CONNECTION::LineBased(_) => CONNECT_LINE_BASED,
        }
    }

    /// The interrupt object KeSynchronizeExecution and the interrupt spin lock routines take: message 0's for a
    /// message-based connection (all its messages share one spin lock), else the line's.
    pub fn InterruptObject(&self) -> PKINTERRUPT {
        match self {
            INTERRUPT_CONNECTION::MessageBased(info) => {
                info.MessageInfo.first().map(|m| m.InterruptObject).unwrap_or(PKINTERRUPT::NULL)
            }
            INTERRUPT_CONNECTION::LineBased(interrupt) => *interrupt,
        }
    }
}

// ---- DPCs ----

/// The driver's DeferredRoutine (KDEFERRED_ROUTINE, also CustomDpc and CustomTimerDpc) with its DeferredContext
/// captured: called at DISPATCH_LEVEL with the DPC and the two system arguments. It may run again before an earlier
/// call returns (a periodic timer's DPC on two processors), hence `Fn + Sync`.
pub type PKDEFERRED_ROUTINE = Arc<dyn Fn(PKDPC, PVOID, PVOID) + Send + Sync>;

/// The driver's DpcForIsr (IO_DPC_ROUTINE): called at DISPATCH_LEVEL with the DPC, the device object and the Context
/// IoRequestDpc was given. Windows also passes the Irp; the driver core queues no IRPs, so it is left out.
pub type PIO_DPC_ROUTINE = Arc<dyn Fn(PKDPC, PDEVICE_OBJECT, PVOID) + Send + Sync>;

// ---- Processors ----

/// PROCESSOR_NUMBER: a processor as a group and a number within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(C)]
pub struct PROCESSOR_NUMBER {
    pub Group: u16,
    pub Number: u8,
    pub Reserved: u8,
}

/// KAFFINITY: a set of processors of one group, a bit each.
pub type KAFFINITY = u64;
/// CCHAR: KeSetTargetProcessorDpc's processor number.
pub type CCHAR = i8;
/// KeQueryActiveProcessorCountEx's "every group" (winnt.h, ntdef.h).
pub const ALL_PROCESSOR_GROUPS: u16 = 0xFFFF;

// ---- Work items ----

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WORK_QUEUE_TYPE {
    CriticalWorkQueue = 0,
    DelayedWorkQueue = 1,
    HyperCriticalWorkQueue = 2,
}

/// The driver's WorkItem routine (IO_WORKITEM_ROUTINE) with its Context captured: called once, at PASSIVE_LEVEL in
/// a system worker thread, with the device object the item was allocated for. The item is dequeued before the call,
/// so the routine may free it.
pub type PIO_WORKITEM_ROUTINE = Box<dyn FnOnce(PDEVICE_OBJECT) + Send>;

// ---- Timers, events and waits ----

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TIMER_TYPE {
    NotificationTimer = 0,
    SynchronizationTimer = 1,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EVENT_TYPE {
    NotificationEvent = 0,
    SynchronizationEvent = 1,
}

/// KPRIORITY: the priority boost KeSetEvent gives a waiter it releases.
pub type KPRIORITY = i32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KWAIT_REASON {
    Executive = 0,
    UserRequest = 6,
}

/// The dispatcher object KeWaitForSingleObject waits on (Windows' PVOID Object, typed). KMUTEX waits stay
/// `NtKernel::KeWaitForMutexObject`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DISPATCHER_OBJECT {
    Event(PKEVENT),
    Timer(PKTIMER),
}

impl DISPATCHER_OBJECT {
    /// The object's address, as bugcheck parameters name it.
    pub fn address(self) -> u64 {
        match self {
            DISPATCHER_OBJECT::Event(e) => e.0,
            DISPATCHER_OBJECT::Timer(t) => t.0,
        }
    }
}

impl From<PKEVENT> for DISPATCHER_OBJECT {
    fn from(e: PKEVENT) -> DISPATCHER_OBJECT {
        DISPATCHER_OBJECT::Event(e)
    }
}

impl From<PKTIMER> for DISPATCHER_OBJECT {
    fn from(t: PKTIMER) -> DISPATCHER_OBJECT {
        DISPATCHER_OBJECT::Timer(t)
    }
}

/// The kernel's asynchronous services, one method per Windows routine. Where Windows passes caller-allocated
/// objects (KDPC, KTIMER, KEVENT) the implementation allocates them, as for `NtKernel`'s locks.
pub trait NtAsyncKernel: NtKernel {
    // ---- Interrupts ----

    /// IRQL = PASSIVE_LEVEL. CONNECT_MESSAGE_BASED: connects the message routine to every message the device was
    /// given, or the fallback routine to its line-based interrupt. STATUS_INVALID_PARAMETER for a NULL device
    /// object; STATUS_NOT_FOUND when the device has no interrupts.
    fn IoConnectInterruptEx(
        &self,
        parameters: IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS,
    ) -> Result<INTERRUPT_CONNECTION, NTSTATUS>;
    /// IRQL = PASSIVE_LEVEL. Takes what IoConnectInterruptEx returned; the driver disables its device's
    /// interrupts first.
    fn IoDisconnectInterruptEx(&self, connection: &INTERRUPT_CONNECTION);
    /// IRQL <= the connection's synchronize IRQL. Raises to it, takes the interrupt spin lock and runs `routine`
    /// (KSYNCHRONIZE_ROUTINE, its context captured), then gives both back; returns what the routine returned.
    fn KeSynchronizeExecution(&self, interrupt: PKINTERRUPT, routine: &mut dyn FnMut() -> bool) -> bool;
    /// IRQL <= the connection's DIRQL. Raises to it and takes the interrupt spin lock; returns the old IRQL.
    fn KeAcquireInterruptSpinLock(&self, interrupt: PKINTERRUPT) -> KIRQL;
    /// IRQL = the connection's DIRQL.
    fn KeReleaseInterruptSpinLock(&self, interrupt: PKINTERRUPT, old_irql: KIRQL);

    // ---- DPCs ----

    /// Any IRQL.
    fn KeInitializeDpc(&self, routine: PKDEFERRED_ROUTINE) -> PKDPC;
    /// Any IRQL. FALSE when the DPC is already queued (a DPC is queued at most once at a time). The DPC runs at
    /// DISPATCH_LEVEL on the current processor once its IRQL is below DISPATCH_LEVEL.
    fn KeInsertQueueDpc(&self, dpc: PKDPC, system_argument1: PVOID, system_argument2: PVOID) -> bool;
    /// Any IRQL. TRUE when the DPC was queued and is now removed before it ran.
    fn KeRemoveQueueDpc(&self, dpc: PKDPC) -> bool;
    /// IRQL = PASSIVE_LEVEL. Returns when every DPC queued on every processor has run.
    fn KeFlushQueuedDpcs(&self);
    /// Any IRQL. Registers the device's DpcForIsr (from AddDevice).
    fn IoInitializeDpcRequest(&self, device_object: PDEVICE_OBJECT, routine: PIO_DPC_ROUTINE);
    /// IRQL = DIRQL (from the ISR). Queues the device's DpcForIsr with `context`.
    fn IoRequestDpc(&self, device_object: PDEVICE_OBJECT, context: PVOID);

    // ---- Spin locks a DPC takes ----

    /// IRQL >= DISPATCH_LEVEL. Takes the lock without changing the IRQL.
    fn KeAcquireSpinLockAtDpcLevel(&self, lock: PKSPIN_LOCK);
    /// IRQL >= DISPATCH_LEVEL.
    fn KeReleaseSpinLockFromDpcLevel(&self, lock: PKSPIN_LOCK);

    // ---- Work items ----

    /// IRQL <= DISPATCH_LEVEL. NULL on failure.
    fn IoAllocateWorkItem(&self, device_object: PDEVICE_OBJECT) -> PIO_WORKITEM;
    /// IRQL <= DISPATCH_LEVEL. The routine runs once, at PASSIVE_LEVEL in a system worker thread.
    fn IoQueueWorkItem(&self, item: PIO_WORKITEM, routine: PIO_WORKITEM_ROUTINE, queue_type: WORK_QUEUE_TYPE);
    /// IRQL <= DISPATCH_LEVEL. Only an item that is not queued.
    fn IoFreeWorkItem(&self, item: PIO_WORKITEM);

    // ---- Timers ----

    /// IRQL <= DISPATCH_LEVEL. A notification timer.
    fn KeInitializeTimer(&self) -> PKTIMER {
        self.KeInitializeTimerEx(TIMER_TYPE::NotificationTimer)
    }
    /// IRQL <= DISPATCH_LEVEL.
    fn KeInitializeTimerEx(&self, timer_type: TIMER_TYPE) -> PKTIMER;
    /// IRQL <= DISPATCH_LEVEL. KeSetTimerEx without a period.
    fn KeSetTimer(&self, timer: PKTIMER, due_time: i64, dpc: PKDPC) -> bool {
        self.KeSetTimerEx(timer, due_time, 0, dpc)
    }
    /// IRQL <= DISPATCH_LEVEL. `due_time` in 100 ns units, negative = relative to now; `period_ms` 0 = one shot
    /// (Windows' LONG Period "must be greater than or equal to zero": unsigned here). On expiry the timer is
    /// signaled and `dpc` (NULL: none) queued. TRUE when the timer was already set (it is set anew).
    fn KeSetTimerEx(&self, timer: PKTIMER, due_time: i64, period_ms: u32, dpc: PKDPC) -> bool;
    /// IRQL <= DISPATCH_LEVEL. TRUE when the timer was set; a DPC it already queued still runs.
    fn KeCancelTimer(&self, timer: PKTIMER) -> bool;

    // ---- Events and waits ----

    /// Any IRQL.
    fn KeInitializeEvent(&self, event_type: EVENT_TYPE, state: bool) -> PKEVENT;
    /// IRQL <= DISPATCH_LEVEL (Wait = FALSE), <= APC_LEVEL (Wait = TRUE). Returns the previous state (nonzero:
    /// signaled).
    fn KeSetEvent(&self, event: PKEVENT, increment: KPRIORITY, wait: bool) -> i32;
    /// IRQL <= DISPATCH_LEVEL.
    fn KeClearEvent(&self, event: PKEVENT);
    /// IRQL <= DISPATCH_LEVEL with a zero timeout, else <= APC_LEVEL. `timeout` in 100 ns units, negative =
    /// relative, None = wait until signaled. STATUS_SUCCESS when the object was signaled, STATUS_TIMEOUT when the
    /// timeout passed first.
    fn KeWaitForSingleObject(
        &self,
        object: DISPATCHER_OBJECT,
        wait_reason: KWAIT_REASON,
        wait_mode: KPROCESSOR_MODE,
        alertable: bool,
        timeout: Option<i64>,
    ) -> NTSTATUS;

    // ---- The processor ----
    //
    // IRQLs as Microsoft's pages give them (learn.microsoft.com/windows-hardware/drivers/ddi/wdm/
    // nf-wdm-kegetcurrentprocessornumberex, nf-wdm-kequeryactiveprocessorcountex, nf-wdm-kequeryactiveprocessorcount,
    // nf-wdm-kesettargetprocessordpc, nf-wdm-kesettargetprocessordpcex): any level, all of them.

    /// Any IRQL.
    fn KeGetCurrentProcessorNumber(&self) -> u32;
    /// Any IRQL. The system-wide index of the caller's processor; with `number`, its group and number in the
    /// group too.
    fn KeGetCurrentProcessorNumberEx(&self, number: Option<&mut PROCESSOR_NUMBER>) -> u32;
    /// Any IRQL. Active processors in `group`, or in every group for ALL_PROCESSOR_GROUPS; 0 for a group the
    /// system does not have.
    fn KeQueryActiveProcessorCountEx(&self, group: u16) -> u32;
    /// Any IRQL. Active processors of group 0; with `active`, their set too.
    fn KeQueryActiveProcessorCount(&self, active: Option<&mut KAFFINITY>) -> u32;
    /// Any IRQL. The processor (group 0) `dpc` is queued on and runs on from its next KeInsertQueueDpc; a number
    /// at or past group 0's processor count leaves the target as it was.
    fn KeSetTargetProcessorDpc(&self, dpc: PKDPC, number: CCHAR);
    /// Any IRQL. As KeSetTargetProcessorDpc with a group; STATUS_INVALID_PARAMETER for a processor the system does
    /// not have.
    fn KeSetTargetProcessorDpcEx(&self, dpc: PKDPC, number: &PROCESSOR_NUMBER) -> NTSTATUS;
    /// Any IRQL. Busy-waits at least `microseconds` on the current processor (Microsoft: keep it under 50 µs).
    fn KeStallExecutionProcessor(&self, microseconds: u32);
}
