//! Run options from the kernel command line: every `vhca.<key>=<value>` word, parsed once, up front.
//! Unknown keys and bad values are collected as warnings for the report instead of stopping the run.

use std::fmt;

use vhca_driver_core::ClMutexKind;
use vhca_ntmodel::{InterleavingMode, LowResourcesConfig, RuleId, SpecialPoolAlignment, TimingConfig, VerifierFlags};

/// PCI identity of the device to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciId {
    pub vendor: u16,
    pub device: u16,
}

impl PciId {
    /// Parses `vvvv:dddd` in hex, as lspci prints it.
    pub fn parse(text: &str) -> Option<PciId> {
        let (vendor, device) = text.split_once(':')?;
        let vendor = u16::from_str_radix(vendor.trim_start_matches("0x"), 16).ok()?;
        let device = u16::from_str_radix(device.trim_start_matches("0x"), 16).ok()?;
        Some(PciId { vendor, device })
    }
}

impl fmt::Display for PciId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:04x}", self.vendor, self.device)
    }
}

/// The driver personality of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Personality {
    Native,
    Sys,
}

/// How the guest program waits for its queues' completions (`vhca.completion`). Interrupts are the default: a
/// Windows driver does not poll, so neither do the runs; polling stays for comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Poll the used ring, sleeping between polls; every queue declines interrupts.
    Poll,
    /// Queue 0 (vhca's command queue, virtio-rng's request queue) asks for interrupts and its waits sleep until
    /// its MSI-X message fires, or, for the native driver once it connected its interrupt, until its DPC sets the
    /// command KEVENT (queue_interrupts.rs); queue 1 asks for them for the driver's ISR. vhca.sys gets the messages
    /// as START_DEVICE's interrupt resources and waits the same way (sys_driver.rs).
    Interrupt,
}

impl Completion {
    pub fn name(self) -> &'static str {
        match self {
            Completion::Poll => "poll",
            Completion::Interrupt => "interrupt",
        }
    }
}

