//! The started HCA as IRP_MJ_DEVICE_CONTROL reaches it: one driver-core Hca for every open file, opened at the first
//! request after START_DEVICE and dropped at STOP/REMOVE, behind a KMUTEX (its verbs wait for the device at
//! PASSIVE_LEVEL, so a spin lock cannot hold them), with the device interface that admits the opens.

use alloc::sync::Arc;
use core::cell::UnsafeCell;
use core::ffi::c_void;

use vhca_driver_core::{status_of, CommandTransport, CommandTransportError, CompletionSignal, Hca, HcaConfig};
use vhca_ntapi::{NTSTATUS as CoreStatus, PDEVICE_OBJECT};
use vhca_proto::Event;
use windows_sys::Wdk::Foundation::{DEVICE_OBJECT, KMUTANT};
use windows_sys::Wdk::System::SystemServices::{
    Executive, KeInitializeMutex, KeReleaseMutex, KeWaitForSingleObject, KernelMode,
};

use super::device_interface::DeviceInterface;
use super::started_device::StartedDevice;
use super::sys_command_transport::SysCommandTransport;
use super::wdk_kernel::WdkKernel;

/// The control path's HCA holds the channel by Arc: it outlives any one IRP, and STOP drops it before the channel.
pub struct SharedChannel(Arc<SysCommandTransport>);

impl CommandTransport for SharedChannel {
    fn execute(&self, request: &[u8], response_capacity: usize) -> Result<alloc::vec::Vec<u8>, CommandTransportError> {
        self.0.execute(request, response_capacity)
    }
    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError> {
        self.0.ring_doorbell(records)
    }
    fn poll_event(&self) -> Option<Event> {
        self.0.poll_event()
    }
    fn wait_for_interrupts(&self, signal: Option<Arc<dyn CompletionSignal>>) {
        self.0.wait_for_interrupts(signal)
    }
}

pub type ControlHca = Hca<WdkKernel, SharedChannel>;

/// What START_DEVICE handed the control path: enough to open its HCA when a request first needs one.
struct Source {
    kernel: Arc<WdkKernel>,
    channel: Arc<SysCommandTransport>,
    pdo: *mut DEVICE_OBJECT,
}

#[derive(Default)]
struct ControlState {
    source: Option<Source>,
    hca: Option<ControlHca>,
    /// Counts STARTs: a file opened under an earlier one holds handles of an HCA that is gone.
    generation: u32,
}

/// In the FDO's extension (non-paged), from AddDevice to REMOVE_DEVICE.
pub struct ControlPath {
    mutex: UnsafeCell<KMUTANT>,
    state: UnsafeCell<ControlState>,
    /// Changed by PnP IRPs alone (serialised by the PnP manager), never by a request.
    interface: Option<DeviceInterface>,
}

impl ControlPath {
    pub fn new() -> ControlPath {
        // SAFETY: KMUTANT is plain data; KeInitializeMutex fills it in `initialize` before any use.
        let mutex = unsafe { core::mem::zeroed() };
        ControlPath { mutex: UnsafeCell::new(mutex), state: UnsafeCell::default(), interface: None }
    }

    /// # Safety
    /// Once, in AddDevice, at the path's final address (the FDO's extension). PASSIVE_LEVEL.
    pub unsafe fn initialize(&self) {
        // SAFETY: the caller's contract; level 0 (no mutex-level ordering is used in this driver).
        unsafe { KeInitializeMutex(self.mutex.get(), 0) }
    }

    /// Runs `f` with the mutex held. PASSIVE_LEVEL (a dispatch routine, or PnP); `f` may wait for the device.
    fn locked<R>(&self, f: impl FnOnce(&mut ControlState) -> R) -> R {
        // SAFETY: PASSIVE_LEVEL, an infinite KernelMode wait on our initialised mutex (KeWaitForSingleObject allows
        // it at IRQL <= APC_LEVEL); a KMUTEX disables normal kernel APCs while held, as a driver's lock must.
        unsafe {
            KeWaitForSingleObject(
                self.mutex.get() as *const c_void,
                Executive,
                KernelMode as i8,
                false,
                core::ptr::null(),
            );
        }
        // SAFETY: the mutex is held: no other thread is inside `locked`.
        let out = f(unsafe { &mut *self.state.get() });
        // SAFETY: held by this thread since the wait above; PASSIVE_LEVEL.
        unsafe { KeReleaseMutex(self.mutex.get(), false) };
        out
    }

    /// START_DEVICE succeeded: requests may reach the HCA, and the interface is enabled. PASSIVE_LEVEL, PnP.
    pub fn started(&mut self, device: Option<&StartedDevice>) {
        let Some((kernel, channel, pdo)) = device.and_then(StartedDevice::control_parts) else { return };
        self.locked(|s| {
            s.generation = s.generation.wrapping_add(1);
            s.source = Some(Source { kernel, channel, pdo });
        });
        if self.interface.is_none() {
            self.interface = DeviceInterface::register(pdo).ok();
        }
        if let Some(interface) = self.interface.as_mut() {
            interface.set_enabled(true);
        }
    }

