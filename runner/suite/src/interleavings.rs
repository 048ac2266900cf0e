//! The interleaving modes' logic, shaped as the exhaustive fail points are: an entry's `interleavings` plan, the
//! recording's contended scheduling points, the runs they expand to, and the checks on each run's pauses and races.

use std::fmt;

use serde::Serialize;
use serde_json::Value;
use vhca_ntmodel::PointId;

use crate::observation::Observation;
use crate::suite::ConcreteRun;
use crate::verdict::{Outcome, Verdict};

/// Expanded runs an entry gets at most when it names no `max_interleavings`: a preempt2 expansion of a scenario's
/// few hundred contended points is tens of thousands of pairs, each a boot.
pub const DEFAULT_MAX_INTERLEAVINGS: u32 = 64;
/// What joins a concrete run's name and its preemption points in the name of the run that pauses there.
pub const INTERLEAVING_INFIX: &str = "/interleaving-";
/// What joins a concrete run's name and a PCT seed.
pub const PCT_INFIX: &str = "/pct-";
/// PCT's depth when a spec names none (the guest's default too).
pub const DEFAULT_PCT_DEPTH: u32 = 3;

/// How an entry's runs are expanded (`interleavings = "preempt1" | "preempt2" | "pct:<runs>"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Expansion {
    /// One run per contended point the recording listed, paused there (preemption bound 1).
    Preempt1,
    /// One run per pair of contended points of two different threads (bound 2).
    Preempt2,
    /// That many PCT runs, seeds 1..=runs.
    Pct { runs: u32 },
}

impl Expansion {
    pub fn parse(text: &str) -> Result<Expansion, String> {
        match text {
            "preempt1" => Ok(Expansion::Preempt1),
            "preempt2" => Ok(Expansion::Preempt2),
            _ => match text.strip_prefix("pct:").map(str::parse::<u32>) {
                Some(Ok(runs)) if runs > 0 => Ok(Expansion::Pct { runs }),
                _ => Err(format!("'{text}' is not preempt1, preempt2 or pct:<runs> (runs a count > 0)")),
            },
        }
    }
}

impl fmt::Display for Expansion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expansion::Preempt1 => f.write_str("preempt1"),
            Expansion::Preempt2 => f.write_str("preempt2"),
            Expansion::Pct { runs } => write!(f, "pct:{runs}"),
        }
    }
}

/// An entry's expansion and its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct InterleavingPlan {
    pub expansion: Expansion,
    /// Expanded runs at most (`max_interleavings`); the rest are left out, and the suite says how many.
    pub budget: u32,
}

/// A concrete run's part in the interleaving modes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RunInterleaving {
    /// The guest's processors and QEMU's vCPUs (`processors = N`); None: the defaults.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub processors: Option<u32>,
    /// The run records its contended points (`vhca.interleave=record`); the runner then expands it by this plan.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<InterleavingPlan>,
    /// An expanded run's `vhca.interleave` (what `vhca-run boot --interleaving` takes) and the run it came from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub of: Option<String>,
    /// The points a preempt run must pause at, as the recording listed them (none for a reproducer: it cannot know).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub recorded: Vec<SchedulePointSeen>,
    /// A PCT run's horizon (`vhca.pct_horizon`): the points its recording passed, so its change points fall inside
    /// the run and not past its end (the guest's default of 2000 is longer than many a scenario).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pct_horizon: Option<u32>,
}

impl RunInterleaving {
    pub fn is_default(&self) -> bool {
        *self == RunInterleaving::default()
    }

    /// The guest's `vhca.interleave` for this run, if any.
    pub fn guest_mode(&self) -> Option<String> {
        match (&self.spec, &self.plan) {
            (Some(spec), _) => Some(spec.clone()),
            (None, Some(_)) => Some("record".into()),
            (None, None) => None,
        }
    }
}

/// Which runs of a suite expand into interleaving runs (`vhca-run suite --interleavings`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterleavingsScope {
    /// The runs whose entry sets `interleavings`: what the seed suite keeps within its budget.
    Entries,
    /// Every run, preempt1 with the default budget where its entry names no plan: the sweep over every scenario.
    /// A fail-point recording keeps its own expansion (a run expands one way).
    All,
    /// None: every run once, as without the modes.
    Off,
}

