//! Reads a suite file: serde + toml into raw, spanned structs, then one validation pass that collects every problem
//! with the file, line and field it belongs to, so a bad file is fixed in one round instead of one error at a time.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use toml::Spanned;

use crate::expect::Expected;
use crate::suite::{
    DeviceOptions, GuestKind, GuestOptions, LockKind, Suite, SuiteRun, VerifierMode, DEFAULT_SILENCE_S,
    DEFAULT_TIMEOUT_S, DEFAULT_VERIFIER_FLAGS,
};
use crate::toml_location::{field_path_at, line_column};

/// The built-in seed suite (the seed threads' scenarios), compiled in.
pub const SEED_SUITE: &str = include_str!("../suites/seed.toml");
/// How messages name the built-in suite.
pub const SEED_SUITE_NAME: &str = "<built-in seed suite>";

/// Longest guest timeout a suite may ask for; longer is almost certainly a typo (ms for s).
const MAX_TIMEOUT_S: i64 = 24 * 3600;

/// One thing wrong with a suite file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based; 0 when the problem has no place in the text.
    pub line: usize,
    pub column: usize,
    /// Dotted path (`run[2].expect.on`), or `-` when the text did not parse far enough to name one.
    pub field: String,
    pub message: String,
}

/// Why a suite file was refused: every problem found, each with its place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct SuiteError {
    pub file: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for SuiteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{}:{}:{}: {}: {}", self.file, p.line, p.column, p.field, p.message)?;
        }
        Ok(())
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSuite {
    name: Spanned<String>,
    guest: Option<Spanned<String>>,
    windows_image: Option<Spanned<String>>,
    #[serde(default)]
    defaults: RawDefaults,
    #[serde(default, rename = "run")]
    runs: Vec<RawRun>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDefaults {
    timeout_s: Option<Spanned<i64>>,
    silence_s: Option<Spanned<i64>>,
    verifier_flags: Option<Spanned<toml::Value>>,
    map_registers: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRun {
    name: Spanned<String>,
    modes: Option<Spanned<Vec<Spanned<String>>>>,
    verifier_flags: Option<Spanned<toml::Value>>,
    #[serde(default)]
    device: RawDevice,
    #[serde(default)]
    guest: RawGuest,
    expect: Spanned<RawExpect>,
    events: Option<Spanned<RawEvents>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    map_registers: Option<Spanned<i64>>,
    #[serde(default)]
    inject: Vec<Spanned<String>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawGuest {
    scenario: Option<Spanned<String>>,
    lock: Option<Spanned<String>>,
    timeout_s: Option<Spanned<i64>>,
    silence_s: Option<Spanned<i64>>,
    #[serde(default)]
    extra: BTreeMap<Spanned<String>, RawExtra>,
}

/// A value under `guest.extra`. Problems point at the key's span: the implicit table of a dotted key
/// (`vhca.key = 1`) has no span of its own, so neither `Spanned` values nor `toml::Value` work here.
enum RawExtra {
    Text(String),
    Integer(i64),
    Float(f64),
    Bool(bool),
    Table(Vec<(Spanned<String>, RawExtra)>),
    Array,
}

impl<'de> Deserialize<'de> for RawExtra {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawExtra;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, number or boolean")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawExtra, E> {
                Ok(RawExtra::Text(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawExtra, E> {
                Ok(RawExtra::Integer(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawExtra, E> {
                i64::try_from(v).map(RawExtra::Integer).map_err(|_| E::custom("integer out of range"))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<RawExtra, E> {
                Ok(RawExtra::Float(v))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<RawExtra, E> {
                Ok(RawExtra::Bool(v))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<RawExtra, A::Error> {
                while seq.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(RawExtra::Array)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawExtra, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<Spanned<String>>()? {
                    entries.push((key, map.next_value::<RawExtra>()?));
                }
                Ok(RawExtra::Table(entries))
            }
        }
        d.deserialize_any(V)
    }
}

/// `expect = "pass"` (every mode) or `expect = { off = "...", on = "..." }`.
enum RawExpect {
    All(String),
    PerMode(Vec<(VerifierMode, Spanned<String>)>),
}

impl<'de> Deserialize<'de> for RawExpect {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawExpect;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a verdict string, or a table with keys `off` and/or `on`")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawExpect, E> {
                Ok(RawExpect::All(v.to_string()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawExpect, A::Error> {
                let mut per_mode = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    let mode = match key.as_str() {
                        "off" => VerifierMode::Off,
                        "on" => VerifierMode::On,
                        _ => return Err(de::Error::unknown_field(&key, &["off", "on"])),
                    };
                    per_mode.push((mode, map.next_value::<Spanned<String>>()?));
                }
                Ok(RawExpect::PerMode(per_mode))
            }
        }
        d.deserialize_any(V)
    }
}

/// `events = ["kind", ...]` (every mode) or `events = { off = [...], on = [...] }`.
enum RawEvents {
    All(Vec<Spanned<String>>),
    PerMode(Vec<(VerifierMode, Vec<Spanned<String>>)>),
}

impl<'de> Deserialize<'de> for RawEvents {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawEvents;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of event-log kinds, or a table with keys `off` and/or `on` holding such lists")
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<RawEvents, A::Error> {
                let mut kinds = Vec::new();
                while let Some(kind) = seq.next_element::<Spanned<String>>()? {
                    kinds.push(kind);
                }
                Ok(RawEvents::All(kinds))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawEvents, A::Error> {
                let mut per_mode = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    let mode = match key.as_str() {
                        "off" => VerifierMode::Off,
                        "on" => VerifierMode::On,
                        _ => return Err(de::Error::unknown_field(&key, &["off", "on"])),
                    };
                    per_mode.push((mode, map.next_value::<Vec<Spanned<String>>>()?));
                }
                Ok(RawEvents::PerMode(per_mode))
            }
        }
        d.deserialize_any(V)
    }
}

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
            Some(f) => Some(f),
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
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn is_key(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// Keys the suite sets itself from structured fields; an extra may not override them behind the file's back.
const RESERVED_GUEST_KEYS: [&str; 3] = ["scenario", "lock", "verifier"];

impl Suite {
    /// Parses and validates a suite file's text. `file` is only used to name the file in messages.
    pub fn parse(text: &str, file: &str) -> Result<Suite, SuiteError> {
        let raw: RawSuite = toml::from_str(text)
            .map_err(|e| SuiteError { file: file.to_string(), problems: vec![serde_problem(text, &e)] })?;
        let mut c = Checker { text, problems: Vec::new() };
        let suite = validate(raw, file, &mut c);
        if c.problems.is_empty() {
            Ok(suite)
        } else {
            Err(SuiteError { file: file.to_string(), problems: c.problems })
        }
    }

    /// The built-in seed suite.
    pub fn seed() -> Result<Suite, SuiteError> {
        Suite::parse(SEED_SUITE, SEED_SUITE_NAME)
    }
}

fn serde_problem(text: &str, e: &toml::de::Error) -> Problem {
    let message = e.message().trim().to_string();
    let Some(span) = e.span() else {
        return Problem { line: 0, column: 0, field: "-".into(), message };
    };
    let (line, column) = line_column(text, span.start);
    let mut field = field_path_at(text, span.start).unwrap_or_else(|| "-".into());
    // A missing field's span is its table, and so is an unknown one's when a hand-written visitor refused it:
    // name the field itself.
    let named = ["missing field `", "unknown field `"]
        .iter()
        .find_map(|prefix| message.strip_prefix(prefix).and_then(|m| m.split('`').next()));
    if let Some(name) = named {
        if field == "-" {
            field = name.to_string();
        } else if !field.ends_with(&format!(".{name}")) && field != name {
            field = format!("{field}.{name}");
        }
    }
    Problem { line, column, field, message }
}

fn validate(raw: RawSuite, file: &str, c: &mut Checker) -> Suite {
    if !is_plain_name(raw.name.get_ref()) {
        c.at(
            raw.name.span(),
            "name",
            format!("bad suite name {:?}: use letters, digits, '-', '_', '.'", raw.name.get_ref()),
        );
    }
    let d = &raw.defaults;
    let default_timeout = d
        .timeout_s
        .as_ref()
        .and_then(|t| c.positive_u32(t, "defaults.timeout_s", MAX_TIMEOUT_S))
        .unwrap_or(DEFAULT_TIMEOUT_S);
    let default_silence = d
        .silence_s
        .as_ref()
        .and_then(|t| c.positive_u32(t, "defaults.silence_s", MAX_TIMEOUT_S))
        .unwrap_or(DEFAULT_SILENCE_S);
    let default_flags = d
        .verifier_flags
        .as_ref()
        .and_then(|v| c.verifier_flags(v, "defaults.verifier_flags"))
        .unwrap_or(DEFAULT_VERIFIER_FLAGS);
    let default_map_registers =
        d.map_registers.as_ref().and_then(|m| c.positive_u32(m, "defaults.map_registers", i64::MAX));
    if raw.runs.is_empty() {
        c.at(raw.name.span(), "run", "a suite needs at least one [[run]]");
    }
    let mut first_line: HashMap<String, usize> = HashMap::new();
    let mut runs = Vec::new();
    for (i, r) in raw.runs.into_iter().enumerate() {
        let f = |field: &str| format!("run[{i}].{field}");
        let name = r.name.get_ref().clone();
        let line = c.line_of(&r.name.span());
        if !is_plain_name(&name) {
            c.at(r.name.span(), f("name"), format!("bad run name {name:?}: use letters, digits, '-', '_', '.'"));
        }
        if let Some(first) = first_line.get(&name) {
            c.at(r.name.span(), f("name"), format!("duplicate run name {name:?} (first at line {first})"));
        } else {
            first_line.insert(name.clone(), line);
        }

        let modes = run_modes(&r, c, &f);
        let verifier_flags =
            r.verifier_flags.as_ref().and_then(|v| c.verifier_flags(v, &f("verifier_flags"))).unwrap_or(default_flags);
        let device = DeviceOptions {
            map_registers: match &r.device.map_registers {
                Some(m) => c.positive_u32(m, &f("device.map_registers"), i64::MAX),
                None => default_map_registers,
            },
            inject: r
                .device
                .inject
                .iter()
                .enumerate()
                .filter_map(|(j, kv)| check_injection(kv, &f(&format!("device.inject[{j}]")), c))
                .collect(),
        };
        let guest = guest_options(&r, &name, (default_timeout, default_silence), c, &f);
        let expect = expectations(&r, &modes, c, &f);
        let events = required_events(&r, &modes, c, &f);
        runs.push(SuiteRun { name, device, guest, verifier_flags, expect, events, line });
    }
    let (guest, windows_image) = guest_kind(raw.guest.as_ref(), raw.windows_image.as_ref(), c);
    Suite { name: raw.name.into_inner(), source: file.to_string(), runs, guest, windows_image }
}

/// `guest = "linux" | "windows"` and the Windows image it may name.
fn guest_kind(
    guest: Option<&Spanned<String>>,
    image: Option<&Spanned<String>>,
    c: &mut Checker,
) -> (GuestKind, Option<String>) {
    let kind = match guest.map(|g| (g, g.get_ref().as_str())) {
        None | Some((_, "linux")) => GuestKind::Linux,
        Some((_, "windows")) => GuestKind::Windows,
        Some((g, other)) => {
            c.at(g.span(), "guest", format!("unknown guest {other:?}: expected \"linux\" or \"windows\""));
            GuestKind::Linux
        }
    };
    match image {
        Some(i) if kind != GuestKind::Windows => {
            c.at(i.span(), "windows_image", "a Windows image for a suite whose guest is not \"windows\"");
            (kind, None)
        }
        Some(i) if i.get_ref().trim().is_empty() => {
            c.at(i.span(), "windows_image", "empty path");
            (kind, None)
        }
        Some(i) => (kind, Some(i.get_ref().clone())),
        None => (kind, None),
    }
}

fn run_modes(r: &RawRun, c: &mut Checker, f: &dyn Fn(&str) -> String) -> Vec<VerifierMode> {
    let Some(modes) = &r.modes else { return VerifierMode::ALL.to_vec() };
    if modes.get_ref().is_empty() {
        c.at(modes.span(), f("modes"), "empty: list \"off\", \"on\" or both (or leave `modes` out for both)");
    }
    let mut out = Vec::new();
    for (j, m) in modes.get_ref().iter().enumerate() {
        let mode = match m.get_ref().as_str() {
            "off" => VerifierMode::Off,
            "on" => VerifierMode::On,
            other => {
                c.at(
                    m.span(),
                    f(&format!("modes[{j}]")),
                    format!("unknown verifier mode {other:?}: expected \"off\" or \"on\""),
                );
                continue;
            }
        };
        if out.contains(&mode) {
            c.at(m.span(), f(&format!("modes[{j}]")), format!("mode {:?} listed twice", mode.as_str()));
        } else {
            out.push(mode);
        }
    }
    out
}

fn check_injection(kv: &Spanned<String>, field: &str, c: &mut Checker) -> Option<String> {
    let text = kv.get_ref();
    match text.split_once('=') {
        Some((key, value)) if is_key(key) && !value.is_empty() && !value.chars().any(char::is_whitespace) => {
            Some(text.clone())
        }
        _ => {
            c.at(kv.span(), field, format!("bad injection {text:?}: expected KEY=VALUE (key in lower_snake_case, value without spaces), as `vhca-device --inject` takes it"));
            None
        }
    }
}

fn guest_options(
    r: &RawRun,
    name: &str,
    (default_timeout, default_silence): (u32, u32),
    c: &mut Checker,
    f: &dyn Fn(&str) -> String,
) -> GuestOptions {
    let g = &r.guest;
    let scenario = match &g.scenario {
        Some(s) => {
            if !is_plain_name(s.get_ref()) {
                c.at(
                    s.span(),
                    f("guest.scenario"),
                    format!("bad scenario name {:?}: use letters, digits, '-', '_', '.'", s.get_ref()),
                );
            }
            s.get_ref().clone()
        }
        None => name.to_string(),
    };
    let lock = g.lock.as_ref().and_then(|l| match l.get_ref().as_str() {
        "fast_mutex" => Some(LockKind::FastMutex),
        "kmutex" => Some(LockKind::Kmutex),
        "eresource" => Some(LockKind::Eresource),
        other => {
            c.at(
                l.span(),
                f("guest.lock"),
                format!("unknown lock kind {other:?}: expected \"fast_mutex\", \"kmutex\" or \"eresource\""),
            );
            None
        }
    });
    let timeout_s = g
        .timeout_s
        .as_ref()
        .and_then(|t| c.positive_u32(t, &f("guest.timeout_s"), MAX_TIMEOUT_S))
        .unwrap_or(default_timeout);
    let silence_s = g
        .silence_s
        .as_ref()
        .and_then(|t| c.positive_u32(t, &f("guest.silence_s"), MAX_TIMEOUT_S))
        .unwrap_or(default_silence);
    let mut extra = BTreeMap::new();
    for (key, value) in &g.extra {
        // `vhca.fragmentation = 4` in TOML is a dotted key: a table `vhca` holding `fragmentation`. Accept it.
        if let ("vhca", RawExtra::Table(entries)) = (key.get_ref().as_str(), value) {
            for (k, v) in entries {
                let name = k.get_ref();
                add_extra(&mut extra, name, v, k.span(), &f(&format!("guest.extra.vhca.{name}")), c);
            }
            continue;
        }
        let name = key.get_ref().strip_prefix("vhca.").unwrap_or(key.get_ref());
        add_extra(&mut extra, name, value, key.span(), &f(&format!("guest.extra.{name}")), c);
    }
    GuestOptions { scenario, lock, extra, timeout_s, silence_s }
}

fn add_extra(
    extra: &mut BTreeMap<String, String>,
    key: &str,
    value: &RawExtra,
    span: Range<usize>,
    field: &str,
    c: &mut Checker,
) {
    if !is_key(key) {
        c.at(span, field, format!("bad key {key:?}: lower_snake_case, written without the `vhca.` prefix"));
        return;
    }
    if RESERVED_GUEST_KEYS.contains(&key) {
        c.at(
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
            c.at(span, field, format!("extra values are strings, numbers or booleans, found {what}"));
            return;
        }
    };
    // The value becomes one word of a kernel command line.
    if text.is_empty() || text.chars().any(|ch| ch.is_whitespace() || ch.is_control()) {
        c.at(
            span,
            field,
            format!(
                "value {text:?} must be one non-empty word (it becomes vhca.{key}=VALUE on the guest's command line)"
            ),
        );
        return;
    }
    if extra.insert(key.to_string(), text).is_some() {
        c.at(span, field, format!("`{key}` given twice (with and without the vhca. prefix?)"));
    }
}

/// The event-log kinds each mode requires. Kinds are checked for spelling only: the device's list is its own (and
/// grows without a schema bump), so an unknown kind shows up as "never seen" when the run is judged.
fn required_events(
    r: &RawRun,
    modes: &[VerifierMode],
    c: &mut Checker,
    f: &dyn Fn(&str) -> String,
) -> BTreeMap<VerifierMode, Vec<String>> {
    let mut out: BTreeMap<VerifierMode, Vec<String>> = BTreeMap::new();
    let Some(events) = &r.events else { return out };
    let check = |kinds: &[Spanned<String>], field: String, c: &mut Checker| -> Vec<String> {
        let mut ok = Vec::new();
        for (j, kind) in kinds.iter().enumerate() {
            let k = kind.get_ref();
            if !is_key(k) {
                c.at(
                    kind.span(),
                    format!("{field}[{j}]"),
                    format!("bad event kind {k:?}: event-log kinds are lower_snake_case (docs/events.md)"),
                );
            } else if ok.contains(k) {
                c.at(kind.span(), format!("{field}[{j}]"), format!("event kind {k:?} listed twice"));
            } else {
                ok.push(k.clone());
            }
        }
        ok
    };
    match events.get_ref() {
        RawEvents::All(kinds) => {
            if kinds.is_empty() {
                c.at(events.span(), f("events"), "empty list: leave `events` out to require none");
            }
            let kinds = check(kinds, f("events"), c);
            out.extend(modes.iter().map(|m| (*m, kinds.clone())));
        }
        RawEvents::PerMode(per_mode) => {
            for (mode, kinds) in per_mode {
                let field = f(&format!("events.{mode}"));
                if !modes.contains(mode) {
                    c.at(
                        events.span(),
                        field,
                        format!("required events for mode {:?}, which `modes` leaves out", mode.as_str()),
                    );
                    continue;
                }
                let kinds = check(kinds, field, c);
                out.insert(*mode, kinds);
            }
        }
    }
    out
}

fn expectations(
    r: &RawRun,
    modes: &[VerifierMode],
    c: &mut Checker,
    f: &dyn Fn(&str) -> String,
) -> BTreeMap<VerifierMode, Expected> {
    let mut out = BTreeMap::new();
    let parse = |text: &str, span: Range<usize>, field: String, c: &mut Checker| match Expected::parse(text) {
        Ok(e) => Some(e),
        Err(err) => {
            c.at(span, field, err.to_string());
            None
        }
    };
    match r.expect.get_ref() {
        RawExpect::All(text) => {
            if let Some(e) = parse(text, r.expect.span(), f("expect"), c) {
                out.extend(modes.iter().map(|m| (*m, e.clone())));
            }
        }
        RawExpect::PerMode(per_mode) => {
            let mut seen = Vec::new();
            for (mode, text) in per_mode {
                seen.push(*mode);
                let field = f(&format!("expect.{mode}"));
                if !modes.contains(mode) {
                    c.at(
                        text.span(),
                        field,
                        format!("an expectation for mode {:?}, which `modes` leaves out", mode.as_str()),
                    );
                    continue;
                }
                if let Some(e) = parse(text.get_ref(), text.span(), field, c) {
                    out.insert(*mode, e);
                }
            }
            for mode in modes.iter().filter(|m| !seen.contains(m)) {
                c.at(
                    r.expect.span(),
                    f(&format!("expect.{mode}")),
                    format!("no expectation for verifier mode {:?}", mode.as_str()),
                );
            }
        }
    }
    out
}
