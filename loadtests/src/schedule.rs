//! Load levels and arrival schedules: closed-loop concurrency, open-loop constant and Poisson
//! arrivals, and trace replay.
//!
//! Every schedule is a pure function of its inputs: the same `(distribution, rate, seed)` gives
//! the same offsets in every run of the same build, so two runs offer the server the same load.
//! Offsets are measured from the start of a load level; the driver sends each request at its
//! offset and measures latency from that scheduled time, not from when it managed to send
//! (no coordinated omission, see Gil Tene, "How NOT to Measure Latency").

use std::fmt;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// Most load levels one range may expand to; a typo like `1:100000` fails fast instead of
/// running for days.
pub const MAX_LEVELS: usize = 1_000;

/// Most arrivals in one trace file.
pub const MAX_TRACE_ARRIVALS: usize = 10_000_000;

/// How open-loop arrivals are spaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Distribution {
    /// Evenly spaced: request `i` at `i / rate`.
    Constant,
    /// A Poisson process: exponential gaps with mean `1 / rate`.
    Poisson,
}

/// One load level of a run.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadLevel {
    /// Closed loop: this many requests outstanding at all times; each completion starts the next.
    Concurrency(u32),
    /// Open loop: this many requests per second, spaced by the distribution.
    RequestRate { rate: f64, distribution: Distribution },
    /// Open loop: arrivals at the offsets of a trace file.
    Trace { arrivals: usize, offered_rate: f64 },
}

impl LoadLevel {
    /// The number a CSV row reports in its first column (`Concurrency` or `Request Rate`).
    pub fn value(&self) -> f64 {
        match self {
            LoadLevel::Concurrency(c) => *c as f64,
            LoadLevel::RequestRate { rate, .. } => *rate,
            LoadLevel::Trace { offered_rate, .. } => *offered_rate,
        }
    }

    pub fn is_open_loop(&self) -> bool {
        !matches!(self, LoadLevel::Concurrency(_))
    }
}

impl fmt::Display for LoadLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadLevel::Concurrency(c) => write!(f, "concurrency {c}"),
            LoadLevel::RequestRate { rate, distribution } => {
                let d = match distribution {
                    Distribution::Constant => "constant",
                    Distribution::Poisson => "poisson",
                };
                write!(f, "{rate} req/s ({d})")
            }
            LoadLevel::Trace { arrivals, offered_rate } => {
                write!(f, "trace ({arrivals} arrivals, {offered_rate:.1} req/s)")
            }
        }
    }
}

/// A range flag could not be parsed.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{flag} '{value}': {reason}")]
pub struct RangeError {
    pub flag: &'static str,
    pub value: String,
    pub reason: String,
}

/// Expands perf_analyzer's `start[:end[:step]]` for `--concurrency-range`: `end` defaults to
/// `start`, `step` to 1.
pub fn concurrency_levels(value: &str) -> Result<Vec<u32>, RangeError> {
    let err = |reason: String| RangeError { flag: "--concurrency-range", value: value.to_string(), reason };
    let (start, end, step) = concurrency_bounds(value)?;
    let levels: Vec<u32> = (start..=end).step_by(step as usize).take(MAX_LEVELS + 1).collect();
    if levels.len() > MAX_LEVELS {
        return Err(err(format!("expands to more than {MAX_LEVELS} levels")));
    }
    Ok(levels)
}

/// `--concurrency-range start[:end[:step]]` as `(start, end, step)`, validated but not expanded
/// (`--binary-search` probes between the bounds, so the range may be as wide as it likes).
pub fn concurrency_bounds(value: &str) -> Result<(u32, u32, u32), RangeError> {
    let err = |reason: String| RangeError { flag: "--concurrency-range", value: value.to_string(), reason };
    let parts = split_range(value).map_err(err)?;
    let parse = |s: &str| s.trim().parse::<u32>().map_err(|e| err(format!("'{s}' is not a whole number ({e})")));
    let start = parse(parts[0])?;
    let end = parts.get(1).map(|s| parse(s)).transpose()?.unwrap_or(start);
    let step = parts.get(2).map(|s| parse(s)).transpose()?.unwrap_or(1);
    if start == 0 {
        return Err(err("concurrency must be at least 1".into()));
    }
    if end < start {
        return Err(err(format!("end {end} is below start {start}")));
    }
    if step == 0 {
        return Err(err("step must be at least 1".into()));
    }
    Ok((start, end, step))
}

