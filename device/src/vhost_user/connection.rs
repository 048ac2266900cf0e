//! The front-end connection: reads QEMU's requests one by one, validates each (size, fd count, queue index, ranges)
//! and applies it to the shared device state. Any malformed request ends the connection with an error naming it.
//! This thread never waits on the queue worker for long and never touches the HCA.

use std::io;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vhca_proto::NUM_QUEUES;
use vhost::vhost_user::message::{FrontendReq, VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use virtio_bindings::virtio_config::{VIRTIO_F_ACCESS_PLATFORM, VIRTIO_F_VERSION_1};
use virtio_queue::QueueT;
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use super::backend::BackendChannel;
use super::framing::{read_message, write_reply, FramingError, Message};
use super::wire::{
    ConfigHeader, IotlbMsg, MemoryHeader, MemoryRegion, VringAddr, VringState, FLAG_NEED_REPLY, IOTLB_ACCESS_FAIL,
    IOTLB_INVALIDATE, IOTLB_UPDATE, VRING_INDEX_MASK, VRING_NOFD_MASK,
};
use crate::event_log::{perm_name, TransportEvent};
use crate::iommu::{perm_from_vhost, IotlbError};
use crate::memory::{map_regions, MemTable, RegionDesc, RegionError};
use crate::shared::Shared;
use crate::vring::check_pollable;

/// virtio-bindings numbers feature bits; the feature words carry them as masks.
const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
const ACCESS_PLATFORM: u64 = 1 << VIRTIO_F_ACCESS_PLATFORM;
pub const OFFERED_FEATURES: u64 = VERSION_1 | ACCESS_PLATFORM | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();

/// What the device offers: OFFERED_FEATURES, less VIRTIO_F_ACCESS_PLATFORM for a device started without it.
pub fn offered_features(access_platform: bool) -> u64 {
    if access_platform {
        OFFERED_FEATURES
    } else {
        OFFERED_FEATURES & !ACCESS_PLATFORM
    }
}

/// QEMU needs BACKEND_REQ and REPLY_ACK for iommu_platform=on, CONFIG for the config space, MQ for 4 queues.
pub fn offered_protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::BACKEND_REQ
        | VhostUserProtocolFeatures::CONFIG
}

