//! Quick search: steepest-ascent hill climbing over the grid of a [`SearchSpace`], one step
//! along one dimension at a time — queue delay (and queue policy, when swept) included, which
//! Model Analyzer's quick search leaves out.
//!
//! Pure state machine, no I/O: [`QuickSearch::next_point`] proposes a point, the caller measures it
//! and feeds the outcome back with [`QuickSearch::record`]. It starts at the smallest value of
//! every dimension, measures all unvisited neighbours (up to 12) of the current point, moves to the best
//! of them if it beats the current point, and stops at a local optimum, when the space is
//! exhausted, or after `max_variants` measured points (skipped, invalid points do not count).
//! Every point is proposed at most once, so it always terminates.

use std::collections::{BTreeMap, VecDeque};

use super::space::{Point, SearchSpace};

/// How good a measured variant is: variants meeting the constraints beat those that do not;
/// then the higher value wins. Compare with [`Score::beats`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Score {
    pub feasible: bool,
    pub value: f64,
}

impl Score {
    /// Whether `self` is strictly better than `other` (NaN values lose to everything).
    pub fn beats(&self, other: &Score) -> bool {
        match (self.feasible, other.feasible) {
            (true, false) => true,
            (false, true) => false,
            _ => {
                let v = |x: f64| if x.is_nan() { f64::NEG_INFINITY } else { x };
                v(self.value) > v(other.value)
            }
        }
    }
}

/// What happened to a proposed point.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outcome {
    /// Not measured: the config was invalid. Does not count against `max_variants`.
    Skipped,
    /// Measured (or tried) but gave no usable number: failed to load, no success.
    Failed,
    Scored(Score),
}

/// Why the search ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// No neighbour beats the current point.
    LocalOptimum,
    /// `max_variants` points were measured.
    Budget,
    /// Every point reachable was visited.
    Exhausted,
}

#[derive(Debug)]
pub struct QuickSearch {
    space: SearchSpace,
    max_variants: usize,
    visited: BTreeMap<Point, Outcome>,
    /// Measured points (Failed or Scored).
    measured: usize,
    /// The point the climb stands on; `None` until the start has been recorded.
    current: Option<Point>,
    /// Neighbours still to measure around `current` (or the start).
    pending: VecDeque<Point>,
    /// The proposed point awaiting its outcome.
    waiting: Option<Point>,
    finished: Option<Finish>,
}

impl QuickSearch {
    /// A climb from the lowest corner of `space`, measuring at most `max_variants` (≥ 1).
    pub fn new(space: SearchSpace, max_variants: usize) -> QuickSearch {
        QuickSearch {
            space,
            max_variants: max_variants.max(1),
            visited: BTreeMap::new(),
            measured: 0,
            current: None,
            pending: VecDeque::from([[0; 7]]),
            waiting: None,
            finished: None,
        }
    }

    pub fn space(&self) -> &SearchSpace {
        &self.space
    }

    /// The next point to measure, or `None` when the search is over. Call [`record`](Self::record)
    /// with its outcome before asking again (asking again without recording re-proposes it).
    pub fn next_point(&mut self) -> Option<Point> {
        if let Some(p) = self.waiting {
            return Some(p);
        }
        loop {
            if self.finished.is_some() {
                return None;
            }
            if self.measured >= self.max_variants {
                self.finished = Some(Finish::Budget);
                return None;
            }
            match self.pending.pop_front() {
                Some(p) if self.visited.contains_key(&p) => continue,
                Some(p) => {
                    self.waiting = Some(p);
                    return Some(p);
                }
                None => self.step(),
            }
        }
    }

    /// Feeds back the outcome of the point [`next_point`](Self::next_point) proposed.
    pub fn record(&mut self, p: Point, outcome: Outcome) {
        if self.waiting == Some(p) {
            self.waiting = None;
        }
        if self.visited.insert(p, outcome).is_none() && outcome != Outcome::Skipped {
            self.measured += 1;
        }
        if self.current.is_none() {
            // The start (or, if it gave nothing, its neighbours) seeds the climb.
            match outcome {
                Outcome::Scored(_) => {
                    self.current = Some(p);
                    self.pending.extend(self.space.neighbours(p));
                }
                _ => {
                    // Spread out from the unusable point until something scores.
                    self.pending.extend(self.space.neighbours(p));
                }
            }
        }
    }

