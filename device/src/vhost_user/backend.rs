//! The backend → front-end channel (SET_BACKEND_REQ_FD): the device uses it to report IOTLB misses.
//! QEMU answers a miss with an IOTLB UPDATE on the front-end socket, from its main loop; asked with NEED_REPLY, it
//! also replies here once done (`crate::miss_replies` reads those replies, never the sender).

use std::io;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;

use vhost::vhost_user::message::BackendReq;
use vm_memory::Permissions;
use zerocopy::IntoBytes;

use super::framing::write_message;
use super::wire::{IotlbMsg, FLAG_NEED_REPLY, IOTLB_MISS, VERSION};
use crate::iommu::perm_to_vhost;

pub struct BackendChannel {
    stream: UnixStream,
}

impl BackendChannel {
    pub fn new(stream: UnixStream) -> BackendChannel {
        BackendChannel { stream }
    }

    /// Asks QEMU to translate the page holding `iova` for `access`; with `need_reply`, QEMU replies on this channel.
    pub fn send_miss(&mut self, iova: u64, access: Permissions, need_reply: bool) -> io::Result<()> {
        let msg =
            IotlbMsg { iova, size: 0, uaddr: 0, perm: perm_to_vhost(access), msg_type: IOTLB_MISS, padding: [0; 6] };
        let flags = if need_reply { VERSION | FLAG_NEED_REPLY } else { VERSION };
        write_message(&mut self.stream, u32::from(BackendReq::IOTLB_MSG), flags, msg.as_bytes())
    }

    /// A second handle on the channel, for the thread that reads QEMU's replies.
    pub fn reader(&self) -> io::Result<UnixStream> {
        self.stream.try_clone()
    }

    /// Ends the channel for both sides at once (QEMU sees the hang-up), whoever else still holds a handle on it.
    pub fn close(self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}
