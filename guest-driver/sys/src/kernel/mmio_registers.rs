//! The device's BARs as the transport reaches them in Windows: mapped by MmMapIoSpaceEx at START_DEVICE, accessed
//! with volatile loads and stores (what READ_REGISTER_* / WRITE_REGISTER_* compile to on x64), bounds-checked.
//! Also the transport's waits: delays measured on the interrupt-time clock.

use core::fmt;
use core::time::Duration;

use vhca_virtio::{PollWait, Registers};
use windows_sys::Wdk::System::SystemServices::{
    KeDelayExecutionThread, KeQueryInterruptTimePrecise, KeStallExecutionProcessor, KernelMode,
};

/// An access outside the mapped BAR.
#[derive(Debug, Clone, Copy)]
pub struct OutsideBar {
    pub offset: u64,
    pub width: u64,
    pub size: u64,
}

impl fmt::Display for OutsideBar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-byte access at {:#x} outside the {:#x}-byte BAR mapping", self.width, self.offset, self.size)
    }
}

/// One BAR mapped uncached into system space.
#[derive(Debug, Clone, Copy)]
pub struct MmioBar {
    base: *mut u8,
    size: u64,
}

// SAFETY: device registers may be accessed from any processor; the transport serialises its own accesses.
unsafe impl Send for MmioBar {}
// SAFETY: as above.
unsafe impl Sync for MmioBar {}

impl MmioBar {
    /// # Safety
    /// `base` maps `size` bytes of the device's BAR (MmMapIoSpaceEx) and stays mapped while the value is used.
    pub unsafe fn new(base: *mut u8, size: u64) -> MmioBar {
        MmioBar { base, size }
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    fn at(&self, offset: u64, width: u64) -> Result<*mut u8, OutsideBar> {
        match offset.checked_add(width) {
            Some(end) if end <= self.size && offset % width == 0 => Ok(self.base.wrapping_add(offset as usize)),
            _ => Err(OutsideBar { offset, width, size: self.size }),
        }
    }
}

macro_rules! mmio {
    ($read:ident, $write:ident, $t:ty) => {
        fn $read(&self, offset: u64) -> Result<$t, OutsideBar> {
            let p = self.at(offset, core::mem::size_of::<$t>() as u64)?;
            // SAFETY: inside the mapping and naturally aligned (checked); device memory is read volatile.
            Ok(unsafe { core::ptr::read_volatile(p.cast::<$t>()) })
        }
        fn $write(&self, offset: u64, value: $t) -> Result<(), OutsideBar> {
            let p = self.at(offset, core::mem::size_of::<$t>() as u64)?;
            // SAFETY: as above, for a store.
            unsafe { core::ptr::write_volatile(p.cast::<$t>(), value) };
            Ok(())
        }
    };
}

impl Registers for MmioBar {
    type Error = OutsideBar;
    fn size(&self) -> u64 {
        self.size
    }
    mmio!(read_u8, write_u8, u8);
    mmio!(read_u16, write_u16, u16);
    mmio!(read_u32, write_u32, u32);
}

/// Waits between polls of the device until `limit` of interrupt time has passed. For the first SPIN_BUDGET of a
/// wait it stalls the processor in 10 µs steps (KeStallExecutionProcessor, any IRQL; Microsoft's page asks for
/// stalls of at most 50 µs per call): a command usually completes within that, and a sleep would add at least a
/// timer tick (1 ms here, up to 15.6 ms on Windows' default clock) to every command. After the budget, below
/// DISPATCH_LEVEL the thread sleeps (KeDelayExecutionThread, 1 ms); at DISPATCH_LEVEL it may only keep stalling, as
/// Microsoft's pages allow at each level.
pub struct KernelWait {
    limit: Duration,
    started: u64,
    deadline: u64,
}

/// How long a wait busy-polls before it sleeps between polls, in 100-ns units (200 µs).
const SPIN_BUDGET: u64 = 2_000;
/// One stall, in µs.
const STALL_US: u32 = 10;

/// 100-ns units, the interrupt-time clock's.
pub fn now() -> u64 {
    // SAFETY: any IRQL; the optional QPC timestamp is not wanted.
    unsafe { KeQueryInterruptTimePrecise(core::ptr::null_mut()) }
}

impl KernelWait {
    pub fn after(limit: Duration) -> KernelWait {
        let started = now();
        KernelWait { limit, started, deadline: started.saturating_add((limit.as_nanos() / 100) as u64) }
    }
}

const DISPATCH_LEVEL: u8 = 2;

impl PollWait for KernelWait {
    fn pause(&mut self) -> bool {
        let at = now();
        if at >= self.deadline {
            return false;
        }
        if at.saturating_sub(self.started) >= SPIN_BUDGET && super::irql::current() < DISPATCH_LEVEL {
            // Relative time: negative, in 100-ns units.
            let interval: i64 = -10_000;
            // SAFETY: IRQL <= APC_LEVEL, kernel mode, not alertable (KeDelayExecutionThread's rules).
            unsafe { KeDelayExecutionThread(KernelMode as i8, false, &interval) };
        } else {
            // SAFETY: any IRQL; a short stall.
            unsafe { KeStallExecutionProcessor(STALL_US) };
        }
        true
    }

    fn limit(&self) -> Duration {
        self.limit
    }
}
