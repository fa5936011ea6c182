//! The Pareto frontier of measured variants (throughput ↑, p99 ↓, memory ↓ — RSS, and GPU
//! memory where the server reports it) and the recommendation: the best variant by the
//! objective among those meeting the constraints.
//!
//! Pure functions over plain numbers. A variant is on the frontier when no other is at least
//! as good in every objective and strictly better in one. Unknown memory counts as worse than
//! any known amount (it cannot be shown to fit), and two unknowns are equal (so a sweep
//! without GPUs trades off three objectives).

use serde::{Deserialize, Serialize};

use super::result::{Measured, VariantResult};
use crate::driver::{SLO_QUANTILE, meets_slo};
use crate::measure::lowest_equivalent_us;

/// The three things the frontier trades off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Objectives {
    pub throughput: f64,
    pub p99_ms: f64,
    pub memory_mb: Option<f64>,
    pub gpu_memory_mb: Option<f64>,
}

impl Objectives {
    pub fn of(m: &Measured) -> Objectives {
        Objectives {
            throughput: m.throughput_infer_per_sec,
            p99_ms: m.p99_ms,
            memory_mb: m.memory_mb,
            gpu_memory_mb: m.gpu_memory_mb,
        }
    }
}

/// Whether `a` dominates `b`: no worse in throughput, p99, memory and GPU memory, better in one.
pub fn dominates(a: &Objectives, b: &Objectives) -> bool {
    let mem = |m: Option<f64>| m.unwrap_or(f64::INFINITY);
    let no_worse = a.throughput >= b.throughput
        && a.p99_ms <= b.p99_ms
        && mem(a.memory_mb) <= mem(b.memory_mb)
        && mem(a.gpu_memory_mb) <= mem(b.gpu_memory_mb);
    let better = a.throughput > b.throughput
        || a.p99_ms < b.p99_ms
        || mem(a.memory_mb) < mem(b.memory_mb)
        || mem(a.gpu_memory_mb) < mem(b.gpu_memory_mb);
    no_worse && better
}

/// Indices of the points no other point dominates, in input order. Points with a non-finite
/// throughput or p99 are left out. O(n²), fine for sweeps of thousands of variants.
pub fn pareto_frontier(points: &[Objectives]) -> Vec<usize> {
    let ok = |p: &Objectives| p.throughput.is_finite() && p.p99_ms.is_finite();
    (0..points.len()).filter(|&i| ok(&points[i]) && !points.iter().any(|q| ok(q) && dominates(q, &points[i]))).collect()
}

/// What the recommendation optimizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Most successful inferences per second within the SLO.
    Goodput,
    /// Most successful inferences per second.
    Throughput,
    /// Lowest p99 latency.
    Latency,
}

impl Objective {
    /// Higher is better: goodput, throughput, or minus the p99.
    pub fn value(self, m: &Measured) -> f64 {
        match self {
            Objective::Goodput => m.goodput_infer_per_sec,
            Objective::Throughput => m.throughput_infer_per_sec,
            Objective::Latency => -m.p99_ms,
        }
    }
}

/// Limits a recommended variant must meet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Constraints {
    pub max_p99_ms: Option<f64>,
    pub max_memory_mb: Option<f64>,
    /// GPU memory in use (all the server's GPUs together) at most this many MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_gpu_memory_mb: Option<f64>,
    /// Failed requests (rejected by a queue policy, timed out, ...) at most this percentage of
    /// the completed ones: a variant must not look good by refusing work.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_error_percent: Option<f64>,
    /// Whether the measured SLO verdict (`slo_met`: at least 99% of requests succeeded within
    /// the SLO, failures counted as misses, each class against its own) is the p99
    /// constraint's own — every class's SLO is `max_p99_ms`. Otherwise (a workload class with
    /// its own `slo_ms`, or another `--slo-p99-ms`) the constraint is judged from the requests
    /// that succeeded within `max_p99_ms` ([`Measured::within_limit`]). Either way a p99 over
    /// the successes alone is not enough: it cannot see the requests that failed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub slo_is_max_p99: bool,
}