impl InterleavingsScope {
    pub fn parse(text: &str) -> Result<InterleavingsScope, String> {
        match text {
            "entries" => Ok(InterleavingsScope::Entries),
            "all" => Ok(InterleavingsScope::All),
            "off" => Ok(InterleavingsScope::Off),
            _ => Err(format!("{text:?} is not entries, all or off")),
        }
    }

    pub fn apply(self, runs: &mut [ConcreteRun]) {
        for run in runs {
            match self {
                InterleavingsScope::Entries => {}
                InterleavingsScope::Off => run.interleaving.plan = None,
                InterleavingsScope::All if run.records_fail_points || run.fail_point.is_some() => {}
                InterleavingsScope::All => {
                    run.interleaving.plan.get_or_insert(InterleavingPlan {
                        expansion: Expansion::Preempt1,
                        budget: DEFAULT_MAX_INTERLEAVINGS,
                    });
                }
            }
        }
    }
}

/// Checks a spec as the guest's `vhca.interleave` reads it and names the run that uses it: `record`,
/// `preempt:<thread>#<k>[,<thread>#<k>]` (`/interleaving-<points>`) or `pct:<seed>[:<depth>]` (`/pct-<seed>`).
pub fn spec_suffix(spec: &str) -> Result<String, String> {
    let bad = || format!("'{spec}' is not record, preempt:<thread>#<k>[,<thread>#<k>] or pct:<seed>[:<depth>]");
    if spec == "record" {
        return Ok(format!("{INTERLEAVING_INFIX}record"));
    }
    if let Some(points) = spec.strip_prefix("preempt:") {
        let ids: Option<Vec<PointId>> = points.split(',').map(PointId::parse).collect();
        return match ids {
            Some(ids) if (1..=2).contains(&ids.len()) => Ok(format!("{INTERLEAVING_INFIX}{points}")),
            _ => Err(bad()),
        };
    }
    let args = spec.strip_prefix("pct:").ok_or_else(bad)?;
    let (seed, depth) = args.split_once(':').unwrap_or((args, ""));
    let seed: u64 = seed.parse().map_err(|_| bad())?;
    match depth {
        "" => Ok(format!("{PCT_INFIX}{seed}")),
        d => match d.parse::<u32>() {
            Ok(d) if d == DEFAULT_PCT_DEPTH => Ok(format!("{PCT_INFIX}{seed}")),
            Ok(d) if d >= 1 => Ok(format!("{PCT_INFIX}{seed}-depth-{d}")),
            _ => Err(bad()),
        },
    }
}

impl ConcreteRun {
    /// This run under one interleaving spec (checked by `spec_suffix`), named after it, recording nothing itself.
    pub fn with_interleaving(&self, spec: &str) -> Result<ConcreteRun, String> {
        let suffix = spec_suffix(spec)?;
        let interleaving = RunInterleaving {
            processors: self.interleaving.processors,
            plan: None,
            spec: Some(spec.to_string()),
            of: Some(self.name.clone()),
            recorded: Vec::new(),
            pct_horizon: None,
        };
        Ok(ConcreteRun {
            name: format!("{}{suffix}", self.name),
            run: format!("{}{suffix}", self.run),
            records_fail_points: false,
            interleaving,
            ..self.clone()
        })
    }
}

/// A contended scheduling point as the guest listed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SchedulePointSeen {
    /// `thread#k`.
    pub point: String,
    pub kind: String,
    pub site: String,
    pub processor: u32,
}

impl SchedulePointSeen {
    fn thread(&self) -> &str {
        self.point.rsplit_once('#').map_or(self.point.as_str(), |(t, _)| t)
    }
}

impl fmt::Display for SchedulePointSeen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}", self.point, self.kind)?;
        if !self.site.is_empty() {
            write!(f, " at {}", self.site)?;
        }
        write!(f, ", processor {})", self.processor)
    }
}

/// One side of a reported race.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RaceSide {
    pub thread: String,
    pub processor: u32,
    pub access: String,
    pub site: String,
}

/// A race the guest's detector reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RaceSeen {
    pub object: String,
    pub earlier: RaceSide,
    pub later: RaceSide,
}

impl RaceSeen {
    /// The object or one of the two sites contains `word` (what `expect = "race WORD"` asks).
    pub fn mentions(&self, word: &str) -> bool {
        [&self.object, &self.earlier.site, &self.later.site].iter().any(|t| t.contains(word))
    }
}

impl fmt::Display for RaceSide {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let site = if self.site.is_empty() { "an unknown site" } else { self.site.as_str() };
        write!(f, "{} {} on processor {} at {site}", self.thread, self.access, self.processor)
    }
}

