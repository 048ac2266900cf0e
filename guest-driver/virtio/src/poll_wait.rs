//! How a driver waits between polls of the device and when it gives up. The Linux guest sleeps on a monotonic
//! clock; vhca.sys delays or stalls by IRQL and counts its budget. The transport never reads a clock itself.

use core::time::Duration;

pub trait PollWait {
    /// Pauses before the next poll. Returns false once the wait's limit has passed: the caller gives up.
    fn pause(&mut self) -> bool;
    /// The limit, for the error that reports giving up.
    fn limit(&self) -> Duration;
}
