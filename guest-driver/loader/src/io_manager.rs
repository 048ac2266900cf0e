//! The I/O manager's side of a WDM driver's life, on windows-sys's Windows-layout objects: the DRIVER_OBJECT, the
//! bus driver's PDO, DEVICE_OBJECTs with their extension and stack, IRPs with their stack locations; moving IRPs
//! through them is `irp_dispatch`'s. Hand-written: no crate models Windows' I/O manager. Driver routines are called
//! as `extern "win64"` (windows-sys's `extern "system"` types mean the SysV ABI on Linux, so their pointers are
//! read raw and called through the types below).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Mutex;

use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, DRIVER_EXTENSION, DRIVER_OBJECT, IO_STACK_LOCATION, IRP};
use windows_sys::Wdk::Storage::FileSystem::{DO_DEVICE_INITIALIZING, DO_POWER_PAGABLE};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_INSUFFICIENT_RESOURCES, STATUS_NOT_SUPPORTED, STATUS_SUCCESS};

/// DriverEntry, AddDevice, a dispatch routine and DriverUnload as the image calls them.
pub type DriverEntryFn = unsafe extern "win64" fn(*mut DRIVER_OBJECT, *const c_void) -> NTSTATUS;
pub type AddDeviceFn = unsafe extern "win64" fn(*mut DRIVER_OBJECT, *mut DEVICE_OBJECT) -> NTSTATUS;
pub type DispatchFn = unsafe extern "win64" fn(*mut DEVICE_OBJECT, *mut IRP) -> NTSTATUS;
pub type UnloadFn = unsafe extern "win64" fn(*mut DRIVER_OBJECT);

/// wdm.h's object type codes (Type field), so a driver's ASSERTs on them hold.
const IO_TYPE_DRIVER: i16 = 4;
const IO_TYPE_DEVICE: i16 = 3;
const IO_TYPE_IRP: i16 = 6;

/// A zeroed heap block for an object the driver sees; freed by `free_object` with the same size.
fn alloc_object(bytes: usize) -> *mut u8 {
    let layout = Layout::from_size_align(bytes.max(1), 16).expect("object layout");
    // SAFETY: a non-zero size; a null result is handled by the caller (allocation failure).
    unsafe { alloc_zeroed(layout) }
}

/// # Safety
/// `p` came from `alloc_object(bytes)` and is freed once.
unsafe fn free_object(p: *mut u8, bytes: usize) {
    // SAFETY: the caller's contract.
    unsafe { dealloc(p, Layout::from_size_align(bytes.max(1), 16).expect("object layout")) }
}

/// The bus driver below the FDO: what the PCI driver answers for its PDO.
pub trait BusDriver: Send + Sync {
    /// IRP_MJ_PNP at the PDO: the status to complete it with. `stack` is the PDO's stack location.
    fn pnp(&self, stack: &IO_STACK_LOCATION) -> NTSTATUS;
    /// The device's memory BARs (start, length), for START_DEVICE's resource lists.
    fn memory_resources(&self) -> Vec<(u64, u32)> {
        Vec::new()
    }
    /// How many MSI-X messages the platform enabled for the device, for START_DEVICE's interrupt descriptors and
    /// the NT model's assignment: 0 (the default) gives no interrupt resources, as on a machine without MSI, and
    /// the driver polls.
    fn message_interrupts(&self) -> u32 {
        0
    }
    /// MmMapIoSpaceEx on one of the device's translated memory ranges: where the CPU reaches it, or None.
    fn map_io_space(&self, _physical: u64, _length: usize) -> Option<*mut u8> {
        None
    }
    /// MmUnmapIoSpace of a range `map_io_space` gave.
    fn unmap_io_space(&self, _base: *mut u8, _length: usize) {}
    /// A second mapping of the whole pages `base` (page-aligned, inside a range `map_io_space` gave) starts,
    /// `length` bytes: the same registers elsewhere, owned (and unmapped) by the caller, or None. The race watch
    /// steps the driver's trapped register accesses through it.
    fn alias_io_space(&self, _base: *mut u8, _length: usize) -> Option<*mut u8> {
        None
    }
}

/// The bus driver as the I/O manager holds it: every PnP minor code that reached it is noted, so the PnP manager can
/// tell whether a function driver that succeeded a PnP IRP passed it down (pnp_sequence.rs).
struct PnpWitness {
    inner: Box<dyn BusDriver>,
    seen: Mutex<Vec<u8>>,
}

