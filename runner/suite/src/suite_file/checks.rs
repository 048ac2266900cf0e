//! The validation pass of a suite file: turns the raw, spanned values into a `Suite`, collecting every problem
//! with the line, column and field it belongs to instead of stopping at the first.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use toml::Spanned;

use super::raw::{PerMode, RawExtra, RawRun, RawSuite};
use super::Problem;
use crate::expect::Expected;
use crate::interleavings::{Expansion, InterleavingPlan, DEFAULT_MAX_INTERLEAVINGS};
use crate::suite::{
    DeviceOptions, GuestKind, GuestOptions, LockKind, Personality, Suite, SuiteRun, VerifierMode, DEFAULT_SILENCE_S,
    DEFAULT_TIMEOUT_S, DEFAULT_VERIFIER_FLAGS, SYSTEMATIC_LOW_RESOURCES,
};
use crate::toml_location::line_column;

/// Longest guest timeout a suite may ask for; longer is almost certainly a typo (ms for s).
const MAX_TIMEOUT_S: i64 = 24 * 3600;

/// Collects problems against the text they came from.
struct Checker<'a> {
    text: &'a str,
    problems: Vec<Problem>,
}

impl Checker<'_> {
    fn at(&mut self, span: Range<usize>, field: impl Into<String>, message: impl Into<String>) {
        let (line, column) = line_column(self.text, span.start);
        self.problems.push(Problem { line, column, field: field.into(), message: message.into() });
    }

    fn line_of(&self, span: &Range<usize>) -> usize {
        line_column(self.text, span.start).0
    }

    fn positive_u32(&mut self, v: &Spanned<i64>, field: &str, max: i64) -> Option<u32> {
        let n = *v.get_ref();
        let max = max.min(i64::from(u32::MAX));
        if (1..=max).contains(&n) {
            u32::try_from(n).ok()
        } else {
            self.at(v.span(), field, format!("{n} is out of range: expected 1..={max}"));
            None
        }
    }

    fn verifier_flags(&mut self, v: &Spanned<toml::Value>, field: &str) -> Option<u32> {
        let flags = match v.get_ref() {
            toml::Value::Integer(n) => u32::try_from(*n).ok(),
            toml::Value::String(s) => crate::stop_line::parse_hex(s.trim()).and_then(|n| u32::try_from(n).ok()),
            _ => None,
        };
        match flags {
            Some(0) => {
                self.at(
                    v.span(),
                    field,
                    "verifier flags 0 would make the \"on\" mode the \"off\" mode; restrict `modes` instead",
                );
                None
            }
            Some(field) => Some(field),
            None => {
                self.at(
                    v.span(),
                    field,
                    format!(
                        "bad verifier flags {}: expected 0x-prefixed hex (\"0xAA\") or an integer that fits in 32 bits",
                        v.get_ref()
                    ),
                );
                None
            }
        }
    }
}

/// Run and suite names: what survives a regex filter, a path component and a shell word without surprises.
fn is_plain_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|checker| checker.is_ascii_alphanumeric())
        && chars.all(|checker| checker.is_ascii_alphanumeric() || matches!(checker, '-' | '_' | '.'))
}

fn is_key(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '_')
}

/// Keys the suite sets itself from structured fields; an extra may not override them behind the file's back.
const RESERVED_GUEST_KEYS: [&str; 9] = [
    "scenario",
    "lock",
    "verifier",
    "fail_point",
    "faults_systematic",
    "driver",
    "processors",
    "interleave",
    "pct_horizon",
];

/// Validates a parsed suite file: the suite, or every problem found in it.
pub(super) fn check(raw: RawSuite, text: &str, file: &str) -> Result<Suite, Vec<Problem>> {
    let mut checker = Checker { text, problems: Vec::new() };
    let suite = validate(raw, file, &mut checker);
    if checker.problems.is_empty() {
        Ok(suite)
    } else {
        Err(checker.problems)
    }
}

