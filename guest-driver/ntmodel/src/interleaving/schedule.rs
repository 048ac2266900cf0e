//! The schedule: every point per thread (bounded), which of them pause the thread that reaches them (the
//! preemption list or the PCT change points), and the pauses taken.
//!
//! The log keeps at most MAX_POINTS points per run, then only counts them: a long run (a soak, a suite entry with
//! many requests) passes millions of points, and a bounded mode expands only the early contended ones anyway.

use std::collections::HashSet;

use super::{InterleavingMode, PointId, Preemption, SchedulePoint};

/// The most points one run lists.
pub(crate) const MAX_POINTS: usize = 100_000;

/// Which points pause the thread that reaches them.
enum Plan {
    None,
    /// By name: the bounded modes.
    Points(HashSet<PointId>),
    /// By global number (the order threads reach points in, from 1): the PCT change points.
    Global(Vec<u64>),
}

pub(crate) struct Schedule {
    plan: Plan,
    points: Vec<SchedulePoint>,
    /// Points passed past MAX_POINTS.
    dropped: u64,
    /// Points passed by every thread so far.
    global: u64,
    pub preemptions: Vec<Preemption>,
}

impl Schedule {
    pub fn new(mode: &InterleavingMode, pct_horizon: u32) -> Schedule {
        let plan = match mode {
            InterleavingMode::Off | InterleavingMode::Record => Plan::None,
            InterleavingMode::Preempt(ids) => Plan::Points(ids.iter().cloned().collect()),
            InterleavingMode::Pct { seed, depth } => {
                Plan::Global(super::pct::change_points(*seed, *depth, pct_horizon))
            }
        };
        Schedule { plan, points: Vec::new(), dropped: 0, global: 0, preemptions: Vec::new() }
    }

    /// Logs one point; the point again when the thread is to pause there (a copy only then: a recording passes
    /// tens of thousands).
    pub fn pass(&mut self, point: SchedulePoint) -> Option<SchedulePoint> {
        self.global += 1;
        let pause = match &self.plan {
            Plan::None => false,
            Plan::Points(ids) => ids.contains(&point.id),
            Plan::Global(change) => change.binary_search(&self.global).is_ok(),
        };
        let paused = pause.then(|| point.clone());
        if self.points.len() < MAX_POINTS {
            self.points.push(point);
        } else {
            self.dropped += 1;
        }
        paused
    }

    /// Every point logged, grouped per thread in the order of each thread's first point, each thread's in order.
    pub fn points(&self) -> Vec<SchedulePoint> {
        let mut order: Vec<&str> = Vec::new();
        for p in &self.points {
            if !order.contains(&p.id.thread.as_str()) {
                order.push(&p.id.thread);
            }
        }
        order.iter().flat_map(|t| self.points.iter().filter(move |p| p.id.thread == *t)).cloned().collect()
    }

    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    pub fn passed(&self) -> u64 {
        self.global
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interleaving::DEFAULT_HORIZON;

    fn point(k: u32) -> SchedulePoint {
        let id = PointId { thread: "passive".into(), index: k };
        SchedulePoint { id, kind: "irql 2".into(), site: String::new(), processor: 0, contended: true }
    }

    fn pauses(schedule: &mut Schedule, points: u32) -> usize {
        (1..=points).filter(|k| schedule.pass(point(*k)).is_some()).count()
    }

    /// A run of 50 points: with the horizon it passed, every PCT seed pauses it twice (depth 3); drawn among the
    /// default 2000, most seeds pause it not at all, so a horizon the schedule ignored fails the first count.
    #[test]
    fn pct_change_points_fall_inside_a_short_run_given_its_horizon() {
        let mode = |seed| InterleavingMode::Pct { seed, depth: 3 };
        for seed in 1..=20 {
            let mut schedule = Schedule::new(&mode(seed), 50);
            assert_eq!(pauses(&mut schedule, 50), 2, "seed {seed}");
            assert_eq!(schedule.passed(), 50);
        }
        let default: usize = (1..=20).map(|seed| pauses(&mut Schedule::new(&mode(seed), DEFAULT_HORIZON), 50)).sum();
        assert!(default < 10, "the default horizon paused a 50-point run {default} times in 20 seeds");
    }
}
