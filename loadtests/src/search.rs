//! `--binary-search`: the highest load that meets the SLO, found by bisection between the bounds
//! of a concurrency or request-rate range (perf_analyzer's `--binary-search`).
//!
//! [`BinarySearch`] is a pure state machine: it names the next load to probe, the driver
//! measures it (warm-up, windows, stability, as for any level) and records whether it met the
//! SLO. The lower bound is probed first: if it misses, nothing in the range meets the SLO and
//! the search ends. Then the upper bound: if it meets, it is the answer (the server may sustain
//! more; widen the range). Otherwise the bracket *(highest load that met, lowest load that
//! missed)* is halved until it is at most `precision` wide — with a concurrency step of 1 the
//! answer is exact. At most [`SearchSpace::max_probes`] loads are measured.
//!
//! Bisection assumes that a load meeting the SLO means every lower load meets it too. On a
//! non-monotone curve (a server that recovers at higher load, a noisy probe) it still ends
//! within the same number of probes, and its answer is still a measured load that met the SLO
//! with a measured miss at most `precision` above it — a local boundary, not necessarily the
//! global one. Every probe is reported so a reader can see which.
//!
//! [`SearchAxis`] maps the searched numbers to load levels, and [`SearchReport`] is what the
//! table, JSON and HTML reports say about a search.

use serde::Serialize;

use crate::schedule::{Distribution, LoadLevel};

/// Where to search, and how finely.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct SearchSpace {
    /// Lower bound of the range; probed first.
    pub low: f64,
    /// Upper bound of the range; probed second.
    pub high: f64,
    /// The search stops once the loads that met and missed are at most this far apart.
    pub precision: f64,
    /// Whole-number loads only (concurrency): midpoints round down.
    pub integer: bool,
}

/// Why a [`SearchSpace`] is unusable.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SearchSpaceError {
    #[error("the bounds must be finite, positive and low <= high, got {low}..{high}")]
    Bounds { low: f64, high: f64 },
    #[error("the precision must be a positive number{}, got {precision}", if *.integer { " (a whole number for concurrency)" } else { "" })]
    Precision { precision: f64, integer: bool },
}

impl SearchSpace {
    /// A validated space: `0 < low <= high`, finite; `precision > 0` (a whole number `>= 1` when
    /// `integer`, where the bounds are whole numbers too).
    pub fn new(low: f64, high: f64, precision: f64, integer: bool) -> Result<SearchSpace, SearchSpaceError> {
        let whole = |x: f64| !integer || x.fract() == 0.0;
        if !(low.is_finite() && high.is_finite() && low > 0.0 && low <= high && whole(low) && whole(high)) {
            return Err(SearchSpaceError::Bounds { low, high });
        }
        if !(precision.is_finite() && precision > 0.0 && whole(precision)) {
            return Err(SearchSpaceError::Precision { precision, integer });
        }
        Ok(SearchSpace { low, high, precision, integer })
    }

    /// The most probes a search of this space measures: both bounds, then one per halving of
    /// the range down to `precision`.
    pub fn max_probes(&self) -> u32 {
        if self.high <= self.low {
            return 1;
        }
        let halvings = ((self.high - self.low) / self.precision).log2().ceil().max(0.0);
        2 + halvings as u32
    }
}

/// One measured load and whether it met the SLO.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Probe {
    pub value: f64,
    pub met: bool,
}

/// Where a search ended.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum SearchOutcome {
    /// `best` met the SLO; `first_miss` is the lowest probed load above it that missed, at most
    /// `precision` above (`None` when the upper bound itself met).
    Found { best: f64, first_miss: Option<f64> },
    /// The lower bound missed the SLO, so no load in the range is taken to meet it.
    NothingMeets { low: f64 },
    /// The search was stopped before it could answer (server lost, interrupted); what is known.
    Unfinished { best: Option<f64>, first_miss: Option<f64> },
}

/// Bisection over a [`SearchSpace`]: ask [`next_probe`](Self::next_probe), measure it, tell
/// [`record`](Self::record), until `next_probe` is `None`; then [`outcome`](Self::outcome).
#[derive(Clone, Debug)]
pub struct BinarySearch {
    space: SearchSpace,
    probes: Vec<Probe>,
    /// Highest probed load that met the SLO.
    best: Option<f64>,
    /// Lowest probed load that missed it.
    first_miss: Option<f64>,
}

