//! Deterministic fault injection: what to break (`FaultInjection`, from `--inject KEY=VALUE` or a JSON file) and the
//! counters that decide when (`Injector`). Every count is 1-based and counts device actions, never wall time.

use serde::{Deserialize, Serialize};

/// What a run with `--contiguous-cap` does with a page list whose contiguous run is longer than the cap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContiguousPolicy {
    /// The registration (ring or MR) is refused with Status::Injected.
    #[default]
    Refuse,
    /// The registration is accepted; the DMA engine never moves more than the cap's pages in one burst.
    Split,
}

/// The knobs. All absent by default: no injection. Serialises only the knobs that are set (plus the policy).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultInjection {
    /// Fail the Nth REG_MR with Status::Injected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fail_reg_mr: Option<u64>,
    /// Fail the Nth ring mapping (a CQ ring, a QP's SQ ring, a QP's RQ ring; in command order, SQ before RQ).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fail_ring_map: Option<u64>,
    /// Drop the Nth completion: the CQE is never written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drop_completion: Option<u64>,
    /// Hold the Nth completion back until `delay_doorbells` further doorbell records have been processed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delay_completion: Option<u64>,
    /// How many doorbell records a delayed completion waits (default 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delay_doorbells: Option<u32>,
    /// Longest run of IOVA-contiguous pages a ring or MR may have.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_contiguous_pages: Option<u32>,
    pub contiguous_policy: ContiguousPolicy,
    /// Before the Nth DMA, invalidate a range as if QEMU had sent an IOTLB invalidate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalidate_at_dma: Option<u64>,
    /// Start of that range; absent: the pages of the Nth DMA itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalidate_iova: Option<u64>,
    /// Length of that range (default one page).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalidate_size: Option<u64>,
    /// Hold the `hold_completion_wr`th send work request this many milliseconds before the device executes it (its
    /// DMA into guest memory and its CQE): the late completion a driver's timeout must survive.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_completion_ms: Option<u64>,
    /// Which send work request `hold_completion_ms` holds, counting every one the device starts (default 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_completion_wr: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InjectionParseError {
    #[error("injection '{0}' is not KEY=VALUE")]
    NotKeyValue(String),
    #[error("unknown injection key '{0}'")]
    UnknownKey(String),
    #[error("injection {key}: '{value}' is not a number (decimal or 0x hex)")]
    BadNumber { key: String, value: String },
    #[error("injection {key}: counts are 1-based, 0 never fires")]
    ZeroCount { key: String },
    #[error("injection contiguous_policy: '{0}' is neither 'refuse' nor 'split'")]
    BadPolicy(String),
    #[error("injection config: {0}")]
    Json(String),
    #[error("injection {key}: {value} is more than {max}")]
    TooLong { key: String, value: u64, max: u64 },
}

impl FaultInjection {
    /// Applies one `KEY=VALUE` (the form of `--inject`). Numbers are decimal or 0x-prefixed hex.
    pub fn parse_kv(&mut self, kv: &str) -> Result<(), InjectionParseError> {
        let (key, value) = kv.split_once('=').ok_or_else(|| InjectionParseError::NotKeyValue(kv.to_string()))?;
        let (key, value) = (key.trim(), value.trim());
        let number = || parse_number(key, value);
        let count = || {
            let n = parse_number(key, value)?;
            if n == 0 {
                return Err(InjectionParseError::ZeroCount { key: key.to_string() });
            }
            Ok(n)
        };
        let small = |n: u64| {
            u32::try_from(n)
                .map_err(|_| InjectionParseError::BadNumber { key: key.to_string(), value: value.to_string() })
        };
        match key {
            "fail_reg_mr" => self.fail_reg_mr = Some(count()?),
            "fail_ring_map" => self.fail_ring_map = Some(count()?),
            "drop_completion" => self.drop_completion = Some(count()?),
            "delay_completion" => self.delay_completion = Some(count()?),
            "delay_doorbells" => self.delay_doorbells = Some(small(number()?)?),
            "max_contiguous_pages" => self.max_contiguous_pages = Some(small(count()?)?),
            "contiguous_policy" => {
                self.contiguous_policy = match value {
                    "refuse" => ContiguousPolicy::Refuse,
                    "split" => ContiguousPolicy::Split,
                    other => return Err(InjectionParseError::BadPolicy(other.to_string())),
                }
            }
            "invalidate_at_dma" => self.invalidate_at_dma = Some(count()?),
            "invalidate_iova" => self.invalidate_iova = Some(number()?),
            "invalidate_size" => self.invalidate_size = Some(count()?),
            "hold_completion_ms" => self.hold_completion_ms = Some(hold_ms(key, count()?)?),
            "hold_completion_wr" => self.hold_completion_wr = Some(count()?),
            other => return Err(InjectionParseError::UnknownKey(other.to_string())),
        }
        Ok(())
    }

