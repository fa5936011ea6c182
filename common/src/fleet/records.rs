//! The JSON values stored in etcd. Every record carries `"schema": 1`; [`decode`] rejects an
//! unknown schema version, unknown fields (typos in a hand-written value), and numbers no real
//! fleet has, with a message naming the field.

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::keys::check_name;

/// The schema version this build reads and writes.
pub const SCHEMA_VERSION: u32 = 1;

/// Upper bounds for "impossible numbers".
pub const MAX_REPLICAS: u32 = 1024;
pub const MAX_MEMORY_MB: u64 = 16 << 20; // 16 TiB
pub const MAX_VERSIONS: usize = 64;
pub const MAX_WEIGHT: u32 = 1_000_000;

/// The reason of a LOADING status whose load has not started yet: the worker loads placed
/// models one at a time, and this one waits its turn.
pub const PENDING_REASON: &str = "pending: waiting for this worker's other loads";

/// Why a value was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("not valid JSON: {0}")]
    Json(String),
    #[error("unknown schema version {0} (this build reads version {SCHEMA_VERSION})")]
    Schema(u64),
    #[error("missing \"schema\" version")]
    MissingSchema,
    #[error("{0}")]
    Invalid(String),
}

/// A value that can be stored in etcd.
pub trait Record: Serialize + DeserializeOwned {
    /// Checks what serde cannot (ranges, names, addresses).
    fn validate(&self) -> Result<(), String>;
}

/// Parses and validates a stored value.
pub fn decode<T: Record>(bytes: &[u8]) -> Result<T, RecordError> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| RecordError::Json(e.to_string()))?;
    match value.get("schema") {
        None => return Err(RecordError::MissingSchema),
        Some(serde_json::Value::Number(n)) if n.as_u64() == Some(SCHEMA_VERSION as u64) => {}
        Some(serde_json::Value::Number(n)) => return Err(RecordError::Schema(n.as_u64().unwrap_or(u64::MAX))),
        Some(_) => return Err(RecordError::Invalid("\"schema\" must be a number".into())),
    }
    let record: T = serde_json::from_value(value).map_err(|e| RecordError::Invalid(e.to_string()))?;
    record.validate().map_err(RecordError::Invalid)?;
    Ok(record)
}

/// Serializes a record (after validating it: nothing invalid is ever written by Nereid).
pub fn encode<T: Record>(record: &T) -> Result<String, RecordError> {
    record.validate().map_err(RecordError::Invalid)?;
    serde_json::to_string(record).map_err(|e| RecordError::Json(e.to_string()))
}

fn schema() -> u32 {
    SCHEMA_VERSION
}

/// Checks a label (a worker's `--label`, a model's `--selector`), the same on both sides so
/// that every selector nereidctl accepts can match a label a worker accepts: a non-empty key,
/// neither part longer than 63 characters (Kubernetes' limit) nor holding whitespace or control
/// characters.
pub fn check_label(key: &str, value: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("the key is empty".into());
    }
    // A worker's `--label KEY=VALUE` splits at the first '=': no worker could carry such a key.
    if key.contains('=') {
        return Err("the key holds '='".into());
    }
    for (what, part) in [("key", key), ("value", value)] {
        if part.chars().count() > 63 {
            return Err(format!("the {what} is longer than 63 characters"));
        }
        if part.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!("the {what} holds a space or control character"));
        }
    }
    Ok(())
}

/// An HTTP header name (RFC 9110 token, at most 256 bytes), which a sticky key must be.
pub fn check_header_name(what: &str, name: &str) -> Result<(), String> {
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || name.len() > 256 || !name.chars().all(token) {
        return Err(format!("{what} '{}' is not an HTTP header name", name.escape_debug()));
    }
    Ok(())
}

