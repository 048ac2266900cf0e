//! The life the PnP manager gives a WDM function driver, on Windows-layout objects: DriverEntry, AddDevice with the
//! bus driver's PDO, START_DEVICE (when a device is there to start, with its memory and message interrupt
//! resources), REMOVE_DEVICE, DriverUnload, then the unload checks: no device left, then the NT model's own (pool
//! under pool tracking, adapters under DMA checking).

use std::ffi::c_void;

use vhca_ntapi::{NtKernel, DRIVER_VERIFIER_DETECTED_VIOLATION, PASSIVE_LEVEL};
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, DRIVER_OBJECT, IRP};
use windows_sys::Wdk::System::SystemServices::{
    IRP_MJ_PNP, IRP_MN_CANCEL_REMOVE_DEVICE, IRP_MN_CANCEL_STOP_DEVICE, IRP_MN_QUERY_REMOVE_DEVICE,
    IRP_MN_QUERY_STOP_DEVICE, IRP_MN_REMOVE_DEVICE, IRP_MN_START_DEVICE, IRP_MN_STOP_DEVICE, IRP_MN_SURPRISE_REMOVAL,
};
use windows_sys::Win32::Foundation::{NTSTATUS, UNICODE_STRING};

use crate::image_mapping::MappedImage;
use crate::io_manager::{top_of, AddDeviceFn, DriverEntryFn, IoManager, UnloadFn};
use crate::irp_dispatch;
use crate::kernel_context::{bugcheck, kernel};
use crate::pnp_sequence::{self, PnpStack, PnpStep};
use crate::start_resources::{model_messages, ListKind, ResourceList};
use vhca_ntapi::PDEVICE_OBJECT;
use vhca_ntmodel::{InterruptResources, VerifierFlags};

/// How the life ended short of a clean unload. Devices left behind are not a bugcheck on Windows (the I/O manager
/// does not unload a driver that still has device objects); here that is a failed step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LifeFailure {
    /// DriverEntry returned an error status: Windows unloads the image without calling anything else.
    DriverEntry(NTSTATUS),
    /// DriverEntry set no AddDevice routine: a PnP driver cannot get its devices.
    NoAddDevice,
    AddDevice(NTSTATUS),
    StartDevice(NTSTATUS),
    RemoveDevice(NTSTATUS),
    /// DriverUnload was reached with devices still alive.
    DevicesLeft(usize),
}

impl std::fmt::Display for LifeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LifeFailure::DriverEntry(s) => write!(f, "DriverEntry failed with status {:#010x}", *s as u32),
            LifeFailure::NoAddDevice => write!(f, "DriverEntry set no AddDevice routine"),
            LifeFailure::AddDevice(s) => write!(f, "AddDevice failed with status {:#010x}", *s as u32),
            LifeFailure::StartDevice(s) => write!(f, "IRP_MN_START_DEVICE failed with status {:#010x}", *s as u32),
            LifeFailure::RemoveDevice(s) => write!(f, "IRP_MN_REMOVE_DEVICE failed with status {:#010x}", *s as u32),
            LifeFailure::DevicesLeft(n) => write!(f, "{n} device object(s) left at DriverUnload"),
        }
    }
}

/// The step of the life running now, for the hang verdict.
pub static STEP: std::sync::Mutex<&'static str> = std::sync::Mutex::new("loading");

fn step(name: &'static str) {
    *crate::lock(&STEP) = name;
}

