//! A real hot-unplug of the HCA mid-run, from the guest's side: the program asks the runner for it with a console
//! line, vfio-pci's request notifier (VFIO_PCI_REQ_IRQ_INDEX) is the kernel's word that the platform wants the
//! device back, and once the program let go of it (device fd closed, BARs unmapped) the kernel removes it.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};

use crate::report::progress;
use crate::vfio;

/// The console line the runner answers with QMP `device_del` of the HCA (runner/src/hot_unplug.rs reads the same).
pub const REQUEST_LINE: &str = "VHCA-HOT-UNPLUG";
/// How long the program waits for the kernel's request after asking. Under QEMU 10's ACPI hot-plug the guest's
/// eject begins within about 30 ms of `device_del` (docs/scenarios.md); a loaded host's TCG guest takes longer.
const NOTICE_LIMIT: Duration = Duration::from_secs(10);
/// How long the device may take to leave sysfs once the program let go: the kernel then finishes its removal and
/// the platform's eject (`_EJ0`).
const REMOVAL_LIMIT: Duration = Duration::from_secs(10);
const SYSFS_DEVICES: &str = "/sys/bus/pci/devices";
const SYSFS_SLOTS: &str = "/sys/bus/pci/slots";

/// vfio-pci's request notifier for one device: an eventfd the kernel signals when the device is to be removed
/// while this program holds it (and again every 10 s until it lets go: drivers/vfio/vfio_main.c).
pub struct RemovalRequest {
    eventfd: OwnedFd,
}

/// What the guest saw of the unplug, for the report's `details.hot_unplug`.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct UnplugSeen {
    /// From the request line to vfio-pci's request.
    pub notice_ms: f64,
    /// From the program letting go to the device gone from sysfs.
    pub removed_ms: Option<f64>,
    /// The first 32 bits of each memory BAR read through /dev/mem once the kernel removed the device (or why they
    /// could not be read): the function is still on the bus then, since the platform's eject follows the removal.
    pub bars_at_removal: Vec<String>,
    /// From the kernel's removal to the platform's eject: the slot's `adapter` reading 0 (acpiphp evaluates the
    /// slot's _STA for it, which QEMU answers from its own hot-plug state, so QEMU has deleted the HCA by then).
    pub ejected_ms: Option<f64>,
    /// The same reads once the HCA was ejected.
    pub bars_after_eject: Vec<String>,
}

impl RemovalRequest {
    /// Registers the request eventfd with vfio-pci. Without one the kernel's removal blocks until the program
    /// happens to close the device ("No device request channel registered, blocked until released by user").
    pub fn arm(device: &vfio::Device) -> anyhow::Result<RemovalRequest> {
        let info = device.irq_info(vfio::REQ_IRQ_INDEX).context("request notifier")?;
        ensure!(info.count >= 1 && info.signals_eventfds(), "vfio-pci offers no request notifier for this device");
        let eventfd = crate::msix_vectors::eventfd().context("request notifier eventfd")?;
        device.set_irq_eventfds(vfio::REQ_IRQ_INDEX, &[eventfd.as_fd()]).context("request notifier")?;
        Ok(RemovalRequest { eventfd })
    }

    /// Asks the runner for the unplug, then waits for the kernel's request; returns how long it took.
    pub fn ask_and_wait(&self) -> anyhow::Result<Duration> {
        use std::io::Write;
        let asked = Instant::now();
        println!("{REQUEST_LINE}");
        let _ = std::io::stdout().flush();
        loop {
            let left = NOTICE_LIMIT.saturating_sub(asked.elapsed());
            ensure!(!left.is_zero(), "no removal request from vfio-pci within {} s", NOTICE_LIMIT.as_secs());
            let mut fd = libc::pollfd { fd: self.eventfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            let ms = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX).max(1);
            // SAFETY: one live pollfd, borrowed for the call.
            let n = unsafe { libc::poll(&mut fd, 1, ms) };
            if n > 0 && fd.revents & libc::POLLIN != 0 {
                let mut count = 0u64;
                // SAFETY: reads the eventfd's 8-byte counter into a live u64.
                unsafe { libc::read(fd.fd, (&mut count as *mut u64).cast(), 8) };
                let took = asked.elapsed();
                progress(format_args!("vfio-pci: removal request after {:.1} ms", took.as_secs_f64() * 1000.0));
                return Ok(took);
            }
        }
    }
}

/// Hands the request to the loader's PnP manager as its bus driver's removal notice (`vhca.pnp=hot-unplug` under
/// vhca.sys): the PnP manager asks for the unplug and waits there before IRP_MN_SURPRISE_REMOVAL. The returned
/// cell gets how long the notice took.
pub fn plan_for_pnp_manager(request: RemovalRequest) -> Arc<Mutex<Option<Duration>>> {
    let took = Arc::new(Mutex::new(None));
    let cell = took.clone();
    vhca_loader::pnp_sequence::plan_removal_notice(Box::new(move || {
        let waited = request.ask_and_wait().map_err(|e| format!("{e:#}"))?;
        *cell.lock().unwrap_or_else(|e| e.into_inner()) = Some(waited);
        Ok(())
    }));
    took
}

