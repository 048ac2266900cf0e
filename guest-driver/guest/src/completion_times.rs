//! When the native driver's ISR and DPC ran (`vhca.completion=interrupt`): the first few hundred of each on this
//! program's clock, for the result line's `completion_times` and so the runner's timeline.
//!
//! Why only the first `KEPT`: the result line is one console line, and a run's first interrupts are where its
//! story is (bring-up, the first CQEs); every later run is still counted, as untimed.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use vhca_driver_core::RoutineObserver;

use crate::report::CompletionTimesView;

/// Runs of each routine timed; the rest are counted.
pub const KEPT: usize = 256;

/// The driver's interrupt path routines this records: the driver core's own, as its observer reports them.
pub use vhca_driver_core::PathRoutine;

#[derive(Debug, Default)]
struct Kept {
    times: Vec<Instant>,
    untimed: u64,
}

impl Kept {
    fn push(&mut self, at: Instant) {
        if self.times.len() < KEPT {
            self.times.push(at);
        } else {
            self.untimed += 1;
        }
    }
}

/// Shared by whatever runs the routines (the interrupt thread the NT model runs the ISR on, the DPC), through the driver core's
/// `RoutineObserver` (`observer`): each call is one run, now.
#[derive(Debug, Default)]
pub struct CompletionTimes {
    isr: Mutex<Kept>,
    dpc: Mutex<Kept>,
}

impl CompletionTimes {
    /// `routine` ran now. Cheap: one clock read and a push under an uncontended lock.
    pub fn ran(&self, routine: PathRoutine) {
        self.ran_at(routine, Instant::now());
    }

    /// `routine` ran at `at`: for a caller that reads the clock before it knows whether the routine ran (the
    /// model's `deliver` says afterwards whether an ISR was connected).
    pub fn ran_at(&self, routine: PathRoutine, at: Instant) {
        let kept = match routine {
            PathRoutine::Isr => &self.isr,
            PathRoutine::Dpc => &self.dpc,
        };
        kept.lock().unwrap_or_else(|e| e.into_inner()).push(at);
    }

    /// The driver core's observer (`CompletionWaits::connect`), recording into `self`. It runs at the
    /// model's DIRQL and DISPATCH_LEVEL, which are this program's threads: a clock read and a push under a lock
    /// only these records take, held for no wait, so the routines it times never wait behind the control path.
    pub fn observer(self: &Arc<Self>) -> RoutineObserver {
        let times = self.clone();
        Arc::new(move |routine| times.ran(routine))
    }

    /// What the result line carries (its times are written relative to the line's own writing).
    pub fn view(&self) -> CompletionTimesView {
        let take = |k: &Mutex<Kept>| {
            let k = k.lock().unwrap_or_else(|e| e.into_inner());
            (k.times.clone(), k.untimed)
        };
        let ((isr, isr_untimed), (dpc, dpc_untimed)) = (take(&self.isr), take(&self.dpc));
        CompletionTimesView { isr, dpc, isr_untimed, dpc_untimed }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_runs_are_timed_and_the_rest_counted() {
        let times = CompletionTimes::default();
        for _ in 0..KEPT + 3 {
            times.ran(PathRoutine::Isr);
        }
        let earlier = Instant::now();
        times.ran(PathRoutine::Dpc);
        times.ran_at(PathRoutine::Dpc, earlier);
        let view = times.view();
        assert_eq!((view.isr.len(), view.isr_untimed), (KEPT, 3));
        assert_eq!((view.dpc.len(), view.dpc_untimed), (2, 0));
        assert_eq!(view.dpc[1], earlier, "kept as given");
        assert!(view.isr.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn the_observer_records_each_routine_in_its_own_lane() {
        let times = Arc::new(CompletionTimes::default());
        let observer = times.observer();
        observer(PathRoutine::Dpc);
        observer(PathRoutine::Isr);
        observer(PathRoutine::Dpc);
        let view = times.view();
        assert_eq!((view.isr.len(), view.dpc.len()), (1, 2));
    }
}
