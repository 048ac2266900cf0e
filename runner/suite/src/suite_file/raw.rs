//! The serde layer of a suite file: the TOML as written, each value with its span, before any validation. One
//! hand-written visitor serves the three shapes serde's derive cannot express (a verdict string or a per-mode table,
//! an event list or a per-mode table, a `guest.extra` value whose table keys keep their spans).

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Unexpected, Visitor};
use serde::Deserialize;
use toml::Spanned;

use crate::suite::VerifierMode;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSuite {
    pub name: Spanned<String>,
    pub guest: Option<Spanned<String>>,
    pub windows_image: Option<Spanned<String>>,
    #[serde(default)]
    pub defaults: RawDefaults,
    #[serde(default, rename = "run")]
    pub runs: Vec<RawRun>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDefaults {
    pub timeout_s: Option<Spanned<i64>>,
    pub silence_s: Option<Spanned<i64>>,
    pub verifier_flags: Option<Spanned<toml::Value>>,
    pub map_registers: Option<Spanned<i64>>,
    /// `drivers = ["native", "sys"]`: the personalities a run without its own `driver` runs in.
    pub drivers: Option<Spanned<Vec<Spanned<String>>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRun {
    pub name: Spanned<String>,
    pub modes: Option<Spanned<Vec<Spanned<String>>>>,
    pub verifier_flags: Option<Spanned<toml::Value>>,
    /// `driver = "native" | "sys"`: which build of the driver runs the scenario.
    pub driver: Option<Spanned<String>>,
    #[serde(default)]
    pub device: RawDevice,
    #[serde(default)]
    pub guest: RawGuest,
    pub expect: Spanned<PerMode<String>>,
    /// What vhca.sys's runs expect where it differs from `expect` (a check that sees the native build only).
    pub expect_sys: Option<Spanned<PerMode<String>>>,
    pub events: Option<Spanned<PerMode<Vec<Spanned<String>>>>>,
    /// The exhaustive low-resources mode: this run records its failure points, then each becomes a run of its own.
    pub each_fail_point: Option<Spanned<bool>>,
    /// The guest's processors and QEMU's vCPUs.
    pub processors: Option<Spanned<i64>>,
    /// The interleaving expansion: `"preempt1"`, `"preempt2"` or `"pct:<runs>"`.
    pub interleavings: Option<Spanned<String>>,
    /// The expansion's budget of runs (default 64).
    pub max_interleavings: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDevice {
    pub map_registers: Option<Spanned<i64>>,
    #[serde(default)]
    pub inject: Vec<Spanned<String>>,
    #[serde(default)]
    pub revalidate_stale: bool,
    /// false: the device without VIRTIO_F_ACCESS_PLATFORM (iommu_platform=off).
    pub access_platform: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGuest {
    pub scenario: Option<Spanned<String>>,
    pub lock: Option<Spanned<String>>,
    pub timeout_s: Option<Spanned<i64>>,
    pub silence_s: Option<Spanned<i64>>,
    #[serde(default)]
    pub extra: BTreeMap<Spanned<String>, RawExtra>,
}

/// A value under `guest.extra`. Problems point at the key's span: the implicit table of a dotted key
/// (`vhca.key = 1`) has no span of its own, so neither `Spanned` values nor `toml::Value` work here.
pub(super) enum RawExtra {
    Text(String),
    Integer(i64),
    Float(f64),
    Bool(bool),
    Table(Vec<(Spanned<String>, RawExtra)>),
    Array,
}

/// One value for every verifier mode (`expect = "pass"`, `events = [...]`) or a table with keys `off` and/or `on`
/// (`expect = { off = "pass", on = "..." }`).
pub(super) enum PerMode<T> {
    All(T),
    Each(Vec<(VerifierMode, Spanned<T>)>),
}

/// A shape the visitor builds: what it makes of each kind of TOML value. Kinds it does not take are refused
/// with the `EXPECTING` text.
trait Shape<'de>: Sized {
    const EXPECTING: &'static str;
    fn from_scalar<E: de::Error>(value: Unexpected<'_>) -> Result<Self, E> {
        Err(E::invalid_type(value, &Self::EXPECTING))
    }
    fn from_seq<A: SeqAccess<'de>>(_seq: A) -> Result<Self, A::Error> {
        Err(de::Error::invalid_type(Unexpected::Seq, &Self::EXPECTING))
    }
    fn from_map<A: MapAccess<'de>>(_map: A) -> Result<Self, A::Error> {
        Err(de::Error::invalid_type(Unexpected::Map, &Self::EXPECTING))
    }
}

/// The one visitor: hands every value kind to the shape.
struct ShapeVisitor<S>(PhantomData<S>);

impl<'de, S: Shape<'de>> Visitor<'de> for ShapeVisitor<S> {
    type Value = S;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(S::EXPECTING)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<S, E> {
        S::from_scalar(Unexpected::Str(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<S, E> {
        S::from_scalar(Unexpected::Signed(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<S, E> {
        let v = i64::try_from(v).map_err(|_| E::custom("integer out of range"))?;
        S::from_scalar(Unexpected::Signed(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<S, E> {
        S::from_scalar(Unexpected::Float(v))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<S, E> {
        S::from_scalar(Unexpected::Bool(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<S, A::Error> {
        S::from_seq(seq)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<S, A::Error> {
        S::from_map(map)
    }
}

impl<'de> Shape<'de> for RawExtra {
    const EXPECTING: &'static str = "a string, number or boolean";
    fn from_scalar<E: de::Error>(value: Unexpected<'_>) -> Result<RawExtra, E> {
        Ok(match value {
            Unexpected::Str(s) => RawExtra::Text(s.to_string()),
            Unexpected::Signed(n) => RawExtra::Integer(n),
            Unexpected::Float(x) => RawExtra::Float(x),
            Unexpected::Bool(b) => RawExtra::Bool(b),
            other => return Err(E::invalid_type(other, &Self::EXPECTING)),
        })
    }
    fn from_seq<A: SeqAccess<'de>>(mut seq: A) -> Result<RawExtra, A::Error> {
        while seq.next_element::<de::IgnoredAny>()?.is_some() {}
        Ok(RawExtra::Array)
    }
    fn from_map<A: MapAccess<'de>>(mut map: A) -> Result<RawExtra, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Spanned<String>>()? {
            entries.push((key, map.next_value::<RawExtra>()?));
        }
        Ok(RawExtra::Table(entries))
    }
}

/// The per-mode table both `expect` and `events` accept.
fn per_mode_table<'de, T: Deserialize<'de>, A: MapAccess<'de>>(
    mut map: A,
) -> Result<Vec<(VerifierMode, Spanned<T>)>, A::Error> {
    let mut each = Vec::new();
    while let Some(key) = map.next_key::<String>()? {
        let mode = match key.as_str() {
            "off" => VerifierMode::Off,
            "on" => VerifierMode::On,
            _ => return Err(de::Error::unknown_field(&key, &["off", "on"])),
        };
        each.push((mode, map.next_value::<Spanned<T>>()?));
    }
    Ok(each)
}

impl<'de> Shape<'de> for PerMode<String> {
    const EXPECTING: &'static str = "a verdict string, or a table with keys `off` and/or `on`";
    fn from_scalar<E: de::Error>(value: Unexpected<'_>) -> Result<Self, E> {
        match value {
            Unexpected::Str(s) => Ok(PerMode::All(s.to_string())),
            other => Err(E::invalid_type(other, &Self::EXPECTING)),
        }
    }
    fn from_map<A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        per_mode_table(map).map(PerMode::Each)
    }
}

impl<'de> Shape<'de> for PerMode<Vec<Spanned<String>>> {
    const EXPECTING: &'static str =
        "a list of event-log kinds, or a table with keys `off` and/or `on` holding such lists";
    fn from_seq<A: SeqAccess<'de>>(mut seq: A) -> Result<Self, A::Error> {
        let mut kinds = Vec::new();
        while let Some(kind) = seq.next_element::<Spanned<String>>()? {
            kinds.push(kind);
        }
        Ok(PerMode::All(kinds))
    }
    fn from_map<A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        per_mode_table(map).map(PerMode::Each)
    }
}

macro_rules! deserialize_through_shape {
    ($($t:ty),*) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any(ShapeVisitor::<Self>(PhantomData))
            }
        }
    )*};
}

deserialize_through_shape!(RawExtra, PerMode<String>, PerMode<Vec<Spanned<String>>>);
