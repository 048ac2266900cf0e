//! The device while started: its BARs mapped from the translated resources, the shared virtio transport brought
//! up over them, every queue the device has and the command transport in common buffers, the interrupts START_DEVICE
//! gave it (its MSI-X messages routed to the queues), and the WDK shim the driver core runs on. Dropping it quiesces
//! the device (reset) before any of its memory is freed.

use alloc::format;
use alloc::string::String;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::ffi::c_void;
use core::time::Duration;

use vhca_driver_core::PathDevices;
use vhca_ntapi::{resource_list_layout, NtKernel, DEVICE_DESCRIPTION, PDEVICE_OBJECT, PDMA_ADAPTER};
use vhca_proto::{
    DeviceConfig, CONFIG_MAGIC, DEVICE_CONFIG_SIZE, NUM_QUEUES, QUEUE_COMMAND, QUEUE_DOORBELL, QUEUE_EVENT, QUEUE_SIZE,
};
use vhca_virtio::{
    command_with_decoding_and_mastering, parse_capabilities, MsixPlan, RingLayout, SplitQueue, VirtioPci,
    F_ACCESS_PLATFORM, F_VERSION_1, PCI_COMMAND, PCI_CONFIG_SPACE_SIZE, STATUS_ACKNOWLEDGE, STATUS_DRIVER,
};
use windows_sys::Wdk::Foundation::DEVICE_OBJECT;
use windows_sys::Wdk::System::SystemServices::{
    MmMapIoSpaceEx, MmUnmapIoSpace, CM_RESOURCE_LIST, PAGE_NOCACHE, PAGE_READWRITE,
};
use zerocopy::FromBytes;

use super::common_buffer::CommonBuffer;
use super::config_space;
use super::mmio_registers::{KernelWait, MmioBar};
use super::scenario_services::{DeviceInterrupts, KernelServices};
use super::sys_command_transport::{Queue, SysCommandTransport, TransportBuffers};
use super::wdk_kernel::WdkKernel;
use crate::bar_resources::{locate_bar, memory_resources};
use crate::interrupt_resources::{interrupt_resources, InterruptResources};
use crate::result_line::RunResult;
use crate::scenario_run;
use vhca_scenarios::{Scenario, ScenarioOptions};

/// How long the device may take to finish a reset.
const RESET_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest transfer the channel's own adapter is described with: one page (its buffers are common buffers).
const CHANNEL_MAX_TRANSFER: u32 = 4096;
/// The most queues set up (the Linux guest program's bound too): vhca's device has four.
const MAX_QUEUES: u16 = 16;

/// A BAR mapped into system space; unmapped on drop.
struct MappedBar {
    index: u8,
    registers: MmioBar,
    length: usize,
}

impl Drop for MappedBar {
    fn drop(&mut self) {
        // SAFETY: mapped by MmMapIoSpaceEx with this length; PASSIVE_LEVEL; nothing uses it after the device reset.
        unsafe { MmUnmapIoSpace(self.registers.base() as *const c_void, self.length) };
    }
}

pub struct StartedDevice {
    pdo: *mut DEVICE_OBJECT,
    kernel: Arc<WdkKernel>,
    /// Shared with the interrupt path, which routes the device's MSI-X vectors off before it disconnects.
    transport: Arc<VirtioPci<MmioBar>>,
    channel: Option<Arc<SysCommandTransport>>,
    /// The interrupt descriptors of START_DEVICE's lists.
    interrupts: InterruptResources,
    /// Which message each virtio source is to signal, when START_DEVICE gave messages: the interrupt path writes it
    /// once connected (scenario_services.rs), and the command and event queues ask for notifications from the start.
    msix: Option<MsixPlan>,
    /// The queues the channel does not use (queue 3), set up only because QEMU needs every queue set up; their
    /// common buffers are freed after the reset in drop.
    unused_queues: Vec<Queue>,
    /// The channel's own adapter (the core gets its own in Hca::open).
    adapter: PDMA_ADAPTER,
    /// In D3 (power.rs): the device reset, its rings and channel freed; D0 brings it up again.
    asleep: bool,
    /// Last: unmapped after everything that uses the registers.
    _bars: Vec<MappedBar>,
}

// SAFETY: the started device is reached only from PnP IRPs, which the PnP manager serialises per device.
unsafe impl Send for StartedDevice {}

