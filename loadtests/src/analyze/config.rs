//! A variant's `ModelConfig`: the base `config.pbtxt` with the instance count, max batch size
//! and dynamic batching settings (queue policy included) of the variant. Pure; an invalid
//! combination (a preferred batch above the max batch, dynamic batching or a queue policy on a
//! model that does not batch) is a skip reason, not an error.

use nereid_common::config::{dynamic_batching, validate_model_config};
use nereid_proto::inference::model_config::SchedulingChoice;
use nereid_proto::inference::model_queue_policy::TimeoutAction;
use nereid_proto::inference::{ModelConfig, ModelDynamicBatching, ModelInstanceGroup, ModelQueuePolicy};

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
/// delay, and — when the variant sets them — the default queue policy's `max_queue_size` and
/// `default_timeout_microseconds` with `timeout_action: REJECT` (a 0 leaves the base's policy
/// field as it is, none by default). With `priority_levels` set, `dynamic_batching` gets that
/// many levels with the lowest as `default_priority_level`; with 2 or more the queue policy
/// goes to `priority_queue_policy` for every level but the top one (which keeps the default
/// policy), so only lower priorities are shed. A model that does not batch (`max_batch_size`
/// 0) gets no dynamic batching, so a variant with a queue policy or priority levels on it is
/// skipped.
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
    if v.max_batch_size == 0 && v.priority_levels > 0 {
        return skip(format!("max_batch_size 0 (no batching) cannot take priority levels ({})", v.priority_levels));
    }
    if v.max_batch_size == 0 && v.has_queue_policy() {
        return skip(format!(
            "max_batch_size 0 (no batching) cannot take a queue policy (max_queue_size {}, timeout {} µs)",
            v.max_queue_size, v.queue_timeout_us
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
        if v.priority_levels > 0 {
            let levels = u64::from(v.priority_levels);
            db.priority_levels = levels;
            db.default_priority_level = levels;
            // The base's per-level policies of levels that no longer exist go.
            db.priority_queue_policy.retain(|&level, _| level <= levels);
        }
        if v.has_queue_policy() {
            let apply = |policy: &mut ModelQueuePolicy| {
                if v.max_queue_size > 0 {
                    policy.max_queue_size = v.max_queue_size;
                }
                if v.queue_timeout_us > 0 {
                    policy.default_timeout_microseconds = v.queue_timeout_us;
                    policy.timeout_action = TimeoutAction::Reject as i32;
                }
            };
            if v.priority_levels >= 2 {
                // Every level but the top one: the highest priority is never shed.
                let default = db.default_queue_policy.unwrap_or_default();
                for level in 2..=u64::from(v.priority_levels) {
                    apply(db.priority_queue_policy.entry(level).or_insert(default));
                }
            } else {
                apply(db.default_queue_policy.get_or_insert_with(ModelQueuePolicy::default));
            }
        }
        config.scheduling_choice = Some(SchedulingChoice::DynamicBatching(db));
    }
    validate_model_config(&config).map_err(|e| SkipReason(format!("invalid config: {e}")))?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_common::config::{
        Severity, config_to_json, config_to_text, parse_model_config, parse_model_config_json, unsupported_fields,
    };

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
        Variant::batching(i, b, p, d)
    }

    fn vq(i: u32, b: u32, q: u32, t: u64) -> Variant {
        Variant { max_queue_size: q, queue_timeout_us: t, ..v(i, b, 0, 0) }
    }

    /// What the worker checks before loading a config: it parses back from the JSON the
    /// repository API sends, passes `validate_model_config`, and sets no field Nereid refuses.
    fn assert_the_worker_accepts(c: &ModelConfig) {
        let sent = parse_model_config_json(&config_to_json(c).to_string()).unwrap();
        assert_eq!(&sent, c);
        validate_model_config(&sent).unwrap();
        let refused: Vec<_> = unsupported_fields(&sent).into_iter().filter(|f| f.severity == Severity::Error).collect();
        assert!(refused.is_empty(), "{refused:?}");
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
    fn writes_the_default_queue_policy_only_when_set() {
        let base = parse_model_config(BASE).unwrap();
        // No queue policy: nothing written, as before.
        let c = variant_config(&base, "identity_fp32", &v(1, 16, 0, 100)).unwrap();
        assert_eq!(dynamic_batching(&c).unwrap().default_queue_policy, None);
        assert!(!config_to_text(&c).contains("default_queue_policy"));

        let c = variant_config(&base, "identity_fp32", &Variant { max_queue_delay_us: 100, ..vq(2, 16, 64, 5000) })
            .unwrap();
        let db = dynamic_batching(&c).unwrap();
        let policy = db.default_queue_policy.as_ref().expect("a default queue policy");
        assert_eq!(policy.max_queue_size, 64);
        assert_eq!(policy.default_timeout_microseconds, 5000);
        assert_eq!(policy.timeout_action, TimeoutAction::Reject as i32);
        assert!(!policy.allow_timeout_override);
        assert_eq!(db.max_queue_delay_microseconds, 100, "the rest of the variant is applied");
        assert_eq!(db.priority_levels, 2, "the base's other batching settings are kept");
        // The recommended config.pbtxt round trips, and the worker takes it.
        let text = config_to_text(&c);
        assert!(text.contains("default_queue_policy"), "{text}");
        assert_eq!(parse_model_config(&text).unwrap(), c);
        assert_the_worker_accepts(&c);

        // One part only: the other field stays unset.
        let c = variant_config(&base, "m", &vq(1, 8, 4, 0)).unwrap();
        let policy = dynamic_batching(&c).unwrap().default_queue_policy.unwrap();
        assert_eq!((policy.max_queue_size, policy.default_timeout_microseconds), (4, 0));
        assert_the_worker_accepts(&c);
        let c = variant_config(&base, "m", &vq(1, 8, 0, 250)).unwrap();
        let policy = dynamic_batching(&c).unwrap().default_queue_policy.unwrap();
        assert_eq!((policy.max_queue_size, policy.default_timeout_microseconds), (0, 250));
        assert_the_worker_accepts(&c);
    }

    #[test]
    fn a_base_queue_policy_is_kept_where_the_variant_does_not_set_it() {
        let text = BASE.replace(
            "default_priority_level: 1 }",
            "default_priority_level: 1 default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 900 \
             allow_timeout_override: true max_queue_size: 16 } }",
        );
        let base = parse_model_config(&text).unwrap();
        let kept = dynamic_batching(&base).unwrap().default_queue_policy;
        assert!(kept.is_some());
        let c = variant_config(&base, "m", &v(1, 8, 0, 0)).unwrap();
        assert_eq!(dynamic_batching(&c).unwrap().default_queue_policy, kept, "no queue policy swept: the base's");
        let c = variant_config(&base, "m", &vq(1, 8, 4, 0)).unwrap();
        let p = dynamic_batching(&c).unwrap().default_queue_policy.unwrap();
        assert_eq!(p.max_queue_size, 4);
        assert_eq!((p.timeout_action, p.default_timeout_microseconds), (TimeoutAction::Delay as i32, 900));
        assert!(p.allow_timeout_override);
        let c = variant_config(&base, "m", &vq(1, 8, 0, 300)).unwrap();
        let p = dynamic_batching(&c).unwrap().default_queue_policy.unwrap();
        assert_eq!(p.max_queue_size, 16);
        assert_eq!((p.timeout_action, p.default_timeout_microseconds), (TimeoutAction::Reject as i32, 300));
        assert_the_worker_accepts(&c);
    }

    #[test]
    fn priority_levels_shed_every_level_but_the_top_one() {
        let base = parse_model_config(&BASE.replace("priority_levels: 2 default_priority_level: 1", "")).unwrap();
        let levels = |n: u32, q: u32, t: u64| Variant { priority_levels: n, ..vq(1, 8, q, t) };
        // Levels alone: the lowest is the default, no policy.
        let c = variant_config(&base, "m", &levels(3, 0, 0)).unwrap();
        let db = dynamic_batching(&c).unwrap();
        assert_eq!((db.priority_levels, db.default_priority_level), (3, 3));
        assert!(db.priority_queue_policy.is_empty() && db.default_queue_policy.is_none());
        assert_the_worker_accepts(&c);
        // With a queue policy: levels 2 and 3 get it, level 1 (and the default) does not.
        let c = variant_config(&base, "m", &levels(3, 4, 500)).unwrap();
        let db = dynamic_batching(&c).unwrap();
        assert_eq!(db.default_queue_policy, None, "the top level is not shed");
        let mut keys: Vec<u64> = db.priority_queue_policy.keys().copied().collect();
        keys.sort();
        assert_eq!(keys, [2, 3]);
        for p in db.priority_queue_policy.values() {
            assert_eq!((p.max_queue_size, p.default_timeout_microseconds), (4, 500));
            assert_eq!(p.timeout_action, TimeoutAction::Reject as i32);
        }
        let text = config_to_text(&c);
        assert!(text.contains("priority_queue_policy"), "{text}");
        assert_eq!(parse_model_config(&text).unwrap(), c);
        assert_the_worker_accepts(&c);
        // One level: nothing to protect, the default policy as without levels.
        let c = variant_config(&base, "m", &levels(1, 4, 0)).unwrap();
        let db = dynamic_batching(&c).unwrap();
        assert_eq!(db.default_queue_policy.as_ref().map(|p| p.max_queue_size), Some(4));
        assert!(db.priority_queue_policy.is_empty());
        // The base's own per-level policies: kept (and the swept fields set) where the level
        // still exists, dropped where it does not.
        let text = BASE.replace(
            "default_priority_level: 1 }",
            "default_priority_level: 1 priority_queue_policy { key: 2 value: { allow_timeout_override: true } } }",
        );
        let base = parse_model_config(&text).unwrap();
        let c = variant_config(&base, "m", &levels(2, 8, 0)).unwrap();
        let p = &dynamic_batching(&c).unwrap().priority_queue_policy[&2];
        assert!(p.allow_timeout_override && p.max_queue_size == 8);
        let text = text.replace("key: 2", "key: 1");
        let c = variant_config(&parse_model_config(&text).unwrap(), "m", &levels(1, 0, 0)).unwrap();
        assert_eq!(dynamic_batching(&c).unwrap().priority_queue_policy.len(), 1, "level 1 exists");
        let e = variant_config(&base, "m", &Variant { priority_levels: 2, ..v(1, 0, 0, 0) }).unwrap_err();
        assert!(e.0.contains("priority levels"), "{e}");
    }

    #[test]
    fn invalid_combinations_are_skipped_with_a_reason() {
        let base = parse_model_config(BASE).unwrap();
        let e = variant_config(&base, "m", &v(1, 8, 16, 0)).unwrap_err();
        assert_eq!(e.0, "preferred_batch_size 16 > max_batch_size 8");
        let e = variant_config(&base, "m", &v(1, 0, 0, 100)).unwrap_err();
        assert!(e.0.contains("max_batch_size 0"), "{e}");
        let e = variant_config(&base, "m", &vq(1, 0, 4, 0)).unwrap_err();
        assert!(e.0.contains("max_batch_size 0") && e.0.contains("queue policy"), "{e}");
        let e = variant_config(&base, "m", &vq(1, 0, 0, 500)).unwrap_err();
        assert!(e.0.contains("queue policy (max_queue_size 0, timeout 500 µs)"), "{e}");
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
