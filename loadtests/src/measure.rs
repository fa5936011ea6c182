//! Measurement windows: HDR latency histograms, throughput, goodput against the SLO, errors by
//! status, and perf_analyzer's stability rule.
//!
//! Latencies are recorded in microseconds into HDR histograms (Gil Tene's HdrHistogram, 3
//! significant digits: every percentile is within 0.1% of the exact order statistic). A window
//! collects every request that *completes* while it is open; requests still in flight when it
//! closes land in the next one, so no completion is lost or counted twice.
//!
//! Stability follows perf_analyzer: a load level is stable when, over the last
//! [`STABILITY_WINDOWS`] windows, both throughput and average latency are each within
//! ±`stability_percentage`% of their mean. The level's result merges those windows.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Highest latency a histogram holds exactly (1 hour); longer ones are clamped to it.
pub const LATENCY_HIGH_US: u64 = 3_600_000_000;
/// Significant decimal digits of every histogram.
pub const LATENCY_SIGFIG: u8 = 3;
/// Windows compared by the stability rule (perf_analyzer's default).
pub const STABILITY_WINDOWS: usize = 3;

/// Why a request did not succeed. A closed set: statuses come from the protocol's code space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Failure {
    /// A gRPC status code other than OK.
    Grpc(i32),
    /// An HTTP status other than 200.
    Http(u16),
    /// No response within the client's request timeout.
    Timeout,
    /// Could not connect, or the connection broke (server down, reset).
    Connection,
}

impl Failure {
    /// `UNAVAILABLE`, `HTTP 503`, `CLIENT_TIMEOUT`, `CONNECTION`.
    pub fn label(&self) -> String {
        match self {
            Failure::Grpc(code) => grpc_code_name(*code).to_string(),
            Failure::Http(status) => format!("HTTP {status}"),
            Failure::Timeout => "CLIENT_TIMEOUT".into(),
            Failure::Connection => "CONNECTION".into(),
        }
    }
}

fn grpc_code_name(code: i32) -> &'static str {
    match code {
        0 => "OK",
        1 => "CANCELLED",
        2 => "UNKNOWN",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        6 => "ALREADY_EXISTS",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        9 => "FAILED_PRECONDITION",
        10 => "ABORTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        15 => "DATA_LOSS",
        16 => "UNAUTHENTICATED",
        _ => "GRPC_UNKNOWN_CODE",
    }
}

/// Counts and latencies of one series (or of all) during one window.
#[derive(Clone, Debug)]
pub struct SeriesStats {
    /// Latencies of successful requests, µs.
    pub latency_us: Histogram<u64>,
    /// Exact sum of `latency_us`, for the average.
    pub latency_sum_us: u64,
    pub ok: u64,
    /// Successful requests within their SLO (all successes when there is no SLO).
    pub ok_within_slo: u64,
    /// Rows inferred by successful requests (`ok × batch_size`).
    pub inferences: u64,
    /// Rows of requests counted in `ok_within_slo`.
    pub good_inferences: u64,
    /// Successful requests within the recorder's latency limit ([`Recorder::with_limit`]:
    /// nereid-analyze's `--max-p99-ms`, whatever each entry's SLO); 0 without a limit.
    pub ok_within_limit: u64,
    pub errors: BTreeMap<Failure, u64>,
    /// Open loop: requests sent, and those sent more than the lateness bound after schedule.
    pub sends: u64,
    pub late_sends: u64,
}

impl Default for SeriesStats {
    fn default() -> Self {
        SeriesStats {
            latency_us: new_histogram(),
            latency_sum_us: 0,
            ok: 0,
            ok_within_slo: 0,
            inferences: 0,
            good_inferences: 0,
            ok_within_limit: 0,
            errors: BTreeMap::new(),
            sends: 0,
            late_sends: 0,
        }
    }
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, LATENCY_HIGH_US, LATENCY_SIGFIG).expect("static histogram bounds are valid")
}