/// START_DEVICE's list as bytes, its length read from its own counts (`resource_list_layout`); empty for a NULL
/// list or one with no full descriptor.
///
/// # Safety
/// `list` is NULL or a CM_RESOURCE_LIST as the PnP manager lays it out (Windows' pack(4) layout), whole.
unsafe fn list_bytes<'a>(list: *const CM_RESOURCE_LIST) -> &'a [u8] {
    if list.is_null() {
        return &[];
    }
    // SAFETY: the caller's contract: a list holds at least its header (Count and the first full descriptor's
    // header), then as many descriptors as that header counts.
    unsafe {
        let header = core::slice::from_raw_parts(list.cast::<u8>(), resource_list_layout::FIRST_DESCRIPTOR);
        match resource_list_layout::list_bytes(header) {
            Some(bytes) => core::slice::from_raw_parts(list.cast::<u8>(), bytes),
            None => &[],
        }
    }
}

fn check(what: &str, status: i32) -> Result<(), String> {
    if status < 0 {
        Err(format!("{what}: status {:#010x}", status as u32))
    } else {
        Ok(())
    }
}

impl StartedDevice {
    /// START_DEVICE's work after the lower drivers started the device. PASSIVE_LEVEL, in the PnP manager's thread.
    ///
    /// # Safety
    /// `pdo` is the device's PDO; the lists are START_DEVICE's.
    pub unsafe fn start(
        pdo: *mut DEVICE_OBJECT,
        raw: *const CM_RESOURCE_LIST,
        translated: *const CM_RESOURCE_LIST,
    ) -> Result<StartedDevice, String> {
        let mut config = [0u8; PCI_CONFIG_SPACE_SIZE];
        check("IRP_MN_READ_CONFIG", config_space::read(pdo, 0, &mut config))?;
        let caps = parse_capabilities(&config).map_err(|e| format!("virtio capabilities: {e}"))?;
        // SAFETY: the caller's contract.
        let (raw, translated) = unsafe { (list_bytes(raw), list_bytes(translated)) };
        let resources = memory_resources(raw, translated);
        let interrupts = interrupt_resources(raw, translated);
        let mut bars: Vec<MappedBar> = Vec::new();
        for bar in [Some(caps.common.bar), Some(caps.notify.bar), caps.device.map(|d| d.bar)].into_iter().flatten() {
            if bars.iter().any(|b| b.index == bar) {
                continue;
            }
            let resource = locate_bar(&config, bar, &resources).map_err(|e| format!("BAR{bar}: {e}"))?;
            let length = resource.length as usize;
            // SAFETY: PASSIVE_LEVEL; the translated range is this device's BAR, mapped uncached for registers.
            let base =
                unsafe { MmMapIoSpaceEx(resource.translated_start as i64, length, PAGE_READWRITE | PAGE_NOCACHE) };
            if base.is_null() {
                return Err(format!("MmMapIoSpaceEx of BAR{bar} ({length:#x} bytes) failed"));
            }
            // SAFETY: just mapped, `length` bytes, kept mapped by MappedBar.
            let registers = unsafe { MmioBar::new(base.cast(), resource.length) };
            bars.push(MappedBar { index: bar, registers, length });
        }
        // Bus mastering on: the PCI bus driver enables decoding at start; mastering is the function driver's.
        let command = u16::from_le_bytes([config[PCI_COMMAND], config[PCI_COMMAND + 1]]);
        let command = command_with_decoding_and_mastering(command).to_le_bytes();
        check("IRP_MN_WRITE_CONFIG", config_space::write(pdo, PCI_COMMAND as u32, &command))?;
        let by_index = |index: u8| bars.iter().find(|b| b.index == index).map(|b| b.registers);
        let transport = VirtioPci::new(caps, |index| {
            by_index(index).ok_or(super::mmio_registers::OutsideBar { offset: 0, width: 0, size: 0 })
        })
        .map_err(|e| format!("virtio-pci: {e}"))?;

        let kernel = Arc::new(WdkKernel::new());
        let mut map_registers = 0;
        let description = DEVICE_DESCRIPTION::bus_master_64(CHANNEL_MAX_TRANSFER);
        let adapter = kernel.IoGetDmaAdapter(PDEVICE_OBJECT(pdo as u64), &description, &mut map_registers);
        if adapter.is_null() {
            return Err("IoGetDmaAdapter for the channel failed".into());
        }
        let mut device = StartedDevice {
            pdo,
            kernel,
            transport: Arc::new(transport),
            channel: None,
            interrupts,
            msix: None,
            unused_queues: Vec::new(),
            adapter,
            asleep: false,
            _bars: bars,
        };
        device.bring_up()?;
        Ok(device)
    }

