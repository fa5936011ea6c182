//! What the generator sends: weighted workload entries (model, shapes, tenant, priority,
//! deadline, SLO, class) and the input tensors each entry's requests carry.
//!
//! A workload comes from flags (one entry) or from a JSON file:
//!
//! ```json
//! { "entries": [
//!     { "model": "mlp_fp32", "weight": 3, "batch_size": 1, "class": "small", "slo_ms": 20,
//!       "tenant": "acme", "api_key": "k-acme", "priority": 1, "timeout_us": 50000 },
//!     { "model": "identity_fp32", "version": "1", "batch_size": 8,
//!       "shapes": { "INPUT0": [16] }, "data": "zero" },
//!     { "model": "identity_fp32", "data": "inputs/identity.json" },
//!     { "model": "text_encoder", "weight": 2, "mix": [
//!         { "weight": 6, "batch_size": 1, "shapes": { "TOKENS": [32] } },
//!         { "weight": 3, "batch_size": 4, "shapes": { "TOKENS": [128] } },
//!         { "weight": 1, "batch_size": 8, "shapes": { "TOKENS": [512] } } ] }
//! ] }
//! ```
//!
//! `mix` gives one entry a distribution of request shapes: each item is picked in proportion
//! to its weight within the entry's own weight, and sets the batch size and/or the shapes of
//! some inputs (merged over the entry's). Everything else — model, tenant, priority, deadline,
//! SLO, class — is the entry's, and the items are reported together as the entry's series.
//!
//! `data` is `zero`, `random`, or the path (relative to the workload file) of an input data
//! file in perf_analyzer's format ([`crate::data_file`]), read and checked when the workload is.
//!
//! The file is parsed with unknown keys refused and every value checked; errors name the key
//! (`entries[1].batch_size`) or the line and column. Input shapes and data types come from the
//! server's model metadata, so a workload names only what differs from the model's defaults.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nereid_common::dtype::DataType;
use rand::rngs::StdRng;
use rand::{Rng, RngExt, SeedableRng};
use serde::{Deserialize, Deserializer, Serialize};

use crate::data_file::{DataFile, DataRequest};

pub const DEFAULT_WEIGHT: f64 = 1.0;
pub const DEFAULT_BATCH_SIZE: u32 = 1;
/// Length of each generated element of a `BYTES` input.
pub const STRING_LENGTH: usize = 16;
/// Most entries a workload file may hold.
pub const MAX_ENTRIES: usize = 1_000;
/// Most items in one entry's `mix`.
pub const MAX_MIX_ITEMS: usize = 256;
/// Most request kinds a workload expands to (entries, each `mix` item counted).
pub const MAX_EXPANDED_ENTRIES: usize = 10_000;
/// Largest request body the generator will build for one entry (all inputs together).
pub const MAX_INPUT_BYTES: u64 = 256 << 20;
/// Largest latency SLO accepted, in milliseconds (1 hour: the longest latency the histograms
/// hold); `--slo-p99-ms`, `slo_ms` and nereid-analyze's `--max-p99-ms` alike.
pub const MAX_SLO_MS: f64 = 3_600_000.0;

/// Input tensor contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum InputData {
    /// All zeros (empty strings for `BYTES`).
    Zero,
    /// Seeded pseudo-random values: floats in [0, 1), integers over their range, booleans,
    /// 16-character lowercase ASCII strings.
    Random,
}

/// Where a request's input values come from.
#[derive(Clone, Debug, PartialEq)]
pub enum InputSource {
    /// Made up by the generator, once per workload entry.
    Generated(InputData),
    /// Read from an input data file; requests cycle through its entries in order.
    File(Arc<DataFile>),
}

impl InputSource {
    /// `zero`, `random`, or else the path of an input data file, read and checked now.
    /// `shown` is the name used in messages.
    pub fn from_arg(value: &str) -> Result<InputSource, WorkloadError> {
        match value {
            "zero" => Ok(InputSource::Generated(InputData::Zero)),
            "random" => Ok(InputSource::Generated(InputData::Random)),
            path => Ok(InputSource::File(Arc::new(read_data_file(Path::new(path), path)?))),
        }
    }
}

/// Reads and parses an input data file; `shown` names it in messages.
pub fn read_data_file(path: &Path, shown: &str) -> Result<DataFile, WorkloadError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        WorkloadError(format!("input data '{shown}': not zero or random, and not a readable JSON input data file: {e}"))
    })?;
    DataFile::from_json(shown, &text)
}

/// A workload entry's `data`: `"zero"`, `"random"` or a file path.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(from = "String", into = "String")]
pub enum DataSpec {
    Zero,
    Random,
    /// An input data file, relative to the workload file's directory.
    File(PathBuf),
}

impl From<String> for DataSpec {
    fn from(s: String) -> Self {
        match s.as_str() {
            "zero" => DataSpec::Zero,
            "random" => DataSpec::Random,
            _ => DataSpec::File(PathBuf::from(s)),
        }
    }
}

impl From<DataSpec> for String {
    fn from(d: DataSpec) -> Self {
        match d {
            DataSpec::Zero => "zero".into(),
            DataSpec::Random => "random".into(),
            DataSpec::File(p) => p.display().to_string(),
        }
    }
}

/// A workload file.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkloadFile {
    pub entries: Vec<Entry>,
}

/// One kind of request and how often it is sent relative to the others.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    pub model: String,
    /// Model version; empty or absent means the server's choice (latest ready).
    #[serde(default, deserialize_with = "version_string", skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Relative frequency; entries are picked at random in proportion to their weights.
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// Rows per request; must be 1 for models without batching.
    #[serde(default = "default_batch_size")]
    pub batch_size: u32,
    /// Non-batch dims per input name, for inputs with variable dims (`-1`) or to check fixed ones.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub shapes: BTreeMap<String, Vec<i64>>,
    /// Input contents: `zero`, `random` or an input data file; absent: the run's `--input-data`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DataSpec>,
    /// Label for reports; defaults to nothing (the API key is never printed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Sent as `authorization: Bearer <api_key>`.
    #[serde(default, skip_serializing)]
    pub api_key: Option<String>,
    /// Request parameter `priority` (1 is highest in Triton's scheme; 0 = model default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u64>,
    /// Request parameter `timeout` in microseconds (server-side queue deadline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_us: Option<u64>,
    /// Latency SLO of this entry's requests; overrides `--slo-p99-ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_ms: Option<f64>,
    /// Reporting class; entries of one class are reported together and must share an SLO.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// A distribution of request shapes (see the module docs); empty: every request is
    /// `batch_size` × `shapes`. Expanded away by [`Workload::new`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mix: Vec<MixItem>,
}

