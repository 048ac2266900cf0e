//! Driver Verifier's low-resources simulation: Low Resources Simulation (flag 0x4, randomized failures),
//! Systematic Low Resource Simulation (flag 0x40000, each call site fails the first time it is seen), its "what if"
//! recording, and the rig's exhaustive mode (fail only point k). docs/verifier.md cites Microsoft's page per rule.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::panic::Location;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vhca_ntapi::{NTSTATUS, STATUS_INSUFFICIENT_RESOURCES};

use crate::verifier::VerifierFlags;

/// Windows' default probability of `verifier /faults`: 6 % (600 in ten thousandths, the unit `/faults` takes).
pub const DEFAULT_PROBABILITY: u32 = 600;
/// Windows' default delay before the randomized simulation starts failing: 8 minutes after boot.
pub const DEFAULT_DELAY: Duration = Duration::from_secs(8 * 60);

/// The routines the model can fail, each the way Windows' page says (or, for the DMA routines, the model assumes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultableRoutine {
    ExAllocatePoolWithTag,
    IoAllocateMdl,
    MmProbeAndLockPages,
    MmAllocateContiguousMemorySpecifyCache,
    /// On Microsoft's list "starting with Windows Vista": the driver gets NULL.
    IoAllocateWorkItem,
    /// Not on Microsoft's list: failed only with `LowResourcesConfig::dma_routines` (a model extension).
    AllocateCommonBuffer,
    /// Not on Microsoft's list: failed only with `LowResourcesConfig::dma_routines` (a model extension).
    GetScatterGatherList,
}

impl FaultableRoutine {
    pub fn name(self) -> &'static str {
        match self {
            FaultableRoutine::ExAllocatePoolWithTag => "ExAllocatePoolWithTag",
            FaultableRoutine::IoAllocateMdl => "IoAllocateMdl",
            FaultableRoutine::MmProbeAndLockPages => "MmProbeAndLockPages",
            FaultableRoutine::MmAllocateContiguousMemorySpecifyCache => "MmAllocateContiguousMemorySpecifyCache",
            FaultableRoutine::IoAllocateWorkItem => "IoAllocateWorkItem",
            FaultableRoutine::AllocateCommonBuffer => "AllocateCommonBuffer",
            FaultableRoutine::GetScatterGatherList => "GetScatterGatherList",
        }
    }

    /// Whether Microsoft's Low Resources Simulation page names this routine.
    pub fn on_microsofts_list(self) -> bool {
        !matches!(self, FaultableRoutine::AllocateCommonBuffer | FaultableRoutine::GetScatterGatherList)
    }

    /// What the failed call gives the driver.
    pub fn failure(self) -> Failure {
        match self {
            FaultableRoutine::MmProbeAndLockPages | FaultableRoutine::GetScatterGatherList => {
                Failure::Status(STATUS_INSUFFICIENT_RESOURCES)
            }
            _ => Failure::Null,
        }
    }
}

impl fmt::Display for FaultableRoutine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed call's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The routine returns NULL.
    Null,
    /// The routine returns (MmProbeAndLockPages: raises) this status.
    Status(NTSTATUS),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Null => f.write_str("NULL"),
            Failure::Status(s) => write!(f, "{:#010X}", s.0 as u32),
        }
    }
}

/// One frame of the driver's part of a call stack, in a form that survives reloads.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SiteFrame {
    /// The native build: where the driver's source calls the kernel (`#[track_caller]`), the same in every run of
    /// the same binary wherever it loads.
    Source { file: &'static str, line: u32, column: u32 },
    /// A loaded image (vhca.sys through the PE loader): a return address as an offset from the image's base, the
    /// same wherever the image loads, as Windows' systematic simulation recognises a reloaded driver.
    Image { module: String, rva: u32 },
}

impl fmt::Display for SiteFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SiteFrame::Source { file, line, column } => write!(f, "{file}:{line}:{column}"),
            SiteFrame::Image { module, rva } => write!(f, "{module}+{rva:#x}"),
        }
    }
}