    /// virtio initialisation (virtio 1.x, 3.1.1) and the channel. On error the caller drops `self`, which resets.
    fn bring_up(&mut self) -> Result<(), String> {
        let t: &VirtioPci<MmioBar> = &self.transport;
        t.reset(&mut KernelWait::after(RESET_TIMEOUT)).map_err(|e| format!("reset: {e}"))?;
        t.add_status(STATUS_ACKNOWLEDGE).map_err(|e| format!("status: {e}"))?;
        t.add_status(STATUS_DRIVER).map_err(|e| format!("status: {e}"))?;
        t.negotiate(F_VERSION_1 | F_ACCESS_PLATFORM, 0).map_err(|e| format!("features: {e}"))?;
        let raw = t.read_device_config(DEVICE_CONFIG_SIZE).map_err(|e| format!("device config: {e}"))?;
        let config = raw.as_deref().and_then(|r| DeviceConfig::read_from_bytes(r).ok());
        match config {
            Some(c) if c.magic.get() == CONFIG_MAGIC => {}
            _ => return Err("device config magic is not \"VHCA\": not a vhca device".into()),
        }
        let take = |index: u16| -> Result<Queue, String> {
            let max = t.queue_max_size(index).map_err(|e| format!("queue {index}: {e}"))?;
            if max == 0 {
                return Err(format!("queue {index} has size 0"));
            }
            let size = 1u16 << (15 - max.min(QUEUE_SIZE).leading_zeros().min(15));
            let layout = RingLayout::new(size).map_err(|e| format!("queue {index}: {e}"))?;
            let memory = CommonBuffer::allocate(self.adapter, layout.bytes as u32)
                .ok_or(format!("queue {index}: no common buffer of {} bytes", layout.bytes))?;
            let ring = SplitQueue::new(size, memory).map_err(|e| format!("queue {index}: {e}"))?;
            let notifier = t.setup_queue(index, size, ring.ring_iovas()).map_err(|e| format!("queue {index}: {e}"))?;
            Ok(Queue { ring, notifier })
        };
        // Every queue the device reports is set up, not only the three the channel uses: QEMU starts a vhost-user
        // backend (vhost-user-snd-pci, the carrier, has four queues) only once every queue is set up, and fails with
        // "Error starting vhost-user-base: 14" otherwise. The others stay initialised and unused until the reset.
        let num_queues = t.num_queues().map_err(|e| format!("queue count: {e}"))?;
        if num_queues < NUM_QUEUES {
            return Err(format!("device has {num_queues} queues, vhca needs {NUM_QUEUES}"));
        }
        // The MSI-X routing for the messages START_DEVICE gave. It is written only once the ISR is connected
        // (scenario_services.rs), so no message can come before there is one to take it: until then every source
        // stays on VIRTIO_MSI_NO_VECTOR, as the reset left it.
        let messages = u16::try_from(self.interrupts.messages()).unwrap_or(u16::MAX);
        self.msix = MsixPlan::new(messages, num_queues.min(MAX_QUEUES));
        let mut queues = Vec::new();
        // Declared after `queues`, so dropped before them: on an error return the device is reset before a ring it
        // was told of is freed (freeing first lets the device DMA to an unmapped ring: 0xE6/0x26, found by the low
        // resources simulation failing the fourth queue's ring).
        let mut reset = ResetOnError { transport: t, armed: true };
        for index in 0..num_queues.min(MAX_QUEUES) {
            queues.push(Some(take(index)?));
        }
        // The channel's buffers before DRIVER_OK and before any queue could be handed on: a failure here returns
        // through `reset` with every queue still owned by this function (sys_command_transport.rs says why).
        let buffers =
            TransportBuffers::allocate(self.adapter).ok_or("command transport: no common buffer for its buffers")?;
        t.driver_ok().map_err(|e| format!("DRIVER_OK: {e}"))?;
        let mut channel_queue = |index: u16| queues[index as usize].take().ok_or(format!("queue {index} taken twice"));
        let commands = channel_queue(QUEUE_COMMAND)?;
        let events = channel_queue(QUEUE_EVENT)?;
        if self.msix.is_some() {
            // Before their first chains, so no completion can come without a notification once the routing is
            // written (the Linux guest's queues ask the same way): the event queue for the DPC, the command queue
            // for the command's KEVENT the DPC sets. The doorbell queue keeps declining: its short wait stalls.
            events.ring.set_interrupts_wanted(true);
            commands.ring.set_interrupts_wanted(true);
        }
        let doorbells = channel_queue(QUEUE_DOORBELL)?;
        self.unused_queues = queues.into_iter().flatten().collect();
        self.channel = Some(Arc::new(
            SysCommandTransport::new(buffers, commands, events, doorbells)
                .ok_or("command transport: event posting failed")?,
        ));
        reset.armed = false;
        Ok(())
    }