/// Expands `start[:end[:step]]` for `--request-rate-range` (requests per second, fractional
/// allowed): `end` defaults to `start`, `step` to 1.
pub fn rate_levels(value: &str) -> Result<Vec<f64>, RangeError> {
    let err = |reason: String| RangeError { flag: "--request-rate-range", value: value.to_string(), reason };
    let (start, end, step) = rate_bounds(value)?;
    let count = ((end - start) / step + 1e-9).floor() + 1.0;
    if count > MAX_LEVELS as f64 {
        return Err(err(format!("expands to more than {MAX_LEVELS} levels")));
    }
    Ok((0..count as usize).map(|i| start + step * i as f64).collect())
}

/// The lowest request rate accepted (requests per second).
pub const MIN_RATE: f64 = 0.001;

/// `--request-rate-range start[:end[:step]]` as `(start, end, step)`, validated but not expanded.
pub fn rate_bounds(value: &str) -> Result<(f64, f64, f64), RangeError> {
    let err = |reason: String| RangeError { flag: "--request-rate-range", value: value.to_string(), reason };
    let parts = split_range(value).map_err(err)?;
    let parse = |s: &str| {
        let v = s.trim().parse::<f64>().map_err(|e| err(format!("'{s}' is not a number ({e})")))?;
        if v.is_finite() { Ok(v) } else { Err(err(format!("'{s}' is not finite"))) }
    };
    let start = parse(parts[0])?;
    let end = parts.get(1).map(|s| parse(s)).transpose()?.unwrap_or(start);
    let step = parts.get(2).map(|s| parse(s)).transpose()?.unwrap_or(1.0);
    // Below one request per 1000 s, arrival offsets leave what a Duration holds.
    if start < MIN_RATE {
        return Err(err(format!("rate must be at least {MIN_RATE} requests/s")));
    }
    if end < start {
        return Err(err(format!("end {end} is below start {start}")));
    }
    if step <= 0.0 {
        return Err(err("step must be above 0".into()));
    }
    Ok((start, end, step))
}

fn split_range(value: &str) -> Result<Vec<&str>, String> {
    let parts: Vec<&str> = value.split(':').collect();
    if parts.is_empty() || parts.len() > 3 || parts.iter().any(|p| p.trim().is_empty()) {
        return Err("expected start[:end[:step]]".into());
    }
    Ok(parts)
}

/// An endless stream of arrival offsets for one open-loop level. Deterministic for a given
/// `(distribution, rate, seed)`.
pub struct Arrivals {
    distribution: Distribution,
    rate: f64,
    index: u64,
    now_secs: f64,
    rng: StdRng,
}

impl Arrivals {
    /// `rate` is in requests per second and must be positive and finite.
    pub fn new(distribution: Distribution, rate: f64, seed: u64) -> Self {
        assert!(rate > 0.0 && rate.is_finite(), "arrival rate must be positive, got {rate}");
        Arrivals { distribution, rate, index: 0, now_secs: 0.0, rng: StdRng::seed_from_u64(seed) }
    }
}

impl Iterator for Arrivals {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let at = match self.distribution {
            // Multiply rather than accumulate, so rounding does not drift over long runs.
            Distribution::Constant => self.index as f64 / self.rate,
            Distribution::Poisson => {
                // Inverse transform sampling of Exp(rate); 1 - u is in (0, 1], so ln is finite.
                let u: f64 = self.rng.random();
                let at = self.now_secs;
                self.now_secs += -(1.0 - u).ln() / self.rate;
                at
            }
        };
        self.index += 1;
        // Past what a Duration holds (a rate far below any validated one): no more arrivals.
        Duration::try_from_secs_f64(at).ok()
    }
}

/// Every arrival offset in `[0, duration)`, in order.
pub fn offsets(distribution: Distribution, rate: f64, seed: u64, duration: Duration) -> Vec<Duration> {
    Arrivals::new(distribution, rate, seed).take_while(|t| *t < duration).collect()
}

