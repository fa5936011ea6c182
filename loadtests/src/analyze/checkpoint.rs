//! The sweep's checkpoint: every variant's result so far, rewritten (atomically, through a
//! temporary file) after each variant, so an interrupted or crashed sweep loses at most the
//! variant it was measuring. `--resume` reads it back and reuses every final result whose
//! key matches (see [`VariantStatus::is_final`](super::result::VariantStatus::is_final)).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::result::VariantResult;

/// Bumped when the format changes incompatibly.
pub const CHECKPOINT_FORMAT: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    pub format: u32,
    pub model: String,
    /// The load each variant was measured with (`concurrency 4`), to warn on a resume that
    /// measures differently.
    pub load: String,
    /// Everything the numbers depend on besides the variant (protocol, load, SLO, measurement,
    /// seed, the base config), as written: a resume under other settings reuses nothing.
    /// Empty in checkpoints written before it was kept.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub settings: String,
    pub results: Vec<VariantResult>,
}

/// A checkpoint that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: cannot read it: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("checkpoint {path}: not a nereid-analyze checkpoint: {source}")]
    Parse { path: String, source: serde_json::Error },
    #[error("checkpoint {path}: format {found}, this nereid-analyze reads format {CHECKPOINT_FORMAT}")]
    Format { path: String, found: u32 },
    #[error("checkpoint {path}: it is for model '{found}', not '{expected}'")]
    Model { path: String, found: String, expected: String },
    #[error("checkpoint {path}: cannot write it: {source}")]
    Write { path: String, source: std::io::Error },
}

impl Checkpoint {
    pub fn new(model: &str, load: &str) -> Checkpoint {
        Checkpoint {
            format: CHECKPOINT_FORMAT,
            model: model.into(),
            load: load.into(),
            settings: String::new(),
            results: Vec::new(),
        }
    }

