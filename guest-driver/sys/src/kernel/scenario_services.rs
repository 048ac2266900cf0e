//! The kernel services vhca.sys's scenario host needs beyond the WDK shim: the debugger for progress, the interrupt
//! clock, delays, user buffers (virtual memory in the current process's user address space), and the interrupt
//! path over the interrupts START_DEVICE gave the device.

use alloc::boxed::Box;
use alloc::sync::Arc;
use core::ffi::c_void;
use core::time::Duration;

use vhca_driver_core::{CompletionWaits, CqCompletions, PathDevices, DEFAULT_CQE_BUDGET};
use vhca_ntapi::{INTERRUPT_CONNECTION, PDEVICE_OBJECT, PVOID};
use vhca_virtio::{MsixPlan, VirtioPci};
use windows_sys::Wdk::System::SystemServices::{KeDelayExecutionThread, KernelMode};

use super::debug_print::print_line;
use super::interrupt_completions::InterruptCompletions;
use super::kernel_imports::{ZwAllocateVirtualMemory, ZwFreeVirtualMemory};
use super::mmio_registers::{self, MmioBar};
use super::sys_command_transport::SysCommandTransport;
use super::wdk_kernel::WdkKernel;
use crate::interrupt_resources::InterruptResources;
use crate::scenario_run::DriverServices;

/// NtCurrentProcess(): the handle wdm.h defines as -1.
const CURRENT_PROCESS: isize = -1;
const MEM_COMMIT: u32 = 0x1000;
const MEM_RESERVE: u32 = 0x2000;
const MEM_RELEASE: u32 = 0x8000;
const PAGE_READWRITE: u32 = 0x04;
const PAGE: u64 = 4096;

/// What the started device has for an interrupt path: START_DEVICE's interrupt descriptors, the MSI-X routing the
/// device took (None: it has no messages), its registers, the PDO IoConnectInterruptEx connects for and vhca.sys's
/// FDO, which owns its work items (`PathDevices` says why).
pub struct DeviceInterrupts<'a> {
    pub resources: &'a InterruptResources,
    pub msix: Option<&'a MsixPlan>,
    pub transport: &'a Arc<VirtioPci<MmioBar>>,
    pub devices: PathDevices,
}

/// The services for one run on one started device's channel (the lifetime is the started device's borrow).
pub struct KernelServices<'a> {
    kernel: &'a Arc<WdkKernel>,
    channel: &'a Arc<SysCommandTransport>,
    interrupts: DeviceInterrupts<'a>,
}

impl<'a> KernelServices<'a> {
    pub fn new(
        channel: &'a Arc<SysCommandTransport>,
        kernel: &'a Arc<WdkKernel>,
        interrupts: DeviceInterrupts<'a>,
    ) -> Self {
        KernelServices { kernel, channel, interrupts }
    }
}

/// How IoConnectInterruptEx connected, in words.
fn connection_kind(connection: Option<&INTERRUPT_CONNECTION>) -> alloc::string::String {
    match connection {
        Some(INTERRUPT_CONNECTION::MessageBased(info)) => {
            alloc::format!("message-based, {} messages at IRQL {}", info.MessageInfo.len(), info.UnifiedIrql)
        }
        Some(INTERRUPT_CONNECTION::LineBased(_)) => "line-based (the fallback)".into(),
        None => "not connected".into(),
    }
}

impl<'a> DriverServices for KernelServices<'a> {
    type Kernel = WdkKernel;
    type Channel = &'a SysCommandTransport;

    fn print(&self, line: &str) {
        print_line(line);
    }

    fn now(&self) -> Duration {
        Duration::from_nanos(mmio_registers::now().saturating_mul(100))
    }

    fn resources_refused(&self) -> bool {
        self.kernel.refusals() > 0
    }

    fn command_waits(&self) -> Option<(u64, u64)> {
        Some(self.channel.command_waits())
    }

    fn own_device(&self) -> Option<PDEVICE_OBJECT> {
        Some(self.interrupts.devices.own)
    }