// Every method is forwarded: one added to BusDriver with a default must be forwarded here too, or the witness would
// answer with the default instead of the real bus.
impl BusDriver for PnpWitness {
    fn pnp(&self, stack: &IO_STACK_LOCATION) -> NTSTATUS {
        crate::lock(&self.seen).push(stack.MinorFunction);
        self.inner.pnp(stack)
    }
    fn memory_resources(&self) -> Vec<(u64, u32)> {
        self.inner.memory_resources()
    }
    fn message_interrupts(&self) -> u32 {
        self.inner.message_interrupts()
    }
    fn map_io_space(&self, physical: u64, length: usize) -> Option<*mut u8> {
        self.inner.map_io_space(physical, length)
    }
    fn unmap_io_space(&self, base: *mut u8, length: usize) {
        self.inner.unmap_io_space(base, length)
    }
    fn alias_io_space(&self, base: *mut u8, length: usize) -> Option<*mut u8> {
        self.inner.alias_io_space(base, length)
    }
}

/// Devices and IRPs the I/O manager made, with their sizes, so each is freed exactly once.
#[derive(Default)]
struct Objects {
    devices: Vec<(usize, usize)>,
    irps: Vec<(usize, usize)>,
    /// IRPs freed most recently, oldest first, whose memory is kept (`free_irp`).
    freed_irps: std::collections::VecDeque<(usize, usize)>,
}

/// How many freed IRPs keep their memory. Windows frees an IRP into a lookaside list, so a driver that touches one
/// it no longer owns (a cancel routine and a completion path both completing it) reads an IRP that still looks
/// completed, and IofCompleteRequest says 0x44 instead of the machine corrupting its heap; the loader keeps the
/// last ones it freed the same way (their bytes as at the free), bounded.
const FREED_IRPS_KEPT: usize = 64;

pub struct IoManager {
    objects: Mutex<Objects>,
    bus: PnpWitness,
    /// The PDO's driver object: its MajorFunction table stays empty; IoCallDriver at the PDO goes to `bus`.
    bus_driver: *mut DRIVER_OBJECT,
    /// The device's PDO once made: what the platform names when it reports the device (an IOMMU fault).
    pdo: std::sync::atomic::AtomicUsize,
    /// Held while the PDO is made, so two first asks make one.
    enumeration: Mutex<()>,
    /// What I/O Verification tracks of the IRPs in flight.
    ledger: crate::io_verification::IrpLedger,
}

// SAFETY: the raw objects are the driver's shared kernel objects, as on Windows; the tables are under a mutex.
unsafe impl Send for IoManager {}
// SAFETY: as above.
unsafe impl Sync for IoManager {}

impl IoManager {
    pub fn new(bus: Box<dyn BusDriver>) -> IoManager {
        let bus_driver = alloc_object(size_of::<DRIVER_OBJECT>()) as *mut DRIVER_OBJECT;
        assert!(!bus_driver.is_null(), "out of memory for the bus driver object");
        // SAFETY: a fresh zeroed DRIVER_OBJECT.
        unsafe {
            (*bus_driver).Type = IO_TYPE_DRIVER;
            (*bus_driver).Size = size_of::<DRIVER_OBJECT>() as i16;
        }
        IoManager {
            objects: Mutex::new(Objects::default()),
            bus: PnpWitness { inner: bus, seen: Mutex::new(Vec::new()) },
            bus_driver,
            pdo: Default::default(),
            enumeration: Mutex::new(()),
            ledger: Default::default(),
        }
    }

    pub(crate) fn ledger(&self) -> &crate::io_verification::IrpLedger {
        &self.ledger
    }

    pub(crate) fn bus(&self) -> &dyn BusDriver {
        &self.bus
    }

    /// The PnP minor codes that reached the bus driver since the last call, oldest first.
    pub(crate) fn take_pnp_at_bus(&self) -> Vec<u8> {
        std::mem::take(&mut *crate::lock(&self.bus.seen))
    }

    /// Whether `driver` is the PDO's driver object: IRPs sent there go to the bus driver.
    pub(crate) fn is_bus_driver(&self, driver: *const DRIVER_OBJECT) -> bool {
        std::ptr::eq(driver, self.bus_driver)
    }