/// One request shape of an entry's `mix`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MixItem {
    /// Relative frequency within the entry.
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// Rows per request [default: the entry's `batch_size`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u32>,
    /// Non-batch dims of some inputs, replacing the entry's `shapes` for those inputs.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub shapes: BTreeMap<String, Vec<i64>>,
}

fn default_weight() -> f64 {
    DEFAULT_WEIGHT
}

fn default_batch_size() -> u32 {
    DEFAULT_BATCH_SIZE
}

/// Accepts `"version": "2"` and `"version": 2`.
fn version_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum V {
        S(String),
        N(u64),
    }
    Ok(match Option::<V>::deserialize(d)? {
        None => None,
        Some(V::S(s)) if s.is_empty() => None,
        Some(V::S(s)) => Some(s),
        Some(V::N(n)) => Some(n.to_string()),
    })
}

impl Entry {
    /// An entry with every optional field at its default.
    pub fn for_model(model: impl Into<String>) -> Self {
        Entry {
            model: model.into(),
            version: None,
            weight: DEFAULT_WEIGHT,
            batch_size: DEFAULT_BATCH_SIZE,
            shapes: BTreeMap::new(),
            data: None,
            tenant: None,
            api_key: None,
            priority: None,
            timeout_us: None,
            slo_ms: None,
            class: None,
            mix: Vec::new(),
        }
    }

    /// The name this entry is reported under: its class, else `model[:version][@tenant]`.
    pub fn series_name(&self) -> String {
        if let Some(class) = &self.class {
            return class.clone();
        }
        let mut s = self.model.clone();
        if let Some(v) = &self.version {
            s.push(':');
            s.push_str(v);
        }
        if let Some(t) = &self.tenant {
            s.push('@');
            s.push_str(t);
        }
        s
    }
}

/// A workload could not be used; the message names the key, line or input.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{0}")]
pub struct WorkloadError(pub String);

/// Where a workload came from, for error messages.
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    Flags,
    File(String),
}

/// A validated workload: entries plus the reporting series they map to.
#[derive(Clone, Debug)]
pub struct Workload {
    pub origin: Origin,
    pub entries: Vec<Entry>,
    /// `series_of[i]` is the index in `series` of entry `i`.
    pub series_of: Vec<usize>,
    pub series: Vec<Series>,
    /// `data[i]`: entry `i`'s own input contents (files read), `None` for the run's default.
    pub data: Vec<Option<InputSource>>,
    /// The run's own key (`--api-key`), sent on the calls that belong to no entry (health,
    /// metadata, config, shared-memory registration); entries carry theirs for inference.
    pub default_api_key: Option<String>,
    /// `names[i]`: how entry `i` is named in messages (`entries[3]`, `entries[3].mix[1]`;
    /// empty for flags).
    names: Vec<String>,
}

/// A group of entries reported together.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Series {
    pub name: String,
    pub models: Vec<String>,
    pub tenant: Option<String>,
    pub class: Option<String>,
    /// Latency SLO in milliseconds, from the entries or `--slo-p99-ms`.
    pub slo_ms: Option<f64>,
}

/// Entries reported together under one name: a series, a model or a tenant. Goodput counts
/// every request against its own entry's SLO, so a group may mix SLOs.
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    pub name: String,
    /// Indexes into [`Workload::entries`].
    pub entries: Vec<usize>,
    /// The SLO every entry shares; `None` when they differ or some entry has none.
    pub slo_ms: Option<f64>,
    /// Whether every entry has an SLO, so the group can be said to meet them (or not).
    pub has_slo: bool,
}

/// Name of the tenant group of entries that name no tenant.
pub const NO_TENANT: &str = "(no tenant)";

impl Workload {
    /// Parses and validates a workload file's text. `path` is only used in messages.
    pub fn from_json(path: &str, text: &str, default_slo_ms: Option<f64>) -> Result<Workload, WorkloadError> {
        let file: WorkloadFile =
            serde_json::from_str(text).map_err(|e| WorkloadError(format!("workload file {path}: {e}")))?;
        Workload::new(Origin::File(path.to_string()), file.entries, default_slo_ms)
    }