/// The device's memory BARs as sysfs lists them (`resource`: start, end and flags per line; IORESOURCE_MEM is
/// 0x200), read before the device goes.
pub fn memory_bars(address: &str) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(Path::new(SYSFS_DEVICES).join(address).join("resource")).unwrap_or_default();
    parse_memory_bars(&text)
}

fn parse_memory_bars(text: &str) -> Vec<(u64, u64)> {
    const IORESOURCE_MEM: u64 = 0x200;
    let hex = |w: &str| u64::from_str_radix(w.trim_start_matches("0x"), 16).ok();
    // The six BARs come first (then the ROM and the bridge windows).
    text.lines()
        .take(6)
        .filter_map(|line| {
            let words: Vec<u64> = line.split_whitespace().filter_map(hex).collect();
            match words[..] {
                [start, end, flags] if flags & IORESOURCE_MEM != 0 && end > start => Some((start, end - start + 1)),
                _ => None,
            }
        })
        .collect()
}

/// After the program let go: waits for the kernel's removal and then the platform's eject, and reads each former
/// BAR through /dev/mem after each.
pub fn after_release(address: &str, bars: &[(u64, u64)], seen: &mut UnplugSeen) -> anyhow::Result<()> {
    let released = Instant::now();
    let path = Path::new(SYSFS_DEVICES).join(address);
    while path.exists() {
        ensure!(
            released.elapsed() < REMOVAL_LIMIT,
            "{address} still present {} s after release",
            REMOVAL_LIMIT.as_secs()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    seen.removed_ms = Some(released.elapsed().as_secs_f64() * 1000.0);
    let read = || bars.iter().map(|&(start, _)| read_physical(start)).collect::<Vec<_>>();
    seen.bars_at_removal = read();
    progress(format_args!(
        "{address} removed {:.1} ms after release; its BARs read {}",
        seen.removed_ms.unwrap_or(0.0),
        seen.bars_at_removal.join(", ")
    ));
    let removed = Instant::now();
    let adapter = slot_of(address).with_context(|| format!("no hot-plug slot lists {address}"))?.join("adapter");
    while std::fs::read_to_string(&adapter).map_or(true, |a| a.trim() != "0") {
        ensure!(
            removed.elapsed() < REMOVAL_LIMIT,
            "{} not 0 {} s after the removal",
            adapter.display(),
            REMOVAL_LIMIT.as_secs()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    seen.ejected_ms = Some(removed.elapsed().as_secs_f64() * 1000.0);
    seen.bars_after_eject = read();
    progress(format_args!(
        "ejected {:.1} ms after the removal; its BARs read {}",
        seen.ejected_ms.unwrap_or(0.0),
        seen.bars_after_eject.join(", ")
    ));
    Ok(())
}

/// The hot-plug slot (`/sys/bus/pci/slots/<name>`) whose `domain:bus:device` holds the function at `address`; the
/// slot outlives the device.
fn slot_of(address: &str) -> Option<std::path::PathBuf> {
    let (device, _function) = address.rsplit_once('.')?;
    std::fs::read_dir(SYSFS_SLOTS)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|slot| std::fs::read_to_string(slot.join("address")).is_ok_and(|a| a.trim() == device))
}

/// The 32 bits at a physical address, through an uncached mapping of /dev/mem (its read(2) refuses addresses that
/// are not RAM), as text.
fn read_physical(address: u64) -> String {
    let page = address & !0xfff;
    let mapped = std::fs::OpenOptions::new().read(true).write(true).open("/dev/mem").and_then(|mem| {
        let offset = libc::off_t::try_from(page).map_err(std::io::Error::other)?;
        // SAFETY: a fresh shared mapping of one page of /dev/mem at a kernel-chosen address; nothing else is touched.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ, libc::MAP_SHARED, mem.as_raw_fd(), offset)
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: inside the one page just mapped, 4-byte aligned (the offset is of a BAR's start within its
        // page); a volatile read, as of a device register. The page is unmapped right after.
        let word = unsafe { std::ptr::read_volatile(ptr.cast::<u8>().add((address - page) as usize).cast::<u32>()) };
        // SAFETY: the mapping made above, not used after.
        unsafe { libc::munmap(ptr, 4096) };
        Ok(word)
    });
    match mapped {
        Ok(word) => format!("{address:#x}: {word:#010x}"),
        Err(e) => format!("{address:#x}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_bars_are_the_memory_lines_of_the_six() {
        let text = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                    0x00000000fe800000 0x00000000fe800fff 0x0000000000040200\n\
                    0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                    0x000000000000c000 0x000000000000c03f 0x0000000000040101\n\
                    0x000000fe00000000 0x000000fe00003fff 0x000000000014220c\n\
                    0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                    0x00000000fe840000 0x00000000fe87ffff 0x0000000000046200\n";
        assert_eq!(parse_memory_bars(text), [(0xfe80_0000, 0x1000), (0xfe_0000_0000, 0x4000)]);
    }
}