/// What the run does and how long it may wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Scenario name (see `vhca_scenarios::Scenario`, plus the transport's `smoke` and `unmapped`).
    pub scenario: String,
    /// Bound on every wait for the device (reset, one command completion).
    pub timeout_ms: u64,
    /// Drive exactly this device instead of the vhca ids (e.g. `1af4:1044`, QEMU's virtio-rng, to test the transport).
    pub device: Option<PciId>,
    /// Power the machine off at the end; `vhca.poweroff=0` keeps an interactive guest alive for debugging.
    pub poweroff: bool,
    /// Written to the device's sysfs reset_method before vfio-pci opens it (e.g. `pm`); None keeps the kernel's.
    pub reset_method: Option<String>,
    /// The kernel lock the driver's control path holds (`vhca.lock`); None: the scenario's own choice.
    pub lock: Option<ClMutexKind>,
    /// Driver Verifier flags of the NT model (`vhca.verifier`, 0 = off).
    pub verifier: VerifierFlags,
    /// Special Pool's alignment (`vhca.special_pool=verify_end|verify_start`, Windows' GFlags setting; Verify End
    /// unless given): which end of each block touches its guard page when the verifier flags have 0x1.
    pub special_pool: SpecialPoolAlignment,
    /// Longest physically contiguous run, in pages, the NT model can still find (`vhca.fragmentation`).
    pub fragmentation: Option<usize>,
    /// Map registers of the NT model's HAL per adapter (`vhca.map_registers`); None: the model's default. Not the
    /// device's pool: that one is the device's own (`vhca-device --map-registers`).
    pub map_registers: Option<u32>,
    /// DMA checking double-buffers (`vhca.double_buffering=0` turns it off, to show what depends on it).
    pub double_buffering: bool,
    /// The platform remaps the driver's DMA (`vhca.dma_remapping=0` turns it off: a machine without an IOMMU, or a
    /// driver without DmaRemappingCompatible=1): the NT model's device domain is then the identity, every frame
    /// reachable. The guest's real intel-iommu stays on either way; the model maps frames in it instead of IOVAs.
    pub dma_remapping: bool,
    /// Verifier rules turned off (`vhca.disable_rule=0xE6/0x26`, repeatable).
    pub disabled_rules: Vec<RuleId>,
    /// The fixed scenarios take their buggy path again (`vhca.break_fix=1`): proves their checks can fail.
    pub break_fix: bool,
    /// The low-resources simulation's knobs (`vhca.faults`, `vhca.faults_seed`, `vhca.faults_delay_ms`,
    /// `vhca.faults_tags`, `vhca.faults_systematic`, `vhca.faults_dma`, `vhca.fail_point`); the verifier flags 0x4
    /// and 0x40000 turn the Windows modes on, `vhca.fail_point` the rig's own.
    pub low_resources: LowResourcesConfig,
    /// `vhca.faults_seed` was given; else a randomized run picks a seed and prints it.
    pub faults_seed_given: bool,
    /// A test mode instead of a run (`vhca.init=hang|panic|poweroff`): the runner's own tests of hangs and crashes.
    pub init: Option<String>,
    /// Samples of each kind the `roundtrip` scenario takes (`vhca.samples`); None: its default.
    pub samples: Option<usize>,
    /// Which driver runs the scenario (`vhca.driver=native|sys`): the driver core built into this program, or the
    /// signed vhca.sys from the initramfs through the PE loader.
    pub driver: Personality,
    /// How completions are waited for (`vhca.completion=poll|interrupt`, default interrupt).
    pub completion: Completion,
    /// The NT model's clock tick and DPC watchdog (`vhca.clock_tick_us`, `vhca.dpc_time_limit`,
    /// `vhca.dpc_watchdog_limit`).
    pub timing: TimingConfig,
    /// The NT model's logical processors (`vhca.processors`, 1 to 64, default 2 as the model's): the runner boots
    /// the guest with as many vCPUs, so the model's processors are really concurrent.
    pub processors: u32,
    /// The interleaving mode (`vhca.interleave=record|preempt:<thread>#<k>[,<thread>#<k>]|pct:<seed>[:<depth>]`).
    pub interleaving: InterleavingMode,
    /// The pool tags whose blocks vhca.sys's interleaving runs trap its own loads and stores of
    /// (`vhca.race_watch=TAG[,TAG...]`, with `common-buffers` for the rings and CQs too; default none): the
    /// loader's race watch, so the race detector and the
    /// scheduler see the binary's shared state as they see the native driver's. Ignored natively (its accesses
    /// pass through the model) and without an interleaving mode.
    pub race_watch: vhca_loader::race_watch::WatchList,
    /// The global points a PCT run draws its change points among (`vhca.pct_horizon`, default the model's 2000):
    /// the suite passes its recording's count, so a short run's change points fall inside it.
    pub pct_horizon: Option<u32>,
    /// Sleep/resume cycles (S0→S3→S0) once the device started (`vhca.power=sleep-resume` for one,
    /// `sleep-resume:N` for N); 0: none.
    pub sleep_resume: u32,
    /// The bus driver completes each D0 IRP at DISPATCH_LEVEL (`vhca.power=sleep-resume-d0-dispatch[:N]`; the cycles
    /// are `sleep_resume`'s). vhca.sys's only: the native twin's power-up has no IRQL.
    pub d0_at_dispatch: bool,
    /// One sleep/resume cycle while a user process has an RDMA write in flight (`vhca.power=sleep-during-traffic`):
    /// vhca.sys's life runs the user program of user_sleep_traffic.rs, which sleeps the machine itself.
    pub sleep_during_traffic: bool,
    /// The PnP sequence the life runs between START_DEVICE and its last REMOVE (`vhca.pnp=rebalance[:N]`,
    /// `query-stop-cancel`, `query-remove-cancel`, `disable-enable[:N]`); default the straight line.
    pub pnp: vhca_loader::pnp_sequence::PnpSequence,
    /// The user program vhca.sys's life runs once the device started (`vhca.user=exit-with-mr`); default none.
    pub user: crate::user_program::UserSequence,
    /// Words with the `vhca.` prefix this program does not understand, or whose value did not parse.
    pub warnings: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            scenario: "smoke".into(),
            timeout_ms: 5000,
            device: None,
            poweroff: true,
            reset_method: None,
            lock: None,
            verifier: VerifierFlags::NONE,
            special_pool: SpecialPoolAlignment::VerifyEnd,
            fragmentation: None,
            map_registers: None,
            double_buffering: true,
            dma_remapping: true,
            disabled_rules: Vec::new(),
            break_fix: false,
            low_resources: LowResourcesConfig::default(),
            faults_seed_given: false,
            init: None,
            samples: None,
            driver: Personality::Native,
            completion: Completion::Interrupt,
            timing: TimingConfig::default(),
            processors: vhca_ntmodel::NtModelConfig::default().processors,
            interleaving: InterleavingMode::Off,
            race_watch: Default::default(),
            pct_horizon: None,
            sleep_resume: 0,
            d0_at_dispatch: false,
            sleep_during_traffic: false,
            pnp: Default::default(),
            user: Default::default(),
            warnings: Vec::new(),
        }
    }
}

