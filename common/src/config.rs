//! Triton `config.pbtxt` loading: protobuf text format of `inference.ModelConfig`, parsed against
//! the real message schema (a descriptor compiled from `proto/`), so every valid Triton config
//! parses, an unknown field is an error naming it and its line, and a field Nereid does not
//! implement is reported by name.
//!
//! Fields Nereid does not implement fall in two groups (see [`unsupported_fields`]):
//! - **errors**: fields that would change results or the request protocol if ignored
//!   (`sequence_batching`, an ensemble step's `model_namespace`, decoupled transactions, ragged batching, shape
//!   tensors, `batch_input`/`batch_output`): the model fails to load and the reason
//!   names the field;
//! - **warnings**: fields that only tune a backend Nereid does not have (`optimization` other
//!   than `optimization.graph.level`, `rate_limiter`, `model_repository_agents`, ...): the model
//!   loads, the warning is logged and shown as the `reason` of its READY rows in the repository
//!   index (HTTP and gRPC).

use std::sync::OnceLock;

use nereid_proto::inference::ModelConfig;
use nereid_proto::inference::ModelDynamicBatching;
use nereid_proto::inference::model_config::SchedulingChoice;
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, Value};

use crate::dtype::DataType;

/// A config that failed to parse or validate, with the line (1-based) when it is known.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", line.map(|l| format!("line {l}: ")).unwrap_or_default())]
pub struct ConfigError {
    pub line: Option<usize>,
    pub message: String,
}

impl ConfigError {
    pub fn new(message: impl Into<String>) -> Self {
        ConfigError { line: None, message: message.into() }
    }
}

/// How a field Nereid does not implement is treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    Warning,
    Error,
}

/// A set field that Nereid does not implement, by its dotted path (`input.is_shape_tensor`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnsupportedField {
    pub path: String,
    pub severity: Severity,
}

fn pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(nereid_proto::FILE_DESCRIPTOR_SET)
            .expect("descriptor set compiled into nereid-proto is valid")
    })
}

fn model_config_descriptor() -> MessageDescriptor {
    pool().get_message_by_name("inference.ModelConfig").expect("inference.ModelConfig is in the descriptor set")
}

/// The text of a `config.pbtxt` file. Bytes that are not UTF-8 are accepted in comments (a
/// comment saved in Latin-1 or another legacy encoding, which Triton's parser skips) and
/// replaced there; anywhere else they are an error naming the line.
pub fn config_text(bytes: &[u8]) -> Result<std::borrow::Cow<'_, str>, ConfigError> {
    if let Ok(text) = std::str::from_utf8(bytes) {
        return Ok(std::borrow::Cow::Borrowed(text));
    }
    let mut text = String::with_capacity(bytes.len());
    for (number, line) in bytes.split_inclusive(|&b| b == b'\n').enumerate() {
        match std::str::from_utf8(line) {
            Ok(line) => text.push_str(line),
            Err(e) => {
                let invalid_at = e.valid_up_to();
                if !comment_starts_before(&line[..invalid_at]) {
                    return Err(ConfigError::new(format!(
                        "line {}: byte {} is not UTF-8 (only comments may hold other encodings)",
                        number + 1,
                        invalid_at + 1
                    )));
                }
                text.push_str(&String::from_utf8_lossy(line));
            }
        }
    }
    Ok(std::borrow::Cow::Owned(text))
}

/// Whether `prefix` (the start of a line) opens a `#` comment outside any string literal.
fn comment_starts_before(prefix: &[u8]) -> bool {
    let mut quote: Option<u8> = None;
    let mut escaped = false;
    for &b in prefix {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == q {
                    quote = None;
                }
            }
            None if b == b'"' || b == b'\'' => quote = Some(b),
            None if b == b'#' => return true,
            None => {}
        }
    }
    false
}

/// Parses `config.pbtxt` text into a `ModelConfig`.
pub fn parse_model_config(text: &str) -> Result<ModelConfig, ConfigError> {
    let message = parse_dynamic(text)?;
    message
        .transcode_to::<ModelConfig>()
        .map_err(|e| ConfigError::new(format!("config does not decode as ModelConfig: {e}")))
}