fn validate(raw: RawSuite, file: &str, checker: &mut Checker) -> Suite {
    if !is_plain_name(raw.name.get_ref()) {
        checker.at(
            raw.name.span(),
            "name",
            format!("bad suite name {:?}: use letters, digits, '-', '_', '.'", raw.name.get_ref()),
        );
    }
    let defaults = &raw.defaults;
    let default_timeout = defaults
        .timeout_s
        .as_ref()
        .and_then(|t| checker.positive_u32(t, "defaults.timeout_s", MAX_TIMEOUT_S))
        .unwrap_or(DEFAULT_TIMEOUT_S);
    let default_silence = defaults
        .silence_s
        .as_ref()
        .and_then(|t| checker.positive_u32(t, "defaults.silence_s", MAX_TIMEOUT_S))
        .unwrap_or(DEFAULT_SILENCE_S);
    let default_flags = defaults
        .verifier_flags
        .as_ref()
        .and_then(|v| checker.verifier_flags(v, "defaults.verifier_flags"))
        .unwrap_or(DEFAULT_VERIFIER_FLAGS);
    let default_map_registers =
        defaults.map_registers.as_ref().and_then(|m| checker.positive_u32(m, "defaults.map_registers", i64::MAX));
    let default_drivers = match &defaults.drivers {
        Some(list) => driver_list(list, checker),
        None => vec![Personality::Native],
    };
    if raw.runs.is_empty() {
        checker.at(raw.name.span(), "run", "a suite needs at least one [[run]]");
    }
    let mut first_line: HashMap<String, usize> = HashMap::new();
    let mut runs = Vec::new();
    for (index, run) in raw.runs.into_iter().enumerate() {
        let field = |name: &str| format!("run[{index}].{name}");
        let name = run.name.get_ref().clone();
        let line = checker.line_of(&run.name.span());
        if !is_plain_name(&name) {
            checker.at(
                run.name.span(),
                field("name"),
                format!("bad run name {name:?}: use letters, digits, '-', '_', '.'"),
            );
        }
        if let Some(first) = first_line.get(&name) {
            checker.at(run.name.span(), field("name"), format!("duplicate run name {name:?} (first at line {first})"));
        } else {
            first_line.insert(name.clone(), line);
        }

        let modes = run_modes(&run, checker, &field);
        let verifier_flags = run
            .verifier_flags
            .as_ref()
            .and_then(|v| checker.verifier_flags(v, &field("verifier_flags")))
            .unwrap_or(default_flags);
        let device = DeviceOptions {
            map_registers: match &run.device.map_registers {
                Some(m) => checker.positive_u32(m, &field("device.map_registers"), i64::MAX),
                None => default_map_registers,
            },
            inject: run
                .device
                .inject
                .iter()
                .enumerate()
                .filter_map(|(j, kv)| check_injection(kv, &field(&format!("device.inject[{j}]")), checker))
                .collect(),
            revalidate_stale: run.device.revalidate_stale,
            without_access_platform: run.device.access_platform == Some(false),
        };
        let guest = guest_options(&run, &name, (default_timeout, default_silence), checker, &field);
        let expect = expectations(&run.expect, "expect", &modes, checker, &field);
        let expect_sys = run.expect_sys.as_ref().map(|e| expectations(e, "expect_sys", &modes, checker, &field));
        let events = required_events(&run, &modes, checker, &field);
        let each_fail_point = each_fail_point(&run, &modes, verifier_flags, checker, &field);
        let drivers = if run.driver.is_some() { vec![guest.driver] } else { default_drivers.clone() };
        let processors = run.processors.as_ref().and_then(|n| checker.positive_u32(n, &field("processors"), 64));
        let interleavings = interleaving_plan(&run, each_fail_point, checker, &field);
        runs.push(SuiteRun {
            name,
            device,
            guest,
            verifier_flags,
            expect,
            expect_sys,
            events,
            each_fail_point,
            line,
            drivers,
            processors,
            interleavings,
        });
    }
    let (guest, windows_image) = guest_kind(raw.guest.as_ref(), raw.windows_image.as_ref(), checker);
    Suite { name: raw.name.into_inner(), source: file.to_string(), runs, guest, windows_image }
}

/// `guest = "linux" | "windows"` and the Windows image it may name.
fn guest_kind(
    guest: Option<&Spanned<String>>,
    image: Option<&Spanned<String>>,
    checker: &mut Checker,
) -> (GuestKind, Option<String>) {
    let kind = match guest.map(|g| (g, g.get_ref().as_str())) {
        None | Some((_, "linux")) => GuestKind::Linux,
        Some((_, "windows")) => GuestKind::Windows,
        Some((g, other)) => {
            checker.at(g.span(), "guest", format!("unknown guest {other:?}: expected \"linux\" or \"windows\""));
            GuestKind::Linux
        }
    };
    match image {
        Some(i) if kind != GuestKind::Windows => {
            checker.at(i.span(), "windows_image", "a Windows image for a suite whose guest is not \"windows\"");
            (kind, None)
        }
        Some(i) if i.get_ref().trim().is_empty() => {
            checker.at(i.span(), "windows_image", "empty path");
            (kind, None)
        }
        Some(i) => (kind, Some(i.get_ref().clone())),
        None => (kind, None),
    }
}

