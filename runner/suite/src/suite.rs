//! A validated suite: runs with their device and guest options and one expectation per verifier mode, and the
//! expansion of each run into concrete runs `<name>/verifier-off` and `<name>/verifier-on`.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::expect::Expected;
use crate::fail_points::FaultPointSeen;
use crate::interleavings::{InterleavingPlan, RunInterleaving};

/// Driver Verifier flags for the "on" mode unless a run overrides them: DMA checking 0x80, IRQL checking 0x2,
/// pool tracking 0x8, deadlock detection 0x20.
pub const DEFAULT_VERIFIER_FLAGS: u32 = 0x80 | 0x2 | 0x8 | 0x20;

/// Driver Verifier's Systematic Low Resource Simulation flag (bit 18).
pub const SYSTEMATIC_LOW_RESOURCES: u32 = 0x40000;

/// Per-run guest timeout when neither the run nor the suite's `[defaults]` sets one.
pub const DEFAULT_TIMEOUT_S: u32 = 60;

/// Seconds without serial output after which a run counts as hung. A TCG boot with `quiet` is silent for 3-10 s
/// (more on a loaded host running runs in parallel), so this leaves room without waiting out the whole timeout.
pub const DEFAULT_SILENCE_S: u32 = 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VerifierMode {
    Off,
    On,
}

impl VerifierMode {
    pub const ALL: [VerifierMode; 2] = [VerifierMode::Off, VerifierMode::On];

    pub fn as_str(self) -> &'static str {
        match self {
            VerifierMode::Off => "off",
            VerifierMode::On => "on",
        }
    }
}

impl fmt::Display for VerifierMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The lock a scenario's control path holds around create_cq.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LockKind {
    FastMutex,
    Kmutex,
    Eresource,
}

impl LockKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LockKind::FastMutex => "fast_mutex",
            LockKind::Kmutex => "kmutex",
            LockKind::Eresource => "eresource",
        }
    }
}

/// How the device is started for a run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DeviceOptions {
    /// `vhca-device --map-registers N`; `None`: the device's default.
    pub map_registers: Option<u32>,
    /// Each becomes `vhca-device --inject KEY=VALUE`, in order.
    pub inject: Vec<String>,
    /// `vhca-device --revalidate-stale`: a register made stale by an IOTLB invalidation asks the vIOMMU again on its
    /// next use, so DMA after an unmap reaches the IOMMU (which refuses it and reports the fault to the guest).
    pub revalidate_stale: bool,
    /// `device = { access_platform = false }`: `vhca-device --no-access-platform` and QEMU's iommu_platform=off, the
    /// device that bypasses the IOMMU, which the driver must refuse at start.
    pub without_access_platform: bool,
}

/// Which build of the driver runs a scenario in the guest: the driver core compiled into the guest program, or
/// the signed vhca.sys loaded by the guest's PE loader (`vhca.driver=sys`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Personality {
    #[default]
    Native,
    Sys,
}

impl Personality {
    pub fn as_str(self) -> &'static str {
        match self {
            Personality::Native => "native",
            Personality::Sys => "sys",
        }
    }

    pub fn parse(text: &str) -> Option<Personality> {
        match text {
            "native" => Some(Personality::Native),
            "sys" => Some(Personality::Sys),
            _ => None,
        }
    }
}

