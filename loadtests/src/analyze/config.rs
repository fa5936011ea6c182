//! A variant's `ModelConfig`: the base `config.pbtxt` with the instance count, max batch size
//! and dynamic batching settings of the variant. Pure; an invalid combination (a preferred
//! batch above the max batch, dynamic batching on a model that does not batch) is a skip
//! reason, not an error.

use nereid_common::config::{dynamic_batching, validate_model_config};
use nereid_proto::inference::model_config::SchedulingChoice;
use nereid_proto::inference::{ModelConfig, ModelDynamicBatching, ModelInstanceGroup};

use super::space::Variant;

/// Why a variant was not tried.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SkipReason(pub String);

/// Checks that the base config can be swept: a scheduler other than dynamic batching
/// (sequence batching, ensembles) cannot take the variant's settings.
pub fn check_base(base: &ModelConfig) -> Result<(), String> {
    match &base.scheduling_choice {
        None | Some(SchedulingChoice::DynamicBatching(_)) => Ok(()),
        Some(SchedulingChoice::SequenceBatching(_)) => {
            Err("the base config uses sequence_batching; only dynamic batching can be swept".into())
        }
        Some(SchedulingChoice::EnsembleScheduling(_)) => {
            Err("the base config is an ensemble; sweep its composing models instead".into())
        }
    }
}

/// The base config with `v` applied: one instance group of `v.instance_count` (keeping the
/// base's first group's kind and devices), `max_batch_size`, and — when the model batches —
/// `dynamic_batching` (the base's, or a default one) with the preferred batch size and queue
/// delay. A model that does not batch (`max_batch_size` 0) gets no dynamic batching.
pub fn variant_config(base: &ModelConfig, model: &str, v: &Variant) -> Result<ModelConfig, SkipReason> {
    let skip = |s: String| Err(SkipReason(s));
    if v.instance_count == 0 {
        return skip("instance_count must be at least 1".into());
    }
    if v.max_batch_size == 0 && (v.preferred_batch_size > 0 || v.max_queue_delay_us > 0) {
        return skip(format!(
            "max_batch_size 0 (no batching) cannot take a preferred batch size ({}) or queue delay ({} µs)",
            v.preferred_batch_size, v.max_queue_delay_us
        ));
    }
    if v.preferred_batch_size > v.max_batch_size {
        return skip(format!("preferred_batch_size {} > max_batch_size {}", v.preferred_batch_size, v.max_batch_size));
    }
    let (Ok(count), Ok(max_batch), Ok(preferred)) =
        (i32::try_from(v.instance_count), i32::try_from(v.max_batch_size), i32::try_from(v.preferred_batch_size))
    else {
        return skip("a value does not fit the config's 32-bit fields".into());
    };

    let mut config = base.clone();
    config.name = model.to_string();
    let group = base.instance_group.first().cloned().unwrap_or_default();
    config.instance_group = vec![ModelInstanceGroup { count, ..group }];
    config.max_batch_size = max_batch;
    if max_batch == 0 {
        config.scheduling_choice = None;
    } else {
        let mut db: ModelDynamicBatching = dynamic_batching(base).cloned().unwrap_or_default();
        db.preferred_batch_size = if preferred > 0 { vec![preferred] } else { vec![] };
        db.max_queue_delay_microseconds = v.max_queue_delay_us;
        config.scheduling_choice = Some(SchedulingChoice::DynamicBatching(db));
    }
    validate_model_config(&config).map_err(|e| SkipReason(format!("invalid config: {e}")))?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_common::config::{config_to_json, config_to_text, parse_model_config, parse_model_config_json};

    const BASE: &str = r#"
name: "identity_fp32"
backend: "onnxruntime"
max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 0 priority_levels: 2 default_priority_level: 1 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"#;

    fn v(i: u32, b: u32, p: u32, d: u64) -> Variant {
        Variant { instance_count: i, max_batch_size: b, preferred_batch_size: p, max_queue_delay_us: d }
    }

    #[test]
    fn applies_the_variant_and_keeps_the_rest() {
        let base = parse_model_config(BASE).unwrap();
        let c = variant_config(&base, "identity_fp32", &v(3, 16, 8, 250)).unwrap();
        assert_eq!(c.instance_group.len(), 1);
        assert_eq!(c.instance_group[0].count, 3);
        assert_eq!(c.instance_group[0].kind, base.instance_group[0].kind, "kind kept");
        assert_eq!(c.max_batch_size, 16);
        let db = dynamic_batching(&c).unwrap();
        assert_eq!(db.preferred_batch_size, vec![8]);
        assert_eq!(db.max_queue_delay_microseconds, 250);
        assert_eq!(db.priority_levels, 2, "the base's other batching settings are kept");
        assert_eq!(c.input, base.input);
        // Round trips through the text format (the recommended config.pbtxt) and the JSON
        // the repository API takes.
        assert_eq!(parse_model_config(&config_to_text(&c)).unwrap(), c);
        assert_eq!(parse_model_config_json(&config_to_json(&c).to_string()).unwrap(), c);
        // No preferred size: the list is empty.
        let c = variant_config(&base, "identity_fp32", &v(1, 8, 0, 0)).unwrap();
        assert!(dynamic_batching(&c).unwrap().preferred_batch_size.is_empty());
    }

    #[test]
    fn invalid_combinations_are_skipped_with_a_reason() {
        let base = parse_model_config(BASE).unwrap();
        let e = variant_config(&base, "m", &v(1, 8, 16, 0)).unwrap_err();
        assert_eq!(e.0, "preferred_batch_size 16 > max_batch_size 8");
        let e = variant_config(&base, "m", &v(1, 0, 0, 100)).unwrap_err();
        assert!(e.0.contains("max_batch_size 0"), "{e}");
        // No batching at all is a valid variant: no dynamic batching.
        let c = variant_config(&base, "m", &v(1, 0, 0, 0)).unwrap();
        assert!(c.scheduling_choice.is_none());
        assert_eq!(c.name, "m");
        // A config the server's own validation refuses is skipped with its message.
        let mut bad = base.clone();
        bad.input[0].dims = vec![0];
        assert!(variant_config(&bad, "m", &v(1, 8, 0, 0)).unwrap_err().0.contains("invalid config"));
    }

    #[test]
    fn base_schedulers_other_than_dynamic_batching_are_refused() {
        let seq = parse_model_config("name: \"s\"\nmax_batch_size: 2\nsequence_batching {}\n").unwrap();
        assert!(check_base(&seq).unwrap_err().contains("sequence_batching"));
        assert!(check_base(&parse_model_config(BASE).unwrap()).is_ok());
    }
}
