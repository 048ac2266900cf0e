//! How a Windows run picks its scenario. The runner (or whoever prepares the guest) writes the REG_SZ value
//! `Scenario` under the service's `Parameters` key before the driver starts
//! (`reg add HKLM\SYSTEM\CurrentControlSet\Services\vhca\Parameters /v Scenario /d fast-mutex-create-cq`);
//! the INF installs `smoke` there as the default. START_DEVICE reads it and runs that scenario once.

use alloc::string::String;
use core::fmt;

/// The seed scenarios vhca.sys can run today: those the driver core performs on its own (no user-mode buffers,
/// no verifier model: on Windows the verifier is Windows' own). Names are the suite's (runner/suite/suites).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowsScenario {
    /// Open the HCA (IoGetDmaAdapter, QUERY_DEVICE), allocate and free a PD, close.
    Smoke,
    /// The seed's bug: create_cq (AllocateCommonBuffer, PASSIVE_LEVEL only) under a FAST_MUTEX (APC_LEVEL).
    FastMutexCreateCq,
    /// The fix: the same under a KMUTEX, which leaves the holder at PASSIVE_LEVEL.
    FixedLockCreateCq,
}

impl WindowsScenario {
    pub const ALL: [WindowsScenario; 3] =
        [WindowsScenario::Smoke, WindowsScenario::FastMutexCreateCq, WindowsScenario::FixedLockCreateCq];

    pub fn name(self) -> &'static str {
        match self {
            WindowsScenario::Smoke => "smoke",
            WindowsScenario::FastMutexCreateCq => "fast-mutex-create-cq",
            WindowsScenario::FixedLockCreateCq => "fixed-lock-create-cq",
        }
    }
}

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
                for s in WindowsScenario::ALL {
                    write!(f, " {}", s.name())?;
                }
                write!(f, ")")
            }
        }
    }
}

/// The scenario a REG_SZ value names. `None` (no value) is the default, smoke. REG_SZ data carries its
/// terminating NUL inside the value's length; it and surrounding blanks are ignored.
pub fn choose(value: Option<&[u16]>) -> Result<WindowsScenario, ChoiceError> {
    let Some(units) = value else { return Ok(WindowsScenario::Smoke) };
    let end = units.iter().position(|&u| u == 0).unwrap_or(units.len());
    let text: String = char::decode_utf16(units[..end].iter().copied())
        .collect::<Result<String, _>>()
        .map_err(|_| ChoiceError::NotText)?;
    let name = text.trim();
    WindowsScenario::ALL.into_iter().find(|s| s.name() == name).ok_or_else(|| ChoiceError::Unknown(name.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utf16(s: &str) -> Vec<u16> {
        s.encode_utf16().collect()
    }

    #[test]
    fn the_registry_value_picks_the_scenario() {
        assert_eq!(choose(None), Ok(WindowsScenario::Smoke));
        let mut with_nul = utf16("fast-mutex-create-cq");
        with_nul.push(0);
        assert_eq!(choose(Some(&with_nul)), Ok(WindowsScenario::FastMutexCreateCq));
        assert_eq!(choose(Some(&utf16(" fixed-lock-create-cq "))), Ok(WindowsScenario::FixedLockCreateCq));
    }

    #[test]
    fn unknown_names_and_broken_text_are_refused_with_the_cause() {
        let err = choose(Some(&utf16("use-after-unmap"))).unwrap_err();
        assert_eq!(err, ChoiceError::Unknown("use-after-unmap".into()));
        assert!(err.to_string().contains("fast-mutex-create-cq"), "{err}");
        assert_eq!(choose(Some(&[0xD800, 0x0041])), Err(ChoiceError::NotText));
    }

    /// Every name vhca.sys runs is a run of the seed suite the runner judges, so its verdicts apply unchanged.
    #[test]
    fn every_windows_scenario_is_in_the_seed_suite() {
        let suite = include_str!("../../../runner/suite/suites/seed.toml");
        for s in WindowsScenario::ALL {
            assert!(suite.contains(&format!("name = \"{}\"", s.name())), "{} not in seed.toml", s.name());
        }
    }
}