    /// The knobs that are set, in `--inject` form (`KEY=VALUE`); applying them to a default value gives this one
    /// back, so a logged list is a reproducer.
    pub fn to_kv(&self) -> Vec<String> {
        let numbers = [
            ("fail_reg_mr", self.fail_reg_mr),
            ("fail_ring_map", self.fail_ring_map),
            ("drop_completion", self.drop_completion),
            ("delay_completion", self.delay_completion),
            ("delay_doorbells", self.delay_doorbells.map(u64::from)),
            ("max_contiguous_pages", self.max_contiguous_pages.map(u64::from)),
            ("invalidate_at_dma", self.invalidate_at_dma),
            ("hold_completion_ms", self.hold_completion_ms),
            ("hold_completion_wr", self.hold_completion_wr),
        ];
        let mut out: Vec<String> =
            numbers.iter().filter_map(|(key, value)| value.map(|v| format!("{key}={v}"))).collect();
        if self.contiguous_policy == ContiguousPolicy::Split {
            out.push("contiguous_policy=split".to_string());
        }
        if let Some(iova) = self.invalidate_iova {
            out.push(format!("invalidate_iova={iova:#x}"));
        }
        if let Some(size) = self.invalidate_size {
            out.push(format!("invalidate_size={size:#x}"));
        }
        out
    }

    /// True when no knob is set: the device behaves as without injection.
    pub fn is_empty(&self) -> bool {
        *self == FaultInjection::default()
    }

    /// Reads the `--inject-config` file's content: a JSON object with the same keys.
    pub fn from_json(text: &str) -> Result<FaultInjection, InjectionParseError> {
        let parsed: FaultInjection =
            serde_json::from_str(text).map_err(|e| InjectionParseError::Json(e.to_string()))?;
        // The same rule as `parse_kv`: a count of 0 would silently never fire.
        let counts = [
            ("fail_reg_mr", parsed.fail_reg_mr),
            ("fail_ring_map", parsed.fail_ring_map),
            ("drop_completion", parsed.drop_completion),
            ("delay_completion", parsed.delay_completion),
            ("max_contiguous_pages", parsed.max_contiguous_pages.map(u64::from)),
            ("invalidate_at_dma", parsed.invalidate_at_dma),
            ("invalidate_size", parsed.invalidate_size),
            ("hold_completion_ms", parsed.hold_completion_ms),
            ("hold_completion_wr", parsed.hold_completion_wr),
        ];
        if let Some((key, _)) = counts.iter().find(|(_, value)| *value == Some(0)) {
            return Err(InjectionParseError::ZeroCount { key: key.to_string() });
        }
        if let Some(ms) = parsed.hold_completion_ms {
            hold_ms("hold_completion_ms", ms)?;
        }
        Ok(parsed)
    }
}

/// Longest hold `hold_completion_ms` accepts: a minute is far past any driver's timeout, and the worker's deadline
/// (`Instant + hold`) must never overflow.
pub const MAX_HOLD_MS: u64 = 60_000;

fn hold_ms(key: &str, ms: u64) -> Result<u64, InjectionParseError> {
    if ms > MAX_HOLD_MS {
        return Err(InjectionParseError::TooLong { key: key.to_string(), value: ms, max: MAX_HOLD_MS });
    }
    Ok(ms)
}

