//! Loading one model from disk: config (parsed, auto-completed, validated against the ONNX
//! model), instance sessions, warmup, schedulers. Runs on a blocking thread.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime};

use nereid_common::config::{
    Severity, dynamic_batching, parse_model_config, parse_model_config_json, unsupported_fields, validate_model_config,
};
use nereid_common::{DataType, Status};
use nereid_proto::inference::model_config::SchedulingChoice;
use nereid_proto::inference::model_instance_group::Kind;
use nereid_proto::inference::model_version_policy::PolicyChoice;
use nereid_proto::inference::model_warmup::input::InputDataType;
use nereid_proto::inference::{
    ModelConfig, ModelDynamicBatching, ModelInput, ModelInstanceGroup, ModelOutput, ModelQueuePolicy,
    ModelTensorReshape,
};

use super::{Executor, LoadedModel, ModelVersion, RepositoryOptions};
use crate::backend::{self, Device, InstanceSession, JobInputs, ModelIo, SessionOptions, TensorSpec};
use crate::ensemble;
use crate::metrics::Metrics;
use crate::scheduler::Scheduler;
use crate::scheduler::policy::{BatchPolicy, LevelPolicy, TimeoutAction};
use crate::validate::ModelSpec;

/// Triton's default `max_batch_size` when auto-completing a model that can batch.
pub const AUTOCOMPLETE_MAX_BATCH_SIZE: i32 = 4;
const DEFAULT_MODEL_FILENAME: &str = "model.onnx";

/// Model directories by name across all repositories. A name found in several repositories
/// maps to the first one here (so the index lists it once); [`load_model`] refuses to load it
/// (see [`model_dirs`]), as Triton does.
pub fn scan_models(paths: &[PathBuf]) -> BTreeMap<String, PathBuf> {
    let mut out = BTreeMap::new();
    for (name, path) in model_entries(paths) {
        out.entry(name).or_insert(path);
    }
    out
}

/// Every model directory by name across all repositories, in repository order (more than one
/// for a name found in several), and the repositories that could not be listed — from the one
/// listing, so that a repository read as empty is one that was read.
pub fn scan_model_dirs(paths: &[PathBuf]) -> (BTreeMap<String, Vec<PathBuf>>, Vec<PathBuf>) {
    let mut out: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    let mut unlisted = Vec::new();
    for repo in paths {
        let Ok(entries) = std::fs::read_dir(repo) else {
            unlisted.push(repo.clone());
            continue;
        };
        let mut found: Vec<(String, PathBuf)> = entries.flatten().filter_map(|entry| model_dir(&entry)).collect();
        found.sort();
        for (name, path) in found {
            out.entry(name).or_default().push(path);
        }
    }
    (out, unlisted)
}

/// `(name, directory)` of a repository entry that is a model directory.
fn model_dir(entry: &std::fs::DirEntry) -> Option<(String, PathBuf)> {
    let path = entry.path();
    let name = path.file_name().and_then(|n| n.to_str()).map(str::to_string)?;
    (path.is_dir() && !name.starts_with('.')).then_some((name, path))
}

/// Every directory named `name` across all repositories, in repository order: more than one
/// means the name is ambiguous.
pub fn model_dirs(paths: &[PathBuf], name: &str) -> Vec<PathBuf> {
    model_entries(paths).filter(|(n, _)| n == name).map(|(_, p)| p).collect()
}

/// `(name, directory)` of every model directory, repository by repository.
fn model_entries(paths: &[PathBuf]) -> impl Iterator<Item = (String, PathBuf)> + '_ {
    paths.iter().flat_map(|repo| {
        let mut found: Vec<(String, PathBuf)> =
            std::fs::read_dir(repo).into_iter().flatten().flatten().filter_map(|entry| model_dir(&entry)).collect();
        found.sort();
        found
    })
}

/// What a model directory held when it was last read: names, sizes and mtimes of its config
/// and version folders' files. A different stamp means the model changed on disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stamp(Vec<(PathBuf, u64, Option<SystemTime>)>);

impl Stamp {
    pub fn of(dir: &Path) -> Stamp {
        let mut files = Vec::new();
        collect(dir, 0, &mut files);
        files.sort();
        Stamp(files)
    }

    /// The stamp of a name's directories together: one added or removed in another repository
    /// (making the name ambiguous, or no longer) is a change too.
    pub fn of_all(dirs: &[PathBuf]) -> Stamp {
        Stamp(dirs.iter().flat_map(|dir| Stamp::of(dir).0).collect())
    }
}

/// How deep and how many entries a stamp looks at: enough for any Triton layout (a version's
/// model directory with its external weights), bounded for a repository polled every few
/// seconds (and a symbolic link that loops).
const STAMP_DEPTH: usize = 6;
const STAMP_ENTRIES: usize = 10_000;

fn collect(dir: &Path, depth: usize, out: &mut Vec<(PathBuf, u64, Option<SystemTime>)>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if out.len() >= STAMP_ENTRIES {
            return;
        }
        let path = entry.path();
        // Through symbolic links (a version folder linked to a model store, as Triton follows
        // them): a change behind the link is a change of the model.
        let Ok(meta) = std::fs::metadata(&path) else { continue };
        if meta.is_dir() {
            out.push((path.clone(), 0, None));
            if depth < STAMP_DEPTH {
                collect(&path, depth + 1, out);
            }
        } else {
            out.push((path, meta.len(), meta.modified().ok()));
        }
    }
}

/// The model's config file, relative to its directory: `configs/<name>.pbtxt` when a custom
/// config name is given and that file exists, else config.pbtxt.
fn config_file(dir: &Path, name: Option<&str>) -> String {
    name.map(|n| format!("configs/{n}.pbtxt"))
        .filter(|custom| dir.join(custom).is_file())
        .unwrap_or_else(|| "config.pbtxt".to_string())
}

/// Whether the model in `dir` is an ensemble, as far as its config file says (an unreadable
/// or unparsable one counts as not: its load will say what is wrong).
pub(super) fn declares_ensemble(dir: &Path, config_name: Option<&str>) -> bool {
    std::fs::read(dir.join(config_file(dir, config_name)))
        .ok()
        .and_then(|bytes| parse_model_config(&nereid_common::config::config_text(&bytes).ok()?).ok())
        .is_some_and(|config| crate::ensemble::is_ensemble(&config))
}

fn fail(message: impl Into<String>) -> Status {
    Status::invalid(message)
}

/// Reads, completes and validates the config, creates the sessions, warms them up and starts
/// one scheduler per version. `versions` overrides the version policy; the versions in `also`
/// that exist on disk are loaded besides (what ensembles' steps name).
pub fn load_model(
    options: &RepositoryOptions,
    name: &str,
    config_override: Option<String>,
    versions: Option<&[i64]>,
    also: &[i64],
    metrics: &Metrics,
) -> Result<LoadedModel, Status> {
    let dirs = model_dirs(&options.paths, name);
    let dir = match dirs.as_slice() {
        [] => return Err(Status::not_found(format!("no model directory '{name}' in the model repository"))),
        [dir] => dir,
        // Triton refuses an ambiguous name rather than pick one silently: which model serves
        // must not depend on the order of --model-repository flags.
        several => {
            return Err(fail(format!(
                "model '{name}' appears in more than one model repository: {}",
                several.iter().map(|d| format!("'{}'", d.display())).collect::<Vec<_>>().join(", ")
            )));
        }
    };
    let stamp = Stamp::of(dir);
    let config_file = config_file(dir, options.config_name.as_deref());
    let config_path = dir.join(&config_file);
    let mut config = match &config_override {
        Some(json) => parse_model_config_json(json).map_err(|e| fail(format!("config parameter: {e}")))?,
        None if config_path.is_file() => {
            let bytes =
                std::fs::read(&config_path).map_err(|e| fail(format!("cannot read {}: {e}", config_path.display())))?;
            let text = nereid_common::config::config_text(&bytes).map_err(|e| fail(format!("{config_file}: {e}")))?;
            parse_model_config(&text).map_err(|e| fail(format!("{config_file}: {e}")))?
        }
        None if options.strict_config => {
            return Err(fail("config.pbtxt is missing and --strict-model-config=true forbids auto-complete"));
        }
        None => ModelConfig::default(),
    };
    if let Some(versions) = versions {
        // Placement names the versions: it overrides the config's version policy.
        config.version_policy = Some(nereid_proto::inference::ModelVersionPolicy {
            policy_choice: Some(PolicyChoice::Specific(nereid_proto::inference::model_version_policy::Specific {
                versions: versions.to_vec(),
            })),
        });
    }
    if config.name.is_empty() {
        config.name = name.to_string();
    } else if config.name != name {
        return Err(fail(format!("config name '{}' does not match the model directory '{name}'", config.name)));
    }
    let mut warnings = Vec::new();
    for field in unsupported_fields(&config) {
        match field.severity {
            Severity::Error => return Err(fail(format!("config field '{}' is not supported by Nereid", field.path))),
            Severity::Warning => {
                warnings.push(format!("config field '{}' is not supported and is ignored", field.path))
            }
        }
    }
    if ensemble::is_ensemble(&config) {
        return load_ensemble(config, name, dir, stamp, warnings, also, metrics);
    }
    check_backend(&config)?;
    let session_options = session_options(&config, &options.session_defaults, &mut warnings)?;

    // Versions on disk, then the version policy.
    let (available, skipped) = scan_versions(dir);
    warnings.extend(skipped);
    let versions = with_also(select_versions(&config, &available, &mut warnings)?, &available, also);
    let filename = if config.default_model_filename.is_empty() {
        DEFAULT_MODEL_FILENAME.to_string()
    } else {
        inside(&config.default_model_filename)
            .map_err(|e| fail(format!("config: default_model_filename '{}': {e}", config.default_model_filename)))?;
        config.default_model_filename.clone()
    };

    // Instances (devices) from the instance groups, resolved in the served config.
    normalize_instance_groups(&mut config, backend::gpu_count())?;
    let devices = instance_devices(&config)?;
    let on_gpu = devices.iter().any(|d| matches!(d, Device::Gpu(_)));
    // The CUDA provider's keys matter to GPU instances only (Triton reads them only for those).
    if let Some(problem) = session_options.cuda.rejected.first() {
        if on_gpu {
            return Err(fail(problem.clone()));
        }
        warnings.push(format!("{problem}: ignored, the model has no GPU instance"));
    }

    // Probe the first version's model for auto-complete; validate every version against it.
    // One session per version is built before the checks (auto-complete needs the model's
    // tensors), the other instances' only once they pass: a config found wrong costs one.
    let mut sessions_by_version = BTreeMap::new();
    let mut spec: Option<ModelSpec> = None;
    // The first version checked, and which of its tensors are scalars fed as such.
    let mut scalars: Option<(i64, Scalars)> = None;
    let mut labels = HashMap::new();
    for &version in &versions {
        let path = model_file(dir, version, &filename)?;
        let create = |device: Device| {
            let opts = SessionOptions { device, ..session_options.clone() };
            backend::create_session(&path, &opts)
                .map_err(|e| fail(format!("version {version}: cannot load '{}' as an ONNX model: {e}", path.display())))
        };
        let probe = create(devices[0])?;
        let io = backend::model_io(&probe);
        if spec.is_none() {
            if options.strict_config {
                // Triton's --strict-model-config=true: the config must be complete as written.
                refuse_incomplete(&config)?;
            } else {
                autocomplete(&mut config, &io, options.default_max_batch_size, &mut warnings);
            }
            fill_backend(&mut config);
            validate_model_config(&config).map_err(|e| fail(format!("config: {e}")))?;
            let mut s = spec_from_config(&config)?;
            // An optional input can be left out only where the model has a default for it.
            for input in s.inputs.iter_mut().filter(|i| i.optional) {
                if !io.defaults.iter().any(|d| d.name == input.name) {
                    input.optional = false;
                    // The served config says what requests must do.
                    for c in config.input.iter_mut().filter(|c| c.name == input.name) {
                        c.optional = false;
                    }
                    warnings.push(format!(
                        "input '{}' is optional, but the model has no default for it (an initializer that is \
                         also a graph input): requests must carry it",
                        input.name
                    ));
                }
            }
            check_warmup(&config, &s).map_err(|e| fail(format!("config: {e}")))?;
            labels = read_labels(&config, dir)?;
            spec = Some(s);
        }
        check_against_model(&config, &io).map_err(|e| fail(format!("version {version}: {e}")))?;
        // Every version's instances share the one spec, so a scalar fed as such must be one in
        // every version.
        let here = scalar_reshapes(&config, &io);
        match &scalars {
            None => {
                if let Some(s) = spec.as_mut() {
                    apply_scalar_reshapes(s, &here);
                }
                scalars = Some((version, here));
            }
            Some((first, theirs)) if *theirs != here => {
                let names = config
                    .input
                    .iter()
                    .map(|t| ("input", &t.name))
                    .chain(config.output.iter().map(|t| ("output", &t.name)));
                let differs = theirs.0.iter().chain(&theirs.1).zip(here.0.iter().chain(&here.1)).map(|(a, b)| a != b);
                let (kind, name) =
                    names.zip(differs).find(|(_, d)| *d).map(|(n, _)| n).unwrap_or(("tensor", &config.name));
                return Err(fail(format!(
                    "version {version}: {kind} '{name}' is a scalar (rank 0) in the model of one version and not \
                     in the other (version {first}): the versions must agree"
                )));
            }
            Some(_) => {}
        }
        if let Some(s) = &spec
            && let Some(input) = s.inputs.iter().find(|i| i.optional && !io.defaults.iter().any(|d| d.name == i.name))
        {
            return Err(fail(format!(
                "version {version}: input '{}' is optional, but this version has no default for it",
                input.name
            )));
        }
        let mut sessions = Vec::with_capacity(devices.len());
        sessions.push(probe);
        for device in &devices[1..] {
            sessions.push(create(*device)?);
        }
        sessions_by_version.insert(version, sessions);
    }
    let spec = spec.ok_or_else(|| fail("no version to load"))?;

    // Warm up, then start the schedulers.
    let batching = spec.max_batch_size > 0;
    if on_gpu
        && matches!(config.scheduling_choice, Some(SchedulingChoice::DynamicBatching(_)))
        && !session_options.pad_batch
        && session_options.cuda.conv_algo_search.is_none()
    {
        warnings.push(
            "KIND_GPU with dynamic batching: for a model with convolutions, ONNX Runtime redoes its cuDNN set-up \
             (by default an EXHAUSTIVE algorithm search) whenever the batch size changes; parameters \
             nereid.pad_batch \"true\" (one batch shape) and cudnn_conv_algo_search \"1\" (HEURISTIC) avoid most of it"
                .to_string(),
        );
    }
    if session_options.pad_batch {
        if !batching {
            return Err(fail("parameters['nereid.pad_batch'] needs a batching model (max_batch_size > 0)"));
        }
        if let Some(input) = spec.inputs.iter().find(|i| i.datatype == DataType::Bytes) {
            return Err(fail(format!(
                "parameters['nereid.pad_batch']: input '{}' is TYPE_STRING; only fixed-size inputs can be padded",
                input.name
            )));
        }
        // Every batch takes max_batch_size rows of each input: bounded, before any is made.
        for input in &spec.inputs {
            let fixed = input.dims.iter().all(|&d| d >= 0);
            let bytes = nereid_common::dtype::element_count(&input.dims)
                .and_then(|n| n.checked_mul(spec.max_batch_size as u64))
                .and_then(|n| n.checked_mul(input.datatype.element_size().unwrap_or(1) as u64));
            if fixed && bytes.is_none_or(|b| b > backend::MAX_PADDED_INPUT_BYTES as u64) {
                return Err(fail(format!(
                    "parameters['nereid.pad_batch']: input '{}' padded to max_batch_size {} rows would take more \
                     than {} bytes per batch; lower max_batch_size or leave batches unpadded",
                    input.name,
                    spec.max_batch_size,
                    backend::MAX_PADDED_INPUT_BYTES
                )));
            }
        }
    }
    let policy = batch_policy(&config);
    let preserve = dynamic_batching(&config).is_some_and(|d| d.preserve_ordering);
    let mut loaded_versions = BTreeMap::new();
    for (version, sessions) in sessions_by_version {
        let mut instances: Vec<InstanceSession> = sessions
            .into_iter()
            .map(|s| {
                InstanceSession::new(s, spec.inputs.clone(), spec.outputs.clone(), batching)
                    .with_denormal_as_zero(session_options.denormal_as_zero)
                    .with_padded_batch(session_options.pad_batch.then_some(spec.max_batch_size))
            })
            .collect();
        {
            // Warm up as the instance threads will run, without leaving the setting on this
            // (runtime) thread.
            let _fp = backend::DenormalScope::enter(session_options.denormal_as_zero);
            warmup(&config, dir, &spec, &mut instances).map_err(|e| fail(format!("version {version}: warmup: {e}")))?;
        }
        let stats = metrics.version(name, version);
        let scheduler =
            Scheduler::start(&format!("{name}:{version}"), policy.clone(), preserve, instances, stats.clone())
                .map_err(|e| Status::internal(format!("cannot start instance threads: {e}")))?;
        loaded_versions
            .insert(version, Arc::new(ModelVersion { version, executor: Executor::Scheduler(scheduler), stats }));
    }
    let cache_enabled = config.response_cache.is_some_and(|c| c.enable);
    Ok(LoadedModel {
        name: name.to_string(),
        labels,
        config: Arc::new(config),
        spec: Arc::new(spec),
        versions: loaded_versions,
        warnings,
        stamp,
        ensemble: None,
        cache_enabled,
        generation: next_generation(),
        steps_fit_at: AtomicU64::new(u64::MAX),
    })
}