impl SeriesStats {
    /// Records one completed request. Latency counts only for successes (as perf_analyzer).
    pub fn record(&mut self, latency: Duration, outcome: Result<(), Failure>, batch_size: u32, slo: Option<Duration>) {
        match outcome {
            Ok(()) => {
                let us = (latency.as_micros() as u64).clamp(1, LATENCY_HIGH_US);
                self.latency_us.saturating_record(us);
                self.latency_sum_us += us;
                self.ok += 1;
                self.inferences += batch_size as u64;
                if slo.is_none_or(|slo| latency <= slo) {
                    self.ok_within_slo += 1;
                    self.good_inferences += batch_size as u64;
                }
            }
            Err(f) => *self.errors.entry(f).or_default() += 1,
        }
    }

    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Adds `other` into `self`.
    pub fn merge(&mut self, other: &SeriesStats) {
        // Same bounds on both sides, so adding cannot fail.
        let _ = self.latency_us.add(&other.latency_us);
        self.latency_sum_us += other.latency_sum_us;
        self.ok += other.ok;
        self.ok_within_slo += other.ok_within_slo;
        self.inferences += other.inferences;
        self.good_inferences += other.good_inferences;
        self.ok_within_limit += other.ok_within_limit;
        for (f, n) in &other.errors {
            *self.errors.entry(*f).or_default() += n;
        }
        self.sends += other.sends;
        self.late_sends += other.late_sends;
    }
}

/// Everything measured during one window, per recorder slot (one per workload entry; the
/// driver groups them into series, models and tenants).
#[derive(Clone, Debug)]
pub struct Window {
    pub duration: Duration,
    pub slots: Vec<SeriesStats>,
}

impl Window {
    /// All slots merged.
    pub fn total(&self) -> SeriesStats {
        self.merged(0..self.slots.len())
    }

    /// The given slots merged (indexes out of range are skipped).
    pub fn merged(&self, slots: impl IntoIterator<Item = usize>) -> SeriesStats {
        let mut t = SeriesStats::default();
        for s in slots.into_iter().filter_map(|i| self.slots.get(i)) {
            t.merge(s);
        }
        t
    }

    /// Takes in the answers `tail` collected after this window closed (open loop: requests
    /// sent in it and answered later), not its sends: they belong to the window they were sent
    /// in, and a stall at a level's end shows only in them.
    pub fn absorb_answers(&mut self, tail: &Window) {
        for (acc, late) in self.slots.iter_mut().zip(&tail.slots) {
            let answers = SeriesStats { sends: 0, late_sends: 0, ..late.clone() };
            acc.merge(&answers);
        }
    }

    /// Windows merged into one: durations add, slots merge index by index.
    pub fn merge(windows: &[Window]) -> Window {
        let n = windows.iter().map(|w| w.slots.len()).max().unwrap_or(0);
        let mut out = Window { duration: Duration::ZERO, slots: vec![SeriesStats::default(); n] };
        for w in windows {
            out.duration += w.duration;
            for (acc, s) in out.slots.iter_mut().zip(&w.slots) {
                acc.merge(s);
            }
        }
        out
    }
}

/// Latency percentiles in microseconds (0 when nothing succeeded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    pub p50_us: u64,
    pub p90_us: u64,
    pub p95_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub avg_us: u64,
    pub min_us: u64,
    pub max_us: u64,
}

/// The `q` quantile (0..=1) of a histogram: the smallest recorded value such that at least
/// `q` of all values are at or below it (nearest rank), within the histogram's precision.
pub fn quantile(h: &Histogram<u64>, q: f64) -> u64 {
    if h.is_empty() { 0 } else { h.value_at_quantile(q) }
}

/// The lowest latency (µs) the histograms cannot tell apart from `us`: the bottom of its
/// bucket. A percentile is reported as the top of its bucket (up to 0.1% above the recorded
/// values), so a percentile compared against a limit should compare this.
pub fn lowest_equivalent_us(us: u64) -> u64 {
    static SHAPE: std::sync::LazyLock<Histogram<u64>> = std::sync::LazyLock::new(new_histogram);
    SHAPE.lowest_equivalent(us)
}

