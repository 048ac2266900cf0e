//! The interleaving modes in a run: `vhca.interleave` read into the model's mode, and what the model saw put into
//! the result (the contended scheduling points a recording lists, the pauses taken, the race reports), once.
//!
//! A recording's list is the console's biggest line (every byte costs a TCG guest 1.5-8 us), so it goes out as a
//! table: each distinct thread, kind and site once, each point as five small numbers indexing them.

use std::sync::{mpsc, Arc, Mutex, Weak};
use std::time::Duration;

use serde_json::{json, Map, Value};
use vhca_ntmodel::interleaving::{Preemption, RaceAccess, Resumed, SchedulePoint};
use vhca_ntmodel::{InterleavingMode, NtModel, PointId, RaceReport};

use crate::report::Report;

/// PCT's depth when `pct:<seed>` names none: two change points, which PCT's authors found to find most bugs.
pub const DEFAULT_PCT_DEPTH: u32 = 3;
/// Contended points the result lists at most: a recording of a long scenario sees thousands, and every console
/// byte costs the run 1.5-8 us under TCG; the runner expands from the first ones, the count dropped says the rest.
pub const MAX_LISTED_POINTS: usize = 500;
/// The result's keys this module fills (vhca.sys's run copies them from the bugcheck sink into its own result).
pub const RESULT_KEYS: [&str; 4] = ["interleaving", "schedule", "preemptions", "races"];

/// Reads `record`, `preempt:<thread>#<k>[,<thread>#<k>]` (bound 1 or 2) or `pct:<seed>[:<depth>]`; `off` too.
pub fn parse_mode(value: &str) -> Result<InterleavingMode, String> {
    let (kind, rest) = value.split_once(':').unwrap_or((value, ""));
    match (kind, rest) {
        ("off", "") => Ok(InterleavingMode::Off),
        ("record", "") => Ok(InterleavingMode::Record),
        ("preempt", points) => {
            let ids: Option<Vec<PointId>> = points.split(',').map(PointId::parse).collect();
            match ids {
                Some(ids) if (1..=2).contains(&ids.len()) => Ok(InterleavingMode::Preempt(ids)),
                _ => Err(format!("not preempt:<thread>#<k>[,<thread>#<k>]: {value:?}")),
            }
        }
        ("pct", args) => {
            let (seed, depth) = args.split_once(':').unwrap_or((args, ""));
            let seed = seed.parse().map_err(|_| format!("not pct:<seed>[:<depth>]: {value:?}"))?;
            let depth = match depth {
                "" => DEFAULT_PCT_DEPTH,
                d => d.parse().ok().filter(|d| *d >= 1).ok_or(format!("not a depth >= 1: {d:?}"))?,
            };
            Ok(InterleavingMode::Pct { seed, depth })
        }
        _ => Err(format!("not record, preempt:<points> or pct:<seed>[:<depth>]: {value:?}")),
    }
}

/// The mode as `vhca.interleave` takes it back, so the result says how to repeat the run (a PCT run its seed).
pub fn mode_spec(mode: &InterleavingMode) -> String {
    match mode {
        InterleavingMode::Off => "off".into(),
        InterleavingMode::Record => "record".into(),
        InterleavingMode::Preempt(ids) => {
            format!("preempt:{}", ids.iter().map(PointId::to_string).collect::<Vec<_>>().join(","))
        }
        InterleavingMode::Pct { seed, depth } => format!("pct:{seed}:{depth}"),
    }
}

/// Distinct strings in order of first use, each named by its index.
#[derive(Default)]
struct Names(Vec<String>);

impl Names {
    fn index(&mut self, name: &str) -> usize {
        match self.0.iter().position(|n| n == name) {
            Some(i) => i,
            None => {
                self.0.push(name.to_string());
                self.0.len() - 1
            }
        }
    }
}

/// A recording's contended points as `schedule`: `{passed, dropped, threads, kinds, sites, points}`, each point
/// `[thread, k, kind, site, processor]` (`thread#k`, the three names by their index in their table). `passed`
/// counts every point the run passed, contended or not (the horizon the suite gives its PCT runs); `dropped` the
/// contended points past `MAX_LISTED_POINTS` (`listed`). isr-passive-synchronized as vhca.sys: 406 points were a
/// 52 KB result line as objects; 385-500 points are 8-12 KB so.
pub fn schedule_view(contended: &[SchedulePoint], passed: u64) -> Value {
    let (mut threads, mut kinds, mut sites) = (Names::default(), Names::default(), Names::default());
    let points: Vec<Value> = listed(contended)
        .into_iter()
        .map(|p| {
            let (t, kind, site) = (threads.index(&p.id.thread), kinds.index(&p.kind), sites.index(&p.site));
            json!([t, p.id.index, kind, site, p.processor])
        })
        .collect();
    json!({"passed": passed, "dropped": contended.len().saturating_sub(MAX_LISTED_POINTS),
           "threads": threads.0, "kinds": kinds.0, "sites": sites.0, "points": points})
}