/// QEMU's baseline number of memory regions (without CONFIGURE_MEM_SLOTS).
pub const MAX_MEM_REGIONS: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error(transparent)]
    Framing(#[from] FramingError),
    #[error("unknown request code {0}")]
    UnknownRequest(u32),
    #[error("unsupported request {0:?}")]
    Unsupported(FrontendReq),
    #[error("{request:?}: bad payload size {got}, expected {expected}")]
    BadSize { request: FrontendReq, expected: usize, got: usize },
    #[error("{request:?}: wrong fd count {got}, expected {expected}")]
    WrongFdCount { request: FrontendReq, expected: usize, got: usize },
    #[error("{request:?}: queue index {index} out of range (the device has {NUM_QUEUES} queues)")]
    QueueIndex { request: FrontendReq, index: u64 },
    #[error("{request:?}: unknown flag bits in {value:#x}")]
    VringFlags { request: FrontendReq, value: u64 },
    #[error("SET_MEM_TABLE: {0} regions, expected 1 to {MAX_MEM_REGIONS}")]
    RegionCount(u32),
    #[error("SET_MEM_TABLE: bad region: {0}")]
    BadRegion(#[from] RegionError),
    #[error("SET_VRING_NUM: queue {index}: size {num} is not a power of two from 1 to {max}")]
    QueueSize { index: u32, num: u32, max: u16 },
    #[error("SET_VRING_BASE: queue {index}: base {num} does not fit a 16-bit ring index")]
    QueueBase { index: u32, num: u32 },
    #[error("SET_VRING_ADDR: queue {index}: {ring} address {addr:#x} {why}")]
    RingAddress { index: u32, ring: &'static str, addr: u64, why: &'static str },
    #[error("SET_VRING_ENABLE: queue {index}: enable value {num} is not 0 or 1")]
    EnableValue { index: u32, num: u32 },
    #[error("SET_FEATURES: {acked:#x} includes features never offered ({extra:#x})")]
    Features { acked: u64, extra: u64 },
    #[error("SET_PROTOCOL_FEATURES: {acked:#x} includes protocol features never offered ({extra:#x})")]
    ProtocolFeatures { acked: u64, extra: u64 },
    #[error("IOTLB_MSG: {0}")]
    Iotlb(#[from] IotlbError),
    #[error("IOTLB_MSG: message type {0} is not UPDATE, INVALIDATE or ACCESS_FAIL")]
    IotlbType(u8),
    #[error("IOTLB_MSG before VIRTIO_F_ACCESS_PLATFORM was negotiated")]
    IotlbWithoutIommu,
    #[error("{request:?}: offset {offset} + size {size} is outside the {len}-byte config space")]
    ConfigRange { request: FrontendReq, offset: u32, size: u32, len: usize },
    #[error("cannot send reply to {request:?}: {source}")]
    Reply { request: FrontendReq, source: io::Error },
    #[error("{request:?}: {source}")]
    Setup { request: FrontendReq, source: io::Error },
    #[error("SET_VRING_KICK: queue {index}: the kick fd cannot be polled: {source}")]
    KickNotPollable { index: usize, source: io::Error },
}

enum Reply {
    /// Success (0) or failure status, sent only when the front-end asked for an ack.
    Ack(u64),
    /// The request's own reply.
    Payload(Vec<u8>),
}

pub struct Frontend {
    stream: UnixStream,
    shared: Arc<Shared>,
    config: Vec<u8>,
    acked_features: u64,
    acked_protocol: VhostUserProtocolFeatures,
    mem_table: MemTable,
    /// The virtio features GET_FEATURES answers and SET_FEATURES may ack.
    offered: u64,
}

impl Frontend {
    pub fn new(stream: UnixStream, shared: Arc<Shared>, config: Vec<u8>) -> Frontend {
        Frontend {
            stream,
            shared,
            config,
            acked_features: 0,
            acked_protocol: VhostUserProtocolFeatures::empty(),
            mem_table: MemTable::default(),
            offered: OFFERED_FEATURES,
        }
    }

    /// Offers `features` instead of OFFERED_FEATURES (`offered_features`).
    pub fn offering(mut self, features: u64) -> Frontend {
        self.offered = features;
        self
    }

    /// Serves requests until the front-end closes the socket (`Ok`) or sends something malformed (`Err`).
    pub fn serve(&mut self) -> Result<(), ProtocolError> {
        while self.serve_one()? {}
        Ok(())
    }

    /// Reads, applies and answers one request; `Ok(false)` when the front-end closed the socket instead.
    pub fn serve_one(&mut self) -> Result<bool, ProtocolError> {
        let Some(msg) = read_message(&mut self.stream)? else {
            return Ok(false);
        };
        let code = msg.header.request;
        let need_reply = msg.header.flags & FLAG_NEED_REPLY != 0;
        let request = FrontendReq::try_from(code).map_err(|()| ProtocolError::UnknownRequest(code))?;
        tracing::debug!("front-end request {request:?} ({} bytes, {} fds)", msg.payload.len(), msg.fds.len());
        let reply = self.dispatch(request, msg)?;
        let bytes = match reply {
            Reply::Payload(bytes) => Some(bytes),
            Reply::Ack(status) if need_reply && self.acked_protocol.contains(VhostUserProtocolFeatures::REPLY_ACK) => {
                Some(status.to_ne_bytes().to_vec())
            }
            Reply::Ack(_) => None,
        };
        if let Some(bytes) = bytes {
            write_reply(&mut self.stream, code, &bytes).map_err(|source| ProtocolError::Reply { request, source })?;
        }
        Ok(true)
    }

    fn iommu_platform(&self) -> bool {
        self.acked_features & ACCESS_PLATFORM != 0
    }

    fn dispatch(&mut self, request: FrontendReq, msg: Message) -> Result<Reply, ProtocolError> {
        match request {
            FrontendReq::GET_FEATURES => {
                expect_empty(request, &msg)?;
                Ok(Reply::Payload(self.offered.to_ne_bytes().to_vec()))
            }
            FrontendReq::SET_FEATURES => {
                let acked = expect_u64(request, &msg)?;
                let extra = acked & !self.offered;
                if extra != 0 {
                    return Err(ProtocolError::Features { acked, extra });
                }
                self.acked_features = acked;
                tracing::info!("features negotiated: {acked:#x}");
                Ok(Reply::Ack(0))
            }
            FrontendReq::GET_PROTOCOL_FEATURES => {
                expect_empty(request, &msg)?;
                Ok(Reply::Payload(offered_protocol_features().bits().to_ne_bytes().to_vec()))
            }
            FrontendReq::SET_PROTOCOL_FEATURES => {
                let acked = expect_u64(request, &msg)?;
                let extra = acked & !offered_protocol_features().bits();
                if extra != 0 {
                    return Err(ProtocolError::ProtocolFeatures { acked, extra });
                }
                self.acked_protocol = VhostUserProtocolFeatures::from_bits_truncate(acked);
                tracing::info!("protocol features negotiated: {acked:#x}");
                Ok(Reply::Ack(0))
            }
            FrontendReq::SET_OWNER => {
                expect_empty(request, &msg)?;
                Ok(Reply::Ack(0))
            }
            FrontendReq::RESET_OWNER => {
                expect_empty(request, &msg)?;
                for index in 0..self.shared.vrings.len() {
                    self.shared.with_vring(index, |vring| vring.reset());
                    self.shared.set_call(index, None);
                }
                self.kicks_changed();
                Ok(Reply::Ack(0))
            }
            FrontendReq::GET_QUEUE_NUM => {
                expect_empty(request, &msg)?;
                Ok(Reply::Payload(u64::from(NUM_QUEUES).to_ne_bytes().to_vec()))
            }
            FrontendReq::SET_MEM_TABLE => self.set_mem_table(request, msg),
            FrontendReq::SET_VRING_NUM => {
                let state: VringState = expect_payload(request, &msg)?;
                let index = self.queue_index(request, u64::from(state.index))?;
                let num = state.num;
                let max = self.shared.max_queue_size;
                let valid = num.is_power_of_two() && num <= u32::from(max);
                let set =
                    valid && self.shared.with_vring(index, |v| v.queue.try_set_size(num as u16).is_ok()) == Some(true);
                if !set {
                    return Err(ProtocolError::QueueSize { index: state.index, num, max });
                }
                Ok(Reply::Ack(0))
            }
            FrontendReq::SET_VRING_ADDR => self.set_vring_addr(request, &msg),
            FrontendReq::SET_VRING_BASE => {
                let state: VringState = expect_payload(request, &msg)?;
                let index = self.queue_index(request, u64::from(state.index))?;
                let base = u16::try_from(state.num)
                    .map_err(|_| ProtocolError::QueueBase { index: state.index, num: state.num })?;
                self.shared.with_vring(index, |vring| {
                    vring.queue.set_next_avail(base);
                    vring.queue.set_next_used(base);
                });
                Ok(Reply::Ack(0))
            }
            FrontendReq::GET_VRING_BASE => {
                let state: VringState = expect_payload(request, &msg)?;
                let index = self.queue_index(request, u64::from(state.index))?;
                let base = self.shared.with_vring(index, |vring| {
                    vring.stop();
                    vring.queue.next_avail()
                });
                self.kicks_changed();
                let reply = VringState { index: state.index, num: u32::from(base.unwrap_or(0)) };
                Ok(Reply::Payload(reply.as_bytes().to_vec()))
            }
            FrontendReq::SET_VRING_KICK | FrontendReq::SET_VRING_CALL | FrontendReq::SET_VRING_ERR => {
                self.set_vring_fd(request, msg)
            }
            FrontendReq::SET_VRING_ENABLE => {
                let state: VringState = expect_payload(request, &msg)?;
                let index = self.queue_index(request, u64::from(state.index))?;
                if state.num > 1 {
                    return Err(ProtocolError::EnableValue { index: state.index, num: state.num });
                }
                self.shared.with_vring(index, |vring| vring.enabled = state.num == 1);
                self.shared.wake_worker();
                Ok(Reply::Ack(0))
            }
            FrontendReq::GET_CONFIG | FrontendReq::SET_CONFIG => self.config(request, &msg),
            FrontendReq::SET_BACKEND_REQ_FD => {
                expect_empty_payload(request, &msg)?;
                let fd = single_fd(request, msg)?;
                let reply_ack = self.acked_protocol.contains(VhostUserProtocolFeatures::REPLY_ACK);
                self.shared.set_backend(BackendChannel::new(UnixStream::from(fd)), reply_ack);
                tracing::info!("backend channel established");
                Ok(Reply::Ack(0))
            }
            FrontendReq::IOTLB_MSG => self.iotlb_msg(request, &msg),
            other => Err(ProtocolError::Unsupported(other)),
        }
    }

    fn queue_index(&self, request: FrontendReq, index: u64) -> Result<usize, ProtocolError> {
        usize::try_from(index)
            .ok()
            .filter(|i| *i < self.shared.vrings.len())
            .ok_or(ProtocolError::QueueIndex { request, index })
    }

    fn kicks_changed(&self) {
        self.shared.kicks_changed.store(true, Ordering::Release);
        self.shared.wake_worker();
    }

    fn set_mem_table(&mut self, request: FrontendReq, msg: Message) -> Result<Reply, ProtocolError> {
        let header_len = std::mem::size_of::<MemoryHeader>();
        let region_len = std::mem::size_of::<MemoryRegion>();
        let header = MemoryHeader::read_from_prefix(&msg.payload)
            .map_err(|_| ProtocolError::BadSize { request, expected: header_len, got: msg.payload.len() })?
            .0;
        let count = header.num_regions as usize;
        if count == 0 || count > MAX_MEM_REGIONS {
            return Err(ProtocolError::RegionCount(header.num_regions));
        }
        let expected = header_len + count * region_len;
        if msg.payload.len() != expected {
            return Err(ProtocolError::BadSize { request, expected, got: msg.payload.len() });
        }
        if msg.fds.len() != count {
            return Err(ProtocolError::WrongFdCount { request, expected: count, got: msg.fds.len() });
        }
        let regions: Vec<RegionDesc> = msg.payload[header_len..]
            .chunks_exact(region_len)
            .filter_map(|chunk| MemoryRegion::read_from_bytes(chunk).ok())
            .map(|r| RegionDesc {
                guest_phys_addr: r.guest_phys_addr,
                memory_size: r.memory_size,
                userspace_addr: r.userspace_addr,
                mmap_offset: r.mmap_offset,
            })
            .collect();
        let files = msg.fds.into_iter().map(std::fs::File::from).collect();
        let backend = map_regions(&regions, files)?;
        for (i, r) in regions.iter().enumerate() {
            tracing::info!(
                "mem region {i}: gpa {:#x} size {:#x} uaddr {:#x} offset {:#x}",
                r.guest_phys_addr,
                r.memory_size,
                r.userspace_addr,
                r.mmap_offset
            );
        }
        self.shared.replace_memory(backend);
        self.mem_table = MemTable { regions };
        if !self.iommu_platform() {
            // Without an IOMMU, buffer addresses are guest-physical: the "IOTLB" is the mem table itself.
            let iommu = &self.shared.iommu;
            iommu.invalidate_all();
            for r in &self.mem_table.regions {
                iommu.update(r.guest_phys_addr, r.memory_size, r.userspace_addr, vm_memory::Permissions::ReadWrite)?;
            }
        }
        self.shared.wake_worker();
        Ok(Reply::Ack(0))
    }

    fn set_vring_addr(&mut self, request: FrontendReq, msg: &Message) -> Result<Reply, ProtocolError> {
        let addr: VringAddr = expect_payload(request, msg)?;
        let index = self.queue_index(request, u64::from(addr.index))?;
        let iommu = self.iommu_platform();
        // With an IOMMU the ring addresses are IOVAs; without, QEMU addresses that we turn into guest-physical ones.
        let convert = |ring: &'static str, value: u64, align: u64| -> Result<u64, ProtocolError> {
            let bad = |why| ProtocolError::RingAddress { index: addr.index, ring, addr: value, why };
            if !value.is_multiple_of(align) {
                return Err(bad("is misaligned"));
            }
            if iommu {
                Ok(value)
            } else {
                self.mem_table.uaddr_to_gpa(value).ok_or_else(|| bad("is not in the mem table"))
            }
        };
        let desc = convert("descriptor table", addr.descriptor, 16)?;
        let avail = convert("available ring", addr.available, 2)?;
        let used = convert("used ring", addr.used, 4)?;
        let applied = self.shared.with_vring(index, |vring| {
            vring.queue.try_set_desc_table_address(GuestAddress(desc)).is_ok()
                && vring.queue.try_set_avail_ring_address(GuestAddress(avail)).is_ok()
                && vring.queue.try_set_used_ring_address(GuestAddress(used)).is_ok()
        });
        if applied != Some(true) {
            return Err(ProtocolError::RingAddress { index: addr.index, ring: "ring", addr: desc, why: "was refused" });
        }
        tracing::info!("queue {index}: desc {desc:#x} avail {avail:#x} used {used:#x}");
        Ok(Reply::Ack(0))
    }

    fn set_vring_fd(&mut self, request: FrontendReq, msg: Message) -> Result<Reply, ProtocolError> {
        let value = expect_u64(request, &msg)?;
        if value & !(VRING_INDEX_MASK | VRING_NOFD_MASK) != 0 {
            return Err(ProtocolError::VringFlags { request, value });
        }
        let index = self.queue_index(request, value & VRING_INDEX_MASK)?;
        let fd = if value & VRING_NOFD_MASK != 0 {
            if !msg.fds.is_empty() {
                return Err(ProtocolError::WrongFdCount { request, expected: 0, got: msg.fds.len() });
            }
            None
        } else {
            let fd = single_fd(request, msg)?;
            // SAFETY: we own `fd` (received over SCM_RIGHTS) and hand its ownership to the EventFd.
            Some(unsafe { EventFd::from_raw_fd(fd.into_raw_fd()) })
        };
        if let (FrontendReq::SET_VRING_KICK, Some(kick)) = (request, fd.as_ref()) {
            check_pollable(kick).map_err(|source| ProtocolError::KickNotPollable { index, source })?;
        }
        if request == FrontendReq::SET_VRING_CALL {
            self.shared.set_call(index, fd);
            return Ok(Reply::Ack(0));
        }
        let protocol_features = self.acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        self.shared.with_vring(index, |vring| match request {
            FrontendReq::SET_VRING_KICK => {
                vring.kick = fd;
                // Without protocol features a ring is enabled as soon as it starts.
                if !protocol_features {
                    vring.enabled = true;
                }
                vring.start();
            }
            _ => vring.err = fd,
        });
        if request == FrontendReq::SET_VRING_KICK {
            self.kicks_changed();
        }
        Ok(Reply::Ack(0))
    }

    fn config(&mut self, request: FrontendReq, msg: &Message) -> Result<Reply, ProtocolError> {
        expect_no_fds(request, msg)?;
        let header_len = std::mem::size_of::<ConfigHeader>();
        let header = ConfigHeader::read_from_prefix(&msg.payload)
            .map_err(|_| ProtocolError::BadSize { request, expected: header_len, got: msg.payload.len() })?
            .0;
        let expected = header_len + header.size as usize;
        if msg.payload.len() != expected {
            return Err(ProtocolError::BadSize { request, expected, got: msg.payload.len() });
        }
        let range = header.offset as usize..(header.offset as usize + header.size as usize);
        let Some(bytes) = self.config.get(range) else {
            return Err(ProtocolError::ConfigRange {
                request,
                offset: header.offset,
                size: header.size,
                len: self.config.len(),
            });
        };
        if request == FrontendReq::SET_CONFIG {
            tracing::warn!("SET_CONFIG refused: the vhca config space is read-only");
            return Ok(Reply::Ack(1));
        }
        let mut reply = header.as_bytes().to_vec();
        reply.extend_from_slice(bytes);
        Ok(Reply::Payload(reply))
    }

    fn iotlb_msg(&mut self, request: FrontendReq, msg: &Message) -> Result<Reply, ProtocolError> {
        let iotlb: IotlbMsg = expect_payload(request, msg)?;
        if !self.iommu_platform() {
            return Err(ProtocolError::IotlbWithoutIommu);
        }
        let events = &self.shared.events;
        match iotlb.msg_type {
            IOTLB_UPDATE => {
                let perm = perm_from_vhost(iotlb.perm)?;
                self.shared.iommu.update(iotlb.iova, iotlb.size, iotlb.uaddr, perm)?;
                events.record(&TransportEvent::IotlbUpdate {
                    iova: iotlb.iova,
                    size: iotlb.size,
                    uaddr: iotlb.uaddr,
                    perm: perm_name(perm),
                });
            }
            IOTLB_INVALIDATE => {
                self.shared.iommu.invalidate(iotlb.iova, iotlb.size);
                events.record(&TransportEvent::IotlbInvalidate { iova: iotlb.iova, size: iotlb.size });
                crate::shared::lock(&self.shared.invalidations).push((iotlb.iova, iotlb.size));
            }
            IOTLB_ACCESS_FAIL => {
                tracing::warn!("front-end reported an IOTLB access failure at {:#x}", iotlb.iova);
            }
            other => return Err(ProtocolError::IotlbType(other)),
        }
        self.shared.wake_worker();
        Ok(Reply::Ack(0))
    }
}

fn expect_no_fds(request: FrontendReq, msg: &Message) -> Result<(), ProtocolError> {
    if msg.fds.is_empty() {
        Ok(())
    } else {
        Err(ProtocolError::WrongFdCount { request, expected: 0, got: msg.fds.len() })
    }
}

fn expect_empty_payload(request: FrontendReq, msg: &Message) -> Result<(), ProtocolError> {
    if msg.payload.is_empty() {
        Ok(())
    } else {
        Err(ProtocolError::BadSize { request, expected: 0, got: msg.payload.len() })
    }
}

fn expect_empty(request: FrontendReq, msg: &Message) -> Result<(), ProtocolError> {
    expect_empty_payload(request, msg)?;
    expect_no_fds(request, msg)
}

fn expect_payload<T: FromBytes + KnownLayout + Immutable>(
    request: FrontendReq,
    msg: &Message,
) -> Result<T, ProtocolError> {
    let expected = std::mem::size_of::<T>();
    let value = T::read_from_bytes(&msg.payload).map_err(|_| ProtocolError::BadSize {
        request,
        expected,
        got: msg.payload.len(),
    })?;
    if matches!(request, FrontendReq::SET_VRING_KICK | FrontendReq::SET_VRING_CALL | FrontendReq::SET_VRING_ERR) {
        return Ok(value);
    }
    expect_no_fds(request, msg)?;
    Ok(value)
}

fn expect_u64(request: FrontendReq, msg: &Message) -> Result<u64, ProtocolError> {
    expect_payload::<u64>(request, msg)
}

fn single_fd(request: FrontendReq, mut msg: Message) -> Result<OwnedFd, ProtocolError> {
    match (msg.fds.len(), msg.fds.pop()) {
        (1, Some(fd)) => Ok(fd),
        (got, _) => Err(ProtocolError::WrongFdCount { request, expected: 1, got }),
    }
}
