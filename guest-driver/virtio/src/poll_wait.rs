//! How a driver waits between polls of the device and when it gives up. The Linux guest sleeps on a monotonic
//! clock; vhca.sys delays or stalls by IRQL and counts its budget. The transport never reads a clock itself.

use core::time::Duration;

/// Polls `SplitQueue::wait_used` makes back to back, with a spin hint between them, before its first `pause`, unless
/// a `PollWait` says otherwise. A device that answers within a few microseconds (one that is busy-polling its avail
/// ring, docs/protocol.md "Kicks and polling") is seen without a sleep's wake-up latency; one that takes longer costs
/// this many polls of CPU time first. Measured in the guest under TCG on this 2-core host (docs/bench.md section 5):
/// 130–400 ns per poll by load, so 25–80 µs of spinning at most, about one to three MMIO exits' worth.
pub const DEFAULT_SPIN_POLLS: u32 = 200;

pub trait PollWait {
    /// Pauses before the next poll. Returns false once the wait's limit has passed: the caller gives up.
    fn pause(&mut self) -> bool;
    /// The limit, for the error that reports giving up.
    fn limit(&self) -> Duration;
    /// How many polls to make back to back before the first pause (0: pause after the first poll, as before).
    fn spin_polls(&self) -> u32 {
        DEFAULT_SPIN_POLLS
    }
}