    /// Validates entries (from flags or a file) and groups them into series.
    pub fn new(origin: Origin, entries: Vec<Entry>, default_slo_ms: Option<f64>) -> Result<Workload, WorkloadError> {
        let prefix = match &origin {
            Origin::Flags => String::new(),
            Origin::File(p) => format!("workload file {p}: "),
        };
        if entries.is_empty() {
            return Err(WorkloadError(format!("{prefix}entries: must list at least one entry")));
        }
        if entries.len() > MAX_ENTRIES {
            return Err(WorkloadError(format!(
                "{prefix}entries: at most {MAX_ENTRIES} entries, got {}",
                entries.len()
            )));
        }
        for (i, e) in entries.iter().enumerate() {
            validate_entry(e)
                .map_err(|(key, msg)| WorkloadError(format!("{prefix}{}{key}: {msg}", entry_key(&origin, i))))?;
        }
        let (entries, names) = expand_mixes(&origin, entries).map_err(|msg| WorkloadError(format!("{prefix}{msg}")))?;
        // Data files, each read once, relative to the workload file.
        let base = match &origin {
            Origin::File(p) => Path::new(p).parent().map(Path::to_path_buf).unwrap_or_default(),
            Origin::Flags => PathBuf::new(),
        };
        let mut files: Vec<(PathBuf, Arc<DataFile>)> = Vec::new();
        let mut data = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            data.push(match &e.data {
                None => None,
                Some(DataSpec::Zero) => Some(InputSource::Generated(InputData::Zero)),
                Some(DataSpec::Random) => Some(InputSource::Generated(InputData::Random)),
                Some(DataSpec::File(p)) => {
                    let path = base.join(p);
                    let file = match files.iter().find(|(f, _)| *f == path) {
                        Some((_, file)) => file.clone(),
                        None => {
                            let file = Arc::new(
                                read_data_file(&path, &path.display().to_string())
                                    .map_err(|e| WorkloadError(format!("{prefix}{}.data: {}", names[i], e.0)))?,
                            );
                            files.push((path, file.clone()));
                            file
                        }
                    };
                    Some(InputSource::File(file))
                }
            });
        }
        let mut series: Vec<Series> = Vec::new();
        let mut series_of = Vec::with_capacity(entries.len());
        let mut first_of: Vec<usize> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let name = e.series_name();
            let slo_ms = e.slo_ms.or(default_slo_ms);
            match series.iter().position(|s| s.name == name) {
                Some(j) => {
                    let s = &mut series[j];
                    if s.slo_ms != slo_ms {
                        return Err(WorkloadError(format!(
                            "{prefix}{}.slo_ms: {} differs from {} of {} in the same class '{name}'",
                            names[i],
                            fmt_opt(slo_ms),
                            fmt_opt(s.slo_ms),
                            names[first_of[j]],
                        )));
                    }
                    if !s.models.contains(&e.model) {
                        s.models.push(e.model.clone());
                    }
                    if s.tenant != e.tenant {
                        s.tenant = None;
                    }
                    series_of.push(j);
                }
                None => {
                    series.push(Series {
                        name,
                        models: vec![e.model.clone()],
                        tenant: e.tenant.clone(),
                        class: e.class.clone(),
                        slo_ms,
                    });
                    first_of.push(i);
                    series_of.push(series.len() - 1);
                }
            }
        }
        Ok(Workload { origin, entries, series_of, series, data, default_api_key: None, names })
    }

    /// Entry `i`'s latency SLO (its series').
    pub fn entry_slo_ms(&self, i: usize) -> Option<f64> {
        self.series[self.series_of[i]].slo_ms
    }

    /// Entries grouped by `key`, groups in order of first appearance.
    fn groups_by(&self, key: impl Fn(usize, &Entry) -> String) -> Vec<Group> {
        let mut groups: Vec<Group> = Vec::new();
        for (i, e) in self.entries.iter().enumerate() {
            let name = key(i, e);
            match groups.iter_mut().find(|g| g.name == name) {
                Some(g) => g.entries.push(i),
                None => groups.push(Group { name, entries: vec![i], slo_ms: None, has_slo: false }),
            }
        }
        for g in &mut groups {
            let slos: Vec<Option<f64>> = g.entries.iter().map(|&i| self.entry_slo_ms(i)).collect();
            g.has_slo = slos.iter().all(Option::is_some);
            g.slo_ms = if slos.windows(2).all(|w| w[0] == w[1]) { slos[0] } else { None };
        }
        groups
    }

    /// The reporting series as groups of entries (same order as `series`).
    pub fn series_groups(&self) -> Vec<Group> {
        let mut groups = self.groups_by(|i, _| self.series[self.series_of[i]].name.clone());
        groups.sort_by_key(|g| self.series_of[g.entries[0]]);
        groups
    }

    /// One group per model (`model[:version]`), whatever class or tenant its entries have.
    pub fn model_groups(&self) -> Vec<Group> {
        self.groups_by(|_, e| match &e.version {
            Some(v) => format!("{}:{v}", e.model),
            None => e.model.clone(),
        })
    }

    /// One group per tenant (entries without one under [`NO_TENANT`]); empty when no entry
    /// names a tenant.
    pub fn tenant_groups(&self) -> Vec<Group> {
        if self.entries.iter().all(|e| e.tenant.is_none()) {
            return Vec::new();
        }
        self.groups_by(|_, e| e.tenant.clone().unwrap_or_else(|| NO_TENANT.to_string()))
    }

    /// How an entry is named in messages: `entries[3]` (or `entries[3].mix[1]`) for files,
    /// empty for flags.
    pub fn entry_name(&self, i: usize) -> String {
        self.names[i].clone()
    }

    /// Distinct `(model, version)` pairs, in first-use order.
    pub fn models(&self) -> Vec<(String, Option<String>)> {
        let mut out: Vec<(String, Option<String>)> = Vec::new();
        for e in &self.entries {
            let key = (e.model.clone(), e.version.clone());
            if !out.contains(&key) {
                out.push(key);
            }
        }
        out
    }

    /// Whether any series has an SLO.
    pub fn has_slo(&self) -> bool {
        self.series.iter().any(|s| s.slo_ms.is_some())
    }
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map(|v| format!("{v}")).unwrap_or_else(|| "none".into())
}

fn entry_key(origin: &Origin, i: usize) -> String {
    match origin {
        Origin::Flags => String::new(),
        Origin::File(_) => format!("entries[{i}]"),
    }
}

/// Replaces every entry that has a `mix` by one entry per item (weight split in proportion,
/// batch size and shapes from the item); returns the entries and their names for messages.
fn expand_mixes(origin: &Origin, entries: Vec<Entry>) -> Result<(Vec<Entry>, Vec<String>), String> {
    let mut out = Vec::with_capacity(entries.len());
    let mut names = Vec::with_capacity(entries.len());
    for (i, mut e) in entries.into_iter().enumerate() {
        let name = entry_key(origin, i);
        if e.mix.is_empty() {
            out.push(e);
            names.push(name);
            continue;
        }
        let mix = std::mem::take(&mut e.mix);
        let total: f64 = mix.iter().map(|m| m.weight).sum();
        if !total.is_finite() {
            return Err(format!("{name}.mix: the item weights add up past the largest number; use smaller weights"));
        }
        for (j, item) in mix.into_iter().enumerate() {
            let mut x = e.clone();
            x.weight = e.weight * item.weight / total;
            if let Some(b) = item.batch_size {
                x.batch_size = b;
            }
            x.shapes.extend(item.shapes);
            out.push(x);
            names.push(format!("{name}.mix[{j}]"));
        }
        if out.len() > MAX_EXPANDED_ENTRIES {
            return Err(format!(
                "{name}.mix: the workload expands to more than {MAX_EXPANDED_ENTRIES} request kinds \
                 (entries × mix items)"
            ));
        }
    }
    Ok((out, names))
}

