//! The interrupt routines a driver binary calls, called here as the binary calls them (the bound addresses, the
//! Windows x64 convention, wdm.h's IO_CONNECT_INTERRUPT_PARAMETERS and IO_INTERRUPT_MESSAGE_INFO), with fake driver
//! routines as `extern "win64"` functions, over the NT model with IRQL checking: the ISR runs on the platform's
//! delivery thread at the DIRQL START_DEVICE's lists name, its DPC at DISPATCH_LEVEL. One kernel per process.

mod common;

use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use common::routine;
use common::shared_kernel::{irql, resident, take_turn};
use vhca_loader::kernel_context::kernel;
use vhca_loader::start_resources::{model_messages, ListKind, ResourceList};
use vhca_ntapi::PDEVICE_OBJECT;
use vhca_ntmodel::{InterruptResources, DEVICE_DIRQL};
use windows_sys::Wdk::Foundation::KDPC;
use windows_sys::Wdk::System::SystemServices::{
    IO_CONNECT_INTERRUPT_PARAMETERS, IO_DISCONNECT_INTERRUPT_PARAMETERS, IO_INTERRUPT_MESSAGE_INFO,
    IO_INTERRUPT_MESSAGE_INFO_ENTRY,
};
use windows_sys::Win32::Foundation::NTSTATUS;

const PDO: u64 = 0xFFFF_C000_0000_2000;
const LINE_PDO: u64 = 0xFFFF_C000_0000_3000;
const SERVICE_CONTEXT: usize = 0x5E41_C000;

/// The driver's KDPC, in its own (resident) memory.
fn isr_dpc() -> *mut KDPC {
    static DPC: OnceLock<usize> = OnceLock::new();
    *DPC.get_or_init(|| resident::<KDPC>() as usize) as *mut KDPC
}

/// (IRQL, interrupt object, ServiceContext, MessageID, thread) per ISR call.
type IsrCall = (u8, usize, usize, u32, std::thread::ThreadId);
static ISR_CALLS: Mutex<Vec<IsrCall>> = Mutex::new(Vec::new());
/// (IRQL, KDPC, DeferredContext, SystemArgument1) per DPC call.
static DPC_CALLS: Mutex<Vec<(u8, usize, usize, usize)>> = Mutex::new(Vec::new());
static LINE_CALLS: Mutex<Vec<(u8, usize)>> = Mutex::new(Vec::new());

/// KMESSAGE_SERVICE_ROUTINE: notes what it ran with, queues its DPC with the MessageID, claims the interrupt.
unsafe extern "win64" fn message_isr(interrupt: *mut c_void, context: *mut c_void, message_id: u32) -> u8 {
    let call = (irql(), interrupt as usize, context as usize, message_id, std::thread::current().id());
    ISR_CALLS.lock().unwrap().push(call);
    let insert: unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void) -> u8 = routine("KeInsertQueueDpc");
    // SAFETY: the thunk, on a KDPC KeInitializeDpc initialized; any IRQL, DIRQL included.
    unsafe { insert(isr_dpc(), message_id as usize as *mut c_void, std::ptr::null_mut()) };
    1
}

unsafe extern "win64" fn deferred(dpc: *mut KDPC, context: *mut c_void, argument1: *mut c_void, _a2: *mut c_void) {
    DPC_CALLS.lock().unwrap().push((irql(), dpc as usize, context as usize, argument1 as usize));
}

unsafe extern "win64" fn line_isr(interrupt: *mut c_void, _context: *mut c_void) -> u8 {
    LINE_CALLS.lock().unwrap().push((irql(), interrupt as usize));
    1
}

unsafe extern "win64" fn synchronized(context: *mut c_void) -> u8 {
    // SAFETY: the test's u8 the context points at, for the length of KeSynchronizeExecution.
    unsafe { *(context as *mut u8) = irql() };
    1
}

/// A routine as windows-sys's slot type holds it (its metadata drops the parameters).
fn slot<F: Copy>(f: F) -> Option<unsafe extern "system" fn() -> bool> {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<usize>());
    // SAFETY: one function pointer for another of the same size; the loader calls it with F's signature.
    Some(unsafe { std::mem::transmute_copy::<F, unsafe extern "system" fn() -> bool>(&f) })
}

