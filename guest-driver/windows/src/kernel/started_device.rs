//! The device while started: its BARs mapped from the translated resources, the shared virtio transport brought
//! up over them, the three queues and the command channel in common buffers, and the WDK shim the driver core
//! runs on. Dropping it quiesces the device (reset) before any of its memory is freed.

use alloc::format;
use alloc::string::String;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::ffi::c_void;
use core::time::Duration;

use vhca_ntapi::{NtKernel, DEVICE_DESCRIPTION, PDEVICE_OBJECT, PDMA_ADAPTER};
use vhca_proto::{
    DeviceConfig, CONFIG_MAGIC, DEVICE_CONFIG_SIZE, QUEUE_COMMAND, QUEUE_DOORBELL, QUEUE_EVENT, QUEUE_SIZE,
};
use vhca_virtio::{
    command_with_decoding_and_mastering, parse_capabilities, RingLayout, SplitQueue, VirtioPci, F_ACCESS_PLATFORM,
    F_VERSION_1, PCI_COMMAND, PCI_CONFIG_SPACE_SIZE, STATUS_ACKNOWLEDGE, STATUS_DRIVER,
};
use windows_sys::Wdk::Foundation::DEVICE_OBJECT;
use windows_sys::Wdk::System::SystemServices::{
    CmResourceTypeMemory, MmMapIoSpaceEx, MmUnmapIoSpace, CM_PARTIAL_RESOURCE_DESCRIPTOR, CM_RESOURCE_LIST,
    PAGE_NOCACHE, PAGE_READWRITE,
};
use zerocopy::FromBytes;

use super::common_buffer::CommonBuffer;
use super::config_space;
use super::device_channel::{DeviceChannel, Queue};
use super::mmio_registers::{KernelWait, MmioBar};
use super::scenario_services::KernelServices;
use super::wdk_kernel::WdkKernel;
use crate::bar_resources::{locate_bar, MemoryResource};
use crate::result_line::RunResult;
use crate::scenario_run;
use vhca_scenarios::{Scenario, ScenarioOptions};

/// How long the device may take to finish a reset.
const RESET_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest transfer the channel's own adapter is described with: one page (its buffers are common buffers).
const CHANNEL_MAX_TRANSFER: u32 = 4096;

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
    transport: VirtioPci<MmioBar>,
    channel: Option<DeviceChannel>,
    /// The channel's own adapter (the core gets its own in Hca::open).
    adapter: PDMA_ADAPTER,
    /// Last: unmapped after everything that uses the registers.
    _bars: Vec<MappedBar>,
}

// SAFETY: the started device is reached only from PnP IRPs, which the PnP manager serialises per device.
unsafe impl Send for StartedDevice {}

/// The memory resources of START_DEVICE: raw and translated descriptors at the same index.
///
/// # Safety
/// Both lists are START_DEVICE's, with the same layout (the PnP manager's promise).
unsafe fn memory_resources(raw: *const CM_RESOURCE_LIST, translated: *const CM_RESOURCE_LIST) -> Vec<MemoryResource> {
    let mut out = Vec::new();
    if raw.is_null() || translated.is_null() {
        return out;
    }
    // SAFETY: the caller's contract; a PCI device's lists have one full descriptor.
    unsafe {
        if (*raw).Count == 0 || (*translated).Count == 0 {
            return out;
        }
        let raw_list = &(*raw).List[0].PartialResourceList;
        let translated_list = &(*translated).List[0].PartialResourceList;
        let count = raw_list.Count.min(translated_list.Count) as usize;
        let raw_first = core::ptr::addr_of!(raw_list.PartialDescriptors).cast::<CM_PARTIAL_RESOURCE_DESCRIPTOR>();
        let translated_first =
            core::ptr::addr_of!(translated_list.PartialDescriptors).cast::<CM_PARTIAL_RESOURCE_DESCRIPTOR>();
        for i in 0..count {
            let (r, t) = (&*raw_first.add(i), &*translated_first.add(i));
            // CmResourceTypeMemoryLarge (BARs past 4 GiB in length) is not handled: vhca's BARs are small.
            if r.Type as u32 == CmResourceTypeMemory && t.Type as u32 == CmResourceTypeMemory {
                out.push(MemoryResource {
                    raw_start: r.u.Memory.Start as u64,
                    translated_start: t.u.Memory.Start as u64,
                    length: t.u.Memory.Length as u64,
                });
            }
        }
    }
    out
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
        let resources = unsafe { memory_resources(raw, translated) };
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
        let mut device = StartedDevice { pdo, kernel, transport, channel: None, adapter, _bars: bars };
        device.bring_up()?;
        Ok(device)
    }

    /// virtio initialisation (virtio 1.x, 3.1.1) and the channel. On error the caller drops `self`, which resets.
    fn bring_up(&mut self) -> Result<(), String> {
        let t = &self.transport;
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
        let commands = take(QUEUE_COMMAND)?;
        let events = take(QUEUE_EVENT)?;
        let doorbells = take(QUEUE_DOORBELL)?;
        t.driver_ok().map_err(|e| format!("DRIVER_OK: {e}"))?;
        self.channel = Some(
            DeviceChannel::new(self.adapter, commands, events, doorbells)
                .ok_or("command channel: buffers or event posting failed")?,
        );
        Ok(())
    }

    /// Runs one scenario on the driver core over this device. PASSIVE_LEVEL.
    pub fn run_scenario(&self, scenario: Scenario, options: &ScenarioOptions) -> RunResult {
        match &self.channel {
            Some(channel) => {
                let services = KernelServices::new(channel);
                let pdo = PDEVICE_OBJECT(self.pdo as u64);
                scenario_run::run(scenario, &services, self.kernel.clone(), channel, pdo, options)
            }
            None => {
                let mut result = RunResult::new(scenario.name());
                result.fail("the device has no command channel");
                result
            }
        }
    }
}

impl Drop for StartedDevice {
    /// STOP, SURPRISE_REMOVAL or REMOVE (or a failed start). PASSIVE_LEVEL. Quiesce first: after the reset the
    /// device no longer reads or writes the rings and buffers freed next.
    fn drop(&mut self) {
        let _ = self.transport.reset(&mut KernelWait::after(RESET_TIMEOUT));
        self.channel = None;
        // The channel's adapter, every common buffer on it freed just above; PASSIVE_LEVEL.
        self.kernel.PutDmaAdapter(self.adapter);
    }
}