    /// IoConnectInterruptEx, CONNECT_MESSAGE_BASED with the line-based fallback, only when START_DEVICE gave the
    /// device an interrupt (without one it returns STATUS_NOT_FOUND, and the run polls as before). The path is
    /// kept only when messages were connected and the device took their routing, written here: the device signals
    /// its queues by MSI-X, and the driver core's ISR claims every call without reading virtio's ISR status
    /// register, which a level-triggered line would need to be deasserted. Otherwise it is disconnected again (the
    /// routing cleared first) and the error says why.
    fn connect_completions(&self) -> anyhow::Result<Option<Box<dyn CqCompletions>>> {
        let i = &self.interrupts;
        if i.resources.is_empty() {
            return Ok(None);
        }
        let waits =
            CompletionWaits::connect(self.kernel.clone(), self.channel.clone(), i.devices, DEFAULT_CQE_BUDGET, None)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        let kind = connection_kind(waits.connection());
        let routed = match (i.msix, waits.connection()) {
            (Some(plan), Some(INTERRUPT_CONNECTION::MessageBased(_))) => {
                // The routing only now that the ISR is connected (started_device.rs says why).
                plan.program(&**i.transport).map(|()| plan).map_err(|e| alloc::format!("MSI-X routing refused: {e}"))
            }
            _ => Err("without the MSI-X routing the queues signal by".into()),
        };
        let plan = match routed {
            Ok(plan) => plan,
            Err(why) => {
                let completions = InterruptCompletions::new(waits, i.transport.clone(), i.msix.cloned());
                let counts = Box::new(completions).disconnect();
                anyhow::bail!(
                    "IoConnectInterruptEx connected {kind}, {why} ({} ISR calls meanwhile)",
                    counts.isr_calls
                );
            }
        };
        print_line(&alloc::format!("vhca: interrupt path connected: {kind}"));
        Ok(Some(Box::new(InterruptCompletions::new(waits, i.transport.clone(), Some(plan.clone())))))
    }

    fn sleep(&self, duration: Duration) {
        // Relative time: negative, in 100-ns units; at least one unit.
        let interval = -((duration.as_nanos() / 100).clamp(1, i64::MAX as u128) as i64);
        // SAFETY: PASSIVE_LEVEL (scenarios run in START_DEVICE), no lock held; kernel mode, not alertable
        // (KeDelayExecutionThread's rules).
        unsafe { KeDelayExecutionThread(KernelMode as i8, false, &interval) };
    }

    /// ZwAllocateVirtualMemory in the current process (START_DEVICE runs in a system thread, so the System
    /// process): committed, pageable, user-mode memory, as a user buffer an application passes in would be.
    fn alloc_user_buffer(&self, len: u32, in_page_offset: u64) -> PVOID {
        let offset = in_page_offset % PAGE;
        let mut base: *mut c_void = core::ptr::null_mut();
        let mut size = (len as u64 + offset) as usize;
        // SAFETY: PASSIVE_LEVEL, no lock held (ZwAllocateVirtualMemory's rule); base and size are ours.
        let status = unsafe {
            ZwAllocateVirtualMemory(
                CURRENT_PROCESS as _,
                &mut base,
                0,
                &mut size,
                MEM_COMMIT | MEM_RESERVE,
                PAGE_READWRITE,
            )
        };
        if status < 0 || base.is_null() {
            return PVOID::NULL;
        }
        PVOID(base as u64 + offset)
    }

    fn free_user_buffer(&self, va: PVOID) {
        let mut base = (va.0 - va.0 % PAGE) as *mut c_void;
        let mut size = 0usize;
        // SAFETY: PASSIVE_LEVEL, no lock held; MEM_RELEASE of the allocation's base with size 0 frees all of it.
        unsafe { ZwFreeVirtualMemory(CURRENT_PROCESS as _, &mut base, &mut size, MEM_RELEASE) };
    }
}