type Connect = unsafe extern "win64" fn(*mut IO_CONNECT_INTERRUPT_PARAMETERS) -> NTSTATUS;
type Disconnect = unsafe extern "win64" fn(*mut IO_DISCONNECT_INTERRUPT_PARAMETERS);

/// IoConnectInterruptEx message-based for `pdo`, as vhca.sys calls it: (status, Version on return, context).
fn connect(pdo: u64, with_fallback: bool) -> (NTSTATUS, u32, *mut c_void) {
    let mut context: *mut c_void = std::ptr::null_mut();
    let mut p = IO_CONNECT_INTERRUPT_PARAMETERS { Version: 3, ..Default::default() };
    // SAFETY: writing the MessageBased member of a zeroed union.
    unsafe {
        let m = &mut p.Anonymous.MessageBased;
        m.PhysicalDeviceObject = pdo as *mut _;
        m.ConnectionContext.Generic = &mut context;
        m.MessageServiceRoutine = slot(message_isr as unsafe extern "win64" fn(*mut c_void, *mut c_void, u32) -> u8);
        m.ServiceContext = SERVICE_CONTEXT as *mut c_void;
        m.SynchronizeIrql = 0;
        if with_fallback {
            m.FallBackServiceRoutine = slot(line_isr as unsafe extern "win64" fn(*mut c_void, *mut c_void) -> u8);
        }
    }
    let f: Connect = routine("IoConnectInterruptEx");
    // SAFETY: the thunk at PASSIVE_LEVEL with live parameters.
    let status = unsafe { f(&mut p) };
    (status, p.Version, context)
}

fn disconnect(version: u32, context: *mut c_void) {
    let mut p = IO_DISCONNECT_INTERRUPT_PARAMETERS { Version: version, ..Default::default() };
    p.ConnectionContext.Generic = context;
    let f: Disconnect = routine("IoDisconnectInterruptEx");
    // SAFETY: the thunk at PASSIVE_LEVEL with what IoConnectInterruptEx returned.
    unsafe { f(&mut p) }
}

/// The platform's delivery thread: message `id` of `pdo`, as the guest's interrupt delivery thread hands it.
fn deliver(pdo: u64, id: u32) -> bool {
    let model = kernel().model.clone();
    std::thread::spawn(move || model.deliver(PDEVICE_OBJECT(pdo), id)).join().unwrap()
}

