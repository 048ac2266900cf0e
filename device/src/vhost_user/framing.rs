//! Reading and writing whole vhost-user messages on a Unix socket, with the fds QEMU passes as SCM_RIGHTS.
//! Checks only framing (size limits, version, control data); what a request means is the dispatcher's job.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

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

/// recvmsg into `buf`, collecting any SCM_RIGHTS fds. Returns bytes read (0 = EOF) and the fds, owned.
fn recv_with_fds(stream: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>), FramingError> {
    // u64 elements keep the control buffer aligned for cmsghdr.
    const CONTROL_WORDS: usize = (MAX_FDS * 4 + 64) / 8;
    let mut control = [0u64; CONTROL_WORDS];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: msghdr is plain old data; all-zero is a valid (empty) value that we fill in below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    let received = loop {
        // SAFETY: msg points at iov (valid for buf.len() bytes of buf) and at control (valid for msg_controllen
        // bytes); both outlive the call. The kernel writes at most those lengths.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(FramingError::Io(err));
        }
    };
    let mut fds = Vec::new();
    // SAFETY: msg was filled by a successful recvmsg; CMSG_FIRSTHDR/NXTHDR stay within msg_controllen.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: cmsg is non-null and points inside the control buffer, as CMSG_FIRSTHDR/NXTHDR guarantee.
        let header = unsafe { &*cmsg };
        if header.cmsg_level == libc::SOL_SOCKET && header.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN(0) is a pure computation of the header size.
            let data_len = header.cmsg_len as usize - unsafe { libc::CMSG_LEN(0) } as usize;
            let count = data_len / std::mem::size_of::<libc::c_int>();
            // SAFETY: CMSG_DATA points at `data_len` bytes of fds inside the control buffer.
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<libc::c_int>();
            for i in 0..count {
                // SAFETY: i < count, within the cmsg data; read_unaligned because CMSG_DATA need not be aligned.
                let fd = unsafe { data.add(i).read_unaligned() };
                // SAFETY: the kernel just installed this fd for us; nobody else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
        // SAFETY: as above, NXTHDR walks within the buffer and returns null at its end.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(FramingError::ControlTruncated);
    }
    Ok((received, fds))
}
