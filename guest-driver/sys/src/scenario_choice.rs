//! How a Windows run picks its scenario. The runner (or whoever prepares the guest) writes the REG_SZ value
//! `Scenario` under the service's `Parameters` key before the driver starts
//! (`reg add HKLM\SYSTEM\CurrentControlSet\Services\vhca\Parameters /v Scenario /d fast-mutex-create-cq`);
//! the INF installs `smoke` there as the default. START_DEVICE reads it and runs that scenario once. Every
//! scenario of vhca-scenarios can be named, smoke included.

use alloc::string::String;
use core::fmt;

use vhca_scenarios::{lock_kind, Scenario, ScenarioOptions};

/// Why the registry value names no scenario vhca.sys runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChoiceError {
    /// The value is not valid UTF-16.
    NotText,
    /// A name vhca.sys does not run (it may be a Linux-only scenario).
    Unknown(String),
    /// The Lock value names no lock kind.
    UnknownLock(String),
    /// The BreakFix value is neither 0 nor 1.
    NotAFlag(String),
}

impl fmt::Display for ChoiceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChoiceError::NotText => write!(f, "a Parameters value is not UTF-16 text"),
            ChoiceError::UnknownLock(name) => write!(f, "Lock {name:?} is not fast_mutex, kmutex or eresource"),
            ChoiceError::NotAFlag(text) => write!(f, "BreakFix {text:?} is not 0 or 1"),
            ChoiceError::Unknown(name) => {
                write!(f, "scenario {name:?} is not one vhca.sys runs (known:")?;
                for s in core::iter::once(Scenario::Smoke).chain(Scenario::DRIVER) {
                    write!(f, " {}", s.name())?;
                }
                write!(f, ")")
            }
        }
    }
}

/// The scenario a REG_SZ value names. `None` (no value) is the default, smoke. REG_SZ data carries its
/// terminating NUL inside the value's length; it and surrounding blanks are ignored.
pub fn choose(value: Option<&[u16]>) -> Result<Scenario, ChoiceError> {
    let Some(units) = value else { return Ok(Scenario::Smoke) };
    let text = text(units)?;
    Scenario::find(&text).ok_or(ChoiceError::Unknown(text))
}

/// The scenario's options from the REG_SZ values `Lock` (the guest's `vhca.lock` spellings) and `BreakFix` (`1`
/// takes the fixed scenarios' buggy path, as `vhca.break_fix=1`); a missing value is the default.
pub fn options(lock: Option<&[u16]>, break_fix: Option<&[u16]>) -> Result<ScenarioOptions, ChoiceError> {
    let lock = match lock.map(text).transpose()? {
        None => None,
        Some(name) => Some(lock_kind(&name).ok_or(ChoiceError::UnknownLock(name))?),
    };
    let break_fix = match break_fix.map(text).transpose()?.as_deref() {
        None | Some("0") => false,
        Some("1") => true,
        Some(other) => return Err(ChoiceError::NotAFlag(other.into())),
    };
    Ok(ScenarioOptions { lock, break_fix })
}

/// REG_SZ data as text: its terminating NUL (inside the value's length) and surrounding blanks dropped.
fn text(units: &[u16]) -> Result<String, ChoiceError> {
    let end = units.iter().position(|&u| u == 0).unwrap_or(units.len());
    let text: String = char::decode_utf16(units[..end].iter().copied())
        .collect::<Result<String, _>>()
        .map_err(|_| ChoiceError::NotText)?;
    Ok(text.trim().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utf16(s: &str) -> Vec<u16> {
        s.encode_utf16().collect()
    }

    #[test]
    fn the_registry_value_picks_the_scenario() {
        assert_eq!(choose(None), Ok(Scenario::Smoke));
        let mut with_nul = utf16("fast-mutex-create-cq");
        with_nul.push(0);
        assert_eq!(choose(Some(&with_nul)), Ok(Scenario::FastMutexCreateCq));
        assert_eq!(choose(Some(&utf16(" fixed-lock-create-cq "))), Ok(Scenario::FixedLockCreateCq));
    }

    #[test]
    fn unknown_names_and_broken_text_are_refused_with_the_cause() {
        assert_eq!(choose(Some(&utf16("use-after-unmap"))), Ok(Scenario::UseAfterUnmap));
        let err = choose(Some(&utf16("unmapped"))).unwrap_err();
        assert_eq!(err, ChoiceError::Unknown("unmapped".into()));
        assert!(err.to_string().contains("fast-mutex-create-cq"), "{err}");
        assert_eq!(choose(Some(&[0xD800, 0x0041])), Err(ChoiceError::NotText));
    }

    #[test]
    fn the_registry_values_set_the_options() {
        assert_eq!(options(None, None), Ok(ScenarioOptions::default()));
        let kmutex = options(Some(&utf16("kmutex\0")), Some(&utf16("1"))).unwrap();
        assert_eq!(kmutex.lock, Some(vhca_driver_core::ClMutexKind::KMutex));
        assert!(kmutex.break_fix);
        assert_eq!(options(Some(&utf16("spin")), None), Err(ChoiceError::UnknownLock("spin".into())));
        assert_eq!(options(None, Some(&utf16("yes"))), Err(ChoiceError::NotAFlag("yes".into())));
    }

    /// Every scenario vhca.sys runs but the verbs suite's two is a run of the seed suite the runner judges, so its
    /// verdicts apply unchanged.
    #[test]
    fn every_windows_scenario_is_in_the_seed_suite() {
        let suite = include_str!("../../../runner/suite/suites/seed.toml");
        let verbs_only = [Scenario::VerbsLoopback, Scenario::DevicePoolExhaustion];
        for s in core::iter::once(Scenario::Smoke).chain(Scenario::DRIVER).filter(|s| !verbs_only.contains(s)) {
            assert!(suite.contains(&format!("name = \"{}\"", s.name())), "{} not in seed.toml", s.name());
        }
    }
}