/// `workers/<id>`: a worker's registration, under its lease.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerRecord {
    #[serde(default = "schema")]
    pub schema: u32,
    pub id: String,
    /// gRPC address (`host:port`) the gateway dials.
    pub grpc: String,
    /// HTTP address, when served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<String>,
    pub state: WorkerState,
    #[serde(default)]
    pub capacity: Capacity,
    /// Devices it runs on (`cpu`, `gpu:0`, …).
    #[serde(default)]
    pub devices: Vec<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Cost classes it serves (empty: all).
    #[serde(default)]
    pub cost_classes: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    /// Takes traffic and placements.
    Ready,
    /// Finishing in-flight work before it exits: no new traffic, no new placements.
    Draining,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capacity {
    /// Memory available for models, in MiB (0: unknown — the placement controller then counts
    /// only models, up to `max_models`).
    #[serde(default)]
    pub memory_mb: u64,
    /// Most model versions it will hold (0: no limit).
    #[serde(default)]
    pub max_models: u32,
}

/// `host:port` with a non-empty host and a non-zero port, that a client can dial: it must parse
/// as an HTTP authority (what the gateway builds its channel's URI and HTTP/2 `:authority`
/// from), without user info. A record whose address passes a looser check but no client can
/// use (`bad^host:1`) would be accepted, placed on, and then fail in the gateway every time it
/// builds a table — rejected here, it is logged and counted once like any invalid value.
pub fn check_host_port(what: &str, s: &str) -> Result<(), String> {
    let err = || format!("{what} '{s}' is not host:port");
    let (host, port) = s.rsplit_once(':').ok_or_else(err)?;
    if host.is_empty() || s.contains('/') || s.contains('@') || s.chars().any(char::is_whitespace) {
        return Err(err());
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 && port.bytes().all(|b| b.is_ascii_digit()) => {}
        _ => return Err(err()),
    }
    let authority: http::uri::Authority =
        s.parse().map_err(|e| format!("{what} '{s}' is not a usable host:port ({e})"))?;
    if authority.host().is_empty() || authority.port_u16().is_none() {
        return Err(err());
    }
    Ok(())
}

impl Record for WorkerRecord {
    fn validate(&self) -> Result<(), String> {
        check_name("worker id", &self.id)?;
        check_host_port("grpc", &self.grpc)?;
        if let Some(http) = &self.http {
            check_host_port("http", http)?;
        }
        if self.capacity.memory_mb > MAX_MEMORY_MB {
            return Err(format!("capacity.memory_mb {} is larger than {MAX_MEMORY_MB}", self.capacity.memory_mb));
        }
        if self.labels.len() > 64 || self.devices.len() > 64 || self.cost_classes.len() > 64 {
            return Err("more than 64 labels, devices or cost classes".into());
        }
        for (k, v) in &self.labels {
            check_label(k, v).map_err(|e| format!("label '{k}': {e}"))?;
        }
        for (what, list) in [("device", &self.devices), ("cost class", &self.cost_classes)] {
            for (i, item) in list.iter().enumerate() {
                check_name(what, item)?;
                if list[..i].contains(item) {
                    return Err(format!("{what} '{item}' is listed twice"));
                }
            }
        }
        Ok(())
    }
}

/// `status/<worker>/<m>/<v>`: one model version's state on one worker, under its lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatusRecord {
    #[serde(default = "schema")]
    pub schema: u32,
    pub state: ModelState,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum ModelState {
    Loading,
    Ready,
    Failed,
}

impl ModelState {
    pub fn name(self) -> &'static str {
        match self {
            ModelState::Loading => "LOADING",
            ModelState::Ready => "READY",
            ModelState::Failed => "FAILED",
        }
    }
}

/// The longest `reason` a status record carries.
pub const MAX_REASON_BYTES: usize = 4096;

impl StatusRecord {
    /// A status with `reason` cut to [`MAX_REASON_BYTES`] (on a character boundary, marked
    /// with "…"): a load error can list every tensor of a model, and a record too long to
    /// write would keep the worker from publishing any status at all.
    pub fn new(state: ModelState, reason: &str) -> StatusRecord {
        const MARK: &str = "…";
        let reason = if reason.len() <= MAX_REASON_BYTES {
            reason.to_string()
        } else {
            let mut end = MAX_REASON_BYTES - MARK.len();
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            format!("{}{MARK}", &reason[..end])
        };
        StatusRecord { schema: SCHEMA_VERSION, state, reason }
    }
}

impl Record for StatusRecord {
    fn validate(&self) -> Result<(), String> {
        if self.reason.len() > MAX_REASON_BYTES {
            return Err(format!("reason is longer than {MAX_REASON_BYTES} bytes"));
        }
        Ok(())
    }
}

