//! What `nereidctl` prints, computed from a [`FleetState`] (pure: no etcd here). Each view is a
//! list of rows that renders either as an aligned table or as JSON, so both outputs always say
//! the same thing.

use std::collections::{BTreeMap, BTreeSet};

use nereid_common::fleet::records::{DrainRecord, ModelRecord, ModelState, RouteRecord, StatusRecord, WorkerRecord};
use nereid_common::fleet::{FleetState, Keys};
use serde_json::{Value, json};

/// Aligned columns separated by two spaces; the last column is not padded.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.extend(std::iter::repeat_n(' ', widths[i] - cell.chars().count() + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn dash_if_empty(s: String) -> String {
    if s.is_empty() { "-".into() } else { s }
}

/// How a worker stands for traffic and placement, as operators say it.
pub fn worker_state(state: &FleetState, id: &str) -> &'static str {
    if state.drains.contains_key(id) {
        "drained-by-operator"
    } else {
        match state.workers.get(id).map(|w| w.state) {
            Some(nereid_common::fleet::records::WorkerState::Ready) => "ready",
            Some(nereid_common::fleet::records::WorkerState::Draining) => "draining",
            None => "not-registered",
        }
    }
}

/// One model version on one worker: placed there, and/or reported by it.
#[derive(Clone, Debug, PartialEq)]
pub struct Held<'a> {
    pub model: &'a str,
    pub version: i64,
    pub placed: bool,
    pub status: Option<&'a StatusRecord>,
}

impl Held<'_> {
    /// `READY`, `FAILED: reason`, `PENDING` (placed, nothing reported yet), with
    /// ` (not placed)` when the worker reports a version the controller did not assign it.
    pub fn status_text(&self) -> String {
        let mut text = match self.status {
            Some(s) if s.reason.is_empty() => s.state.name().to_string(),
            Some(s) => format!("{}: {}", s.state.name(), printable(&s.reason)),
            None => "PENDING".to_string(),
        };
        if !self.placed {
            text.push_str(" (not placed)");
        }
        text
    }

    fn json(&self) -> Value {
        json!({
            "model": self.model,
            "version": self.version,
            "placed": self.placed,
            "status": self.status.map(|s| s.state.name()),
            "reason": self.status.map(|s| s.reason.as_str()).filter(|r| !r.is_empty()),
        })
    }
}

/// Everything placed on or reported by `worker`, by model and version.
fn held_by<'a>(state: &'a FleetState, worker: &str) -> Vec<Held<'a>> {
    let mut held: BTreeMap<(&'a str, i64), Held<'a>> = BTreeMap::new();
    for (w, m, v) in &state.placements {
        if w == worker {
            held.insert((m, *v), Held { model: m, version: *v, placed: true, status: None });
        }
    }
    for ((m, v), s) in state.statuses.get(worker).into_iter().flatten() {
        held.entry((m, *v)).or_insert(Held { model: m, version: *v, placed: false, status: None }).status = Some(s);
    }
    held.into_values().collect()
}

/// A row of `nereidctl workers`: every registered worker, and drained ids not registered.
#[derive(Clone, Debug)]
pub struct WorkerRow<'a> {
    pub id: &'a str,
    pub state: &'static str,
    pub record: Option<&'a WorkerRecord>,
    pub drain: Option<&'a DrainRecord>,
    pub models: Vec<Held<'a>>,
}

pub fn workers(state: &FleetState) -> Vec<WorkerRow<'_>> {
    let ids: BTreeSet<&String> = state.workers.keys().chain(state.drains.keys()).collect();
    ids.into_iter()
        .map(|id| WorkerRow {
            id,
            state: worker_state(state, id),
            record: state.workers.get(id),
            drain: state.drains.get(id),
            models: held_by(state, id),
        })
        .collect()
}

fn capacity_text(w: &WorkerRecord) -> String {
    let mut parts = Vec::new();
    if w.capacity.memory_mb > 0 {
        parts.push(format!("{} MiB", w.capacity.memory_mb));
    }
    if w.capacity.max_models > 0 {
        parts.push(format!("max {} models", w.capacity.max_models));
    }
    dash_if_empty(parts.join(", "))
}

fn labels_text(labels: &BTreeMap<String, String>) -> String {
    dash_if_empty(labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","))
}

/// `text` with control characters (a newline in a load error, an escape sequence in a hand-
/// written drain reason) escaped: one table row stays one line, and a terminal prints it as is.
fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