/// A call site: the driver's frames of the call stack, innermost first. Windows' systematic simulation identifies a
/// call by exactly this part of the stack.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CallSite {
    frames: Vec<SiteFrame>,
    /// The native build's whole stack, as a hash of its return addresses relative to the program image: what tells
    /// create_cq's ring allocation from create_qp's when both call AllocateCommonBuffer from the same source line.
    stack: Option<u64>,
}

impl CallSite {
    /// A site by its source location alone (the innermost frame).
    pub fn source(location: &'static Location<'static>) -> CallSite {
        CallSite {
            frames: vec![SiteFrame::Source { file: location.file(), line: location.line(), column: location.column() }],
            stack: None,
        }
    }

    /// The native build's site: the source location that called the kernel, and the stack that led there. Return
    /// addresses are taken relative to a function of this image, so the hash is the same wherever the program
    /// loads (ASLR), in every run of the same binary.
    pub fn native(location: &'static Location<'static>) -> CallSite {
        let anchor = CallSite::native as *const () as usize;
        let mut h: u64 = FNV_OFFSET;
        backtrace::trace(|frame| {
            let offset = (frame.ip() as usize).wrapping_sub(anchor) as isize;
            // Only the program's own frames: the unwinder's last step past `_start` yields a word of the initial
            // stack, which differs from boot to boot (seen on cold boots; a snapshot restores the same one).
            if offset.unsigned_abs() < PROGRAM_SPAN {
                for byte in offset.to_le_bytes() {
                    h = fnv_step(h, byte);
                }
            }
            true
        });
        CallSite { stack: Some(h), ..CallSite::source(location) }
    }

    /// A loaded image's site from a stack walk's return addresses (innermost first): the ones inside the image
    /// `[image_base, image_base + image_size)` become offsets; the kernel's and the loader's own frames drop out.
    pub fn image(module: &str, image_base: u64, image_size: u32, return_addresses: &[u64]) -> CallSite {
        let frames = return_addresses
            .iter()
            .filter_map(|ra| ra.checked_sub(image_base))
            .filter(|offset| *offset < u64::from(image_size))
            .map(|offset| SiteFrame::Image { module: module.to_string(), rva: offset as u32 })
            .collect();
        CallSite { frames, stack: None }
    }

    pub fn frames(&self) -> &[SiteFrame] {
        &self.frames
    }

    /// A hash of the site that is the same in every run and every build of the same source (FNV-1a over the
    /// printed frames; hand-written because the standard hasher's output may change between Rust releases).
    fn stable_hash(&self) -> u64 {
        self.to_string().bytes().fold(FNV_OFFSET, fnv_step)
    }
}

/// How far from this module's code a return address may lie and still be the program's: more than any program
/// image here (the static guest binary is ~10 MB), far less than the distance to the stack, the heap or the vDSO.
const PROGRAM_SPAN: usize = 1 << 30;

const FNV_OFFSET: u64 = 0xCBF2_9CE4_8422_2325;

fn fnv_step(h: u64, byte: u8) -> u64 {
    (h ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01B3)
}

impl fmt::Display for CallSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, frame) in self.frames.iter().enumerate() {
            if i > 0 {
                f.write_str(" < ")?;
            }
            write!(f, "{frame}")?;
        }
        match self.stack {
            Some(stack) => write!(f, " [stack {stack:016x}]"),
            None => Ok(()),
        }
    }
}

/// Where the kernel routine running on a thread was called from, as its entry into the model knows it.
enum Entry {
    /// A native call: the source location; the stack is walked only if the simulation needs the site.
    Native(&'static Location<'static>),
    /// A site the caller named (the PE loader's image frames).
    Given(CallSite),
}

thread_local! {
    /// The call site of the kernel routine running on this thread: a named site (the innermost), else the outermost
    /// native entry into the model.
    static CURRENT_SITE: RefCell<Option<Entry>> = const { RefCell::new(None) };
}

/// Runs `f` (a call into the model's kernel routines) as called from `site`. A site the caller names wins over the
/// `#[track_caller]` location of the model routine it then calls (a PE loader's thunk names the vhca.sys frames
/// first), and over an outer named site: a driver routine the model calls back inside a kernel call (an
/// AdapterListControl inside GetScatterGatherList) that calls the kernel again is its own call site, as a stack walk
/// from that inner call sees it. The outer site is back when `f` returns, or a bugcheck unwinds through it.
pub fn with_call_site<T>(site: CallSite, f: impl FnOnce() -> T) -> T {
    entered(Entry::Given(site), f)
}