const PREFIX: &str = "vhca.";
/// Windows' group 0, which is all the model has.
pub const MAX_PROCESSORS: u32 = 64;

impl Options {
    /// Parses a whole kernel command line; words without the `vhca.` prefix belong to others and are ignored.
    pub fn parse(cmdline: &str) -> Options {
        Options::parse_words(cmdline.split_whitespace())
    }

    /// Parses words in order (a later word overrides an earlier one): the kernel command line, then a run request's.
    pub fn parse_words<'a>(words: impl IntoIterator<Item = &'a str>) -> Options {
        let mut options = Options::default();
        for word in words {
            let Some(setting) = word.strip_prefix(PREFIX) else { continue };
            let (key, value) = setting.split_once('=').unwrap_or((setting, ""));
            if let Err(why) = options.apply(key, value) {
                options.warnings.push(format!("{PREFIX}{key}: {why}"));
            }
        }
        options
    }

    fn apply(&mut self, key: &str, value: &str) -> Result<(), String> {
        // The simulation's keys belong to the NT model, so every personality built on it parses them alike.
        if let Some(r) = self.low_resources.apply_option(key, value) {
            self.faults_seed_given |= key == "faults_seed" && r.is_ok();
            return r;
        }
        if let Some(r) = self.timing.apply_option(key, value) {
            return r;
        }
        match key {
            "scenario" if !value.is_empty() => self.scenario = value.to_string(),
            "driver" => {
                self.driver = match value {
                    "native" => Personality::Native,
                    "sys" => Personality::Sys,
                    _ => return Err(format!("not native or sys: {value:?}")),
                }
            }
            "scenario" => return Err("empty value".into()),
            "completion" => {
                self.completion = match value {
                    "poll" => Completion::Poll,
                    "interrupt" => Completion::Interrupt,
                    _ => return Err(format!("not poll or interrupt: {value:?}")),
                }
            }
            "timeout_ms" => {
                self.timeout_ms =
                    value.parse().ok().filter(|ms| *ms > 0).ok_or(format!("not a positive integer: {value:?}"))?
            }
            "device" => self.device = Some(PciId::parse(value).ok_or(format!("not vvvv:dddd in hex: {value:?}"))?),
            "poweroff" => self.poweroff = boolean(value)?,
            "break_fix" => self.break_fix = boolean(value)?,
            "double_buffering" => self.double_buffering = boolean(value)?,
            "dma_remapping" => self.dma_remapping = boolean(value)?,
            "lock" => {
                self.lock = Some(
                    vhca_scenarios::lock_kind(value)
                        .ok_or_else(|| format!("not fast_mutex, kmutex or eresource: {value:?}"))?,
                )
            }
            "verifier" => {
                self.verifier = VerifierFlags::parse(value).ok_or(format!("not verifier flags: {value:?}"))?
            }
            "special_pool" => {
                self.special_pool =
                    SpecialPoolAlignment::parse(value).ok_or(format!("not verify_end or verify_start: {value:?}"))?
            }
            "samples" => {
                self.samples = Some(value.parse().ok().filter(|n| *n > 0).ok_or(format!("not a count > 0: {value:?}"))?)
            }
            "fragmentation" => {
                self.fragmentation =
                    Some(value.parse().ok().filter(|n| *n > 0).ok_or(format!("not a page count > 0: {value:?}"))?)
            }
            "map_registers" => {
                self.map_registers =
                    Some(value.parse().ok().filter(|n| *n > 0).ok_or(format!("not a count > 0: {value:?}"))?)
            }
            "processors" => {
                self.processors = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_PROCESSORS).contains(n))
                    .ok_or(format!("not a processor count 1..={MAX_PROCESSORS}: {value:?}"))?
            }
            "interleave" => self.interleaving = crate::interleaving::parse_mode(value)?,
            "race_watch" => {
                self.race_watch = vhca_loader::race_watch::WatchList::parse(value)
                    .map_err(|word| format!("not a pool tag of 1 to 4 ASCII characters or common-buffers: {word:?}"))?
            }
            "pct_horizon" => {
                self.pct_horizon =
                    Some(value.parse().ok().filter(|n| *n > 0).ok_or(format!("not a point count > 0: {value:?}"))?)
            }
            "pnp" => self.pnp = vhca_loader::pnp_sequence::PnpSequence::parse(value)?,
            "user" => self.user = crate::user_program::UserSequence::parse(value)?,
            "power" if value == "sleep-during-traffic" => self.sleep_during_traffic = true,
            "power" => {
                let (mode, cycles) = match value.split_once(':') {
                    None => (value, 1),
                    Some((mode, n)) => {
                        (mode, n.parse().ok().filter(|n| *n > 0).ok_or(format!("not a cycle count > 0: {n:?}"))?)
                    }
                };
                self.d0_at_dispatch = match mode {
                    "sleep-resume" => false,
                    "sleep-resume-d0-dispatch" => true,
                    _ => {
                        return Err(format!(
                            "not sleep-resume[-d0-dispatch] or sleep-resume[-d0-dispatch]:N: {value:?}"
                        ))
                    }
                };
                self.sleep_resume = cycles;
            }
            "disable_rule" => self
                .disabled_rules
                .push(RuleId::parse(value).ok_or(format!("not 0xCODE or 0xCODE/0xSUBCODE: {value:?}"))?),
            "reset_method" if !value.is_empty() => self.reset_method = Some(value.to_string()),
            "reset_method" => return Err("empty value".into()),
            // `probe` is the initramfs' /init's own (it never starts this program); the others are test modes here.
            "init" => match value {
                "hang" | "panic" | "poweroff" => self.init = Some(value.to_string()),
                "probe" | "guest" => {}
                _ => return Err(format!("not hang, panic or poweroff: {value:?}")),
            },
            // The resident agent (agent.rs) is chosen from the kernel command line before options are parsed.
            "agent" => {}
            _ => return Err("unknown key".into()),
        }
        Ok(())
    }
}

