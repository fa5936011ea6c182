//! What a sweep records per variant: its config, whether it was measured (or why not), and
//! the numbers. Serializable both ways: the checkpoint and `results.json` hold these.

use serde::{Deserialize, Serialize};

use super::space::Variant;
use crate::driver::{LATE_BOUND, MAX_LATE_FRACTION};

/// What became of a variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VariantStatus {
    /// Loaded and measured.
    Measured,
    /// Not tried: its config is invalid (the reason says why).
    Skipped,
    /// The server refused to load it (the reason is the server's message).
    LoadFailed,
    /// Loaded but not measured to the end: no request succeeded, or the server was lost.
    Failed,
}

impl VariantStatus {
    /// Whether `--resume` reuses a checkpointed result with this status instead of trying
    /// again (a failed measurement is retried: the server may have been lost mid-way).
    pub fn is_final(self) -> bool {
        !matches!(self, VariantStatus::Failed)
    }

    pub fn label(self) -> &'static str {
        match self {
            VariantStatus::Measured => "measured",
            VariantStatus::Skipped => "skipped",
            VariantStatus::LoadFailed => "load failed",
            VariantStatus::Failed => "failed",
        }
    }
}

/// The numbers of one measured variant (one load level of nereid-perf's driver).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measured {
    /// Successful inferences (rows) per second.
    pub throughput_infer_per_sec: f64,
    /// *Successful* requests per second (failures not counted; `requests` counts both).
    pub requests_per_sec: f64,
    /// Successful inferences within the SLO per second (equal to throughput without an SLO).
    pub goodput_infer_per_sec: f64,
    pub p50_ms: f64,
    /// Absent in checkpoints from before the percentile plot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p90_ms: Option<f64>,
    pub p99_ms: f64,
    /// p99.9 (absent in checkpoints from before the percentile plot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p999_ms: Option<f64>,
    pub avg_ms: f64,
    /// Completed requests: successes plus `errors`.
    pub requests: u64,
    pub errors: u64,
    /// Whether the measurement windows agreed (nereid-perf's stability rule). An unstable
    /// variant is reported but neither recommended nor on the frontier.
    pub stable: bool,
    /// Open loop: requests the generator sent, and those it sent more than
    /// [`LATE_BOUND`] after their scheduled time (0 and 0 in closed loop). More than
    /// [`MAX_LATE_FRACTION`] late is nereid-perf's "could not keep the schedule": the offered
    /// load was lower than asked, so the variant is reported but not trusted.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub sends: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub late_sends: u64,
    /// Whether at least 99% of requests succeeded within the SLO — every class within its own
    /// (`None` without an SLO, or when a class with an SLO completed no request).
    pub slo_met: Option<bool>,
    /// Successful requests within `--max-p99-ms` (counted exactly, whatever each class's
    /// SLO), and that limit: what the p99 constraint is judged by. Absent without the
    /// constraint, and in checkpoints from before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub within_limit: Option<WithinLimit>,
    /// The worker's peak resident set size during the level, in MiB (`None`: unknown).
    pub memory_mb: Option<f64>,
    /// Most GPU memory the server reported in use (`nv_gpu_memory_used_bytes`, summed over
    /// its GPUs) at the level's scrapes, in MiB (`None`: no GPU, or `/metrics` not scraped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_mb: Option<f64>,
    /// Average batch the server executed, from `/metrics` (`None` when not scraped).
    pub server_avg_batch_size: Option<f64>,
    /// The server's time per request, from `/metrics`: queue vs compute (`None` when not
    /// scraped, or in checkpoints from before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_time: Option<ServerTime>,
    /// The closed-loop level measured (absent in checkpoints from before load ranges).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
    /// The open-loop level measured, requests per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_rate: Option<f64>,
    /// Per class (or tenant) of a `--workload` with several: what each got at this level —
    /// how a priority or queue policy shares the capacity out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub series: Vec<SeriesMeasured>,
}

/// Successes within a latency limit, counted while measuring.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WithinLimit {
    pub limit_ms: f64,
    pub ok: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The server's average time per successful request over a level's merged windows, in µs