/// An ensemble: its config and step graph checked, one version per version folder (empty, as
/// in Triton). Its composing models are loaded and checked by the repository afterwards.
fn load_ensemble(
    config: ModelConfig,
    name: &str,
    dir: &Path,
    stamp: super::Stamp,
    mut warnings: Vec<String>,
    also: &[i64],
    metrics: &Metrics,
) -> Result<LoadedModel, Status> {
    let plan = ensemble::plan(&config).map_err(|e| fail(format!("config: {e}")))?;
    if let Some(name) = config
        .input
        .iter()
        .filter(|t| t.reshape.is_some())
        .map(|t| &t.name)
        .chain(config.output.iter().filter(|t| t.reshape.is_some()).map(|t| &t.name))
        .next()
    {
        return Err(fail(format!(
            "tensor '{name}': reshape does not apply to an ensemble (reshape in its steps' models)"
        )));
    }
    validate_model_config(&config).map_err(|e| fail(format!("config: {e}")))?;
    if !config.instance_group.is_empty() {
        warnings.push("instance_group does not apply to an ensemble (its steps run on their models' instances)".into());
    }
    if !config.model_warmup.is_empty() {
        warnings.push("model_warmup does not apply to an ensemble (warm up its composing models)".into());
    }
    let (available, skipped) = scan_versions(dir);
    warnings.extend(skipped);
    let versions = with_also(select_versions(&config, &available, &mut warnings)?, &available, also);
    let spec = spec_from_config(&config)?;
    let plan = Arc::new(plan);
    let inflight = match &config.scheduling_choice {
        Some(SchedulingChoice::EnsembleScheduling(e)) if e.max_inflight_requests > 0 => {
            Some(Arc::new(tokio::sync::Semaphore::new(e.max_inflight_requests as usize)))
        }
        _ => None,
    };
    let versions = versions
        .into_iter()
        .map(|version| {
            let stats = metrics.version(name, version);
            let executor = Executor::Ensemble { plan: plan.clone(), inflight: inflight.clone() };
            (version, Arc::new(ModelVersion { version, executor, stats }))
        })
        .collect();
    let cache_enabled = config.response_cache.is_some_and(|c| c.enable);
    let labels = read_labels(&config, dir)?;
    Ok(LoadedModel {
        name: name.to_string(),
        labels,
        config: Arc::new(config),
        spec: Arc::new(spec),
        versions,
        warnings,
        stamp,
        cache_enabled,
        ensemble: Some(plan),
        generation: next_generation(),
        steps_fit_at: AtomicU64::new(u64::MAX),
    })
}

/// The model file of `version`: `<version>/<filename>`, or — Triton's onnxruntime layout for
/// a model whose weights live in files beside it — `<version>/<filename>/model.onnx` when that
/// is a directory.
fn model_file(dir: &Path, version: i64, filename: &str) -> Result<PathBuf, Status> {
    let mut path = dir.join(version.to_string()).join(filename);
    if path.is_dir() {
        path = path.join(DEFAULT_MODEL_FILENAME);
    }
    if !path.is_file() {
        return Err(fail(format!("version {version}: model file '{}' is missing", path.display())));
    }
    Ok(path)
}

/// A path a config names relative to a model's directory (`label_filename`,
/// `default_model_filename`, a warm-up `input_data_file`): plain names only, no absolute path
/// and no `..` — a load request's config override must not reach files elsewhere on the host.
fn inside(relative: &str) -> Result<&Path, String> {
    let path = Path::new(relative);
    if relative.is_empty() || !path.components().all(|c| matches!(c, std::path::Component::Normal(_))) {
        return Err("must name a file inside the model's directory (no absolute path, no '..')".into());
    }
    Ok(path)
}

/// Most instances one model may ask for, all groups together.
const MAX_INSTANCES: usize = 1024;
/// Largest warm-up sample input (bytes), and most runs of one sample.
const MAX_WARMUP_INPUT_BYTES: u64 = 1 << 30;
const MAX_WARMUP_COUNT: u32 = 10_000;

/// Largest `label_filename` file read.
const MAX_LABEL_FILE_BYTES: u64 = 16 << 20;

/// The labels of every output naming a `label_filename`: a file in the model's directory, one
/// label per line. A missing or unreadable file fails the load, naming it.
fn read_labels(config: &ModelConfig, dir: &Path) -> Result<HashMap<String, Arc<[String]>>, Status> {
    let mut labels = HashMap::new();
    for output in config.output.iter().filter(|o| !o.label_filename.is_empty()) {
        let at = format!("output '{}': label_filename '{}'", output.name, output.label_filename);
        // Labels come back to clients: only files of the model's own directory are read.
        let path = dir.join(inside(&output.label_filename).map_err(|e| fail(format!("{at}: {e}")))?);
        // Read no further than the limit, whatever the file's reported size (a device, a
        // link to a huge file).
        let data = read_bounded(&path, MAX_LABEL_FILE_BYTES).map_err(|e| fail(format!("{at}: {e}")))?;
        // Bytes that are not UTF-8 (a Latin-1 label file) come back as U+FFFD rather than fail the
        // load (Triton reads labels as raw bytes): the rest of the labels still serve.
        let text = String::from_utf8_lossy(&data);
        labels.insert(output.name.clone(), Arc::from(crate::classify::parse_labels(&text)));
    }
    Ok(labels)
}

fn check_backend(config: &ModelConfig) -> Result<(), Status> {
    let backend_ok = matches!(config.backend.as_str(), "" | "onnxruntime");
    let platform_ok = matches!(config.platform.as_str(), "" | "onnxruntime_onnx");
    if config.backend.is_empty() && !platform_ok {
        return Err(fail(format!("platform '{}' is not supported (Nereid serves onnxruntime_onnx)", config.platform)));
    }
    if !backend_ok {
        return Err(fail(format!("backend '{}' is not supported (Nereid serves onnxruntime)", config.backend)));
    }
    // Both named: they must agree, as Triton requires ("platform: onnxruntime" beside
    // "backend: onnxruntime" is a typo Triton refuses too).
    if !config.backend.is_empty() && !platform_ok {
        return Err(fail(format!(
            "platform '{}' does not go with backend '{}' (the onnxruntime backend's platform is onnxruntime_onnx)",
            config.platform, config.backend
        )));
    }
    Ok(())
}

