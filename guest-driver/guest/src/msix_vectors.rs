//! A VFIO device's MSI-X table entries as eventfds: enabled with one eventfd per entry, disabled again when dropped
//! (the device's MSI-X off, the eventfds closed), so a run's process leaves no interrupt set up behind it.

use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::vfio::{Device, IrqInfo, VfioError, MSIX_IRQ_INDEX};

#[derive(Debug, thiserror::Error)]
pub enum MsixError {
    #[error(transparent)]
    Vfio(#[from] VfioError),
    #[error("the device has no MSI-X table (VFIO reports {0} MSI-X interrupts)")]
    NoTable(u32),
    #[error("VFIO cannot signal the device's MSI-X interrupts through eventfds (flags {0:#x})")]
    NoEventfds(u32),
    #[error("{wanted} MSI-X entries wanted, the device's table has {table}")]
    TooMany { wanted: u32, table: u32 },
    #[error("eventfd: {0}")]
    Eventfd(std::io::Error),
}

/// How many MSI-X table entries the device has, as VFIO reports it.
pub fn table_entries(device: &Device) -> Result<IrqInfo, MsixError> {
    let info = device.irq_info(MSIX_IRQ_INDEX)?;
    if info.count == 0 {
        return Err(MsixError::NoTable(info.count));
    }
    if !info.signals_eventfds() {
        return Err(MsixError::NoEventfds(info.flags));
    }
    Ok(info)
}

/// Entries 0..n of the device's MSI-X table, each signalling its own eventfd, for as long as this lives.
#[derive(Debug)]
pub struct MsixVectors<'d> {
    device: &'d Device,
    eventfds: Vec<OwnedFd>,
}

impl<'d> MsixVectors<'d> {
    /// Enables the first `count` entries. The eventfds are non-blocking: their reader waits in poll(2), and a read
    /// that finds nothing (another reader was first) must not hang it.
    pub fn enable(device: &'d Device, count: u32) -> Result<MsixVectors<'d>, MsixError> {
        let table = table_entries(device)?.count;
        if count == 0 || count > table {
            return Err(MsixError::TooMany { wanted: count, table });
        }
        let eventfds = (0..count).map(|_| eventfd()).collect::<Result<Vec<_>, _>>().map_err(MsixError::Eventfd)?;
        let borrowed: Vec<BorrowedFd<'_>> = eventfds.iter().map(AsFd::as_fd).collect();
        device.set_irq_eventfds(MSIX_IRQ_INDEX, &borrowed)?;
        Ok(MsixVectors { device, eventfds })
    }

    pub fn len(&self) -> usize {
        self.eventfds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.eventfds.is_empty()
    }

    /// The eventfd of each entry, in entry order, for the thread that waits on them.
    pub fn eventfds(&self) -> &[OwnedFd] {
        &self.eventfds
    }
}

impl Drop for MsixVectors<'_> {
    /// MSI-X off before the eventfds close: vfio-pci then holds no reference to them, and the device sends nothing.
    fn drop(&mut self) {
        if let Err(e) = self.device.disable_irqs(MSIX_IRQ_INDEX) {
            crate::report::progress(format_args!("MSI-X disable: {e}"));
        }
    }
}

/// A new eventfd, close-on-exec and non-blocking.
pub(crate) fn eventfd() -> std::io::Result<OwnedFd> {
    // SAFETY: eventfd(2) takes two integers and returns a new descriptor or -1; nothing else is touched.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