/// Checks one entry; on error returns the key (`.batch_size`, empty for flags-level) and why.
fn validate_entry(e: &Entry) -> Result<(), (String, String)> {
    let bad = |key: &str, msg: String| Err((format!(".{key}"), msg));
    if e.model.trim().is_empty() {
        return bad("model", "must not be empty".into());
    }
    if !(e.weight.is_finite() && e.weight > 0.0) {
        return bad("weight", format!("must be a positive number, got {}", e.weight));
    }
    if e.batch_size == 0 {
        return bad("batch_size", "must be at least 1".into());
    }
    check_shapes(&e.shapes)?;
    if let Some(t) = &e.tenant
        && t.is_empty()
    {
        return bad("tenant", "must not be empty".into());
    }
    if let Some(k) = &e.api_key
        && (k.is_empty() || k.chars().any(|c| c.is_control() || c == ' '))
    {
        return bad("api_key", "must be a non-empty token without spaces or control characters".into());
    }
    if let Some(t) = e.timeout_us
        && t == 0
    {
        return bad("timeout_us", "must be at least 1 (omit it for the model's default)".into());
    }
    if let Some(s) = e.slo_ms
        && !(s.is_finite() && s > 0.0 && s <= MAX_SLO_MS)
    {
        return bad(
            "slo_ms",
            format!("must be a positive number of milliseconds, at most {MAX_SLO_MS} (1 hour), got {s}"),
        );
    }
    if let Some(c) = &e.class
        && c.is_empty()
    {
        return bad("class", "must not be empty".into());
    }
    if let Some(DataSpec::File(p)) = &e.data
        && p.as_os_str().is_empty()
    {
        return bad("data", "must be zero, random or the path of an input data file".into());
    }
    if e.mix.len() > MAX_MIX_ITEMS {
        return bad("mix", format!("at most {MAX_MIX_ITEMS} items, got {}", e.mix.len()));
    }
    for (j, m) in e.mix.iter().enumerate() {
        if !(m.weight.is_finite() && m.weight > 0.0) {
            return bad(&format!("mix[{j}].weight"), format!("must be a positive number, got {}", m.weight));
        }
        if m.batch_size == Some(0) {
            return bad(&format!("mix[{j}].batch_size"), "must be at least 1".into());
        }
        check_shapes(&m.shapes).map_err(|(key, msg)| (format!(".mix[{j}]{key}"), msg))?;
    }
    Ok(())
}

/// Checks a `shapes` map; on error returns the key (`.shapes.INPUT0`) and why.
fn check_shapes(shapes: &BTreeMap<String, Vec<i64>>) -> Result<(), (String, String)> {
    for (name, dims) in shapes {
        if name.is_empty() {
            return Err((".shapes".into(), "input names must not be empty".into()));
        }
        if let Some(d) = dims.iter().find(|d| **d < 0) {
            return Err((format!(".shapes.{name}"), format!("dims must be concrete (≥ 0), got {d}")));
        }
    }
    Ok(())
}

/// Picks entries at random in proportion to their weights (inverse CDF over the cumulative
/// weights; O(log n) per pick).
#[derive(Clone, Debug)]
pub struct Picker {
    cumulative: Vec<f64>,
}

impl Picker {
    /// `weights` must be positive and finite (validated workloads are).
    pub fn new(weights: impl IntoIterator<Item = f64>) -> Self {
        let mut total = 0.0;
        let cumulative = weights
            .into_iter()
            .map(|w| {
                total += w;
                total
            })
            .collect();
        Picker { cumulative }
    }

    /// The entry for a uniform sample `u` in [0, 1).
    pub fn pick(&self, u: f64) -> usize {
        if self.cumulative.len() <= 1 {
            return 0;
        }
        let total = *self.cumulative.last().unwrap_or(&1.0);
        let x = u * total;
        self.cumulative.partition_point(|c| *c <= x).min(self.cumulative.len() - 1)
    }
}

/// A model as the server describes it (`ModelMetadata` + `max_batch_size` from `ModelConfig`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelInfo {
    pub name: String,
    pub versions: Vec<String>,
    /// 0: the model does not batch; its shapes have no batch dimension.
    pub max_batch_size: u32,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
}

/// A tensor as metadata reports it: shapes include `-1` for the batch and variable dims.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

/// One concrete input of a request.
#[derive(Clone, PartialEq)]
pub struct InputTensor {
    pub name: String,
    pub datatype: DataType,
    /// Full shape, batch dimension included where the model batches.
    pub shape: Vec<i64>,
    /// Row-major little-endian bytes; `BYTES` elements are a 4-byte length then the bytes.
    pub data: Vec<u8>,
}

impl fmt::Debug for InputTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InputTensor")
            .field("name", &self.name)
            .field("datatype", &self.datatype)
            .field("shape", &self.shape)
            .field("bytes", &self.data.len())
            .finish()
    }
}

/// Builds the inputs of `entry`'s requests for `model`: shapes from metadata completed by
/// `entry.shapes` and `entry.batch_size`, contents per `data`, random ones from `seed`.
/// Errors say which input or setting does not fit the model.
pub fn resolve_inputs(
    entry: &Entry,
    model: &ModelInfo,
    data: InputData,
    seed: u64,
) -> Result<Vec<InputTensor>, WorkloadError> {
    let err = |msg: String| Err(WorkloadError(format!("model '{}': {msg}", model.name)));
    check_entry_fits(entry, model)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut total_bytes = 0u64;
    let mut out = Vec::with_capacity(model.inputs.len());
    for input in &model.inputs {
        let Some(dtype) = DataType::from_wire_name(&input.datatype) else {
            return err(format!(
                "input '{}' has datatype '{}', which the generator does not know",
                input.name, input.datatype
            ));
        };
        let model_dims: &[i64] =
            if model.max_batch_size > 0 { input.shape.get(1..).unwrap_or(&[]) } else { &input.shape };
        let dims: Vec<i64> = match entry.shapes.get(&input.name) {
            Some(given) => {
                if given.len() != model_dims.len() {
                    return err(format!(
                        "shape {given:?} for '{}' has {} dims but the model's input has {} (non-batch dims {model_dims:?})",
                        input.name,
                        given.len(),
                        model_dims.len()
                    ));
                }
                for (g, m) in given.iter().zip(model_dims) {
                    if *m >= 0 && g != m {
                        return err(format!(
                            "shape {given:?} for '{}' does not match the model's dims {model_dims:?}",
                            input.name
                        ));
                    }
                }
                given.clone()
            }
            None if model_dims.iter().any(|d| *d < 0) => {
                return err(format!(
                    "input '{}' has variable dims {model_dims:?}; give concrete ones with --shape {}:<d1,d2,...> or \"shapes\" in the workload file",
                    input.name, input.name
                ));
            }
            None => model_dims.to_vec(),
        };
        let mut shape = Vec::with_capacity(dims.len() + 1);
        if model.max_batch_size > 0 {
            shape.push(entry.batch_size as i64);
        }
        shape.extend_from_slice(&dims);
        let per_element = dtype.element_size().map(|w| w as u64).unwrap_or(4 + STRING_LENGTH as u64);
        let elements = nereid_common::dtype::element_count(&shape).unwrap_or(u64::MAX);
        total_bytes = total_bytes.saturating_add(elements.saturating_mul(per_element));
        if total_bytes > MAX_INPUT_BYTES {
            return err(format!(
                "inputs need {total_bytes} bytes per request, more than the generator's limit of {MAX_INPUT_BYTES}"
            ));
        }
        let data = generate(dtype, elements as usize, data, &mut rng);
        out.push(InputTensor { name: input.name.clone(), datatype: dtype, shape, data });
    }
    Ok(out)
}