fn session_options(
    config: &ModelConfig,
    defaults: &SessionOptions,
    warnings: &mut Vec<String>,
) -> Result<SessionOptions, Status> {
    let mut opts = defaults.clone();
    // Triton's onnxruntime backend reads `optimization { graph { level } }` as: -1 basic,
    // 1 extended, 2 none, anything else (0 included) all optimizations.
    if let Some(graph) = config.optimization.as_ref().and_then(|o| o.graph.as_ref()) {
        opts.optimization_level = match graph.level {
            -1 => 1,
            1 => 2,
            2 => 0,
            _ => 3,
        };
    }
    for (key, value) in &config.parameters {
        let v = value.string_value.trim();
        let number = || {
            v.parse::<usize>()
                .map_err(|_| fail(format!("parameters['{key}'] must be a non-negative integer, got '{v}'")))
        };
        let flag = || match v {
            "true" | "1" => Ok(true),
            "false" | "0" => Ok(false),
            _ => Err(fail(format!("parameters['{key}'] must be true or false, got '{v}'"))),
        };
        match key.as_str() {
            // Triton's onnxruntime backend keys; 0 means ONNX Runtime's own default.
            "intra_op_thread_count" => opts.intra_op_threads = number()?,
            "inter_op_thread_count" => opts.inter_op_threads = number()?,
            "nereid.intra_op_spinning" => opts.intra_op_spinning = flag()?,
            "nereid.denormal_as_zero" => opts.denormal_as_zero = flag()?,
            "nereid.pad_batch" => opts.pad_batch = flag()?,
            // Triton's onnxruntime key: "0" sequential (the default), "1" parallel.
            "execution_mode" => {
                opts.parallel_execution = match v {
                    "0" => false,
                    "1" => true,
                    _ => {
                        return Err(fail(format!(
                            "parameters['{key}'] must be 0 (sequential) or 1 (parallel), got '{v}'"
                        )));
                    }
                }
            }
            "nereid.graph_optimization_level" => {
                opts.optimization_level = number()?.min(3) as u8;
            }
            // Triton's onnxruntime keys for the CUDA execution provider (KIND_GPU instances):
            // an invalid value fails the load only where the model has a GPU instance.
            "cudnn_conv_algo_search" => match v {
                "0" | "1" | "2" => opts.cuda.conv_algo_search = v.parse().ok(),
                _ => opts.cuda.rejected.push(format!(
                    "parameters['{key}'] must be 0 (EXHAUSTIVE), 1 (HEURISTIC) or 2 (DEFAULT), got '{v}'"
                )),
            },
            // Triton reads it as an unsigned integer, -1 wrapping to no limit.
            "gpu_mem_limit" => match v {
                "-1" => opts.cuda.gpu_mem_limit = None,
                _ => match v.parse::<usize>() {
                    Ok(n) => opts.cuda.gpu_mem_limit = Some(n),
                    Err(_) => opts
                        .cuda
                        .rejected
                        .push(format!("parameters['{key}'] must be a number of bytes (or -1: no limit), got '{v}'")),
                },
            },
            "arena_extend_strategy" => match v {
                "0" | "1" => opts.cuda.arena_extend_strategy = v.parse().ok(),
                _ => opts.cuda.rejected.push(format!(
                    "parameters['{key}'] must be 0 (kNextPowerOfTwo) or 1 (kSameAsRequested), got '{v}'"
                )),
            },
            "do_copy_in_default_stream" => match flag() {
                Ok(same) => opts.cuda.copy_in_default_stream = Some(same),
                Err(e) => opts.cuda.rejected.push(e.message),
            },
            other => warnings.push(format!("parameter '{other}' is not supported and is ignored")),
        }
    }
    Ok(opts)
}

/// The model's version folders, sorted.
pub(super) fn version_dirs(dir: &Path) -> Vec<i64> {
    scan_versions(dir).0
}

/// The model's version folders (sorted) and the warnings about folders skipped: Triton takes
/// only a canonical non-negative integer as a version ("0", "7"), so "07", "+1" or "-1" are
/// skipped with a warning instead of being read as a version whose folder does not exist under
/// that name. Folders that are no number at all (`warmup`, ...) are skipped silently.
fn scan_versions(dir: &Path) -> (Vec<i64>, Vec<String>) {
    let mut versions = Vec::new();
    let mut warnings = Vec::new();
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    names.sort();
    for name in names {
        match canonical_version(&name) {
            Some(v) => versions.push(v),
            None if name.parse::<i64>().is_ok() => warnings.push(format!(
                "version folder '{name}' is skipped: a version folder must be named by a non-negative integer \
                 without sign or leading zeros"
            )),
            None => {}
        }
    }
    versions.sort_unstable();
    versions.dedup();
    (versions, warnings)
}

/// `name` as a version number if it is one written canonically: digits only, no leading zero
/// except for "0" itself.
fn canonical_version(name: &str) -> Option<i64> {
    let digits = !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit());
    if !digits || (name.len() > 1 && name.starts_with('0')) {
        return None;
    }
    name.parse::<i64>().ok()
}

/// A number no earlier load in this process had.
fn next_generation() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// `versions` plus those of `also` that are `available`, sorted.
fn with_also(mut versions: Vec<i64>, available: &[i64], also: &[i64]) -> Vec<i64> {
    versions.extend(also.iter().filter(|v| available.contains(v)));
    versions.sort_unstable();
    versions.dedup();
    versions
}

/// The versions the config's policy picks among those `available`. A `specific` policy naming
/// versions without a folder loads the ones that exist and warns about the rest (as Triton
/// does); it fails only when none exists.
fn select_versions(config: &ModelConfig, available: &[i64], warnings: &mut Vec<String>) -> Result<Vec<i64>, Status> {
    if available.is_empty() {
        return Err(fail("no numeric version folder in the model directory"));
    }
    let policy = config.version_policy.as_ref().map(|p| p.policy_choice.as_ref());
    let mut chosen: Vec<i64> = match policy.flatten() {
        // No policy: the latest version (Triton's default).
        None if policy.is_none() => available.iter().rev().take(1).copied().collect(),
        // A policy that names no choice (`version_policy: { }`) is Triton's "all".
        None => available.to_vec(),
        // `latest { num_versions: 0 }` picks no version, and Triton then fails the load rather
        // than read 0 as 1: loading a version the policy does not name would serve a model the
        // config never asked for.
        Some(PolicyChoice::Latest(l)) if l.num_versions == 0 => {
            return Err(fail(
                "version_policy.latest.num_versions is 0, so no version is selected: at least one version must be \
                 available under the version policy (set num_versions to 1 or more)",
            ));
        }
        Some(PolicyChoice::Latest(l)) => available.iter().rev().take(l.num_versions as usize).copied().collect(),
        Some(PolicyChoice::All(_)) => available.to_vec(),
        Some(PolicyChoice::Specific(s)) => {
            let (present, missing): (Vec<i64>, Vec<i64>) = s.versions.iter().partition(|v| available.contains(v));
            if present.is_empty() {
                let named = s.versions.iter().map(i64::to_string).collect::<Vec<_>>().join(", ");
                return Err(fail(format!(
                    "version_policy.specific names version {named}, and none has a folder (version folders: {available:?})"
                )));
            }
            for v in missing {
                warnings.push(format!("version_policy.specific names version {v}, which has no folder: not loaded"));
            }
            present
        }
    };
    chosen.sort_unstable();
    chosen.dedup();
    Ok(chosen)
}

/// Triton's default instance count: two per group on CPU (so one request's execution never
/// leaves the model idle), one per listed GPU.
const DEFAULT_CPU_INSTANCES: i32 = 2;
const DEFAULT_GPU_INSTANCES: i32 = 1;

/// Resolves the instance groups as Triton's normalization does, in the config itself so the
/// served config shows what runs: no group becomes one group; each group gets its name
/// (`<model>_<index>` where empty), its kind (KIND_AUTO becomes KIND_GPU where a GPU exists,
/// else KIND_CPU), its count (0 becomes the kind's default) and, on GPU, its GPUs (every GPU
/// where none are listed). `gpus` is the number of visible GPUs.
fn normalize_instance_groups(config: &mut ModelConfig, gpus: usize) -> Result<(), Status> {
    if config.instance_group.is_empty() {
        config.instance_group.push(ModelInstanceGroup { kind: Kind::Auto as i32, ..Default::default() });
    }
    let model = config.name.clone();
    for (i, g) in config.instance_group.iter_mut().enumerate() {
        if g.count < 0 || g.count as usize > MAX_INSTANCES {
            return Err(fail(format!(
                "config: instance_group[{i}].count must be in 0..={MAX_INSTANCES}, got {}",
                g.count
            )));
        }
        if g.name.is_empty() {
            g.name = format!("{model}_{i}");
        }
        let kind = match Kind::try_from(g.kind).unwrap_or(Kind::Auto) {
            Kind::Auto if gpus > 0 => Kind::Gpu,
            Kind::Auto => Kind::Cpu,
            Kind::Gpu if gpus == 0 => {
                let why = backend::gpu_devices().err().unwrap_or_else(|| "no CUDA device".into());
                return Err(fail(format!("instance_group[{i}] asks for KIND_GPU, but no GPU is available: {why}")));
            }
            other => other,
        };
        g.kind = kind as i32;
        if g.count == 0 {
            g.count = if kind == Kind::Cpu { DEFAULT_CPU_INSTANCES } else { DEFAULT_GPU_INSTANCES };
        }
        if kind == Kind::Gpu {
            if g.gpus.is_empty() {
                g.gpus = (0..gpus as i32).collect();
            }
            if let Some(id) = g.gpus.iter().find(|&&id| id as usize >= gpus) {
                return Err(fail(format!("instance_group[{i}].gpus names GPU {id}, but only {gpus} exist")));
            }
        }
    }
    Ok(())
}

/// One device per instance of the (normalized) instance groups: `count` per group on CPU,
/// `count` per listed GPU.
fn instance_devices(config: &ModelConfig) -> Result<Vec<Device>, Status> {
    // Counted before anything is built: a config may ask for billions.
    let wanted = config.instance_group.iter().try_fold(0usize, |sum, g| {
        let per_device = g.count.max(1) as usize;
        let devices = if matches!(Kind::try_from(g.kind), Ok(Kind::Gpu)) { g.gpus.len() } else { 1 };
        sum.checked_add(per_device.checked_mul(devices)?)
    });
    if wanted.is_none_or(|n| n > MAX_INSTANCES) {
        return Err(fail(format!(
            "config: the instance groups ask for {}, more than {MAX_INSTANCES} instances",
            wanted.map_or_else(|| "more instances than can be counted".to_string(), |n| format!("{n} instances"))
        )));
    }
    let mut devices = Vec::new();
    for g in &config.instance_group {
        let count = g.count.max(1) as usize;
        if matches!(Kind::try_from(g.kind), Ok(Kind::Gpu)) {
            for &id in &g.gpus {
                devices.extend(std::iter::repeat_n(Device::Gpu(id), count));
            }
        } else {
            devices.extend(std::iter::repeat_n(Device::Cpu, count));
        }
    }
    if devices.is_empty() {
        return Err(fail("config: the instance groups ask for no instance"));
    }
    Ok(devices)
}

fn config_type(dt: DataType) -> i32 {
    dt.config_value()
}