fn boolean(value: &str) -> Result<bool, String> {
    match value {
        "1" | "on" | "yes" | "true" => Ok(true),
        "0" | "off" | "no" | "false" => Ok(false),
        _ => Err(format!("not a boolean: {value:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_when_nothing_is_given() {
        let options = Options::parse("console=ttyS0 intel_iommu=on panic=-1 quiet");
        assert_eq!(options, Options::default());
    }

    #[test]
    fn reads_every_known_key() {
        let options = Options::parse(
            "quiet vhca.init=guest vhca.scenario=cq-fallback vhca.timeout_ms=250 vhca.device=1af4:1044 vhca.poweroff=0 vhca.reset_method=pm",
        );
        assert_eq!(options.scenario, "cq-fallback");
        assert_eq!(options.timeout_ms, 250);
        assert_eq!(options.device, Some(PciId { vendor: 0x1af4, device: 0x1044 }));
        assert!(!options.poweroff);
        assert_eq!(options.reset_method.as_deref(), Some("pm"));
        assert_eq!(options.init, None);
        assert!(options.warnings.is_empty(), "{:?}", options.warnings);
    }

    #[test]
    fn special_pool_alignment_is_verify_end_unless_verify_start_is_given() {
        assert_eq!(Options::parse("").special_pool, SpecialPoolAlignment::VerifyEnd);
        assert_eq!(Options::parse("vhca.special_pool=verify_start").special_pool, SpecialPoolAlignment::VerifyStart);
        let bad = Options::parse("vhca.special_pool=middle");
        assert_eq!((bad.special_pool, bad.warnings.len()), (SpecialPoolAlignment::VerifyEnd, 1));
    }

    #[test]
    fn request_words_follow_and_override_the_kernel_command_line() {
        let boot = "quiet vhca.agent=1 vhca.reset_method=pm vhca.scenario=smoke";
        let request = ["vhca.scenario=cq-fallback", "vhca.init=hang"];
        let options = Options::parse_words(boot.split_whitespace().chain(request));
        assert_eq!(options.scenario, "cq-fallback");
        assert_eq!(options.reset_method.as_deref(), Some("pm"));
        assert_eq!(options.init.as_deref(), Some("hang"));
        assert!(options.warnings.is_empty(), "{:?}", options.warnings);
        assert_eq!(Options::parse("vhca.init=sing").warnings.len(), 1);
    }

    #[test]
    fn the_model_timing_options_reach_its_timing_config() {
        let options = Options::parse("vhca.clock_tick_us=1000 vhca.dpc_time_limit=7 vhca.dpc_watchdog_limit=0");
        assert!(options.warnings.is_empty(), "{:?}", options.warnings);
        assert_eq!(options.timing.tick, std::time::Duration::from_millis(1));
        assert_eq!((options.timing.dpc_time_limit, options.timing.dpc_watchdog_limit), (7, 0));
        let bad = Options::parse("vhca.clock_tick_us=0");
        assert_eq!(bad.timing, TimingConfig::default());
        assert!(bad.warnings[0].contains("vhca.clock_tick_us"), "{:?}", bad.warnings);
    }

    #[test]
    fn unknown_keys_and_bad_values_become_warnings_and_keep_defaults() {
        let options =
            Options::parse("vhca.colour=blue vhca.timeout_ms=soon vhca.timeout_ms=0 vhca.device=1af4 vhca.scenario=");
        assert_eq!(options.timeout_ms, Options::default().timeout_ms);
        assert_eq!(options.device, None);
        assert_eq!(options.scenario, "smoke");
        assert_eq!(options.warnings.len(), 5, "{:?}", options.warnings);
        assert!(options.warnings[0].contains("vhca.colour"));
        assert!(options.warnings[1].contains("soon"));
    }

    #[test]
    fn reads_the_driver_options_the_runner_passes() {
        let options = Options::parse(
            "vhca.scenario=contiguous-cq-fallback vhca.lock=kmutex vhca.verifier=0xaa vhca.fragmentation=4 \
             vhca.map_registers=16 vhca.disable_rule=0xC4/0xE5 vhca.disable_rule=0xE6 vhca.break_fix=1 \
             vhca.double_buffering=0 vhca.dma_remapping=0",
        );
        assert!(options.warnings.is_empty(), "{:?}", options.warnings);
        assert_eq!(options.lock, Some(ClMutexKind::KMutex));
        assert_eq!(options.verifier, VerifierFlags(0xAA));
        assert_eq!(options.fragmentation, Some(4));
        assert_eq!(options.map_registers, Some(16));
        assert_eq!(options.disabled_rules.len(), 2);
        assert_eq!(options.disabled_rules[0].subcode, Some(0xE5));
        assert_eq!(options.disabled_rules[1].subcode, None);
        assert!(options.break_fix);
        assert!(!options.double_buffering);
        assert!(!options.dma_remapping);
        assert!(Options::parse("").dma_remapping, "DMA remapping is on unless switched off, as vhca.inf asks");
        assert!(Options::parse("").double_buffering, "double buffering is on unless switched off");
        let off = Options::parse("vhca.verifier=0x0 vhca.lock=spin vhca.disable_rule=E6/x");
        assert_eq!(off.verifier, VerifierFlags::NONE);
        assert_eq!(off.lock, None);
        assert_eq!(off.warnings.len(), 2, "{:?}", off.warnings);
    }

    #[test]
    fn reads_the_low_resources_options() {
        let options = Options::parse(
            "vhca.verifier=0x40000 vhca.faults=250 vhca.faults_seed=42 vhca.faults_delay_ms=0 vhca.faults_tags=vhca,Ab \
             vhca.faults_systematic=record vhca.faults_dma=1 vhca.fail_point=3",
        );
        assert!(options.warnings.is_empty(), "{:?}", options.warnings);
        let lr = &options.low_resources;
        assert_eq!((lr.probability, lr.seed, lr.delay), (250, 42, std::time::Duration::ZERO));
        assert_eq!(lr.pool_tags, [u32::from_le_bytes(*b"vhca"), u32::from_le_bytes(*b"Ab  ")]);
        assert_eq!(lr.systematic, vhca_ntmodel::Systematic::Record);
        assert!(lr.dma_routines && options.faults_seed_given);
        assert_eq!(lr.fail_point, Some(3));
        let bad = Options::parse("vhca.faults=0 vhca.faults=20000 vhca.fail_point=0 vhca.faults_systematic=maybe");
        assert_eq!(bad.warnings.len(), 4, "{:?}", bad.warnings);
        assert_eq!(bad.low_resources, LowResourcesConfig::default());
        assert!(!bad.faults_seed_given);
    }

    #[test]
    fn reads_the_processors_and_the_interleaving_mode() {
        let default = Options::parse("");
        assert_eq!((default.processors, &default.interleaving), (2, &InterleavingMode::Off));
        let options = Options::parse("vhca.processors=4 vhca.interleave=preempt:passive#3,dpc-0#1");
        assert!(options.warnings.is_empty(), "{:?}", options.warnings);
        assert_eq!(options.processors, 4);
        let ids: Vec<String> = match &options.interleaving {
            InterleavingMode::Preempt(ids) => ids.iter().map(|id| id.to_string()).collect(),
            other => panic!("{other:?}"),
        };
        assert_eq!(ids, ["passive#3", "dpc-0#1"]);
        assert_eq!(Options::parse("vhca.interleave=pct:5").interleaving, InterleavingMode::Pct { seed: 5, depth: 3 });
        assert_eq!(Options::parse("vhca.pct_horizon=340").pct_horizon, Some(340));
        let watch = Options::parse("vhca.race_watch=VhSw,Ab,common-buffers");
        assert_eq!(watch.race_watch.tags, [u32::from_le_bytes(*b"VhSw"), u32::from_le_bytes(*b"Ab  ")]);
        assert!(watch.race_watch.common_buffers);
        let bad = Options::parse("vhca.race_watch=VhSw,toolong");
        assert!(bad.race_watch.tags.is_empty() && bad.warnings.len() == 1, "{:?}", bad.warnings);
        assert_eq!(Options::parse("vhca.pct_horizon=0").pct_horizon, None);
    }

    #[test]
    fn pnp_names_the_sequence_and_refuses_an_unknown_one() {
        use vhca_loader::pnp_sequence::PnpSequence;
        assert_eq!(Options::parse("").pnp, PnpSequence::Straight);
        assert_eq!(Options::parse("vhca.pnp=rebalance:2").pnp, PnpSequence::Rebalance(2));
        assert_eq!(Options::parse("vhca.pnp=disable-enable").pnp, PnpSequence::DisableEnable(1));
        let refused = Options::parse("vhca.pnp=eject");
        assert_eq!((refused.pnp, refused.warnings.len()), (PnpSequence::Straight, 1));
    }

    #[test]
    fn power_takes_a_sleep_resume_cycle_count() {
        assert_eq!(Options::parse("").sleep_resume, 0);
        assert_eq!(Options::parse("vhca.power=sleep-resume").sleep_resume, 1);
        assert_eq!(Options::parse("vhca.power=sleep-resume:3").sleep_resume, 3);
        let dispatch = Options::parse("vhca.power=sleep-resume-d0-dispatch:2");
        assert_eq!((dispatch.sleep_resume, dispatch.d0_at_dispatch), (2, true));
        assert!(!Options::parse("vhca.power=sleep-resume").d0_at_dispatch);
        let traffic = Options::parse("vhca.power=sleep-during-traffic");
        assert_eq!((traffic.sleep_during_traffic, traffic.sleep_resume, traffic.warnings.len()), (true, 0, 0));
        let refused = Options::parse("vhca.power=hibernate vhca.power=sleep-resume:0");
        assert_eq!(refused.sleep_resume, 0);
        assert_eq!(refused.warnings.len(), 2, "{:?}", refused.warnings);
        let bad = Options::parse("vhca.processors=0 vhca.processors=65 vhca.interleave=preempt:x");
        assert_eq!(bad.warnings.len(), 3, "{:?}", bad.warnings);
        assert_eq!((bad.processors, &bad.interleaving), (2, &InterleavingMode::Off));
    }

    #[test]
    fn completion_is_interrupt_unless_poll_is_asked_for() {
        let default = Options::parse("");
        assert_eq!((default.completion, default.warnings.len()), (Completion::Interrupt, 0));
        let poll = Options::parse("vhca.completion=poll");
        assert_eq!((poll.completion, poll.warnings.len()), (Completion::Poll, 0));
        assert_eq!(Options::parse("vhca.completion=poll vhca.completion=interrupt").completion, Completion::Interrupt);
        let bad = Options::parse("vhca.completion=msi");
        assert_eq!(bad.completion, Completion::Interrupt, "a bad value leaves the default");
        assert!(bad.warnings[0].contains("not poll or interrupt"), "{:?}", bad.warnings);
        let sys = Options::parse("vhca.driver=sys");
        assert_eq!((sys.completion, sys.warnings.len()), (Completion::Interrupt, 0), "vhca.sys's default too");
    }

    #[test]
    fn pci_id_round_trips_through_display() {
        let id = PciId::parse("0x1AF4:1059").unwrap();
        assert_eq!(id, PciId { vendor: 0x1af4, device: 0x1059 });
        assert_eq!(id.to_string(), "1af4:1059");
        assert_eq!(PciId::parse("1af4:10599"), None);
    }
}