    /// The DRIVER_OBJECT DriverEntry receives, with its DRIVER_EXTENSION, for an image at `start`.
    pub(crate) fn new_driver_object(&self, start: usize, size: usize) -> *mut DRIVER_OBJECT {
        let driver = alloc_object(size_of::<DRIVER_OBJECT>()) as *mut DRIVER_OBJECT;
        let extension = alloc_object(size_of::<DRIVER_EXTENSION>()) as *mut DRIVER_EXTENSION;
        assert!(!driver.is_null() && !extension.is_null(), "out of memory for the driver object");
        // SAFETY: fresh zeroed objects, linked as the I/O manager links them.
        unsafe {
            (*driver).Type = IO_TYPE_DRIVER;
            (*driver).Size = size_of::<DRIVER_OBJECT>() as i16;
            (*driver).DriverStart = start as *mut c_void;
            (*driver).DriverSize = size as u32;
            (*driver).DriverExtension = extension;
            (*extension).DriverObject = driver;
        }
        driver
    }

    /// The PCI bus driver's PDO for the device, made on the first call (the bus enumerated its device): the
    /// platform names it when it delivers the device's interrupts, so it may ask before the PnP life starts.
    pub fn device_pdo(&self) -> *mut DEVICE_OBJECT {
        let _enumerating = crate::lock(&self.enumeration);
        match self.pdo() {
            Some(pdo) => pdo as *mut DEVICE_OBJECT,
            None => self.new_pdo(),
        }
    }

    fn new_pdo(&self) -> *mut DEVICE_OBJECT {
        let mut pdo = std::ptr::null_mut();
        let status = self.create_device(self.bus_driver, 0, &mut pdo);
        assert_eq!(status, STATUS_SUCCESS, "out of memory for the PDO");
        // SAFETY: just created; a started PDO is no longer initializing. The PCI bus driver's PDOs are pageable for
        // power: the power manager then sends the stack's power IRPs at PASSIVE_LEVEL (IRP_MN_SET_POWER's page).
        unsafe { (*pdo).Flags = ((*pdo).Flags & !DO_DEVICE_INITIALIZING) | DO_POWER_PAGABLE };
        self.pdo.store(pdo as usize, std::sync::atomic::Ordering::Relaxed);
        pdo
    }

    /// The device's PDO (its address), once the PnP life made it.
    pub fn pdo(&self) -> Option<usize> {
        Some(self.pdo.load(std::sync::atomic::Ordering::Relaxed)).filter(|&p| p != 0)
    }

    /// IoCreateDevice's work: a DEVICE_OBJECT with `extension_size` bytes of zeroed extension behind it, linked
    /// into its driver's device list, DO_DEVICE_INITIALIZING until the driver clears it.
    pub(crate) fn create_device(
        &self,
        driver: *mut DRIVER_OBJECT,
        extension_size: u32,
        out: &mut *mut DEVICE_OBJECT,
    ) -> NTSTATUS {
        let header = size_of::<DEVICE_OBJECT>().div_ceil(16) * 16;
        let bytes = header + extension_size as usize;
        let block = alloc_object(bytes);
        if block.is_null() {
            return STATUS_INSUFFICIENT_RESOURCES;
        }
        let device = block as *mut DEVICE_OBJECT;
        // SAFETY: a fresh zeroed block holding the device object and its extension; `driver` is a live driver
        // object (the caller's, or the bus driver's).
        unsafe {
            (*device).Type = IO_TYPE_DEVICE;
            (*device).Size = bytes as u16;
            (*device).ReferenceCount = 1;
            (*device).DriverObject = driver;
            (*device).DeviceExtension =
                if extension_size > 0 { block.add(header).cast() } else { std::ptr::null_mut() };
            (*device).StackSize = 1;
            (*device).Flags = DO_DEVICE_INITIALIZING;
            (*device).NextDevice = (*driver).DeviceObject;
            (*driver).DeviceObject = device;
        }
        crate::lock(&self.objects).devices.push((device as usize, bytes));
        *out = device;
        STATUS_SUCCESS
    }

    /// IoDeleteDevice: unlinked from its driver and freed.
    pub(crate) fn delete_device(&self, device: *mut DEVICE_OBJECT) {
        let mut objects = crate::lock(&self.objects);
        let Some(at) = objects.devices.iter().position(|(d, _)| *d == device as usize) else {
            return;
        };
        let (_, bytes) = objects.devices.remove(at);
        // SAFETY: a device this manager created and has not freed; its driver object outlives it.
        unsafe {
            let driver = (*device).DriverObject;
            let mut link: *mut *mut DEVICE_OBJECT = &mut (*driver).DeviceObject;
            while !(*link).is_null() {
                if *link == device {
                    *link = (*device).NextDevice;
                    break;
                }
                link = &mut (**link).NextDevice;
            }
            free_object(device as *mut u8, bytes);
        }
    }