impl std::fmt::Display for Personality {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the guest program runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GuestOptions {
    pub scenario: String,
    pub lock: Option<LockKind>,
    /// Free-form `vhca.KEY=VALUE` settings, keys without the `vhca.` prefix.
    pub extra: BTreeMap<String, String>,
    pub timeout_s: u32,
    /// No serial output for this long: the run is hung.
    pub silence_s: u32,
    /// The driver personality (`driver` in the suite file, `--driver` on the command line).
    pub driver: Personality,
}

/// One run as written in the suite file, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuiteRun {
    pub name: String,
    pub device: DeviceOptions,
    pub guest: GuestOptions,
    /// Flags for the "on" mode.
    pub verifier_flags: u32,
    /// The modes this run expands to, each with its expectation, in `VerifierMode` order.
    pub expect: BTreeMap<VerifierMode, Expected>,
    /// vhca.sys's own expectations where they differ (`expect_sys`): a check the native build alone reaches, as the
    /// race detector's view of memory the driver touches through the kernel.
    pub expect_sys: Option<BTreeMap<VerifierMode, Expected>>,
    /// Device event-log kinds that must appear, per mode (a mode without an entry requires none).
    pub events: BTreeMap<VerifierMode, Vec<String>>,
    /// Exhaustive low-resources mode: the run records its failure points; each then runs alone (`fail_point`).
    pub each_fail_point: bool,
    /// 1-based line of the run's `name` in the suite file, for messages that point back at it.
    pub line: usize,
    /// The driver personalities it runs in, in order, never empty: its own `driver`, else the suite's
    /// `[defaults] drivers`, else native.
    pub drivers: Vec<Personality>,
    /// The guest's processors and QEMU's vCPUs (`processors = N`); None: the defaults.
    pub processors: Option<u32>,
    /// `interleavings = "preempt1" | "preempt2" | "pct:<runs>"` with `max_interleavings`: the run records its
    /// contended scheduling points, then each schedule choice runs alone.
    pub interleavings: Option<InterleavingPlan>,
}

/// The guest a suite's runs boot: the Linux guest program (built here), or a Windows image the user built from
/// their own ISO (images/windows; never run on the machines this project is developed on).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestKind {
    #[default]
    Linux,
    Windows,
}

impl GuestKind {
    pub fn as_str(self) -> &'static str {
        match self {
            GuestKind::Linux => "linux",
            GuestKind::Windows => "windows",
        }
    }
}

/// A validated suite file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suite {
    pub name: String,
    /// Where it came from (a path, or `<built-in seed>`), as error messages name it.
    pub source: String,
    pub runs: Vec<SuiteRun>,
    /// `guest = "windows"` at the top of the file; Linux when absent.
    pub guest: GuestKind,
    /// `windows_image = "PATH"`: the image directory `vhca-run windows-image build` wrote (a relative path is
    /// relative to the suite file); `--windows-image` overrides it.
    pub windows_image: Option<String>,
}

/// One thing the runner executes: a run in one verifier mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConcreteRun {
    /// `<run>/verifier-<mode>` natively, `<run>/sys/verifier-<mode>` as vhca.sys; unique in the suite, the name
    /// filters and reports use.
    pub name: String,
    pub run: String,
    pub mode: VerifierMode,
    /// 0 for "off".
    pub verifier_flags: u32,
    pub device: DeviceOptions,
    pub guest: GuestOptions,
    pub expected: Expected,
    /// Device event-log kinds (`map_registers_exhausted`, ...) that must appear for the run to pass.
    pub events: Vec<String>,
    /// The run records the low-resources simulation's failure points (Windows' systematic "what if" mode); the
    /// runner then expands each into a run of its own.
    pub records_fail_points: bool,
    /// The run fails only failure point k (the rig's exhaustive mode; `vhca-run boot --fail-point k`).
    pub fail_point: Option<u32>,
    /// What the recording run saw at point k, when this run was expanded from one: the site the run must fail.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recorded_point: Option<FaultPointSeen>,
    /// Its processors, and its part in the interleaving modes (a recording, or one schedule of an expansion).
    #[serde(skip_serializing_if = "RunInterleaving::is_default")]
    pub interleaving: RunInterleaving,
}