/// The distinct requests of `entry` for `model`: one for generated data (see
/// [`resolve_inputs`]), one per row group of an input data file (see [`DataFile::requests`]).
pub fn resolve_requests(
    entry: &Entry,
    model: &ModelInfo,
    source: &InputSource,
    seed: u64,
) -> Result<Vec<DataRequest>, WorkloadError> {
    match source {
        InputSource::Generated(data) => {
            let inputs = resolve_inputs(entry, model, *data, seed)?;
            Ok(vec![DataRequest { source: "generated".into(), inputs, expected: Vec::new() }])
        }
        InputSource::File(file) => {
            check_entry_fits(entry, model)?;
            file.requests(entry, model).map_err(|e| WorkloadError(format!("model '{}': {}", model.name, e.0)))
        }
    }
}

/// The batch size fits the model and `shapes` names only its inputs.
fn check_entry_fits(entry: &Entry, model: &ModelInfo) -> Result<(), WorkloadError> {
    let err = |msg: String| Err(WorkloadError(format!("model '{}': {msg}", model.name)));
    if model.max_batch_size == 0 && entry.batch_size != 1 {
        return err(format!(
            "batch size {} requested but the model does not batch (max_batch_size 0)",
            entry.batch_size
        ));
    }
    if model.max_batch_size > 0 && entry.batch_size > model.max_batch_size {
        return err(format!(
            "batch size {} exceeds the model's max_batch_size {}",
            entry.batch_size, model.max_batch_size
        ));
    }
    for name in entry.shapes.keys() {
        if !model.inputs.iter().any(|i| &i.name == name) {
            let known: Vec<&str> = model.inputs.iter().map(|i| i.name.as_str()).collect();
            return err(format!("shape given for '{name}', which is not an input (inputs: {})", known.join(", ")));
        }
    }
    Ok(())
}

/// Element bytes for `n` elements of `dtype`.
fn generate(dtype: DataType, n: usize, data: InputData, rng: &mut StdRng) -> Vec<u8> {
    match (dtype, data) {
        (DataType::Bytes, InputData::Zero) => vec![0u8; 4 * n],
        (DataType::Bytes, InputData::Random) => {
            let mut out = Vec::with_capacity(n * (4 + STRING_LENGTH));
            for _ in 0..n {
                out.extend_from_slice(&(STRING_LENGTH as u32).to_le_bytes());
                out.extend((0..STRING_LENGTH).map(|_| rng.random_range(b'a'..=b'z')));
            }
            out
        }
        (_, InputData::Zero) => vec![0u8; n * dtype.element_size().unwrap_or(1)],
        (DataType::Bool, InputData::Random) => (0..n).map(|_| rng.random::<bool>() as u8).collect(),
        (DataType::Fp32, InputData::Random) => (0..n).flat_map(|_| rng.random::<f32>().to_le_bytes()).collect(),
        (DataType::Fp64, InputData::Random) => (0..n).flat_map(|_| rng.random::<f64>().to_le_bytes()).collect(),
        // bfloat16 is the top half of an f32.
        (DataType::Bf16, InputData::Random) => {
            (0..n).flat_map(|_| ((rng.random::<f32>().to_bits() >> 16) as u16).to_le_bytes()).collect()
        }
        // IEEE half in [0, 1): biased exponent 0..=14, any mantissa.
        (DataType::Fp16, InputData::Random) => (0..n)
            .flat_map(|_| {
                let exp = rng.random_range(0u16..15);
                let mantissa = rng.random_range(0u16..1024);
                ((exp << 10) | mantissa).to_le_bytes()
            })
            .collect(),
        // Integers: any bit pattern is a valid value.
        (_, InputData::Random) => {
            let mut out = vec![0u8; n * dtype.element_size().unwrap_or(1)];
            rng.fill_bytes(&mut out);
            out
        }
    }
}

/// The JSON `data` array of a tensor (KServe v2 JSON tensor format), row-major and flat.
pub fn json_data(dtype: DataType, raw: &[u8]) -> serde_json::Value {
    use serde_json::Value;
    fn chunks<const N: usize>(raw: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
        raw.chunks_exact(N).map(|c| c.try_into().unwrap_or([0; N]))
    }
    let num = |v: f64| serde_json::Number::from_f64(v).map(Value::Number).unwrap_or(Value::Null);
    let values: Vec<Value> = match dtype {
        DataType::Bool => raw.iter().map(|b| Value::Bool(*b != 0)).collect(),
        DataType::Uint8 => raw.iter().map(|b| Value::from(*b)).collect(),
        DataType::Int8 => raw.iter().map(|b| Value::from(*b as i8)).collect(),
        DataType::Uint16 => chunks::<2>(raw).map(|c| Value::from(u16::from_le_bytes(c))).collect(),
        DataType::Int16 => chunks::<2>(raw).map(|c| Value::from(i16::from_le_bytes(c))).collect(),
        DataType::Uint32 => chunks::<4>(raw).map(|c| Value::from(u32::from_le_bytes(c))).collect(),
        DataType::Int32 => chunks::<4>(raw).map(|c| Value::from(i32::from_le_bytes(c))).collect(),
        DataType::Uint64 => chunks::<8>(raw).map(|c| Value::from(u64::from_le_bytes(c))).collect(),
        DataType::Int64 => chunks::<8>(raw).map(|c| Value::from(i64::from_le_bytes(c))).collect(),
        DataType::Fp32 => chunks::<4>(raw).map(|c| num(f32::from_le_bytes(c) as f64)).collect(),
        DataType::Fp64 => chunks::<8>(raw).map(|c| num(f64::from_le_bytes(c))).collect(),
        DataType::Bf16 => {
            chunks::<2>(raw).map(|c| num(f32::from_bits((u16::from_le_bytes(c) as u32) << 16) as f64)).collect()
        }
        DataType::Fp16 => chunks::<2>(raw).map(|c| num(f16_to_f32(u16::from_le_bytes(c)) as f64)).collect(),
        DataType::Bytes => {
            let mut out = Vec::new();
            let mut rest = raw;
            while rest.len() >= 4 {
                let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                let end = (4 + len).min(rest.len());
                out.push(Value::String(String::from_utf8_lossy(&rest[4..end]).into_owned()));
                rest = &rest[end..];
            }
            out
        }
    };
    Value::Array(values)
}

