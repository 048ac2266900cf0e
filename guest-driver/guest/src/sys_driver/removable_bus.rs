//! The PCI bus driver over a device the platform can take away: every call goes to the VFIO bus while the program
//! holds the device, and finds no device once the program let go of it after a hot-unplug (`release`).

use std::sync::{Arc, Mutex, MutexGuard};

use vhca_loader::io_manager::BusDriver;
use vhca_loader::windows_sys::Wdk::Foundation::IO_STACK_LOCATION;
use vhca_loader::windows_sys::Win32::Foundation::{NTSTATUS, STATUS_NO_SUCH_DEVICE};

/// The bus as the I/O manager holds it. The I/O manager lives as long as the process, so the VFIO regions it holds
/// (the BAR mappings and the device fd they keep open) would too: the kernel's removal waits for exactly those.
pub(super) struct RemovableBus<B>(Arc<Mutex<Option<B>>>);

/// The program's hold on the bus's device, to let go of it.
pub(super) struct BusHold<B>(Arc<Mutex<Option<B>>>);

impl<B: BusDriver> RemovableBus<B> {
    pub(super) fn new(bus: B) -> (RemovableBus<B>, BusHold<B>) {
        let shared = Arc::new(Mutex::new(Some(bus)));
        (RemovableBus(shared.clone()), BusHold(shared))
    }

    fn bus(&self) -> MutexGuard<'_, Option<B>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<B> BusHold<B> {
    /// Drops the bus and what it holds of the device. Only after the driver's last REMOVE: a mapping it got from
    /// `map_io_space` ends here.
    pub(super) fn release(self) {
        drop(self.0.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl<B: BusDriver> BusDriver for RemovableBus<B> {
    fn pnp(&self, stack: &IO_STACK_LOCATION) -> NTSTATUS {
        self.bus().as_ref().map_or(STATUS_NO_SUCH_DEVICE, |b| b.pnp(stack))
    }
    fn memory_resources(&self) -> Vec<(u64, u32)> {
        self.bus().as_ref().map(|b| b.memory_resources()).unwrap_or_default()
    }
    fn message_interrupts(&self) -> u32 {
        self.bus().as_ref().map_or(0, |b| b.message_interrupts())
    }
    fn map_io_space(&self, physical: u64, length: usize) -> Option<*mut u8> {
        self.bus().as_ref().and_then(|b| b.map_io_space(physical, length))
    }
    fn unmap_io_space(&self, base: *mut u8, length: usize) {
        if let Some(b) = self.bus().as_ref() {
            b.unmap_io_space(base, length)
        }
    }
    fn alias_io_space(&self, base: *mut u8, length: usize) -> Option<*mut u8> {
        self.bus().as_ref().and_then(|b| b.alias_io_space(base, length))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bus that holds a count: only its drop is looked at.
    struct Counted {
        _held: Arc<()>,
    }
    impl BusDriver for Counted {
        fn pnp(&self, _: &IO_STACK_LOCATION) -> NTSTATUS {
            0
        }
        fn message_interrupts(&self) -> u32 {
            4
        }
    }

    #[test]
    fn a_released_bus_is_dropped_and_answers_no_device() {
        let held = Arc::new(());
        let (bus, hold) = RemovableBus::new(Counted { _held: held.clone() });
        assert_eq!(bus.message_interrupts(), 4);
        assert_eq!(Arc::strong_count(&held), 2);
        hold.release();
        assert_eq!(Arc::strong_count(&held), 1, "what the bus held is gone");
        assert_eq!(bus.message_interrupts(), 0);
        // SAFETY: an all-zero IO_STACK_LOCATION is a valid value of the plain C struct.
        let stack: IO_STACK_LOCATION = unsafe { std::mem::zeroed() };
        assert_eq!(bus.pnp(&stack), STATUS_NO_SUCH_DEVICE);
    }
}
