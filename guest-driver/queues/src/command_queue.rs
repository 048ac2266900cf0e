//! The command queue (queue 0): one request at a time, header + body in a device-readable buffer, response header +
//! body in a separate device-writable one poisoned before each command. Checks the transport (which chain completed,
//! a whole response header written); `execute_to` also checks the response itself for callers without the core.

use alloc::vec;
use alloc::vec::Vec;

use vhca_driver_core::CommandTransportError;
use vhca_proto::{
    encode_request, request_len, Opcode, QueryDeviceResp, ResponseHeader, Status, ABI_VERSION, PAGE_SIZE,
    RESPONSE_HEADER_SIZE,
};
use vhca_virtio::{Buffer, DmaMemory, DmaRangeError, QueueError, SplitQueue, Used};
use zerocopy::FromBytes;

use crate::{Note, Notify, RingError, WaitSource};

/// Poison for the response buffer: a device that completes without writing leaves it, and a status of
/// 0xa5a5a5a5 names no `Status`, so a silent non-write is never read as success.
const POISON: u8 = 0xa5;

#[derive(Debug, thiserror::Error)]
pub enum CommandError<E: core::fmt::Display + core::fmt::Debug> {
    #[error(transparent)]
    Ring(#[from] RingError<E>),
    #[error("{opcode}: request of {len} bytes exceeds {max}")]
    RequestTooLarge { opcode: &'static str, len: usize, max: usize },
    #[error("{opcode}: completion for head {got}, expected {expected}")]
    WrongHead { opcode: &'static str, got: u16, expected: u16 },
    #[error("{opcode}: device wrote {written} bytes, less than the {need}-byte response header")]
    ShortResponse { opcode: &'static str, written: u32, need: usize },
    #[error("{opcode}: response {field} is {got:#x}, expected {expected:#x}")]
    Mismatch { opcode: &'static str, field: &'static str, got: u32, expected: u32 },
    #[error("{opcode}: response status {status:#x} is not a known status")]
    UnknownStatus { opcode: &'static str, status: u32 },
    #[error("{opcode}: device answered {}", .status.name())]
    Refused { opcode: &'static str, status: Status },
    #[error("{opcode}: response body of {body_len} bytes does not fit the {written} bytes written / {room} of room")]
    BodyOverrun { opcode: &'static str, body_len: u32, written: u32, room: usize },
    #[error("{opcode}: {field} = {got:#x}, expected {expected:#x}")]
    BadField { opcode: &'static str, field: &'static str, got: u64, expected: u64 },
}

impl<E: core::fmt::Display + core::fmt::Debug> From<DmaRangeError> for CommandError<E> {
    fn from(e: DmaRangeError) -> Self {
        CommandError::Ring(RingError::Range(e))
    }
}

impl<E: core::fmt::Display + core::fmt::Debug> From<QueueError> for CommandError<E> {
    fn from(e: QueueError) -> Self {
        CommandError::Ring(RingError::Queue(e))
    }
}

/// A validated response: header (status Ok) and the body bytes the device said it wrote.
#[derive(Debug, Clone)]
pub struct Response {
    pub header: ResponseHeader,
    pub body: Vec<u8>,
    /// Bytes the used ring reported.
    pub used_len: u32,
}

/// The command queue with its two DMA buffers (request: up to `MAX_REQUEST_SIZE`; response: a page is room for the
/// largest response any command has).
pub struct CommandQueue<M: DmaMemory, N: Notify, W: WaitSource> {
    queue: SplitQueue<M>,
    notifier: N,
    request: M,
    response: M,
    next_tag: u32,
    waits: W,
}

impl<M: DmaMemory, N: Notify, W: WaitSource> CommandQueue<M, N, W> {
    pub fn new(queue: SplitQueue<M>, notifier: N, request: M, response: M, waits: W) -> Self {
        CommandQueue { queue, notifier, request, response, next_tag: 0x5a00_0001, waits }
    }

    /// The request and response buffers (their addresses go into reports).
    pub fn buffers(&self) -> (&M, &M) {
        (&self.request, &self.response)
    }

    /// The same queue waiting another way (a program's polling waits wrapped in `SignalledWaits`).
    pub fn map_waits<W2: WaitSource>(self, f: impl FnOnce(W) -> W2) -> CommandQueue<M, N, W2> {
        let CommandQueue { queue, notifier, request, response, next_tag, waits } = self;
        CommandQueue { queue, notifier, request, response, next_tag, waits: f(waits) }
    }

    /// Where the waits come from, to change them between commands (`SignalledWaits::attach`).
    pub fn waits_mut(&mut self) -> &mut W {
        &mut self.waits
    }

    /// `CommandTransport::execute`: the transport's failures are noted and become the core's
    /// `CommandTransportError` (a timeout stays one, for the core to report as such).
    pub fn execute_for_core(
        &mut self,
        request: &[u8],
        response_capacity: usize,
        note: Note<'_>,
    ) -> Result<Vec<u8>, CommandTransportError> {
        self.execute_raw(request, response_capacity).map_err(|e| match e {
            CommandError::Ring(RingError::Queue(QueueError::Timeout(_))) => CommandTransportError::Timeout,
            other => {
                note(format_args!("command queue: {other}"));
                CommandTransportError::Refused(4)
            }
        })
    }

    /// Sends one command and waits for its response; anything but a well-formed Ok response is an error.
    pub fn execute(&mut self, opcode: Opcode, body: &[u8]) -> Result<Response, CommandError<N::Error>> {
        self.execute_to(opcode, body, None)
    }

    /// As `execute`, but the response descriptor may name another IOVA: the negative control points it at an
    /// unmapped one, where the device must fault instead of answering.
    pub fn execute_to(
        &mut self,
        opcode: Opcode,
        body: &[u8],
        response_iova: Option<u64>,
    ) -> Result<Response, CommandError<N::Error>> {
        let name = opcode.name();
        let tag = self.next_tag;
        self.next_tag = self.next_tag.wrapping_add(1);
        let request_len = request_len(body.len(), 0).unwrap_or(usize::MAX);
        let too_large = CommandError::RequestTooLarge { opcode: name, len: request_len, max: self.request.len() };
        if request_len > self.request.len() {
            return Err(too_large);
        }
        let mut request = vec![0u8; request_len];
        encode_request(&mut request, opcode, tag, body, &[]).ok_or(too_large)?;
        self.request.write_bytes(0, &request)?;
        let response_room = RESPONSE_HEADER_SIZE + opcode.response_size();
        let used = self.submit(name, request_len, response_iova.unwrap_or(self.response.iova()), response_room)?;
        let mut raw = [0u8; RESPONSE_HEADER_SIZE];
        self.response.read_bytes(0, &mut raw)?;
        // Cannot fail: the array has exactly the header's size.
        let header = ResponseHeader::read_from_bytes(&raw).unwrap_or_default();
        let check = |field, got: u32, expected: u32| {
            if got == expected {
                Ok(())
            } else {
                Err(CommandError::Mismatch { opcode: name, field, got, expected })
            }
        };
        check("tag", header.tag.get(), tag)?;
        check("opcode", header.opcode.get(), opcode as u32)?;
        let status = Status::from_u32(header.status.get())
            .ok_or(CommandError::UnknownStatus { opcode: name, status: header.status.get() })?;
        if status != Status::Ok {
            return Err(CommandError::Refused { opcode: name, status });
        }
        let body_len = header.body_len.get();
        let fits = (body_len as usize)
            .checked_add(RESPONSE_HEADER_SIZE)
            .is_some_and(|end| end <= used.len as usize && end <= response_room);
        if !fits {
            return Err(CommandError::BodyOverrun { opcode: name, body_len, written: used.len, room: response_room });
        }
        let mut body = vec![0u8; body_len as usize];
        self.response.read_bytes(RESPONSE_HEADER_SIZE, &mut body)?;
        Ok(Response { header, body, used_len: used.len })
    }

    /// Sends an encoded request (header, body, page list) and returns the bytes the device wrote into the response
    /// buffer, at most `response_capacity`: the driver core decodes and checks them. Only the transport is checked
    /// here (sizes, which chain completed, at least a response header written).
    pub fn execute_raw(&mut self, request: &[u8], response_capacity: usize) -> Result<Vec<u8>, CommandError<N::Error>> {
        let opcode = request.get(..4).map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let name = Opcode::from_u32(opcode).map_or("unknown opcode", Opcode::name);
        if request.len() > self.request.len() || request.is_empty() {
            return Err(CommandError::RequestTooLarge { opcode: name, len: request.len(), max: self.request.len() });
        }
        let room = response_capacity.clamp(RESPONSE_HEADER_SIZE, self.response.len());
        self.request.write_bytes(0, request)?;
        let used = self.submit(name, request.len(), self.response.iova(), room)?;
        let mut out = vec![0u8; (used.len as usize).min(room)];
        self.response.read_bytes(0, &mut out)?;
        Ok(out)
    }

    /// Puts the request already written to the request buffer (`request_len` bytes) and a `room`-byte response
    /// buffer at `response_iova` (poisoned first, so unwritten bytes show) on the queue, notifies, waits, and checks
    /// the transport: the chain that completed is ours and at least a response header was written.
    fn submit(
        &mut self,
        name: &'static str,
        request_len: usize,
        response_iova: u64,
        room: usize,
    ) -> Result<Used, CommandError<N::Error>> {
        self.response.fill(0, room, POISON)?;
        let head = self.queue.add_chain(&[
            Buffer { iova: self.request.iova(), len: request_len as u32, device_writes: false },
            Buffer { iova: response_iova, len: room as u32, device_writes: true },
        ])?;
        self.queue.kick(|| self.notifier.notify()).map_err(RingError::Notify)?;
        let used = self.queue.wait_used(&mut self.waits.wait())?;
        if used.head != head {
            return Err(CommandError::WrongHead { opcode: name, got: used.head, expected: head });
        }
        if (used.len as usize) < RESPONSE_HEADER_SIZE {
            return Err(CommandError::ShortResponse { opcode: name, written: used.len, need: RESPONSE_HEADER_SIZE });
        }
        Ok(used)
    }

    /// QUERY_DEVICE, with the fields a driver relies on checked.
    pub fn query_device(&mut self) -> Result<(QueryDeviceResp, Response), CommandError<N::Error>> {
        let opcode = Opcode::QueryDevice;
        let response = self.execute(opcode, &[])?;
        let expected = core::mem::size_of::<QueryDeviceResp>();
        let resp = QueryDeviceResp::read_from_bytes(&response.body).map_err(|_| CommandError::BadField {
            opcode: opcode.name(),
            field: "body_len",
            got: response.body.len() as u64,
            expected: expected as u64,
        })?;
        let field = |field, got: u64, expected: u64| {
            if got == expected {
                Ok(())
            } else {
                Err(CommandError::BadField { opcode: opcode.name(), field, got, expected })
            }
        };
        field("abi_version", resp.abi_version.get() as u64, ABI_VERSION as u64)?;
        field("page_size", resp.page_size.get() as u64, PAGE_SIZE)?;
        if resp.map_registers_free.get() > resp.map_registers_total.get() {
            field("map_registers_free", resp.map_registers_free.get() as u64, resp.map_registers_total.get() as u64)?;
        }
        Ok((resp, response))
    }
}
