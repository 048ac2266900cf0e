//! QEMU's replies to the device's IOTLB misses: every miss goes out with NEED_REPLY and QEMU answers it on the backend
//! channel once handled, 0 when its UPDATE is already applied and non-zero when the vIOMMU has no mapping (an IOMMU
//! fault now, instead of a wait for the miss timeout). A thread of its own reads them: the queue worker never waits on
//! the backend socket, since QEMU's main loop may be inside a front-end request that waits for a vring lock it holds.
//!
//! Protocol use and the QEMU functions behind it: docs/protocol.md, "IOTLB misses and their replies".

use std::collections::VecDeque;
use std::io;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vhost::vhost_user::message::BackendReq;
use vm_memory::Permissions;

use crate::event_log::perm_name;
use crate::shared::{lock, Shared};
use crate::vhost_user::framing::{read_message, FramingError, Message};
use crate::vhost_user::wire::FLAG_REPLY;

/// Most misses awaiting a reply at once. Past it a miss goes out without NEED_REPLY (waited for until the timeout,
/// as with a front-end that never replies): memory stays bounded, and the replies still to come pair up in order.
pub const MAX_PENDING: usize = 256;

/// One miss as asked: the address and the access it was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Miss {
    pub iova: u64,
    pub access: Permissions,
}

/// A reply that cannot be one, or a channel that failed under the reader: the channel is closed.
#[derive(Debug, thiserror::Error)]
pub enum ReplyError {
    #[error(transparent)]
    Framing(#[from] FramingError),
    #[error("message {request} where a reply to IOTLB_MSG ({expected}) was due")]
    NotIotlb { request: u32, expected: u32 },
    #[error("IOTLB_MSG with flags {0:#x} and no reply bit: the device serves no requests on this channel")]
    NotAReply(u32),
    #[error("reply of {0} bytes, expected an 8-byte status")]
    BadSize(usize),
    #[error("reply carries {0} fds, expected none")]
    Fds(usize),
    #[error("a reply with no miss awaiting one")]
    Unexpected,
}

/// What QEMU said about one miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Status 0: QEMU sent the UPDATE, and the device acked it, before this reply.
    Applied(Miss),
    /// Non-zero status: no translation (`vhost_device_iotlb_miss` returned an error).
    Refused(Miss, u64),
}

/// How reading one channel ended.
#[derive(Debug)]
pub enum ChannelEnd {
    /// The front-end closed it (EOF between messages).
    Closed,
    /// A newer channel took its place, or the device stops: its replies no longer count.
    Superseded,
    /// Something that is not a reply to a miss came in: the channel must be closed.
    Malformed(ReplyError),
}

#[derive(Debug, Default)]
struct State {
    /// A reader thread collects replies (the fuzzer drives the device without one: then nothing is asked).
    reader: bool,
    stopped: bool,
    /// Counts channels: a reader's replies count only while its channel is the current one.
    epoch: u64,
    /// Replies are asked for on the current channel (REPLY_ACK negotiated, and the channel is whole).
    asking: bool,
    /// The current channel, not yet taken by the reader.
    incoming: Option<UnixStream>,
    /// A handle on the channel being read: shutting it down ends the reader's blocking read.
    reading: Option<UnixStream>,
    /// Misses sent with NEED_REPLY and not yet answered, oldest first: QEMU handles backend messages one at a time,
    /// so its replies come in this order.
    pending: VecDeque<Miss>,
    /// Misses QEMU refused, until the waiter takes the refusal or a newer ask for the same miss replaces it.
    refused: VecDeque<Miss>,
}

/// The replies to the device's misses, shared by the sender (the queue worker), the reader thread, and the waiters.
#[derive(Debug, Default)]
pub struct MissReplies {
    state: Mutex<State>,
    handed: Condvar,
}

impl MissReplies {
    pub fn new() -> MissReplies {
        MissReplies::default()
    }