/// `each_fail_point = true`: the recording run is Windows' systematic simulation in its "what if" mode, so the run's
/// flags must hold Systematic Low Resource Simulation (0x40000) and the run must be verifier-on only.
fn each_fail_point(
    run: &RawRun,
    modes: &[VerifierMode],
    flags: u32,
    checker: &mut Checker,
    field: &dyn Fn(&str) -> String,
) -> bool {
    let Some(each) = &run.each_fail_point else { return false };
    if !*each.get_ref() {
        return false;
    }
    if modes != [VerifierMode::On] {
        checker.at(
            each.span(),
            field("each_fail_point"),
            "needs `modes = [\"on\"]`: failure points are a verifier mode",
        );
    }
    if flags & SYSTEMATIC_LOW_RESOURCES == 0 {
        checker.at(
            each.span(),
            field("each_fail_point"),
            format!(
                "verifier flags {flags:#x} lack Systematic Low Resource Simulation (0x40000), which records the points"
            ),
        );
    }
    true
}

/// `interleavings = "preempt1" | "preempt2" | "pct:<runs>"` and its `max_interleavings` budget. Not with
/// `each_fail_point`: a run expands one way, so each expanded run names one schedule or one failure.
fn interleaving_plan(
    run: &RawRun,
    each_fail_point: bool,
    checker: &mut Checker,
    field: &dyn Fn(&str) -> String,
) -> Option<InterleavingPlan> {
    let budget =
        run.max_interleavings.as_ref().map(|b| (b, checker.positive_u32(b, &field("max_interleavings"), 100_000)));
    let Some(text) = &run.interleavings else {
        if let Some((b, _)) = budget {
            checker.at(b.span(), field("max_interleavings"), "a budget without `interleavings` to spend it on");
        }
        return None;
    };
    let expansion = match Expansion::parse(text.get_ref()) {
        Ok(e) => e,
        Err(why) => {
            checker.at(text.span(), field("interleavings"), why);
            return None;
        }
    };
    if each_fail_point {
        checker.at(text.span(), field("interleavings"), "not with `each_fail_point`: a run expands one way");
    }
    let budget = match budget {
        Some((_, n)) => n?,
        None => DEFAULT_MAX_INTERLEAVINGS,
    };
    Some(InterleavingPlan { expansion, budget })
}

/// `[defaults] drivers`: each a known personality, once; an empty list is an error (a run must run somewhere).
fn driver_list(list: &Spanned<Vec<Spanned<String>>>, checker: &mut Checker) -> Vec<Personality> {
    let mut drivers = Vec::new();
    for (i, d) in list.get_ref().iter().enumerate() {
        match Personality::parse(d.get_ref()) {
            Some(kind) if drivers.contains(&kind) => {
                checker.at(d.span(), format!("defaults.drivers[{i}]"), format!("{kind} is listed twice"))
            }
            Some(kind) => drivers.push(kind),
            None => checker.at(
                d.span(),
                format!("defaults.drivers[{i}]"),
                format!("unknown driver {:?}: expected \"native\" or \"sys\"", d.get_ref()),
            ),
        }
    }
    if list.get_ref().is_empty() {
        checker.at(list.span(), "defaults.drivers", "an empty list: name \"native\", \"sys\" or both");
    }
    if drivers.is_empty() {
        drivers.push(Personality::Native);
    }
    drivers
}

fn run_modes(run: &RawRun, checker: &mut Checker, field: &dyn Fn(&str) -> String) -> Vec<VerifierMode> {
    let Some(modes) = &run.modes else { return VerifierMode::ALL.to_vec() };
    if modes.get_ref().is_empty() {
        checker.at(modes.span(), field("modes"), "empty: list \"off\", \"on\" or both (or leave `modes` out for both)");
    }
    let mut out = Vec::new();
    for (j, m) in modes.get_ref().iter().enumerate() {
        let mode = match m.get_ref().as_str() {
            "off" => VerifierMode::Off,
            "on" => VerifierMode::On,
            other => {
                checker.at(
                    m.span(),
                    field(&format!("modes[{j}]")),
                    format!("unknown verifier mode {other:?}: expected \"off\" or \"on\""),
                );
                continue;
            }
        };
        if out.contains(&mode) {
            checker.at(m.span(), field(&format!("modes[{j}]")), format!("mode {:?} listed twice", mode.as_str()));
        } else {
            out.push(mode);
        }
    }
    out
}