pub fn workers_table(rows: &[WorkerRow<'_>]) -> String {
    let mut out = Vec::new();
    for row in rows {
        let mut state = row.state.to_string();
        if let Some(reason) = row.drain.map(|d| d.reason.as_str()).filter(|r| !r.is_empty()) {
            state = format!("{state} ({})", printable(reason));
        }
        let (grpc, capacity, labels) = match row.record {
            Some(w) => (w.grpc.clone(), capacity_text(w), labels_text(&w.labels)),
            None => ("(not registered)".into(), "-".into(), "-".into()),
        };
        let models: Vec<String> =
            row.models.iter().map(|h| format!("{}/{} {}", h.model, h.version, h.status_text())).collect();
        let mut models = models.into_iter();
        out.push(vec![row.id.to_string(), state, grpc, capacity, labels, models.next().unwrap_or_else(|| "-".into())]);
        // One line per further model version, under the first.
        out.extend(models.map(|m| vec![String::new(), String::new(), String::new(), String::new(), String::new(), m]));
    }
    table(&["WORKER", "STATE", "GRPC", "CAPACITY", "LABELS", "MODELS"], &out)
}

pub fn workers_json(rows: &[WorkerRow<'_>]) -> Value {
    Value::Array(
        rows.iter()
            .map(|row| {
                json!({
                    "id": row.id,
                    "registered": row.record.is_some(),
                    "state": row.state,
                    "drain_reason": row.drain.map(|d| d.reason.as_str()),
                    "grpc": row.record.map(|w| w.grpc.as_str()),
                    "http": row.record.and_then(|w| w.http.as_deref()),
                    "capacity": row.record.map(|w| json!({
                        "memory_mb": w.capacity.memory_mb,
                        "max_models": w.capacity.max_models,
                    })),
                    "devices": row.record.map(|w| w.devices.clone()).unwrap_or_default(),
                    "labels": row.record.map(|w| w.labels.clone()).unwrap_or_default(),
                    "cost_classes": row.record.map(|w| w.cost_classes.clone()).unwrap_or_default(),
                    "models": row.models.iter().map(Held::json).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

/// One declared version of `nereidctl models`: how far the fleet is from what was asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionCount {
    pub version: i64,
    pub wanted: u32,
    /// Workers reporting it READY.
    pub ready_on: Vec<String>,
    pub placed: usize,
    pub loading: usize,
    pub failed: usize,
    /// Its weight in `routes/<m>`, when the model has routes.
    pub weight: Option<u32>,
}

#[derive(Clone, Debug)]
pub struct ModelRow<'a> {
    pub name: &'a str,
    pub record: &'a ModelRecord,
    pub route: Option<&'a RouteRecord>,
    pub versions: Vec<VersionCount>,
}

pub fn models(state: &FleetState) -> Vec<ModelRow<'_>> {
    state
        .models
        .iter()
        .map(|(name, record)| {
            let versions = record
                .versions
                .iter()
                .map(|&version| {
                    let key = (name.clone(), version);
                    let reported: Vec<(&String, &StatusRecord)> =
                        state.statuses.iter().filter_map(|(w, m)| m.get(&key).map(|s| (w, s))).collect();
                    let count = |st: ModelState| reported.iter().filter(|(_, s)| s.state == st).count();
                    let route = state.routes.get(name);
                    VersionCount {
                        version,
                        wanted: record.replicas,
                        ready_on: reported
                            .iter()
                            .filter(|(_, s)| s.state == ModelState::Ready)
                            .map(|(w, _)| w.to_string())
                            .collect(),
                        placed: state.placements.iter().filter(|(_, m, v)| m == name && *v == version).count(),
                        loading: count(ModelState::Loading),
                        failed: count(ModelState::Failed),
                        weight: route.map(|r| r.weights.get(&version).copied().unwrap_or(0)),
                    }
                })
                .collect();
            ModelRow { name, record, route: state.routes.get(name), versions }
        })
        .collect()
}

fn memory_text(mb: u64) -> String {
    if mb == 0 { "-".into() } else { format!("{mb} MiB") }
}

pub fn models_table(rows: &[ModelRow<'_>]) -> String {
    let mut out = Vec::new();
    for row in rows {
        let total: u64 = row.route.map(|r| r.weights.values().map(|w| *w as u64).sum()).unwrap_or(0);
        for (i, v) in row.versions.iter().enumerate() {
            let first = i == 0;
            let weight = match v.weight {
                Some(w) if total > 0 => format!("{w} ({})", percent(w as u64, total)),
                _ => "-".into(),
            };
            out.push(vec![
                if first { row.name.to_string() } else { String::new() },
                v.version.to_string(),
                format!("{}/{}", v.ready_on.len(), v.wanted),
                v.placed.to_string(),
                v.loading.to_string(),
                v.failed.to_string(),
                if first { memory_text(row.record.resources.memory_mb) } else { String::new() },
                if first { row.record.cost_class.clone().unwrap_or_else(|| "-".into()) } else { String::new() },
                if first { selector_text(&row.record.selector) } else { String::new() },
                weight,
            ]);
        }
    }
    table(&["MODEL", "VERSION", "READY", "PLACED", "LOADING", "FAILED", "MEMORY", "CLASS", "SELECTOR", "WEIGHT"], &out)
}

/// `k=v,k2=v2` (as `--selector` takes it), `-` for none.
fn selector_text(selector: &std::collections::BTreeMap<String, String>) -> String {
    if selector.is_empty() {
        return "-".into();
    }
    selector.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

pub fn models_json(rows: &[ModelRow<'_>]) -> Value {
    Value::Array(
        rows.iter()
            .map(|row| {
                json!({
                    "model": row.name,
                    "versions": row.record.versions,
                    "replicas": row.record.replicas,
                    "memory_mb": row.record.resources.memory_mb,
                    "cost_class": row.record.cost_class,
                    "selector": row.record.selector,
                    "route": row.route.map(route_json_value),
                    "status": row.versions.iter().map(|v| json!({
                        "version": v.version,
                        "wanted": v.wanted,
                        "ready": v.ready_on.len(),
                        "ready_on": v.ready_on,
                        "placed": v.placed,
                        "loading": v.loading,
                        "failed": v.failed,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

/// A worker of `nereidctl placement` with what it was assigned and what it reports.
#[derive(Clone, Debug)]
pub struct PlacementRow<'a> {
    pub worker: &'a str,
    pub state: &'static str,
    pub held: Vec<Held<'a>>,
}

pub fn placement(state: &FleetState) -> Vec<PlacementRow<'_>> {
    let ids: BTreeSet<&str> =
        state.placements.iter().map(|(w, _, _)| w.as_str()).chain(state.statuses.keys().map(String::as_str)).collect();
    ids.into_iter()
        .map(|w| PlacementRow { worker: w, state: worker_state(state, w), held: held_by(state, w) })
        .collect()
}

pub fn placement_table(rows: &[PlacementRow<'_>]) -> String {
    let mut out = Vec::new();
    for row in rows {
        for (i, h) in row.held.iter().enumerate() {
            let (w, s) = if i == 0 { (row.worker.to_string(), row.state.to_string()) } else { Default::default() };
            out.push(vec![w, s, h.model.to_string(), h.version.to_string(), h.status_text()]);
        }
    }
    table(&["WORKER", "WORKER STATE", "MODEL", "VERSION", "STATUS"], &out)
}

pub fn placement_json(rows: &[PlacementRow<'_>]) -> Value {
    Value::Array(
        rows.iter()
            .map(|row| {
                json!({
                    "worker": row.worker,
                    "state": row.state,
                    "assignments": row.held.iter().map(Held::json).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

/// A model of `nereidctl routes show`.
#[derive(Clone, Debug)]
pub struct RouteRow<'a> {
    pub model: &'a str,
    pub route: &'a RouteRecord,
    /// `None`: the model is not declared.
    pub declared: Option<&'a ModelRecord>,
}

impl RouteRow<'_> {
    /// Versions with a weight that the model does not declare (drift after a redeclare).
    pub fn undeclared_versions(&self) -> Vec<i64> {
        match self.declared {
            Some(m) => self.route.weights.keys().copied().filter(|v| !m.versions.contains(v)).collect(),
            None => self.route.weights.keys().copied().collect(),
        }
    }
}

pub fn routes<'a>(state: &'a FleetState, only: Option<&str>) -> Vec<RouteRow<'a>> {
    state
        .routes
        .iter()
        .filter(|(m, _)| only.is_none_or(|o| o == m.as_str()))
        .map(|(m, r)| RouteRow { model: m, route: r, declared: state.models.get(m) })
        .collect()
}

fn percent(part: u64, total: u64) -> String {
    let p = part as f64 * 100.0 / total as f64;
    if p.fract() == 0.0 { format!("{p:.0}%") } else { format!("{p:.1}%") }
}

/// `1=90 (90%), 2=10 (10%)`.
pub fn weights_text(route: &RouteRecord) -> String {
    let total: u64 = route.weights.values().map(|w| *w as u64).sum();
    route.weights.iter().map(|(v, w)| format!("{v}={w} ({})", percent(*w as u64, total))).collect::<Vec<_>>().join(", ")
}

pub fn routes_table(rows: &[RouteRow<'_>]) -> String {
    let out: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            let note = match (row.declared, row.undeclared_versions()) {
                (None, _) => "model not declared".to_string(),
                (Some(_), v) if v.is_empty() => String::new(),
                (Some(_), v) => format!(
                    "version{} {} not declared",
                    if v.len() > 1 { "s" } else { "" },
                    v.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
                ),
            };
            vec![
                row.model.to_string(),
                weights_text(row.route),
                row.route.sticky_key.clone().unwrap_or_else(|| "-".into()),
                note,
            ]
        })
        .collect();
    table(&["MODEL", "WEIGHTS", "STICKY KEY", "NOTE"], &out)
}

fn route_json_value(route: &RouteRecord) -> Value {
    json!({
        "weights": route.weights.iter().map(|(v, w)| (v.to_string(), json!(w))).collect::<serde_json::Map<_, _>>(),
        "sticky_key": route.sticky_key,
    })
}

pub fn routes_json(rows: &[RouteRow<'_>]) -> Value {
    Value::Array(
        rows.iter()
            .map(|row| {
                let mut v = route_json_value(row.route);
                v["model"] = json!(row.model);
                v["declared"] = json!(row.declared.is_some());
                v["undeclared_versions"] = json!(row.undeclared_versions());
                v
            })
            .collect(),
    )
}

/// One key of `nereidctl get`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRow {
    pub key: String,
    pub value: String,
    /// etcd lease id (0: none).
    pub lease: i64,
    /// The key's kind in the schema (`other`: not part of it, e.g. election keys).
    pub kind: &'static str,
    /// Why the value would be rejected by every Nereid reader.
    pub invalid: Option<String>,
}

/// Checks each `(key, value, lease)` alone, as a reader would apply it.
pub fn keys<'a>(keys: &Keys, kvs: impl IntoIterator<Item = (&'a [u8], &'a [u8], i64)>) -> Vec<KeyRow> {
    kvs.into_iter()
        .map(|(k, v, lease)| {
            let kind = keys.parse(k).map_or("other", |p| p.kind());
            let invalid = FleetState::default().apply(keys, k, Some(v)).err().map(|r| r.reason);
            KeyRow {
                key: String::from_utf8_lossy(k).into_owned(),
                value: String::from_utf8_lossy(v).into_owned(),
                lease,
                kind,
                invalid,
            }
        })
        .collect()
}

pub fn keys_table(rows: &[KeyRow]) -> String {
    let out: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            // Keys and values as etcd holds them, written by anyone: escapes and line breaks
            // are shown escaped, not sent to the terminal.
            let mut value = printable(&r.value).into_owned();
            if let Some(reason) = &r.invalid {
                value.push_str(&format!("   <- INVALID: {}", printable(reason)));
            }
            let lease = if r.lease == 0 { "-".into() } else { format!("{:x}", r.lease) };
            vec![printable(&r.key).into_owned(), lease, value]
        })
        .collect();
    table(&["KEY", "LEASE", "VALUE"], &out)
}

pub fn keys_json(rows: &[KeyRow]) -> Value {
    Value::Array(
        rows.iter()
            .map(|r| {
                json!({
                    "key": r.key,
                    "value": r.value,
                    "lease": r.lease,
                    "kind": r.kind,
                    "valid": r.invalid.is_none(),
                    "error": r.invalid,
                })
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> (Keys, FleetState) {
        let keys = Keys::new("/n").unwrap();
        let kvs: Vec<(&str, &str)> = vec![
            (
                "/n/workers/w1",
                r#"{"schema":1,"id":"w1","grpc":"127.0.0.1:9001","state":"ready","capacity":{"memory_mb":1000},"labels":{"zone":"a"}}"#,
            ),
            ("/n/workers/w2", r#"{"schema":1,"id":"w2","grpc":"127.0.0.1:9002","state":"draining"}"#),
            ("/n/workers/w3", r#"{"schema":1,"id":"w3","grpc":"127.0.0.1:9003","state":"ready"}"#),
            ("/n/drain/w3", r#"{"schema":1,"reason":"kernel upgrade"}"#),
            ("/n/drain/w9", r#"{"schema":1}"#),
            ("/n/models/m", r#"{"schema":1,"versions":[1,2],"replicas":2,"resources":{"memory_mb":64}}"#),
            (
                "/n/models/idle",
                r#"{"schema":1,"versions":[1],"replicas":1,"cost_class":"small","selector":{"device":"gpu","zone":"a"}}"#,
            ),
            ("/n/placement/w1/m/1", r#"{"schema":1,"leader_revision":7}"#),
            ("/n/placement/w1/m/2", r#"{"schema":1,"leader_revision":7}"#),
            ("/n/placement/w2/m/1", r#"{"schema":1,"leader_revision":7}"#),
            ("/n/status/w1/m/1", r#"{"schema":1,"state":"READY"}"#),
            ("/n/status/w1/m/2", r#"{"schema":1,"state":"FAILED","reason":"no such version"}"#),
            ("/n/status/w2/m/1", r#"{"schema":1,"state":"LOADING"}"#),
            ("/n/status/w3/old/4", r#"{"schema":1,"state":"READY"}"#),
            ("/n/routes/m", r#"{"schema":1,"weights":{"1":90,"2":10},"sticky_key":"x-user"}"#),
            ("/n/routes/gone", r#"{"schema":1,"weights":{"1":1}}"#),
        ];
        let (state, rejected) = FleetState::from_kvs(&keys, kvs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
        assert!(rejected.is_empty(), "{rejected:?}");
        (keys, state)
    }

    /// A reason with a newline (a multi-line load error) or an escape sequence stays on its row
    /// and prints as text.
    #[test]
    fn reasons_with_control_characters_are_escaped() {
        let status = StatusRecord { schema: 1, state: ModelState::Failed, reason: "bad\nmodel \u{1b}[31m".into() };
        let held = Held { model: "m", version: 1, placed: true, status: Some(&status) };
        assert_eq!(held.status_text(), "FAILED: bad\\nmodel \\u{1b}[31m");
    }

    #[test]
    fn tables_align_columns_without_trailing_spaces() {
        let t = table(&["A", "LONGER"], &[vec!["xyz".into(), "1".into()], vec!["".into(), "".into()]]);
        assert_eq!(t, "A    LONGER\nxyz  1\n\n");
    }

    #[test]
    fn workers_show_state_capacity_and_each_version_status() {
        let (_, s) = fleet();
        let rows = workers(&s);
        let ids: Vec<_> = rows.iter().map(|r| (r.id, r.state)).collect();
        assert_eq!(
            ids,
            [("w1", "ready"), ("w2", "draining"), ("w3", "drained-by-operator"), ("w9", "drained-by-operator")]
        );
        let t = workers_table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("WORKER  STATE"), "{t}");
        assert!(lines[1].contains("127.0.0.1:9001") && lines[1].contains("1000 MiB") && lines[1].contains("zone=a"));
        assert!(lines[1].ends_with("m/1 READY"), "{t}");
        assert!(lines[2].trim_start().starts_with("m/2 FAILED: no such version"), "{t}");
        assert!(t.contains("drained-by-operator (kernel upgrade)"), "{t}");
        assert!(t.contains("old/4 READY (not placed)"), "{t}");
        assert!(t.lines().any(|l| l.starts_with("w9") && l.contains("(not registered)")), "{t}");

        let j = workers_json(&rows);
        assert_eq!(j[0]["id"], "w1");
        assert_eq!(j[0]["capacity"]["memory_mb"], 1000);
        assert_eq!(j[0]["models"][1]["status"], "FAILED");
        assert_eq!(j[0]["models"][1]["reason"], "no such version");
        assert_eq!(j[2]["drain_reason"], "kernel upgrade");
        assert_eq!(j[3]["registered"], false);
    }

    #[test]
    fn models_count_ready_workers_against_replicas() {
        let (_, s) = fleet();
        let rows = models(&s);
        assert_eq!(rows.iter().map(|r| r.name).collect::<Vec<_>>(), ["idle", "m"]);
        let m = &rows[1].versions;
        assert_eq!(
            m[0],
            VersionCount {
                version: 1,
                wanted: 2,
                ready_on: vec!["w1".into()],
                placed: 2,
                loading: 1,
                failed: 0,
                weight: Some(90)
            }
        );
        assert_eq!((m[1].ready_on.len(), m[1].failed, m[1].weight), (0, 1, Some(10)));
        assert_eq!(rows[0].versions[0].weight, None);

        let t = models_table(&rows);
        assert!(t.lines().any(|l| l.starts_with("m ") && l.contains("1/2") && l.contains("90 (90%)")), "{t}");
        assert!(t.lines().any(|l| l.starts_with("idle") && l.contains("0/1") && l.contains("small")), "{t}");
        assert!(t.lines().any(|l| l.starts_with("idle") && l.contains("device=gpu,zone=a")), "{t}");
        assert!(t.lines().any(|l| l.starts_with("m ") && l.contains(" - ")), "{t}");
        let j = models_json(&rows);
        assert_eq!(j[0]["selector"]["zone"], "a");
        assert_eq!(j[1]["selector"], json!({}));
        assert_eq!(j[1]["status"][0]["ready"], 1);
        assert_eq!(j[1]["status"][0]["wanted"], 2);
        assert_eq!(j[1]["route"]["weights"]["2"], 10);
    }

    #[test]
    fn placement_groups_by_worker_with_status() {
        let (_, s) = fleet();
        let rows = placement(&s);
        assert_eq!(rows.iter().map(|r| r.worker).collect::<Vec<_>>(), ["w1", "w2", "w3"]);
        let t = placement_table(&rows);
        assert!(t.lines().any(|l| l.starts_with("w2") && l.contains("draining") && l.ends_with("LOADING")), "{t}");
        assert!(t.contains("FAILED: no such version"), "{t}");
        let j = placement_json(&rows);
        assert_eq!(j[2]["assignments"][0]["placed"], false);
        assert_eq!(j[0]["assignments"][0]["status"], "READY");

        let mut pending = s.clone();
        pending.statuses.clear();
        assert!(placement_table(&placement(&pending)).contains("PENDING"));
    }

    #[test]
    fn routes_show_weights_and_drift() {
        let (_, s) = fleet();
        let rows = routes(&s, None);
        let t = routes_table(&rows);
        assert!(t.contains("1=90 (90%), 2=10 (10%)") && t.contains("x-user"), "{t}");
        assert!(t.lines().any(|l| l.starts_with("gone") && l.ends_with("model not declared")), "{t}");
        let only = routes(&s, Some("m"));
        assert_eq!(only.len(), 1);
        assert!(only[0].undeclared_versions().is_empty());
        let j = routes_json(&only);
        assert_eq!(j[0]["weights"]["1"], 90);
        assert_eq!(j[0]["sticky_key"], "x-user");
        let third = RouteRecord { schema: 1, weights: [(1, 1), (2, 2)].into(), sticky_key: None };
        assert_eq!(weights_text(&third), "1=1 (33.3%), 2=2 (66.7%)");
    }

    #[test]
    fn get_marks_invalid_values() {
        let keys = Keys::new("/n").unwrap();
        let kvs: Vec<(&[u8], &[u8], i64)> = vec![
            (b"/n/models/m", br#"{"schema":1,"versions":[1],"replicas":1}"#, 0),
            (b"/n/models/bad", b"{", 0),
            (b"/n/workers/w", br#"{"schema":1,"id":"x","grpc":"a:1","state":"ready"}"#, 0x2a),
            (b"/n/leader/placement/1", b"g1", 0x2b),
            (b"/n/other\x1b[2J", b"\x1b]0;pwned\x07", 0),
        ];
        let rows = super::keys(&keys, kvs);
        assert_eq!(rows[0].invalid, None);
        assert!(rows[1].invalid.as_deref().unwrap().contains("not valid JSON"));
        assert!(rows[2].invalid.as_deref().unwrap().contains("does not match"));
        assert_eq!((rows[3].kind, &rows[3].invalid), ("other", &None));
        let t = keys_table(&rows);
        assert!(t.lines().any(|l| l.starts_with("/n/models/bad") && l.contains("<- INVALID: not valid JSON")), "{t}");
        assert!(t.lines().any(|l| l.starts_with("/n/workers/w") && l.contains("2a")), "{t}");
        // Terminal escapes in keys or values written by hand are shown escaped.
        assert!(!t.contains('\x1b') && !t.contains('\x07'), "{t:?}");
        assert!(t.contains("/n/other\\u{1b}[2J"), "{t}");
        let j = keys_json(&rows);
        assert_eq!(j[1]["valid"], false);
        assert_eq!(j[0]["valid"], true);
    }
}