impl fmt::Display for RaceSeen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "race on {}: {}, then {}", self.object, self.earlier, self.later)
    }
}

fn details<'a>(o: &'a Observation, key: &str) -> Option<&'a Value> {
    o.guest_result.as_ref().and_then(|r| r.get("details")).and_then(|d| d.get(key))
}

fn list<'a>(o: &'a Observation, key: &str) -> &'a [Value] {
    details(o, key).and_then(Value::as_array).map_or(&[], Vec::as_slice)
}

fn text(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_string)
}

fn number(v: &Value, key: &str) -> Option<u32> {
    v.get(key).and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok())
}

/// The recording's `schedule` table: `{passed, dropped, threads, kinds, sites, points}`, each point
/// `[thread, k, kind, site, processor]` with the three names as indexes into their tables (the guest prints it so
/// to keep its console short: vhca-guest's interleaving.rs, `schedule_view`).
fn schedule(o: &Observation) -> Option<&Value> {
    details(o, "schedule")
}

/// The contended points the recording listed, in order; entries that do not read are skipped (guest output is
/// untrusted: an index past its table, a name that is not `thread#k`).
pub fn schedule_points(o: &Observation) -> Vec<SchedulePointSeen> {
    let Some(table) = schedule(o) else { return Vec::new() };
    let names = |key: &str| table.get(key).and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    let (threads, kinds, sites) = (names("threads"), names("kinds"), names("sites"));
    let name = |names: &[Value], at: Option<&Value>| {
        let i = usize::try_from(at?.as_u64()?).ok()?;
        names.get(i)?.as_str().map(str::to_string)
    };
    names("points")
        .iter()
        .filter_map(|p| {
            let p = p.as_array()?;
            let index = p.get(1)?.as_u64().filter(|k| *k > 0)?;
            let point = format!("{}#{index}", name(threads, p.get(0))?);
            PointId::parse(&point)?;
            Some(SchedulePointSeen {
                point,
                kind: name(kinds, p.get(2))?,
                site: name(sites, p.get(3))?,
                processor: p.get(4)?.as_u64().and_then(|n| u32::try_from(n).ok())?,
            })
        })
        .collect()
}

/// Contended points the guest left out of its list (it lists 500 at most).
pub fn schedule_points_dropped(o: &Observation) -> u64 {
    schedule(o).and_then(|t| t.get("dropped")).and_then(Value::as_u64).unwrap_or(0)
}

/// Every point the recording passed, contended or not (0 when it did not say): its PCT runs' horizon.
pub fn schedule_points_passed(o: &Observation) -> u64 {
    schedule(o).and_then(|t| t.get("passed")).and_then(Value::as_u64).unwrap_or(0)
}

/// The points a run paused at, with the kind and site the guest saw there.
fn preempted_points(o: &Observation) -> Vec<(String, String, String)> {
    list(o, "preemptions")
        .iter()
        .filter_map(|p| {
            Some((text(p, "point")?, text(p, "kind").unwrap_or_default(), text(p, "site").unwrap_or_default()))
        })
        .collect()
}

fn side(v: Option<&Value>) -> Option<RaceSide> {
    let v = v?;
    Some(RaceSide {
        thread: text(v, "thread")?,
        processor: number(v, "processor")?,
        access: text(v, "access")?,
        site: text(v, "site").unwrap_or_default(),
    })
}

/// The races the guest reported (on a bugcheck too: its result line lists those found before the stop).
pub fn races(o: &Observation) -> Vec<RaceSeen> {
    list(o, "races")
        .iter()
        .filter_map(|r| {
            Some(RaceSeen {
                object: text(r, "object")?,
                earlier: side(r.get("earlier"))?,
                later: side(r.get("later"))?,
            })
        })
        .collect()
}

/// What a recording expanded to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Expanded {
    pub runs: Vec<ConcreteRun>,
    /// Schedule choices the budget left out.
    pub left_out: usize,
}

/// `count` indexes out of `0..total`, evenly spaced (all when they fit): deterministic, so the same recording
/// always expands to the same runs, and spread over the whole run rather than its first points.
fn evenly_spaced(total: usize, count: usize) -> Vec<usize> {
    if total <= count {
        return (0..total).collect();
    }
    (0..count).map(|i| i * total / count).collect()
}

