//! How the driver core reaches the device: one command at a time, doorbells, and asynchronous events.
//! The Linux guest's virtio transport implements it; tests implement it over the in-process HCA model.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::time::Duration;

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
    /// PASSIVE_LEVEL, no command in flight. From here on (Some) each command's wait sleeps on `signal`, which the
    /// driver's DPC sets; None: it polls again (before the interrupt is disconnected, as nothing sets it after).
    /// The default ignores it: a transport that only polls.
    fn wait_for_interrupts(&self, _signal: Option<Arc<dyn CompletionSignal>>) {}
}

/// What a queue's completion wait sleeps on once the driver's interrupt is connected: an event the DPC sets each
/// time it runs, and a deadline. One wait at a time (the queue's own lock makes sure), so one deadline serves.
/// The used ring is polled after every wake: the carrier's queues share one vector, so a wake may be for another.
pub trait CompletionSignal: Send + Sync {
    /// PASSIVE_LEVEL (APC_LEVEL under a FAST_MUTEX). Starts one wait of at most `limit`.
    fn begin(&self, limit: Duration);
    /// PASSIVE_LEVEL (APC_LEVEL). Sleeps until the DPC signals or the deadline passes: false once it has passed.
    fn sleep(&self) -> bool;
    /// Ends the wait begun last (its deadline is cancelled, so no timer is left set at unload).
    fn end(&self);
}
