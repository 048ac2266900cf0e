//! The scenarios each guest program knows, and the refusal of a suite that names another one before anything boots:
//! a misspelt name would otherwise cost a guest boot per run, each ending in the guest's own `unknown scenario`.

use vhca_suite::{GuestKind, Suite};

/// The Linux guest program's own scenarios besides the driver's (guest-driver/guest/src/bring_up.rs,
/// `Scenario::parse`): the transport's negative control and the round-trip timing.
const LINUX_GUEST_OWN: [&str; 2] = ["unmapped", "roundtrip"];

/// What the guest program of `guest` runs: the driver's scenarios (vhca-scenarios, which the Linux guest program
/// and vhca.sys both look names up in), and on Linux the guest program's own.
pub fn known(guest: GuestKind) -> Vec<&'static str> {
    let driver = std::iter::once(vhca_scenarios::Scenario::Smoke).chain(vhca_scenarios::Scenario::DRIVER);
    let mut names: Vec<&'static str> = driver.map(|s| s.name()).collect();
    if guest == GuestKind::Linux {
        names.extend(LINUX_GUEST_OWN);
    }
    names
}

/// Every run of `suite` whose scenario its guest does not know, one line each with the closest known name;
/// Ok when there is none.
pub fn check_suite(suite: &Suite) -> Result<(), String> {
    let known = known(suite.guest);
    let lines: Vec<String> = suite
        .unknown_scenarios(&known)
        .into_iter()
        .map(|(_run, line, scenario)| {
            format!("unknown scenario {scenario:?} in {}:{line}; {}", suite.source, hint(&scenario, &known))
        })
        .collect();
    if lines.is_empty() {
        Ok(())
    } else {
        Err(lines.join("\n"))
    }
}

/// One scenario named on the command line (`boot --scenario`), checked against the Linux guest's list.
pub fn check_name(scenario: &str, flag: &str) -> Result<(), String> {
    let known = known(GuestKind::Linux);
    if known.contains(&scenario) {
        return Ok(());
    }
    Err(format!("unknown scenario {scenario:?} ({flag}); {}", hint(scenario, &known)))
}

/// "did you mean" the nearest known name when it is a plausible typo (a few edits away), else the whole list.
fn hint(scenario: &str, known: &[&str]) -> String {
    let nearest = known.iter().map(|k| (strsim::levenshtein(scenario, k), *k)).min();
    match nearest {
        Some((distance, name)) if distance <= (scenario.len() / 3).max(2) => format!("did you mean {name:?}?"),
        _ => format!("the guest knows: {}", known.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typo_is_refused_with_the_closest_name_and_its_line() {
        let text = "name = \"mine\"\n\n[[run]]\nname = \"loop\"\nexpect = \"pass\"\nguest = { scenario = \"verbs-loopbak\" }\n";
        let suite = Suite::parse(text, "my.toml").unwrap();
        let err = check_suite(&suite).unwrap_err();
        assert_eq!(err, "unknown scenario \"verbs-loopbak\" in my.toml:4; did you mean \"verbs-loopback\"?");
    }

    #[test]
    fn a_name_nothing_like_a_scenario_gets_the_list() {
        let err = check_name("frobnicate", "--scenario").unwrap_err();
        assert!(err.starts_with("unknown scenario \"frobnicate\" (--scenario); the guest knows: smoke, "), "{err}");
    }

    #[test]
    fn the_seed_suite_and_the_guest_programs_own_names_pass() {
        check_suite(&Suite::seed().unwrap()).unwrap();
        for name in ["smoke", "unmapped", "roundtrip", "use-after-unmap"] {
            check_name(name, "--scenario").unwrap();
        }
    }

    #[test]
    fn windows_guests_do_not_know_the_linux_programs_own_scenarios() {
        assert!(!known(GuestKind::Windows).contains(&"unmapped"));
        assert!(known(GuestKind::Windows).contains(&"verbs-loopback"));
    }

    /// The Linux guest program's own names are written here and in its `Scenario::parse`; this reads that match so
    /// the two cannot drift apart silently.
    #[test]
    fn the_linux_guest_programs_own_names_match_its_parser() {
        let source = include_str!("../../guest-driver/guest/src/bring_up.rs");
        let parse = &source[source.find("fn parse(name: &str)").expect("bring_up.rs has Scenario::parse")..];
        let parse = &parse[..parse.find("\n    }\n").unwrap_or(parse.len())];
        let arms: Vec<&str> = parse
            .lines()
            .filter_map(|l| l.trim().strip_prefix('"')?.split_once("\" =>").map(|(name, _)| name))
            .filter(|name| *name != "smoke")
            .collect();
        assert_eq!(arms, LINUX_GUEST_OWN, "bring_up.rs's own scenarios changed: update LINUX_GUEST_OWN");
    }
}