/// The points listed when there are more than `MAX_LISTED_POINTS`: each thread's first ones, the threads taking
/// turns, so a thread whose points come later in the grouped list (a DPC's after the passive path's thousands, as
/// in vhca.sys's runs) is still there to be preempted and paired. In the model's order (grouped per thread).
fn listed(contended: &[SchedulePoint]) -> Vec<&SchedulePoint> {
    if contended.len() <= MAX_LISTED_POINTS {
        return contended.iter().collect();
    }
    let mut per_thread: Vec<(&str, usize)> = Vec::new();
    for p in contended {
        match per_thread.iter_mut().find(|(t, _)| *t == p.id.thread) {
            Some((_, n)) => *n += 1,
            None => per_thread.push((&p.id.thread, 1)),
        }
    }
    let mut quota = vec![0usize; per_thread.len()];
    let mut left = MAX_LISTED_POINTS;
    while left > 0 {
        for (q, (_, n)) in quota.iter_mut().zip(&per_thread) {
            if left > 0 && *q < *n {
                *q += 1;
                left -= 1;
            }
        }
    }
    let mut taken = vec![0usize; per_thread.len()];
    contended
        .iter()
        .filter(|p| {
            let i = per_thread.iter().position(|(t, _)| *t == p.id.thread).expect("counted above");
            taken[i] += 1;
            taken[i] <= quota[i]
        })
        .collect()
}

fn preemption_view(p: &Preemption) -> Value {
    let resumed = match p.resumed {
        Resumed::Quiescent => "quiescent",
        Resumed::Settled => "settled",
        Resumed::Limit => "limit",
    };
    json!({"point": p.id.to_string(), "kind": p.kind, "site": p.site, "paused_us": p.paused.as_micros() as u64,
           "resumed": resumed})
}

fn access_view(a: &RaceAccess) -> Value {
    json!({"thread": a.thread, "processor": a.processor, "access": format!("{:?}", a.access).to_lowercase(),
           "site": a.site})
}

pub fn race_view(r: &RaceReport) -> Value {
    json!({"object": r.object, "earlier": access_view(&r.earlier), "later": access_view(&r.later)})
}

/// What the model saw, as the result's details: nothing while the mode is Off (those runs pay no console bytes).
pub fn result_details(kernel: &NtModel, mode: &InterleavingMode, processors: u32) -> Map<String, Value> {
    let mut details = Map::new();
    if *mode == InterleavingMode::Off {
        return details;
    }
    details.insert("interleaving".into(), json!({"mode": mode_spec(mode), "processors": processors}));
    // Only a recording lists its points: the runner expands recordings alone, and a verbs-loopback list is 45 KB
    // of console (0.2 s under TCG) that a preempt or PCT run, costed against a seed run, need not pay.
    if *mode == InterleavingMode::Record {
        let contended: Vec<SchedulePoint> = kernel.schedule_points().into_iter().filter(|p| p.contended).collect();
        details.insert("schedule".into(), schedule_view(&contended, kernel.schedule_points_passed()));
    }
    details.insert("preemptions".into(), kernel.preemptions().iter().map(preemption_view).collect());
    details.insert("races".into(), kernel.race_reports().iter().map(race_view).collect());
    details
}

/// Puts `result_details` into the run's report.
pub fn record(kernel: &NtModel, mode: &InterleavingMode, processors: u32, report: &Mutex<Report>) {
    let details = result_details(kernel, mode, processors);
    if details.is_empty() {
        return;
    }
    let mut r = report.lock().unwrap_or_else(|e| e.into_inner());
    r.details.extend(details);
}

/// The model a bugcheck handler asks for the races found so far. The handler is made before the model (the model
/// owns it), hence set afterwards; weak, so the model's drop is not held up by its own handler.
#[derive(Default)]
pub struct BugcheckWitness {
    model: std::sync::OnceLock<(Weak<NtModel>, InterleavingMode, u32)>,
}

/// How long a bugcheck waits for the model's lists: a bugcheck raised from inside the engine could hold the lock
/// the lists need, and the STOP must go out whatever happens.
const WITNESS_WAIT: Duration = Duration::from_millis(200);

impl BugcheckWitness {
    pub fn attach(&self, kernel: &Arc<NtModel>, mode: &InterleavingMode, processors: u32) {
        if *mode != InterleavingMode::Off {
            let _ = self.model.set((Arc::downgrade(kernel), mode.clone(), processors));
        }
    }