fn parse_number(key: &str, value: &str) -> Result<u64, InjectionParseError> {
    let parsed = match value.strip_prefix("0x").or_else(|| value.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => value.parse(),
    };
    parsed.map_err(|_| InjectionParseError::BadNumber { key: key.to_string(), value: value.to_string() })
}

/// What the injector decided for one completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionFate {
    Deliver,
    Drop,
    /// Hold for this many further doorbell records.
    Delay(u32),
}

/// The counters behind the knobs. One per HCA; counts only grow.
#[derive(Debug, Default)]
pub struct Injector {
    pub config: FaultInjection,
    reg_mrs: u64,
    ring_maps: u64,
    completions: u64,
    dmas: u64,
    /// Send work requests started (the clock of `hold_completion_wr`); whether the hold fired already.
    send_wrs: u64,
    hold_fired: bool,
}

impl Injector {
    pub fn new(config: FaultInjection) -> Injector {
        Injector { config, ..Default::default() }
    }

    /// Counts a REG_MR; true when this one must fail. Returns the ordinal too, for the event.
    pub fn reg_mr(&mut self) -> (u64, bool) {
        self.reg_mrs += 1;
        (self.reg_mrs, self.config.fail_reg_mr == Some(self.reg_mrs))
    }

    pub fn ring_map(&mut self) -> (u64, bool) {
        self.ring_maps += 1;
        (self.ring_maps, self.config.fail_ring_map == Some(self.ring_maps))
    }

    pub fn completion(&mut self) -> (u64, CompletionFate) {
        self.completions += 1;
        let n = Some(self.completions);
        let fate = if self.config.drop_completion == n {
            CompletionFate::Drop
        } else if self.config.delay_completion == n {
            CompletionFate::Delay(self.config.delay_doorbells.unwrap_or(1))
        } else {
            CompletionFate::Deliver
        };
        (self.completions, fate)
    }

    /// Counts a DMA; returns its ordinal and whether the invalidation knob fires before it.
    pub fn dma(&mut self) -> (u64, bool) {
        self.dmas += 1;
        (self.dmas, self.config.invalidate_at_dma == Some(self.dmas))
    }

    /// Counts a send work request the device starts executing.
    pub fn send_wr_started(&mut self) {
        self.send_wrs += 1;
    }

    /// Whether the send work request about to start is the one `hold_completion_ms` holds: its ordinal and the hold.
    /// Fires once per device, so the same request starting again after its hold runs.
    pub fn hold_next_send_wr(&mut self) -> Option<(u64, u64)> {
        let ms = self.config.hold_completion_ms?;
        let n = self.send_wrs + 1;
        if self.hold_fired || n != self.config.hold_completion_wr.unwrap_or(1) {
            return None;
        }
        self.hold_fired = true;
        Some((n, ms))
    }

    /// The longest contiguous run `pages` has, if it exceeds the cap.
    pub fn contiguous_violation(&self, pages: &[u64]) -> Option<(u32, u32)> {
        let cap = self.config.max_contiguous_pages?;
        let run = longest_contiguous_run(pages);
        (run > cap).then_some((run, cap))
    }
}

