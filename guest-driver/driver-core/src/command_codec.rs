//! Encoding requests and decoding responses in proto's layouts, with every length checked before use.

use alloc::vec::Vec;

use vhca_proto::{
    encode_request, request_len, Opcode, ResponseHeader, Status, MAX_PAGES_PER_COMMAND, RESPONSE_HEADER_SIZE,
};
use zerocopy::{FromBytes, Immutable};

use crate::error::DriverError;

/// `CommandHeader` + `body` + page list, ready for the channel.
pub(crate) fn encode(opcode: Opcode, tag: u32, body: &[u8], pages: &[u64]) -> Result<Vec<u8>, DriverError> {
    if pages.len() > MAX_PAGES_PER_COMMAND {
        return Err(DriverError::InvalidParameter("page list longer than one command carries"));
    }
    let too_long = DriverError::InvalidParameter("command larger than its header can describe");
    let mut out = alloc::vec![0; request_len(body.len(), pages.len()).ok_or(too_long)?];
    encode_request(&mut out, opcode, tag, body, pages).ok_or(too_long)?;
    Ok(out)
}

/// Checks the response header (opcode, tag, status) and returns the body.
pub(crate) fn decode(opcode: Opcode, tag: u32, response: &[u8]) -> Result<&[u8], DriverError> {
    let (header, rest) = ResponseHeader::read_from_prefix(response)
        .map_err(|_| DriverError::BadResponse { opcode, reason: "shorter than a response header" })?;
    if header.opcode.get() != opcode as u32 || header.tag.get() != tag {
        return Err(DriverError::BadResponse { opcode, reason: "opcode or tag does not match the request" });
    }
    let status = Status::from_u32(header.status.get())
        .ok_or(DriverError::BadResponse { opcode, reason: "unknown status value" })?;
    if status != Status::Ok {
        return Err(DriverError::Device { opcode, status });
    }
    let body_len = header.body_len.get() as usize;
    rest.get(..body_len).ok_or(DriverError::BadResponse { opcode, reason: "body_len beyond the response" })
}

/// Reads a fixed response body.
pub(crate) fn body<T: FromBytes + Immutable>(opcode: Opcode, bytes: &[u8]) -> Result<T, DriverError> {
    T::read_from_prefix(bytes)
        .map(|(v, _)| v)
        .map_err(|_| DriverError::BadResponse { opcode, reason: "response body too short" })
}

pub(crate) fn response_capacity(opcode: Opcode) -> usize {
    RESPONSE_HEADER_SIZE + opcode.response_size()
}
