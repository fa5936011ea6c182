//! What a sweep records per variant: its config, whether it was measured (or why not), and
//! the numbers. Serializable both ways: the checkpoint and `results.json` hold these.

use serde::{Deserialize, Serialize};

use super::space::Variant;

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
    pub requests_per_sec: f64,
    /// Successful inferences within the SLO per second (equal to throughput without an SLO).
    pub goodput_infer_per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub avg_ms: f64,
    pub requests: u64,
    pub errors: u64,
    /// Whether the measurement windows agreed (nereid-perf's stability rule).
    pub stable: bool,
    /// Whether at least 99% of requests succeeded within the SLO (`None` without an SLO).
    pub slo_met: Option<bool>,
    /// The worker's peak resident set size during the level, in MiB (`None`: unknown).
    pub memory_mb: Option<f64>,
    /// Most GPU memory the server reported in use (`nv_gpu_memory_used_bytes`, summed over
    /// its GPUs) at the level's scrapes, in MiB (`None`: no GPU, or `/metrics` not scraped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_mb: Option<f64>,
    /// Average batch the server executed, from `/metrics` (`None` when not scraped).
    pub server_avg_batch_size: Option<f64>,
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

    /// The measurement, when the variant was measured and something succeeded.
    pub fn usable(&self) -> Option<&Measured> {
        self.measured.as_ref().filter(|m| self.status == VariantStatus::Measured && m.requests > m.errors)
    }
}