impl ConcreteRun {
    /// The guest's `vhca.*` settings for this run, in a stable order: scenario, lock, verifier, then the extras.
    /// The runner puts them on the kernel command line (cold) or hands them to the resident agent (snapshot).
    pub fn guest_params(&self) -> Vec<(String, String)> {
        let mut params = vec![("vhca.scenario".to_string(), self.guest.scenario.clone())];
        if let Some(lock) = self.guest.lock {
            params.push(("vhca.lock".to_string(), lock.as_str().to_string()));
        }
        params.push(("vhca.verifier".to_string(), format!("{:#x}", self.verifier_flags)));
        if self.guest.driver == Personality::Sys {
            params.push(("vhca.driver".to_string(), Personality::Sys.as_str().to_string()));
        }
        params.extend(self.guest.extra.iter().map(|(k, v)| (format!("vhca.{k}"), v.clone())));
        if let Some(n) = self.interleaving.processors {
            params.push(("vhca.processors".to_string(), n.to_string()));
        }
        if let Some(mode) = self.interleaving.guest_mode() {
            params.push(("vhca.interleave".to_string(), mode));
        }
        if let Some(n) = self.interleaving.pct_horizon {
            params.push(("vhca.pct_horizon".to_string(), n.to_string()));
        }
        match self.fail_point {
            Some(k) => params.push(("vhca.fail_point".to_string(), k.to_string())),
            None if self.records_fail_points => {
                params.push(("vhca.faults_systematic".to_string(), "record".to_string()))
            }
            None => {}
        }
        params
    }

    /// This run failing only failure point `k` (1-based, as its recording numbered them): `<name>/fail-point-<k>`.
    pub fn at_fail_point(&self, k: u32) -> ConcreteRun {
        ConcreteRun {
            name: format!("{}{FAIL_POINT_INFIX}{k}", self.name),
            run: format!("{}{FAIL_POINT_INFIX}{k}", self.run),
            records_fail_points: false,
            fail_point: Some(k),
            recorded_point: None,
            interleaving: RunInterleaving { plan: None, ..self.interleaving.clone() },
            ..self.clone()
        }
    }

    /// The device's extra arguments for this run: `--map-registers N` and one `--inject KEY=VALUE` per injection.
    pub fn device_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(n) = self.device.map_registers {
            args.push("--map-registers".to_string());
            args.push(n.to_string());
        }
        for kv in &self.device.inject {
            args.push("--inject".to_string());
            args.push(kv.clone());
        }
        if self.device.revalidate_stale {
            args.push("--revalidate-stale".to_string());
        }
        if self.device.without_access_platform {
            args.push("--no-access-platform".to_string());
        }
        args
    }
}

/// What joins a concrete run's name and a failure point's number in the name of the run that fails it.
pub const FAIL_POINT_INFIX: &str = "/fail-point-";

/// `<concrete run>/fail-point-<k>` split into the concrete run's name and k.
pub fn split_fail_point(name: &str) -> Option<(&str, u32)> {
    let (base, k) = name.rsplit_once(FAIL_POINT_INFIX)?;
    Some((base, k.parse().ok().filter(|k| *k > 0)?))
}

/// The concrete-run name for a run in a personality and a mode.
pub fn concrete_name(run: &str, driver: Personality, mode: VerifierMode) -> String {
    match driver {
        Personality::Native => format!("{run}/verifier-{mode}"),
        Personality::Sys => format!("{run}/sys/verifier-{mode}"),
    }
}

impl Suite {
    /// Every concrete run, in file order, each run's personalities in order, "off" before "on".
    pub fn expand(&self) -> Vec<ConcreteRun> {
        let mut out = Vec::new();
        for run in &self.runs {
            for &driver in &run.drivers {
                for (mode, expected) in &run.expect {
                    let expected = match (driver, &run.expect_sys) {
                        (Personality::Sys, Some(sys)) => sys.get(mode).unwrap_or(expected),
                        _ => expected,
                    };
                    out.push(ConcreteRun {
                        name: concrete_name(&run.name, driver, *mode),
                        run: run.name.clone(),
                        mode: *mode,
                        verifier_flags: match mode {
                            VerifierMode::Off => 0,
                            VerifierMode::On => run.verifier_flags,
                        },
                        device: run.device.clone(),
                        guest: GuestOptions { driver, ..run.guest.clone() },
                        expected: expected.clone(),
                        events: run.events.get(mode).cloned().unwrap_or_default(),
                        records_fail_points: run.each_fail_point,
                        fail_point: None,
                        recorded_point: None,
                        interleaving: RunInterleaving {
                            processors: run.processors,
                            plan: run.interleavings,
                            ..RunInterleaving::default()
                        },
                    });
                }
            }
        }
        out
    }