impl Latency {
    pub fn of(s: &SeriesStats) -> Latency {
        let h = &s.latency_us;
        if h.is_empty() {
            return Latency::default();
        }
        Latency {
            p50_us: quantile(h, 0.50),
            p90_us: quantile(h, 0.90),
            p95_us: quantile(h, 0.95),
            p99_us: quantile(h, 0.99),
            p999_us: quantile(h, 0.999),
            avg_us: s.latency_sum_us / s.ok.max(1),
            min_us: h.min(),
            max_us: h.max(),
        }
    }
}

/// What a report says about one series (or all) over some duration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub duration_s: f64,
    /// Completed requests: successes plus errors.
    pub requests: u64,
    pub ok: u64,
    pub errors: u64,
    pub errors_by_status: BTreeMap<String, u64>,
    /// *Successful* requests per second (`ok` over the duration; failures are not counted,
    /// as in `infer_per_sec`, while `requests` counts both).
    pub requests_per_sec: f64,
    /// Successful rows per second (perf_analyzer's "Inferences/Second").
    pub infer_per_sec: f64,
    /// Successful requests within their SLO per second; equal to throughput without an SLO.
    pub goodput_requests_per_sec: f64,
    pub goodput_infer_per_sec: f64,
    pub latency: Latency,
    pub sends: u64,
    pub late_sends: u64,
}

impl Summary {
    pub fn of(s: &SeriesStats, duration: Duration) -> Summary {
        let secs = duration.as_secs_f64();
        let per_sec = |n: u64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        Summary {
            duration_s: secs,
            requests: s.ok + s.error_count(),
            ok: s.ok,
            errors: s.error_count(),
            errors_by_status: s.errors.iter().map(|(f, n)| (f.label(), *n)).collect(),
            requests_per_sec: per_sec(s.ok),
            infer_per_sec: per_sec(s.inferences),
            goodput_requests_per_sec: per_sec(s.ok_within_slo),
            goodput_infer_per_sec: per_sec(s.good_inferences),
            latency: Latency::of(s),
            sends: s.sends,
            late_sends: s.late_sends,
        }
    }

    /// Share of open-loop sends that were late (0 when nothing was scheduled).
    pub fn late_fraction(&self) -> f64 {
        if self.sends == 0 { 0.0 } else { self.late_sends as f64 / self.sends as f64 }
    }
}

/// Whether the last `n` windows agree: throughput and average latency each within
/// ±`percentage`% of their mean over those windows. Fewer than `n` windows are never stable;
/// `n` of 0 or 1 makes any single window stable.
pub fn is_stable(windows: &[Summary], percentage: f64, n: usize) -> bool {
    let n = n.max(1);
    if windows.len() < n {
        return false;
    }
    let last = &windows[windows.len() - n..];
    within(last.iter().map(|w| w.infer_per_sec), percentage)
        && within(last.iter().map(|w| w.latency.avg_us as f64), percentage)
}

fn within(values: impl Iterator<Item = f64> + Clone, percentage: f64) -> bool {
    let (sum, count) = values.clone().fold((0.0, 0usize), |(s, c), v| (s + v, c + 1));
    let mean = sum / count.max(1) as f64;
    let tolerance = mean.abs() * percentage / 100.0;
    values.into_iter().all(|v| (v - mean).abs() <= tolerance + f64::EPSILON)
}

/// Collects completions from every request task into the open window. Shared by all tasks of
/// a load level; the lock is held for a histogram increment only.
pub struct Recorder {
    slos: Vec<Option<Duration>>,
    limit: Option<Duration>,
    open: Mutex<Option<Vec<SeriesStats>>>,
    completed: AtomicU64,
}

impl Recorder {
    /// One slot per workload entry; `slos[i]` is slot `i`'s latency SLO.
    pub fn new(slos: Vec<Option<Duration>>) -> Self {
        Recorder::with_limit(slos, None)
    }