/// How a measurement misses the p99 constraint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum P99Miss {
    /// The p99 of the successes is over the limit.
    Percentile,
    /// The successes are within it, but with the failures counted as over, fewer than 99% of
    /// the requests are.
    Failures,
}

/// Failed requests as a percentage of the completed ones (0 when none completed).
pub fn error_percent(m: &Measured) -> f64 {
    if m.requests == 0 { 0.0 } else { 100.0 * m.errors as f64 / m.requests as f64 }
}

impl Constraints {
    /// Whether `m` misses the p99 constraint, and how. From the exact count of successes within
    /// the limit when the level kept one for this limit; else (a checkpoint from before, or a
    /// resume under another `--max-p99-ms`) from the p99's histogram bucket — its lowest
    /// equivalent, as the reported p99 is the bucket's top, up to 0.1% above the latencies
    /// recorded — and, for the failures, from the SLO verdict when the SLO is the limit, else
    /// from the failures alone (more than 1% failed is a miss whatever the latencies).
    fn p99_miss(&self, m: &Measured) -> Option<P99Miss> {
        let max = self.max_p99_ms?;
        let exact = m.within_limit.filter(|w| w.limit_ms == max).map(|w| w.ok);
        let ok = m.requests.saturating_sub(m.errors);
        let over = ok > 0
            && match exact {
                Some(within) => (within as f64) < SLO_QUANTILE * ok as f64,
                None => lowest_equivalent_us((m.p99_ms * 1000.0).round() as u64) as f64 > max * 1000.0,
            };
        if over {
            return Some(P99Miss::Percentile);
        }
        let failures = (self.slo_is_max_p99 && m.slo_met == Some(false))
            || (m.requests > 0 && !meets_slo(exact.unwrap_or(ok), m.requests));
        failures.then_some(P99Miss::Failures)
    }

