//! How a Windows run picks its scenario. The runner (or whoever prepares the guest) writes the REG_SZ value
//! `Scenario` under the service's `Parameters` key before the driver starts
//! (`reg add HKLM\SYSTEM\CurrentControlSet\Services\vhca\Parameters /v Scenario /d fast-mutex-create-cq`);
//! the INF installs `smoke` there as the default. START_DEVICE reads it and runs that scenario once. Every
//! scenario of vhca-scenarios can be named, smoke included.

use alloc::string::String;
use core::fmt;

use vhca_scenarios::Scenario;

/// Why the registry value names no scenario vhca.sys runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChoiceError {
    /// The value is not valid UTF-16.
    NotText,
    /// A name vhca.sys does not run (it may be a Linux-only scenario).
    Unknown(String),
}

impl fmt::Display for ChoiceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChoiceError::NotText => write!(f, "the Scenario value is not UTF-16 text"),
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
    let end = units.iter().position(|&u| u == 0).unwrap_or(units.len());
    let text: String = char::decode_utf16(units[..end].iter().copied())
        .collect::<Result<String, _>>()
        .map_err(|_| ChoiceError::NotText)?;
    let name = text.trim();
    Scenario::find(name).ok_or_else(|| ChoiceError::Unknown(name.into()))
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
