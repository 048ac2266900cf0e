//! How the driver core reaches the device: one command at a time, doorbells, and asynchronous events.
//! The Linux guest's virtio transport implements it; tests implement it over the in-process HCA model.

use alloc::vec::Vec;

use vhca_proto::Event;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandTransportError {
    /// The device did not answer in time.
    Timeout,
    /// The transport is down (device reset, queue broken).
    DeviceGone,
    /// The transport refused the request (too large for a descriptor chain, ...); the value is its own code.
    Refused(u32),
}

impl core::fmt::Display for CommandTransportError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            CommandTransportError::Timeout => write!(f, "device did not answer in time"),
            CommandTransportError::DeviceGone => write!(f, "device transport is down"),
            CommandTransportError::Refused(c) => write!(f, "transport refused the request (code {c})"),
        }
    }
}

pub trait CommandTransport {
    /// Submits one command (`CommandHeader`, body, page list) and waits for the response (`ResponseHeader` and
    /// body), which is at most `response_capacity` bytes.
    fn execute(&self, request: &[u8], response_capacity: usize) -> Result<Vec<u8>, CommandTransportError>;
    /// Sends doorbell records (`vhca_proto::Doorbell`, back to back).
    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError>;
    /// The next asynchronous event, if one has arrived.
    fn poll_event(&self) -> Option<Event>;
}
