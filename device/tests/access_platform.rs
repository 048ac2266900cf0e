//! `--no-access-platform`: the device offers every feature but VIRTIO_F_ACCESS_PLATFORM (bit 33), as a device that
//! bypasses the IOMMU does (QEMU's iommu_platform=off); by default it offers the bit.

mod common;

use common::*;

fn offered(extra: &[&str]) -> u64 {
    let device = Device::spawn(extra);
    let mut stream = device.connect();
    send(&stream, SET_OWNER, 0, &[], &[]);
    get_u64(&mut stream, GET_FEATURES)
}

#[test]
fn the_device_offers_access_platform_unless_told_not_to() {
    let with = offered(&[]);
    assert_eq!(with & ACCESS_PLATFORM, ACCESS_PLATFORM, "{with:#x}");
    let without = offered(&["--no-access-platform"]);
    assert_eq!(without & ACCESS_PLATFORM, 0, "{without:#x}");
    assert_eq!(without, with & !ACCESS_PLATFORM, "nothing else changes");
}