    /// A new backend channel: `stream` is the reader's own handle on it, `None` when no replies are to be asked for.
    /// Whatever was asked on the previous channel is never answered now (its waiters keep their timeouts).
    pub fn attach(&self, stream: Option<UnixStream>) {
        let mut state = lock(&self.state);
        state.epoch = state.epoch.wrapping_add(1);
        if let Some(old) = state.reading.take() {
            let _ = old.shutdown(Shutdown::Both);
        }
        state.pending.clear();
        state.refused.clear();
        // The handle is what lets a stop or a later channel end the reader's read: without one, ask nothing.
        let reading = stream.as_ref().and_then(|stream| match stream.try_clone() {
            Ok(handle) => Some(handle),
            Err(err) => {
                tracing::error!("backend channel: cannot keep a handle on it ({err}); misses wait for the timeout");
                None
            }
        });
        state.asking = reading.is_some();
        state.incoming = if reading.is_some() { stream } else { None };
        state.reading = reading;
        self.handed.notify_all();
    }

    /// Whether this miss goes out with NEED_REPLY; if so, its reply is now awaited, after those asked before it.
    /// Called with the backend channel locked, right before the send, so the order here is the order on the wire.
    pub fn ask(&self, miss: Miss) -> bool {
        let mut state = lock(&self.state);
        // A new ask supersedes an old refusal of the same miss: the driver may have mapped the page since.
        state.refused.retain(|refused| *refused != miss);
        let ask = state.reader && state.asking && !state.stopped && state.pending.len() < MAX_PENDING;
        if ask {
            state.pending.push_back(miss);
        }
        ask
    }

    /// The send of `miss`, just asked, failed: no reply will come for it.
    pub fn unask(&self, miss: Miss) {
        let mut state = lock(&self.state);
        if state.pending.back() == Some(&miss) {
            state.pending.pop_back();
        }
    }

    /// Whether QEMU refused the latest ask of `miss` (the vIOMMU has no mapping). Takes the refusal.
    pub fn take_refusal(&self, miss: Miss) -> bool {
        let mut state = lock(&self.state);
        match state.refused.iter().position(|refused| *refused == miss) {
            Some(at) => state.refused.remove(at).is_some(),
            None => false,
        }
    }

    /// Pairs a reply's status with the oldest miss awaiting one. `None` when `epoch` is no longer the channel.
    pub fn record(&self, epoch: u64, status: u64) -> Result<Option<Answer>, ReplyError> {
        let mut state = lock(&self.state);
        if state.epoch != epoch || state.stopped {
            return Ok(None);
        }
        let miss = state.pending.pop_front().ok_or(ReplyError::Unexpected)?;
        if status == 0 {
            return Ok(Some(Answer::Applied(miss)));
        }
        // Only the latest ask of a miss counts: with a newer one still out, this refusal says nothing about it.
        if !state.pending.contains(&miss) {
            if state.refused.len() >= MAX_PENDING {
                state.refused.pop_front();
            }
            state.refused.push_back(miss);
        }
        Ok(Some(Answer::Refused(miss, status)))
    }

    /// Channel `epoch` is gone: nothing more is asked on it and nothing asked is answered. Whether it was current.
    pub fn lost(&self, epoch: u64) -> bool {
        let mut state = lock(&self.state);
        if state.epoch != epoch {
            return false;
        }
        state.asking = false;
        state.pending.clear();
        state.incoming = None;
        if let Some(handle) = state.reading.take() {
            let _ = handle.shutdown(Shutdown::Both);
        }
        true
    }

    /// The device stops: the reader's read ends and it takes no further channel.
    pub fn stop(&self) {
        let mut state = lock(&self.state);
        state.stopped = true;
        state.epoch = state.epoch.wrapping_add(1);
        state.incoming = None;
        if let Some(handle) = state.reading.take() {
            let _ = handle.shutdown(Shutdown::Both);
        }
        self.handed.notify_all();
    }

    fn set_reader(&self, present: bool) {
        lock(&self.state).reader = present;
    }

    fn is_current(&self, epoch: u64) -> bool {
        let state = lock(&self.state);
        state.epoch == epoch && !state.stopped
    }