/// Why a tensor cannot be written exactly as KServe v2 JSON (a NaN or infinite float, a
/// `BYTES` element that is not UTF-8), or `None` if it can. Only `b64` values of an input data
/// file can hold such elements.
pub fn json_unrepresentable(dtype: DataType, raw: &[u8]) -> Option<String> {
    let bad_float = |i: usize| Some(format!("element {i} is NaN or infinite, which JSON cannot carry"));
    match dtype {
        DataType::Fp32 => raw
            .chunks_exact(4)
            .position(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())
            .and_then(bad_float),
        DataType::Fp64 => raw
            .chunks_exact(8)
            .position(|c| !f64::from_le_bytes(c.try_into().unwrap_or([0; 8])).is_finite())
            .and_then(bad_float),
        // Exponent bits all set: infinity or NaN.
        DataType::Fp16 => {
            raw.chunks_exact(2).position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00).and_then(bad_float)
        }
        DataType::Bf16 => {
            raw.chunks_exact(2).position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80).and_then(bad_float)
        }
        DataType::Bytes => {
            let mut rest = raw;
            let mut i = 0;
            while rest.len() >= 4 {
                let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                let end = (4 + len).min(rest.len());
                if std::str::from_utf8(&rest[4..end]).is_err() {
                    return Some(format!("element {i} is not UTF-8, which a JSON string cannot carry"));
                }
                rest = &rest[end..];
                i += 1;
            }
            None
        }
        _ => None,
    }
}

