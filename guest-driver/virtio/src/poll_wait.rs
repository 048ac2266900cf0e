//! How a driver waits between polls of the device and when it gives up. The Linux guest sleeps on a monotonic
//! clock; vhca.sys delays or stalls by IRQL and counts its budget. The transport never reads a clock itself.

use core::time::Duration;

/// Polls `SplitQueue::wait_used` makes back to back, with a spin hint between them, before its first `pause`, for a
/// `PollWait` that keeps the default `keep_spinning` (vhca.sys's; the Linux guest bounds its spin by time). A device
/// that answers within a few microseconds (one busy-polling its avail ring, docs/protocol.md "Kicks and polling") is
/// seen without a sleep's wake-up latency; one that takes longer costs this many polls of CPU time first. One poll
/// measured in the Linux guest under TCG on this 2-core host (docs/bench.md section 5): 130–1470 ns by load.
pub const DEFAULT_SPIN_POLLS: u32 = 200;

pub trait PollWait {
    /// Pauses before the next poll. Returns false once the wait's limit has passed: the caller gives up.
    fn pause(&mut self) -> bool;
    /// The limit, for the error that reports giving up.
    fn limit(&self) -> Duration;
    /// Whether `SplitQueue::wait_used` polls again at once, with only a spin hint, after `polls` empty polls and
    /// before its first pause. The default spins `DEFAULT_SPIN_POLLS` polls; a waiter with a clock bounds the spin by
    /// time instead (the cost of one poll varies 10-fold under TCG with the host's load); false: pause at once.
    fn keep_spinning(&mut self, polls: u32) -> bool {
        polls < DEFAULT_SPIN_POLLS
    }
}
