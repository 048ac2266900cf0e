//! The kernel services vhca.sys's scenario host needs beyond the WDK shim: the debugger for progress, the interrupt
//! clock, delays, and user buffers (virtual memory in the current process's user address space).

use core::ffi::c_void;
use core::marker::PhantomData;
use core::time::Duration;

use vhca_ntapi::PVOID;
use windows_sys::Wdk::System::SystemServices::{KeDelayExecutionThread, KernelMode};

use super::debug_print::print_line;
use super::kernel_imports::{ZwAllocateVirtualMemory, ZwFreeVirtualMemory};
use super::mmio_registers;
use super::sys_command_transport::SysCommandTransport;
use super::wdk_kernel::WdkKernel;
use crate::scenario_run::DriverServices;

/// NtCurrentProcess(): the handle wdm.h defines as -1.
const CURRENT_PROCESS: isize = -1;
const MEM_COMMIT: u32 = 0x1000;
const MEM_RESERVE: u32 = 0x2000;
const MEM_RELEASE: u32 = 0x8000;
const PAGE_READWRITE: u32 = 0x04;
const PAGE: u64 = 4096;

/// The services for one run on one started device's channel (the lifetime is the channel's borrow).
pub struct KernelServices<'a> {
    kernel: &'a WdkKernel,
    _channel: PhantomData<&'a SysCommandTransport>,
}

impl<'a> KernelServices<'a> {
    pub fn new(_channel: &'a SysCommandTransport, kernel: &'a WdkKernel) -> Self {
        KernelServices { kernel, _channel: PhantomData }
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