    /// `--driver`: every run in this one personality only.
    pub fn set_driver(&mut self, driver: Personality) {
        for run in &mut self.runs {
            run.drivers = vec![driver];
            run.guest.driver = driver;
        }
    }

    /// The concrete runs whose name matches `pattern` (a regex, searched, as `--filter` takes it).
    pub fn expand_filtered(&self, pattern: &str) -> Result<Vec<ConcreteRun>, regex::Error> {
        let re = regex::Regex::new(pattern)?;
        Ok(self.expand().into_iter().filter(|r| re.is_match(&r.name)).collect())
    }

    /// Runs whose scenario the guest program does not know, as `(run name, line, scenario)`. The known list belongs
    /// to the guest program, so the runner passes it in (the file itself only checks the name's spelling).
    pub fn unknown_scenarios(&self, known: &[&str]) -> Vec<(String, usize, String)> {
        self.runs
            .iter()
            .filter(|r| !known.contains(&r.guest.scenario.as_str()))
            .map(|r| (r.name.clone(), r.line, r.guest.scenario.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(name: &str, modes: &[(VerifierMode, Expected)]) -> SuiteRun {
        SuiteRun {
            name: name.into(),
            device: DeviceOptions {
                map_registers: Some(16),
                inject: vec!["max_contiguous_pages=4".into()],
                revalidate_stale: false,
                without_access_platform: false,
            },
            guest: GuestOptions {
                scenario: name.into(),
                lock: Some(LockKind::Kmutex),
                extra: BTreeMap::from([("fragmentation".to_string(), "4".to_string())]),
                timeout_s: 30,
                silence_s: 10,
                driver: Personality::Native,
            },
            verifier_flags: 0x80,
            expect: modes.iter().cloned().collect(),
            expect_sys: None,
            events: BTreeMap::from([(VerifierMode::On, vec!["map_registers_exhausted".to_string()])]),
            each_fail_point: false,
            line: 1,
            drivers: vec![Personality::Native],
            processors: None,
            interleavings: None,
        }
    }

    #[test]
    fn a_run_in_both_personalities_expands_to_both_and_driver_narrows_it() {
        let mut both = run("a", &[(VerifierMode::Off, Expected::Pass), (VerifierMode::On, Expected::Pass)]);
        both.drivers = vec![Personality::Native, Personality::Sys];
        let mut suite = Suite {
            name: "t".into(),
            source: "t".into(),
            runs: vec![both],
            guest: GuestKind::Linux,
            windows_image: None,
        };
        let runs = suite.expand();
        let names: Vec<_> = runs.iter().map(|r| (r.name.as_str(), r.guest.driver)).collect();
        assert_eq!(
            names,
            [
                ("a/verifier-off", Personality::Native),
                ("a/verifier-on", Personality::Native),
                ("a/sys/verifier-off", Personality::Sys),
                ("a/sys/verifier-on", Personality::Sys),
            ]
        );
        assert_eq!(runs[3].guest_params().last().unwrap(), &("vhca.fragmentation".into(), "4".into()));
        assert!(runs[3].guest_params().contains(&("vhca.driver".into(), "sys".into())));
        suite.set_driver(Personality::Sys);
        let names: Vec<_> = suite.expand().into_iter().map(|r| (r.name, r.guest.driver)).collect();
        assert_eq!(
            names,
            [("a/sys/verifier-off".into(), Personality::Sys), ("a/sys/verifier-on".into(), Personality::Sys)]
        );
    }

    #[test]
    fn expansion_names_modes_and_flags() {
        let suite = Suite {
            name: "t".into(),
            source: "t.toml".into(),
            guest: GuestKind::Linux,
            windows_image: None,
            runs: vec![
                run("a", &[(VerifierMode::On, Expected::Hang), (VerifierMode::Off, Expected::Pass)]),
                run("b", &[(VerifierMode::On, Expected::GuestPanic)]),
            ],
        };
        let runs = suite.expand();
        let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["a/verifier-off", "a/verifier-on", "b/verifier-on"]);
        assert_eq!(runs[0].verifier_flags, 0);
        assert_eq!(runs[1].verifier_flags, 0x80);
        assert_eq!(runs[1].expected, Expected::Hang);
        assert!(runs[0].events.is_empty(), "the off mode requires no event");
        assert_eq!(runs[1].events, ["map_registers_exhausted"]);
        let filtered = suite.expand_filtered("^a/verifier-on$").unwrap();
        assert_eq!(filtered.len(), 1);
        assert_eq!(filtered[0].name, "a/verifier-on");
        assert!(suite.expand_filtered("(").is_err());
    }

    #[test]
    fn a_run_without_access_platform_starts_the_device_without_it() {
        let mut plain = run("a", &[(VerifierMode::On, Expected::Pass)]);
        plain.device = DeviceOptions::default();
        let mut without = plain.clone();
        without.device.without_access_platform = true;
        let args = |r: SuiteRun| {
            let suite = Suite {
                name: "t".into(),
                source: "t".into(),
                runs: vec![r],
                guest: GuestKind::Linux,
                windows_image: None,
            };
            suite.expand()[0].device_args()
        };
        assert!(args(plain).is_empty());
        assert_eq!(args(without), ["--no-access-platform"]);
    }

    #[test]
    fn guest_params_and_device_args() {
        let suite = Suite {
            name: "t".into(),
            source: "t".into(),
            runs: vec![run("a", &[(VerifierMode::On, Expected::Pass)])],
            guest: GuestKind::Linux,
            windows_image: None,
        };
        let r = &suite.expand()[0];
        let params: Vec<String> = r.guest_params().iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert_eq!(params, ["vhca.scenario=a", "vhca.lock=kmutex", "vhca.verifier=0x80", "vhca.fragmentation=4"]);
        assert_eq!(r.device_args(), ["--map-registers", "16", "--inject", "max_contiguous_pages=4"]);
        assert_eq!(suite.unknown_scenarios(&["b"]), vec![("a".to_string(), 1, "a".to_string())]);
        assert!(suite.unknown_scenarios(&["a"]).is_empty());
    }

    #[test]
    fn a_recording_run_and_its_fail_point_runs() {
        let mut a = run("a", &[(VerifierMode::On, Expected::Pass)]);
        a.each_fail_point = true;
        let suite =
            Suite { name: "t".into(), source: "t".into(), runs: vec![a], guest: GuestKind::Linux, windows_image: None };
        let recording = &suite.expand()[0];
        let words = |r: &ConcreteRun| r.guest_params().iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>();
        assert_eq!(words(recording).last().unwrap(), "vhca.faults_systematic=record");
        let third = recording.at_fail_point(3);
        assert_eq!(third.name, "a/verifier-on/fail-point-3");
        assert_eq!(words(&third).last().unwrap(), "vhca.fail_point=3");
        assert!(!words(&third).iter().any(|w| w.contains("faults_systematic")));
        assert_eq!(split_fail_point(&third.name), Some(("a/verifier-on", 3)));
        assert_eq!(split_fail_point("a/verifier-on"), None);
        assert_eq!(split_fail_point("a/verifier-on/fail-point-0"), None);
    }
}
