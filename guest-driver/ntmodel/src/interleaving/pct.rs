//! The PCT-style mode's change points: `depth - 1` global point numbers drawn from a seed, at which the thread
//! that reaches them pauses as a preemption does.
//!
//! Burckhardt et al.'s PCT (ASPLOS 2010) gives every thread a strict random priority, runs only the highest one
//! and lowers a thread's priority at each change point. The model's threads are free OS threads that the engine
//! cannot hold back one by one, so only the change points are scheduled here: the thread at one pauses until the
//! others are quiescent or settle. PCT's probability bound (1/(n·k^(d-1))) does not carry over; the seed still
//! names one schedule choice a later run takes again.

use crate::low_resources::splitmix64;

/// How many global points the change points are drawn among when the configuration says nothing: a seed
/// scenario's passive path takes a few hundred to a few thousand points.
pub const DEFAULT_HORIZON: u32 = 2000;

/// The change points for `seed` and `depth`: `depth - 1` distinct global point numbers (counted from 1 in the
/// order threads reach points) in `1..=horizon`, ascending. The same seed gives the same points in every run and
/// on every host.
pub fn change_points(seed: u64, depth: u32, horizon: u32) -> Vec<u64> {
    let horizon = u64::from(horizon.max(1));
    let wanted = (depth.saturating_sub(1) as u64).min(horizon) as usize;
    let mut points = Vec::with_capacity(wanted);
    let mut state = seed;
    while points.len() < wanted {
        state = splitmix64(state);
        let point = 1 + state % horizon;
        if !points.contains(&point) {
            points.push(point);
        }
    }
    points.sort_unstable();
    points
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_minus_one_distinct_points_inside_the_horizon() {
        let points = change_points(7, 4, 10);
        assert_eq!(points.len(), 3);
        assert!(points.windows(2).all(|w| w[0] < w[1]));
        assert!(points.iter().all(|p| (1..=10).contains(p)));
        assert_eq!(change_points(7, 1, 10), Vec::<u64>::new(), "depth 1 is no change at all");
        assert_eq!(change_points(7, 50, 3), vec![1, 2, 3], "never more points than the horizon holds");
        assert_ne!(change_points(7, 4, 2000), change_points(8, 4, 2000));
    }
}