/// Parses a config given as JSON (the repository load API's `config` parameter), with the
/// protobuf JSON mapping Triton uses (proto or camelCase field names).
pub fn parse_model_config_json(text: &str) -> Result<ModelConfig, ConfigError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let message = DynamicMessage::deserialize(model_config_descriptor(), &mut de)
        .map_err(|e| ConfigError { line: Some(e.line()), message: format!("invalid JSON model config: {e}") })?;
    message
        .transcode_to::<ModelConfig>()
        .map_err(|e| ConfigError::new(format!("config does not decode as ModelConfig: {e}")))
}

fn parse_dynamic(text: &str) -> Result<DynamicMessage, ConfigError> {
    let prepared = insert_list_colons(text);
    DynamicMessage::parse_text_format(model_config_descriptor(), &prepared).map_err(|e| {
        use miette::Diagnostic;
        // The pre-pass inserts only ':' characters, so line numbers are unchanged.
        let offset = e
            .labels()
            .and_then(|mut labels| labels.next())
            .map(|label| label.offset())
            // Errors at the end of input carry no span: they point past the last line.
            .unwrap_or(prepared.trim_end().len());
        let line = Some(prepared[..offset.min(prepared.len())].matches('\n').count() + 1);
        ConfigError { line, message: e.to_string() }
    })
}

/// Protobuf text format allows `field [ ... ]` without a colon for repeated fields, and every
/// Triton config uses it; prost-reflect only accepts `field: [ ... ]`. Insert the colon where a
/// `[` directly follows an identifier, skipping strings and `#` comments. Inserts nothing else.
pub fn insert_list_colons(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 16);
    let mut chars = text.chars().peekable();
    let mut last_significant: Option<char> = None;
    while let Some(c) = chars.next() {
        match c {
            '#' => {
                out.push(c);
                for c in chars.by_ref() {
                    out.push(c);
                    if c == '\n' {
                        break;
                    }
                }
            }
            '"' | '\'' => {
                out.push(c);
                let quote = c;
                while let Some(c) = chars.next() {
                    out.push(c);
                    if c == '\\' {
                        if let Some(escaped) = chars.next() {
                            out.push(escaped);
                        }
                    } else if c == quote || c == '\n' {
                        break;
                    }
                }
                last_significant = Some(quote);
            }
            '[' => {
                if last_significant.is_some_and(|p| p.is_ascii_alphanumeric() || p == '_') {
                    out.push(':');
                }
                out.push(c);
                last_significant = Some(c);
            }
            c if c.is_whitespace() => out.push(c),
            c => {
                out.push(c);
                last_significant = Some(c);
            }
        }
    }
    out
}

/// Lists the fields set in `config` that Nereid does not implement.
pub fn unsupported_fields(config: &ModelConfig) -> Vec<UnsupportedField> {
    let dynamic = config.transcode_to_dynamic();
    let mut found = Vec::new();
    walk(&dynamic, "", &mut found);
    found
}

fn classify(path: &str) -> Option<Severity> {
    use Severity::*;
    Some(match path {
        "sequence_batching" | "batch_input" | "batch_output" => Error,
        "ensemble_scheduling.step.model_namespace" => Error,
        "input.is_shape_tensor" | "output.is_shape_tensor" => Error,
        "input.allow_ragged_batch" | "input.is_non_linear_format_io" => Error,
        "output.is_non_linear_format_io" => Warning,
        "model_transaction_policy.decoupled" => Error,
        "instance_group.secondary_devices" | "instance_group.profile" | "instance_group.passive" => Warning,
        "instance_group.rate_limiter" | "instance_group.host_policy" => Warning,
        "input.format" | "model_repository_agents" => Warning,
        // `optimization.graph.level` maps onto ONNX Runtime's graph optimization level; the
        // rest of `optimization` (priority, CUDA, accelerators, pinned memory, ...) does not apply.
        p if p.starts_with("optimization.") && p != "optimization.graph" && !p.starts_with("optimization.graph.") => {
            Warning
        }
        "cc_model_filenames" | "metric_tags" | "model_operations" | "model_metrics" => Warning,
        "dynamic_batching.priority_queue_policy.max_queue_size"
        | "dynamic_batching.default_queue_policy.max_queue_size" => return None,
        "runtime" => Warning,
        _ => return None,
    })
}