fn check_injection(kv: &Spanned<String>, field: &str, checker: &mut Checker) -> Option<String> {
    let text = kv.get_ref();
    match text.split_once('=') {
        Some((key, value)) if is_key(key) && !value.is_empty() && !value.chars().any(char::is_whitespace) => {
            Some(text.clone())
        }
        _ => {
            checker.at(kv.span(), field, format!("bad injection {text:?}: expected KEY=VALUE (key in lower_snake_case, value without spaces), as `vhca-device --inject` takes it"));
            None
        }
    }
}

fn guest_options(
    run: &RawRun,
    name: &str,
    (default_timeout, default_silence): (u32, u32),
    checker: &mut Checker,
    field: &dyn Fn(&str) -> String,
) -> GuestOptions {
    let guest = &run.guest;
    let scenario = match &guest.scenario {
        Some(s) => {
            if !is_plain_name(s.get_ref()) {
                checker.at(
                    s.span(),
                    field("guest.scenario"),
                    format!("bad scenario name {:?}: use letters, digits, '-', '_', '.'", s.get_ref()),
                );
            }
            s.get_ref().clone()
        }
        None => name.to_string(),
    };
    let lock = guest.lock.as_ref().and_then(|l| match l.get_ref().as_str() {
        "fast_mutex" => Some(LockKind::FastMutex),
        "kmutex" => Some(LockKind::Kmutex),
        "eresource" => Some(LockKind::Eresource),
        other => {
            checker.at(
                l.span(),
                field("guest.lock"),
                format!("unknown lock kind {other:?}: expected \"fast_mutex\", \"kmutex\" or \"eresource\""),
            );
            None
        }
    });
    let timeout_s = guest
        .timeout_s
        .as_ref()
        .and_then(|t| checker.positive_u32(t, &field("guest.timeout_s"), MAX_TIMEOUT_S))
        .unwrap_or(default_timeout);
    let silence_s = guest
        .silence_s
        .as_ref()
        .and_then(|t| checker.positive_u32(t, &field("guest.silence_s"), MAX_TIMEOUT_S))
        .unwrap_or(default_silence);
    let mut extra = BTreeMap::new();
    for (key, value) in &guest.extra {
        // `vhca.fragmentation = 4` in TOML is a dotted key: a table `vhca` holding `fragmentation`. Accept it.
        if let ("vhca", RawExtra::Table(entries)) = (key.get_ref().as_str(), value) {
            for (k, v) in entries {
                let name = k.get_ref();
                add_extra(&mut extra, name, v, k.span(), &field(&format!("guest.extra.vhca.{name}")), checker);
            }
            continue;
        }
        let name = key.get_ref().strip_prefix("vhca.").unwrap_or(key.get_ref());
        add_extra(&mut extra, name, value, key.span(), &field(&format!("guest.extra.{name}")), checker);
    }
    let driver = match run.driver.as_ref().map(|d| (d, d.get_ref().as_str())) {
        None | Some((_, "native")) => Personality::Native,
        Some((_, "sys")) => Personality::Sys,
        Some((d, other)) => {
            checker.at(d.span(), field("driver"), format!("unknown driver {other:?}: expected \"native\" or \"sys\""));
            Personality::Native
        }
    };
    GuestOptions { scenario, lock, extra, timeout_s, silence_s, driver }
}

fn add_extra(
    extra: &mut BTreeMap<String, String>,
    key: &str,
    value: &RawExtra,
    span: Range<usize>,
    field: &str,
    checker: &mut Checker,
) {
    if !is_key(key) {
        checker.at(span, field, format!("bad key {key:?}: lower_snake_case, written without the `vhca.` prefix"));
        return;
    }
    if RESERVED_GUEST_KEYS.contains(&key) {
        checker.at(
            span,
            field,
            format!(
                "`{key}` is set by the run's own fields (guest.scenario, guest.lock, verifier_flags), not by extra"
            ),
        );
        return;
    }
    let text = match value {
        RawExtra::Text(s) => s.clone(),
        RawExtra::Integer(n) => n.to_string(),
        RawExtra::Float(x) => x.to_string(),
        RawExtra::Bool(b) => if *b { "1" } else { "0" }.to_string(),
        RawExtra::Table(_) | RawExtra::Array => {
            let what = if matches!(value, RawExtra::Array) { "an array" } else { "a table" };
            checker.at(span, field, format!("extra values are strings, numbers or booleans, found {what}"));
            return;
        }
    };
    // The value becomes one word of a kernel command line.
    if text.is_empty() || text.chars().any(|ch| ch.is_whitespace() || ch.is_control()) {
        checker.at(
            span,
            field,
            format!(
                "value {text:?} must be one non-empty word (it becomes vhca.{key}=VALUE on the guest's command line)"
            ),
        );
        return;
    }
    if extra.insert(key.to_string(), text).is_some() {
        checker.at(span, field, format!("`{key}` given twice (with and without the vhca. prefix?)"));
    }
}

