//! Sharding a suite across CI machines: `--shard I/N` takes a deterministic, balanced share of the concrete runs.
//! Balanced by the runs' recorded durations when a previous report gives them, by run count otherwise.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::suite::ConcreteRun;

/// Shard `index` (1-based) of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("shard {0:?} is not I/N with 1 <= I <= N (e.g. 2/4)")]
pub struct ShardParseError(String);

impl FromStr for Shard {
    type Err = ShardParseError;

    fn from_str(s: &str) -> Result<Shard, ShardParseError> {
        let bad = || ShardParseError(s.to_string());
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count) = (i.trim().parse().map_err(|_| bad())?, n.trim().parse().map_err(|_| bad())?);
        if index == 0 || count == 0 || index > count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// Run name → seconds, from a previous JSON report (`runs[].name`, `runs[].seconds`). Unreadable entries are skipped:
/// a missing duration only makes the balance coarser.
pub fn durations_from_report(json: &str) -> BTreeMap<String, f64> {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(json) else { return BTreeMap::new() };
    let runs = value.get("runs").and_then(|r| r.as_array()).cloned().unwrap_or_default();
    runs.iter()
        .filter_map(|r| {
            let name = r.get("name")?.as_str()?.to_string();
            let secs = r.get("seconds")?.as_f64().filter(|s| s.is_finite() && *s > 0.0)?;
            Some((name, secs))
        })
        .collect()
}

/// The runs of `shard`, in suite order. Every shard computes the same assignment from the same inputs: runs go
/// longest first (ties by name) to the shard with the least time so far (ties to the lowest index). A run without
/// a recorded duration counts as the median of the recorded ones (1 s when there are none), so with no report
/// the shards get equal counts.
pub fn shard_runs(runs: &[ConcreteRun], shard: Shard, durations: &BTreeMap<String, f64>) -> Vec<ConcreteRun> {
    let assignment = assign(runs.iter().map(|r| r.name.as_str()), shard.count, durations);
    runs.iter().zip(assignment).filter(|(_, s)| *s == shard.index).map(|(r, _)| r.clone()).collect()
}

/// The 1-based shard of each name, in input order.
fn assign<'a>(names: impl Iterator<Item = &'a str>, count: usize, durations: &BTreeMap<String, f64>) -> Vec<usize> {
    let names: Vec<&str> = names.collect();
    let mut known: Vec<f64> = names.iter().filter_map(|n| durations.get(*n).copied()).collect();
    known.sort_by(f64::total_cmp);
    let fallback = if known.is_empty() { 1.0 } else { known[known.len() / 2] };
    let cost = |name: &str| durations.get(name).copied().unwrap_or(fallback);
    let mut order: Vec<usize> = (0..names.len()).collect();
    order.sort_by(|&a, &b| cost(names[b]).total_cmp(&cost(names[a])).then_with(|| names[a].cmp(names[b])));
    let mut load = vec![0.0f64; count.max(1)];
    let mut out = vec![0usize; names.len()];
    for i in order {
        let (least, _) = load
            .iter()
            .enumerate()
            .min_by(|(ia, a), (ib, b)| a.total_cmp(b).then_with(|| ia.cmp(ib)))
            .unwrap_or((0, &0.0));
        load[least] += cost(names[i]);
        out[i] = least + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suite::Suite;

    fn seed_runs() -> Vec<ConcreteRun> {
        Suite::seed().unwrap().expand()
    }

    #[test]
    fn shard_specs_parse_and_bad_ones_are_refused() {
        assert_eq!("2/4".parse::<Shard>().unwrap(), Shard { index: 2, count: 4 });
        assert_eq!("1/1".parse::<Shard>().unwrap().to_string(), "1/1");
        for bad in ["0/2", "3/2", "1/0", "2", "a/b", "1/2/3", ""] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
    }

    #[test]
    fn shards_are_disjoint_cover_the_suite_and_are_deterministic() {
        let runs = seed_runs();
        for count in 1..=5 {
            for durations in [BTreeMap::new(), varied(&runs)] {
                let mut seen: Vec<String> = Vec::new();
                for index in 1..=count {
                    let shard = Shard { index, count };
                    let mine = shard_runs(&runs, shard, &durations);
                    assert_eq!(mine, shard_runs(&runs, shard, &durations), "deterministic");
                    seen.extend(mine.into_iter().map(|r| r.name));
                }
                let mut all: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
                let total = seen.len();
                seen.sort();
                seen.dedup();
                assert_eq!(seen.len(), total, "no run in two shards");
                all.sort();
                assert_eq!(seen, all, "every run in one shard ({count} shards)");
            }
        }
    }

    fn varied(runs: &[ConcreteRun]) -> BTreeMap<String, f64> {
        runs.iter().enumerate().map(|(i, r)| (r.name.clone(), 0.5 + (i % 7) as f64)).collect()
    }

    #[test]
    fn without_durations_counts_are_even_and_with_them_time_is_balanced() {
        let runs = seed_runs();
        let counts: Vec<usize> =
            (1..=3).map(|i| shard_runs(&runs, Shard { index: i, count: 3 }, &BTreeMap::new()).len()).collect();
        assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1, "{counts:?}");
        // One long run and many short ones: the long one gets a shard nearly to itself.
        let mut durations: BTreeMap<String, f64> = runs.iter().map(|r| (r.name.clone(), 1.0)).collect();
        durations.insert(runs[0].name.clone(), runs.len() as f64);
        let first = shard_runs(&runs, Shard { index: 1, count: 2 }, &durations);
        assert_eq!(first.iter().map(|r| r.name.clone()).collect::<Vec<_>>(), [runs[0].name.clone()]);
        let time = |i| {
            shard_runs(&runs, Shard { index: i, count: 2 }, &durations).iter().map(|r| durations[&r.name]).sum::<f64>()
        };
        assert!((time(1) - time(2)).abs() <= runs.len() as f64, "balanced by time");
    }

    #[test]
    fn durations_come_from_a_previous_report() {
        let json = r#"{"runs":[{"name":"a/verifier-off","seconds":0.7},{"name":"b/verifier-on","seconds":"x"},{"seconds":3}]}"#;
        let d = durations_from_report(json);
        assert_eq!(d.len(), 1);
        assert_eq!(d["a/verifier-off"], 0.7);
        assert!(durations_from_report("not json").is_empty());
    }
}