#[test]
fn a_message_isr_runs_at_the_dirql_start_device_named_and_its_dpc_at_dispatch() {
    let (k, _turn) = take_turn();
    let init_dpc: unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void) = routine("KeInitializeDpc");
    type Deferred = unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void, *mut c_void);
    // SAFETY: the thunk with the driver's KDPC and routine; any IRQL.
    unsafe { init_dpc(isr_dpc(), deferred as Deferred as *mut c_void, 0xD0C as *mut c_void) };

    // Nothing assigned: no interrupt to connect, as on a machine without MSI.
    assert_eq!(connect(0xFFFF_C000_0000_9000, false).0, 0xC000_0225u32 as i32, "STATUS_NOT_FOUND");

    k.model.assign_interrupts(PDEVICE_OBJECT(PDO), InterruptResources::Messages(3));
    let (status, version, context) = connect(PDO, true);
    assert_eq!((status, version), (0, 3), "connected message-based (CONNECT_MESSAGE_BASED written back)");
    // SAFETY: the IO_INTERRUPT_MESSAGE_INFO the loader wrote for the driver, MessageCount entries long.
    let entries: Vec<IO_INTERRUPT_MESSAGE_INFO_ENTRY> = unsafe {
        let table = context as *const IO_INTERRUPT_MESSAGE_INFO;
        assert_eq!(((*table).UnifiedIrql, (*table).MessageCount), (DEVICE_DIRQL, 3));
        let first = std::ptr::addr_of!((*table).MessageInfo) as *const IO_INTERRUPT_MESSAGE_INFO_ENTRY;
        (0..3).map(|i| first.add(i).read()).collect()
    };
    // What START_DEVICE's translated list says of each message is what the connection gives it.
    for (entry, listed) in entries.iter().zip(model_messages(&k.model, 3)) {
        assert_eq!(
            (entry.Irql, entry.Vector, entry.TargetProcessorSet as u64),
            (listed.level, listed.vector, listed.affinity)
        );
        assert!(entry.InterruptObject as usize != 0);
    }

    assert!(deliver(PDO, 1), "the ISR claimed message 1");
    let isr = ISR_CALLS.lock().unwrap().clone();
    assert_eq!(isr.len(), 1);
    let (isr_irql, interrupt, service_context, message_id, thread) = isr[0];
    assert_eq!((isr_irql, service_context, message_id), (DEVICE_DIRQL, SERVICE_CONTEXT, 1));
    assert_eq!(interrupt, entries[1].InterruptObject as usize, "the message's own KINTERRUPT");
    assert_ne!(thread, std::thread::current().id(), "on the delivery thread");
    assert_eq!(DPC_CALLS.lock().unwrap().clone(), vec![(2, isr_dpc() as usize, 0xD0C, 1)], "its DPC, at DISPATCH");

    // KeSynchronizeExecution and the interrupt spin lock: the connection's DIRQL, the caller's IRQL back after.
    let sync: unsafe extern "win64" fn(*mut c_void, *mut c_void, *mut c_void) -> u8 = routine("KeSynchronizeExecution");
    let acquire: unsafe extern "win64" fn(*mut c_void) -> u8 = routine("KeAcquireInterruptSpinLock");
    let release: unsafe extern "win64" fn(*mut c_void, u8) = routine("KeReleaseInterruptSpinLock");
    let mut seen = 0u8;
    type Sync = unsafe extern "win64" fn(*mut c_void) -> u8;
    let object = entries[0].InterruptObject as *mut c_void;
    // SAFETY: the thunks at PASSIVE_LEVEL, on the connection's interrupt object; `seen` outlives the call.
    unsafe {
        let routine = synchronized as Sync as *mut c_void;
        assert_eq!(sync(object, routine, (&mut seen as *mut u8).cast()), 1);
        assert_eq!((seen, irql()), (DEVICE_DIRQL, 0));
        let old = acquire(object);
        assert_eq!((old, irql()), (0, DEVICE_DIRQL));
        release(object, old);
    }
    assert_eq!(irql(), 0);

    disconnect(version, context);
    assert!(!deliver(PDO, 1), "no ISR after IoDisconnectInterruptEx");
    assert_eq!(ISR_CALLS.lock().unwrap().len(), 1);
    assert!(k.model.bugchecks().is_empty());
}

#[test]
fn a_device_with_only_a_line_gets_the_fallback_routine() {
    let (k, _turn) = take_turn();
    k.model.assign_interrupts(PDEVICE_OBJECT(LINE_PDO), InterruptResources::Line);
    let (status, version, context) = connect(LINE_PDO, true);
    assert_eq!((status, version), (0, 2), "CONNECT_LINE_BASED: the fallback was connected");
    assert!(!context.is_null(), "the context is the line's KINTERRUPT");
    assert!(deliver(LINE_PDO, 0));
    assert_eq!(LINE_CALLS.lock().unwrap().clone(), vec![(DEVICE_DIRQL, context as usize)]);
    disconnect(version, context);
    assert!(!deliver(LINE_PDO, 0));
}

#[test]
fn start_device_lists_read_back_through_vhca_sys_reader_as_the_messages_granted() {
    let _turn = take_turn();
    let bars = [(0xfea0_0000u64, 0x4000u32)];
    let (model, _) = vhca_ntmodel::NtModel::for_tests(Default::default());
    let messages = model_messages(&model, 5);
    let raw = ResourceList::new(&bars, &messages, ListKind::Raw);
    let translated = ResourceList::new(&bars, &messages, ListKind::Translated);
    let read = vhca_sys::interrupt_resources::interrupt_resources(raw.bytes(), translated.bytes());
    assert_eq!(read.messages(), 5, "one MSI-X descriptor per message, MessageCount 1 each");
    assert!(read.line().is_none());
    for (d, m) in read.descriptors.iter().zip(&messages) {
        assert!(d.message && d.latched);
        assert_eq!((d.level, d.vector, d.affinity, d.group), (u16::from(m.level), m.vector, m.affinity, 0));
    }
    let polling = ResourceList::new(&bars, &[], ListKind::Raw);
    assert!(vhca_sys::interrupt_resources::interrupt_resources(polling.bytes(), polling.bytes()).is_empty());
}