    /// All neighbours of the current point are measured: move to the best one if it beats
    /// the current point, else stop.
    fn step(&mut self) {
        loop {
            let Some(current) = self.current else {
                // Nothing has scored and nothing is left to try.
                self.finished = Some(Finish::Exhausted);
                return;
            };
            let score_of = |p: &Point| match self.visited.get(p) {
                Some(Outcome::Scored(s)) => Some(*s),
                _ => None,
            };
            let here = score_of(&current).expect("the current point scored");
            let best = self.space.neighbours(current).into_iter().filter_map(|q| score_of(&q).map(|s| (q, s))).fold(
                None::<(Point, Score)>,
                |acc, (q, s)| match acc {
                    Some((_, b)) if !s.beats(&b) => acc,
                    _ => Some((q, s)),
                },
            );
            match best {
                Some((q, s)) if s.beats(&here) => {
                    // Each move strictly improves the score, so the climb cannot cycle.
                    self.current = Some(q);
                    let fresh: Vec<Point> =
                        self.space.neighbours(q).into_iter().filter(|n| !self.visited.contains_key(n)).collect();
                    if !fresh.is_empty() {
                        self.pending.extend(fresh);
                        return;
                    }
                    // Every neighbour of the new point is known already: look again from it.
                }
                _ => {
                    self.finished = Some(Finish::LocalOptimum);
                    return;
                }
            }
        }
    }

    /// Why the search ended (`None` while it goes on).
    pub fn finish(&self) -> Option<Finish> {
        self.finished
    }

    /// The point the climb ended on (the best it found).
    pub fn current(&self) -> Option<Point> {
        self.current
    }

    /// The best-scoring point measured so far (the climb may have stopped at the budget
    /// before moving onto it).
    pub fn best(&self) -> Option<Point> {
        let mut best: Option<(Point, Score)> = None;
        for (p, o) in &self.visited {
            if let Outcome::Scored(s) = o
                && best.is_none_or(|(_, b)| s.beats(&b))
            {
                best = Some((*p, *s));
            }
        }
        best.map(|(p, _)| p)
    }