fn entered<T>(entry: Entry, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<Entry>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            CURRENT_SITE.with(|s| *s.borrow_mut() = previous);
        }
    }
    // A native location under an outer site is the model calling itself (or a thunk's own call): the outer wins.
    let previous = CURRENT_SITE.with(|s| {
        let mut s = s.borrow_mut();
        if s.is_some() && matches!(entry, Entry::Native(_)) {
            return None;
        }
        Some(s.replace(entry))
    });
    let Some(previous) = previous else { return f() };
    let _restore = Restore(previous);
    f()
}

/// The native thunks' form of `with_call_site`: the caller's source location, built only when no outer site is set.
pub(crate) fn at_location<T>(location: &'static Location<'static>, f: impl FnOnce() -> T) -> T {
    entered(Entry::Native(location), f)
}

/// The current call's site; for a native call this walks the stack (the simulation asks only when it is on).
fn current_site() -> Option<CallSite> {
    CURRENT_SITE.with(|s| match &*s.borrow() {
        Some(Entry::Native(location)) => Some(CallSite::native(location)),
        Some(Entry::Given(site)) => Some(site.clone()),
        None => None,
    })
}

/// The current call's site as reports print it, without the stack walk `current_site` makes for a native call: a
/// named site (the PE loader's image frames) whole, a native entry by its source location; None outside any entry.
/// The interleaving engine names points and racing accesses by it in every mode but Off.
pub(crate) fn current_site_label() -> Option<String> {
    CURRENT_SITE.with(|s| match &*s.borrow() {
        Some(Entry::Native(location)) => Some(CallSite::source(location).to_string()),
        Some(Entry::Given(site)) => Some(site.to_string()),
        None => None,
    })
}

/// Whether the current call's site was named by the caller (a driver binary's frames): it then names the call
/// better than any location inside the rig.
pub(crate) fn site_is_named() -> bool {
    CURRENT_SITE.with(|s| matches!(&*s.borrow(), Some(Entry::Given(_))))
}

/// The systematic simulation's sub-mode (`verifier /faultssystematic`): fail each new stack, or only record it
/// ("what if" mode, Windows' `recordboottime` / `recordruntime`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Systematic {
    #[default]
    Fail,
    Record,
}

/// The knobs of the low-resources simulation. Which mode runs follows the verifier flags (0x4 randomized, 0x40000
/// systematic) unless `fail_point` asks for the rig's exhaustive mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LowResourcesConfig {
    /// Randomized: chance of failing a call, in ten thousandths (`/faults` Probability; Windows' default 600).
    pub probability: u32,
    /// Randomized: the seed; the same seed fails the same calls (the run prints it).
    pub seed: u64,
    /// Randomized: no failure before this long after the model starts (`/faults` DelayMins; default 8 minutes).
    pub delay: Duration,
    /// Randomized: only pool allocations with one of these tags fail (`/faults` PoolTags); empty: every call.
    pub pool_tags: Vec<u32>,
    /// Systematic: fail new stacks, or only record them.
    pub systematic: Systematic,
    /// Exhaustive mode: fail only the first call at the k-th failure point (1-based, in order of first sighting)
    /// and no other. Runs regardless of the flags.
    pub fail_point: Option<u32>,
    /// Also fail AllocateCommonBuffer (NULL) and GetScatterGatherList (STATUS_INSUFFICIENT_RESOURCES), which
    /// Microsoft's list does not name: a model extension, off by default.
    pub dma_routines: bool,
}

impl Default for LowResourcesConfig {
    fn default() -> Self {
        LowResourcesConfig {
            probability: DEFAULT_PROBABILITY,
            seed: 0,
            delay: DEFAULT_DELAY,
            pool_tags: Vec::new(),
            systematic: Systematic::Fail,
            fail_point: None,
            dma_routines: false,
        }
    }
}

/// What the simulation does in one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InjectionMode {
    Off,
    Randomized,
    Systematic,
    /// Systematic "what if": every failure point is recorded, none is failed.
    Record,
    /// Fail only point k.
    FailPoint(u32),
}