/// Threads whose number of points follows the host's timing, not the driver: the model's interrupt delivery calls
/// the ISR once per read of the vector's eventfd, and messages that arrive before a read are one call (as an APIC
/// latches one pending interrupt per vector), so a run makes as many ISR calls, and DPC runs, as the timing gives.
/// A recording that made 29 ISR calls listed `msix-interrupts#189`; a preempted run of the same scenario made 18
/// calls, never came to #189, and failed for it.
const TIMING_COUNTED_THREADS: [&str; 2] = ["msix-interrupts", "dpc-"];

/// How far along a timing-counted thread a preemption may be chosen: its points up to this share of the highest one
/// the recording listed, a margin of three times as many ISR calls coalesced as in that recording.
const TIMING_COUNTED_REACH: u32 = 3;

/// The points a run can be sure to meet again: all of every thread's, but a timing-counted thread's only within
/// the first third of its recorded reach (its first point always: a bug entry's one run preempts the first point).
pub fn reachable_points(points: &[SchedulePointSeen]) -> Vec<SchedulePointSeen> {
    let ordinal = |p: &SchedulePointSeen| p.point.rsplit_once('#').and_then(|(_, k)| k.parse::<u32>().ok());
    let timing_counted = |p: &SchedulePointSeen| TIMING_COUNTED_THREADS.iter().any(|t| p.thread().starts_with(t));
    let reach = |thread: &str| points.iter().filter(|p| p.thread() == thread).filter_map(ordinal).max().unwrap_or(0);
    let first = |thread: &str| points.iter().filter(|p| p.thread() == thread).filter_map(ordinal).min().unwrap_or(0);
    points
        .iter()
        .filter(|p| {
            !timing_counted(p)
                || ordinal(p).is_some_and(|k| k == first(p.thread()) || k <= reach(p.thread()) / TIMING_COUNTED_REACH)
        })
        .cloned()
        .collect()
}

/// The runs a recording run expands to by its plan, each knowing the points it must pause at; `passed` is every
/// point the recording passed (`schedule_points_passed`), each PCT run's horizon (0: the guest's default).
pub fn expand_interleavings(run: &ConcreteRun, points: &[SchedulePointSeen], passed: u64) -> Expanded {
    let Some(plan) = run.interleaving.plan else { return Expanded::default() };
    let budget = plan.budget as usize;
    let all = points;
    let reachable = reachable_points(points);
    let points = reachable.as_slice();
    let choices: Vec<Vec<&SchedulePointSeen>> = match plan.expansion {
        Expansion::Pct { runs } => {
            let seeds = evenly_spaced(runs as usize, budget).into_iter().map(|i| i as u64 + 1);
            let horizon = u32::try_from(passed).ok().filter(|n| *n > 0);
            let runs: Vec<ConcreteRun> = seeds
                .filter_map(|seed| {
                    let mut pct = run.with_interleaving(&format!("pct:{seed}")).ok()?;
                    pct.interleaving.pct_horizon = horizon;
                    Some(pct)
                })
                .collect();
            return Expanded { left_out: plan_total(plan.expansion, points) - runs.len(), runs };
        }
        Expansion::Preempt1 => points.iter().map(|p| vec![p]).collect(),
        Expansion::Preempt2 => {
            let mut pairs = Vec::new();
            for (i, a) in points.iter().enumerate() {
                for b in &points[i + 1..] {
                    if a.thread() != b.thread() {
                        pairs.push(vec![a, b]);
                    }
                }
            }
            pairs
        }
    };
    // Points a replay may not meet are left out too, and counted so.
    let unreachable = plan_total(plan.expansion, all) - plan_total(plan.expansion, points);
    let chosen = evenly_spaced(choices.len(), budget);
    let runs: Vec<ConcreteRun> = chosen
        .iter()
        .filter_map(|&i| {
            let chosen = &choices[i];
            let spec = format!("preempt:{}", chosen.iter().map(|p| p.point.as_str()).collect::<Vec<_>>().join(","));
            let mut expanded = run.with_interleaving(&spec).ok()?;
            expanded.interleaving.recorded = chosen.iter().map(|p| (*p).clone()).collect();
            Some(expanded)
        })
        .collect();
    Expanded { left_out: choices.len() - runs.len() + unreachable, runs }
}