/// The event-log kinds each mode requires. Kinds are checked for spelling only: the device's list is its own (and
/// grows without a schema bump), so an unknown kind shows up as "never seen" when the run is judged.
fn required_events(
    run: &RawRun,
    modes: &[VerifierMode],
    checker: &mut Checker,
    field: &dyn Fn(&str) -> String,
) -> BTreeMap<VerifierMode, Vec<String>> {
    let mut out: BTreeMap<VerifierMode, Vec<String>> = BTreeMap::new();
    let Some(events) = &run.events else { return out };
    let check = |kinds: &[Spanned<String>], field: String, checker: &mut Checker| -> Vec<String> {
        let mut ok = Vec::new();
        for (j, kind) in kinds.iter().enumerate() {
            let k = kind.get_ref();
            if !is_key(k) {
                checker.at(
                    kind.span(),
                    format!("{field}[{j}]"),
                    format!("bad event kind {k:?}: event-log kinds are lower_snake_case (docs/events.md)"),
                );
            } else if ok.contains(k) {
                checker.at(kind.span(), format!("{field}[{j}]"), format!("event kind {k:?} listed twice"));
            } else {
                ok.push(k.clone());
            }
        }
        ok
    };
    match events.get_ref() {
        PerMode::All(kinds) => {
            if kinds.is_empty() {
                checker.at(events.span(), field("events"), "empty list: leave `events` out to require none");
            }
            let kinds = check(kinds, field("events"), checker);
            out.extend(modes.iter().map(|m| (*m, kinds.clone())));
        }
        PerMode::Each(per_mode) => {
            for (mode, kinds) in per_mode {
                let field = field(&format!("events.{mode}"));
                if !modes.contains(mode) {
                    checker.at(
                        events.span(),
                        field,
                        format!("required events for mode {:?}, which `modes` leaves out", mode.as_str()),
                    );
                    continue;
                }
                let kinds = check(kinds.get_ref(), field, checker);
                out.insert(*mode, kinds);
            }
        }
    }
    out
}

/// One expectation per mode from `expect` (or `expect_sys`, named by `key`).
fn expectations(
    expect: &Spanned<PerMode<String>>,
    key: &str,
    modes: &[VerifierMode],
    checker: &mut Checker,
    field: &dyn Fn(&str) -> String,
) -> BTreeMap<VerifierMode, Expected> {
    let mut out = BTreeMap::new();
    let parse = |text: &str, span: Range<usize>, field: String, checker: &mut Checker| match Expected::parse(text) {
        Ok(e) => Some(e),
        Err(err) => {
            checker.at(span, field, err.to_string());
            None
        }
    };
    match expect.get_ref() {
        PerMode::All(text) => {
            if let Some(e) = parse(text, expect.span(), field(key), checker) {
                out.extend(modes.iter().map(|m| (*m, e.clone())));
            }
        }
        PerMode::Each(per_mode) => {
            let mut seen = Vec::new();
            for (mode, text) in per_mode {
                seen.push(*mode);
                let field = field(&format!("{key}.{mode}"));
                if !modes.contains(mode) {
                    checker.at(
                        text.span(),
                        field,
                        format!("an expectation for mode {:?}, which `modes` leaves out", mode.as_str()),
                    );
                    continue;
                }
                if let Some(e) = parse(text.get_ref(), text.span(), field, checker) {
                    out.insert(*mode, e);
                }
            }
            for mode in modes.iter().filter(|m| !seen.contains(m)) {
                checker.at(
                    expect.span(),
                    field(&format!("{key}.{mode}")),
                    format!("no expectation for verifier mode {:?}", mode.as_str()),
                );
            }
        }
    }
    out
}