/// The seed of one load level, so levels of one run get independent but reproducible streams.
pub fn level_seed(seed: u64, level_index: usize) -> u64 {
    // SplitMix64 finaliser over (seed, index): nearby inputs give unrelated outputs.
    let mut z = seed ^ (level_index as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A trace file could not be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TraceError {
    #[error("line {line}: {reason}")]
    Line { line: usize, reason: String },
    #[error("the trace has no arrivals")]
    Empty,
    #[error("the trace has more than {MAX_TRACE_ARRIVALS} arrivals")]
    TooLong,
}

/// Parses a trace: one arrival offset per line in milliseconds (fractions allowed),
/// non-decreasing. Blank lines and lines starting with `#` are skipped. The offsets come back
/// rebased to the first arrival (which is at 0), so a trace cut from a longer log — its first
/// offset 60000 ms — is replayed from its first arrival, not after a minute of idle time that
/// would count in the measured window.
pub fn parse_trace(text: &str) -> Result<Vec<Duration>, TraceError> {
    let mut out = Vec::new();
    let mut last = 0.0f64;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |reason: String| TraceError::Line { line: i + 1, reason };
        let ms: f64 = line.parse().map_err(|_| err(format!("'{line}' is not an offset in milliseconds")))?;
        if !ms.is_finite() || ms < 0.0 {
            return Err(err(format!("offset {line} must be a non-negative number of milliseconds")));
        }
        if ms < last {
            return Err(err(format!(
                "offset {ms} ms is before the previous offset {last} ms; offsets must not decrease"
            )));
        }
        last = ms;
        if out.len() == MAX_TRACE_ARRIVALS {
            return Err(TraceError::TooLong);
        }
        let offset = Duration::try_from_secs_f64(ms / 1000.0)
            .map_err(|_| err(format!("offset {line} ms is beyond any run's length")))?;
        out.push(offset);
    }
    let Some(&first) = out.first() else {
        return Err(TraceError::Empty);
    };
    for offset in &mut out {
        *offset -= first;
    }
    Ok(out)
}

/// The average rate a trace offers: arrivals per second over its span.
pub fn trace_rate(offsets: &[Duration]) -> f64 {
    match (offsets.first(), offsets.last()) {
        (Some(first), Some(last)) if last > first => (offsets.len() - 1) as f64 / (*last - *first).as_secs_f64(),
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn concurrency_ranges_expand_like_perf_analyzer() {
        assert_eq!(concurrency_levels("4").unwrap(), vec![4]);
        assert_eq!(concurrency_levels("1:4").unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(concurrency_levels("1:8:3").unwrap(), vec![1, 4, 7]);
        assert!(concurrency_levels("0").unwrap_err().reason.contains("at least 1"));
        assert!(concurrency_levels("4:1").unwrap_err().reason.contains("below start"));
        assert!(concurrency_levels("1:2:0").unwrap_err().reason.contains("step"));
        assert!(concurrency_levels("a").unwrap_err().to_string().contains("--concurrency-range 'a'"));
        assert!(concurrency_levels("1::2").is_err());
        assert!(concurrency_levels("1:100000").unwrap_err().reason.contains("more than"));
        // Bounds are not expanded, so a search range may be wide.
        assert_eq!(concurrency_bounds("1:100000").unwrap(), (1, 100_000, 1));
        assert_eq!(concurrency_bounds("2:64:4").unwrap(), (2, 64, 4));
        assert!(concurrency_bounds("4:1").is_err());
    }

    #[test]
    fn rate_ranges_expand_with_fractions() {
        assert_eq!(rate_levels("100").unwrap(), vec![100.0]);
        assert_eq!(rate_levels("100:300:100").unwrap(), vec![100.0, 200.0, 300.0]);
        assert_eq!(rate_levels("0.5:1.5:0.5").unwrap(), vec![0.5, 1.0, 1.5]);
        assert!(rate_levels("0").is_err());
        assert!(rate_levels("nan").is_err());
        assert!(rate_levels("1:2:-1").is_err());
        assert_eq!(rate_bounds("10:100000").unwrap(), (10.0, 100_000.0, 1.0));
        assert!(rate_levels("10:100000").is_err());
    }

    #[test]
    fn constant_arrivals_are_evenly_spaced() {
        let o = offsets(Distribution::Constant, 1000.0, 7, Duration::from_millis(10));
        assert_eq!(o.len(), 10);
        for (i, t) in o.iter().enumerate() {
            assert_eq!(*t, Duration::from_millis(i as u64));
        }
    }

    #[test]
    fn poisson_mean_rate_is_close_for_a_fixed_seed() {
        let rate = 2_000.0;
        let duration = Duration::from_secs(50);
        let o = offsets(Distribution::Poisson, rate, 42, duration);
        let measured = o.len() as f64 / duration.as_secs_f64();
        // 100k arrivals: the standard error of the count is ~0.3%; allow 2%.
        assert!((measured - rate).abs() / rate < 0.02, "measured {measured} req/s");
        // Exponential gaps: the coefficient of variation is ~1 (constant spacing would give 0).
        let gaps: Vec<f64> = o.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        let cv = var.sqrt() / mean;
        assert!((cv - 1.0).abs() < 0.05, "coefficient of variation {cv}");
    }

    #[test]
    fn schedules_are_pure_functions_of_their_inputs() {
        let d = Duration::from_secs(1);
        assert_eq!(offsets(Distribution::Poisson, 500.0, 1, d), offsets(Distribution::Poisson, 500.0, 1, d));
        assert_ne!(offsets(Distribution::Poisson, 500.0, 1, d), offsets(Distribution::Poisson, 500.0, 2, d));
        assert_ne!(level_seed(1, 0), level_seed(1, 1));
        assert_eq!(level_seed(9, 3), level_seed(9, 3));
    }

    #[test]
    fn traces_parse_and_errors_name_the_line() {
        let t = parse_trace("# offsets in ms\n0\n\n1.5\n1.5\n10\n").unwrap();
        assert_eq!(
            t,
            vec![Duration::ZERO, Duration::from_micros(1500), Duration::from_micros(1500), Duration::from_millis(10)]
        );
        assert!((trace_rate(&t) - 300.0).abs() < 1e-6);
        assert_eq!(
            parse_trace("0\n5\n3\n").unwrap_err(),
            TraceError::Line {
                line: 3,
                reason: "offset 3 ms is before the previous offset 5 ms; offsets must not decrease".into()
            }
        );
        assert!(matches!(parse_trace("0\nabc\n").unwrap_err(), TraceError::Line { line: 2, .. }));
        assert!(matches!(parse_trace("-1\n").unwrap_err(), TraceError::Line { line: 1, .. }));
        // Beyond what a Duration holds: an error, not a panic.
        assert!(matches!(parse_trace("0\n1e23\n").unwrap_err(), TraceError::Line { line: 2, .. }));
        assert!(rate_bounds("1e-20").unwrap_err().reason.contains("at least 0.001"));
        assert_eq!(rate_levels("0.001").unwrap(), vec![0.001]);
        assert_eq!(parse_trace("# nothing\n").unwrap_err(), TraceError::Empty);
    }

    #[test]
    fn traces_are_replayed_from_their_first_arrival() {
        // Cut from a longer log: a minute in before its first arrival.
        let t = parse_trace("60000\n60000.5\n60010\n").unwrap();
        assert_eq!(t, vec![Duration::ZERO, Duration::from_micros(500), Duration::from_millis(10)]);
        assert!((trace_rate(&t) - 200.0).abs() < 1e-6, "the rate over its span, as before");
        assert_eq!(parse_trace("5\n").unwrap(), vec![Duration::ZERO]);
    }

    proptest! {
        #[test]
        fn offsets_are_monotonic_and_inside_the_duration(
            rate in 1.0f64..50_000.0,
            seed in any::<u64>(),
            ms in 1u64..200,
            poisson in any::<bool>(),
        ) {
            let dist = if poisson { Distribution::Poisson } else { Distribution::Constant };
            let d = Duration::from_millis(ms);
            let o = offsets(dist, rate, seed, d);
            prop_assert!(o.windows(2).all(|w| w[0] <= w[1]));
            prop_assert!(o.iter().all(|t| *t < d));
            if let Some(first) = o.first() {
                prop_assert_eq!(*first, Duration::ZERO);
            }
            if !poisson {
                // Constant spacing: exactly ceil(rate * duration) arrivals (within rounding).
                let expected = rate * d.as_secs_f64();
                prop_assert!((o.len() as f64 - expected).abs() <= 1.0 + 1e-6, "{} vs {}", o.len(), expected);
            }
        }

        #[test]
        fn rate_levels_stay_within_the_range(start in 1.0f64..100.0, span in 0.0f64..100.0, step in 0.5f64..50.0) {
            let spec = format!("{start}:{}:{step}", start + span);
            let levels = rate_levels(&spec).unwrap();
            prop_assert!(!levels.is_empty());
            prop_assert_eq!(levels[0], start);
            prop_assert!(levels.iter().all(|r| *r <= start + span + 1e-6));
            prop_assert!(levels.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