impl InjectionMode {
    /// The mode the flags and the config choose. Both 0x4 and 0x40000: systematic (the model's choice; Microsoft
    /// does not say how the two combine).
    pub fn of(flags: VerifierFlags, config: &LowResourcesConfig) -> InjectionMode {
        if let Some(k) = config.fail_point {
            InjectionMode::FailPoint(k)
        } else if flags.contains(VerifierFlags::SYSTEMATIC_LOW_RESOURCES) {
            match config.systematic {
                Systematic::Fail => InjectionMode::Systematic,
                Systematic::Record => InjectionMode::Record,
            }
        } else if flags.contains(VerifierFlags::LOW_RESOURCES) {
            InjectionMode::Randomized
        } else {
            InjectionMode::Off
        }
    }
}

/// A place the simulation can fail: a call site and the routine called there, numbered from 1 in order of first
/// sighting (the `k` of `--fail-point k`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultPoint {
    pub point: u32,
    pub routine: FaultableRoutine,
    pub site: CallSite,
}

/// One failure the simulation injected, as `!verifier 4` lists them: in order, with the routine, the result it
/// gave and the code that asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectedFault {
    /// 1-based, in injection order.
    pub sequence: u32,
    pub point: u32,
    pub routine: FaultableRoutine,
    pub failure: Failure,
    pub site: CallSite,
}

/// Hears each injected failure as it happens (the guest prints it, so a bugcheck right after still shows it).
pub type FaultObserver = Arc<dyn Fn(&InjectedFault) + Send + Sync>;

/// The simulation's state in one model.
pub(crate) struct LowResources {
    mode: InjectionMode,
    config: LowResourcesConfig,
    start: Instant,
    points: Vec<FaultPoint>,
    /// Point number of each (site, routine) seen, and how often it was called (the randomized draw's input).
    seen: HashMap<(CallSite, FaultableRoutine), (u32, u64)>,
    injected: Vec<InjectedFault>,
    observer: Option<FaultObserver>,
}

impl LowResources {
    pub fn new(flags: VerifierFlags, config: LowResourcesConfig) -> LowResources {
        LowResources {
            mode: InjectionMode::of(flags, &config),
            config,
            start: Instant::now(),
            points: Vec::new(),
            seen: HashMap::new(),
            injected: Vec::new(),
            observer: None,
        }
    }

    pub fn mode(&self) -> InjectionMode {
        self.mode
    }

    pub fn set_observer(&mut self, observer: FaultObserver) {
        self.observer = Some(observer);
    }

    pub fn points(&self) -> &[FaultPoint] {
        &self.points
    }

    pub fn injected(&self) -> &[InjectedFault] {
        &self.injected
    }

    /// Whether this call of `routine` (from the thread's current site) fails. `tag` is the pool tag of a pool
    /// allocation. The observer is called with the failure before this returns.
    pub fn decide(&mut self, routine: FaultableRoutine, tag: Option<u32>) -> Option<Failure> {
        if self.mode == InjectionMode::Off || (!routine.on_microsofts_list() && !self.config.dma_routines) {
            return None;
        }
        // A call with no site came from the model itself (an execution routine it runs), not from the driver.
        let site = current_site()?;
        let next_point = self.points.len() as u32 + 1;
        let entry = self.seen.entry((site.clone(), routine)).or_insert((next_point, 0));
        let (point, calls) = (entry.0, entry.1);
        entry.1 += 1;
        let first = calls == 0;
        if first {
            self.points.push(FaultPoint { point, routine, site: site.clone() });
        }
        let fail = match self.mode {
            InjectionMode::Off | InjectionMode::Record => false,
            InjectionMode::Systematic => first,
            InjectionMode::FailPoint(k) => first && point == k,
            InjectionMode::Randomized => self.randomized(routine, tag, &site, calls),
        };
        if !fail {
            return None;
        }
        let fault = InjectedFault {
            sequence: self.injected.len() as u32 + 1,
            point,
            routine,
            failure: routine.failure(),
            site,
        };
        if let Some(observer) = &self.observer {
            observer(&fault);
        }
        let failure = fault.failure;
        self.injected.push(fault);
        Some(failure)
    }