    /// As [`Recorder::new`], also counting every slot's successes within `limit`
    /// ([`SeriesStats::ok_within_limit`]), exactly rather than from a histogram bucket.
    pub fn with_limit(slos: Vec<Option<Duration>>, limit: Option<Duration>) -> Self {
        Recorder { slos, limit, open: Mutex::new(None), completed: AtomicU64::new(0) }
    }

    /// Opens a fresh window; until then (warm-up) completions are dropped.
    pub fn open_window(&self) {
        let fresh = vec![SeriesStats::default(); self.slos.len()];
        *self.lock() = Some(fresh);
        self.completed.store(0, Ordering::Relaxed);
    }

    /// Closes the open window and returns what it collected; `reopen` starts the next one in
    /// the same step so no completion falls between windows.
    pub fn close_window(&self, duration: Duration, reopen: bool) -> Window {
        let next = reopen.then(|| vec![SeriesStats::default(); self.slos.len()]);
        let slots = std::mem::replace(&mut *self.lock(), next).unwrap_or_default();
        self.completed.store(0, Ordering::Relaxed);
        Window { duration, slots }
    }

    /// Completions recorded in the open window so far.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    pub fn record(&self, slot: usize, latency: Duration, outcome: Result<(), Failure>, batch_size: u32) {
        let slo = self.slos.get(slot).copied().flatten();
        let mut open = self.lock();
        if let Some(s) = open.as_mut().and_then(|w| w.get_mut(slot)) {
            s.record(latency, outcome, batch_size, slo);
            if outcome.is_ok() && self.limit.is_some_and(|limit| latency <= limit) {
                s.ok_within_limit += 1;
            }
            self.completed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Open loop: a request of `slot` was sent; `late` if after its schedule plus the bound.
    pub fn record_send(&self, slot: usize, late: bool) {
        let mut open = self.lock();
        if let Some(s) = open.as_mut().and_then(|w| w.get_mut(slot)) {
            s.sends += 1;
            s.late_sends += late as u64;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<SeriesStats>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Nearest-rank percentile of a sorted vector: the smallest value with at least `q` of the
    /// values at or below it.
    /// A window takes in the answers collected after it closed, not the sends: a request
    /// stuck at its end counts in its latencies.
    #[test]
    fn a_window_absorbs_late_answers_but_not_later_sends() {
        let recorder = Recorder::new(vec![Some(Duration::from_millis(10))]);
        recorder.open_window();
        recorder.record_send(0, false);
        recorder.record_send(0, false);
        recorder.record(0, Duration::from_millis(2), Ok(()), 1);
        let mut window = recorder.close_window(Duration::from_secs(1), true);
        // After the close: the second request's answer, 400 ms late, and a send of the next.
        recorder.record(0, Duration::from_millis(400), Ok(()), 1);
        recorder.record_send(0, true);
        let tail = recorder.close_window(Duration::ZERO, false);
        window.absorb_answers(&tail);
        let total = window.total();
        assert_eq!((total.ok, total.ok_within_slo, total.sends, total.late_sends), (2, 1, 2, 0));
        assert_eq!(total.latency_us.max() / 1000, 400, "the late answer is in the window's latencies");
    }

    fn nearest_rank(sorted: &[u64], q: f64) -> u64 {
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
        sorted[rank - 1]
    }

    fn summary(infer_per_sec: f64, avg_us: u64) -> Summary {
        let mut s = Summary::of(&SeriesStats::default(), Duration::from_secs(1));
        s.infer_per_sec = infer_per_sec;
        s.latency.avg_us = avg_us;
        s
    }

    proptest! {
        #[test]
        fn percentiles_match_a_sorted_vector_within_hdr_precision(
            values in prop::collection::vec(1u64..50_000_000, 1..2_000),
            q in prop::sample::select(vec![0.5, 0.9, 0.95, 0.99, 0.999, 1.0]),
        ) {
            let mut s = SeriesStats::default();
            for v in &values {
                s.record(Duration::from_micros(*v), Ok(()), 1, None);
            }
            let mut sorted = values.clone();
            sorted.sort_unstable();
            let exact = nearest_rank(&sorted, q);
            let hdr = quantile(&s.latency_us, q);
            // 3 significant digits: within 0.1% (plus the histogram's unit) of the exact value.
            let tolerance = exact / 1000 + 1;
            prop_assert!(hdr.abs_diff(exact) <= tolerance, "q={} hdr={} exact={}", q, hdr, exact);
            let l = Latency::of(&s);
            prop_assert!(l.min_us <= l.p50_us && l.p50_us <= l.p90_us && l.p90_us <= l.p95_us);
            prop_assert!(l.p95_us <= l.p99_us && l.p99_us <= l.p999_us && l.p999_us <= l.max_us);
            prop_assert_eq!(l.avg_us, values.iter().sum::<u64>() / values.len() as u64);
        }

        #[test]
        fn merging_windows_equals_recording_once(a in prop::collection::vec(1u64..1_000_000, 0..300), b in prop::collection::vec(1u64..1_000_000, 0..300)) {
            let mut wa = SeriesStats::default();
            let mut wb = SeriesStats::default();
            let mut all = SeriesStats::default();
            for v in &a { wa.record(Duration::from_micros(*v), Ok(()), 2, None); all.record(Duration::from_micros(*v), Ok(()), 2, None); }
            for v in &b { wb.record(Duration::from_micros(*v), Ok(()), 2, None); all.record(Duration::from_micros(*v), Ok(()), 2, None); }
            let merged = Window::merge(&[
                Window { duration: Duration::from_secs(1), slots: vec![wa] },
                Window { duration: Duration::from_secs(2), slots: vec![wb] },
            ]);
            prop_assert_eq!(merged.duration, Duration::from_secs(3));
            prop_assert_eq!(Latency::of(&merged.slots[0]), Latency::of(&all));
            prop_assert_eq!(merged.slots[0].inferences, 2 * (a.len() + b.len()) as u64);
        }
    }

    #[test]
    fn goodput_counts_successes_within_the_slo() {
        let slo = Some(Duration::from_millis(10));
        let mut s = SeriesStats::default();
        for ms in [1, 5, 10, 11, 50] {
            s.record(Duration::from_millis(ms), Ok(()), 4, slo);
        }
        s.record(Duration::from_millis(1), Err(Failure::Grpc(8)), 4, slo);
        s.record(Duration::from_millis(1), Err(Failure::Grpc(8)), 4, slo);
        s.record(Duration::from_millis(1), Err(Failure::Http(503)), 4, slo);
        assert_eq!((s.ok, s.ok_within_slo, s.inferences, s.good_inferences), (5, 3, 20, 12));
        let sum = Summary::of(&s, Duration::from_secs(2));
        assert_eq!(sum.requests, 8);
        assert_eq!(sum.errors, 3);
        assert_eq!(sum.requests_per_sec, 2.5, "5 successes in 2 s: the 3 failures are not counted");
        assert_eq!(sum.infer_per_sec, 10.0);
        assert_eq!(sum.goodput_requests_per_sec, 1.5);
        assert_eq!(sum.goodput_infer_per_sec, 6.0);
        assert!(sum.goodput_infer_per_sec <= sum.infer_per_sec);
        assert_eq!(sum.errors_by_status.get("RESOURCE_EXHAUSTED"), Some(&2));
        assert_eq!(sum.errors_by_status.get("HTTP 503"), Some(&1));
        // No SLO: every success is good.
        let mut t = SeriesStats::default();
        t.record(Duration::from_secs(5), Ok(()), 1, None);
        assert_eq!(t.ok_within_slo, 1);
    }

    #[test]
    fn stability_needs_the_last_windows_to_agree() {
        let w = |v: &[(f64, u64)]| v.iter().map(|(t, l)| summary(*t, *l)).collect::<Vec<_>>();
        assert!(!is_stable(&w(&[(100.0, 10), (100.0, 10)]), 10.0, 3), "too few windows");
        assert!(is_stable(&w(&[(100.0, 10), (105.0, 10), (95.0, 11)]), 10.0, 3));
        assert!(!is_stable(&w(&[(100.0, 10), (130.0, 10), (95.0, 10)]), 10.0, 3), "throughput off");
        assert!(!is_stable(&w(&[(100.0, 10), (100.0, 20), (100.0, 10)]), 10.0, 3), "latency off");
        // Only the last n windows count.
        assert!(is_stable(&w(&[(10.0, 99), (100.0, 10), (100.0, 10), (101.0, 10)]), 5.0, 3));
        // A wider band accepts more.
        assert!(is_stable(&w(&[(100.0, 10), (130.0, 10), (95.0, 10)]), 25.0, 3));
        // Fewer windows when max trials is small; one window is trivially stable.
        assert!(is_stable(&w(&[(100.0, 10)]), 10.0, 1));
        assert!(is_stable(&w(&[(100.0, 10)]), 10.0, 0));
        // All-zero windows (every request failing) agree.
        assert!(is_stable(&w(&[(0.0, 0), (0.0, 0), (0.0, 0)]), 10.0, 3));
    }

    #[test]
    fn the_recorder_drops_warmup_and_splits_windows() {
        let r = Recorder::new(vec![None, Some(Duration::from_millis(1))]);
        r.record(0, Duration::from_millis(1), Ok(()), 1);
        r.open_window();
        r.record(0, Duration::from_millis(1), Ok(()), 1);
        r.record(1, Duration::from_millis(2), Ok(()), 1);
        r.record_send(1, true);
        r.record_send(1, false);
        assert_eq!(r.completed(), 2);
        let w1 = r.close_window(Duration::from_secs(1), true);
        r.record(1, Duration::from_micros(500), Err(Failure::Timeout), 1);
        let w2 = r.close_window(Duration::from_secs(1), false);
        r.record(1, Duration::from_micros(500), Ok(()), 1);
        assert_eq!(w1.slots[0].ok, 1, "warm-up completion dropped");
        assert_eq!((w1.slots[1].ok, w1.slots[1].ok_within_slo), (1, 0));
        assert_eq!((w1.slots[1].sends, w1.slots[1].late_sends), (2, 1));
        assert_eq!(w2.total().errors.get(&Failure::Timeout), Some(&1));
        assert_eq!(Summary::of(&w1.total(), w1.duration).late_fraction(), 0.5);
    }

    #[test]
    fn the_recorder_counts_successes_within_its_limit_exactly() {
        // Entry SLOs of 5 ms and none; a limit of 10 ms counts across both, exactly (10 ms
        // and 10.007 ms share a histogram bucket).
        let r = Recorder::with_limit(vec![Some(Duration::from_millis(5)), None], Some(Duration::from_millis(10)));
        r.open_window();
        for (slot, us) in [(0, 4_000), (0, 10_000), (1, 10_000), (1, 10_007), (1, 20_000)] {
            r.record(slot, Duration::from_micros(us), Ok(()), 1);
        }
        r.record(0, Duration::from_micros(1), Err(Failure::Timeout), 1);
        let w = r.close_window(Duration::from_secs(1), false);
        assert_eq!((w.slots[0].ok_within_limit, w.slots[1].ok_within_limit), (2, 1));
        assert_eq!(w.slots[0].ok_within_slo, 1);
        assert_eq!(Window::merge(&[w.clone(), w]).total().ok_within_limit, 6);
        // Without a limit nothing is counted.
        let r = Recorder::new(vec![None]);
        r.open_window();
        r.record(0, Duration::from_micros(1), Ok(()), 1);
        assert_eq!(r.close_window(Duration::from_secs(1), false).slots[0].ok_within_limit, 0);
        assert_eq!(lowest_equivalent_us(10_007), 10_000);
        assert_eq!(lowest_equivalent_us(1_500), 1_500, "exact below 2048 µs");
    }

    #[test]
    fn failure_labels_are_status_names() {
        assert_eq!(Failure::Grpc(14).label(), "UNAVAILABLE");
        assert_eq!(Failure::Http(429).label(), "HTTP 429");
        assert_eq!(Failure::Timeout.label(), "CLIENT_TIMEOUT");
        assert_eq!(Failure::Connection.label(), "CONNECTION");
    }
}