impl BinarySearch {
    pub fn new(space: SearchSpace) -> Self {
        BinarySearch { space, probes: Vec::new(), best: None, first_miss: None }
    }

    pub fn space(&self) -> &SearchSpace {
        &self.space
    }

    /// Every probe recorded, in the order measured.
    pub fn probes(&self) -> &[Probe] {
        &self.probes
    }

    /// The next load to measure, or `None` when the search is over.
    pub fn next_probe(&self) -> Option<f64> {
        let SearchSpace { low, high, precision, integer } = self.space;
        if self.probes.is_empty() {
            return Some(low);
        }
        // The lower bound missed: nothing to search.
        let best = self.best?;
        let Some(miss) = self.first_miss else {
            // Everything probed so far met: the upper bound next, unless it was the one that met.
            return (best < high).then_some(high);
        };
        if miss - best <= precision {
            return None;
        }
        let mid = best + (miss - best) / 2.0;
        let mid = if integer { mid.floor() } else { mid };
        (mid > best && mid < miss).then_some(mid)
    }

    /// Records the measurement of `value` (normally the last [`next_probe`](Self::next_probe)).
    pub fn record(&mut self, value: f64, met: bool) {
        self.probes.push(Probe { value, met });
        if met {
            if self.best.is_none_or(|b| value > b) {
                self.best = Some(value);
            }
        } else if self.first_miss.is_none_or(|m| value < m) {
            self.first_miss = Some(value);
        }
    }

    /// The answer so far: final once [`next_probe`](Self::next_probe) is `None`.
    pub fn outcome(&self) -> SearchOutcome {
        if self.probes.is_empty() || self.next_probe().is_some() {
            return SearchOutcome::Unfinished { best: self.best, first_miss: self.first_miss };
        }
        match self.best {
            None => SearchOutcome::NothingMeets { low: self.space.low },
            Some(best) => SearchOutcome::Found { best, first_miss: self.first_miss },
        }
    }
}

/// What a binary search varies.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SearchAxis {
    /// Closed loop: outstanding requests.
    Concurrency,
    /// Open loop: requests per second.
    RequestRate { distribution: Distribution },
}

impl SearchAxis {
    /// The load level of a probed value.
    pub fn level(&self, value: f64) -> LoadLevel {
        match self {
            SearchAxis::Concurrency => LoadLevel::Concurrency(value as u32),
            SearchAxis::RequestRate { distribution } => {
                LoadLevel::RequestRate { rate: value, distribution: *distribution }
            }
        }
    }

    pub fn noun(&self) -> &'static str {
        match self {
            SearchAxis::Concurrency => "concurrency",
            SearchAxis::RequestRate { .. } => "request rate",
        }
    }
}

/// How a search ended, for reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SearchStatus {
    /// A load met the SLO: the answer.
    Found,
    /// The lower bound missed it.
    NothingMeets,
    /// Stopped before an answer (server lost, interrupted).
    Unfinished,
}

/// One measured probe of a binary search.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProbeResult {
    pub level: LoadLevel,
    pub slo_met: bool,
}

/// What `--binary-search` found, and every probe it measured (in order; their full results
/// are the report's `levels`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SearchReport {
    pub axis: SearchAxis,
    pub low: LoadLevel,
    pub high: LoadLevel,
    pub precision: f64,
    pub outcome: SearchStatus,
    /// The answer: the highest load measured to meet the SLO.
    pub highest_meeting_slo: Option<LoadLevel>,
    /// The lowest load measured to miss it (above the answer, within the precision).
    pub lowest_missing_slo: Option<LoadLevel>,
    pub probes: Vec<ProbeResult>,
    /// The answer in one sentence.
    pub summary: String,
}