/// `models/<m>`: a model the operator wants served.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRecord {
    #[serde(default = "schema")]
    pub schema: u32,
    /// Versions to serve (each placed separately).
    pub versions: Vec<i64>,
    /// Workers each version is placed on.
    pub replicas: u32,
    #[serde(default)]
    pub resources: Resources,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_class: Option<String>,
    /// Worker labels a worker must carry (all of them) to be given this model, e.g.
    /// `{"device": "gpu"}` for a model whose config asks for KIND_GPU.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub selector: BTreeMap<String, String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// Memory one loaded version needs on a worker, in MiB.
    #[serde(default)]
    pub memory_mb: u64,
}

impl ModelRecord {
    /// Whether a worker carrying `labels` may be given this model: it carries every label of
    /// the `selector`.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.selector.iter().all(|(k, v)| labels.get(k) == Some(v))
    }
}

impl Record for ModelRecord {
    fn validate(&self) -> Result<(), String> {
        if self.versions.is_empty() {
            return Err("versions is empty (declare at least one version)".into());
        }
        if self.versions.len() > MAX_VERSIONS {
            return Err(format!("more than {MAX_VERSIONS} versions"));
        }
        if let Some(v) = self.versions.iter().find(|v| **v < 1) {
            return Err(format!("version {v} is not a positive integer"));
        }
        let mut sorted = self.versions.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err("versions lists a version twice".into());
        }
        if self.replicas == 0 || self.replicas > MAX_REPLICAS {
            return Err(format!("replicas {} is outside 1..={MAX_REPLICAS}", self.replicas));
        }
        if self.resources.memory_mb > MAX_MEMORY_MB {
            return Err(format!("resources.memory_mb {} is larger than {MAX_MEMORY_MB}", self.resources.memory_mb));
        }
        if let Some(c) = &self.cost_class {
            check_name("cost_class", c)?;
        }
        if self.selector.len() > 16 {
            return Err("selector has more than 16 labels".into());
        }
        // As a worker's labels are checked: a selector no label can match would leave the model
        // unplaced for good, silently.
        for (k, v) in &self.selector {
            check_label(k, v).map_err(|e| format!("selector label '{k}': {e}"))?;
        }
        Ok(())
    }
}

/// `placement/<worker>/<m>/<v>`: the controller's assignment (the key says what; the value says
/// which leader term wrote it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlacementRecord {
    #[serde(default = "schema")]
    pub schema: u32,
    /// The election revision of the leader that wrote it.
    pub leader_revision: i64,
}

impl Record for PlacementRecord {
    fn validate(&self) -> Result<(), String> {
        if self.leader_revision < 0 {
            return Err("leader_revision is negative".into());
        }
        Ok(())
    }
}

/// `routes/<m>`: how traffic splits across versions (read by the canary split).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRecord {
    #[serde(default = "schema")]
    pub schema: u32,
    /// Version → weight (relative; versions not listed get no traffic unless pinned).
    pub weights: BTreeMap<i64, u32>,
    /// Request header whose value keeps a client on one version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticky_key: Option<String>,
}

impl Record for RouteRecord {
    fn validate(&self) -> Result<(), String> {
        if self.weights.is_empty() {
            return Err("weights is empty".into());
        }
        if self.weights.len() > MAX_VERSIONS {
            return Err(format!("weights names more than {MAX_VERSIONS} versions"));
        }
        if let Some(v) = self.weights.keys().find(|v| **v < 1) {
            return Err(format!("version {v} is not a positive integer"));
        }
        if let Some((v, w)) = self.weights.iter().find(|(_, w)| **w > MAX_WEIGHT) {
            return Err(format!("weight {w} of version {v} is larger than {MAX_WEIGHT}"));
        }
        if self.weights.values().all(|w| *w == 0) {
            return Err("every weight is 0: no version would get traffic".into());
        }
        if let Some(key) = &self.sticky_key {
            check_header_name("sticky_key", key)?;
        }
        Ok(())
    }
}

/// `drain/<worker>`: an operator asked that the worker get no traffic and no placements.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainRecord {
    #[serde(default = "schema")]
    pub schema: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

