//! Reading and writing whole vhost-user messages on a Unix socket, with the fds QEMU passes as SCM_RIGHTS.
//! Checks only framing (size limits, version, control data); what a request means is the dispatcher's job.

use std::io::{self, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};

use zerocopy::{FromBytes, IntoBytes};

use super::wire::{Header, FLAG_REPLY, FLAG_VERSION_MASK, HEADER_SIZE, MAX_FDS, MAX_PAYLOAD, VERSION};

#[derive(Debug, thiserror::Error)]
pub enum FramingError {
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    #[error("connection closed in the middle of a message")]
    Truncated,
    #[error("request {request}: payload size {size} exceeds the {MAX_PAYLOAD}-byte limit")]
    TooLarge { request: u32, size: u32 },
    #[error("request {request}: flags {flags:#x} name protocol version {version}, expected 1")]
    BadVersion { request: u32, flags: u32, version: u32 },
    #[error("more fds than vhost-user allows were attached (control data truncated)")]
    ControlTruncated,
}

pub struct Message {
    pub header: Header,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// Reads one message. `Ok(None)` is a clean close between messages.
pub fn read_message(stream: &mut UnixStream) -> Result<Option<Message>, FramingError> {
    let mut raw = [0u8; HEADER_SIZE];
    let (got, fds) = recv_with_fds(stream, &mut raw)?;
    if got == 0 {
        return Ok(None);
    }
    if got < HEADER_SIZE {
        read_full(stream, &mut raw[got..])?;
    }
    let header = Header::read_from_bytes(&raw).map_err(|_| FramingError::Truncated)?;
    let version = header.flags & FLAG_VERSION_MASK;
    if version != VERSION {
        return Err(FramingError::BadVersion { request: header.request, flags: header.flags, version });
    }
    let size = header.size as usize;
    if size > MAX_PAYLOAD {
        return Err(FramingError::TooLarge { request: header.request, size: header.size });
    }
    let mut payload = vec![0u8; size];
    read_full(stream, &mut payload)?;
    Ok(Some(Message { header, payload, fds }))
}

fn read_full(stream: &mut UnixStream, buf: &mut [u8]) -> Result<(), FramingError> {
    stream.read_exact(buf).map_err(|err| match err.kind() {
        io::ErrorKind::UnexpectedEof => FramingError::Truncated,
        _ => FramingError::Io(err),
    })
}

/// Sends `request`'s reply: the reply flag set, `payload` after the header.
pub fn write_reply(stream: &mut UnixStream, request: u32, payload: &[u8]) -> io::Result<()> {
    write_message(stream, request, VERSION | FLAG_REPLY, payload)
}

/// Sends one message without fds (replies and backend-channel requests).
pub fn write_message(stream: &mut UnixStream, request: u32, flags: u32, payload: &[u8]) -> io::Result<()> {
    let size = u32::try_from(payload.len()).map_err(|_| io::Error::other("payload larger than u32"))?;
    let header = Header { request, flags, size };
    let mut bytes = Vec::with_capacity(HEADER_SIZE + payload.len());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(payload);
    stream.write_all(&bytes)
}

/// recvmsg into `buf`, collecting any SCM_RIGHTS fds (CLOEXEC, owned). Returns bytes read (0 = EOF) and the fds.
fn recv_with_fds(stream: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>), FramingError> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let received = loop {
        match recvmsg(stream, &mut [IoSliceMut::new(buf)], &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(received) => break received,
            Err(rustix::io::Errno::INTR) => continue,
            Err(errno) => return Err(FramingError::Io(errno.into())),
        }
    };
    // Drain before judging truncation: fds that did arrive are closed, not leaked, when the message is refused.
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    if received.flags.contains(ReturnFlags::CTRUNC) {
        return Err(FramingError::ControlTruncated);
    }
    Ok((received.bytes, fds))
}
