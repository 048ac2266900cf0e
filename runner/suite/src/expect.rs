//! The expected verdict of one concrete run, as written in a suite file (`pass`, `bugcheck 0xE6 0x26 * * 0x4`, ...).
//! Parsing is strict: a typo in an expectation must fail the suite file, not silently expect something else.
//! A bugcheck names all four parameters: every one must match, except those marked `*` (addresses, which differ
//! from run to run).

use std::fmt;

use serde::{Serialize, Serializer};
use vhca_proto::async_event::FaultCause;

use crate::stop_line::parse_hex;

/// What a run should end in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    Pass,
    /// A bugcheck with this code and these four parameters.
    Bugcheck {
        code: u32,
        params: [Param; 4],
    },
    /// The device refused a DMA for this cause (a `FaultCause` name from proto).
    DeviceFault {
        cause: String,
    },
    GuestPanic,
    /// The guest's own checks failed the run (`"ok": false`), with an error that contains this word if one is
    /// given: a failure no kernel check catches (the shared buffer's stale read under double buffering).
    GuestFailed {
        word: Option<String>,
    },
    Hang,
    /// The race detector reported at least one race (whatever the run did after: a race often ends in a
    /// bugcheck), one of them naming this word in its object or a call site if one is given.
    Race {
        word: Option<String>,
    },
}

/// One expected bugcheck parameter: a value, or `*` for an address that differs from run to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    Is(u64),
    Any,
}

impl Param {
    pub fn matches(self, actual: u64) -> bool {
        match self {
            Param::Is(v) => v == actual,
            Param::Any => true,
        }
    }
}

impl fmt::Display for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Param::Is(v) => write!(f, "{v:#X}"),
            Param::Any => write!(f, "*"),
        }
    }
}

const VERDICTS: &str =
    "pass, bugcheck CODE P1 P2 P3 P4, device-fault CAUSE, guest-panic, guest-failed [WORD], hang, race [WORD]";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpectParseError {
    #[error("empty verdict; expected one of: {VERDICTS}")]
    Empty,
    #[error("unknown verdict '{0}'; expected one of: {VERDICTS}")]
    UnknownKind(String),
    #[error("'{verdict}' takes no argument, found '{extra}'")]
    UnexpectedArgument { verdict: &'static str, extra: String },
    #[error("bugcheck needs a code, e.g. 'bugcheck 0xE6'")]
    MissingCode,
    #[error("bad bugcheck code '{0}': expected 0x-prefixed hex that fits in 32 bits")]
    BadCode(String),
    #[error(
        "bad bugcheck parameter {index} '{text}': expected 0x-prefixed hex that fits in 64 bits, or * for an address"
    )]
    BadParam { index: usize, text: String },
    #[error("bugcheck {code} names {given} parameter(s): give all four (e.g. 'bugcheck 0xE6 0x26 * * 0x5'), * for addresses")]
    ParamCount { code: String, given: usize },
    #[error("device-fault needs a cause, one of: {}", fault_cause_names().join(", "))]
    MissingCause,
    #[error("unknown device fault cause '{0}'; expected one of: {names}", names = fault_cause_names().join(", "))]
    UnknownCause(String),
}

/// The cause names a device fault can carry (from proto's `FaultCause`, without `none`).
pub fn fault_cause_names() -> Vec<&'static str> {
    (1..u32::MAX).map_while(FaultCause::from_u32).map(FaultCause::name).collect()
}

impl Expected {
    pub fn parse(text: &str) -> Result<Expected, ExpectParseError> {
        let mut words = text.split_whitespace();
        let kind = words.next().ok_or(ExpectParseError::Empty)?;
        let args: Vec<&str> = words.collect();
        let no_args = |verdict: &'static str, e: Expected| {
            if args.is_empty() {
                Ok(e)
            } else {
                Err(ExpectParseError::UnexpectedArgument { verdict, extra: args.join(" ") })
            }
        };
        match kind {
            "pass" => no_args("pass", Expected::Pass),
            "guest-panic" => no_args("guest-panic", Expected::GuestPanic),
            "guest-failed" => match args.as_slice() {
                [] => Ok(Expected::GuestFailed { word: None }),
                [word] => Ok(Expected::GuestFailed { word: Some(word.to_string()) }),
                [_, rest @ ..] => {
                    Err(ExpectParseError::UnexpectedArgument { verdict: "guest-failed", extra: rest.join(" ") })
                }
            },
            "hang" => no_args("hang", Expected::Hang),
            "race" => match args.as_slice() {
                [] => Ok(Expected::Race { word: None }),
                [word] => Ok(Expected::Race { word: Some(word.to_string()) }),
                [_, rest @ ..] => Err(ExpectParseError::UnexpectedArgument { verdict: "race", extra: rest.join(" ") }),
            },
            "bugcheck" => {
                let code_text = args.first().ok_or(ExpectParseError::MissingCode)?;
                let code = parse_hex(code_text)
                    .and_then(|c| u32::try_from(c).ok())
                    .ok_or_else(|| ExpectParseError::BadCode(code_text.to_string()))?;
                let given = &args[1..];
                if given.len() != 4 {
                    return Err(ExpectParseError::ParamCount { code: code_text.to_string(), given: given.len() });
                }
                let mut params = [Param::Any; 4];
                for (index, (slot, text)) in params.iter_mut().zip(given).enumerate() {
                    *slot = match *text {
                        "*" => Param::Any,
                        t => Param::Is(
                            parse_hex(t)
                                .ok_or_else(|| ExpectParseError::BadParam { index: index + 1, text: t.to_string() })?,
                        ),
                    };
                }
                Ok(Expected::Bugcheck { code, params })
            }
            "device-fault" => {
                let cause = args.first().ok_or(ExpectParseError::MissingCause)?;
                if !fault_cause_names().contains(cause) {
                    return Err(ExpectParseError::UnknownCause(cause.to_string()));
                }
                if args.len() > 1 {
                    return Err(ExpectParseError::UnexpectedArgument {
                        verdict: "device-fault",
                        extra: args[1..].join(" "),
                    });
                }
                Ok(Expected::DeviceFault { cause: cause.to_string() })
            }
            other => Err(ExpectParseError::UnknownKind(other.to_string())),
        }
    }
}