/// Fills in what the config leaves out from the model's own inputs and outputs, as Triton's
/// onnxruntime backend does. It runs only where the config lacks inputs or outputs (a config
/// declaring both is taken as written). When every tensor's first dim is dynamic the model can
/// batch: `max_batch_size` 0 becomes `default_max_batch_size` ([`AUTOCOMPLETE_MAX_BATCH_SIZE`]
/// unless `--backend-config` says otherwise), and a final `max_batch_size` > 1 without a
/// scheduler gets `dynamic_batching {}` (whether the config set it or auto-complete did;
/// Triton's `AutoCompleteMaxBatch`).
///
/// A tensor left with no dims (a scalar, or only the batch dim) gets `dims: [1]` as in Triton's
/// `AutoCompleteIO`, so clients send `[1]` (or `[batch, 1]`), the shape Triton's clients send
/// for it; with batching a `reshape { shape: [] }` feeds the model its `[batch]` tensor. (Triton
/// writes no reshape without batching: there the scalar is implied, see [`scalar_reshapes`].)
///
/// A tensor of a type Nereid has no datatype for is left out: an input left out fails the load
/// later, naming its type ([`check_against_model`]); an output is merely not served, which
/// `warnings` says (Triton fails the load, but the model's other outputs can still serve).
fn autocomplete(config: &mut ModelConfig, io: &ModelIo, default_max_batch_size: i32, warnings: &mut Vec<String>) {
    if !config.input.is_empty() && !config.output.is_empty() {
        return;
    }
    let can_batch = !io.inputs.is_empty() && io.inputs.iter().chain(&io.outputs).all(|t| t.dims.first() == Some(&-1));
    if can_batch {
        if config.max_batch_size == 0 {
            config.max_batch_size = default_max_batch_size;
        }
        if config.max_batch_size > 1 && config.scheduling_choice.is_none() {
            config.scheduling_choice = Some(SchedulingChoice::DynamicBatching(ModelDynamicBatching::default()));
        }
    }
    let batching = config.max_batch_size > 0;
    // (dims, reshape) of a model tensor as the config declares it.
    let shape = |d: &[i64]| {
        let dims: Vec<i64> = d.iter().skip(usize::from(batching)).copied().collect();
        if !dims.is_empty() {
            return (dims, None);
        }
        (vec![1], batching.then(ModelTensorReshape::default))
    };
    if config.input.is_empty() {
        config.input = io
            .inputs
            .iter()
            .filter_map(|t| {
                let (dims, reshape) = shape(&t.dims);
                Some(ModelInput {
                    name: t.name.clone(),
                    data_type: config_type(t.datatype?),
                    dims,
                    reshape,
                    ..Default::default()
                })
            })
            .collect();
    }
    if config.output.is_empty() {
        for t in io.outputs.iter().filter(|t| t.datatype.is_none()) {
            warnings.push(format!(
                "model output '{}' has ONNX type {}, which Nereid does not support: it is left out of the \
                 auto-completed config and not served",
                t.name, t.type_name
            ));
        }
        config.output = io
            .outputs
            .iter()
            .filter_map(|t| {
                let (dims, reshape) = shape(&t.dims);
                Some(ModelOutput {
                    name: t.name.clone(),
                    data_type: config_type(t.datatype?),
                    dims,
                    reshape,
                    ..Default::default()
                })
            })
            .collect();
    }
}

/// Under `--strict-model-config=true` nothing is auto-completed, so a config without inputs or
/// outputs cannot describe the model: say so rather than fail later on a vaguer mismatch.
fn refuse_incomplete(config: &ModelConfig) -> Result<(), Status> {
    let missing: Vec<&str> = [("input", config.input.is_empty()), ("output", config.output.is_empty())]
        .into_iter()
        .filter_map(|(what, empty)| empty.then_some(what))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(fail(format!(
        "config: the config declares no {} and --strict-model-config=true turns auto-complete off: \
         declare every model input and output (and max_batch_size) in config.pbtxt",
        missing.join(" and no ")
    )))
}

/// The platform / backend names and the model file name Triton's normalization fills in (not
/// auto-completion: done under --strict-model-config too), so that the served config says
/// what runs, as Triton's does.
fn fill_backend(config: &mut ModelConfig) {
    if config.backend.is_empty() {
        config.backend = "onnxruntime".to_string();
    }
    if config.platform.is_empty() {
        config.platform = "onnxruntime_onnx".to_string();
    }
    if config.default_model_filename.is_empty() {
        config.default_model_filename = DEFAULT_MODEL_FILENAME.to_string();
    }
}

/// The config's tensors must exist in the model with the same type and compatible dims, as
/// Triton's onnxruntime backend checks them (`ValidateInputs` / `ValidateOutputs`): an input's
/// fixed model dim must be the config's, a -1 taking any config dim; an output's dims must be
/// the model's exactly (Triton's `compare_exact`: a config dim that the model leaves free is not
/// what the model promises to answer). A model scalar (rank 0) without batching takes config
/// dims that are all 1 (served as `[1]`, see [`scalar_reshapes`]) as well as none.
fn check_against_model(config: &ModelConfig, io: &ModelIo) -> Result<(), String> {
    let batch = config.max_batch_size > 0;
    let check = |kind: &str, name: &str, data_type: i32, dims: &[i64], model: &[backend::ModelTensor]| {
        let Some(t) = model.iter().find(|t| t.name == name) else {
            return Err(format!(
                "{kind} '{name}' is not in the model (model {kind}s: {})",
                model.iter().map(|t| format!("'{}'", t.name)).collect::<Vec<_>>().join(", ")
            ));
        };
        let want = DataType::from_config_value(data_type);
        if t.datatype != want {
            return Err(format!(
                "{kind} '{name}': config says {}, the model has {}",
                want.map(|d| d.config_name()).unwrap_or_else(|| "TYPE_INVALID".into()),
                t.datatype.map(|d| d.config_name()).unwrap_or_else(|| t.type_name.clone())
            ));
        }
        if batch && t.dims.first() != Some(&-1) {
            return Err(format!(
                "{kind} '{name}': max_batch_size is {} but the model's dims {:?} have no dynamic batch \
                 dimension (set max_batch_size: 0, or export the model with a dynamic first dimension)",
                config.max_batch_size, t.dims
            ));
        }
        if !batch && t.dims.is_empty() {
            if dims.iter().all(|&d| d == 1) {
                return Ok(());
            }
            return Err(format!(
                "{kind} '{name}': the model's {kind} is a scalar, so the config's dims {dims:?} must all be 1 \
                 (dims: [ 1 ])"
            ));
        }
        let exact = kind == "output";
        let full: Vec<i64> =
            if batch { std::iter::once(-1).chain(dims.iter().copied()).collect() } else { dims.to_vec() };
        let compatible = t.dims.len() == full.len()
            && t.dims.iter().zip(&full).enumerate().all(|(i, (&m, &c))| {
                if batch && i == 0 {
                    m == -1 // the model must accept any batch size
                } else {
                    m == c || (m == -1 && !exact)
                }
            });
        if !compatible {
            return Err(format!(
                "{kind} '{name}': config dims {:?}{} do not match the model's {:?}{}",
                dims,
                if batch { " (plus the batch dimension, since max_batch_size > 0)" } else { "" },
                t.dims,
                if exact && t.dims.len() == full.len() {
                    " (an output's dims must be the model's exactly, -1 where the model's is -1)"
                } else {
                    ""
                }
            ));
        }
        Ok(())
    };
    // With a `reshape`, the model's dims are the reshape's; the config's dims (what clients
    // send and get) must hold as many elements, by Triton's rule (`ValidateIOShape`): as many
    // -1 on both sides, and each stretch of fixed dims around them (before the first -1,
    // between two, after the last) as many elements on both sides: [2, 4, -1, 6] may become
    // [8, -1, 1, 6], not [-1, 8, 6] (whose rows would not split where the client's do).
    let model_dims = |kind: &str, name: &str, dims: &[i64], reshape: Option<&ModelTensorReshape>| {
        let Some(r) = reshape else { return Ok(dims.to_vec()) };
        if r.shape.iter().any(|&d| d < -1 || d == 0) {
            return Err(format!("{kind} '{name}': reshape {:?} may hold positive dims and -1 only", r.shape));
        }
        // Element counts are computed from these dims at run time: they must not overflow.
        for (what, d) in [("dims", dims), ("reshape", &r.shape[..])] {
            if d.iter().filter(|&&x| x > 0).try_fold(1i64, |n, &x| n.checked_mul(x)).is_none() {
                return Err(format!("{kind} '{name}': {what} {d:?} hold more elements than can be counted"));
            }
        }
        let stretches = |d: &[i64]| d.split(|&x| x == -1).map(|s| s.iter().product::<i64>()).collect::<Vec<_>>();
        let (from, to) = (stretches(dims), stretches(&r.shape));
        if from.len() != to.len() {
            return Err(format!(
                "{kind} '{name}': dims {dims:?} and reshape {:?} must hold as many -1 ({} and {})",
                r.shape,
                from.len() - 1,
                to.len() - 1
            ));
        }
        match (from.len(), from == to) {
            (1 | 2, true) => Ok(r.shape.clone()),
            (1, false) => Err(format!(
                "{kind} '{name}': dims {dims:?} hold {} elements but reshape {:?} holds {}",
                from[0], r.shape, to[0]
            )),
            (_, false) => Err(format!(
                "{kind} '{name}': dims {dims:?} and reshape {:?} differ around their -1: the fixed dims before, \
                 between and after the -1s hold {from:?} elements in dims but {to:?} in reshape",
                r.shape
            )),
            // Triton takes these; requests are reshaped here by one free dim only (the one -1
            // takes what is left), so say so rather than fail every request.
            (n, true) => Err(format!(
                "{kind} '{name}': dims {dims:?} and reshape {:?} hold {} -1 each; Nereid reshapes a tensor \
                 with one -1 at most",
                r.shape,
                n - 1
            )),
        }
    };
    let with_reshape = |e: String, r: Option<&ModelTensorReshape>| match r {
        Some(r) => format!("{e} (the model's dims being the config's reshape {:?})", r.shape),
        None => e,
    };
    // A config input is a required model input or one the model has a default for (which a
    // request may then override).
    let model_inputs: Vec<backend::ModelTensor> = io.inputs.iter().chain(&io.defaults).cloned().collect();
    for input in &config.input {
        let dims = model_dims("input", &input.name, &input.dims, input.reshape.as_ref())?;
        check("input", &input.name, input.data_type, &dims, &model_inputs)
            .map_err(|e| with_reshape(e, input.reshape.as_ref()))?;
    }
    for output in &config.output {
        let dims = model_dims("output", &output.name, &output.dims, output.reshape.as_ref())?;
        check("output", &output.name, output.data_type, &dims, &io.outputs)
            .map_err(|e| with_reshape(e, output.reshape.as_ref()))?;
    }
    for t in &io.inputs {
        if config.input.iter().any(|i| i.name == t.name) {
            continue;
        }
        // Auto-complete leaves out what it has no datatype for: say that, not "missing".
        if t.datatype.is_none() {
            return Err(format!(
                "model input '{}' has ONNX type {}, which Nereid does not support (no KServe datatype for it)",
                t.name, t.type_name
            ));
        }
        return Err(format!("model input '{}' is missing from the config", t.name));
    }
    Ok(())
}

/// Per config input, then per config output: whether the model gets it as a scalar.
type Scalars = (Vec<bool>, Vec<bool>);

/// The config's tensors (inputs, then outputs, each in config order) that the model has as
/// scalars (rank 0) while the config gives them dims (all 1, [`check_against_model`] having
/// passed), in a model that does not batch:
/// Triton's onnxruntime backend feeds such an input to the model as a scalar and answers such an
/// output with the config's dims. Here the spec's reshape to `[]` does both (the served config
/// keeps what was written: Triton refuses an empty reshape without batching).
fn scalar_reshapes(config: &ModelConfig, io: &ModelIo) -> Scalars {
    if config.max_batch_size > 0 {
        return (Vec::new(), Vec::new());
    }
    let scalar = |name: &str, dims: &[i64], reshape: Option<&ModelTensorReshape>, model: &[&backend::ModelTensor]| {
        let dims = reshape.map_or(dims, |r| &r.shape[..]);
        !dims.is_empty() && model.iter().any(|t| t.name == name && t.dims.is_empty())
    };
    let inputs: Vec<&backend::ModelTensor> = io.inputs.iter().chain(&io.defaults).collect();
    let outputs: Vec<&backend::ModelTensor> = io.outputs.iter().collect();
    (
        config.input.iter().map(|t| scalar(&t.name, &t.dims, t.reshape.as_ref(), &inputs)).collect(),
        config.output.iter().map(|t| scalar(&t.name, &t.dims, t.reshape.as_ref(), &outputs)).collect(),
    )
}

/// Feeds the tensors [`scalar_reshapes`] found to the model as scalars.
fn apply_scalar_reshapes(spec: &mut ModelSpec, scalars: &Scalars) {
    for (t, &scalar) in spec.inputs.iter_mut().zip(&scalars.0).chain(spec.outputs.iter_mut().zip(&scalars.1)) {
        if scalar {
            t.reshape = Some(Vec::new());
        }
    }
}