fn walk(message: &DynamicMessage, prefix: &str, found: &mut Vec<UnsupportedField>) {
    for (field, value) in message.fields() {
        let path = if prefix.is_empty() { field.name().to_string() } else { format!("{prefix}.{}", field.name()) };
        // A field set to its default ("decoupled: false") changes nothing.
        if is_default(value) {
            continue;
        }
        if let Some(severity) = classify(&path) {
            found.push(UnsupportedField { path, severity });
            continue;
        }
        match value {
            Value::Message(m) => walk(m, &path, found),
            Value::List(items) => {
                for item in items {
                    if let Value::Message(m) = item {
                        walk(m, &path, found);
                    }
                }
            }
            _ => {}
        }
    }
}

fn is_default(value: &Value) -> bool {
    match value {
        Value::Bool(b) => !*b,
        Value::I32(v) | Value::EnumNumber(v) => *v == 0,
        Value::I64(v) => *v == 0,
        Value::U32(v) => *v == 0,
        Value::U64(v) => *v == 0,
        Value::F32(v) => *v == 0.0,
        Value::F64(v) => *v == 0.0,
        Value::String(s) => s.is_empty(),
        Value::Bytes(b) => b.is_empty(),
        Value::List(l) => l.is_empty(),
        Value::Map(m) => m.is_empty(),
        Value::Message(_) => false,
    }
}

/// Renders a config as Triton does on `GET .../config`: protobuf JSON with the proto field
/// names and default values included, and 64-bit integers (dims, delays, versions) as JSON
/// numbers, not the strings of proto3's JSON mapping (clients do arithmetic on `dims`).
pub fn config_to_json(config: &ModelConfig) -> serde_json::Value {
    let dynamic = config.transcode_to_dynamic();
    let options = prost_reflect::SerializeOptions::new()
        .use_proto_field_name(true)
        .skip_default_fields(false)
        .stringify_64_bit_integers(false);
    let mut serializer = serde_json::Serializer::new(Vec::new());
    match dynamic.serialize_with_options(&mut serializer, &options) {
        Ok(()) => serde_json::from_slice(&serializer.into_inner()).unwrap_or_default(),
        Err(_) => serde_json::Value::Null,
    }
}

/// Renders a config back to protobuf text format (for writing generated configs).
pub fn config_to_text(config: &ModelConfig) -> String {
    config
        .transcode_to_dynamic()
        .to_text_format_with_options(&prost_reflect::text_format::FormatOptions::new().pretty(true))
}

trait TranscodeToDynamic {
    fn transcode_to_dynamic(&self) -> DynamicMessage;
}

impl TranscodeToDynamic for ModelConfig {
    fn transcode_to_dynamic(&self) -> DynamicMessage {
        let bytes = self.encode_to_vec();
        DynamicMessage::decode(model_config_descriptor(), bytes.as_slice())
            .expect("a ModelConfig re-decodes against its own descriptor")
    }
}

/// The `dynamic_batching` member of the `scheduling_choice` oneof, when that is the one set.
pub fn dynamic_batching(config: &ModelConfig) -> Option<&ModelDynamicBatching> {
    match &config.scheduling_choice {
        Some(SchedulingChoice::DynamicBatching(db)) => Some(db),
        _ => None,
    }
}

/// Checks the config's own consistency (not against a model file). Messages name the field.
/// Most `dynamic_batching.priority_levels` a config may ask for.
pub const MAX_PRIORITY_LEVELS: u64 = 1024;