    /// Reads `path`; `Ok(None)` when it does not exist. A checkpoint for another model or
    /// format is an error.
    pub fn read(path: &Path, model: &str) -> Result<Option<Checkpoint>, CheckpointError> {
        let shown = path.display().to_string();
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(CheckpointError::Read { path: shown, source }),
        };
        let c: Checkpoint =
            serde_json::from_str(&text).map_err(|source| CheckpointError::Parse { path: shown.clone(), source })?;
        if c.format != CHECKPOINT_FORMAT {
            return Err(CheckpointError::Format { path: shown, found: c.format });
        }
        if c.model != model {
            return Err(CheckpointError::Model { path: shown, found: c.model, expected: model.into() });
        }
        Ok(Some(c))
    }

    /// Writes the checkpoint to `path` through a temporary file and a rename.
    pub fn write(&self, path: &Path) -> Result<(), CheckpointError> {
        let err = |source| CheckpointError::Write { path: path.display().to_string(), source };
        let text = serde_json::to_string_pretty(self).expect("a checkpoint serializes");
        let tmp = path.with_extension("tmp~");
        std::fs::write(&tmp, text).map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)
    }

    /// The final result recorded for `key`, if any (what `--resume` reuses). An untrusted
    /// measurement (unstable, or the schedule not kept) is not final: the remedy exit 5
    /// suggests (longer windows, more trials) must be able to measure it again.
    pub fn reusable(&self, key: &str) -> Option<&VariantResult> {
        self.results.iter().rev().find(|r| r.key == key && r.status.is_final() && r.untrusted_reason().is_none())
    }

    /// Records `result`, replacing an earlier one for the same key.
    pub fn record(&mut self, result: VariantResult) {
        self.results.retain(|r| r.key != result.key);
        self.results.push(result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analyze::result::{Measured, ServerTime, VariantStatus};
    use crate::analyze::space::Variant;

    fn v(i: u32, d: u64) -> Variant {
        Variant::batching(i, 8, 0, d)
    }

    fn sample() -> Checkpoint {
        let mut c = Checkpoint::new("identity_fp32", "concurrency 4");
        let mut measured = VariantResult::new(v(1, 0), VariantStatus::Measured);
        measured.config = Some(serde_json::json!({"name": "identity_fp32", "max_batch_size": 8}));
        measured.measured = Some(Measured {
            throughput_infer_per_sec: 1234.5,
            requests_per_sec: 1234.5,
            goodput_infer_per_sec: 1200.25,
            p50_ms: 0.5,
            p90_ms: Some(1.0),
            p99_ms: 2.125,
            p999_ms: Some(3.5),
            avg_ms: 0.75,
            requests: 5000,
            errors: 0,
            stable: true,
            sends: 5000,
            late_sends: 60,
            slo_met: Some(true),
            within_limit: None,
            memory_mb: Some(87.5),
            gpu_memory_mb: None,
            server_avg_batch_size: Some(3.25),
            server_time: Some(ServerTime {
                queue_us: 120.5,
                compute_input_us: 3.0,
                compute_infer_us: 40.25,
                compute_output_us: 2.0,
            }),
            concurrency: None,
            request_rate: None,
            series: Vec::new(),
        });
        c.record(measured);
        let mut skipped = VariantResult::new(v(1, 100), VariantStatus::Skipped);
        skipped.reason = Some("preferred_batch_size 16 > max_batch_size 8".into());
        c.record(skipped);
        let mut failed = VariantResult::new(v(2, 0), VariantStatus::Failed);
        failed.reason = Some("the server was lost".into());
        c.record(failed);
        c
    }

    #[test]
    fn round_trips_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        assert!(Checkpoint::read(&path, "identity_fp32").unwrap().is_none(), "absent is not an error");
        let c = sample();
        c.write(&path).unwrap();
        let back = Checkpoint::read(&path, "identity_fp32").unwrap().unwrap();
        assert_eq!(back, c);
        assert!(!path.with_extension("tmp~").exists());
        // What makes a measurement untrusted survives a resume: 60 of 5000 sends late (1.2%).
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"late_sends\": 60") && text.contains("\"queue_us\": 120.5"), "{text}");
        let kept = back.results.iter().find(|r| r.key == "i1_b8_p0_d0").unwrap();
        assert!(kept.usable().is_none() && kept.untrusted_reason().unwrap().contains("1.2% of sends"));
    }

    #[test]
    fn resume_reuses_final_results_only() {
        let mut c = sample();
        assert!(c.reusable("i1_b8_p0_d0").is_none(), "an untrusted measurement is measured again");
        let mut trusted = c.results[0].clone();
        trusted.measured.as_mut().unwrap().late_sends = 0;
        c.record(trusted);
        assert!(c.reusable("i1_b8_p0_d0").is_some(), "a trusted measurement is final");
        assert!(c.reusable("i1_b8_p0_d100").is_some(), "a skip is final");
        assert!(c.reusable("i2_b8_p0_d0").is_none(), "a failed measurement is retried");
        assert!(c.reusable("i9_b8_p0_d0").is_none());
        // A later result for the same key replaces the earlier one.
        c.record(VariantResult::new(v(2, 0), VariantStatus::LoadFailed));
        assert_eq!(c.results.len(), 3);
        assert_eq!(c.reusable("i2_b8_p0_d0").unwrap().status, VariantStatus::LoadFailed);
    }

    #[test]
    fn checkpoints_from_before_queue_policy_sweeps_still_resume() {
        // Written by a nereid-analyze that could not sweep the queue policy.
        let old = r#"{
  "format": 1,
  "model": "identity_fp32",
  "load": "concurrency 4",
  "results": [
    {
      "key": "i1_b8_p0_d100",
      "variant": { "instance_count": 1, "max_batch_size": 8, "preferred_batch_size": 0, "max_queue_delay_us": 100 },
      "status": "skipped",
      "reason": "an old reason"
    }
  ]
}"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        std::fs::write(&path, old).unwrap();
        let mut c = Checkpoint::read(&path, "identity_fp32").unwrap().unwrap();
        let r = c.reusable(&v(1, 100).key()).expect("the same key without a queue policy");
        assert_eq!(r.variant, v(1, 100));
        // Written back unchanged in form; a queue-policy variant has its own key.
        c.write(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("max_queue_size") && !text.contains("queue_timeout_us"), "{text}");
        let q = Variant { max_queue_size: 4, queue_timeout_us: 1000, ..v(1, 100) };
        assert_eq!(q.key(), "i1_b8_p0_d100_q4_t1000");
        assert!(c.reusable(&q.key()).is_none(), "not confused with the plain variant");
        c.record(VariantResult::new(q, VariantStatus::Skipped));
        c.write(&path).unwrap();
        let back = Checkpoint::read(&path, "identity_fp32").unwrap().unwrap();
        assert_eq!(back.reusable("i1_b8_p0_d100_q4_t1000").unwrap().variant, q);
        assert_eq!(back.results.len(), 2);
    }

    #[test]
    fn refuses_another_model_or_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.json");
        sample().write(&path).unwrap();
        let e = Checkpoint::read(&path, "mlp_fp32").unwrap_err().to_string();
        assert!(e.contains("'identity_fp32', not 'mlp_fp32'"), "{e}");
        std::fs::write(&path, "{\"format\": 1}").unwrap();
        assert!(Checkpoint::read(&path, "m").unwrap_err().to_string().contains("not a nereid-analyze checkpoint"));
        std::fs::write(&path, "{\"format\": 99, \"model\": \"m\", \"load\": \"\", \"results\": []}").unwrap();
        assert!(Checkpoint::read(&path, "m").unwrap_err().to_string().contains("format 99"));
    }
}