    /// The details as far as the run got, or none when the mode is Off or the model did not answer in time.
    pub fn details(&self) -> Map<String, Value> {
        let Some((model, mode, processors)) = self.model.get() else { return Map::new() };
        let Some(kernel) = model.upgrade() else { return Map::new() };
        let (mode, processors) = (mode.clone(), *processors);
        let (sender, answer) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = sender.send(result_details(&kernel, &mode, processors));
        });
        answer.recv_timeout(WITNESS_WAIT).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spec_form_parses_and_round_trips() {
        for (text, spec) in [
            ("record", "record"),
            ("off", "off"),
            ("preempt:passive#3", "preempt:passive#3"),
            ("preempt:passive#3,dpc-1#12", "preempt:passive#3,dpc-1#12"),
            ("pct:42", "pct:42:3"),
            ("pct:7:5", "pct:7:5"),
        ] {
            let mode = parse_mode(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(mode_spec(&mode), spec);
            assert_eq!(parse_mode(spec), Ok(mode));
        }
        assert_eq!(parse_mode("pct:9"), Ok(InterleavingMode::Pct { seed: 9, depth: DEFAULT_PCT_DEPTH }));
    }

    #[test]
    fn refuses_what_is_not_a_spec() {
        for bad in [
            "",
            "recording",
            "record:1",
            "preempt:",
            "preempt:a#0",
            "preempt:a#1,b#2,c#3",
            "pct:",
            "pct:x",
            "pct:1:0",
            "preempt:a",
        ] {
            assert!(parse_mode(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn an_off_run_adds_nothing_to_the_result() {
        let kernel = NtModel::new(
            vhca_ntmodel::NtModelConfig::default(),
            Arc::new(vhca_ntmodel::HostDmaBackend::default()),
            Arc::new(vhca_ntmodel::CaptureBugchecks),
        );
        assert!(result_details(&kernel, &InterleavingMode::Off, 2).is_empty());
        let recorded = result_details(&kernel, &InterleavingMode::Record, 2);
        assert_eq!(recorded["interleaving"], json!({"mode": "record", "processors": 2}));
        for key in RESULT_KEYS {
            assert!(recorded.contains_key(key), "{key} missing from {recorded:?}");
        }
        let preempted = result_details(&kernel, &InterleavingMode::Pct { seed: 1, depth: 3 }, 2);
        assert!(!preempted.contains_key("schedule"), "only a recording lists its points");
        assert_eq!(preempted["interleaving"]["mode"], "pct:1:3", "a PCT run prints its seed");
    }

    fn seen(thread: &str, index: u32, kind: &str, site: &str) -> SchedulePoint {
        SchedulePoint {
            id: PointId { thread: thread.into(), index },
            kind: kind.into(),
            site: site.into(),
            processor: index % 2,
            contended: true,
        }
    }

    #[test]
    fn the_schedule_names_each_thread_kind_and_site_once() {
        let points = [
            seen("passive", 3, "call KeAcquireSpinLock", "cq.rs:1:1"),
            seen("dpc-1", 1, "acquire 0x10", "cq.rs:1:1"),
            seen("passive", 4, "call KeAcquireSpinLock", "ring.rs:2:2"),
        ];
        let view = schedule_view(&points, 77);
        assert_eq!(
            view,
            json!({"passed": 77, "dropped": 0, "threads": ["passive", "dpc-1"],
                   "kinds": ["call KeAcquireSpinLock", "acquire 0x10"], "sites": ["cq.rs:1:1", "ring.rs:2:2"],
                   "points": [[0, 3, 0, 0, 1], [1, 1, 1, 0, 1], [0, 4, 0, 1, 0]]})
        );
        let many: Vec<SchedulePoint> =
            (1..=MAX_LISTED_POINTS as u32 + 3).map(|k| seen("passive", k, "irql 2", "x.rs:1:1")).collect();
        let capped = schedule_view(&many, 900);
        assert_eq!(capped["points"].as_array().unwrap().len(), MAX_LISTED_POINTS);
        assert_eq!(capped["dropped"], 3);
        // A second thread's few points after the first's many are all listed; the first gives up the room.
        let mut two = many.clone();
        two.extend((1..=5).map(|k| seen("dpc-1", k, "dpc 0x10", "dpc.rs:1:1")));
        let listed = schedule_view(&two, 900);
        let points = listed["points"].as_array().unwrap();
        assert_eq!(points.len(), MAX_LISTED_POINTS);
        assert_eq!(points.iter().filter(|p| p[0] == 1).count(), 5, "every dpc-1 point is listed");
        assert_eq!(points[MAX_LISTED_POINTS - 6][1], MAX_LISTED_POINTS - 5, "passive's first ones, in order");
        assert_eq!(listed["dropped"], 8);
        // What the same points cost as the objects the guest printed before the table.
        let objects: usize = many[..MAX_LISTED_POINTS]
            .iter()
            .map(|p| {
                json!({"point": p.id.to_string(), "kind": p.kind, "site": p.site, "processor": 0}).to_string().len() + 1
            })
            .sum();
        assert!(capped.to_string().len() * 4 < objects, "the table is not a quarter of the objects' bytes");
    }

    #[test]
    fn a_bugcheck_without_a_model_or_mode_adds_nothing() {
        let witness = BugcheckWitness::default();
        assert!(witness.details().is_empty());
        let kernel = Arc::new(NtModel::new(
            vhca_ntmodel::NtModelConfig::default(),
            Arc::new(vhca_ntmodel::HostDmaBackend::default()),
            Arc::new(vhca_ntmodel::CaptureBugchecks),
        ));
        witness.attach(&kernel, &InterleavingMode::Off, 2);
        assert!(witness.details().is_empty());
        let racing = BugcheckWitness::default();
        racing.attach(&kernel, &InterleavingMode::Record, 2);
        assert_eq!(racing.details()["races"], json!([]));
    }
}