/// Runs the driver's life. `start` sends START_DEVICE (only where the bus driver has a device behind it).
pub fn run_life(image: &MappedImage, start: bool) -> Result<(), LifeFailure> {
    let k = kernel();
    let io = &k.io;
    let driver = io.new_driver_object(image.base(), image.size());
    let pdo = io.device_pdo();
    let registry_path = UNICODE_STRING::default();

    step("DriverEntry");
    let entry: DriverEntryFn = {
        // SAFETY: the image's entry point, checked to lie in its code section; the Windows x64 convention.
        unsafe { std::mem::transmute::<usize, DriverEntryFn>(image.at(image.image.entry_rva)) }
    };
    // SAFETY: PASSIVE_LEVEL, a fresh driver object and its registry path, as the I/O manager calls DriverEntry.
    let status = unsafe { entry(driver, &registry_path as *const UNICODE_STRING as *const c_void) };
    back_at_passive("DriverEntry");
    if status < 0 {
        return Err(LifeFailure::DriverEntry(status));
    }
    image.discard_init_sections();

    step("AddDevice");
    // SAFETY: the driver extension the I/O manager made; DriverEntry filled in AddDevice.
    let add_device = unsafe { (*(*driver).DriverExtension).AddDevice };
    let Some(add_device) = add_device else {
        unload(driver);
        return Err(LifeFailure::NoAddDevice);
    };
    let status = call_add_device(add_device as usize, driver, pdo);
    if status < 0 {
        unload(driver);
        return Err(LifeFailure::AddDevice(status));
    }

    if start {
        step("IRP_MN_START_DEVICE");
        let status = start_device(io, pdo);
        if status < 0 {
            // Windows sends REMOVE_DEVICE to a stack whose start failed; the driver frees there.
            pnp_irp(io, pdo, IRP_MN_REMOVE_DEVICE, None);
            unload(driver);
            return Err(LifeFailure::StartDevice(status));
        }
        *crate::lock(&LIVE) =
            Some(Live { driver: driver as usize, pdo: pdo as usize, add_device: add_device as usize });
        crate::power_life::run_planned(io, pdo);
        crate::user_process::run_planned(pdo);
        let outcome = pnp_sequence::run(
            pnp_sequence::planned(),
            &mut LiveStack { io, driver, pdo, add_device: add_device as usize, expected_at_bus: None },
        );
        let stack_gone = outcome.stack_gone;
        pnp_sequence::record(outcome);
        if stack_gone {
            *crate::lock(&LIVE) = None;
            // The sequence's REMOVE was the last: Windows sends no second one to a stack that is gone.
            return finish(io, driver, pdo);
        }
    }

    *crate::lock(&LIVE) = None;
    step("IRP_MN_REMOVE_DEVICE");
    let status = pnp_irp(io, pdo, IRP_MN_REMOVE_DEVICE, None);
    if status < 0 {
        return Err(LifeFailure::RemoveDevice(status));
    }
    finish(io, driver, pdo)
}

/// The started stack's parts, for a rebalance a user program sends while the life waits in it (`rebalance_now`).
/// Addresses: the objects live as long as the life, which clears this before its last REMOVE.
struct Live {
    driver: usize,
    pdo: usize,
    add_device: usize,
}

static LIVE: std::sync::Mutex<Option<Live>> = std::sync::Mutex::new(None);

/// One rebalance now (QUERY_STOP, then STOP and START, or CANCEL_STOP if refused), from a user process whose
/// requests are live (the seed's rebalance-during-traffic), at PASSIVE_LEVEL in its thread, as the PnP manager
/// rebalances whatever programs are doing. Ok(true): stopped and started again; Ok(false): the driver refused the
/// query; Err: a rule broken or a step failed.
pub fn rebalance_now() -> Result<bool, String> {
    let outcome = with_live_stack(pnp_sequence::rebalance_in_traffic)?;
    match outcome.failure {
        Some(why) => Err(why),
        None => Ok(outcome.refused == 0),
    }
}

/// A real hot-unplug now, from a user process whose requests are live (the seed's surprise-removal-during-traffic):
/// waits for the bus driver's removal notice, then IRP_MN_SURPRISE_REMOVAL, in the process's thread at
/// PASSIVE_LEVEL; REMOVE follows after the process (`hot-unplug-during-traffic`). Err: no unplug, or the IRP failed.
pub fn surprise_removal_now() -> Result<(), String> {
    match with_live_stack(pnp_sequence::surprise_in_traffic)?.failure {
        Some(why) => Err(why),
        None => Ok(()),
    }
}