    /// How many points were measured (skipped ones excluded).
    pub fn measured(&self) -> usize {
        self.measured
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// A space of `shape` (dimensions beyond those given have one value: no queue policy).
    fn space<const N: usize>(shape: [usize; N]) -> SearchSpace {
        let dim = |d: usize| shape.get(d).copied().unwrap_or(1);
        SearchSpace::new(
            (1..=dim(0) as u32).collect(),
            (0..dim(1) as u32).collect(),
            (0..dim(2) as u32).collect(),
            (0..dim(3) as u64).collect(),
        )
        .and_then(|s| s.with_queue_policy((0..dim(4) as u32).collect(), (0..dim(5) as u64).collect()))
        .and_then(|s| s.with_priority_levels((0..dim(6) as u32).collect()))
        .unwrap()
    }

    /// Runs a search to the end against `score`, returning the proposed points in order.
    fn drive(search: &mut QuickSearch, score: impl Fn(Point) -> Outcome) -> Vec<Point> {
        let mut proposed = Vec::new();
        let mut guard = 0;
        while let Some(p) = search.next_point() {
            proposed.push(p);
            search.record(p, score(p));
            guard += 1;
            assert!(guard <= 10_000, "the search did not terminate");
        }
        proposed
    }

    fn scored(v: f64) -> Outcome {
        Outcome::Scored(Score { feasible: true, value: v })
    }

    #[test]
    fn climbs_a_single_peak_including_the_queue_delay() {
        // Peak at instances 3 (index 2), batch index 2, preferred index 0, delay index 3.
        let peak = [2usize, 2, 0, 3, 0, 0, 0];
        let f = |p: Point| -> Outcome {
            let d: i64 = (0..7).map(|i| (p[i] as i64 - peak[i] as i64).abs()).sum();
            scored(-(d as f64))
        };
        let mut s = QuickSearch::new(space([4, 4, 2, 5]), 100);
        let proposed = drive(&mut s, f);
        assert_eq!(s.current(), Some(peak));
        assert_eq!(s.finish(), Some(Finish::LocalOptimum));
        assert!(proposed.len() < 4 * 4 * 2 * 5, "fewer points than brute force: {}", proposed.len());
        assert!(proposed.iter().any(|p| p[3] > 0), "queue delay was explored");
        assert!(proposed.iter().all(|p| p[4] == 0 && p[5] == 0 && p[6] == 0), "no queue policy swept, none proposed");
    }

    #[test]
    fn climbs_along_the_queue_policy_and_priority_levels_when_swept() {
        // Peak at the largest queue size and the middle timeout.
        let peak = [1usize, 1, 0, 0, 2, 1, 1];
        let f = |p: Point| -> Outcome {
            let d: i64 = (0..7).map(|i| (p[i] as i64 - peak[i] as i64).abs()).sum();
            scored(-(d as f64))
        };
        let sp = space([2, 2, 1, 2, 3, 3, 2]);
        let mut s = QuickSearch::new(sp.clone(), 200);
        let proposed = drive(&mut s, f);
        assert_eq!(s.current(), Some(peak));
        assert_eq!(s.finish(), Some(Finish::LocalOptimum));
        assert!(proposed.len() < sp.len(), "fewer points than brute force: {}", proposed.len());
        // At most 14 neighbours per point, every one tried once.
        assert!(sp.neighbours(peak).len() <= 14);
    }

    #[test]
    fn stops_at_the_budget() {
        let mut s = QuickSearch::new(space([5, 5, 1, 5, 2, 2]), 4);
        let proposed = drive(&mut s, |p| scored((p[0] + p[1] + p[3]) as f64));
        assert_eq!(proposed.len(), 4);
        assert_eq!(s.finish(), Some(Finish::Budget));
    }

    #[test]
    fn skipped_points_do_not_use_the_budget_and_failed_starts_spread_out() {
        // The start fails to load; its neighbours with preferred > 0 are skipped.
        let f = |p: Point| match p {
            [0, 0, 0, 0, 0, 0, 0] => Outcome::Failed,
            [_, _, 1, ..] => Outcome::Skipped,
            _ => scored(p[0] as f64),
        };
        let mut s = QuickSearch::new(space([3, 1, 2, 1]), 3);
        let proposed = drive(&mut s, f);
        assert!(proposed.contains(&[0, 0, 1, 0, 0, 0, 0]));
        assert_eq!(s.measured(), 3);
        assert_eq!(s.finish(), Some(Finish::Budget));
        assert_eq!(s.current(), Some([1, 0, 0, 0, 0, 0, 0]), "the budget ran out before the move");
        assert_eq!(s.best(), Some([2, 0, 0, 0, 0, 0, 0]));
    }

    #[test]
    fn nothing_scoring_exhausts() {
        let mut s = QuickSearch::new(space([2, 2, 1, 1]), 100);
        let proposed = drive(&mut s, |_| Outcome::Failed);
        assert_eq!(proposed.len(), 4, "every point is tried once");
        assert_eq!(s.finish(), Some(Finish::Exhausted));
        assert_eq!(s.current(), None);
    }

    #[test]
    fn feasible_beats_infeasible() {
        let a = Score { feasible: true, value: -100.0 };
        let b = Score { feasible: false, value: 100.0 };
        assert!(a.beats(&b) && !b.beats(&a));
        assert!(!a.beats(&a));
        assert!(Score { feasible: true, value: 1.0 }.beats(&Score { feasible: true, value: f64::NAN }));
    }

    proptest! {
        #[test]
        fn any_landscape_terminates_without_repeats_within_the_budget(
            shape in prop::array::uniform7(1usize..4),
            values in prop::collection::vec(-100i32..100, 2187),
            kinds in prop::collection::vec(0u8..10, 2187),
            budget in 1usize..30,
        ) {
            let sp = space(shape);
            let index = |p: Point| p.iter().fold(0, |i, &x| i * 3 + x);
            let f = |p: Point| match kinds[index(p)] {
                0 => Outcome::Skipped,
                1 => Outcome::Failed,
                k => Outcome::Scored(Score { feasible: k > 3, value: values[index(p)] as f64 }),
            };
            let mut s = QuickSearch::new(sp.clone(), budget);
            let proposed = drive(&mut s, f);
            let unique: BTreeSet<Point> = proposed.iter().copied().collect();
            prop_assert_eq!(unique.len(), proposed.len(), "a point was proposed twice");
            prop_assert!(proposed.len() <= sp.len());
            let measured = proposed.iter().filter(|p| f(**p) != Outcome::Skipped).count();
            prop_assert!(measured <= budget);
            prop_assert!(s.finish().is_some());
            // A climb that ended at a local optimum: no measured neighbour beats it.
            if let (Some(Finish::LocalOptimum), Some(c)) = (s.finish(), s.current()) {
                let Outcome::Scored(here) = f(c) else { panic!("current did not score") };
                for q in sp.neighbours(c) {
                    prop_assert!(unique.contains(&q), "neighbour {:?} of the optimum was not tried", q);
                    if let Outcome::Scored(n) = f(q) {
                        prop_assert!(!n.beats(&here));
                    }
                }
            }
        }
    }
}