impl SearchReport {
    /// The report of a search over `axis`, finished or not.
    pub fn of(axis: SearchAxis, search: &BinarySearch) -> SearchReport {
        let space = search.space();
        let (low, high) = (axis.level(space.low), axis.level(space.high));
        let probes =
            search.probes().iter().map(|p| ProbeResult { level: axis.level(p.value), slo_met: p.met }).collect();
        let n = search.probes().len();
        let probed = format!("{n} probe{}", if n == 1 { "" } else { "s" });
        let (outcome, best, miss, summary) = match search.outcome() {
            SearchOutcome::Found { best, first_miss: Some(miss) } => (
                SearchStatus::Found,
                Some(best),
                Some(miss),
                format!(
                    "highest load meeting the SLO: {} ({} misses it; {probed})",
                    axis.level(best),
                    axis.level(miss)
                ),
            ),
            SearchOutcome::Found { best, first_miss: None } => (
                SearchStatus::Found,
                Some(best),
                None,
                format!(
                    "highest load meeting the SLO: {} — the upper bound of the range; the server may sustain more, raise the range's end ({probed})",
                    axis.level(best)
                ),
            ),
            SearchOutcome::NothingMeets { .. } => (
                SearchStatus::NothingMeets,
                None,
                None,
                format!("the lower bound {low} misses the SLO, so no load between {low} and {high} meets it"),
            ),
            SearchOutcome::Unfinished { best, first_miss } => (
                SearchStatus::Unfinished,
                best,
                first_miss,
                format!(
                    "stopped after {probed} before an answer; highest load meeting the SLO so far: {}",
                    best.map(|b| axis.level(b).to_string()).unwrap_or_else(|| "none".into())
                ),
            ),
        };
        SearchReport {
            axis,
            low,
            high,
            precision: space.precision,
            outcome,
            highest_meeting_slo: best.map(|b| axis.level(b)),
            lowest_missing_slo: miss.map(|m| axis.level(m)),
            probes,
            summary,
        }
    }
}