/// (nereid-perf's breakdown from Triton's `nv_inference_*_duration_us` counters).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTime {
    pub queue_us: f64,
    pub compute_input_us: f64,
    pub compute_infer_us: f64,
    pub compute_output_us: f64,
}

/// One workload series' numbers at a level.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeriesMeasured {
    pub name: String,
    pub throughput_infer_per_sec: f64,
    pub goodput_infer_per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub requests: u64,
    pub errors: u64,
    /// The series' SLO (`None` without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_ms: Option<f64>,
}

impl Measured {
    /// Share of open-loop sends that were late (0 in closed loop).
    pub fn late_fraction(&self) -> f64 {
        if self.sends == 0 { 0.0 } else { self.late_sends as f64 / self.sends as f64 }
    }

    /// Whether the open-loop generator kept its schedule (nereid-perf's rule: at most
    /// [`MAX_LATE_FRACTION`] of sends late); always true in closed loop.
    pub fn kept_schedule(&self) -> bool {
        self.late_fraction() <= MAX_LATE_FRACTION
    }

    /// Why these numbers cannot be trusted (nereid-perf's exit 5 reasons), or `None`.
    pub fn distrust(&self) -> Option<String> {
        let mut why = Vec::new();
        if !self.stable {
            why.push("no stable measurement within --max-trials windows".to_string());
        }
        let no_data: Vec<String> = self
            .series
            .iter()
            .filter(|s| s.slo_ms.is_some() && s.requests == 0)
            .map(|s| format!("'{}'", s.name))
            .collect();
        if !no_data.is_empty() && self.requests > 0 {
            why.push(format!(
                "no request of {} completed, so its SLO cannot be judged (longer windows or a larger weight)",
                no_data.join(", ")
            ));
        }
        if !self.kept_schedule() {
            why.push(format!(
                "the generator could not keep the schedule: {:.1}% of sends started more than {} ms late (limit {}%), \
                 so the offered load was lower than asked",
                100.0 * self.late_fraction(),
                LATE_BOUND.as_millis(),
                MAX_LATE_FRACTION * 100.0
            ));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }

    /// Whether something succeeded and the measurement can be trusted.
    pub fn trusted(&self) -> bool {
        self.requests > self.errors && self.distrust().is_none()
    }

    /// `c=8`, `100 req/s`, or empty when the level is not recorded.
    pub fn level_label(&self) -> String {
        match (self.concurrency, self.request_rate) {
            (Some(c), _) => format!("c={c}"),
            (None, Some(r)) => format!("{r} req/s"),
            _ => String::new(),
        }
    }
}

/// One variant's record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VariantResult {
    /// [`Variant::key`]: what `--resume` matches on.
    pub key: String,
    pub variant: Variant,
    pub status: VariantStatus,
    /// Why it was skipped or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The full ModelConfig sent to the server, as protobuf JSON (absent when skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<serde_json::Value>,
    /// The credited level when the variant was measured at several load levels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<Measured>,
    /// Every load level measured, in order, when there were several (`measured` is the best).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub levels: Vec<Measured>,
}

impl VariantResult {
    pub fn new(variant: Variant, status: VariantStatus) -> Self {
        VariantResult {
            key: variant.key(),
            variant,
            status,
            reason: None,
            config: None,
            measured: None,
            levels: Vec::new(),
        }
    }

    /// The numbers, when the variant was measured and something succeeded, trusted or not:
    /// what the table and the plots show.
    pub fn numbers(&self) -> Option<&Measured> {
        self.measured.as_ref().filter(|m| self.status == VariantStatus::Measured && m.requests > m.errors)
    }

    /// The measurement when it can be ranked: measured, something succeeded, stable, and (open
    /// loop) the schedule kept. Only these are on the frontier or recommended.
    pub fn usable(&self) -> Option<&Measured> {
        self.numbers().filter(|m| m.trusted())
    }