impl Record for DrainRecord {
    /// As `nereidctl drain --reason` checks it: it is printed as it is.
    fn validate(&self) -> Result<(), String> {
        check_reason(&self.reason)
    }
}

/// A drain's reason: at most [`MAX_REASON_BYTES`], no line breaks or terminal escapes (it is
/// printed as it is by `nereidctl workers`).
pub fn check_reason(reason: &str) -> Result<(), String> {
    if reason.len() > MAX_REASON_BYTES {
        return Err(format!("the reason is longer than {MAX_REASON_BYTES} bytes"));
    }
    if let Some(c) = reason.chars().find(|c| c.is_control()) {
        return Err(format!("the reason contains the control character {c:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker() -> WorkerRecord {
        WorkerRecord {
            schema: 1,
            id: "w1".into(),
            grpc: "127.0.0.1:8001".into(),
            http: Some("127.0.0.1:8000".into()),
            state: WorkerState::Ready,
            capacity: Capacity { memory_mb: 1024, max_models: 0 },
            devices: vec!["cpu".into()],
            labels: [("zone".to_string(), "a".to_string())].into(),
            cost_classes: vec![],
        }
    }

    #[test]
    fn round_trips() {
        let w = worker();
        assert_eq!(decode::<WorkerRecord>(encode(&w).unwrap().as_bytes()).unwrap(), w);
        let m = ModelRecord {
            schema: 1,
            versions: vec![1, 2],
            replicas: 2,
            resources: Resources { memory_mb: 64 },
            cost_class: None,
            selector: [("device".to_string(), "gpu".to_string())].into(),
        };
        assert_eq!(decode::<ModelRecord>(encode(&m).unwrap().as_bytes()).unwrap(), m);
        let s = StatusRecord { schema: 1, state: ModelState::Failed, reason: "bad".into() };
        let text = encode(&s).unwrap();
        assert!(text.contains("\"FAILED\""), "{text}");
        assert_eq!(decode::<StatusRecord>(text.as_bytes()).unwrap(), s);
        let r = RouteRecord { schema: 1, weights: [(1, 90), (2, 10)].into(), sticky_key: None };
        assert_eq!(decode::<RouteRecord>(encode(&r).unwrap().as_bytes()).unwrap(), r);
    }

    #[test]
    fn rejects_bad_values_with_a_reason() {
        let bad = |json: &str| decode::<ModelRecord>(json.as_bytes()).unwrap_err().to_string();
        assert!(bad("{").contains("not valid JSON"));
        assert!(bad(r#"{"versions":[1],"replicas":1}"#).contains("missing \"schema\""));
        assert!(bad(r#"{"schema":7,"versions":[1],"replicas":1}"#).contains("unknown schema version 7"));
        assert!(bad(r#"{"schema":"1","versions":[1],"replicas":1}"#).contains("must be a number"));
        assert!(bad(r#"{"schema":1,"versions":[1],"replicas":0}"#).contains("replicas 0"));
        assert!(bad(r#"{"schema":1,"versions":[1],"replicas":100000}"#).contains("replicas 100000"));
        assert!(bad(r#"{"schema":1,"versions":[],"replicas":1}"#).contains("versions is empty"));
        assert!(bad(r#"{"schema":1,"versions":[0],"replicas":1}"#).contains("version 0"));
        assert!(bad(r#"{"schema":1,"versions":[1,1],"replicas":1}"#).contains("twice"));
        assert!(bad(r#"{"schema":1,"versions":[1],"replicas":-1}"#).contains("invalid value"));
        assert!(bad(r#"{"schema":1,"versions":[1],"replicas":1,"replica":2}"#).contains("unknown field"));
        assert!(
            bad(r#"{"schema":1,"versions":[1],"replicas":1,"resources":{"memory_mb":99999999999}}"#)
                .contains("memory_mb")
        );

        let mut w = worker();
        w.grpc = "nohost".into();
        assert!(encode(&w).unwrap_err().to_string().contains("grpc 'nohost'"));
        let mut w = worker();
        w.http = Some("bad^host:8000".into());
        assert!(encode(&w).unwrap_err().to_string().contains("http 'bad^host:8000'"));
        let mut w = worker();
        w.id = "a/b".into();
        assert!(encode(&w).is_err());
        let r = RouteRecord { schema: 1, weights: [(1, 0)].into(), sticky_key: None };
        assert!(encode(&r).unwrap_err().to_string().contains("every weight is 0"));
        // Written by hand, what nereidctl refuses is refused by the readers too: a selector
        // label no worker label can match, a worker label, a sticky key no header can be.
        assert!(
            bad(r#"{"schema":1,"versions":[1],"replicas":1,"selector":{"device":"gpu "}}"#)
                .contains("selector label 'device'")
        );
        let mut w = worker();
        w.labels.insert("zone".into(), "a\nb".into());
        assert!(encode(&w).unwrap_err().to_string().contains("label 'zone'"));
        let r = RouteRecord { schema: 1, weights: [(1, 1)].into(), sticky_key: Some("x user".into()) };
        assert!(encode(&r).unwrap_err().to_string().contains("not an HTTP header name"));
        let r = RouteRecord { schema: 1, weights: [(1, 1)].into(), sticky_key: Some("x-user".into()) };
        encode(&r).unwrap();
        // A name a repository folder can have (NAME_MAX), not one byte more.
        crate::fleet::keys::check_name("model", &"m".repeat(255)).unwrap();
        assert!(
            crate::fleet::keys::check_name("model", &"m".repeat(256)).unwrap_err().contains("longer than 255 bytes")
        );
        assert!(decode::<StatusRecord>(br#"{"schema":1,"state":"GONE"}"#).is_err());
    }

    /// What an operator may write by hand but no reader should take: list items that are not
    /// names (or repeat), label keys no worker can carry, route weights for more versions than
    /// a model may declare, drain reasons nereidctl would refuse.
    #[test]
    fn hand_written_values_nereidctl_would_refuse_are_refused() {
        let mut w = worker();
        w.devices = vec!["gpu0".into(), "gpu0".into()];
        assert!(encode(&w).unwrap_err().to_string().contains("listed twice"));
        w.devices = vec!["".into()];
        assert!(encode(&w).unwrap_err().to_string().contains("device is empty"));
        w.devices = vec![];
        w.cost_classes = vec!["a b".into()];
        assert!(encode(&w).unwrap_err().to_string().contains("cost class 'a b'"));
        assert!(check_label("zone=a", "b").unwrap_err().contains("'='"));
        let weights: String = (1..=65).map(|v| format!("\"{v}\":1")).collect::<Vec<_>>().join(",");
        let e = decode::<RouteRecord>(format!(r#"{{"schema":1,"weights":{{{weights}}}}}"#).as_bytes()).unwrap_err();
        assert!(e.to_string().contains("more than 64 versions"), "{e}");
        let e = decode::<DrainRecord>(br#"{"schema":1,"reason":"a\u001b[2Jb"}"#).unwrap_err();
        assert!(e.to_string().contains("control character"), "{e}");
        let long = format!(r#"{{"schema":1,"reason":"{}"}}"#, "x".repeat(MAX_REASON_BYTES + 1));
        assert!(decode::<DrainRecord>(long.as_bytes()).unwrap_err().to_string().contains("longer than 4096"));
        assert!(decode::<DrainRecord>(br#"{"schema":1,"reason":"rack 7 maintenance"}"#).is_ok());
    }

    #[test]
    fn worker_addresses_must_be_dialable() {
        for good in ["127.0.0.1:8001", "worker-3.nereid.svc:8001", "[::1]:8001", "[fe80::1]:1", "a:65535"] {
            assert_eq!(check_host_port("grpc", good), Ok(()), "{good}");
        }
        for bad in [
            "bad^host:1",
            "bad\"host:1",
            "a{b}:1",
            "::1:8001",
            "user@host:1",
            "host:+1",
            "host:0",
            "host:65536",
            "host:",
            ":1",
            "host",
            "http://host:1",
            "ho st:1",
        ] {
            assert!(check_host_port("grpc", bad).is_err(), "{bad} accepted");
        }
        // Through the reader's path: the record is rejected (and so counted), not applied.
        let json = r#"{"schema":1,"id":"w1","grpc":"bad^host:1","state":"ready"}"#;
        let e = decode::<WorkerRecord>(json.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("grpc 'bad^host:1'"), "{e}");
    }
}
