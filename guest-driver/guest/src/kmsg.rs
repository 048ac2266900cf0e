//! The kernel log lines that judge DMA: IOMMU (DMAR) faults and VFIO complaints, read from /dev/kmsg.
//! A run that completed but made the IOMMU fault is not a pass, so the report carries these lines.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Mutex;

/// The log of a run that is not its guest's first (`scope_to_run`): what was logged since its request, gathered
/// as it grows. A guest that serves several runs keeps one kernel log; each run judges only its own records, as a
/// run on a freshly booted or restored guest does.
static RUN_SCOPE: Mutex<Option<(KmsgFollower, Vec<String>)>> = Mutex::new(None);

/// From now on `iommu_lines` returns only what `follower` (opened at the run's request) reads.
pub fn scope_to_run(follower: KmsgFollower) {
    if let Ok(mut scope) = RUN_SCOPE.lock() {
        *scope = Some((follower, Vec::new()));
    }
}

/// Kernel log records mentioning the IOMMU or VFIO, oldest first, at most `limit`: the whole log, or a later run's
/// own records (`scope_to_run`).
pub fn iommu_lines(limit: usize) -> Vec<String> {
    if let Ok(mut scope) = RUN_SCOPE.lock() {
        if let Some((follower, lines)) = scope.as_mut() {
            lines.extend(follower.new_iommu_lines());
            return lines.iter().take(limit).cloned().collect();
        }
    }
    let Ok(mut kmsg) = open_kmsg() else {
        return Vec::new();
    };
    read_iommu_records(&mut kmsg, limit)
}

fn open_kmsg() -> std::io::Result<File> {
    OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open("/dev/kmsg")
}

