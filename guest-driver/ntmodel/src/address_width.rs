//! How far a DMA device reaches: its address width as IoGetDmaAdapter reads DEVICE_DESCRIPTION, and whether a
//! mapping of the buffer's own pages lies within it (else the transfer bounces through map registers).

use vhca_ntapi::{DEVICE_DESCRIPTION, DEVICE_DESCRIPTION_VERSION3};

use crate::sg_split::DeviceRun;
use crate::PAGE;

/// The device's address width in bits. Version 3 gives it in DmaAddressWidth; versions 0 to 2 (and a version 3
/// description that leaves it 0, which the DEVICE_DESCRIPTION page does not cover) say it with the flags:
/// Dma64BitAddresses 64, else 32 (Dma32BitAddresses, or a PCI bus master that sets neither: PCI's own addresses
/// are 32 bits wide).
pub(crate) fn address_width(desc: &DEVICE_DESCRIPTION) -> u32 {
    if desc.Version >= DEVICE_DESCRIPTION_VERSION3 && desc.DmaAddressWidth != 0 {
        return desc.DmaAddressWidth.min(64);
    }
    if desc.Dma64BitAddresses {
        64
    } else {
        32
    }
}

/// The first device address a device of `width` bits cannot put on the bus; None: it reaches every address.
pub(crate) fn reach(width: u32) -> Option<u64> {
    (width < 64).then(|| 1u64 << width)
}

/// Whether every page of `runs` lies below `reach`: the device can be handed the buffer's own pages.
pub(crate) fn within_reach(runs: &[DeviceRun], reach: Option<u64>) -> bool {
    let Some(limit) = reach else { return true };
    runs.iter().all(|r| r.iova.checked_add(r.pages as u64 * PAGE).is_some_and(|end| end <= limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn described(version: u32, width: u32, dma32: bool, dma64: bool) -> DEVICE_DESCRIPTION {
        DEVICE_DESCRIPTION {
            Version: version,
            DmaAddressWidth: width,
            Dma32BitAddresses: dma32,
            Dma64BitAddresses: dma64,
            ..DEVICE_DESCRIPTION::bus_master_64(4096)
        }
    }

    #[test]
    fn version_3_reads_dma_address_width_and_older_versions_read_the_flags() {
        assert_eq!(address_width(&described(3, 36, true, true)), 36);
        assert_eq!(address_width(&described(3, 0, true, false)), 32, "version 3 without a width: the flags");
        assert_eq!(address_width(&described(2, 36, true, true)), 64, "version 2 has no DmaAddressWidth");
        assert_eq!(address_width(&described(2, 0, true, false)), 32);
        assert_eq!(address_width(&described(1, 0, false, false)), 32, "a PCI bus master with neither flag");
    }

    #[test]
    fn a_run_past_the_limit_is_out_of_reach() {
        let run = |iova| DeviceRun { va: 0, len: 4096, iova, pages: 1 };
        assert!(within_reach(&[run(0xFFFF_F000)], reach(32)));
        assert!(!within_reach(&[run(0xFFFF_F000), run(0x1_0000_0000)], reach(32)));
        assert!(within_reach(&[run(u64::MAX - 0xFFF)], reach(64)));
    }
}