fn spec_from_config(config: &ModelConfig) -> Result<ModelSpec, Status> {
    let convert = |name: &str, data_type: i32, dims: &[i64], reshape: Option<&ModelTensorReshape>| {
        Ok::<_, Status>(TensorSpec {
            name: name.to_string(),
            datatype: DataType::from_config_value(data_type)
                .ok_or_else(|| fail(format!("tensor '{name}': invalid data_type")))?,
            dims: dims.to_vec(),
            reshape: reshape.map(|r| r.shape.clone()),
            optional: false,
        })
    };
    Ok(ModelSpec {
        max_batch_size: config.max_batch_size.max(0) as usize,
        inputs: config
            .input
            .iter()
            .map(|t| {
                convert(&t.name, t.data_type, &t.dims, t.reshape.as_ref())
                    .map(|spec| TensorSpec { optional: t.optional, ..spec })
            })
            .collect::<Result<_, _>>()?,
        outputs: config
            .output
            .iter()
            .map(|t| convert(&t.name, t.data_type, &t.dims, t.reshape.as_ref()))
            .collect::<Result<_, _>>()?,
    })
}

/// The batcher policy a config asks for.
pub fn batch_policy(config: &ModelConfig) -> BatchPolicy {
    let Some(db) = dynamic_batching(config) else {
        let mut p = BatchPolicy::direct();
        if config.max_batch_size > 0 {
            p.max_batch_size = config.max_batch_size as usize;
        }
        return p;
    };
    let level_count = db.priority_levels.max(1) as usize;
    let from_policy = |q: Option<&ModelQueuePolicy>| match q {
        None => LevelPolicy::default(),
        Some(q) => LevelPolicy {
            timeout_action: if q.timeout_action == 1 { TimeoutAction::Delay } else { TimeoutAction::Reject },
            default_timeout: (q.default_timeout_microseconds > 0)
                .then(|| Duration::from_micros(q.default_timeout_microseconds)),
            allow_timeout_override: q.allow_timeout_override,
            max_queue_size: q.max_queue_size as usize,
        },
    };
    // Per-level policies count only with priority levels (Triton ignores them otherwise).
    let per_level = |l: u64| (db.priority_levels > 0).then(|| db.priority_queue_policy.get(&l)).flatten();
    let levels =
        (1..=level_count as u64).map(|l| from_policy(per_level(l).or(db.default_queue_policy.as_ref()))).collect();
    let mut preferred: Vec<usize> = db.preferred_batch_size.iter().map(|&p| p.max(1) as usize).collect();
    preferred.sort();
    preferred.dedup();
    BatchPolicy {
        max_batch_size: config.max_batch_size.max(1) as usize,
        // A model that does not batch runs one request at a time, queue policies and all.
        max_requests: if config.max_batch_size > 0 { usize::MAX } else { 1 },
        preferred_batch_sizes: preferred,
        max_queue_delay: Duration::from_micros(db.max_queue_delay_microseconds),
        levels,
        // Without priority levels there is one level, whatever default_priority_level says
        // (Triton ignores it then).
        default_level: if db.priority_levels == 0 || db.default_priority_level == 0 {
            1
        } else {
            db.default_priority_level as usize
        },
    }
}

/// Checks every `model_warmup` sample against the model's inputs before anything runs: each
/// input it names must be a model input, of the input's data type, with dims the input accepts
/// (the config's, a -1 taking any positive size). Triton refuses such a sample; running it
/// anyway would warm up with data the model never receives, or fail with a vaguer error.
fn check_warmup(config: &ModelConfig, spec: &ModelSpec) -> Result<(), String> {
    for (index, sample) in config.model_warmup.iter().enumerate() {
        let sample_name = if sample.name.is_empty() { format!("#{index}") } else { format!("'{}'", sample.name) };
        let at = |what: String| format!("model_warmup sample {sample_name}: {what}");
        if spec.max_batch_size > 0 && sample.batch_size as usize > spec.max_batch_size {
            return Err(at(format!("batch_size {} exceeds max_batch_size {}", sample.batch_size, spec.max_batch_size)));
        }
        if sample.count > MAX_WARMUP_COUNT {
            return Err(at(format!("count {} is over {MAX_WARMUP_COUNT}", sample.count)));
        }
        let mut names: Vec<&String> = sample.inputs.keys().collect();
        names.sort();
        // A sample's inputs are all held at once: bounded together.
        let mut sample_bytes = 0u64;
        for name in names {
            let w = &sample.inputs[name];
            let Some(input) = spec.inputs.iter().find(|i| &i.name == name) else {
                return Err(at(format!(
                    "inputs['{name}'] is not a model input (model inputs: {})",
                    spec.inputs.iter().map(|i| format!("'{}'", i.name)).collect::<Vec<_>>().join(", ")
                )));
            };
            if DataType::from_config_value(w.data_type) != Some(input.datatype) {
                return Err(at(format!(
                    "inputs['{name}'].data_type is {}, but the model input is {}",
                    DataType::from_config_value(w.data_type)
                        .map(|d| d.config_name())
                        .unwrap_or_else(|| "TYPE_INVALID".into()),
                    input.datatype.config_name()
                )));
            }
            let fits = w.dims.len() == input.dims.len()
                && w.dims.iter().zip(&input.dims).all(|(&d, &want)| d > 0 && (want == -1 || d == want));
            if !fits {
                return Err(at(format!(
                    "inputs['{name}'].dims {:?} do not fit the model input's dims {:?}{}",
                    w.dims,
                    input.dims,
                    if spec.max_batch_size > 0 { " (without the batch dimension: batch_size sets it)" } else { "" }
                )));
            }
            // Allocated before the sample runs: bounded (a BYTES element takes at least 5 bytes).
            let rows = if spec.max_batch_size > 0 { i64::from(sample.batch_size.max(1)) } else { 1 };
            let bytes = nereid_common::dtype::element_count(&w.dims)
                .and_then(|n| n.checked_mul(rows as u64))
                .and_then(|n| n.checked_mul(input.datatype.element_size().unwrap_or(5) as u64));
            sample_bytes = sample_bytes.saturating_add(bytes.unwrap_or(u64::MAX));
            if sample_bytes > MAX_WARMUP_INPUT_BYTES {
                return Err(at(format!(
                    "inputs['{name}'] takes the sample's inputs past {MAX_WARMUP_INPUT_BYTES} bytes together \
                     (dims {:?}, batch_size {})",
                    w.dims, sample.batch_size
                )));
            }
            if let Some(InputDataType::InputDataFile(file)) = &w.input_data_type {
                inside(file).map_err(|e| at(format!("inputs['{name}'].input_data_file '{file}': {e}")))?;
            }
        }
    }
    Ok(())
}

/// Runs each `model_warmup` sample on every instance before the model reports READY. As in
/// Triton: a sample is `batch_size` requests of one row each (here run as one batch of that
/// many rows, each row the same data), its `input_data_file` holds one row's data (a longer
/// file gives its first bytes), and a sample of batch size 0 is skipped.
fn warmup(config: &ModelConfig, dir: &Path, spec: &ModelSpec, instances: &mut [InstanceSession]) -> Result<(), String> {
    for sample in &config.model_warmup {
        if sample.batch_size == 0 {
            tracing::debug!(sample = %sample.name, "skipping a warm-up sample of batch size 0");
            continue;
        }
        let batching = spec.max_batch_size > 0;
        let batch = if batching { sample.batch_size as usize } else { 1 };
        let mut inputs = Vec::with_capacity(spec.inputs.len());
        for input in &spec.inputs {
            let Some(w) = sample.inputs.get(&input.name) else {
                if input.optional {
                    inputs.push(None);
                    continue;
                }
                return Err(format!("sample '{}' lacks input '{}'", sample.name, input.name));
            };
            let row_shape: Vec<i64> = batching.then_some(1).into_iter().chain(w.dims.iter().copied()).collect();
            let elements = nereid_common::dtype::element_count(&row_shape)
                .ok_or_else(|| format!("sample '{}': input '{}' has an invalid shape", sample.name, input.name))?
                as usize;
            let row = match (&w.input_data_type, input.datatype) {
                (Some(InputDataType::InputDataFile(file)), dt) => {
                    let path = dir.join("warmup").join(inside(file)?);
                    match dt.element_size() {
                        // BYTES: the whole file is the row's serialized elements.
                        None => read_bounded(&path, MAX_WARMUP_INPUT_BYTES)?,
                        Some(size) => read_prefix(&path, (elements * size) as u64)?,
                    }
                }
                (_, DataType::Bytes) => crate::tensor::serialize_bytes_elements(vec![b"0"; elements]),
                (Some(InputDataType::RandomData(true)), dt) => {
                    let size = dt.element_size().unwrap_or(1);
                    pseudo_random(elements * size, dt)
                }
                (_, dt) => vec![0u8; elements * dt.element_size().unwrap_or(1)],
            };
            crate::validate::check_byte_size(&input.name, input.datatype, &row_shape, &row).map_err(|e| e.message)?;
            let mut shape = row_shape;
            if batching {
                shape[0] = batch as i64;
            }
            // A BYTES row is as long as its file: the batch of it is bounded here, not above.
            if row.len().checked_mul(batch).is_none_or(|n| n as u64 > MAX_WARMUP_INPUT_BYTES) {
                return Err(format!(
                    "sample '{}': input '{}' takes more than {MAX_WARMUP_INPUT_BYTES} bytes for {batch} rows",
                    sample.name, input.name
                ));
            }
            inputs.push(Some((shape, bytes::Bytes::from(row.repeat(batch)))));
        }
        let jobs = [JobInputs { rows: batch, inputs: &inputs }];
        for instance in instances.iter_mut() {
            for _ in 0..sample.count.max(1) {
                if SHUTTING_DOWN.load(std::sync::atomic::Ordering::Relaxed) {
                    return Err("the worker is shutting down".into());
                }
                instance.run(&jobs, &|_, _| true).map_err(|e| e.message)?;
            }
        }
    }
    Ok(())
}

/// Set once the process is exiting: warm-ups stop between runs (a build on a blocking thread
/// cannot be interrupted otherwise, and the process should not exit while one is inside ONNX
/// Runtime).
static SHUTTING_DOWN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Stops the warm-ups under way and to come (the process is exiting).
pub fn begin_shutdown() {
    SHUTTING_DOWN.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// A warm-up data file, read whole but never more than `limit` bytes (a device or a huge file
/// linked by mistake is refused, not read until memory runs out).
fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut data = Vec::new();
    file.take(limit + 1).read_to_end(&mut data).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if data.len() as u64 > limit {
        return Err(format!("{} is larger than {limit} bytes", path.display()));
    }
    Ok(data)
}

/// The first `len` bytes of a warm-up data file; a shorter file is refused, naming both sizes.
fn read_prefix(path: &Path, len: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut data = Vec::new();
    file.take(len).read_to_end(&mut data).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if (data.len() as u64) < len {
        return Err(format!("{} holds {} bytes, but one row of the input takes {len}", path.display(), data.len()));
    }
    Ok(data)
}