/// Runs a whole search against `meets` (a synthetic latency curve in tests): the probes in
/// order and the outcome.
pub fn search_with(space: SearchSpace, mut meets: impl FnMut(f64) -> bool) -> (Vec<Probe>, SearchOutcome) {
    let mut search = BinarySearch::new(space);
    while let Some(value) = search.next_probe() {
        search.record(value, meets(value));
    }
    (search.probes().to_vec(), search.outcome())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn concurrency(low: u32, high: u32, step: u32) -> SearchSpace {
        SearchSpace::new(low as f64, high as f64, step as f64, true).unwrap()
    }

    /// p99 latency of a synthetic server that saturates at `capacity`: flat, then growing
    /// linearly with the queue.
    fn p99_ms(load: f64, capacity: f64) -> f64 {
        2.0 + (load - capacity).max(0.0) * 0.5
    }

    #[test]
    fn monotone_concurrency_finds_the_exact_threshold_with_step_one() {
        // SLO 10 ms: p99 = 2 + (c - 20) / 2 <= 10 up to c = 36.
        let (probes, outcome) = search_with(concurrency(1, 64, 1), |c| p99_ms(c, 20.0) <= 10.0);
        assert_eq!(outcome, SearchOutcome::Found { best: 36.0, first_miss: Some(37.0) });
        let values: Vec<f64> = probes.iter().map(|p| p.value).collect();
        assert_eq!(&values[..2], &[1.0, 64.0], "bounds first");
        assert!(probes.len() as u32 <= concurrency(1, 64, 1).max_probes());
        assert!(values.iter().all(|v| v.fract() == 0.0), "whole concurrencies only: {values:?}");
    }

    #[test]
    fn a_coarser_step_stops_once_the_bracket_fits_it() {
        let space = concurrency(1, 64, 8);
        let (probes, outcome) = search_with(space, |c| c <= 36.0);
        let SearchOutcome::Found { best, first_miss: Some(miss) } = outcome else { panic!("{outcome:?}") };
        assert!(best <= 36.0 && miss > 36.0 && miss - best <= 8.0, "{best}..{miss}");
        assert!(probes.len() < search_with(concurrency(1, 64, 1), |c| c <= 36.0).0.len());
    }

    #[test]
    fn request_rates_bisect_to_the_precision() {
        let space = SearchSpace::new(100.0, 1000.0, 10.0, false).unwrap();
        let (probes, outcome) = search_with(space, |r| p99_ms(r, 400.0) <= 20.0);
        // 2 + (r - 400) / 2 <= 20 up to r = 436.
        let SearchOutcome::Found { best, first_miss: Some(miss) } = outcome else { panic!("{outcome:?}") };
        assert!(best <= 436.0 && best > 426.0, "{best}");
        assert!(miss > 436.0 && miss - best <= 10.0, "{best}..{miss}");
        assert!(probes.len() as u32 <= space.max_probes(), "{} probes", probes.len());
    }

    #[test]
    fn nothing_meets_when_the_lower_bound_misses() {
        let (probes, outcome) = search_with(concurrency(4, 64, 1), |_| false);
        assert_eq!(outcome, SearchOutcome::NothingMeets { low: 4.0 });
        assert_eq!(probes, vec![Probe { value: 4.0, met: false }], "one probe is enough");
    }

    #[test]
    fn everything_meets_answers_the_upper_bound() {
        let (probes, outcome) = search_with(concurrency(1, 64, 1), |_| true);
        assert_eq!(outcome, SearchOutcome::Found { best: 64.0, first_miss: None });
        assert_eq!(probes.len(), 2);
        // A single-load range is one probe.
        let (probes, outcome) = search_with(concurrency(8, 8, 1), |_| true);
        assert_eq!((probes.len(), outcome), (1, SearchOutcome::Found { best: 8.0, first_miss: None }));
    }

    #[test]
    fn non_monotone_curves_end_at_a_local_boundary() {
        // Meets at 1..=10 and again at 21..=30 (say, a second instance that starts at 21).
        let curve = |c: f64| c <= 10.0 || (21.0..=30.0).contains(&c);
        let (probes, outcome) = search_with(concurrency(1, 40, 1), curve);
        let values: Vec<f64> = probes.iter().map(|p| p.value).collect();
        // 1 met, 40 missed, 20 missed: the upper island is never seen.
        assert_eq!(&values[..3], &[1.0, 40.0, 20.0]);
        assert_eq!(outcome, SearchOutcome::Found { best: 10.0, first_miss: Some(11.0) });
        // Starting higher lands in the upper island instead: still a met load next to a miss.
        let (_, outcome) = search_with(concurrency(1, 56, 1), curve);
        assert_eq!(outcome, SearchOutcome::Found { best: 30.0, first_miss: Some(31.0) });
        // A cold lower bound that misses ends the search even though higher loads would meet.
        let (_, outcome) = search_with(concurrency(1, 64, 1), |c| (2.0..=20.0).contains(&c));
        assert_eq!(outcome, SearchOutcome::NothingMeets { low: 1.0 });
        // An upper bound that meets is taken as the answer even with misses in between.
        let (_, outcome) = search_with(concurrency(1, 64, 1), |c| !(30.0..40.0).contains(&c));
        assert_eq!(outcome, SearchOutcome::Found { best: 64.0, first_miss: None });
    }

    #[test]
    fn an_interrupted_search_is_unfinished() {
        let mut s = BinarySearch::new(concurrency(1, 64, 1));
        assert_eq!(s.outcome(), SearchOutcome::Unfinished { best: None, first_miss: None });
        s.record(1.0, true);
        s.record(64.0, false);
        assert_eq!(s.next_probe(), Some(32.0));
        assert_eq!(s.outcome(), SearchOutcome::Unfinished { best: Some(1.0), first_miss: Some(64.0) });
    }

    #[test]
    fn spaces_are_validated() {
        assert!(SearchSpace::new(0.0, 4.0, 1.0, true).is_err());
        assert!(SearchSpace::new(5.0, 4.0, 1.0, true).is_err());
        assert!(SearchSpace::new(1.0, 4.0, 0.0, false).is_err());
        assert!(SearchSpace::new(1.0, 4.0, 0.5, true).unwrap_err().to_string().contains("whole number"));
        assert!(SearchSpace::new(1.0, f64::INFINITY, 1.0, false).is_err());
        assert_eq!(concurrency(1, 1, 1).max_probes(), 1);
        assert_eq!(concurrency(1, 2, 1).max_probes(), 2);
        assert_eq!(concurrency(1, 65, 1).max_probes(), 8);
    }

    #[test]
    fn reports_say_the_answer_in_load_levels() {
        let rate = SearchAxis::RequestRate { distribution: Distribution::Constant };
        let mut s = BinarySearch::new(SearchSpace::new(100.0, 400.0, 50.0, false).unwrap());
        while let Some(v) = s.next_probe() {
            s.record(v, v <= 300.0);
        }
        let r = SearchReport::of(rate, &s);
        assert_eq!(r.outcome, SearchStatus::Found);
        assert_eq!(r.highest_meeting_slo, Some(rate.level(287.5)));
        assert_eq!(r.lowest_missing_slo, Some(rate.level(325.0)));
        assert_eq!(r.probes.len(), s.probes().len());
        assert!(
            r.summary.contains("287.5 req/s (constant) (325 req/s (constant) misses it; 5 probes)"),
            "{}",
            r.summary
        );

        let (c, space) = (SearchAxis::Concurrency, concurrency(2, 16, 1));
        let mut s = BinarySearch::new(space);
        s.record(2.0, false);
        let r = SearchReport::of(c, &s);
        assert_eq!((r.outcome, r.highest_meeting_slo.clone()), (SearchStatus::NothingMeets, None));
        assert_eq!(
            r.summary,
            "the lower bound concurrency 2 misses the SLO, so no load between concurrency 2 and concurrency 16 meets it"
        );

        let mut s = BinarySearch::new(space);
        s.record(2.0, true);
        s.record(16.0, true);
        let r = SearchReport::of(c, &s);
        assert!(r.summary.contains("concurrency 16 — the upper bound"), "{}", r.summary);
        assert_eq!(r.lowest_missing_slo, None);

        let mut s = BinarySearch::new(space);
        s.record(2.0, true);
        let r = SearchReport::of(c, &s);
        assert_eq!(r.outcome, SearchStatus::Unfinished);
        assert!(r.summary.contains("so far: concurrency 2"), "{}", r.summary);
    }

    proptest! {
        /// Whatever the curve, the search ends within `max_probes`, never probes outside the
        /// range or twice, and answers with a measured met load next to a measured miss.
        #[test]
        fn any_curve_gives_a_consistent_answer(
            low in 1u32..50,
            span in 0u32..500,
            step in 1u32..20,
            curve in prop::collection::vec(any::<bool>(), 600),
        ) {
            let space = concurrency(low, low + span, step);
            let meets = |c: f64| curve[c as usize];
            let (probes, outcome) = search_with(space, meets);
            prop_assert!(probes.len() as u32 <= space.max_probes(), "{} > {}", probes.len(), space.max_probes());
            let mut seen: Vec<f64> = probes.iter().map(|p| p.value).collect();
            prop_assert!(seen.iter().all(|v| *v >= space.low && *v <= space.high && v.fract() == 0.0));
            seen.sort_by(f64::total_cmp);
            seen.dedup();
            prop_assert_eq!(seen.len(), probes.len(), "a load probed twice: {:?}", probes);
            let was = |v: f64, met: bool| probes.iter().any(|p| p.value == v && p.met == met);
            match outcome {
                SearchOutcome::Found { best, first_miss: Some(miss) } => {
                    prop_assert!(was(best, true) && was(miss, false));
                    prop_assert!(miss > best && miss - best <= space.precision);
                }
                SearchOutcome::Found { best, first_miss: None } => {
                    prop_assert!(best == space.high && was(best, true));
                }
                SearchOutcome::NothingMeets { low } => {
                    prop_assert!(low == space.low && was(low, false) && probes.len() == 1);
                }
                SearchOutcome::Unfinished { .. } => prop_assert!(false, "a finished search is unfinished"),
            }
        }

        /// On a monotone curve (meets up to a threshold) the answer is the exact threshold with
        /// step 1 and within the precision for request rates.
        #[test]
        fn monotone_curves_find_the_threshold(
            low in 1u32..50,
            span in 1u32..2000,
            threshold in 0.0f64..2100.0,
            precision in 0.1f64..50.0,
        ) {
            let high = low + span;
            let (_, outcome) = search_with(concurrency(low, high, 1), |c| c <= threshold);
            let expected = if threshold < low as f64 {
                SearchOutcome::NothingMeets { low: low as f64 }
            } else if threshold >= high as f64 {
                SearchOutcome::Found { best: high as f64, first_miss: None }
            } else {
                let t = threshold.floor();
                SearchOutcome::Found { best: t, first_miss: Some(t + 1.0) }
            };
            prop_assert_eq!(outcome, expected);

            let space = SearchSpace::new(low as f64, high as f64, precision, false).unwrap();
            let (_, outcome) = search_with(space, |r| r <= threshold);
            if let SearchOutcome::Found { best, first_miss: Some(miss) } = outcome {
                prop_assert!(best <= threshold && miss > threshold && miss - best <= precision);
            }
        }
    }
}