fn plan_total(expansion: Expansion, points: &[SchedulePointSeen]) -> usize {
    match expansion {
        Expansion::Pct { runs } => runs as usize,
        Expansion::Preempt1 => points.len(),
        Expansion::Preempt2 => points
            .iter()
            .enumerate()
            .map(|(i, a)| points[i + 1..].iter().filter(|b| a.thread() != b.thread()).count())
            .sum(),
    }
}

/// The points of its recording a preempt run never paused at, on the timing-counted threads only (the ISR's and
/// the DPCs'), as `judge_interleaving` names them; empty when it reached them all or is no preempt run. Such a run
/// did not meet the schedule it names because the host coalesced interrupts, not because the driver went
/// elsewhere: the runner runs it once more (`suite_run::one_run`).
pub fn unreached_timing_counted_points(run: &ConcreteRun, o: &Observation) -> Vec<String> {
    let paused = preempted_points(o);
    run.interleaving
        .recorded
        .iter()
        .filter(|p| TIMING_COUNTED_THREADS.iter().any(|t| p.thread().starts_with(t)))
        .filter(|p| !paused.iter().any(|(id, _, _)| *id == p.point))
        .map(|p| p.to_string())
        .collect()
}

/// Fails a preempt run that never paused at a point its recording listed (the schedule under test was not the
/// one named), as a fail-point run that never reached its point fails. A run that failed anyway keeps its reason.
pub fn judge_interleaving(run: &ConcreteRun, o: &Observation, verdict: &mut Verdict) {
    if run.interleaving.recorded.is_empty() {
        return;
    }
    let paused = preempted_points(o);
    // A thread's k-th point can be another call than in the recording (a poll loop ran once more): the run still
    // paused there, so it stands, and the note says what it paused at instead.
    for p in &run.interleaving.recorded {
        if let Some((_, kind, site)) =
            paused.iter().find(|(id, kind, site)| *id == p.point && (*kind != p.kind || *site != p.site))
        {
            verdict.notes.push(format!("paused at {} ({kind} at {site}); the recording saw {p} there", p.point));
        }
    }
    let missed: Vec<String> = run
        .interleaving
        .recorded
        .iter()
        .filter(|p| !paused.iter().any(|(id, _, _)| *id == p.point))
        .map(|p| p.to_string())
        .collect();
    if missed.is_empty() {
        return;
    }
    let what = format!("preemption point(s) the recording listed but the run never reached: {}", missed.join("; "));
    match &verdict.outcome {
        Outcome::Pass => verdict.outcome = Outcome::Fail { reason: what },
        Outcome::Fail { .. } => verdict.notes.push(what),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::suite::Suite;
    use crate::verdict::judge_run;
    use serde_json::json;

    fn recording(plan: &str) -> ConcreteRun {
        let text = format!(
            "name = \"t\"\n[[run]]\nname = \"v\"\nmodes = [\"on\"]\ninterleavings = \"{plan}\"\nmax_interleavings = 3\n\
             processors = 4\nexpect = \"pass\"\n"
        );
        Suite::parse(&text, "t.toml").unwrap().expand().remove(0)
    }

    /// A recording's `schedule` table listing `ids` (`thread#k`), every one a KeAcquireSpinLock call at cq.rs:1:1.
    fn schedule_of(ids: &[&str], passed: u64) -> Value {
        let mut threads: Vec<&str> = Vec::new();
        let points: Vec<Value> = ids
            .iter()
            .map(|id| {
                let (thread, k) = id.rsplit_once('#').unwrap();
                if !threads.contains(&thread) {
                    threads.push(thread);
                }
                let t = threads.iter().position(|x| *x == thread).unwrap();
                json!([t, k.parse::<u64>().unwrap(), 0, 0, 1])
            })
            .collect();
        json!({"passed": passed, "dropped": 0, "threads": threads, "kinds": ["call KeAcquireSpinLock"],
               "sites": ["cq.rs:1:1"], "points": points})
    }

    fn observed(details: Value) -> Observation {
        Observation { guest_result: Some(json!({"ok": true, "details": details})), ..Observation::default() }
    }

    #[test]
    fn plans_parse_strictly() {
        assert_eq!(Expansion::parse("preempt1"), Ok(Expansion::Preempt1));
        assert_eq!(Expansion::parse("pct:8"), Ok(Expansion::Pct { runs: 8 }));
        for bad in ["preempt3", "pct:0", "pct:", "pct:x", "PREEMPT1", ""] {
            assert!(Expansion::parse(bad).is_err(), "{bad:?}");
        }
        for e in [Expansion::Preempt1, Expansion::Preempt2, Expansion::Pct { runs: 2 }] {
            assert_eq!(Expansion::parse(&e.to_string()), Ok(e));
        }
    }

    #[test]
    fn specs_name_their_runs_and_bad_ones_are_refused() {
        assert_eq!(spec_suffix("preempt:passive#3").unwrap(), "/interleaving-passive#3");
        assert_eq!(spec_suffix("preempt:passive#3,dpc-0#1").unwrap(), "/interleaving-passive#3,dpc-0#1");
        assert_eq!(spec_suffix("pct:7").unwrap(), "/pct-7");
        assert_eq!(spec_suffix("pct:7:3").unwrap(), "/pct-7");
        assert_eq!(spec_suffix("pct:7:5").unwrap(), "/pct-7-depth-5");
        assert_eq!(spec_suffix("record").unwrap(), "/interleaving-record");
        for bad in ["", "preempt:", "preempt:a", "preempt:a#0", "preempt:a#1,b#2,c#3", "pct:x", "pct:1:0", "off"] {
            assert!(spec_suffix(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_recording_run_asks_the_guest_to_record_on_its_processors() {
        let run = recording("preempt1");
        let words: Vec<String> = run.guest_params().iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert!(words.contains(&"vhca.interleave=record".to_string()), "{words:?}");
        assert!(words.contains(&"vhca.processors=4".to_string()), "{words:?}");
    }

    #[test]
    fn preempt1_expands_one_run_per_point_within_the_budget() {
        let mut table = schedule_of(&["passive#1", "dpc-0#2", "passive#5", "passive#9"], 40);
        let listed = table["points"].as_array_mut().unwrap();
        for junk in [json!([0, 3, 9, 0, 1]), json!([0, 0, 0, 0, 1]), json!([7, 3, 0, 0, 1]), json!("passive#4")] {
            listed.insert(1, junk);
        }
        let o = observed(json!({ "schedule": table }));
        let points = schedule_points(&o);
        assert_eq!(points.len(), 4, "the junk entries are skipped: {points:?}");
        assert_eq!(points[1].to_string(), "dpc-0#2 (call KeAcquireSpinLock at cq.rs:1:1, processor 1)");
        assert_eq!(schedule_points_passed(&o), 40);
        let expanded = expand_interleavings(&recording("preempt1"), &points, 40);
        let names: Vec<&str> = expanded.runs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "v/verifier-on/interleaving-passive#1",
                "v/verifier-on/interleaving-dpc-0#2",
                "v/verifier-on/interleaving-passive#5"
            ]
        );
        assert_eq!(expanded.left_out, 1);
        let first = &expanded.runs[0];
        let words: Vec<String> = first.guest_params().iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert!(words.contains(&"vhca.interleave=preempt:passive#1".to_string()), "{words:?}");
        assert!(words.contains(&"vhca.processors=4".to_string()), "an expanded run keeps the entry's processors");
        assert!(expand_interleavings(first, &points, 40).runs.is_empty(), "an expanded run expands to nothing");
        assert_eq!(first.interleaving.pct_horizon, None, "a preempt run has no horizon to pass");
    }

    #[test]
    fn a_timing_counted_thread_is_preempted_only_where_a_replay_surely_comes() {
        // The ISR's thread listed up to #190 (29 ISR calls); a replay that coalesces more messages makes fewer.
        let listed = ["main#3", "main#40", "msix-interrupts#11", "msix-interrupts#63", "msix-interrupts#64"];
        let listed: Vec<&str> = listed.into_iter().chain(["msix-interrupts#190", "dpc-1#2", "dpc-1#30"]).collect();
        let points = schedule_points(&observed(json!({ "schedule": schedule_of(&listed, 300) })));
        let reachable: Vec<String> = reachable_points(&points).into_iter().map(|p| p.point).collect();
        assert_eq!(
            reachable,
            ["main#3", "main#40", "msix-interrupts#11", "msix-interrupts#63", "dpc-1#2"],
            "a timing-counted thread keeps its first point and those within a third of its reach; main keeps all"
        );
        // Budget 3 of the 5 reachable; the three out of reach count as left out too.
        let expanded = expand_interleavings(&recording("preempt1"), &points, 300);
        let specs: Vec<&str> = expanded.runs.iter().map(|r| r.interleaving.spec.as_deref().unwrap()).collect();
        assert_eq!(specs, ["preempt:main#3", "preempt:main#40", "preempt:msix-interrupts#63"]);
        assert_eq!(expanded.left_out, 2 + 3);
    }

    #[test]
    fn preempt2_pairs_points_of_two_threads_evenly_over_the_list() {
        let points: Vec<SchedulePointSeen> =
            schedule_points(&observed(json!({ "schedule": schedule_of(&["a#1", "a#2", "b#1", "c#1"], 9) })));
        // Pairs of different threads: a1-b1 a1-c1 a2-b1 a2-c1 b1-c1 (a1-a2 is one thread's).
        let expanded = expand_interleavings(&recording("preempt2"), &points, 9);
        let specs: Vec<&str> = expanded.runs.iter().map(|r| r.interleaving.spec.as_deref().unwrap()).collect();
        assert_eq!(specs, ["preempt:a#1,b#1", "preempt:a#1,c#1", "preempt:a#2,c#1"]);
        assert_eq!(expanded.left_out, 2);
        assert_eq!(expanded.runs[2].interleaving.recorded.len(), 2);
    }

    #[test]
    fn the_scope_turns_expansion_on_everywhere_or_off() {
        let text =
            "name = \"t\"\n[[run]]\nname = \"p\"\nmodes = [\"on\"]\ninterleavings = \"pct:2\"\nexpect = \"pass\"\n\
                    [[run]]\nname = \"q\"\nexpect = \"pass\"\n";
        let runs = Suite::parse(text, "t.toml").unwrap().expand();
        let plans = |scope: InterleavingsScope| {
            let mut runs = runs.clone();
            scope.apply(&mut runs);
            runs.iter().map(|r| r.interleaving.plan.map(|p| p.expansion.to_string())).collect::<Vec<_>>()
        };
        assert_eq!(plans(InterleavingsScope::Entries), [Some("pct:2".to_string()), None, None]);
        assert_eq!(
            plans(InterleavingsScope::All),
            [Some("pct:2".to_string()), Some("preempt1".into()), Some("preempt1".into())]
        );
        assert_eq!(plans(InterleavingsScope::Off), [None, None, None]);
        assert!(InterleavingsScope::parse("some").is_err());
    }

    #[test]
    fn pct_runs_take_seeds_from_one() {
        let expanded = expand_interleavings(&recording("pct:2"), &[], 0);
        let names: Vec<&str> = expanded.runs.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["v/verifier-on/pct-1", "v/verifier-on/pct-2"]);
        assert_eq!(expanded.left_out, 0);
        assert_eq!(expanded.runs[1].interleaving.of.as_deref(), Some("v/verifier-on"));
        let words = expanded.runs[0].guest_params();
        assert!(!words.iter().any(|(k, _)| k == "vhca.pct_horizon"), "no count recorded: the guest's default");
    }

    /// A short scenario passes fewer points than the guest's default horizon: its PCT runs must be told how many,
    /// or most of their change points fall past the run's end and it never pauses.
    #[test]
    fn pct_runs_take_the_recording_s_point_count_as_their_horizon() {
        let o = observed(json!({ "schedule": schedule_of(&["passive#1"], 340) }));
        let expanded = expand_interleavings(&recording("pct:2"), &schedule_points(&o), schedule_points_passed(&o));
        for run in &expanded.runs {
            let words: Vec<String> = run.guest_params().iter().map(|(k, v)| format!("{k}={v}")).collect();
            assert!(words.contains(&"vhca.pct_horizon=340".to_string()), "{words:?}");
            assert!(words.contains(&format!("vhca.interleave={}", run.interleaving.spec.as_deref().unwrap())));
        }
    }

    #[test]
    fn a_preempt_run_that_never_paused_at_its_point_fails() {
        let points = schedule_points(&observed(json!({ "schedule": schedule_of(&["passive#1"], 5) })));
        let run = expand_interleavings(&recording("preempt1"), &points, 5).runs.remove(0);
        let judged = |details: Value| {
            let o = observed(details);
            let mut v = judge_run(&run, &o);
            judge_interleaving(&run, &o, &mut v);
            v
        };
        let paused = json!({"preemptions": [{"point": "passive#1", "kind": "k", "site": "", "paused_us": 20000,
                                             "resumed": "settled"}]});
        assert!(judged(paused).outcome.passed());
        let missed = judged(json!({"preemptions": []}));
        match missed.outcome {
            Outcome::Fail { reason } => assert!(reason.contains("never reached: passive#1"), "{reason}"),
            Outcome::Pass => panic!("a run that never paused passed"),
        }
        assert!(
            unreached_timing_counted_points(&run, &observed(json!({"preemptions": []}))).is_empty(),
            "a passive thread's point missed is the driver's path, not the host's timing: no second attempt"
        );
    }

    #[test]
    fn an_isr_point_never_reached_is_named_for_a_second_attempt() {
        let points = schedule_points(&observed(json!({ "schedule": schedule_of(&["msix-interrupts#11"], 5) })));
        let run = expand_interleavings(&recording("preempt1"), &points, 5).runs.remove(0);
        let missed = unreached_timing_counted_points(&run, &observed(json!({"preemptions": []})));
        assert_eq!(missed, ["msix-interrupts#11 (call KeAcquireSpinLock at cq.rs:1:1, processor 1)"]);
        let paused = json!({"preemptions": [{"point": "msix-interrupts#11", "kind": "k", "site": "",
                                             "paused_us": 20000, "resumed": "settled"}]});
        assert!(unreached_timing_counted_points(&run, &observed(paused)).is_empty());
        let plain = recording("preempt1");
        assert!(unreached_timing_counted_points(&plain, &observed(json!({}))).is_empty(), "a recording run");
    }

    fn raced(ok: bool) -> Observation {
        let race = json!({"object": "memory 0x1000+0x40",
            "earlier": {"thread": "passive", "processor": 0, "access": "free", "site": "cq.rs:10:5"},
            "later": {"thread": "dpc-1", "processor": 1, "access": "read", "site": "dpc.rs:3:9"}});
        Observation {
            guest_result: Some(json!({"ok": ok, "error": "e", "details": {"races": [race]}})),
            ..Observation::default()
        }
    }

    fn outcome(expect: &str, o: &Observation) -> Outcome {
        crate::verdict::judge(&crate::expect::Expected::parse(expect).unwrap(), o).outcome
    }

    #[test]
    fn a_race_fails_every_expectation_but_race_and_names_both_sites() {
        match outcome("pass", &raced(true)) {
            Outcome::Fail { reason } => {
                assert!(reason.contains("cq.rs:10:5") && reason.contains("dpc.rs:3:9"), "{reason}")
            }
            Outcome::Pass => panic!("a reported race passed a pass expectation"),
        }
        assert!(!outcome("guest-failed", &raced(false)).passed());
        assert!(outcome("race", &raced(true)).passed());
        assert!(outcome("race", &raced(false)).passed(), "a run that reported a race and then failed");
        assert!(outcome("race dpc.rs", &raced(true)).passed());
        assert!(!outcome("race mdl", &raced(true)).passed(), "no report names the word");
        assert!(!outcome("race", &observed(json!({}))).passed(), "no race reported");
        // The run stopped on a bugcheck after the detector reported: its result line still lists the race.
        let stopped = Observation {
            bugchecks: vec![crate::stop_line::Bugcheck { code: 0xE6, params: vec![0x26, 0, 0, 0], name: None }],
            ..raced(false)
        };
        assert!(outcome("race", &stopped).passed(), "a race, then the bugcheck it caused");
        match outcome("bugcheck 0xE6 0x26 0x0 0x0 0x0", &stopped) {
            Outcome::Fail { reason } => {
                assert!(reason.contains("cq.rs:10:5") && reason.contains("dpc.rs:3:9"), "{reason}")
            }
            Outcome::Pass => panic!("a bugcheck expectation passed a run that reported a race"),
        }
        assert!(outcome("pass", &observed(json!({"races": []}))).passed());
    }

    #[test]
    fn races_read_from_the_result_and_junk_is_skipped() {
        let o = observed(json!({"races": [
            {"object": "memory 0x1000+0x40", "earlier": {"thread": "passive", "processor": 0, "access": "write",
             "site": "cq.rs:10:5"}, "later": {"thread": "dpc-1", "processor": 1, "access": "read", "site": "dpc.rs:3:9"}},
            {"object": "x"}
        ]}));
        let races = races(&o);
        assert_eq!(races.len(), 1);
        assert_eq!(
            races[0].to_string(),
            "race on memory 0x1000+0x40: passive write on processor 0 at cq.rs:10:5, then dpc-1 read on processor 1 \
             at dpc.rs:3:9"
        );
        assert!(races[0].mentions("dpc.rs") && races[0].mentions("memory") && !races[0].mentions("mdl"));
    }
}