    /// Why a measured variant is left out of the frontier and the recommendation, if it is.
    pub fn untrusted_reason(&self) -> Option<String> {
        self.numbers().and_then(Measured::distrust)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analyze::frontier::tests::measured;

    fn result(status: VariantStatus, m: Measured) -> VariantResult {
        let mut r = VariantResult::new(Variant::batching(1, 8, 0, 0), status);
        r.measured = Some(m);
        r
    }

    #[test]
    fn only_stable_measurements_that_kept_their_schedule_are_usable() {
        let ok = measured(100.0, 100.0, 2.0, None);
        assert!(ok.trusted() && ok.distrust().is_none());
        assert!(result(VariantStatus::Measured, ok.clone()).usable().is_some());

        let unstable = Measured { stable: false, ..ok.clone() };
        let r = result(VariantStatus::Measured, unstable);
        assert!(r.usable().is_none(), "unstable: not ranked");
        assert!(r.numbers().is_some(), "but its numbers are still shown");
        assert!(r.untrusted_reason().unwrap().contains("no stable measurement"));

        // nereid-perf's rule: at most 1% of open-loop sends late.
        let at_limit = Measured { sends: 1000, late_sends: 10, ..ok.clone() };
        assert!(at_limit.kept_schedule() && result(VariantStatus::Measured, at_limit).usable().is_some());
        let behind = Measured { sends: 1000, late_sends: 11, ..ok.clone() };
        assert!(!behind.kept_schedule());
        let r = result(VariantStatus::Measured, behind);
        assert!(r.usable().is_none() && r.numbers().is_some());
        let why = r.untrusted_reason().unwrap();
        assert!(why.contains("could not keep the schedule: 1.1% of sends started more than 1 ms late"), "{why}");
        // Both at once: both reasons.
        let both = Measured { stable: false, sends: 10, late_sends: 5, ..ok.clone() };
        assert_eq!(both.distrust().unwrap().matches("; ").count(), 1);
        // Closed loop sends nothing on a schedule: never late.
        assert_eq!(ok.late_fraction(), 0.0);

        // Nothing succeeded, or not measured to the end: neither numbers nor usable.
        let failed = Measured { errors: 100, ..ok.clone() };
        assert!(result(VariantStatus::Measured, failed).numbers().is_none());
        let r = result(VariantStatus::Failed, ok);
        assert!(r.numbers().is_none() && r.usable().is_none() && r.untrusted_reason().is_none());
    }

    #[test]
    fn a_class_with_no_requests_makes_the_level_untrusted() {
        let class = |name: &str, requests: u64, slo_ms: Option<f64>| SeriesMeasured {
            name: name.into(),
            throughput_infer_per_sec: requests as f64,
            goodput_infer_per_sec: requests as f64,
            p50_ms: 1.0,
            p99_ms: 1.0,
            requests,
            errors: 0,
            slo_ms,
        };
        let mut m = measured(100.0, 100.0, 2.0, None);
        m.series = vec![class("common", 100, Some(5.0)), class("rare", 0, Some(5.0))];
        assert!(!m.trusted());
        assert!(m.distrust().unwrap().contains("no request of 'rare' completed"));
        // A class without an SLO has nothing to judge.
        m.series[1].slo_ms = None;
        assert!(m.trusted());
    }

    #[test]
    fn measurements_from_older_checkpoints_still_read() {
        // Written before late sends, p90/p99.9 and the server's time were kept.
        let old = r#"{"throughput_infer_per_sec": 10.0, "requests_per_sec": 10.0, "goodput_infer_per_sec": 10.0,
            "p50_ms": 1.0, "p99_ms": 2.0, "avg_ms": 1.0, "requests": 50, "errors": 0, "stable": true,
            "slo_met": null, "memory_mb": 80.0, "server_avg_batch_size": 1.0}"#;
        let m: Measured = serde_json::from_str(old).unwrap();
        assert_eq!((m.sends, m.late_sends, m.p90_ms, m.p999_ms, m.server_time), (0, 0, None, None, None));
        assert!(m.trusted());
        // And a closed-loop measurement writes no late-send fields.
        let text = serde_json::to_string(&m).unwrap();
        assert!(!text.contains("sends") && !text.contains("server_time"), "{text}");
        let late = Measured { sends: 100, late_sends: 7, ..m };
        let back: Measured = serde_json::from_str(&serde_json::to_string(&late).unwrap()).unwrap();
        assert_eq!(back, late);
    }
}