pub fn validate_model_config(config: &ModelConfig) -> Result<(), ConfigError> {
    let err = |m: String| Err(ConfigError::new(m));
    if config.max_batch_size < 0 {
        return err(format!("max_batch_size must be >= 0, got {}", config.max_batch_size));
    }
    let mut names = std::collections::HashSet::new();
    for (kind, tensors) in [
        ("input", config.input.iter().map(|t| (&t.name, t.data_type, &t.dims)).collect::<Vec<_>>()),
        ("output", config.output.iter().map(|t| (&t.name, t.data_type, &t.dims)).collect()),
    ] {
        for (name, data_type, dims) in tensors {
            if name.is_empty() {
                return err(format!("{kind}: every {kind} needs a name"));
            }
            if !names.insert((kind, name.clone())) {
                return err(format!("{kind} '{name}' is declared twice"));
            }
            if DataType::from_config_value(data_type).is_none() {
                return err(format!("{kind} '{name}': data_type must be set to a valid TYPE_*"));
            }
            if let Some(d) = dims.iter().find(|&&d| d < -1 || d == 0) {
                return err(format!("{kind} '{name}': dims must be -1 or positive, got {d}"));
            }
        }
    }
    // With max_batch_size 0 the batcher is still the model's scheduler (its queue policies
    // apply) but batches nothing, as in Triton; a preferred size then fails below.
    if let Some(db) = dynamic_batching(config) {
        for &p in &db.preferred_batch_size {
            if p <= 0 || p > config.max_batch_size {
                return err(format!(
                    "dynamic_batching.preferred_batch_size {p} must be in 1..={}",
                    config.max_batch_size
                ));
            }
        }
        // Every level has its queues, walked as batches form: a level count is no free
        // number (4e9 of them would allocate ~128 GB).
        if db.priority_levels > MAX_PRIORITY_LEVELS {
            return err(format!(
                "dynamic_batching.priority_levels must be at most {MAX_PRIORITY_LEVELS}, got {}",
                db.priority_levels
            ));
        }
        if db.priority_levels > 0 && (db.default_priority_level == 0 || db.default_priority_level > db.priority_levels)
        {
            return err(format!(
                "dynamic_batching.default_priority_level must be in 1..={} when priority_levels is set, got {}",
                db.priority_levels, db.default_priority_level
            ));
        }
        // Without priority levels Triton ignores the per-level policies.
        for &level in db.priority_queue_policy.keys() {
            if db.priority_levels > 0 && (level == 0 || level > db.priority_levels) {
                return err(format!(
                    "dynamic_batching.priority_queue_policy key {level} must be in 1..={}",
                    db.priority_levels
                ));
            }
        }
    }
    for (i, group) in config.instance_group.iter().enumerate() {
        if group.count < 0 {
            return err(format!("instance_group[{i}].count must be >= 0, got {}", group.count));
        }
        if group.gpus.iter().any(|&g| g < 0) {
            return err(format!("instance_group[{i}].gpus must be >= 0"));
        }
        if group.kind == nereid_proto::inference::model_instance_group::Kind::Cpu as i32 && !group.gpus.is_empty() {
            return err(format!("instance_group[{i}] has kind KIND_CPU but names gpus {:?}", group.gpus));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_may_hold_other_encodings_and_nothing_else_may() {
        let latin1 = b"name: \"m\" # caf\xe9\nmax_batch_size: 4 # \"\xff\n";
        let text = config_text(latin1).expect("non-UTF-8 in comments");
        let config = parse_model_config(&text).expect("parses");
        assert_eq!((config.name.as_str(), config.max_batch_size), ("m", 4));
        for (bad, line) in [(&b"name: \"caf\xe9\"\n"[..], 1), (b"max_batch_size: 4\nname: \"a#\xe9\"\n", 2)] {
            let e = config_text(bad).expect_err("non-UTF-8 outside a comment");
            assert!(e.to_string().contains(&format!("line {line}")), "{e}");
        }
        assert!(matches!(config_text(b"name: \"m\"\n"), Ok(std::borrow::Cow::Borrowed(_))));
    }

    const TRITON_STYLE: &str = r#"
name: "mlp"   # a comment with [brackets]
backend: "onnxruntime"
max_batch_size: 64
input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 256 ]
  }
]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims [ 10 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size [ 16, 32 ]
  max_queue_delay_microseconds: 500
  priority_levels: 2
  default_priority_level: 1
  default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 1000 }
  priority_queue_policy { key: 2 value: { max_queue_size: 8 } }
}
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
version_policy: { latest: { num_versions: 2 } }
"#;

    #[test]
    fn parses_triton_style_config() {
        let c = parse_model_config(TRITON_STYLE).unwrap();
        assert_eq!(c.name, "mlp");
        assert_eq!(c.max_batch_size, 64);
        assert_eq!(c.input[0].dims, vec![256]);
        assert_eq!(c.output[0].dims, vec![10]);
        assert_eq!(c.instance_group[0].count, 2);
        let db = dynamic_batching(&c).unwrap();
        assert_eq!(db.preferred_batch_size, vec![16, 32]);
        assert_eq!(db.max_queue_delay_microseconds, 500);
        assert_eq!(db.priority_queue_policy[&2].max_queue_size, 8);
        assert_eq!(db.default_queue_policy.as_ref().unwrap().timeout_action, 1);
        assert_eq!(c.parameters["intra_op_thread_count"].string_value, "1");
        validate_model_config(&c).unwrap();
        assert!(unsupported_fields(&c).is_empty(), "{:?}", unsupported_fields(&c));
    }

    #[test]
    fn unknown_field_names_field_and_line() {
        let e = parse_model_config("name: \"a\"\nmax_batch_size: 4\nbogus_field: 3\n").unwrap_err();
        assert_eq!(e.line, Some(3), "{e}");
        assert!(e.message.contains("bogus_field"), "{e}");
    }

    #[test]
    fn syntax_error_has_line() {
        let e = parse_model_config("name: \"a\"\ninput [ { name: \"x\" \n").unwrap_err();
        assert!(e.line.is_some(), "{e}");
        let e = parse_model_config("name: \"a\"\nmax_batch_size: \"x\"\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
    }

    #[test]
    fn colon_insertion_skips_strings_and_comments() {
        assert_eq!(insert_list_colons("dims [ 1 ]"), "dims :[ 1 ]");
        assert_eq!(insert_list_colons("dims: [ 1 ]"), "dims: [ 1 ]");
        assert_eq!(insert_list_colons("name: \"a [b\" # c [d\n"), "name: \"a [b\" # c [d\n");
        assert_eq!(insert_list_colons("a { b[1] }"), "a { b:[1] }");
    }

    #[test]
    fn reports_unsupported_fields() {
        let c = parse_model_config(
            "name: \"s\"\nmax_batch_size: 2\nsequence_batching {}\noptimization { priority: PRIORITY_MAX }\n\
             response_cache { enable: true }\nmodel_transaction_policy { decoupled: false }\n",
        )
        .unwrap();
        let found = unsupported_fields(&c);
        assert!(found.contains(&UnsupportedField { path: "sequence_batching".into(), severity: Severity::Error }));
        assert!(
            found.contains(&UnsupportedField { path: "optimization.priority".into(), severity: Severity::Warning })
        );
        assert!(!found.iter().any(|f| f.path.contains("response_cache")), "implemented: {found:?}");
        assert!(!found.iter().any(|f| f.path.contains("decoupled")));
    }

    /// `optimization { graph { level } }` is applied (as ONNX Runtime's graph optimization
    /// level), so it draws no warning; its siblings still do.
    #[test]
    fn graph_level_is_implemented() {
        let c = parse_model_config(
            "name: \"g\"\noptimization { graph { level: -1 } input_pinned_memory { enable: true } }\n",
        )
        .unwrap();
        let found = unsupported_fields(&c);
        assert!(!found.iter().any(|f| f.path.contains("graph")), "{found:?}");
        assert!(found.iter().any(|f| f.path == "optimization.input_pinned_memory"), "{found:?}");
    }

    #[test]
    fn optional_inputs_and_reshape_are_implemented() {
        let c = parse_model_config(
            "name: \"o\"\nmax_batch_size: 2\ninput [ { name: \"x\" data_type: TYPE_FP32 dims: [ 2 ] optional: true \
             reshape: { shape: [ 2 ] } } ]\n",
        )
        .unwrap();
        // Implemented: a request may leave the input out where the model has a default for it.
        assert_eq!(unsupported_fields(&c), vec![]);
    }

    /// Every field of `ModelConfig` (walked through the schema) is either one Nereid
    /// implements or one `classify` reports, so a config field is never silently ignored — and
    /// a field added to the proto fails this test until someone decides which it is.
    #[test]
    fn no_config_field_is_silently_ignored() {
        const IMPLEMENTED: &[&str] = &[
            "name",
            "platform",
            "backend",
            "version_policy",
            "max_batch_size",
            "input.name",
            "input.data_type",
            "input.dims",
            "input.reshape",
            "input.optional",
            "output.name",
            "output.data_type",
            "output.dims",
            "output.reshape",
            "output.label_filename",
            "instance_group.name",
            "instance_group.kind",
            "instance_group.count",
            "instance_group.gpus",
            "default_model_filename",
            "parameters",
            "model_warmup",
            "dynamic_batching",
            "ensemble_scheduling",
            "model_transaction_policy.decoupled",
            "response_cache",
            "optimization.graph.level",
        ];
        fn walk(d: &MessageDescriptor, prefix: &str, depth: usize, missing: &mut Vec<String>) {
            for field in d.fields() {
                let path =
                    if prefix.is_empty() { field.name().to_string() } else { format!("{prefix}.{}", field.name()) };
                let covered = |p: &str| {
                    IMPLEMENTED.iter().any(|i| p == *i || p.starts_with(&format!("{i}.")))
                        || std::iter::successors(Some(p), |q| q.rsplit_once('.').map(|(head, _)| head))
                            .any(|q| classify(q).is_some())
                };
                if covered(&path) {
                    continue;
                }
                match field.kind() {
                    prost_reflect::Kind::Message(m) if depth < 4 && !field.is_map() => {
                        walk(&m, &path, depth + 1, missing)
                    }
                    _ => missing.push(path),
                }
            }
        }
        let mut missing = Vec::new();
        walk(&model_config_descriptor(), "", 0, &mut missing);
        assert!(missing.is_empty(), "config fields neither implemented nor reported: {missing:?}");
    }

    #[test]
    fn validation_names_the_field() {
        let c =
            parse_model_config("name: \"v\"\nmax_batch_size: 8\ndynamic_batching { preferred_batch_size: [ 16 ] }\n")
                .unwrap();
        let e = validate_model_config(&c).unwrap_err();
        assert!(e.message.contains("preferred_batch_size"), "{e}");
        let c = parse_model_config("name: \"v\"\ninput [ { name: \"x\" dims: [ 0 ] data_type: TYPE_FP32 } ]").unwrap();
        assert!(validate_model_config(&c).unwrap_err().message.contains("dims"));
        let check = |text: &str| validate_model_config(&parse_model_config(text).unwrap());
        // A level count allocates queues: bounded.
        let e = check("name: \"v\"\nmax_batch_size: 4\ndynamic_batching { priority_levels: 4000000000 default_priority_level: 1 }")
            .unwrap_err();
        assert!(e.message.contains("priority_levels must be at most 1024, got 4000000000"), "{e}");
        assert!(
            check(
                "name: \"v\"\nmax_batch_size: 4\ndynamic_batching { priority_levels: 1024 default_priority_level: 1 }"
            )
            .is_ok()
        );
        // What Triton accepts: a batcher on a model that does not batch, per-level policies
        // without levels (ignored).
        assert!(check("name: \"v\"\ndynamic_batching { }").is_ok());
        assert!(check("name: \"v\"\nmax_batch_size: 4\ndynamic_batching { priority_queue_policy { key: 3 value { max_queue_size: 2 } } }").is_ok());
        assert!(check("name: \"v\"\ndynamic_batching { preferred_batch_size: [ 1 ] }").is_err());
        // And what it refuses: CPU instances on GPUs.
        let e = check("name: \"v\"\ninstance_group [ { kind: KIND_CPU gpus: [ 0 ] } ]").unwrap_err();
        assert!(e.message.contains("instance_group[0] has kind KIND_CPU but names gpus [0]"), "{e}");
    }

    #[test]
    fn json_uses_proto_field_names() {
        let c = parse_model_config(TRITON_STYLE).unwrap();
        let j = config_to_json(&c);
        assert_eq!(j["max_batch_size"], 64);
        assert_eq!(j["input"][0]["data_type"], "TYPE_FP32");
        assert_eq!(j["dynamic_batching"]["max_queue_delay_microseconds"], 500);
        assert_eq!(j["input"][0]["dims"], serde_json::json!([256]));
        let back = parse_model_config_json(&j.to_string()).unwrap();
        assert_eq!(back, c);
        assert!(parse_model_config_json("{\"max_batch_size\": \"x\"}").is_err());
        assert!(parse_model_config_json("{\"bogus\": 1}").unwrap_err().message.contains("bogus"));
        let text = config_to_text(&c);
        assert_eq!(parse_model_config(&text).unwrap(), c);
    }
}