    /// `None` if `m` meets every constraint, else why not (one sentence).
    pub fn violation(&self, m: &Measured) -> Option<String> {
        let mut why = Vec::new();
        match (self.max_p99_ms, self.p99_miss(m)) {
            (Some(max), Some(P99Miss::Percentile)) => why.push(format!("p99 {:.3} ms > {max} ms", m.p99_ms)),
            (Some(max), Some(P99Miss::Failures)) => why.push(format!(
                "fewer than 99% of requests succeeded within {max} ms (failed ones count as over; {:.2}% failed)",
                error_percent(m)
            )),
            _ => {}
        }
        if let Some(max) = self.max_memory_mb {
            match m.memory_mb {
                Some(mem) if mem > max => why.push(format!("memory {mem:.1} MiB > {max} MiB")),
                Some(_) => {}
                None => why.push("memory unknown (give --worker-pid or use --worker-bin)".into()),
            }
        }
        if let Some(max) = self.max_gpu_memory_mb {
            match m.gpu_memory_mb {
                Some(mem) if mem > max => why.push(format!("GPU memory {mem:.1} MiB > {max} MiB")),
                Some(_) => {}
                None => why.push("GPU memory unknown (the server's /metrics has no nv_gpu_memory_used_bytes)".into()),
            }
        }
        if let Some(max) = self.max_error_percent
            && error_percent(m) > max
        {
            why.push(format!("errors {:.2}% > {max}%", error_percent(m)));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// How far `m` is from meeting the constraints, relative to each limit (0 when it meets
    /// them): what the quick search climbs down while nothing is feasible.
    pub fn excess(&self, m: &Measured) -> f64 {
        let over = |v: f64, max: f64| if max > 0.0 { (v / max - 1.0).max(0.0) } else { 0.0 };
        let p99 = match (self.max_p99_ms, self.p99_miss(m)) {
            (Some(max), Some(P99Miss::Percentile)) => over(m.p99_ms, max).max(0.001),
            // Under the limit for the successes, over it counting the failures: as far off as
            // the share of requests that failed (at least a little).
            (Some(_), Some(P99Miss::Failures)) => (error_percent(m) / 100.0).max(0.01),
            _ => 0.0,
        };
        let mem = match (self.max_memory_mb, m.memory_mb) {
            (Some(max), Some(v)) => over(v, max),
            (Some(_), None) => 1.0,
            _ => 0.0,
        };
        let gpu = match (self.max_gpu_memory_mb, m.gpu_memory_mb) {
            (Some(max), Some(v)) => over(v, max),
            (Some(_), None) => 1.0,
            _ => 0.0,
        };
        // A limit of 0% is allowed: then any error counts as a whole limit over.
        let errors = match self.max_error_percent {
            Some(max) if max > 0.0 => over(error_percent(m), max),
            Some(_) if m.errors > 0 => 1.0,
            _ => 0.0,
        };
        p99 + mem + gpu + errors
    }
}

/// The quick search's score of a measurement.
pub fn score(m: &Measured, constraints: &Constraints, objective: Objective) -> super::quick::Score {
    match constraints.violation(m) {
        None => super::quick::Score { feasible: true, value: objective.value(m) },
        Some(_) => super::quick::Score { feasible: false, value: -constraints.excess(m) },
    }
}

/// The index of the best usable result meeting the constraints by `objective` (ties: lower
/// p99, then higher throughput, then the earlier one), or `None` when nothing meets them.
/// Only trusted measurements count ([`VariantResult::usable`]): an unstable variant, or one
/// whose open-loop generator fell behind its schedule, is never recommended.
pub fn recommend(results: &[VariantResult], constraints: &Constraints, objective: Objective) -> Option<usize> {
    let mut best: Option<(usize, &Measured)> = None;
    for (i, r) in results.iter().enumerate() {
        let Some(m) = r.usable() else { continue };
        if constraints.violation(m).is_some() {
            continue;
        }
        let better = match best {
            None => true,
            Some((_, b)) => {
                let (x, y) = (objective.value(m), objective.value(b));
                x > y
                    || (x == y && m.p99_ms < b.p99_ms)
                    || (x == y && m.p99_ms == b.p99_ms && m.throughput_infer_per_sec > b.throughput_infer_per_sec)
            }
        };
        if better {
            best = Some((i, m));
        }
    }
    best.map(|(i, _)| i)
}

/// The level a variant is credited with when it was measured at several: the best by the
/// objective among the levels meeting the constraints, else (nothing meets them) the level
/// closest to meeting them, ties to the objective. A trusted level (stable, open-loop schedule
/// kept) beats one that is not, whatever their numbers. Levels where nothing succeeded are
/// never chosen; `None` when that is all of them.
pub fn best_level(levels: &[Measured], constraints: &Constraints, objective: Objective) -> Option<usize> {
    let usable = |m: &Measured| m.requests > m.errors;
    let key = |m: &Measured| {
        let trusted = m.trusted();
        let feasible = constraints.violation(m).is_none();
        (trusted && feasible, trusted, if feasible { 0.0 } else { -constraints.excess(m) }, objective.value(m))
    };
    let mut best: Option<(usize, (bool, bool, f64, f64))> = None;
    for (i, m) in levels.iter().enumerate().filter(|(_, m)| usable(m)) {
        let k = key(m);
        let better = match &best {
            None => true,
            Some((_, b)) => k.partial_cmp(b) == Some(std::cmp::Ordering::Greater),
        };
        if better {
            best = Some((i, k));
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::analyze::result::{VariantStatus, WithinLimit};
    use crate::analyze::space::Variant;
    use proptest::prelude::*;

    fn o(throughput: f64, p99_ms: f64, memory_mb: Option<f64>) -> Objectives {
        Objectives { throughput, p99_ms, memory_mb, gpu_memory_mb: None }
    }

    pub(crate) fn measured(throughput: f64, goodput: f64, p99_ms: f64, memory_mb: Option<f64>) -> Measured {
        Measured {
            throughput_infer_per_sec: throughput,
            requests_per_sec: throughput,
            goodput_infer_per_sec: goodput,
            p50_ms: p99_ms / 2.0,
            p90_ms: None,
            p99_ms,
            p999_ms: None,
            avg_ms: p99_ms / 2.0,
            requests: 100,
            errors: 0,
            stable: true,
            sends: 0,
            late_sends: 0,
            slo_met: None,
            within_limit: None,
            memory_mb,
            gpu_memory_mb: None,
            server_avg_batch_size: None,
            server_time: None,
            concurrency: None,
            request_rate: None,
            series: Vec::new(),
        }
    }

    fn result(i: u32, m: Measured) -> VariantResult {
        let v = Variant::batching(i, 1, 0, 0);
        let mut r = VariantResult::new(v, VariantStatus::Measured);
        r.measured = Some(m);
        r
    }

    #[test]
    fn a_variant_is_credited_with_its_best_level_that_meets_the_constraints() {
        let c = Constraints { max_p99_ms: Some(10.0), ..Constraints::default() };
        let mut failed = measured(0.0, 0.0, 1.0, None);
        failed.errors = failed.requests;
        let levels = [
            measured(100.0, 100.0, 2.0, None),  // 0: meets
            failed.clone(),                     // 1: nothing succeeded: never chosen
            measured(300.0, 290.0, 8.0, None),  // 2: meets, best goodput
            measured(500.0, 200.0, 30.0, None), // 3: misses p99
        ];
        assert_eq!(best_level(&levels, &c, Objective::Goodput), Some(2));
        assert_eq!(best_level(&levels, &c, Objective::Throughput), Some(2), "3 misses the constraint");
        assert_eq!(best_level(&levels, &c, Objective::Latency), Some(0));
        assert_eq!(best_level(&levels, &Constraints::default(), Objective::Throughput), Some(3));
        // Nothing meets them: the level closest to meeting them, whatever its throughput.
        let tight = Constraints { max_p99_ms: Some(1.0), ..Constraints::default() };
        assert_eq!(best_level(&levels, &tight, Objective::Throughput), Some(0));
        assert_eq!(best_level(&[failed.clone(), failed], &c, Objective::Goodput), None);
        assert_eq!(best_level(&[], &c, Objective::Goodput), None);

        // The p99 of the successes under the limit, but 2% of requests failed (queue timeouts):
        // with the SLO being the limit, the level misses it — its own verdict says so.
        let c = Constraints { max_p99_ms: Some(10.0), slo_is_max_p99: true, ..Constraints::default() };
        let mut shedding = measured(400.0, 392.0, 9.0, None);
        shedding.errors = shedding.requests / 50;
        shedding.slo_met = Some(false);
        let mut fine = measured(300.0, 300.0, 8.0, None);
        fine.slo_met = Some(true);
        let why = c.violation(&shedding).expect("a violation");
        assert!(why.contains("fewer than 99% of requests succeeded within 10 ms"), "{why}");
        assert_eq!(best_level(&[fine.clone(), shedding.clone()], &c, Objective::Throughput), Some(0));
        assert!(c.excess(&shedding) > 0.0);
        // A separate, tighter SLO's verdict is not the constraint's, but 2% failed is a miss
        // whatever the latencies.
        let separate = Constraints { slo_is_max_p99: false, ..c };
        assert!(separate.violation(&shedding).unwrap().contains("fewer than 99% of requests succeeded"));
        let tighter_slo_missed = Measured { errors: 0, ..shedding.clone() };
        assert!(separate.violation(&tighter_slo_missed).is_none());
        assert_eq!(separate.excess(&tighter_slo_missed), 0.0);
    }

    #[test]
    fn the_p99_constraint_counts_requests_within_its_own_limit() {
        // `--max-p99-ms 100 --workload classes.json` where a class has slo_ms 5: the level's
        // SLO verdict is the classes' (missed), not the constraint's.
        let c = Constraints { max_p99_ms: Some(100.0), slo_is_max_p99: false, ..Constraints::default() };
        let mut m = measured(400.0, 300.0, 40.0, None);
        m.slo_met = Some(false);
        m.within_limit = Some(WithinLimit { limit_ms: 100.0, ok: 100 });
        assert_eq!(c.violation(&m), None, "every request succeeded within 100 ms");
        assert_eq!(c.excess(&m), 0.0);
        // Under the limit for the successes, but 3 of 100 requests failed.
        let failing = Measured { errors: 3, within_limit: Some(WithinLimit { limit_ms: 100.0, ok: 97 }), ..m.clone() };
        let why = c.violation(&failing).expect("a violation");
        assert!(why.contains("fewer than 99% of requests succeeded within 100 ms"), "{why}");
        assert!(c.excess(&failing) > 0.0);
        // 5 of 100 successes slower than the limit: the p99 of the successes is over it.
        let slow = Measured { within_limit: Some(WithinLimit { limit_ms: 100.0, ok: 95 }), p99_ms: 130.0, ..m.clone() };
        assert!(c.violation(&slow).unwrap().contains("p99 130.000 ms > 100 ms"));
        // A count kept for another limit (a resume under a new --max-p99-ms) is not used.
        let other = Measured { within_limit: Some(WithinLimit { limit_ms: 50.0, ok: 0 }), ..m.clone() };
        assert_eq!(c.violation(&other), None, "judged from the p99 and the failures");
        // Without the separate SLO, the verdict is the constraint's own.
        let own = Constraints { slo_is_max_p99: true, ..c };
        assert!(own.violation(&m).unwrap().contains("fewer than 99%"));
    }

    #[test]
    fn a_p99_at_the_limit_is_not_over_it_by_the_histogram_bucket() {
        // Every latency exactly 10 ms: HDR reports the p99 as the top of 10 ms's bucket.
        let top = {
            let mut s = crate::measure::SeriesStats::default();
            for _ in 0..100 {
                s.record(std::time::Duration::from_millis(10), Ok(()), 1, None);
            }
            crate::measure::Latency::of(&s).p99_us
        };
        assert!(top > 10_000, "the bucket's top: {top} µs");
        let c = Constraints { max_p99_ms: Some(10.0), ..Constraints::default() };
        let mut m = measured(100.0, 100.0, top as f64 / 1000.0, None);
        assert_eq!(c.violation(&m), None, "without a count: the bucket's lowest equivalent, 10 ms");
        m.within_limit = Some(WithinLimit { limit_ms: 10.0, ok: 100 });
        assert_eq!(c.violation(&m), None, "with the exact count");
        // Really over: 10.1 ms is in a higher bucket.
        let over = measured(100.0, 100.0, 10.1, None);
        assert!(c.violation(&over).unwrap().contains("p99 10.100 ms > 10 ms"));
    }

    #[test]
    fn untrusted_variants_and_levels_are_never_preferred() {
        let best = measured(5000.0, 5000.0, 1.0, Some(10.0));
        let unstable = Measured { stable: false, ..best.clone() };
        let behind = Measured { sends: 1000, late_sends: 500, ..best.clone() };
        let results = vec![
            result(1, measured(1000.0, 1000.0, 5.0, Some(100.0))),
            result(2, unstable.clone()),
            result(3, behind.clone()),
        ];
        for objective in [Objective::Goodput, Objective::Throughput, Objective::Latency] {
            assert_eq!(recommend(&results, &Constraints::default(), objective), Some(0), "{objective:?}");
        }
        assert_eq!(recommend(&results[1..], &Constraints::default(), Objective::Goodput), None);

        // A variant is credited with a trusted level over better-looking untrusted ones, even one
        // that misses the constraints (then it is not recommended, but the numbers are real).
        let c = Constraints { max_p99_ms: Some(3.0), ..Default::default() };
        let slow = measured(800.0, 800.0, 4.0, None);
        assert_eq!(best_level(&[slow.clone(), behind.clone(), best.clone()], &c, Objective::Goodput), Some(2));
        assert_eq!(best_level(&[slow.clone(), behind.clone()], &c, Objective::Goodput), Some(0));
        assert_eq!(best_level(&[unstable.clone(), slow], &c, Objective::Goodput), Some(1));
        assert_eq!(best_level(&[behind, unstable], &c, Objective::Goodput), Some(0), "all untrusted: still one");
    }

    #[test]
    fn gpu_memory_is_a_fourth_objective_and_a_constraint() {
        let gpu = |t: f64, p99: f64, g: Option<f64>| Objectives { gpu_memory_mb: g, ..o(t, p99, Some(100.0)) };
        // Same throughput, p99 and RSS: less GPU memory dominates, and known beats unknown.
        assert!(dominates(&gpu(100.0, 5.0, Some(1000.0)), &gpu(100.0, 5.0, Some(2000.0))));
        assert!(dominates(&gpu(100.0, 5.0, Some(1000.0)), &gpu(100.0, 5.0, None)));
        assert!(!dominates(&gpu(100.0, 5.0, None), &gpu(100.0, 5.0, None)), "two unknowns are equal");
        // More throughput for more GPU memory: both on the frontier.
        let pts = [gpu(100.0, 5.0, Some(1000.0)), gpu(200.0, 5.0, Some(3000.0)), gpu(90.0, 6.0, Some(1500.0))];
        assert_eq!(pareto_frontier(&pts), vec![0, 1]);

        let c = Constraints { max_gpu_memory_mb: Some(2048.0), ..Constraints::default() };
        let mut m = measured(100.0, 100.0, 5.0, None);
        m.gpu_memory_mb = Some(1024.0);
        assert_eq!(c.violation(&m), None);
        m.gpu_memory_mb = Some(4096.0);
        assert!(c.violation(&m).unwrap().contains("GPU memory 4096.0 MiB > 2048 MiB"));
        assert!((c.excess(&m) - 1.0).abs() < 1e-9);
        m.gpu_memory_mb = None;
        assert!(c.violation(&m).unwrap().contains("GPU memory unknown"));
    }

    #[test]
    fn frontier_of_a_small_set() {
        let pts = [
            o(100.0, 5.0, Some(100.0)), // 0: dominated by 1
            o(200.0, 4.0, Some(100.0)), // 1: frontier
            o(300.0, 9.0, Some(120.0)), // 2: frontier (most throughput)
            o(150.0, 2.0, Some(300.0)), // 3: frontier (lowest p99)
            o(200.0, 4.0, Some(90.0)),  // 4: frontier (dominates 1 on memory)
            o(200.0, 4.0, None),        // 5: dominated by 4 (unknown memory is worst)
            o(f64::NAN, 1.0, Some(1.0)),
        ];
        assert_eq!(pareto_frontier(&pts), vec![2, 3, 4]);
        // Equal points are both kept.
        assert_eq!(pareto_frontier(&[o(1.0, 1.0, None), o(1.0, 1.0, None)]), vec![0, 1]);
        assert!(pareto_frontier(&[]).is_empty());
    }

    #[test]
    fn recommends_by_objective_under_constraints() {
        let results = vec![
            result(1, measured(1000.0, 900.0, 8.0, Some(200.0))),
            result(2, measured(1500.0, 1000.0, 12.0, Some(250.0))),
            result(3, measured(800.0, 800.0, 3.0, Some(500.0))),
            {
                let mut r = result(4, measured(5000.0, 5000.0, 1.0, Some(10.0)));
                r.status = VariantStatus::Failed;
                r
            },
        ];
        let none = Constraints::default();
        assert_eq!(recommend(&results, &none, Objective::Throughput), Some(1));
        assert_eq!(recommend(&results, &none, Objective::Goodput), Some(1));
        assert_eq!(recommend(&results, &none, Objective::Latency), Some(2));
        let p99 = Constraints { max_p99_ms: Some(10.0), ..Default::default() };
        assert_eq!(recommend(&results, &p99, Objective::Throughput), Some(0));
        let both = Constraints { max_p99_ms: Some(10.0), max_memory_mb: Some(300.0), ..Default::default() };
        assert_eq!(recommend(&results, &both, Objective::Latency), Some(0));
        let impossible = Constraints { max_p99_ms: Some(0.5), ..Default::default() };
        assert_eq!(recommend(&results, &impossible, Objective::Throughput), None);
        let v = both.violation(&results[1].measured.clone().unwrap()).unwrap();
        assert!(v.contains("p99 12.000 ms > 10 ms"), "{v}");
        let unknown = measured(1.0, 1.0, 1.0, None);
        assert!(both.violation(&unknown).unwrap().contains("memory unknown"));
        assert!(both.excess(&results[2].measured.clone().unwrap()) > 0.0);
        assert_eq!(both.excess(&results[0].measured.clone().unwrap()), 0.0);
    }

    #[test]
    fn a_variant_that_refuses_work_does_not_win_under_an_error_limit() {
        // Variant 2 sheds a fifth of its requests and looks best on goodput.
        let shedding = Measured { errors: 20, ..measured(3000.0, 3000.0, 2.0, None) };
        let results = vec![result(1, measured(1000.0, 1000.0, 5.0, None)), result(2, shedding.clone())];
        assert_eq!(recommend(&results, &Constraints::default(), Objective::Goodput), Some(1));
        let limit = Constraints { max_error_percent: Some(1.0), ..Default::default() };
        assert_eq!(recommend(&results, &limit, Objective::Goodput), Some(0));
        assert!(limit.violation(&shedding).unwrap().contains("errors 20.00% > 1%"));
        assert!((limit.excess(&shedding) - 19.0).abs() < 1e-9);
        // 0%: any error disqualifies, and the quick search still sees how far off it is.
        let zero = Constraints { max_error_percent: Some(0.0), ..Default::default() };
        assert!(zero.violation(&shedding).is_some());
        assert_eq!(zero.excess(&shedding), 1.0);
        assert_eq!(zero.violation(&results[0].measured.clone().unwrap()), None);
        // Old reports (no error limit) still read, and one without a limit writes none.
        let old: Constraints = serde_json::from_str(r#"{"max_p99_ms": 5.0, "max_memory_mb": null}"#).unwrap();
        assert_eq!(old.max_error_percent, None);
        assert!(!serde_json::to_string(&old).unwrap().contains("error"));
    }

    fn arb_point() -> impl Strategy<Value = Objectives> {
        (0u32..20, 0u32..20, prop::option::of(0u32..20))
            .prop_map(|(t, p, m)| o(t as f64 * 10.0, p as f64, m.map(|m| m as f64)))
    }

    proptest! {
        #[test]
        fn frontier_is_exactly_the_undominated_points(pts in prop::collection::vec(arb_point(), 0..40)) {
            let f = pareto_frontier(&pts);
            prop_assert_eq!(f.is_empty(), pts.is_empty());
            for &i in &f {
                for q in &pts {
                    prop_assert!(!dominates(q, &pts[i]));
                }
            }
            for (i, p) in pts.iter().enumerate() {
                if !f.contains(&i) {
                    // Dominated by someone, hence (transitively) by a frontier point.
                    prop_assert!(f.iter().any(|&j| dominates(&pts[j], p)));
                }
            }
        }

        #[test]
        fn the_throughput_recommendation_is_on_the_frontier(pts in prop::collection::vec(arb_point(), 1..30)) {
            let results: Vec<VariantResult> = pts
                .iter()
                .enumerate()
                .map(|(i, p)| result(i as u32 + 1, measured(p.throughput, p.throughput, p.p99_ms, p.memory_mb)))
                .collect();
            let best = recommend(&results, &Constraints::default(), Objective::Throughput).unwrap();
            let f = pareto_frontier(&pts);
            // Ties may pick an equal twin; some frontier point matches it.
            prop_assert!(f.iter().any(|&j| pts[j].throughput == pts[best].throughput && pts[j].p99_ms <= pts[best].p99_ms));
        }
    }
}