/// The suite-file form, so `Expected::parse(e.to_string()) == e`.
impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expected::Pass => write!(f, "pass"),
            Expected::Bugcheck { code, params: [p1, p2, p3, p4] } => {
                write!(f, "bugcheck {code:#X} {p1} {p2} {p3} {p4}")
            }
            Expected::DeviceFault { cause } => write!(f, "device-fault {cause}"),
            Expected::GuestPanic => write!(f, "guest-panic"),
            Expected::GuestFailed { word: None } => write!(f, "guest-failed"),
            Expected::GuestFailed { word: Some(w) } => write!(f, "guest-failed {w}"),
            Expected::Hang => write!(f, "hang"),
            Expected::Race { word: None } => write!(f, "race"),
            Expected::Race { word: Some(w) } => write!(f, "race {w}"),
        }
    }
}

impl Serialize for Expected {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form_and_round_trips() {
        let cases = [
            ("pass", Expected::Pass),
            (
                "bugcheck 0xC4 0xE5 0x1 0x0 0x0",
                Expected::Bugcheck { code: 0xC4, params: [Param::Is(0xE5), Param::Is(1), Param::Is(0), Param::Is(0)] },
            ),
            (
                "bugcheck 0x000000e6 0x26 * * 0x5",
                Expected::Bugcheck { code: 0xE6, params: [Param::Is(0x26), Param::Any, Param::Any, Param::Is(5)] },
            ),
            ("device-fault iommu_unmapped", Expected::DeviceFault { cause: "iommu_unmapped".into() }),
            ("  guest-panic ", Expected::GuestPanic),
            ("guest-failed", Expected::GuestFailed { word: None }),
            ("guest-failed stale", Expected::GuestFailed { word: Some("stale".into()) }),
            ("hang", Expected::Hang),
            ("race", Expected::Race { word: None }),
            ("race cq.rs", Expected::Race { word: Some("cq.rs".into()) }),
        ];
        for (text, want) in cases {
            let got = Expected::parse(text).unwrap();
            assert_eq!(got, want, "{text}");
            assert_eq!(Expected::parse(&got.to_string()).unwrap(), want);
        }
    }

    #[test]
    fn refuses_bad_strings() {
        use ExpectParseError as E;
        type Check = fn(&E) -> bool;
        let cases: [(&str, Check); 13] = [
            ("race cq.rs dpc.rs", |e| matches!(e, E::UnexpectedArgument { verdict: "race", .. })),
            ("races", |e| matches!(e, E::UnknownKind(_))),
            ("", |e| matches!(e, E::Empty)),
            ("passes", |e| matches!(e, E::UnknownKind(_))),
            ("pass now", |e| matches!(e, E::UnexpectedArgument { .. })),
            ("bugcheck", |e| matches!(e, E::MissingCode)),
            ("bugcheck E6", |e| matches!(e, E::BadCode(_))),
            ("bugcheck 0x1FFFFFFFF", |e| matches!(e, E::BadCode(_))),
            ("bugcheck 0xE6 26 0x0 0x0 0x0", |e| matches!(e, E::BadParam { index: 1, .. })),
            ("bugcheck 0xE6 0x26 0x0 ** 0x0", |e| matches!(e, E::BadParam { index: 3, .. })),
            ("bugcheck 0xE6 0x26", |e| matches!(e, E::ParamCount { given: 1, .. })),
            ("device-fault", |e| matches!(e, E::MissingCause)),
            ("device-fault iommu", |e| matches!(e, E::UnknownCause(_))),
        ];
        for (text, check) in cases {
            let err = Expected::parse(text).unwrap_err();
            assert!(check(&err), "{text:?} gave {err:?}");
        }
    }

    #[test]
    fn fault_causes_come_from_proto() {
        let names = fault_cause_names();
        assert!(names.contains(&"iommu_unmapped"));
        assert!(names.contains(&"stale_translation"));
        assert!(!names.contains(&"none"));
        assert_eq!(names.len(), 6);
    }
}