/// Reads records from `kmsg` until none is left, keeping the IOMMU ones (at most `limit`).
fn read_iommu_records(kmsg: &mut File, limit: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut record = vec![0u8; 8192];
    // Each read returns one record; EAGAIN ends the log, EPIPE means records were overwritten (keep going).
    for _ in 0..100_000 {
        match kmsg.read(&mut record) {
            Ok(0) => break,
            Ok(n) => {
                let text = String::from_utf8_lossy(&record[..n]);
                let message = text.split_once(';').map_or(&*text, |(_, m)| m).lines().next().unwrap_or("").trim();
                if is_iommu_line(message) && lines.len() < limit {
                    lines.push(message.to_string());
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    lines
}

/// The kernel log followed as it grows: /dev/kmsg stays open, so each look reads only the records logged since the
/// last one (a fresh open reads the whole log, hundreds of records and as many system calls: under TCG a look every
/// 20 ms that way took a noticeable share of the guest's one vCPU).
pub struct KmsgFollower {
    kmsg: Option<File>,
}

impl KmsgFollower {
    /// Follows only what is logged from now on: the records already in the log are skipped with one seek to its
    /// end (/dev/kmsg's SEEK_END), not read one system call each.
    pub fn from_now() -> KmsgFollower {
        let mut kmsg = open_kmsg().ok();
        if let Some(file) = &mut kmsg {
            if std::io::Seek::seek(file, std::io::SeekFrom::End(0)).is_err() {
                // A kernel whose /dev/kmsg cannot seek: read the old records once, and drop them.
                drop(read_iommu_records(file, 0));
            }
        }
        KmsgFollower { kmsg }
    }

    /// The IOMMU records logged since the last call; the first call returns those already in the log.
    pub fn new_iommu_lines(&mut self) -> Vec<String> {
        match &mut self.kmsg {
            Some(kmsg) => read_iommu_records(kmsg, usize::MAX),
            None => Vec::new(),
        }
    }
}

/// The IOMMU faults among `lines` caused by the device at `address` (`0000:01:00.0`); faults of other requesters are
/// not the run's (q35's AHCI controller, which no driver owned, faulted once on every restore as QEMU loaded its state,
/// until the runner turned it off; another built-in device could do the same).
/// A fault line that names no requester counts.
pub fn count_faults(lines: &[String], address: Option<&str>) -> usize {
    // The kernel names the requester as [bus:dev.fn], without the PCI domain.
    let requester = address.map(|a| a.split_once(':').map_or(a, |(_, rest)| rest).to_ascii_lowercase());
    lines
        .iter()
        .filter(|l| l.contains("DMAR") && l.contains("fault addr"))
        .filter(|l| {
            let named = l.split_once("Request device [").and_then(|(_, rest)| rest.split_once(']'));
            match (named, &requester) {
                (Some((who, _)), Some(want)) => who.eq_ignore_ascii_case(want),
                _ => true,
            }
        })
        .count()
}

/// One DMAR fault record as the kernel logs it: `DMAR: [DMA Write NO_PASID] Request device [01:00.0] fault addr
/// 0x1000000000 [fault reason 0x05] PTE Write access is not set`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmarFault {
    /// The address the IOMMU refused (the device's IOVA).
    pub address: u64,
    /// VT-d's fault reason code: Windows' 0xE6/0x26 parameter 4 ("fault type, hardware specific").
    pub reason: u64,
    pub write: bool,
}

/// The DMAR fault records among `lines` caused by the device at `address` (as `count_faults` picks them), in order.
/// A line whose address or reason does not parse is skipped: the kernel's text is not trusted blindly.
pub fn dmar_faults(lines: &[String], address: Option<&str>) -> Vec<DmarFault> {
    lines
        .iter()
        .filter(|l| count_faults(std::slice::from_ref(*l), address) == 1)
        .filter_map(|l| parse_fault(l))
        .collect()
}

fn parse_fault(line: &str) -> Option<DmarFault> {
    let hex_after = |mark: &str| {
        let rest = line.split_once(mark)?.1.trim_start();
        let digits = rest.strip_prefix("0x")?;
        let end = digits.find(|c: char| !c.is_ascii_hexdigit()).unwrap_or(digits.len());
        u64::from_str_radix(&digits[..end], 16).ok()
    };
    Some(DmarFault {
        address: hex_after("fault addr")?,
        reason: hex_after("fault reason")?,
        write: line.contains("[DMA Write"),
    })
}

fn is_iommu_line(message: &str) -> bool {
    message.contains("DMAR") && (message.contains("fault") || message.contains("Fault")) || message.starts_with("vfio")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_fault_lines_only() {
        assert!(is_iommu_line(
            "DMAR: [DMA Write NO_PASID] Request device [01:00.0] fault addr 0x1000000000 [fault reason 0x05]"
        ));
        assert!(is_iommu_line("vfio-pci 0000:01:00.0: enabling device (0000 -> 0002)"));
        assert!(!is_iommu_line("DMAR: IOMMU enabled"));
        assert!(!is_iommu_line("virtio_blk virtio0: [vda] 4096 512-byte logical blocks"));
    }

    #[test]
    fn parses_the_fault_address_and_reason_of_the_devices_own_faults() {
        let lines: Vec<String> = [
            "DMAR: [DMA Write NO_PASID] Request device [00:1f.2] fault addr 0x1ffdf000 [fault reason 0x05]",
            "DMAR: [DMA Write NO_PASID] Request device [01:00.0] fault addr 0x1000003000 [fault reason 0x05] PTE Write \
             access is not set",
            "DMAR: [DMA Read NO_PASID] Request device [01:00.0] fault addr 0xzz [fault reason 0x06]",
        ]
        .map(String::from)
        .to_vec();
        let faults = dmar_faults(&lines, Some("0000:01:00.0"));
        assert_eq!(faults, vec![DmarFault { address: 0x10_0000_3000, reason: 5, write: true }]);
    }

    #[test]
    fn counts_only_the_devices_own_faults() {
        let lines: Vec<String> = [
            "DMAR: DRHD: handling fault status reg 2",
            "DMAR: [DMA Write NO_PASID] Request device [00:1f.2] fault addr 0x1ffdf000 [fault reason 0x05]",
            "DMAR: [DMA Write NO_PASID] Request device [01:00.0] fault addr 0x1000000000 [fault reason 0x05]",
            "DMAR: [DMA Read NO_PASID] fault addr 0x2000 [fault reason 0x06]",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(count_faults(&lines, Some("0000:01:00.0")), 2, "its own fault and the unnamed one");
        assert_eq!(count_faults(&lines, Some("0000:02:00.0")), 1);
        assert_eq!(count_faults(&lines, None), 3);
    }
}