/// Longest run of pages whose IOVAs follow each other page by page.
pub fn longest_contiguous_run(pages: &[u64]) -> u32 {
    let mut best = 0u32;
    let mut run = 0u32;
    let mut prev: Option<u64> = None;
    for &p in pages {
        run = match prev.and_then(|q| q.checked_add(vhca_proto::PAGE_SIZE)) {
            Some(next) if next == p => run.saturating_add(1),
            _ => 1,
        };
        best = best.max(run);
        prev = Some(p);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_kv_sets_each_knob() {
        let mut f = FaultInjection::default();
        for kv in [
            "fail_reg_mr=3",
            "fail_ring_map=2",
            "drop_completion=5",
            "delay_completion=6",
            "delay_doorbells=4",
            "max_contiguous_pages=8",
            "contiguous_policy=split",
            "invalidate_at_dma=7",
            "invalidate_iova=0x10000",
            "invalidate_size=8192",
            "hold_completion_ms=250",
            "hold_completion_wr=3",
        ] {
            f.parse_kv(kv).unwrap();
        }
        let expected = FaultInjection {
            fail_reg_mr: Some(3),
            fail_ring_map: Some(2),
            drop_completion: Some(5),
            delay_completion: Some(6),
            delay_doorbells: Some(4),
            max_contiguous_pages: Some(8),
            contiguous_policy: ContiguousPolicy::Split,
            invalidate_at_dma: Some(7),
            invalidate_iova: Some(0x10000),
            invalidate_size: Some(8192),
            hold_completion_ms: Some(250),
            hold_completion_wr: Some(3),
        };
        assert_eq!(f, expected);
        let json = serde_json::to_string(&expected).unwrap();
        assert_eq!(FaultInjection::from_json(&json).unwrap(), expected);
        let mut again = FaultInjection::default();
        for kv in expected.to_kv() {
            again.parse_kv(&kv).unwrap();
        }
        assert_eq!(again, expected, "to_kv is a reproducer");
        assert!(!expected.is_empty());
    }

    #[test]
    fn no_injection_serialises_to_the_policy_only() {
        let none = FaultInjection::default();
        assert!(none.is_empty());
        assert!(none.to_kv().is_empty());
        assert_eq!(serde_json::to_string(&none).unwrap(), r#"{"contiguous_policy":"refuse"}"#);
        let one = FaultInjection { drop_completion: Some(2), ..Default::default() };
        assert_eq!(one.to_kv(), vec!["drop_completion=2"]);
        assert_eq!(serde_json::to_value(&one).unwrap()["drop_completion"], 2);
    }

    #[test]
    fn parse_kv_refuses_nonsense() {
        let mut f = FaultInjection::default();
        assert!(matches!(f.parse_kv("fail_reg_mr"), Err(InjectionParseError::NotKeyValue(_))));
        assert!(matches!(f.parse_kv("bogus=1"), Err(InjectionParseError::UnknownKey(_))));
        assert!(matches!(f.parse_kv("fail_reg_mr=x"), Err(InjectionParseError::BadNumber { .. })));
        assert!(matches!(f.parse_kv("fail_reg_mr=0"), Err(InjectionParseError::ZeroCount { .. })));
        assert!(matches!(f.parse_kv("max_contiguous_pages=0x100000000"), Err(InjectionParseError::BadNumber { .. })));
        assert!(matches!(f.parse_kv("contiguous_policy=maybe"), Err(InjectionParseError::BadPolicy(_))));
        assert!(matches!(f.parse_kv("hold_completion_ms=0"), Err(InjectionParseError::ZeroCount { .. })));
        assert!(matches!(f.parse_kv("hold_completion_ms=60001"), Err(InjectionParseError::TooLong { .. })));
        assert!(matches!(
            FaultInjection::from_json("{\"hold_completion_ms\":99999999}"),
            Err(InjectionParseError::TooLong { .. })
        ));
        assert!(matches!(FaultInjection::from_json("{\"nope\":1}"), Err(InjectionParseError::Json(_))));
        assert!(matches!(
            FaultInjection::from_json("{\"drop_completion\":0}"),
            Err(InjectionParseError::ZeroCount { .. })
        ));
        assert_eq!(f, FaultInjection::default());
    }

    #[test]
    fn the_hold_fires_once_at_its_send_work_request() {
        let config = FaultInjection { hold_completion_ms: Some(5), hold_completion_wr: Some(2), ..Default::default() };
        let mut injector = Injector::new(config);
        assert_eq!(injector.hold_next_send_wr(), None, "the first request runs");
        injector.send_wr_started();
        assert_eq!(injector.hold_next_send_wr(), Some((2, 5)), "the second is held");
        assert_eq!(injector.hold_next_send_wr(), None, "and starts after its hold without being held again");
        injector.send_wr_started();
        assert_eq!(injector.hold_next_send_wr(), None);
        let mut unset = Injector::default();
        assert_eq!(unset.hold_next_send_wr(), None);
    }

    #[test]
    fn contiguous_runs() {
        assert_eq!(longest_contiguous_run(&[]), 0);
        assert_eq!(longest_contiguous_run(&[0x1000, 0x2000, 0x9000, 0xa000, 0xb000]), 3);
        assert_eq!(longest_contiguous_run(&[!0xfff, 0]), 1);
    }
}
