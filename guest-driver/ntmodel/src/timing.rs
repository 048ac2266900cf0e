//! The model's timing knobs: where its clock's time comes from, the tick the clock interrupt and the DPC watchdog
//! count in, the watchdog's two limits, and the `vhca.*` options that set them.

use std::time::Duration;

/// Where the model's clock gets its time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockSource {
    /// The host's monotonic clock (the guest): time passes on its own.
    Host,
    /// Only `NtModel::advance_clock` and KeStallExecutionProcessor move it (tests): every timeout, timer and
    /// watchdog count is deterministic.
    Manual,
}

/// The clock and the DPC watchdog. Microsoft documents no default for either watchdog limit ("the actual timeout
/// values on the system are set much higher" than the 100 µs a DPC and 25 µs an ISR should take, 0x133's page) and
/// calls the clock interval platform-specific (ExSetTimerResolution's page); these defaults are the model's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimingConfig {
    pub clock: ClockSource,
    /// The clock interrupt's period, the unit of both watchdog counts: 15.625 ms (64 a second) by default.
    pub tick: Duration,
    /// Ticks one DPC or ISR may run (0x133, P1 = 0); 0 turns the check off. Default 64 (1 s at the default tick):
    /// ten thousand times Microsoft's 100 µs, so nothing sound reaches it even in a TCG guest, and well inside a
    /// run's 60 s timeout, where a Windows-sized limit (the 0x133 page's example is 0x500 ticks) would let the run
    /// time out before the watchdog said why.
    pub dpc_time_limit: u64,
    /// Ticks a processor may stay at DISPATCH_LEVEL or above without dropping below it (0x133, P1 = 1); 0 turns
    /// the check off. Default 320 (5 s): five single-DPC allotments back to back.
    pub dpc_watchdog_limit: u64,
}

impl Default for TimingConfig {
    fn default() -> Self {
        TimingConfig {
            clock: ClockSource::Host,
            tick: Duration::from_micros(15_625),
            dpc_time_limit: 64,
            dpc_watchdog_limit: 320,
        }
    }
}

/// The `vhca.<key>` options `TimingConfig::apply_option` takes.
pub const TIMING_OPTION_KEYS: [&str; 3] = ["clock_tick_us", "dpc_time_limit", "dpc_watchdog_limit"];

impl TimingConfig {
    /// The tick in the clock's 100 ns units (at least one).
    pub fn tick_100ns(&self) -> u64 {
        (self.tick.as_nanos() / 100).max(1) as u64
    }

    /// Applies `vhca.<key>=<value>` if `key` is one of the timing options (`clock_tick_us`, `dpc_time_limit`,
    /// `dpc_watchdog_limit`, the last two in ticks): None for another key, else whether the value parsed. The keys
    /// belong to the model, so every program built on it parses them alike.
    pub fn apply_option(&mut self, key: &str, value: &str) -> Option<Result<(), String>> {
        if !TIMING_OPTION_KEYS.contains(&key) {
            return None;
        }
        let number = value.parse::<u64>().map_err(|_| format!("not a non-negative integer: {value:?}"));
        Some(number.and_then(|n| {
            match key {
                "clock_tick_us" if n == 0 => return Err("a tick of 0 µs".to_string()),
                "clock_tick_us" => self.tick = Duration::from_micros(n),
                "dpc_time_limit" => self.dpc_time_limit = n,
                _ => self.dpc_watchdog_limit = n,
            }
            Ok(())
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_set_their_knob_and_refuse_bad_values() {
        let mut t = TimingConfig::default();
        assert_eq!(t.apply_option("clock_tick_us", "1000"), Some(Ok(())));
        assert_eq!(t.apply_option("dpc_time_limit", "5"), Some(Ok(())));
        assert_eq!(t.apply_option("dpc_watchdog_limit", "0"), Some(Ok(())));
        assert_eq!((t.tick, t.dpc_time_limit, t.dpc_watchdog_limit), (Duration::from_millis(1), 5, 0));
        assert_eq!(t.tick_100ns(), 10_000);
        assert!(matches!(t.apply_option("clock_tick_us", "0"), Some(Err(_))));
        assert!(matches!(t.apply_option("dpc_time_limit", "-1"), Some(Err(_))));
        assert_eq!(t.apply_option("faults", "10"), None);
        assert_eq!(TimingConfig::default().tick_100ns(), 156_250);
    }
}