    /// Entering D3 (power.rs, before the IRP goes down): DMA quiesced as on STOP, but what D0 needs is kept (the BARs'
    /// mappings, the adapter, the interrupt resources and MSI-X plan). The reset first: after it the device no
    /// longer reads or writes the rings and buffers freed next. Nothing else is in flight: vhca.sys takes no request
    /// outside START_DEVICE, whose scenario disconnected its interrupt before it returned. PASSIVE_LEVEL.
    pub fn power_down(&mut self) {
        if self.asleep {
            return;
        }
        let _ = self.transport.reset(&mut KernelWait::after(RESET_TIMEOUT));
        self.channel = None;
        self.unused_queues.clear();
        self.asleep = true;
    }

    /// Back in D0 (power.rs, once the bus driver powered the device up): the device really initialised again, as
    /// at START_DEVICE (bus mastering, which a D3hot→D0 transition may clear, then reset, features, every queue,
    /// DRIVER_OK, the channel). A failure leaves no channel, so nothing later uses a ring that is not there: a
    /// scenario answers "no command transport" and REMOVE frees what is left. PASSIVE_LEVEL.
    pub fn power_up(&mut self) -> Result<(), String> {
        if !self.asleep {
            return Ok(());
        }
        let mut command = [0u8; 2];
        check("IRP_MN_READ_CONFIG", config_space::read(self.pdo, PCI_COMMAND as u32, &mut command))?;
        let command = command_with_decoding_and_mastering(u16::from_le_bytes(command)).to_le_bytes();
        check("IRP_MN_WRITE_CONFIG", config_space::write(self.pdo, PCI_COMMAND as u32, &command))?;
        self.bring_up()?;
        self.asleep = false;
        Ok(())
    }

    /// What the device-control path opens its own HCA on (control_path.rs), while there is a channel.
    pub fn control_parts(&self) -> Option<(Arc<WdkKernel>, Arc<SysCommandTransport>, *mut DEVICE_OBJECT)> {
        Some((self.kernel.clone(), self.channel.clone()?, self.pdo))
    }

    /// Runs one scenario on the driver core over this device; `fdo` is vhca.sys's device object for it. PASSIVE_LEVEL.
    pub fn run_scenario(&self, fdo: *mut DEVICE_OBJECT, scenario: Scenario, options: &ScenarioOptions) -> RunResult {
        match &self.channel {
            Some(channel) => {
                let pdo = PDEVICE_OBJECT(self.pdo as u64);
                let interrupts = DeviceInterrupts {
                    resources: &self.interrupts,
                    msix: self.msix.as_ref(),
                    transport: &self.transport,
                    devices: PathDevices { pdo, own: PDEVICE_OBJECT(fdo as u64) },
                };
                let services = KernelServices::new(channel, &self.kernel, interrupts);
                scenario_run::run(scenario, &services, self.kernel.clone(), &**channel, pdo, options)
            }
            None => {
                let mut result = RunResult::new(scenario.name());
                result.fail("the device has no command transport");
                result
            }
        }
    }
}

/// Resets the device when dropped armed: a failed bring-up's queues are freed only after the device let go of them.
struct ResetOnError<'a> {
    transport: &'a VirtioPci<MmioBar>,
    armed: bool,
}

impl Drop for ResetOnError<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.transport.reset(&mut KernelWait::after(RESET_TIMEOUT));
        }
    }
}

impl Drop for StartedDevice {
    /// STOP, SURPRISE_REMOVAL or REMOVE (or a failed start). PASSIVE_LEVEL. Quiesce first: after the reset the
    /// device no longer reads or writes the rings and buffers freed next.
    fn drop(&mut self) {
        let _ = self.transport.reset(&mut KernelWait::after(RESET_TIMEOUT));
        // No interrupt is connected here: the interrupt path lives for one scenario inside START_DEVICE, and was
        // disconnected (vectors off, IoDisconnectInterruptEx, KeFlushQueuedDpcs) before the scenario destroyed its
        // first CQ (vhca_scenarios::run; the path's own drop does the same on any other way out).
        self.channel = None;
        self.unused_queues.clear();
        // The channel's adapter, every common buffer on it freed just above; PASSIVE_LEVEL.
        self.kernel.PutDmaAdapter(self.adapter);
    }
}