    /// STOP, SURPRISE_REMOVAL or REMOVE, before the started device goes: no new open, then (once the request in
    /// flight let go of the mutex) the HCA is dropped, so none of its objects outlives the channel. PASSIVE_LEVEL.
    pub fn stopping(&mut self) {
        if let Some(interface) = self.interface.as_mut() {
            interface.set_enabled(false);
        }
        self.locked(|s| {
            s.hca = None;
            s.source = None;
        });
    }

    /// A set-power to D3, before the device is quiesced: no new request reaches the HCA (the mutex, then no source),
    /// and the HCA is closed while the device still answers: each MR deregistered (its list and map registers given
    /// back, a user's pages unlocked), each QP destroyed (the device drops the work it holds, so nothing is DMA'd
    /// after D3 into what the driver reclaims), each CQ's ring freed, the adapter put back; the power-down then
    /// resets the device and frees the channel. Dropped unclosed, as it was, all of that outlived the sleep: a user
    /// process with MRs registered exited with their pages locked (0x76, 0xCB under Pool Tracking; the seed's
    /// sleep-during-traffic). The interface stays enabled, since the device is still there; `started` at D0 gives
    /// requests the new channel. A file opened before the sleep is of an older START: its handles are refused and
    /// its CLEANUP releases nothing twice. `close` false is that bug, kept as the seed's sleep-during-traffic-unquiesced
    /// (power.rs). PASSIVE_LEVEL (the stack is DO_POWER_PAGABLE).
    pub fn sleeping(&mut self, close: bool) {
        self.locked(|s| {
            match s.hca.take() {
                Some(hca) if close => hca.close(),
                unclosed => drop(unclosed),
            }
            s.source = None;
        });
    }

    /// SURPRISE_REMOVAL: no new open, no request reaches the HCA again, and the HCA is handed to the caller, which
    /// resets the device before it abandons the HCA's host memory (`Hca::abandon`: nothing sent to a device that is
    /// gone). PASSIVE_LEVEL.
    pub fn surprise_removed(&mut self) -> Option<ControlHca> {
        if let Some(interface) = self.interface.as_mut() {
            interface.set_enabled(false);
        }
        self.locked(|s| {
            s.source = None;
            s.hca.take()
        })
    }

    /// Whether requests opened the HCA since START: then a file's QPs, CQs and MRs may live in it, and a STOP would
    /// drop them under it. The HCA stays until STOP (or D3) once opened, so this stays true after the last file
    /// closed: coarse, but a driver may refuse a query-stop whenever it cannot stop. PASSIVE_LEVEL.
    pub fn holds_hca(&self) -> bool {
        self.locked(|s| s.hca.is_some())
    }

    /// REMOVE_DEVICE, after `stopping`: the interface's link is given back.
    pub fn removed(&mut self) {
        self.interface = None;
    }

    /// The bug variant's view of `cq` for a pending wait (cq_waits.rs, CachedCq): its ring's reader and the kernel,
    /// taken under the mutex and read later without it. None when the HCA is not open or has no such CQ.
    pub fn cq_view(&self, cq: u32) -> Option<super::cq_waits::CachedCq> {
        self.locked(|s| {
            let kernel = s.source.as_ref()?.kernel.clone();
            Some(super::cq_waits::CachedCq { reader: s.hca.as_ref()?.cq_reader(cq)?, kernel })
        })
    }

    /// The current START's number, for a new file.
    pub fn generation(&self) -> u32 {
        self.locked(|s| s.generation)
    }

    /// Runs `f` on the started HCA (opened now if this is its first request) with the mutex held; `generation` is
    /// the file's. Err(STATUS_DEVICE_NOT_READY) while the device is not started, or the open's own status.
    pub fn with_hca<R>(&self, f: impl FnOnce(&mut ControlHca, u32) -> R) -> Result<R, CoreStatus> {
        self.locked(|s| {
            let Some(source) = &s.source else { return Err(STATUS_DEVICE_NOT_READY) };
            if s.hca.is_none() {
                let channel = SharedChannel(source.channel.clone());
                let pdo = PDEVICE_OBJECT(source.pdo as u64);
                let hca = Hca::open(source.kernel.clone(), channel, pdo, HcaConfig::default()).map_err(status_of)?;
                s.hca = Some(hca);
            }
            let generation = s.generation;
            Ok(f(s.hca.as_mut().expect("opened above"), generation))
        })
    }
}

/// STATUS_DEVICE_NOT_READY (ntstatus.h): a request between STOP and the next START.
pub const STATUS_DEVICE_NOT_READY: CoreStatus = CoreStatus(0xC000_00A3_u32 as i32);