    /// Whether `device` is a live device object of this manager (a driver passing anything else is its bug).
    pub(crate) fn is_device(&self, device: *const DEVICE_OBJECT) -> bool {
        crate::lock(&self.objects).devices.iter().any(|(d, _)| *d == device as usize)
    }

    /// The driver's devices still alive (DriverUnload with devices left is a driver bug the verifier reports).
    pub(crate) fn devices_of(&self, driver: *mut DRIVER_OBJECT) -> usize {
        // SAFETY: the device list of a live driver object, made of live devices.
        unsafe {
            let mut n = 0;
            let mut d = (*driver).DeviceObject;
            while !d.is_null() {
                n += 1;
                d = (*d).NextDevice;
            }
            n
        }
    }

    /// IoAttachDeviceToDeviceStack: `source` goes on top of `target`'s stack; returns the device it sits on.
    pub(crate) fn attach(&self, source: *mut DEVICE_OBJECT, target: *mut DEVICE_OBJECT) -> *mut DEVICE_OBJECT {
        if !self.is_device(source) || !self.is_device(target) {
            return std::ptr::null_mut();
        }
        // SAFETY: both live devices of this manager.
        unsafe {
            let top = top_of(target);
            (*top).AttachedDevice = source;
            (*source).StackSize = (*top).StackSize + 1;
            (*source).AlignmentRequirement = (*top).AlignmentRequirement.max((*source).AlignmentRequirement);
            top
        }
    }

    /// IoDetachDevice: whatever sits on `target` comes off.
    pub(crate) fn detach(&self, target: *mut DEVICE_OBJECT) {
        if self.is_device(target) {
            // SAFETY: a live device.
            unsafe { (*target).AttachedDevice = std::ptr::null_mut() };
        }
    }

    /// An IRP with `stack_size` stack locations, none current yet (IoAllocateIrp).
    pub(crate) fn allocate_irp(&self, stack_size: i8) -> *mut IRP {
        let count = stack_size.max(1) as usize;
        let bytes = size_of::<IRP>() + count * size_of::<IO_STACK_LOCATION>();
        let irp = alloc_object(bytes) as *mut IRP;
        if irp.is_null() {
            return irp;
        }
        // SAFETY: a fresh zeroed IRP with its stack locations right behind it, as IoAllocateIrp lays them out;
        // the current location starts one past the last, so the first IoCallDriver makes the last current.
        unsafe {
            (*irp).Type = IO_TYPE_IRP;
            (*irp).Size = bytes as u16;
            (*irp).StackCount = count as i8;
            (*irp).CurrentLocation = count as i8 + 1;
            let stacks = (irp as *mut u8).add(size_of::<IRP>()) as *mut IO_STACK_LOCATION;
            (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation = stacks.add(count);
            (*irp).IoStatus.Anonymous.Status = STATUS_NOT_SUPPORTED;
        }
        crate::lock(&self.objects).irps.push((irp as usize, bytes));
        self.ledger.allocated(irp as usize);
        irp
    }

    /// IoFreeIrp.
    pub(crate) fn free_irp(&self, irp: *mut IRP) {
        let mut objects = crate::lock(&self.objects);
        if let Some(at) = objects.irps.iter().position(|(i, _)| *i == irp as usize) {
            let entry = objects.irps.remove(at);
            objects.freed_irps.push_back(entry);
            if objects.freed_irps.len() > FREED_IRPS_KEPT {
                if let Some((oldest, bytes)) = objects.freed_irps.pop_front() {
                    // SAFETY: an IRP this manager allocated, freed once: it left `irps` when it was kept.
                    unsafe { free_object(oldest as *mut u8, bytes) };
                }
            }
            self.ledger.freed(irp as usize);
        }
    }

    /// The stack location the next driver down will see (IoGetNextIrpStackLocation).
    ///
    /// # Safety
    /// A live IRP with a location left below the current one.
    pub(crate) unsafe fn next_stack(irp: *mut IRP) -> *mut IO_STACK_LOCATION {
        // SAFETY: the caller's contract.
        unsafe { (*irp).Tail.Overlay.Anonymous2.Anonymous.CurrentStackLocation.sub(1) }
    }
}

/// The top of the stack `device` is in.
///
/// # Safety
/// A live device whose attached devices are live.
pub unsafe fn top_of(mut device: *mut DEVICE_OBJECT) -> *mut DEVICE_OBJECT {
    // SAFETY: the caller's contract.
    unsafe {
        while !(*device).AttachedDevice.is_null() {
            device = (*device).AttachedDevice;
        }
    }
    device
}