/// IEEE 754 half → single (normals, subnormals, infinities and NaN).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let mantissa = (h & 0x3ff) as u32;
    let bits = match (exp, mantissa) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value = m × 2^-24.
            let v = m as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mlp() -> ModelInfo {
        ModelInfo {
            name: "mlp_fp32".into(),
            versions: vec!["1".into()],
            max_batch_size: 64,
            inputs: vec![TensorSpec { name: "INPUT0".into(), datatype: "FP32".into(), shape: vec![-1, 256] }],
            outputs: vec![TensorSpec { name: "OUTPUT0".into(), datatype: "FP32".into(), shape: vec![-1, 10] }],
        }
    }

    #[test]
    fn a_full_workload_file_parses() {
        let w = Workload::from_json(
            "w.json",
            r#"{"entries":[
                {"model":"mlp_fp32","weight":3,"class":"small","slo_ms":20,"tenant":"acme","api_key":"k1","priority":1,"timeout_us":50000},
                {"model":"identity_fp32","version":1,"batch_size":8,"shapes":{"INPUT0":[16]},"data":"zero"},
                {"model":"mlp_fp32","class":"small","slo_ms":20}
            ]}"#,
            Some(100.0),
        )
        .unwrap();
        assert_eq!(w.entries.len(), 3);
        assert_eq!(w.entries[1].version.as_deref(), Some("1"));
        assert_eq!(w.entries[1].data, Some(DataSpec::Zero));
        assert_eq!(w.data[1], Some(InputSource::Generated(InputData::Zero)));
        assert_eq!(w.data[0], None, "no data: the run's --input-data");
        assert_eq!(w.series.len(), 2);
        assert_eq!(w.series_of, vec![0, 1, 0]);
        assert_eq!(w.series[0].name, "small");
        assert_eq!(w.series[0].slo_ms, Some(20.0));
        assert_eq!(w.series[0].tenant, None, "mixed tenants in one class are not attributed to one");
        assert_eq!(w.series[1].name, "identity_fp32:1");
        assert_eq!(w.series[1].slo_ms, Some(100.0), "--slo-p99-ms is the default");
        assert_eq!(w.models(), vec![("mlp_fp32".into(), None), ("identity_fp32".into(), Some("1".into()))]);
    }

    #[test]
    fn entries_group_by_series_model_and_tenant() {
        let w = Workload::from_json(
            "w.json",
            r#"{"entries":[
                {"model":"mlp_fp32","class":"small","slo_ms":20,"tenant":"acme"},
                {"model":"identity_fp32","class":"small","slo_ms":20,"tenant":"globex"},
                {"model":"mlp_fp32","tenant":"globex","slo_ms":50},
                {"model":"identity_fp32","version":2}
            ]}"#,
            None,
        )
        .unwrap();
        let names = |gs: &[Group]| gs.iter().map(|g| (g.name.clone(), g.entries.clone())).collect::<Vec<_>>();
        assert_eq!(
            names(&w.series_groups()),
            vec![
                ("small".into(), vec![0, 1]),
                ("mlp_fp32@globex".into(), vec![2]),
                ("identity_fp32:2".into(), vec![3])
            ]
        );
        let models = w.model_groups();
        assert_eq!(
            names(&models),
            vec![
                ("mlp_fp32".into(), vec![0, 2]),
                ("identity_fp32".into(), vec![1]),
                ("identity_fp32:2".into(), vec![3])
            ]
        );
        assert_eq!((models[0].slo_ms, models[0].has_slo), (None, true), "20 and 50 ms: each request against its own");
        assert_eq!((models[1].slo_ms, models[1].has_slo), (Some(20.0), true));
        assert_eq!((models[2].slo_ms, models[2].has_slo), (None, false));
        let tenants = w.tenant_groups();
        assert_eq!(
            names(&tenants),
            vec![("acme".into(), vec![0]), ("globex".into(), vec![1, 2]), (NO_TENANT.into(), vec![3])]
        );
        assert_eq!(tenants[1].slo_ms, None);
        let plain = Workload::from_json("w.json", r#"{"entries":[{"model":"a"}]}"#, None).unwrap();
        assert!(plain.tenant_groups().is_empty(), "no tenant named: no tenant breakdown");
    }

    #[test]
    fn workload_errors_name_the_key() {
        let e = |text: &str| Workload::from_json("w.json", text, None).unwrap_err().0;
        let unknown = e(r#"{"entries":[{"model":"m",
            "batchsize":4}]}"#);
        assert!(
            unknown.contains("w.json") && unknown.contains("unknown field `batchsize`") && unknown.contains("line 2"),
            "{unknown}"
        );
        assert!(e(r#"{"entries":[], "extra":1}"#).contains("unknown field `extra`"));
        assert!(e(r#"{"entries":[]}"#).contains("entries: must list at least one entry"));
        assert!(e(r#"{"entries":[{"weight":1}]}"#).contains("missing field `model`"));
        assert!(
            e(r#"{"entries":[{"model":"m"},{"model":"m","batch_size":0}]}"#)
                .contains("entries[1].batch_size: must be at least 1")
        );
        assert!(e(r#"{"entries":[{"model":"m","weight":0}]}"#).contains("entries[0].weight"));
        assert!(e(r#"{"entries":[{"model":"m","slo_ms":-1}]}"#).contains("entries[0].slo_ms"));
        assert!(e(r#"{"entries":[{"model":"m","shapes":{"X":[2,-1]}}]}"#).contains("entries[0].shapes.X"));
        assert!(e(r#"{"entries":[{"model":"m","api_key":"a b"}]}"#).contains("entries[0].api_key"));
        let data = e(r#"{"entries":[{"model":"m","data":"ones"}]}"#);
        assert!(data.contains("entries[0].data") && data.contains("not zero or random"), "{data}");
        assert!(e(r#"{"entries":[{"model":"m","data":""}]}"#).contains("entries[0].data"));
        assert!(e(r#"{"entries":[{"model":"m","data":3}]}"#).contains("expected a string"));
        let slo = e(r#"{"entries":[{"model":"a","class":"c","slo_ms":5},{"model":"b","class":"c","slo_ms":6}]}"#);
        assert!(slo.contains("entries[1].slo_ms") && slo.contains("entries[0]") && slo.contains("'c'"), "{slo}");
        assert!(e("{").contains("EOF while parsing"));
    }

    #[test]
    fn a_mix_expands_into_weighted_request_shapes_of_one_series() {
        let w = Workload::from_json(
            "w.json",
            r#"{"entries":[
                {"model":"a","weight":1},
                {"model":"t","weight":3,"batch_size":2,"shapes":{"X":[8],"Y":[4]},"tenant":"acme","priority":2,
                 "mix":[{"weight":2,"shapes":{"X":[16]}},{"batch_size":8},{"weight":1,"batch_size":4,"shapes":{"Y":[1]}}]}
            ]}"#,
            None,
        )
        .unwrap();
        assert_eq!(w.entries.len(), 4, "one entry per mix item");
        let t = &w.entries[1..];
        let weights: Vec<f64> = t.iter().map(|e| e.weight).collect();
        assert_eq!(weights, vec![1.5, 0.75, 0.75], "the entry's weight split 2:1:1");
        assert_eq!(t.iter().map(|e| e.batch_size).collect::<Vec<_>>(), vec![2, 8, 4], "item batch or the entry's");
        assert_eq!(t[0].shapes["X"], vec![16]);
        assert_eq!(t[0].shapes["Y"], vec![4], "shapes merge over the entry's");
        assert_eq!(t[1].shapes["X"], vec![8]);
        assert_eq!(t[2].shapes["Y"], vec![1]);
        assert!(t.iter().all(|e| e.mix.is_empty() && e.priority == Some(2) && e.tenant.as_deref() == Some("acme")));
        assert_eq!(w.series.len(), 2, "a mix is reported as its entry");
        assert_eq!(w.series_of, vec![0, 1, 1, 1]);
        assert_eq!(w.entry_name(0), "entries[0]");
        assert_eq!(w.entry_name(2), "entries[1].mix[1]");

        let e = |text: &str| Workload::from_json("w.json", text, None).unwrap_err().0;
        assert!(e(r#"{"entries":[{"model":"m","mix":[{"weight":0}]}]}"#).contains("entries[0].mix[0].weight"));
        assert!(
            e(r#"{"entries":[{"model":"m","mix":[{},{"batch_size":0}]}]}"#).contains("entries[0].mix[1].batch_size")
        );
        assert!(
            e(r#"{"entries":[{"model":"m","mix":[{"shapes":{"X":[-1]}}]}]}"#).contains("entries[0].mix[0].shapes.X")
        );
        assert!(e(r#"{"entries":[{"model":"m","mix":[{"batch":2}]}]}"#).contains("unknown field `batch`"));
        let many = format!(r#"{{"entries":[{{"model":"m","mix":[{}]}}]}}"#, vec!["{}"; MAX_MIX_ITEMS + 1].join(","));
        assert!(e(&many).contains("entries[0].mix: at most 256 items"));
        let huge = r#"{"entries":[{"model":"m","mix":[{"weight":1e308},{"weight":1e308}]}]}"#;
        assert!(e(huge).contains("entries[0].mix: the item weights add up past the largest number"), "{}", e(huge));
        let one = format!(r#"{{"model":"m","mix":[{}]}}"#, vec!["{}"; MAX_MIX_ITEMS].join(","));
        let wide = format!(r#"{{"entries":[{}]}}"#, vec![one.as_str(); 40].join(","));
        assert!(e(&wide).contains("expands to more than 10000 request kinds"), "{}", e(&wide));
    }

    #[test]
    fn a_mix_item_s_shape_error_names_the_item() {
        let w = Workload::from_json(
            "w.json",
            r#"{"entries":[{"model":"mlp_fp32","mix":[{"batch_size":2},{"shapes":{"INPUT0":[128]}}]}]}"#,
            None,
        )
        .unwrap();
        assert!(resolve_inputs(&w.entries[0], &mlp(), InputData::Zero, 1).is_ok());
        assert!(resolve_inputs(&w.entries[1], &mlp(), InputData::Zero, 1).unwrap_err().0.contains("does not match"));
        assert_eq!(w.entry_name(1), "entries[0].mix[1]", "what the driver prefixes the error with");
    }

    #[test]
    fn inputs_take_shapes_from_metadata_and_flags() {
        let mut entry = Entry::for_model("mlp_fp32");
        entry.batch_size = 4;
        let inputs = resolve_inputs(&entry, &mlp(), InputData::Random, 1).unwrap();
        assert_eq!(inputs[0].shape, vec![4, 256]);
        assert_eq!(inputs[0].data.len(), 4 * 256 * 4);
        let floats: Vec<f32> =
            inputs[0].data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert!(floats.iter().all(|f| (0.0..1.0).contains(f)));
        assert_eq!(inputs, resolve_inputs(&entry, &mlp(), InputData::Random, 1).unwrap(), "seeded");
        let zero = resolve_inputs(&entry, &mlp(), InputData::Zero, 1).unwrap();
        assert!(zero[0].data.iter().all(|b| *b == 0));

        entry.batch_size = 65;
        assert!(resolve_inputs(&entry, &mlp(), InputData::Zero, 1).unwrap_err().0.contains("max_batch_size 64"));
        entry.batch_size = 1;
        entry.shapes.insert("INPUT0".into(), vec![128]);
        assert!(resolve_inputs(&entry, &mlp(), InputData::Zero, 1).unwrap_err().0.contains("does not match"));
        entry.shapes.clear();
        entry.shapes.insert("NOPE".into(), vec![1]);
        assert!(
            resolve_inputs(&entry, &mlp(), InputData::Zero, 1).unwrap_err().0.contains("'NOPE', which is not an input")
        );

        let mut var = mlp();
        var.max_batch_size = 0;
        var.inputs[0] = TensorSpec { name: "X".into(), datatype: "BYTES".into(), shape: vec![2, -1] };
        let mut e = Entry::for_model("v");
        assert!(resolve_inputs(&e, &var, InputData::Zero, 1).unwrap_err().0.contains("--shape X:"));
        e.shapes.insert("X".into(), vec![2, 3]);
        let r = resolve_inputs(&e, &var, InputData::Random, 1).unwrap();
        assert_eq!(r[0].shape, vec![2, 3]);
        assert_eq!(r[0].data.len(), 6 * (4 + STRING_LENGTH));
        e.batch_size = 2;
        assert!(resolve_inputs(&e, &var, InputData::Zero, 1).unwrap_err().0.contains("does not batch"));
    }

    #[test]
    fn entries_read_data_files_relative_to_the_workload_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("in")).unwrap();
        std::fs::write(dir.path().join("in/d.json"), r#"{"data":[{"INPUT0":[1,2]}]}"#).unwrap();
        let path = dir.path().join("w.json");
        let text = r#"{"entries":[{"model":"a","data":"in/d.json"},{"model":"b","data":"in/d.json"},{"model":"c"}]}"#;
        let w = Workload::from_json(path.to_str().unwrap(), text, None).unwrap();
        let (Some(InputSource::File(a)), Some(InputSource::File(b))) = (&w.data[0], &w.data[1]) else {
            panic!("{:?}", w.data)
        };
        assert!(Arc::ptr_eq(a, b), "one file is read once");
        assert_eq!(a.entries.len(), 1);
        assert_eq!(w.data[2], None);
        assert_eq!(serde_json::to_value(&w.entries[0]).unwrap()["data"], "in/d.json");

        std::fs::write(dir.path().join("in/d.json"), r#"{"data":[{"INPUT0":{"b64":"!!"}}]}"#).unwrap();
        let err = Workload::from_json(path.to_str().unwrap(), text, None).unwrap_err().0;
        assert!(err.contains("entries[0].data") && err.contains("data[0].INPUT0.b64: not valid base64"), "{err}");
    }

    #[test]
    fn json_safety_of_tensors() {
        assert_eq!(json_unrepresentable(DataType::Fp32, &1.0f32.to_le_bytes()), None);
        assert!(json_unrepresentable(DataType::Fp32, &f32::NAN.to_le_bytes()).unwrap().contains("element 0"));
        assert!(json_unrepresentable(DataType::Fp16, &0x7c00u16.to_le_bytes()).is_some());
        assert!(json_unrepresentable(DataType::Bf16, &0x7f80u16.to_le_bytes()).is_some());
        assert!(json_unrepresentable(DataType::Fp64, &f64::INFINITY.to_le_bytes()).is_some());
        let mut s = 1u32.to_le_bytes().to_vec();
        s.push(0xff);
        assert!(json_unrepresentable(DataType::Bytes, &s).unwrap().contains("UTF-8"));
        assert_eq!(json_unrepresentable(DataType::Int32, &[0xff; 4]), None);
    }

    #[test]
    fn json_data_decodes_every_type() {
        assert_eq!(json_data(DataType::Fp32, &1.5f32.to_le_bytes()), serde_json::json!([1.5]));
        assert_eq!(json_data(DataType::Int64, &(-3i64).to_le_bytes()), serde_json::json!([-3]));
        assert_eq!(json_data(DataType::Bool, &[0, 1]), serde_json::json!([false, true]));
        assert_eq!(json_data(DataType::Fp16, &0x3c00u16.to_le_bytes()), serde_json::json!([1.0]));
        assert_eq!(json_data(DataType::Bf16, &0x3fc0u16.to_le_bytes()), serde_json::json!([1.5]));
        let mut s = 2u32.to_le_bytes().to_vec();
        s.extend_from_slice(b"hi");
        s.extend_from_slice(&0u32.to_le_bytes());
        assert_eq!(json_data(DataType::Bytes, &s), serde_json::json!(["hi", ""]));
    }

    #[test]
    fn picker_follows_weights() {
        let p = Picker::new([1.0, 3.0]);
        assert_eq!(p.pick(0.0), 0);
        assert_eq!(p.pick(0.24), 0);
        assert_eq!(p.pick(0.25), 1);
        assert_eq!(p.pick(0.999_999), 1);
        let mut rng = StdRng::seed_from_u64(3);
        let n = 100_000;
        let ones = (0..n).filter(|_| p.pick(rng.random()) == 1).count();
        assert!((ones as f64 / n as f64 - 0.75).abs() < 0.01);
        assert_eq!(Picker::new([2.0]).pick(0.9), 0);
    }
}
