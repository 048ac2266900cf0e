//! The vhost-user transport, spoken directly: message framing, the front-end request dispatcher, and the backend
//! channel used for IOTLB misses. The `vhost` crate contributes request codes and feature bits only.
//!
//! Why not vhost-user-backend: vhost 0.18 / vhost-user-backend 0.24 refuse VHOST_USER_IOTLB_MSG from the front-end
//! (rust-vmm/vhost issue 312, "Support for iommu in vhost-user-backend", open), so QEMU with iommu_platform=on
//! cannot get past set-up; and their memory handling maps regions by guest-physical address, while behind
//! intel-iommu every ring and buffer address is an IOVA that must go through the IOTLB (`crate::iommu`). Before
//! moving to vhost-user-backend, check that a released version (1) accepts IOTLB_MSG UPDATE/INVALIDATE and lets the
//! backend send IOTLB_MISS on the backend channel, (2) translates vring and descriptor addresses through a
//! vm-memory `Iommu` (IOVA-keyed), not the GPA-keyed mem table, and (3) lets a chain that misses be put back and
//! retried after the UPDATE, as `crate::queue_worker` parks it; then the device tests (tests/vhost_user.rs,
//! tests/robustness.rs) and the fuzz target `vhost_user_connection` must pass unchanged against it.

pub mod backend;
pub mod connection;
pub mod framing;
pub mod wire;