fn with_live_stack(
    f: impl FnOnce(&mut dyn PnpStack) -> pnp_sequence::SequenceOutcome,
) -> Result<pnp_sequence::SequenceOutcome, String> {
    let parts = crate::lock(&LIVE).as_ref().map(|l| (l.driver, l.pdo, l.add_device));
    let (driver, pdo, add_device) = parts.ok_or("no started stack")?;
    let mut stack = LiveStack {
        io: &kernel().io,
        driver: driver as *mut DRIVER_OBJECT,
        pdo: pdo as *mut DEVICE_OBJECT,
        add_device,
        expected_at_bus: None,
    };
    Ok(f(&mut stack))
}

/// After the last REMOVE_DEVICE: no device of the driver may be left, then DriverUnload and the PDO goes.
fn finish(io: &IoManager, driver: *mut DRIVER_OBJECT, pdo: *mut DEVICE_OBJECT) -> Result<(), LifeFailure> {
    // Only the PDO is left on the bus driver's side; the driver's own devices must be gone.
    let left = io.devices_of(driver);
    if left > 0 {
        return Err(LifeFailure::DevicesLeft(left));
    }
    unload(driver);
    io.delete_device(pdo);
    Ok(())
}

/// The driver's AddDevice, with its driver object and the PDO, at PASSIVE_LEVEL.
fn call_add_device(add_device: usize, driver: *mut DRIVER_OBJECT, pdo: *mut DEVICE_OBJECT) -> NTSTATUS {
    // SAFETY: the routine DriverEntry set in the driver extension, called as the PnP manager calls it.
    let status = unsafe { std::mem::transmute::<usize, AddDeviceFn>(add_device)(driver, pdo) };
    back_at_passive("AddDevice");
    status
}

/// START_DEVICE with the device's resources, as the PnP manager assigns them (again, after a STOP or a disable).
fn start_device(io: &IoManager, pdo: *mut DEVICE_OBJECT) -> NTSTATUS {
    let k = kernel();
    let ranges = io.bus().memory_resources();
    // The PnP manager's part: the messages the platform enabled are the device's, in the model (which
    // IoConnectInterruptEx connects) and in both lists; none (a polling run) gives no interrupt descriptor.
    let count = io.bus().message_interrupts();
    if count > 0 {
        k.model.assign_interrupts(PDEVICE_OBJECT(pdo as u64), InterruptResources::Messages(count));
    }
    let messages = model_messages(&k.model, count);
    let raw = ResourceList::new(&ranges, &messages, ListKind::Raw);
    let translated = ResourceList::new(&ranges, &messages, ListKind::Translated);
    pnp_irp(io, pdo, IRP_MN_START_DEVICE, Some((&raw, &translated)))
}

/// The real stack for a PnP sequence (pnp_sequence.rs): each step an IRP at the top of the PDO's stack, or the
/// driver's AddDevice.
struct LiveStack<'a> {
    io: &'a IoManager,
    driver: *mut DRIVER_OBJECT,
    pdo: *mut DEVICE_OBJECT,
    /// The AddDevice routine DriverEntry set.
    add_device: usize,
    /// The minor code the last step's IRP had (None: AddDevice), which the bus driver must have seen if it succeeded.
    expected_at_bus: Option<u8>,
}

impl PnpStack for LiveStack<'_> {
    fn send(&mut self, s: PnpStep) -> NTSTATUS {
        step(s.name());
        self.io.take_pnp_at_bus();
        let minor = match s {
            PnpStep::AddDevice => {
                self.expected_at_bus = None;
                return call_add_device(self.add_device, self.driver, self.pdo);
            }
            PnpStep::Start => IRP_MN_START_DEVICE,
            PnpStep::QueryStop => IRP_MN_QUERY_STOP_DEVICE,
            PnpStep::CancelStop => IRP_MN_CANCEL_STOP_DEVICE,
            PnpStep::Stop => IRP_MN_STOP_DEVICE,
            PnpStep::QueryRemove => IRP_MN_QUERY_REMOVE_DEVICE,
            PnpStep::CancelRemove => IRP_MN_CANCEL_REMOVE_DEVICE,
            PnpStep::Remove => IRP_MN_REMOVE_DEVICE,
            PnpStep::SurpriseRemoval => IRP_MN_SURPRISE_REMOVAL,
        };
        self.expected_at_bus = Some(minor as u8);
        if s == PnpStep::Start {
            return start_device(self.io, self.pdo);
        }
        pnp_irp(self.io, self.pdo, minor, None)
    }

    fn devices_left(&self) -> usize {
        self.io.devices_of(self.driver)
    }

    fn reached_bus(&mut self) -> bool {
        let seen = self.io.take_pnp_at_bus();
        self.expected_at_bus.is_none_or(|minor| seen.contains(&minor))
    }
}