    /// The randomized draw: a function of the seed, the site and how often the site was called, so the same seed
    /// fails the same calls whatever order threads interleave in.
    fn randomized(&self, routine: FaultableRoutine, tag: Option<u32>, site: &CallSite, calls: u64) -> bool {
        if self.start.elapsed() < self.config.delay {
            return false;
        }
        if !self.config.pool_tags.is_empty()
            && (routine != FaultableRoutine::ExAllocatePoolWithTag
                || !tag.is_some_and(|t| self.config.pool_tags.contains(&t)))
        {
            return false;
        }
        let draw = splitmix64(self.config.seed ^ site.stable_hash() ^ splitmix64(calls ^ routine as u64));
        draw % 10_000 < u64::from(self.config.probability)
    }
}

/// SplitMix64's output function: a well-mixed 64-bit value from any input (a few lines; no crate needed for it).
/// The interleaving engine's PCT draws use it too.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Pool tags as `verifier /faults` takes them: four characters, the first in the low byte (as ExAllocatePoolWithTag's
/// `Tag` is written in C, `'ahcv'` reads "vcha" in a dump).
pub fn pool_tag(text: &str) -> Option<u32> {
    let bytes = text.as_bytes();
    if bytes.is_empty() || bytes.len() > 4 || !text.is_ascii() {
        return None;
    }
    let mut tag = [b' '; 4];
    tag[..bytes.len()].copy_from_slice(bytes);
    Some(u32::from_le_bytes(tag))
}

/// The `vhca.*` keys of the low-resources simulation, shared by every personality that builds an `NtModelConfig`
/// from run options (the native guest program, the PE loader's vhca.sys).
pub const OPTION_KEYS: &[&str] =
    &["faults", "faults_seed", "faults_delay_ms", "faults_tags", "faults_systematic", "faults_dma", "fail_point"];

impl LowResourcesConfig {
    /// Applies one `vhca.KEY=VALUE` setting. None: not one of `OPTION_KEYS`; Some(Err): a bad value, with why.
    /// `faults` takes `/faults`' Probability (1..=10000 ten-thousandths); `faults_delay_ms` its DelayMins in
    /// milliseconds (runs here last seconds); `faults_tags` its PoolTags, comma-separated.
    pub fn apply_option(&mut self, key: &str, value: &str) -> Option<Result<(), String>> {
        if !OPTION_KEYS.contains(&key) {
            return None;
        }
        Some(self.apply_known(key, value))
    }

    fn apply_known(&mut self, key: &str, value: &str) -> Result<(), String> {
        let number = || value.parse::<u64>().map_err(|_| format!("not a non-negative integer: {value:?}"));
        match key {
            "faults" => {
                let p = number()?;
                if !(1..=10_000).contains(&p) {
                    return Err(format!("probability {p} is not 1..=10000 (ten-thousandths)"));
                }
                self.probability = p as u32;
            }
            "faults_seed" => self.seed = number()?,
            "faults_delay_ms" => self.delay = Duration::from_millis(number()?),
            "faults_tags" => {
                self.pool_tags = value
                    .split(',')
                    .map(|t| pool_tag(t.trim()).ok_or(format!("not a pool tag of 1-4 ASCII characters: {t:?}")))
                    .collect::<Result<Vec<_>, _>>()?
            }
            "faults_systematic" => {
                self.systematic = match value {
                    "fail" | "enable" => Systematic::Fail,
                    "record" => Systematic::Record,
                    _ => return Err(format!("not fail or record: {value:?}")),
                }
            }
            "faults_dma" => {
                self.dma_routines = match value {
                    "1" | "on" | "true" => true,
                    "0" | "off" | "false" => false,
                    _ => return Err(format!("not a boolean: {value:?}")),
                }
            }
            "fail_point" => {
                let k = u32::try_from(number()?).ok().filter(|k| *k > 0);
                self.fail_point = Some(k.ok_or(format!("not a failure point 1..: {value:?}"))?);
            }
            _ => unreachable!("OPTION_KEYS lists every key handled here"),
        }
        Ok(())
    }
}