/// Deterministic filler for `random_data`: small finite values for floats, bytes otherwise.
fn pseudo_random(len: usize, dt: DataType) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    match dt {
        DataType::Fp32 => (0..len / 4).flat_map(|_| ((next() % 1000) as f32 / 1000.0).to_le_bytes()).collect(),
        DataType::Fp64 => (0..len / 8).flat_map(|_| ((next() % 1000) as f64 / 1000.0).to_le_bytes()).collect(),
        DataType::Fp16 => {
            (0..len / 2).flat_map(|_| half::f16::from_f32((next() % 1000) as f32 / 1000.0).to_le_bytes()).collect()
        }
        DataType::Bf16 => {
            (0..len / 2).flat_map(|_| half::bf16::from_f32((next() % 1000) as f32 / 1000.0).to_le_bytes()).collect()
        }
        DataType::Bool => (0..len).map(|_| (next() & 1) as u8).collect(),
        _ => (0..len).map(|_| (next() % 16) as u8).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_common::config::parse_model_config;

    /// A label file that is not UTF-8 (Latin-1) loads: its odd bytes become U+FFFD, the other
    /// labels are as written.
    #[test]
    fn a_label_file_that_is_not_utf8_still_loads() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("labels.txt"), b"caf\xe9\nplain\n").expect("write");
        let c = config("output [ { name: \"P\" data_type: TYPE_FP32 dims: [ 2 ] label_filename: \"labels.txt\" } ]");
        let labels = read_labels(&c, dir.path()).expect("loads");
        assert_eq!(&labels["P"][..], ["caf\u{fffd}".to_string(), "plain".to_string()]);
    }

    fn config(text: &str) -> ModelConfig {
        parse_model_config(text).expect("test config parses")
    }

    fn tensor(name: &str, dims: &[i64]) -> backend::ModelTensor {
        backend::ModelTensor {
            name: name.into(),
            datatype: Some(DataType::Fp32),
            type_name: "float".into(),
            dims: dims.to_vec(),
        }
    }

    /// default_priority_level without priority_levels: one level, and every request lands in
    /// it (a level 2 that does not exist made every request panic).
    #[test]
    fn a_default_priority_level_without_levels_means_the_one_level() {
        let c = config(
            "max_batch_size: 4\ndynamic_batching { default_priority_level: 2 }\n\
             input [ { name: \"A\" data_type: TYPE_FP32 dims: [ 8 ] } ]\n\
             output [ { name: \"S\" data_type: TYPE_FP32 dims: [ 8 ] } ]",
        );
        validate_model_config(&c).unwrap();
        let policy = batch_policy(&c);
        assert_eq!(policy.levels.len(), 1);
        for priority in [0, 1, 2, 7] {
            assert_eq!(policy.level_for(priority), 1, "priority {priority}");
        }
    }

    /// Per-level queue policies without priority levels are ignored, as in Triton: the one
    /// level follows default_queue_policy (a key 1 used to replace it).
    #[test]
    fn per_level_policies_without_levels_are_ignored() {
        let c = config(
            "max_batch_size: 4\ndynamic_batching { priority_queue_policy { key: 1 value { max_queue_size: 1 } } \
             default_queue_policy { max_queue_size: 5 } }\n\
             input [ { name: \"A\" data_type: TYPE_FP32 dims: [ 8 ] } ]\n\
             output [ { name: \"S\" data_type: TYPE_FP32 dims: [ 8 ] } ]",
        );
        validate_model_config(&c).unwrap();
        let policy = batch_policy(&c);
        assert_eq!(policy.levels.len(), 1);
        assert_eq!(policy.levels[0].max_queue_size, 5);
    }

    fn batching_io() -> ModelIo {
        ModelIo { inputs: vec![tensor("A", &[-1, 8])], outputs: vec![tensor("S", &[-1, 8])], defaults: vec![] }
    }

    #[test]
    fn only_canonical_version_folders_are_versions() {
        for (name, want) in [("0", Some(0)), ("7", Some(7)), ("12", Some(12))] {
            assert_eq!(canonical_version(name), want, "{name}");
        }
        for name in ["07", "00", "+1", "-1", "", "1a", "warmup", " 1"] {
            assert_eq!(canonical_version(name), None, "{name}");
        }
        let dir = tempfile::tempdir().expect("temp dir");
        for d in ["1", "07", "+3", "3", "warmup"] {
            std::fs::create_dir(dir.path().join(d)).expect("mkdir");
        }
        let (versions, warnings) = scan_versions(dir.path());
        assert_eq!(versions, vec![1, 3]);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings.iter().any(|w| w.contains("'07'")) && warnings.iter().any(|w| w.contains("'+3'")));
    }

    #[test]
    fn a_specific_policy_loads_the_versions_that_exist() {
        let c = config("version_policy: { specific: { versions: [ 1, 5, 3 ] } }");
        let mut warnings = Vec::new();
        assert_eq!(select_versions(&c, &[1, 2, 3], &mut warnings).expect("some exist"), vec![1, 3]);
        assert!(warnings.len() == 1 && warnings[0].contains("version 5"), "{warnings:?}");
        let none = config("version_policy: { specific: { versions: [ 7 ] } }");
        let e = select_versions(&none, &[1, 2], &mut Vec::new()).expect_err("none exists");
        assert!(e.message.contains("version 7"), "{e}");
    }

    #[test]
    fn instance_groups_resolve_as_triton_s() {
        let mut c =
            config("name: \"m\"\ninstance_group [ { kind: KIND_CPU }, { count: 3 kind: KIND_AUTO name: \"x\" } ]");
        normalize_instance_groups(&mut c, 0).expect("CPU only");
        let g = &c.instance_group;
        assert_eq!((g[0].name.as_str(), g[0].count, g[0].kind), ("m_0", 2, Kind::Cpu as i32));
        assert_eq!((g[1].name.as_str(), g[1].count, g[1].kind), ("x", 3, Kind::Cpu as i32));
        assert_eq!(instance_devices(&c).unwrap().len(), 5);

        let mut none = config("name: \"n\"");
        normalize_instance_groups(&mut none, 0).expect("default group");
        assert_eq!(none.instance_group.len(), 1);
        assert_eq!((none.instance_group[0].name.as_str(), none.instance_group[0].count), ("n_0", 2));

        let mut gpu = config("name: \"g\"\ninstance_group [ { kind: KIND_AUTO } ]");
        normalize_instance_groups(&mut gpu, 2).expect("two GPUs");
        let g = &gpu.instance_group[0];
        assert_eq!((g.count, g.kind, g.gpus.clone()), (1, Kind::Gpu as i32, vec![0, 1]));
        assert_eq!(instance_devices(&gpu).unwrap(), vec![Device::Gpu(0), Device::Gpu(1)]);

        let mut no_gpu = config("name: \"g\"\ninstance_group [ { kind: KIND_GPU } ]");
        assert!(normalize_instance_groups(&mut no_gpu, 0).expect_err("no GPU").message.contains("KIND_GPU"));
    }

    #[test]
    fn autocomplete_turns_on_dynamic_batching_whenever_the_model_batches_beyond_one() {
        // Nothing declared: max_batch_size 4 and dynamic batching, as before.
        let mut c = ModelConfig::default();
        autocomplete(&mut c, &batching_io(), AUTOCOMPLETE_MAX_BATCH_SIZE, &mut Vec::new());
        assert_eq!(c.max_batch_size, AUTOCOMPLETE_MAX_BATCH_SIZE);
        assert!(dynamic_batching(&c).is_some());
        // max_batch_size set by the config, tensors left out: dynamic batching too.
        let mut c = config("max_batch_size: 8");
        autocomplete(&mut c, &batching_io(), AUTOCOMPLETE_MAX_BATCH_SIZE, &mut Vec::new());
        assert!(dynamic_batching(&c).is_some());
        assert_eq!(c.input[0].dims, vec![8]);
        // max_batch_size 1: nothing to batch, no scheduler added.
        let mut c = config("max_batch_size: 1");
        autocomplete(&mut c, &batching_io(), AUTOCOMPLETE_MAX_BATCH_SIZE, &mut Vec::new());
        assert!(c.scheduling_choice.is_none());
        // Inputs and outputs declared: auto-complete does not run at all.
        let mut c = config(
            "max_batch_size: 8\ninput [ { name: \"A\" data_type: TYPE_FP32 dims: [ 8 ] } ]\n\
             output [ { name: \"S\" data_type: TYPE_FP32 dims: [ 8 ] } ]",
        );
        autocomplete(&mut c, &batching_io(), AUTOCOMPLETE_MAX_BATCH_SIZE, &mut Vec::new());
        assert!(c.scheduling_choice.is_none());
        // --backend-config=default-max-batch-size: 16 batches up to 16; 0 does not batch (the
        // batch dim stays in the tensors' dims).
        let mut c = ModelConfig::default();
        autocomplete(&mut c, &batching_io(), 16, &mut Vec::new());
        assert_eq!(c.max_batch_size, 16);
        assert!(dynamic_batching(&c).is_some());
        let mut c = ModelConfig::default();
        autocomplete(&mut c, &batching_io(), 0, &mut Vec::new());
        assert_eq!(c.max_batch_size, 0);
        assert!(c.scheduling_choice.is_none());
        assert_eq!(c.input[0].dims, vec![-1, 8]);
    }

    #[test]
    fn strict_config_refuses_a_partial_config_with_the_reason() {
        let e = refuse_incomplete(&config("max_batch_size: 8")).expect_err("no tensors");
        assert!(e.message.contains("--strict-model-config") && e.message.contains("no input and no output"), "{e}");
        let complete = config(
            "input [ { name: \"A\" data_type: TYPE_FP32 dims: [ 8 ] } ]\n\
             output [ { name: \"S\" data_type: TYPE_FP32 dims: [ 8 ] } ]",
        );
        assert!(refuse_incomplete(&complete).is_ok());
    }

    #[test]
    fn graph_level_and_execution_mode_reach_the_session_options() {
        let defaults = SessionOptions::default();
        for (level, want) in [(-1, 1u8), (0, 3), (1, 2), (2, 0)] {
            let c = config(&format!("optimization {{ graph {{ level: {level} }} }}"));
            let mut warnings = Vec::new();
            let opts = session_options(&c, &defaults, &mut warnings).expect("valid");
            assert_eq!(opts.optimization_level, want, "graph level {level}");
            assert!(warnings.is_empty(), "{warnings:?}");
            assert!(unsupported_fields(&c).is_empty(), "graph level {level} is implemented");
        }
        let parallel = config("parameters { key: \"execution_mode\" value: { string_value: \"1\" } }");
        let mut warnings = Vec::new();
        assert!(session_options(&parallel, &defaults, &mut warnings).expect("valid").parallel_execution);
        assert!(warnings.is_empty(), "{warnings:?}");
        let bad = config("parameters { key: \"execution_mode\" value: { string_value: \"2\" } }");
        assert!(
            session_options(&bad, &defaults, &mut Vec::new()).expect_err("0 or 1").message.contains("execution_mode")
        );
    }

    #[test]
    fn cuda_provider_parameters_reach_the_session_options() {
        let param = |k: &str, v: &str| format!("parameters {{ key: \"{k}\" value: {{ string_value: \"{v}\" }} }}\n");
        let c = config(
            &[
                param("cudnn_conv_algo_search", "1"),
                param("gpu_mem_limit", "4294967200"),
                param("arena_extend_strategy", "1"),
                param("do_copy_in_default_stream", "0"),
            ]
            .concat(),
        );
        let mut warnings = Vec::new();
        let opts = session_options(&c, &SessionOptions::default(), &mut warnings).expect("valid");
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(
            opts.cuda,
            crate::backend::CudaOptions {
                conv_algo_search: Some(1),
                gpu_mem_limit: Some(4_294_967_200),
                arena_extend_strategy: Some(1),
                copy_in_default_stream: Some(false),
                rejected: vec![],
            }
        );
        assert_eq!(
            session_options(&config(""), &SessionOptions::default(), &mut warnings).unwrap().cuda,
            Default::default()
        );
        // Triton takes the integers only ("HEURISTIC" fails its conversion too); an invalid value
        // is kept for the load to refuse where the model has a GPU instance.
        for (k, v) in [
            ("cudnn_conv_algo_search", "HEURISTIC"),
            ("cudnn_conv_algo_search", "3"),
            ("gpu_mem_limit", "lots"),
            ("arena_extend_strategy", "2"),
            ("do_copy_in_default_stream", "yes"),
        ] {
            let opts = session_options(&config(&param(k, v)), &SessionOptions::default(), &mut Vec::new()).unwrap();
            let rejected = &opts.cuda.rejected;
            assert!(rejected.len() == 1 && rejected[0].contains(k) && rejected[0].contains(v), "{rejected:?}");
        }
        // -1 is Triton's "no limit" (its unsigned conversion wraps it).
        let opts = session_options(&config(&param("gpu_mem_limit", "-1")), &SessionOptions::default(), &mut Vec::new());
        assert_eq!(opts.unwrap().cuda, Default::default());
    }

    #[test]
    fn warmup_samples_must_match_the_model_inputs() {
        let spec = ModelSpec {
            max_batch_size: 4,
            inputs: vec![TensorSpec {
                name: "A".into(),
                datatype: DataType::Fp32,
                dims: vec![-1, 8],
                reshape: None,
                optional: false,
            }],
            outputs: vec![],
        };
        let sample = |input: &str| {
            config(&format!("model_warmup [ {{ name: \"w\" batch_size: 2 inputs {{ key: {input} }} }} ]"))
        };
        let ok = sample("\"A\" value: { data_type: TYPE_FP32 dims: [ 3, 8 ] zero_data: true }");
        assert!(check_warmup(&ok, &spec).is_ok());
        for (input, needles) in [
            (
                "\"A\" value: { data_type: TYPE_INT32 dims: [ 3, 8 ] zero_data: true }",
                ["'w'", "data_type", "TYPE_INT32"],
            ),
            ("\"A\" value: { data_type: TYPE_FP32 dims: [ 3, 7 ] zero_data: true }", ["'w'", "dims", "[3, 7]"]),
            ("\"A\" value: { data_type: TYPE_FP32 dims: [ 8 ] zero_data: true }", ["'w'", "dims", "[8]"]),
            (
                "\"B\" value: { data_type: TYPE_FP32 dims: [ 3, 8 ] zero_data: true }",
                ["'w'", "inputs['B']", "not a model input"],
            ),
            // Allocated before running: bounded.
            (
                "\"A\" value: { data_type: TYPE_FP32 dims: [ 1099511627776, 8 ] zero_data: true }",
                ["'w'", "inputs['A']", "past 1073741824 bytes together"],
            ),
            (
                "\"A\" value: { data_type: TYPE_FP32 dims: [ 4611686018427387904, 8 ] zero_data: true }",
                ["'w'", "inputs['A']", "past 1073741824 bytes"],
            ),
            // Read from the model's own warmup folder only.
            (
                "\"A\" value: { data_type: TYPE_FP32 dims: [ 3, 8 ] input_data_file: \"../../x\" }",
                ["'w'", "input_data_file '../../x'", "inside the model's directory"],
            ),
        ] {
            let e = check_warmup(&sample(input), &spec).expect_err(input);
            for n in needles {
                assert!(e.contains(n), "{n:?} not in {e:?}");
            }
        }
    }

    /// A sample's inputs are held together: bounded together (each under the bound, both over).
    #[test]
    fn warmup_inputs_are_bounded_together() {
        let input = |name: &str| TensorSpec {
            name: name.into(),
            datatype: DataType::Fp32,
            dims: vec![-1],
            reshape: None,
            optional: false,
        };
        let spec = ModelSpec { max_batch_size: 0, inputs: vec![input("A"), input("B")], outputs: vec![] };
        let sample = |b: u64| {
            config(&format!(
                "model_warmup [ {{ name: \"w\" batch_size: 1 inputs [ \
                 {{ key: \"A\" value: {{ data_type: TYPE_FP32 dims: [ 160000000 ] zero_data: true }} }}, \
                 {{ key: \"B\" value: {{ data_type: TYPE_FP32 dims: [ {b} ] zero_data: true }} }} ] }} ]"
            ))
        };
        assert!(check_warmup(&sample(100_000_000), &spec).is_ok(), "0.64 + 0.4 GB");
        let e = check_warmup(&sample(160_000_000), &spec).expect_err("0.64 + 0.64 GB");
        assert!(e.contains("inputs['B']") && e.contains("together"), "{e}");
    }

    fn io(inputs: &[(&str, &[i64])], outputs: &[(&str, &[i64])]) -> ModelIo {
        ModelIo {
            inputs: inputs.iter().map(|(n, d)| tensor(n, d)).collect(),
            outputs: outputs.iter().map(|(n, d)| tensor(n, d)).collect(),
            defaults: vec![],
        }
    }

    /// What `load_model` makes of a config and a model: auto-completed, checked, and the spec
    /// the instances run with.
    fn completed(mut c: ModelConfig, io: &ModelIo) -> Result<(ModelConfig, ModelSpec), String> {
        autocomplete(&mut c, io, AUTOCOMPLETE_MAX_BATCH_SIZE, &mut Vec::new());
        check_against_model(&c, io)?;
        let mut spec = spec_from_config(&c).map_err(|e| e.message)?;
        apply_scalar_reshapes(&mut spec, &scalar_reshapes(&c, io));
        Ok((c, spec))
    }

    /// Triton's `AutoCompleteIO`: a tensor that is only the batch dim gets dims [1] and an
    /// empty reshape, so clients send [batch, 1] and the model gets [batch] (it was dims [],
    /// a shape Triton's clients never send).
    #[test]
    fn a_tensor_of_only_the_batch_dim_autocompletes_to_dims_one_reshaped_to_nothing() {
        let (c, spec) = completed(ModelConfig::default(), &io(&[("X", &[-1])], &[("Y", &[-1])])).expect("loads");
        assert_eq!(c.max_batch_size, AUTOCOMPLETE_MAX_BATCH_SIZE);
        assert_eq!(
            (c.input[0].dims.clone(), c.input[0].reshape.clone()),
            (vec![1], Some(ModelTensorReshape { shape: vec![] }))
        );
        assert_eq!(
            (c.output[0].dims.clone(), c.output[0].reshape.clone()),
            (vec![1], Some(ModelTensorReshape { shape: vec![] }))
        );
        // What the instances feed and answer: [3, 1] in, [3] to the model, [3, 1] out.
        assert_eq!(spec.inputs[0].reshape, Some(vec![]));
        assert_eq!(backend::reshaped(spec.inputs[0].reshape.as_deref().unwrap(), &[3, 1], true), vec![3]);
        assert_eq!(backend::reshaped(&spec.outputs[0].dims, &[3], true), vec![3, 1]);
    }

    /// Without batching Triton auto-completes a scalar to dims [1] with no reshape (it refuses
    /// an empty reshape there) and feeds the model a scalar: here the spec's implied reshape.
    #[test]
    fn a_scalar_without_batching_autocompletes_to_dims_one_and_is_fed_as_a_scalar() {
        let (c, spec) = completed(ModelConfig::default(), &io(&[("X", &[])], &[("Y", &[])])).expect("loads");
        assert_eq!(c.max_batch_size, 0);
        assert_eq!((c.input[0].dims.clone(), c.input[0].reshape.clone()), (vec![1], None));
        assert_eq!((c.output[0].dims.clone(), c.output[0].reshape.clone()), (vec![1], None));
        assert_eq!((spec.inputs[0].reshape.clone(), spec.outputs[0].reshape.clone()), (Some(vec![]), Some(vec![])));
        assert_eq!(backend::reshaped(&[], &[1], false), Vec::<i64>::new(), "[1] in, a scalar to the model");
        assert_eq!(backend::reshaped(&spec.outputs[0].dims, &[], false), vec![1], "a scalar out, [1] to the client");
    }

    /// Triton's `ValidateInputs` / `ValidateOutputs` take any config dims that are all 1 for a
    /// model scalar without batching; dims [] (what Nereid wrote before) still load too.
    #[test]
    fn config_dims_of_ones_take_a_model_scalar_without_batching() {
        let scalar = io(&[("X", &[])], &[("Y", &[])]);
        for dims in ["[ 1 ]", "[ 1, 1 ]"] {
            let c = config(&format!(
                "input [ {{ name: \"X\" data_type: TYPE_FP32 dims: {dims} }} ]\n\
                 output [ {{ name: \"Y\" data_type: TYPE_FP32 dims: {dims} }} ]"
            ));
            let (_, spec) = completed(c, &scalar).unwrap_or_else(|e| panic!("dims {dims}: {e}"));
            assert_eq!(spec.inputs[0].reshape, Some(vec![]), "dims {dims}");
            assert_eq!(spec.outputs[0].reshape, Some(vec![]), "dims {dims}");
        }
        let empty = config(
            "input [ { name: \"X\" data_type: TYPE_FP32 dims: [ ] } ]\n\
             output [ { name: \"Y\" data_type: TYPE_FP32 dims: [ ] } ]",
        );
        let (_, spec) = completed(empty, &scalar).expect("dims [] still load");
        assert_eq!(spec.inputs[0].reshape, None, "already the model's shape");
        let two = config(
            "input [ { name: \"X\" data_type: TYPE_FP32 dims: [ 2 ] } ]\n\
             output [ { name: \"Y\" data_type: TYPE_FP32 dims: [ 1 ] } ]",
        );
        let e = completed(two, &scalar).expect_err("two elements are no scalar");
        assert!(e.contains("input 'X'") && e.contains("scalar") && e.contains("[2]"), "{e}");
        // A model of [1] is no scalar: nothing implied.
        let (_, spec) = completed(
            config(
                "input [ { name: \"X\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n\
                 output [ { name: \"Y\" data_type: TYPE_FP32 dims: [ 1 ] } ]",
            ),
            &io(&[("X", &[1])], &[("Y", &[1])]),
        )
        .expect("loads");
        assert_eq!(spec.inputs[0].reshape, None);
    }

    /// Triton's reshape rule: as many -1 on both sides, and the fixed dims around them hold as
    /// many elements on both sides. [-1, 3] as [-1, 4] loaded before and failed every request.
    #[test]
    fn a_reshape_with_a_free_dim_must_split_where_the_dims_do() {
        let check = |dims: &str, reshape: &str, model: &[i64]| {
            let c = config(&format!(
                "input [ {{ name: \"X\" data_type: TYPE_FP32 dims: {model:?} }} ]\n\
                 output [ {{ name: \"Y\" data_type: TYPE_FP32 dims: {dims} reshape: {{ shape: {reshape} }} }} ]"
            ));
            check_against_model(&c, &io(&[("X", model)], &[("Y", model)]))
        };
        let e = check("[ -1, 3 ]", "[ -1, 4 ]", &[-1, 4]).expect_err("3 elements a row against 4");
        assert!(e.contains("output 'Y'") && e.contains("[1, 3]") && e.contains("[1, 4]"), "{e}");
        let e = check("[ 2, -1 ]", "[ -1, 2 ]", &[-1, 2]).expect_err("the fixed dims on other sides of the -1");
        assert!(e.contains("output 'Y'") && e.contains("[2, 1]") && e.contains("[1, 2]"), "{e}");
        check("[ 2, 4, -1, 6 ]", "[ 8, -1, 1, 6 ]", &[8, -1, 1, 6]).expect("Triton's own example");
        check("[ -1, 4 ]", "[ -1, 2, 2 ]", &[-1, 2, 2]).expect("4 elements after the -1 on both sides");
        let e = check("[ -1, 4 ]", "[ 4 ]", &[4]).expect_err("a -1 on one side only");
        assert!(e.contains("as many -1"), "{e}");
        let e = check("[ 16 ]", "[ 4, 5 ]", &[4, 5]).expect_err("element counts");
        assert!(e.contains("16 elements") && e.contains("holds 20"), "{e}");
        // Valid in Triton, but requests are reshaped here by one free dim only: refused with
        // that reason rather than loaded to fail every request.
        let e = check("[ -1, 4, -1 ]", "[ -1, 2, 2, -1 ]", &[-1, 2, 2, -1]).expect_err("two -1");
        assert!(e.contains("one -1 at most"), "{e}");
    }

    /// Triton's `ValidateOutputs` compares an output's dims exactly (`compare_exact`): a fixed
    /// config dim where the model's is -1 is refused for an output, taken for an input.
    #[test]
    fn an_output_s_dims_must_be_the_model_s_exactly() {
        let model = io(&[("X", &[-1, -1])], &[("Y", &[-1, -1])]);
        let c = |x: &str, y: &str| {
            config(&format!(
                "max_batch_size: 4\ninput [ {{ name: \"X\" data_type: TYPE_FP32 dims: {x} }} ]\n\
                 output [ {{ name: \"Y\" data_type: TYPE_FP32 dims: {y} }} ]"
            ))
        };
        let e = check_against_model(&c("[ 10 ]", "[ 10 ]"), &model).expect_err("output [10] against [-1, -1]");
        assert!(e.contains("output 'Y'") && e.contains("[10]") && e.contains("exactly"), "{e}");
        check_against_model(&c("[ 10 ]", "[ -1 ]"), &model).expect("an input's -1 takes any dim");
        let fixed = io(&[("X", &[-1, 10])], &[("Y", &[-1, 10])]);
        let e = check_against_model(&c("[ 10 ]", "[ -1 ]"), &fixed).expect_err("output [-1] against [-1, 10]");
        assert!(e.contains("output 'Y'"), "{e}");
    }

    /// The platform and backend: either may name ONNX Runtime; both named, they must agree.
    #[test]
    fn platform_and_backend_must_agree() {
        for ok in [
            "",
            "platform: \"onnxruntime_onnx\"",
            "backend: \"onnxruntime\"",
            "platform: \"onnxruntime_onnx\" backend: \"onnxruntime\"",
        ] {
            check_backend(&config(ok)).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for (bad, needle) in [
            ("platform: \"tensorrt_plan\"", "platform 'tensorrt_plan' is not supported"),
            ("backend: \"python\"", "backend 'python' is not supported"),
            ("platform: \"onnxruntime\" backend: \"onnxruntime\"", "does not go with backend 'onnxruntime'"),
            ("platform: \"tensorrt_plan\" backend: \"onnxruntime\"", "platform 'tensorrt_plan' does not go with"),
        ] {
            let e = check_backend(&config(bad)).expect_err(bad);
            assert!(e.message.contains(needle), "{bad}: {e}");
        }
    }

    /// A policy that names no choice is Triton's "all"; no policy at all is the latest one.
    #[test]
    fn an_empty_version_policy_loads_every_version() {
        let all = config("version_policy: { }");
        assert_eq!(select_versions(&all, &[1, 2, 3], &mut Vec::new()).unwrap(), vec![1, 2, 3]);
        assert_eq!(select_versions(&config(""), &[1, 2, 3], &mut Vec::new()).unwrap(), vec![3]);
    }

    /// Triton selects no version for `latest { num_versions: 0 }` and fails the load; it was
    /// read as 1.
    #[test]
    fn a_latest_policy_of_no_versions_fails_the_load() {
        let c = config("version_policy: { latest: { num_versions: 0 } }");
        let e = select_versions(&c, &[1, 2], &mut Vec::new()).expect_err("no version selected");
        assert!(e.message.contains("num_versions is 0") && e.message.contains("at least one version"), "{e}");
        let one = config("version_policy: { latest: { num_versions: 1 } }");
        assert_eq!(select_versions(&one, &[1, 2], &mut Vec::new()).expect("one"), vec![2]);
    }

    /// Auto-complete leaves out a tensor it has no datatype for: an input so left out fails the
    /// load naming its ONNX type (it said "missing from the config", which no config could
    /// fix); an output is left out with a warning.
    #[test]
    fn an_input_of_an_unsupported_type_is_refused_naming_its_onnx_type() {
        let odd = |name: &str| backend::ModelTensor {
            name: name.into(),
            datatype: None,
            type_name: "Float8E4M3FN".into(),
            dims: vec![-1, 4],
        };
        let model = ModelIo {
            inputs: vec![tensor("A", &[-1, 4]), odd("F8")],
            outputs: vec![tensor("S", &[-1, 4]), odd("G8")],
            defaults: vec![],
        };
        let mut c = ModelConfig::default();
        let mut warnings = Vec::new();
        autocomplete(&mut c, &model, AUTOCOMPLETE_MAX_BATCH_SIZE, &mut warnings);
        assert!(
            warnings.len() == 1 && warnings[0].contains("output 'G8'") && warnings[0].contains("Float8E4M3FN"),
            "{warnings:?}"
        );
        let e = check_against_model(&c, &model).expect_err("F8 cannot be served");
        assert!(e.contains("input 'F8'") && e.contains("Float8E4M3FN") && e.contains("does not support"), "{e}");
    }

    /// Just enough of onnx.proto to write test models.
    mod onnx {
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Model {
            #[prost(int64, tag = "1")]
            pub ir_version: i64,
            #[prost(message, optional, tag = "7")]
            pub graph: Option<Graph>,
            #[prost(message, repeated, tag = "8")]
            pub opset_import: Vec<OpsetId>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct OpsetId {
            #[prost(string, tag = "1")]
            pub domain: String,
            #[prost(int64, tag = "2")]
            pub version: i64,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Graph {
            #[prost(message, repeated, tag = "1")]
            pub node: Vec<Node>,
            #[prost(string, tag = "2")]
            pub name: String,
            #[prost(message, repeated, tag = "11")]
            pub input: Vec<ValueInfo>,
            #[prost(message, repeated, tag = "12")]
            pub output: Vec<ValueInfo>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Node {
            #[prost(string, repeated, tag = "1")]
            pub input: Vec<String>,
            #[prost(string, repeated, tag = "2")]
            pub output: Vec<String>,
            #[prost(string, tag = "4")]
            pub op_type: String,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct ValueInfo {
            #[prost(string, tag = "1")]
            pub name: String,
            #[prost(message, optional, tag = "2")]
            pub r#type: Option<Type>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Type {
            #[prost(message, optional, tag = "1")]
            pub tensor_type: Option<TensorType>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct TensorType {
            #[prost(int32, tag = "1")]
            pub elem_type: i32,
            /// Present and empty for a scalar (absent would mean any rank).
            #[prost(message, optional, tag = "2")]
            pub shape: Option<Shape>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Shape {
            #[prost(message, repeated, tag = "1")]
            pub dim: Vec<Dim>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub struct Dim {
            #[prost(int64, optional, tag = "1")]
            pub dim_value: Option<i64>,
            #[prost(string, optional, tag = "2")]
            pub dim_param: Option<String>,
        }
    }

    const FLOAT: i32 = 1;
    const INT64: i32 = 7;

    /// An ONNX model of `nodes` (op, inputs, outputs; no attributes) with the given graph
    /// inputs and outputs: (name, ONNX element type, dims), a -1 being a free dim.
    fn onnx_model(
        nodes: &[(&str, &[&str], &[&str])],
        inputs: &[(&str, i32, &[i64])],
        outputs: &[(&str, i32, &[i64])],
    ) -> Vec<u8> {
        use prost::Message;
        let value = |&(name, elem_type, dims): &(&str, i32, &[i64])| onnx::ValueInfo {
            name: name.into(),
            r#type: Some(onnx::Type {
                tensor_type: Some(onnx::TensorType {
                    elem_type,
                    shape: Some(onnx::Shape {
                        dim: dims
                            .iter()
                            .enumerate()
                            .map(|(i, &d)| onnx::Dim {
                                dim_value: (d >= 0).then_some(d),
                                dim_param: (d < 0).then(|| format!("{name}_{i}")),
                            })
                            .collect(),
                    }),
                }),
            }),
        };
        let strings = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();
        onnx::Model {
            ir_version: 8,
            opset_import: vec![onnx::OpsetId { domain: String::new(), version: 13 }],
            graph: Some(onnx::Graph {
                name: "test".into(),
                node: nodes
                    .iter()
                    .map(|(op, i, o)| onnx::Node { input: strings(i), output: strings(o), op_type: op.to_string() })
                    .collect(),
                input: inputs.iter().map(value).collect(),
                output: outputs.iter().map(value).collect(),
            }),
        }
        .encode_to_vec()
    }

    /// End to end through ONNX Runtime: scalars and batch-only tensors load as Triton's
    /// auto-complete or a hand-written dims: [1] says, and requests of Triton's shapes ([1],
    /// [batch, 1]) run, the model getting its own shapes and clients the config's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scalars_and_batch_only_tensors_serve_in_triton_s_shapes() {
        backend::init_runtime(&backend::default_runtime_path()).expect("ONNX Runtime (scripts/setup.sh)");
        let dir = tempfile::tempdir().expect("temp dir");
        let model = |name: &str, onnx: Vec<u8>, config: Option<&str>| {
            std::fs::create_dir_all(dir.path().join(name).join("1")).expect("mkdir");
            std::fs::write(dir.path().join(name).join("1").join("model.onnx"), onnx).expect("write");
            if let Some(c) = config {
                std::fs::write(dir.path().join(name).join("config.pbtxt"), c).expect("write config");
            }
        };
        let add = [("Add", &["X", "X"][..], &["Y"][..])];
        model("scalar", onnx_model(&add, &[("X", FLOAT, &[])], &[("Y", FLOAT, &[])]), None);
        model("column", onnx_model(&add, &[("X", FLOAT, &[-1])], &[("Y", FLOAT, &[-1])]), None);
        // RANK: the rank of what the model was given (0 for a scalar); SIZE: its element count,
        // a scalar whatever X is. No graph optimization: it would fold the Shape of X (declared a
        // scalar) into a constant.
        let probe = onnx_model(
            &[("Shape", &["X"], &["S"]), ("Size", &["S"], &["RANK"]), ("Size", &["X"], &["SIZE"])],
            &[("X", FLOAT, &[])],
            &[("RANK", INT64, &[]), ("SIZE", INT64, &[])],
        );
        let ones = "input [ { name: \"X\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n\
                    output [ { name: \"RANK\" data_type: TYPE_INT64 dims: [ 1 ] },\n\
                             { name: \"SIZE\" data_type: TYPE_INT64 dims: [ 1 ] } ]\n\
                    optimization { graph { level: 2 } }";
        model("scalar_ones", probe, Some(ones));
        let options = super::super::RepositoryOptions {
            paths: vec![dir.path().to_path_buf()],
            mode: super::super::ControlMode::Explicit,
            strict_config: false,
            startup_models: vec![],
            session_defaults: SessionOptions::default(),
            load_threads: 2,
            default_max_batch_size: AUTOCOMPLETE_MAX_BATCH_SIZE,
            config_name: None,
        };
        let metrics = Arc::new(Metrics::new());
        let served = |name: &str| {
            let m = load_model(&options, name, None, None, &[], &metrics).expect("loads");
            let (i, o) = (&m.config.input[0], &m.config.output[0]);
            (m.config.max_batch_size, i.dims.clone(), i.reshape.is_some(), o.dims.clone(), o.reshape.is_some())
        };
        assert_eq!(served("scalar"), (0, vec![1], false, vec![1], false));
        assert_eq!(served("column"), (AUTOCOMPLETE_MAX_BATCH_SIZE, vec![1], true, vec![1], true));

        let repo = super::super::Repository::new(options.clone(), metrics);
        let infer = |name: &'static str, shape: Vec<i64>, values: Vec<f32>| {
            let repo = &repo;
            async move {
                repo.load(name, None).await.unwrap_or_else(|e| panic!("{name}: {e}"));
                let request = crate::tensor::InferRequest {
                    model_name: name.into(),
                    inputs: vec![crate::tensor::InputTensor {
                        name: "X".into(),
                        datatype: DataType::Fp32,
                        shape,
                        data: bytes::Bytes::from(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()),
                    }],
                    ..Default::default()
                };
                let mut outputs = repo.infer(request).await.unwrap_or_else(|e| panic!("{name}: {e}")).outputs;
                outputs.sort_by(|a, b| a.name.cmp(&b.name));
                outputs.into_iter().map(|o| (o.name, o.shape, o.data.to_vec())).collect::<Vec<_>>()
            }
        };
        let floats = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(infer("scalar", vec![1], vec![1.5]).await, vec![("Y".into(), vec![1], floats(&[3.0]))]);
        assert_eq!(
            infer("column", vec![3, 1], vec![1.0, 2.0, 3.0]).await,
            vec![("Y".into(), vec![3, 1], floats(&[2.0, 4.0, 6.0]))]
        );
        // The model was given a scalar (a shape of no dims), and its scalar answer comes back
        // as the config's [1].
        assert_eq!(
            infer("scalar_ones", vec![1], vec![7.0]).await,
            vec![
                ("RANK".into(), vec![1], 0i64.to_le_bytes().to_vec()),
                ("SIZE".into(), vec![1], 1i64.to_le_bytes().to_vec())
            ]
        );
    }
}