/// A PnP IRP from the PnP manager to the top of the PDO's stack, as Windows sends it: status preset to
/// STATUS_NOT_SUPPORTED, the IRP back with its final status.
fn pnp_irp(
    io: &IoManager,
    pdo: *mut DEVICE_OBJECT,
    minor: u32,
    resources: Option<(&ResourceList, &ResourceList)>,
) -> NTSTATUS {
    // SAFETY: the live stack above the PDO.
    let top = unsafe { top_of(pdo) };
    // SAFETY: a live device.
    let irp: *mut IRP = io.allocate_irp(unsafe { (*top).StackSize });
    assert!(!irp.is_null(), "out of memory for a PnP IRP");
    // SAFETY: a fresh IRP; its next location is the top driver's.
    let status = unsafe {
        let stack = IoManager::next_stack(irp);
        (*stack).MajorFunction = IRP_MJ_PNP as u8;
        (*stack).MinorFunction = minor as u8;
        if let Some((raw, translated)) = resources {
            (*stack).Parameters.StartDevice.AllocatedResources = raw.as_ptr();
            (*stack).Parameters.StartDevice.AllocatedResourcesTranslated = translated.as_ptr();
        }
        irp_dispatch::call_driver(io, top, irp);
        (*irp).IoStatus.Anonymous.Status
    };
    back_at_passive("a PnP IRP");
    io.free_irp(irp);
    status
}

/// DriverUnload, once no work item routine of the driver is queued or running, then the verifier's unload
/// checks. Public for the loader's tests, which unload a fake driver object.
pub fn unload(driver: *mut DRIVER_OBJECT) {
    step("DriverUnload");
    let k = kernel();
    // A work item's routine still running holds its device object, and so the driver: Windows calls DriverUnload
    // only after it returned (IoQueueWorkItem's reference). vhca.sys's routine frees its own context after its
    // last kernel call, so an unload before that found its heap in use (0xC4/0x60 under pool tracking).
    k.model.wait_for_work_items();
    // SAFETY: the driver object DriverEntry filled in.
    if let Some(f) = unsafe { (*driver).DriverUnload } {
        // SAFETY: the driver's unload routine, at PASSIVE_LEVEL, every device of its gone.
        unsafe { std::mem::transmute::<usize, UnloadFn>(f as usize)(driver) };
        back_at_passive("DriverUnload");
    }
    // The model's unload checks: pool left under pool tracking (0xC4/0x60), adapters under DMA checking.
    step("unload checks");
    k.model.unload_driver();
}

/// A driver routine returns at PASSIVE_LEVEL, as it was called; anything else is the verifier's IRQL check
/// (0xC4 with the IRQL it returned at) when IRQL checking is on, and is put right otherwise as Windows' I/O
/// manager does not.
fn back_at_passive(routine: &str) {
    let k = kernel();
    let irql = k.model.KeGetCurrentIrql();
    if irql != PASSIVE_LEVEL {
        println!("VHCA-LOADER: {routine} returned at IRQL {irql}");
        if k.model.verifier().contains(VerifierFlags::IRQL_CHECKING) {
            // 0xC4/0x3A... Windows has no one subcode for every routine; 0x0 with the IRQLs is the model's choice.
            bugcheck(DRIVER_VERIFIER_DETECTED_VIOLATION, 0x0, irql as u64, PASSIVE_LEVEL as u64, 0);
        }
    }
}