    /// Blocks until a channel is handed over (with its epoch) or the device stops (`None`).
    fn next_channel(&self) -> Option<(u64, UnixStream)> {
        let mut state = lock(&self.state);
        loop {
            if state.stopped {
                return None;
            }
            if let Some(stream) = state.incoming.take() {
                return Some((state.epoch, stream));
            }
            state = self.handed.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

/// The status a reply carries, as QEMU's `backend_read` writes it: the request code of the miss (IOTLB_MSG), the
/// reply flag, and a u64.
pub fn parse_reply(msg: &Message) -> Result<u64, ReplyError> {
    let expected = u32::from(BackendReq::IOTLB_MSG);
    if msg.header.request != expected {
        return Err(ReplyError::NotIotlb { request: msg.header.request, expected });
    }
    if msg.header.flags & FLAG_REPLY == 0 {
        return Err(ReplyError::NotAReply(msg.header.flags));
    }
    if !msg.fds.is_empty() {
        return Err(ReplyError::Fds(msg.fds.len()));
    }
    let status: [u8; 8] = msg.payload.as_slice().try_into().map_err(|_| ReplyError::BadSize(msg.payload.len()))?;
    Ok(u64::from_ne_bytes(status))
}

/// Reads channel `epoch` until it ends, recording each reply; `refused` hears of each refusal (to wake the waiters).
pub fn read_replies(replies: &MissReplies, epoch: u64, mut stream: UnixStream, refused: impl Fn(Miss)) -> ChannelEnd {
    let superseded = |end: ChannelEnd| if replies.is_current(epoch) { end } else { ChannelEnd::Superseded };
    loop {
        let msg = match read_message(&mut stream) {
            Ok(Some(msg)) => msg,
            Ok(None) => return superseded(ChannelEnd::Closed),
            Err(err) => return superseded(ChannelEnd::Malformed(err.into())),
        };
        let answer = parse_reply(&msg).and_then(|status| replies.record(epoch, status));
        match answer {
            Ok(Some(Answer::Applied(miss))) => {
                tracing::debug!("front-end answered the IOTLB miss at {:#x}: mapped", miss.iova);
            }
            Ok(Some(Answer::Refused(miss, status))) => {
                tracing::warn!(
                    "front-end refused the IOTLB miss at {:#x} ({}): status {status}, the vIOMMU has no mapping",
                    miss.iova,
                    perm_name(miss.access)
                );
                refused(miss);
            }
            Ok(None) => return ChannelEnd::Superseded,
            Err(err) => return superseded(ChannelEnd::Malformed(err)),
        }
    }
}

/// Starts the thread that reads the replies for `shared`: before the sandbox goes on, since it forbids new threads.
/// It runs with scheduler slice `slice` (`thread_sched`): QEMU's answer to an IOTLB miss wakes it while the guest's
/// vCPU thread may hold the core, and the DMA waiting for that answer waits for it.
pub fn spawn_reader(shared: Arc<Shared>, slice: Duration) -> io::Result<JoinHandle<()>> {
    shared.miss_replies.set_reader(true);
    let thread = Arc::clone(&shared);
    let spawned = crate::thread_sched::spawn("vhca-replies", slice, move || run(&thread));
    if spawned.is_err() {
        shared.miss_replies.set_reader(false);
    }
    spawned
}

/// Stops the reader thread and waits for it.
pub fn stop_reader(shared: &Shared, reader: JoinHandle<()>) {
    shared.miss_replies.stop();
    if reader.join().is_err() {
        tracing::error!("backend channel reader panicked");
    }
}

fn run(shared: &Shared) {
    while let Some((epoch, stream)) = shared.miss_replies.next_channel() {
        let end = read_replies(&shared.miss_replies, epoch, stream, |_| {
            // As an UPDATE would: the worker's miss waits and parked rings look again, and find the refusal.
            shared.iommu.wake_waiters();
            shared.wake_worker();
        });
        match end {
            ChannelEnd::Closed => {
                tracing::warn!("backend channel: the front-end closed it; misses already asked wait for the timeout");
                shared.miss_replies.lost(epoch);
            }
            ChannelEnd::Malformed(err) => {
                tracing::error!("backend channel: closing it: {err}");
                shared.close_backend(epoch);
            }
            ChannelEnd::Superseded => tracing::debug!("backend channel {epoch}: no longer read"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vhost_user::framing::write_message;
    use crate::vhost_user::wire::{FLAG_NEED_REPLY, VERSION};

    const IOTLB_MSG: u32 = 1;

    fn miss(iova: u64) -> Miss {
        Miss { iova, access: Permissions::Read }
    }

    /// Replies on a channel to the misses at `iovas`, all asked: the reader's end and QEMU's end.
    fn channel(iovas: &[u64]) -> (MissReplies, u64, UnixStream, UnixStream) {
        let replies = MissReplies::new();
        replies.set_reader(true);
        let (ours, theirs) = UnixStream::pair().unwrap();
        replies.attach(Some(ours));
        let (epoch, stream) = replies.next_channel().unwrap();
        for &iova in iovas {
            assert!(replies.ask(miss(iova)));
        }
        (replies, epoch, stream, theirs)
    }

    fn reply(qemu: &mut UnixStream, status: u64) {
        write_message(qemu, IOTLB_MSG, VERSION | FLAG_REPLY, &status.to_ne_bytes()).unwrap();
    }

    /// Runs the reader over what QEMU wrote (then QEMU's end closes); the end and the refusals heard, in order.
    fn read_all(replies: &MissReplies, epoch: u64, stream: UnixStream, qemu: UnixStream) -> (ChannelEnd, Vec<Miss>) {
        drop(qemu);
        let heard = Mutex::new(Vec::new());
        let end = read_replies(replies, epoch, stream, |miss| heard.lock().unwrap().push(miss));
        (end, heard.into_inner().unwrap())
    }

    #[test]
    fn replies_pair_with_misses_in_order_and_only_refusals_are_kept() {
        let (replies, epoch, stream, mut qemu) = channel(&[0x1000, 0x2000, 0x3000]);
        reply(&mut qemu, 0);
        reply(&mut qemu, 1);
        reply(&mut qemu, 0);
        let (end, heard) = read_all(&replies, epoch, stream, qemu);
        assert!(matches!(end, ChannelEnd::Closed), "{end:?}");
        assert_eq!(heard, vec![miss(0x2000)], "the second miss was refused");
        assert!(!replies.take_refusal(miss(0x1000)), "an ack is no refusal");
        assert!(!replies.take_refusal(miss(0x3000)));
        assert!(replies.take_refusal(miss(0x2000)));
        assert!(!replies.take_refusal(miss(0x2000)), "a refusal is taken once");
        assert!(!replies.take_refusal(Miss { iova: 0x2000, access: Permissions::Write }), "per access");
    }

    #[test]
    fn any_nonzero_status_is_a_refusal_and_an_ack_alone_is_not() {
        let (replies, epoch, stream, mut qemu) = channel(&[0x5000, 0x6000]);
        reply(&mut qemu, 0);
        reply(&mut qemu, u64::MAX);
        let (_, heard) = read_all(&replies, epoch, stream, qemu);
        assert_eq!(heard, vec![miss(0x6000)]);
        assert!(!replies.take_refusal(miss(0x5000)));
        assert!(replies.take_refusal(miss(0x6000)));
    }

    #[test]
    fn a_newer_ask_supersedes_an_older_refusal() {
        // Asked twice (the driver mapped the page in between): the refusal of the first says nothing of the second.
        let (replies, epoch, stream, mut qemu) = channel(&[0x7000, 0x7000]);
        reply(&mut qemu, 1);
        let (_, heard) = read_all(&replies, epoch, stream, qemu);
        assert_eq!(heard, vec![miss(0x7000)]);
        assert!(!replies.take_refusal(miss(0x7000)), "the second ask is still out");
        // And a refusal already kept is dropped by a new ask of the same miss.
        let (replies, epoch, stream, mut qemu) = channel(&[0x8000]);
        reply(&mut qemu, 1);
        read_all(&replies, epoch, stream, qemu);
        assert!(replies.ask(miss(0x8000)));
        assert!(!replies.take_refusal(miss(0x8000)));
    }

    #[test]
    fn malformed_replies_end_the_channel_naming_the_cause() {
        let cases: [(u32, u32, &[u8], &str); 4] = [
            (2, VERSION | FLAG_REPLY, &[0; 8], "where a reply to IOTLB_MSG (1) was due"),
            (IOTLB_MSG, VERSION | FLAG_NEED_REPLY, &[0; 8], "no reply bit"),
            (IOTLB_MSG, VERSION | FLAG_REPLY, &[0; 4], "reply of 4 bytes"),
            (IOTLB_MSG, 0x2 | FLAG_REPLY, &[0; 8], "protocol version 2"),
        ];
        for (request, flags, payload, cause) in cases {
            let (replies, epoch, stream, mut qemu) = channel(&[0x1000]);
            write_message(&mut qemu, request, flags, payload).unwrap();
            let (end, heard) = read_all(&replies, epoch, stream, qemu);
            match end {
                ChannelEnd::Malformed(err) => assert!(err.to_string().contains(cause), "{err} lacks {cause:?}"),
                other => panic!("{request}/{flags:#x}: {other:?}"),
            }
            assert!(heard.is_empty());
        }
    }

    #[test]
    fn a_reply_nobody_asked_for_is_malformed() {
        let (replies, epoch, stream, mut qemu) = channel(&[0x1000]);
        reply(&mut qemu, 1);
        reply(&mut qemu, 1);
        let (end, heard) = read_all(&replies, epoch, stream, qemu);
        assert!(matches!(end, ChannelEnd::Malformed(ReplyError::Unexpected)), "{end:?}");
        assert_eq!(heard, vec![miss(0x1000)], "the reply that was due still counts");
    }

    #[test]
    fn eof_mid_reply_is_malformed_and_eof_between_replies_is_a_close() {
        let (replies, epoch, stream, mut qemu) = channel(&[0x1000]);
        std::io::Write::write_all(&mut qemu, &[1, 0, 0, 0, 5, 0]).unwrap();
        let (end, _) = read_all(&replies, epoch, stream, qemu);
        assert!(matches!(end, ChannelEnd::Malformed(ReplyError::Framing(FramingError::Truncated))), "{end:?}");

        let (replies, epoch, stream, qemu) = channel(&[0x1000]);
        let (end, _) = read_all(&replies, epoch, stream, qemu);
        assert!(matches!(end, ChannelEnd::Closed), "{end:?}");
        assert!(replies.lost(epoch));
        assert!(!replies.ask(miss(0x2000)), "nothing is asked on a lost channel");
    }

    #[test]
    fn a_new_channel_or_a_stop_supersedes_the_one_being_read() {
        let (replies, epoch, stream, mut qemu) = channel(&[0x1000]);
        let (next, _next_qemu) = UnixStream::pair().unwrap();
        replies.attach(Some(next));
        // The old channel was shut down: its reader ends without taking a late reply as an answer.
        let _ = write_message(&mut qemu, IOTLB_MSG, VERSION | FLAG_REPLY, &1u64.to_ne_bytes());
        let (end, heard) = read_all(&replies, epoch, stream, qemu);
        assert!(matches!(end, ChannelEnd::Superseded), "{end:?}");
        assert!(heard.is_empty());
        let (next_epoch, _stream) = replies.next_channel().unwrap();
        assert_ne!(next_epoch, epoch);
        replies.stop();
        assert!(replies.next_channel().is_none(), "a stopped reader takes no channel");
        assert!(!replies.ask(miss(0x1000)));
    }

    #[test]
    fn without_a_reader_or_reply_ack_nothing_is_asked_and_pending_is_bounded() {
        let replies = MissReplies::new();
        let (ours, _theirs) = UnixStream::pair().unwrap();
        replies.attach(Some(ours));
        assert!(!replies.ask(miss(0x1000)), "no reader thread");
        replies.set_reader(true);
        replies.attach(None);
        assert!(!replies.ask(miss(0x1000)), "REPLY_ACK not negotiated");
        let (replies, _epoch, _stream, _qemu) = channel(&[]);
        for i in 0..MAX_PENDING as u64 {
            assert!(replies.ask(miss(i << 12)));
        }
        assert!(!replies.ask(miss(0xdead_0000)), "past MAX_PENDING the miss goes out without NEED_REPLY");
        replies.unask(miss((MAX_PENDING as u64 - 1) << 12));
        assert!(replies.ask(miss(0xdead_0000)), "a failed send frees its place");
    }
}
