//! The backend → front-end channel (SET_BACKEND_REQ_FD): the device uses it to report IOTLB misses.
//! Sends never wait for an answer: QEMU replies with an IOTLB UPDATE on the front-end socket, from its main loop.

use std::io;
use std::os::unix::net::UnixStream;

use vhost::vhost_user::message::BackendReq;
use vm_memory::Permissions;
use zerocopy::IntoBytes;

use super::framing::write_message;
use super::wire::{IotlbMsg, IOTLB_MISS, VERSION};
use crate::iommu::perm_to_vhost;

pub struct BackendChannel {
    stream: UnixStream,
}

impl BackendChannel {
    pub fn new(stream: UnixStream) -> BackendChannel {
        BackendChannel { stream }
    }

    /// Asks QEMU to translate the page holding `iova` for `access`.
    pub fn send_miss(&mut self, iova: u64, access: Permissions) -> io::Result<()> {
        let msg =
            IotlbMsg { iova, size: 0, uaddr: 0, perm: perm_to_vhost(access), msg_type: IOTLB_MISS, padding: [0; 6] };
        // need_reply stays off: QEMU answers with an UPDATE on the other socket, not here.
        write_message(&mut self.stream, u32::from(BackendReq::IOTLB_MSG), VERSION, msg.as_bytes())
    }
}
