//! The model repository: Triton's layout (`<repo>/<model>/config.pbtxt` + numeric version
//! folders), model control modes NONE / POLL / EXPLICIT, and the table of loaded models that
//! requests look up.
//!
//! Loading reads and validates the config (or auto-completes it from the ONNX model), creates
//! one ONNX Runtime session per instance, runs `model_warmup`, starts one scheduler per version
//! and only then swaps the model in. A reload builds the new model beside the old one and swaps
//! atomically: in-flight requests hold the old version and finish on it. A load that fails
//! leaves the model UNAVAILABLE with the reason in the index, and nothing else is affected
//! (on a failed reload, the old model keeps serving).

mod load;

pub use load::{AUTOCOMPLETE_MAX_BATCH_SIZE, begin_shutdown};

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use nereid_common::{Code, DataType, Status};
use nereid_proto::inference::ModelConfig;
use tokio::sync::oneshot;

use crate::backend::SessionOptions;
use crate::cache::ResponseCache;
use crate::ensemble::{self, Plan};
use crate::metrics::{Execution, Metrics, RunFigures, VersionStats};
use crate::scheduler::{Answer, Job, Scheduler};
use crate::server::{IndexEntry, ModelMetadata, ModelStats, TensorMetadata};
use crate::tensor::{InferRequest, InferResponse};
use crate::validate::{ModelSpec, validate};

pub use load::{Stamp, scan_models};

/// Triton's `--model-control-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ControlMode {
    None,
    Poll,
    Explicit,
}

/// How the repository is set up (from the command line).
#[derive(Clone, Debug)]
pub struct RepositoryOptions {
    pub paths: Vec<PathBuf>,
    pub mode: ControlMode,
    /// Triton's `--strict-model-config`: no auto-completion at all; a missing config.pbtxt, or
    /// one without inputs or outputs, fails the load.
    pub strict_config: bool,
    /// Models to load at start in EXPLICIT mode (`*` = all).
    pub startup_models: Vec<String>,
    /// Session defaults when a config's `parameters` do not say.
    pub session_defaults: SessionOptions,
    /// Models built at once (tritonserver's `--model-load-thread-count`; 0 counts as 1).
    pub load_threads: usize,
    /// The max_batch_size auto-complete gives a model that can batch (tritonserver's
    /// `--backend-config=default-max-batch-size`).
    pub default_max_batch_size: i32,
    /// tritonserver's `--model-config-name`: read `<model>/configs/<name>.pbtxt` where it
    /// exists, else config.pbtxt.
    pub config_name: Option<String>,
}

/// One loaded version: what runs its requests, and its counters.
pub struct ModelVersion {
    pub version: i64,
    pub executor: Executor,
    pub stats: Arc<VersionStats>,
}

/// What runs a version's requests.
pub enum Executor {
    /// The dynamic batcher in front of the version's ONNX Runtime instances.
    Scheduler(Scheduler),
    /// An ensemble's steps, each a request to a composing model; `inflight` bounds the
    /// requests in the pipeline at once (`max_inflight_requests`), shared by its versions.
    Ensemble { plan: Arc<Plan>, inflight: Option<Arc<tokio::sync::Semaphore>> },
}

/// A model as it serves: one config, one spec, one or more versions.
pub struct LoadedModel {
    pub name: String,
    pub config: Arc<ModelConfig>,
    pub spec: Arc<ModelSpec>,
    pub versions: BTreeMap<i64, Arc<ModelVersion>>,
    pub warnings: Vec<String>,
    pub stamp: Stamp,
    /// The step graph, for an ensemble.
    pub ensemble: Option<Arc<Plan>>,
    /// `response_cache { enable: true }`: answers may come from the repository's cache.
    pub cache_enabled: bool,
    /// Distinct for every load, so a reload (new weights under the same version) never
    /// answers from responses cached before it.
    pub generation: u64,
    /// Class labels of the outputs that name a `label_filename`, for classification.
    pub labels: HashMap<String, Arc<[String]>>,
    /// For an ensemble: the repository epoch at which its steps were last found to fit its
    /// composing models (`u64::MAX`: not yet), so requests re-check only after a load or unload.
    pub steps_fit_at: AtomicU64,
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    Loading,
    Ready,
    Unloading,
    Unavailable(String),
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            State::Loading => "LOADING",
            State::Ready => "READY",
            State::Unloading => "UNLOADING",
            State::Unavailable(_) => "UNAVAILABLE",
        }
    }
}

#[derive(Clone)]
struct Slot {
    state: State,
    model: Option<Arc<LoadedModel>>,
    /// Why the last reload failed while the previous model kept serving.
    reload_error: Option<String>,
}

/// The table of models plus the machinery to change it.
pub struct Repository {
    options: RepositoryOptions,
    metrics: Arc<Metrics>,
    slots: RwLock<HashMap<String, Slot>>,
    /// Models unloaded while requests still ran on them: the index shows them UNLOADING (as
    /// Triton does) until the last of those finishes and the sessions go.
    unloading: Mutex<HashMap<String, Vec<std::sync::Weak<LoadedModel>>>>,
    /// Serializes changes to the table (requests never take it). A load builds its model
    /// outside it, taking it to read the model's state before and to put the model in place
    /// after.
    changes: tokio::sync::Mutex<()>,
    /// Each model's turn: the loads and unloads of one model run one at a time, in order.
    turns: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Bounds the models built at once outside start-up (`load_threads`).
    builds: tokio::sync::Semaphore,
    /// The load of each model that waits for its turn, if one does: an identical request
    /// (same config override and versions) arriving meanwhile is answered by it instead of
    /// queueing another build — a client retrying a slow load does not pile up reloads.
    queued: std::sync::Mutex<HashMap<String, Queued>>,
    /// Numbers queued loads.
    queued_ids: AtomicU64,
    /// Model builds started by loads outside start-up.
    builds_started: AtomicU64,
    startup_done: AtomicBool,
    draining: AtomicBool,
    /// The inputs every model's requests may hold at once (`--max-queued-bytes`).
    budget: Arc<crate::scheduler::MemoryBudget>,
    /// POLL: the files each model had at its last load attempt, so an unchanged broken model
    /// is not retried every pass.
    attempted: std::sync::Mutex<HashMap<String, Stamp>>,
    /// `--cache-config`: the response cache models with `response_cache { enable: true }` use.
    cache: Option<Arc<ResponseCache>>,
    /// Counts loads and unloads (part of an ensemble's cache key).
    epoch: std::sync::atomic::AtomicU64,
    /// Triton's `--strict-readiness`: the server is ready only while every model it tried to
    /// load is READY (see [`server_ready`](Self::server_ready)).
    strict_readiness: bool,
}

/// The reason an explicitly unloaded model's slot carries: such a model does not count
/// against strict readiness.
const UNLOADED: &str = "unloaded";

/// A load waiting for its model's turn (see [`Repository::queued`]).
struct Queued {
    request: (Option<String>, Option<Vec<i64>>),
    id: u64,
    done: tokio::sync::watch::Receiver<Option<Result<(), Status>>>,
}

/// Takes a queued load off [`Repository::queued`] when it gets its turn or is dropped.
struct Unqueue<'a> {
    queued: &'a std::sync::Mutex<HashMap<String, Queued>>,
    name: &'a str,
    id: u64,
}

impl Drop for Unqueue<'_> {
    fn drop(&mut self) {
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        if queued.get(self.name).is_some_and(|q| q.id == self.id) {
            queued.remove(self.name);
        }
    }
}

/// A model's turn, held (see [`Repository::turn`]); the last holder removes its entry.
struct Turn<'a> {
    turns: &'a std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    name: String,
    lock: Arc<tokio::sync::Mutex<()>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.guard = None;
        let mut turns = self.turns.lock().unwrap_or_else(|e| e.into_inner());
        // Held by the table and this guard only: nobody else waits for the turn.
        if Arc::strong_count(&self.lock) == 2 {
            turns.remove(&self.name);
        }
    }
}

/// What a failed load task said: its panic's message, or why it did not finish.
fn panic_message(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(payload) => crate::scheduler::panic_text(payload.as_ref()),
        Err(e) => e.to_string(),
    }
}

impl Repository {
    pub fn new(options: RepositoryOptions, metrics: Arc<Metrics>) -> Self {
        let builds = options.load_threads.max(1);
        let budget = crate::scheduler::MemoryBudget::new(0);
        metrics.show_memory_budget(budget.clone());
        Repository {
            options,
            metrics,
            slots: RwLock::new(HashMap::new()),
            unloading: Mutex::new(HashMap::new()),
            changes: tokio::sync::Mutex::new(()),
            turns: Default::default(),
            builds: tokio::sync::Semaphore::new(builds),
            queued: Default::default(),
            queued_ids: Default::default(),
            builds_started: Default::default(),
            startup_done: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            budget,
            attempted: Default::default(),
            cache: None,
            epoch: Default::default(),
            strict_readiness: true,
        }
    }

    /// Bounds the bytes of input the requests of every model may hold at once, queued or
    /// running (`--max-queued-bytes`; 0: no bound). Past it a request is RESOURCE_EXHAUSTED.
    pub fn with_max_queued_bytes(mut self, limit: u64) -> Self {
        self.budget = crate::scheduler::MemoryBudget::new(limit);
        self.metrics.show_memory_budget(self.budget.clone());
        self
    }

    /// Sets strict readiness (Triton's `--strict-readiness`, default true): with it, the server
    /// reports ready only while every model it tried to load (at start, through the repository
    /// API, a POLL pass or fleet placement) is READY; without it, once start-up loading is done.
    pub fn with_strict_readiness(mut self, strict: bool) -> Self {
        self.strict_readiness = strict;
        self
    }

    /// Gives the repository a response cache of `bytes` (Triton's `--cache-config
    /// local,size=BYTES`); `None` leaves it without one.
    pub fn with_response_cache(mut self, bytes: Option<usize>) -> Self {
        self.cache = bytes.map(|b| Arc::new(ResponseCache::new(b)));
        self
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn options(&self) -> &RepositoryOptions {
        &self.options
    }

    /// Those of `names` whose config in the repository declares an ensemble.
    pub fn ensembles_among<'a>(&self, names: impl IntoIterator<Item = &'a String>) -> BTreeSet<String> {
        let on_disk = scan_models(&self.options.paths);
        let config_name = self.options.config_name.as_deref();
        names
            .into_iter()
            .filter(|n| on_disk.get(*n).is_some_and(|dir| load::declares_ensemble(dir, config_name)))
            .cloned()
            .collect()
    }

    /// Loads what the control mode says to load at start. Returns the names that failed.
    pub async fn load_startup_models(&self) -> Vec<(String, String)> {
        let names: Vec<String> = match self.options.mode {
            ControlMode::None | ControlMode::Poll => scan_models(&self.options.paths).into_keys().collect(),
            ControlMode::Explicit => {
                if self.options.startup_models.iter().any(|m| m == "*") {
                    scan_models(&self.options.paths).into_keys().collect()
                } else {
                    self.options.startup_models.clone()
                }
            }
        };
        let mut failed = Vec::new();
        // The expensive part of a load — reading the model, creating its ONNX Runtime
        // sessions, warm-up — runs for up to `load_threads` models at once, outside the change
        // lock; each built model is put in place under the lock as soon as it is ready.
        // Ensembles are put in place last, once the models they compose are.
        let mut names = names.into_iter();
        let mut builds = tokio::task::JoinSet::new();
        let mut building: HashMap<tokio::task::Id, String> = HashMap::new();
        let mut ensembles = Vec::new();
        loop {
            while builds.len() < self.options.load_threads.max(1) {
                let Some(name) = names.next() else { break };
                if self.slot(&name).is_some() {
                    continue; // loaded (or being loaded) already
                }
                self.set_slot(&name, Slot { state: State::Loading, model: None, reload_error: None });
                let (options, metrics) = (self.options.clone(), self.metrics.clone());
                let task = name.clone();
                let id =
                    builds.spawn_blocking(move || load::load_model(&options, &task, None, None, &[], &metrics)).id();
                building.insert(id, name);
            }
            let Some(joined) = builds.join_next_with_id().await else { break };
            let (name, result) = match joined {
                Ok((id, result)) => (building.remove(&id).unwrap_or_default(), result),
                Err(e) => {
                    let name = building.remove(&e.id()).unwrap_or_default();
                    (name, Err(Status::internal(format!("model load panicked: {}", panic_message(e)))))
                }
            };
            if result.as_ref().is_ok_and(|m| m.ensemble.is_some()) {
                ensembles.push((name, result));
                continue;
            }
            if let Err(e) = self.install_built(&name, result).await {
                tracing::error!(model = %name, error = %e, "model failed to load");
                failed.push((name, e.message));
            }
        }
        ensembles.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, result) in ensembles {
            if let Err(e) = self.install_built(&name, result).await {
                tracing::error!(model = %name, error = %e, "model failed to load");
                failed.push((name, e.message));
            }
        }
        self.startup_done.store(true, Ordering::SeqCst);
        failed
    }

    /// Puts a model built at start in place, under the change lock. It was built without the
    /// versions loaded ensembles name (none is loaded before the models it composes are in
    /// place). Dropped instead when the model is READY by now (loaded as an ensemble's
    /// composing model, or through the repository API), and loaded again as a load would when
    /// something else touched it meanwhile (a failed load as a composing model) or an ensemble
    /// names versions of it after all.
    async fn install_built(&self, name: &str, result: Result<LoadedModel, Status>) -> Result<(), Status> {
        let _serial = self.changes.lock().await;
        let previous = self.slot(name);
        let placeholder = previous.as_ref().is_some_and(|s| s.state == State::Loading && s.model.is_none());
        if placeholder && self.ensemble_named_versions(name).is_empty() {
            // The placeholder is this build's own (no slot existed when it started): nothing
            // was there before it.
            return self.install_locked(name, None, None, result, &mut Vec::new()).await;
        }
        let serving = previous.as_ref().and_then(|s| s.model.clone());
        let served: Vec<i64> = serving.iter().flat_map(|m| m.versions.keys().copied()).collect();
        drop(result);
        self.metrics.retain_versions(name, &served);
        // READY by now, or unloaded on purpose while it was being built (the repository API,
        // placement): that stands.
        let stands = |s: &Slot| {
            matches!(&s.state, State::Ready | State::Unloading)
                || matches!(&s.state, State::Unavailable(reason) if reason == UNLOADED)
        };
        if previous.as_ref().is_some_and(stands) {
            return Ok(());
        }
        if placeholder {
            self.slots.write().unwrap_or_else(|e| e.into_inner()).remove(name);
        }
        self.load_locked(name, None, None, Vec::new(), &mut Vec::new()).await
    }

    /// How many model builds loads have started outside start-up (the repository API, POLL,
    /// placement; rebuilds included): for diagnostics and tests.
    pub fn builds_started(&self) -> u64 {
        self.builds_started.load(Ordering::Relaxed)
    }

    /// Stops answering ready; requests already admitted still run.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Live and done loading at start, not draining and, under strict readiness, no model that
    /// should serve failing to (see [`not_ready_models`](Self::not_ready_models)).
    pub fn server_ready(&self) -> bool {
        self.startup_done.load(Ordering::SeqCst)
            && !self.draining.load(Ordering::SeqCst)
            && (!self.strict_readiness || self.not_ready_models().is_empty())
    }

    /// Models this repository tried to load that do not serve now: a failed load, or one
    /// still loading for the first time. Models unloaded on purpose (repository API, removed
    /// from disk under POLL, placement) or being unloaded are not counted, nor is a model whose
    /// reload failed or is under way while its previous version keeps serving. With nothing
    /// tried (EXPLICIT mode, no --load-model) the list is empty. Sorted.
    pub fn not_ready_models(&self) -> Vec<String> {
        // A copy: an ensemble's check below reads the slots again.
        let slots = self.slots.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut out: Vec<String> = slots
            .iter()
            .filter(|(_, slot)| match &slot.state {
                // Loaded, but an ensemble whose composing model is gone serves nothing.
                _ if slot.model.as_ref().is_some_and(|m| self.missing_step(m).is_some()) => true,
                _ if slot.model.is_some() => false,
                State::Ready | State::Unloading => false,
                State::Unavailable(reason) => reason != UNLOADED,
                State::Loading => true,
            })
            .map(|(name, _)| name.clone())
            .collect();
        out.sort();
        out
    }

    fn slot(&self, name: &str) -> Option<Slot> {
        self.slots.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    fn set_slot(&self, name: &str, slot: Slot) {
        self.slots.write().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), slot);
    }

    /// The serving model, or NOT_FOUND / UNAVAILABLE naming why not.
    fn model(&self, name: &str) -> Result<Arc<LoadedModel>, Status> {
        match self.slot(name) {
            Some(Slot { model: Some(m), .. }) => Ok(m),
            Some(Slot { state, .. }) => Err(Status::unavailable(format!(
                "model '{name}' is not ready ({}{})",
                state.name(),
                match &state {
                    State::Unavailable(r) => format!(": {r}"),
                    _ => String::new(),
                }
            ))),
            None => Err(Status::not_found(format!("unknown model '{name}'"))),
        }
    }

    fn version(&self, model: &LoadedModel, version: Option<i64>) -> Result<Arc<ModelVersion>, Status> {
        match version {
            None => model
                .versions
                .values()
                .next_back()
                .cloned()
                .ok_or_else(|| Status::unavailable(format!("model '{}' has no ready version", model.name))),
            Some(v) => model.versions.get(&v).cloned().ok_or_else(|| {
                Status::not_found(format!(
                    "model '{}' has no version {v} (ready versions: {})",
                    model.name,
                    model.versions.keys().map(|v| v.to_string()).collect::<Vec<_>>().join(", ")
                ))
            }),
        }
    }

    pub fn model_ready(&self, name: &str, version: Option<i64>) -> bool {
        self.model(name)
            .and_then(|m| self.version(&m, version).map(|_| m))
            .is_ok_and(|m| self.missing_step(&m).is_none())
    }

    /// For an ensemble, why one of its steps cannot run now (a composing model unloaded or
    /// failed since the ensemble loaded, nested ensembles included), else `None`: such an
    /// ensemble is not ready (it answers every request with the step's error), as in Triton.
    fn missing_step(&self, model: &LoadedModel) -> Option<String> {
        self.missing_step_at(model, 0)
    }

    fn missing_step_at(&self, model: &LoadedModel, depth: usize) -> Option<String> {
        let plan = model.ensemble.as_ref()?;
        if depth >= ensemble::MAX_DEPTH {
            return Some(format!("ensembles nested more than {} deep", ensemble::MAX_DEPTH));
        }
        let missing = plan.steps.iter().find_map(|step| {
            let composing = match self.model(&step.model).and_then(|m| self.version(&m, step.version).map(|_| m)) {
                Ok(composing) => composing,
                Err(e) => return Some(format!("composing model '{}': {}", step.model, e.message)),
            };
            let why = self.missing_step_at(&composing, depth + 1)?;
            Some(format!("composing model '{}': {why}", step.model))
        });
        if missing.is_some() {
            return missing;
        }
        self.unfit_steps(&model.config, plan)
    }

    /// Why an ensemble's steps no longer fit its composing models as loaded now (one was
    /// reloaded with other tensors since the ensemble loaded; Triton reloads the ensemble then,
    /// and it fails to load), else `None` — also when a composing model is gone, which the
    /// step that needs it reports.
    fn unfit_steps(&self, config: &ModelConfig, plan: &Plan) -> Option<String> {
        let present = |step: &ensemble::Step| {
            self.model(&step.model).and_then(|m| self.version(&m, step.version).map(|_| ())).is_ok()
        };
        if !plan.steps.iter().all(present) {
            return None;
        }
        ensemble::check_composing(config, plan, |step| {
            let composing = self.model(&step.model).map_err(|e| e.message)?;
            self.version(&composing, step.version).map_err(|e| e.message)?;
            Ok(composing.spec.clone())
        })
        .err()
        .map(|e| format!("a composing model no longer fits the ensemble: {e}"))
    }

    pub fn model_metadata(&self, name: &str, version: Option<i64>) -> Result<ModelMetadata, Status> {
        let model = self.model(name)?;
        let versions = match version {
            Some(v) => vec![self.version(&model, Some(v))?.version.to_string()],
            None => model.versions.keys().map(|v| v.to_string()).collect(),
        };
        let batch = model.spec.max_batch_size > 0;
        let tensors = |specs: &[crate::backend::TensorSpec]| {
            specs
                .iter()
                .map(|t| TensorMetadata {
                    name: t.name.clone(),
                    datatype: t.datatype.wire_name().to_string(),
                    shape: if batch {
                        std::iter::once(-1).chain(t.dims.iter().copied()).collect()
                    } else {
                        t.dims.clone()
                    },
                })
                .collect()
        };
        Ok(ModelMetadata {
            name: model.name.clone(),
            versions,
            platform: if model.ensemble.is_some() { "ensemble" } else { "onnxruntime_onnx" }.to_string(),
            inputs: tensors(&model.spec.inputs),
            outputs: tensors(&model.spec.outputs),
        })
    }

    pub fn model_config(&self, name: &str, version: Option<i64>) -> Result<ModelConfig, Status> {
        let model = self.model(name)?;
        if version.is_some() {
            self.version(&model, version)?;
        }
        Ok((*model.config).clone())
    }

    pub fn model_statistics(&self, name: Option<&str>, version: Option<i64>) -> Result<Vec<ModelStats>, Status> {
        match name {
            Some(name) => {
                let model = self.model(name)?;
                match version {
                    Some(v) => Ok(vec![self.version(&model, Some(v))?.stats.snapshot()]),
                    None => Ok(model.versions.values().map(|v| v.stats.snapshot()).collect()),
                }
            }
            None => {
                let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
                let mut out: Vec<ModelStats> = slots
                    .values()
                    .filter_map(|s| s.model.as_ref())
                    .flat_map(|m| m.versions.values().map(|v| v.stats.snapshot()))
                    .collect();
                out.sort_by(|a, b| (&a.name, &a.version).cmp(&(&b.name, &b.version)));
                Ok(out)
            }
        }
    }

    /// Validates, queues and awaits one request. Dropping the future cancels it.
    pub async fn infer(&self, request: InferRequest) -> Result<InferResponse, Status> {
        self.infer_at(request, 0).await
    }

    /// [`infer`](Self::infer) for a request `depth` ensembles deep.
    async fn infer_at(&self, request: InferRequest, depth: usize) -> Result<InferResponse, Status> {
        let started = Instant::now();
        let model = self.model(&request.model_name)?;
        self.infer_on(model, request, depth, started).await
    }

    /// [`infer_at`](Self::infer_at) on `model`, already looked up (an ensemble's steps run on
    /// the composing models it looked up when the request began).
    async fn infer_on(
        &self,
        model: Arc<LoadedModel>,
        mut request: InferRequest,
        depth: usize,
        started: Instant,
    ) -> Result<InferResponse, Status> {
        let version = self.version(&model, request.model_version)?;
        // Counted exactly once: here when the request finishes, or by the guard when the
        // caller drops this future (client disconnect, gateway cancel) at any point.
        let mut counted = CancelGuard { stats: &version.stats, started, armed: true };
        let stats = &version.stats;
        // An ensemble whose steps no longer fit its composing models is not ready: refused as
        // such rather than run into a step that fails (or, worse, does not). A composing model
        // that is gone fails in its step, naming it.
        if let Some(plan) = &model.ensemble {
            // Read before the check: a load or unload after it moves the epoch on.
            let epoch = self.epoch.load(Ordering::SeqCst);
            if model.steps_fit_at.load(Ordering::Relaxed) != epoch {
                if let Some(why) = self.unfit_steps(&model.config, plan) {
                    counted.armed = false;
                    let status = Status::unavailable(format!("model '{}' is not ready: {why}", model.name));
                    stats.record_failure(started.elapsed(), status.code.reason());
                    return Err(status);
                }
                model.steps_fit_at.store(epoch, Ordering::Relaxed);
            }
        }
        if let Err(status) = check_classification(&model, &request) {
            counted.armed = false;
            stats.record_failure(started.elapsed(), status.code.reason());
            return Err(status);
        }
        // The response cache, for a model that enables it: an identical earlier request's
        // answer is returned without running anything.
        let cached = match self.cache.as_ref().filter(|_| model.cache_enabled) {
            None => None,
            Some(cache) => {
                let lookup = Instant::now();
                // An ensemble's answer also depends on its composing models: any load or unload
                // since (the repository's epoch) makes its old responses unusable.
                let epoch = if model.ensemble.is_some() { self.epoch.load(Ordering::SeqCst) } else { 0 };
                let generations = [model.generation, epoch];
                let bytes: usize = request.inputs.iter().map(|i| i.data.len()).sum();
                let key = if bytes <= CACHE_INLINE_BYTES {
                    Some(cache.key(&request, &model.name, version.version, generations))
                } else {
                    // Hashing a large request takes milliseconds: off the I/O threads (the
                    // tensors are shared, not copied).
                    let keyed = InferRequest {
                        inputs: request.inputs.clone(),
                        outputs: request.outputs.clone(),
                        ..Default::default()
                    };
                    let (cache, name, v) = (cache.clone(), model.name.clone(), version.version);
                    tokio::task::spawn_blocking(move || cache.key(&keyed, &name, v, generations)).await.ok()
                };
                // (A key that could not be computed: served as if the model did not cache.)
                key.map(|key| (cache, key, cache.get(key), lookup.elapsed()))
            }
        };
        if let Some((_, _, Some(outputs), lookup)) = &cached {
            let outcome = classified(&model, &request.outputs, outputs.as_ref().clone()).await;
            let outcome = write_shm_outputs(outcome, std::mem::take(&mut request.shm_outputs)).await;
            counted.armed = false;
            let elapsed = started.elapsed();
            return answered(request, version.version, outcome, stats, elapsed, || {
                stats.record_cache_hit(*lookup, elapsed)
            });
        }
        // A client's request holds its inputs' place in the memory budget until answered; an
        // ensemble's steps take none of their own (their tensors are the ensemble's, or its
        // intermediates): counted per step, a fan-out would count one tensor thrice, and an
        // ensemble could be refused by its own steps.
        let ensemble_budget = match &version.executor {
            Executor::Ensemble { .. } if depth == 0 => Some(self.budget.reserve(request_weight(&request))),
            _ => None,
        };
        let outcome = match &version.executor {
            _ if let Some(Err(refused)) = &ensemble_budget => Err(refused.clone()),
            Executor::Scheduler(scheduler) => {
                run(&model.spec, scheduler, (depth == 0).then_some(&self.budget), &mut request).await
            }
            // Over max_inflight_requests, a request waits for its turn (bounded by its
            // deadline) before its first step.
            Executor::Ensemble { plan, inflight: None } => {
                self.run_ensemble(&model, &version, plan, &mut request, depth).await
            }
            Executor::Ensemble { plan, inflight: Some(limit) } => {
                let waited = Instant::now();
                match acquire_before(limit, wait_limit(&request)).await {
                    Ok(_permit) => {
                        // The ensemble's queue: the wait for its turn.
                        let queued = waited.elapsed();
                        let mut answer = self.run_ensemble(&model, &version, plan, &mut request, depth).await;
                        if let Ok(a) = &mut answer {
                            a.figures.queue = queued;
                        }
                        answer
                    }
                    Err(e) => Err(e),
                }
            }
        };
        drop(ensemble_budget);
        // Counted only if the request succeeds (below); its batch's execution after that, when
        // `_execution` (and the batch's other answers) are dropped.
        let (outcome, figures, _execution) = match outcome {
            Ok(answer) => (Ok(answer.outputs), answer.figures, answer.execution),
            Err(e) => (Err(e), RunFigures::default(), None),
        };
        let mut cache_miss = None;
        if let (Some((cache, key, None, lookup)), Ok(outputs)) = (&cached, &outcome) {
            let insert = Instant::now();
            if outputs.iter().map(|o| o.data.len()).sum::<usize>() <= CACHE_INLINE_BYTES {
                cache.insert(*key, outputs);
            } else {
                // Its copy of a large response, likewise off the I/O threads.
                let (cache, key, outputs) = ((*cache).clone(), *key, outputs.clone());
                let _ = tokio::task::spawn_blocking(move || cache.insert(key, &outputs)).await;
            }
            // Counted with the request's success (below), as Triton counts a miss.
            cache_miss = Some(*lookup + insert.elapsed());
        }
        // The classification extension reshapes what the model answered (the cache keeps the
        // answer itself).
        let outcome = match outcome {
            Ok(outputs) => classified(&model, &request.outputs, outputs).await,
            Err(e) => Err(e),
        };
        let outcome = write_shm_outputs(outcome, std::mem::take(&mut request.shm_outputs)).await;
        counted.armed = false;
        // The request's time includes the cache insert and the shared-memory writes, as
        // Triton's does.
        let elapsed = started.elapsed();
        answered(request, version.version, outcome, stats, elapsed, || {
            if let Some(miss) = cache_miss {
                stats.record_cache_miss(miss);
            }
            stats.record_ran(&figures);
            stats.record_success(elapsed)
        })
    }

    /// Runs an ensemble's steps, wave by wave (the steps of a wave concurrently), each as a
    /// request to its composing model carrying the caller's priority, timeout and deadline.
    /// A step's failure fails the request with the step's code, naming the step. A success
    /// counts as one execution of the request's rows in the ensemble's statistics (as
    /// Triton's), the steps' time being in their own models' figures.
    async fn run_ensemble(
        &self,
        model: &LoadedModel,
        version: &ModelVersion,
        plan: &Plan,
        request: &mut InferRequest,
        depth: usize,
    ) -> Result<Answer, Status> {
        if depth >= ensemble::MAX_DEPTH {
            return Err(Status::invalid(format!(
                "ensemble '{}' is nested more than {} deep (do its steps form a cycle?)",
                model.name,
                ensemble::MAX_DEPTH
            )));
        }
        let v = validate(&model.spec, request)?;
        let rows = v.rows;
        let mut tensors: HashMap<String, crate::tensor::InputTensor> = HashMap::new();
        for (spec, (shape, data)) in model.spec.inputs.iter().zip(v.inputs).filter_map(|(s, i)| Some((s, i?))) {
            tensors.insert(
                spec.name.clone(),
                crate::tensor::InputTensor { name: spec.name.clone(), datatype: spec.datatype, shape, data },
            );
        }
        // Only the steps the outputs asked for need (Triton's pruning).
        let wanted: Vec<&str> =
            model.spec.outputs.iter().zip(&v.wanted).filter(|(_, w)| **w).map(|(o, _)| o.name.as_str()).collect();
        let needed = plan.needed_steps(&wanted);
        // The composing models are looked up once, now: a request that has begun runs every
        // step on them (holding them loaded until it ends), not into a model unloaded — or
        // reloaded with other tensors — between two of its steps. One that is not there now
        // fails the request before any step runs, naming it.
        let mut composing: HashMap<&str, Arc<LoadedModel>> = HashMap::new();
        for (i, step) in plan.steps.iter().enumerate().filter(|(i, _)| needed[*i]) {
            if !composing.contains_key(step.model.as_str()) {
                let found = self.model(&step.model).map_err(|e| {
                    Status::new(
                        e.code,
                        nereid_common::status::ensemble_step_message(&model.name, i, &step.model, &e.message),
                    )
                })?;
                composing.insert(step.model.as_str(), found);
            }
        }
        // The last wave reading each tensor: an intermediate is dropped after it (a long
        // pipeline holds no more than what is still to be read).
        let mut last_read: HashMap<&str, usize> = HashMap::new();
        for (w, wave) in plan.waves.iter().enumerate() {
            for &i in wave.iter().filter(|&&i| needed[i]) {
                for (_, tensor) in &plan.steps[i].inputs {
                    last_read.insert(tensor.as_str(), w);
                }
            }
        }
        for (w, wave) in plan.waves.iter().enumerate() {
            let calls = wave.iter().filter(|&&i| needed[i]).map(|&i| {
                let step = &plan.steps[i];
                let sub = InferRequest {
                    model_name: step.model.clone(),
                    model_version: step.version,
                    id: request.id.clone(),
                    // Every tensor a step reads exists by now (the plan orders the waves);
                    // one that does not is an internal error, not a panic.
                    inputs: step
                        .inputs
                        .iter()
                        .filter_map(|(input, tensor)| {
                            tensors.get(tensor).map(|t| crate::tensor::InputTensor { name: input.clone(), ..t.clone() })
                        })
                        .collect(),
                    outputs: step
                        .outputs
                        .iter()
                        .map(|(output, _)| crate::tensor::RequestedOutput {
                            name: output.clone(),
                            ..Default::default()
                        })
                        .collect(),
                    priority: request.priority,
                    timeout_us: request.timeout_us,
                    deadline: request.deadline,
                    shm_outputs: Vec::new(),
                };
                let on = composing.get(step.model.as_str()).cloned();
                async move {
                    let answer = match on {
                        Some(on) => Box::pin(self.infer_on(on, sub, depth + 1, Instant::now())).await,
                        None => Box::pin(self.infer_at(sub, depth + 1)).await,
                    };
                    let answer = answer.map_err(|e| {
                        Status::new(
                            e.code,
                            nereid_common::status::ensemble_step_message(&model.name, i, &step.model, &e.message),
                        )
                    })?;
                    Ok::<_, Status>((i, answer))
                }
            });
            // Every step of the wave runs to its end even when one fails (as Triton's ensemble
            // scheduler lets steps in flight finish): dropped, a sibling would count as a
            // CANCELED failure of its model that no client caused.
            let answers = futures::future::join_all(calls).await.into_iter().collect::<Result<Vec<_>, Status>>()?;
            tensors.retain(|name, _| {
                last_read.get(name.as_str()).is_some_and(|&last| last > w)
                    || model.spec.outputs.iter().any(|o| &o.name == name)
            });
            for (i, answer) in answers {
                for out in answer.outputs {
                    let Some((_, tensor)) = plan.steps[i].outputs.iter().find(|(o, _)| *o == out.name) else {
                        continue;
                    };
                    tensors.insert(
                        tensor.clone(),
                        crate::tensor::InputTensor {
                            name: tensor.clone(),
                            datatype: out.datatype,
                            shape: out.shape,
                            data: out.data,
                        },
                    );
                }
            }
        }
        let mut outputs = Vec::new();
        for (spec, wanted) in model.spec.outputs.iter().zip(&v.wanted) {
            if !wanted {
                continue;
            }
            let t = tensors.remove(&spec.name).ok_or_else(|| {
                Status::internal(format!("ensemble '{}': no step produced output '{}'", model.name, spec.name))
            })?;
            if t.datatype != spec.datatype {
                return Err(Status::internal(format!(
                    "ensemble '{}': output '{}' came back as {}, but the config declares {}",
                    model.name, spec.name, t.datatype, spec.datatype
                )));
            }
            outputs.push(crate::tensor::OutputTensor {
                name: spec.name.clone(),
                datatype: t.datatype,
                shape: t.shape,
                data: t.data,
            });
        }
        // Its rows count as inferences (and it counts in the queue figures) once the request
        // has succeeded, then its execution; its steps' time is in their own models' figures.
        let execution = Execution::new(version.stats.clone(), rows, Duration::ZERO, Duration::ZERO, Duration::ZERO);
        Ok(Answer { outputs, figures: RunFigures { rows, ..RunFigures::default() }, execution: Some(execution) })
    }

    /// Loads or reloads `name`. `config` (JSON) overrides the repository's config.pbtxt.
    pub async fn load(&self, name: &str, config: Option<String>) -> Result<(), Status> {
        if self.options.mode != ControlMode::Explicit {
            return Err(Status::new(
                Code::FailedPrecondition,
                "explicit model load / unload is only allowed with --model-control-mode=explicit",
            ));
        }
        self.load_inner(name, config, None).await
    }

    /// Loads (or reloads) exactly `versions` of `name`, whatever the control mode and the
    /// config's version policy: what etcd placement assigned to this worker.
    pub async fn load_versions(&self, name: &str, versions: Vec<i64>) -> Result<(), Status> {
        self.load_inner(name, None, Some(versions)).await
    }

    /// Unloads `name` whatever the control mode (etcd placement removed it from this worker).
    /// A model a loaded ensemble composes stays: placement does not know about ensembles, and
    /// taking it away would break one this worker serves.
    pub async fn unload_placed(&self, name: &str) -> Result<(), Status> {
        if let Unloaded::Kept(user) = self.unload_inner(name, Some(&[])).await? {
            tracing::info!(model = %name, ensemble = %user, "placement: kept, a loaded ensemble composes it");
        }
        Ok(())
    }

    /// The models the loaded ensemble `name` has a step on (none if it is not a loaded
    /// ensemble).
    pub fn composing_models(&self, name: &str) -> Vec<String> {
        let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
        let plan = slots.get(name).and_then(|s| s.model.as_ref()).and_then(|m| m.ensemble.as_ref());
        plan.map(|p| p.models().into_iter().map(str::to_string).collect()).unwrap_or_default()
    }

    /// The loaded ensembles with a step on `name`, by name.
    pub fn ensembles_composing(&self, name: &str) -> Vec<String> {
        self.ensembles_using(name, &[])
    }

    /// Loaded ensembles (other than those in `except`) with a step on `name`.
    fn ensembles_using(&self, name: &str, except: &[String]) -> Vec<String> {
        let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<String> = slots
            .iter()
            .filter(|(n, _)| !except.contains(n))
            .filter(|(_, s)| {
                s.model.as_ref().and_then(|m| m.ensemble.as_ref()).is_some_and(|p| p.models().contains(&name))
            })
            .map(|(n, _)| n.clone())
            .collect();
        out.sort();
        out
    }

    pub async fn unload(&self, name: &str) -> Result<(), Status> {
        self.unload_with(name, false).await
    }

    /// Unloads `name`; with `dependents` (Triton's `unload_dependents`), an ensemble's
    /// composing models too, nested ensembles' included.
    pub async fn unload_with(&self, name: &str, dependents: bool) -> Result<(), Status> {
        if self.options.mode != ControlMode::Explicit {
            return Err(Status::new(
                Code::FailedPrecondition,
                "explicit model load / unload is only allowed with --model-control-mode=explicit",
            ));
        }
        let mut pending = vec![name.to_string()];
        let mut done: Vec<String> = Vec::new();
        while let Some(next) = pending.pop() {
            if done.contains(&next) {
                continue;
            }
            // A composing model another loaded ensemble still uses stays (decided under the
            // change lock: an ensemble that finishes loading meanwhile counts).
            let keep = (next != name).then_some(&done[..]);
            let unloaded = match self.unload_inner(&next, keep).await {
                Ok(unloaded) => unloaded,
                Err(e) if next == name => return Err(e),
                Err(e) => {
                    tracing::warn!(model = %next, error = %e, "could not unload a composing model");
                    Unloaded::Removed(None)
                }
            };
            // The composing models of the ensemble actually removed: a load still running when
            // the unload was asked for has finished by now, and may have changed its steps.
            if dependents
                && let Unloaded::Removed(Some(model)) = &unloaded
                && let Some(plan) = &model.ensemble
            {
                pending.extend(plan.models().into_iter().map(str::to_string));
            }
            done.push(next);
        }
        Ok(())
    }

    /// Waits for `name`'s turn (see [`Repository::turns`]) and holds it until the guard drops.
    async fn turn(&self, name: &str) -> Turn<'_> {
        let lock = self.turns.lock().unwrap_or_else(|e| e.into_inner()).entry(name.to_string()).or_default().clone();
        let guard = lock.clone().lock_owned().await;
        Turn { turns: &self.turns, name: name.to_string(), lock, guard: Some(guard) }
    }

    /// Loads (or reloads) `name` in its turn. The model is built — files read, ONNX Runtime
    /// sessions created, warm-up run — outside the change lock, up to `load_threads` models at
    /// once, so loads of different models proceed side by side and nothing else waits on a
    /// slow one; it is put in place under the lock. Should another change have touched the
    /// model meanwhile (an ensemble loading it as a composing model, or naming other versions
    /// of it), it is built again under the lock, as that change left it.
    async fn load_inner(
        &self,
        name: &str,
        config_override: Option<String>,
        versions: Option<Vec<i64>>,
    ) -> Result<(), Status> {
        let request = (config_override.clone(), versions.clone());
        // An identical load still waiting for its turn reads the files when it starts, as this
        // one would: its result is this one's.
        let joined = {
            let queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
            queued.get(name).filter(|q| q.request == request).map(|q| q.done.clone())
        };
        if let Some(mut done) = joined
            && let Ok(result) = done.wait_for(Option::is_some).await
        {
            return result.clone().expect("waited for a result");
        }
        // (A joined load dropped before it finished leaves this one to run.)
        let (tx, rx) = tokio::sync::watch::channel(None);
        let id = self.queued_ids.fetch_add(1, Ordering::Relaxed);
        let unqueue = {
            let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
            (!queued.contains_key(name)).then(|| {
                queued.insert(name.to_string(), Queued { request, id, done: rx });
                Unqueue { queued: &self.queued, name, id }
            })
        };
        let result = self.load_in_turn(name, config_override, versions, unqueue).await;
        let _ = tx.send(Some(result.clone()));
        result
    }

    /// [`Self::load_inner`] once queued: takes the model's turn (then the load no longer
    /// answers for requests arriving after it, `unqueue`), builds, puts in place.
    async fn load_in_turn(
        &self,
        name: &str,
        config_override: Option<String>,
        versions: Option<Vec<i64>>,
        unqueue: Option<Unqueue<'_>>,
    ) -> Result<(), Status> {
        let _turn = self.turn(name).await;
        drop(unqueue);
        let permit = self.builds.acquire().await.expect("the build semaphore is never closed");
        let (previous, serving, also) = {
            let _serial = self.changes.lock().await;
            let previous = self.slot(name);
            let serving = previous.as_ref().and_then(|s| s.model.clone());
            self.set_slot(name, Slot { state: State::Loading, model: serving.clone(), reload_error: None });
            (previous, serving, self.ensemble_named_versions(name))
        };
        let (options, metrics) = (self.options.clone(), self.metrics.clone());
        let (task, config, wanted, named) = (name.to_string(), config_override.clone(), versions.clone(), also.clone());
        self.builds_started.fetch_add(1, Ordering::Relaxed);
        let result = tokio::task::spawn_blocking(move || {
            load::load_model(&options, &task, config, wanted.as_deref(), &named, &metrics)
        })
        .await
        .unwrap_or_else(|e| Err(Status::internal(format!("model load panicked: {}", panic_message(e)))));
        drop(permit);
        let _serial = self.changes.lock().await;
        let now = self.slot(name).and_then(|s| s.model);
        let untouched = match (&now, &serving) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        if !untouched || self.ensemble_named_versions(name) != also {
            tracing::info!(model = %name, "changed while it was being built; building it again");
            drop(result);
            return self.load_locked(name, config_override, versions, Vec::new(), &mut Vec::new()).await;
        }
        self.install_locked(name, previous, serving, result, &mut Vec::new()).await
    }

    /// Loads `name` with the change lock held. An ensemble first loads those of its composing
    /// models that are not ready (as Triton does), then is checked against them; `loading`
    /// holds the ensembles being loaded above this one, to refuse a cycle.
    fn load_locked<'a>(
        &'a self,
        name: &'a str,
        config_override: Option<String>,
        versions: Option<Vec<i64>>,
        mut also: Vec<i64>,
        loading: &'a mut Vec<String>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), Status>> + Send + 'a>> {
        // Whatever the version policy or placement says, keep the versions that loaded
        // ensembles' steps name.
        also.extend(self.ensemble_named_versions(name));
        Box::pin(async move {
            let previous = self.slot(name);
            let serving = previous.as_ref().and_then(|s| s.model.clone());
            self.set_slot(name, Slot { state: State::Loading, model: serving.clone(), reload_error: None });
            let options = self.options.clone();
            let owned_name = name.to_string();
            let metrics = self.metrics.clone();
            self.builds_started.fetch_add(1, Ordering::Relaxed);
            let result = tokio::task::spawn_blocking(move || {
                load::load_model(&options, &owned_name, config_override, versions.as_deref(), &also, &metrics)
            })
            .await
            .unwrap_or_else(|e| Err(Status::internal(format!("model load panicked: {}", panic_message(e)))));
            self.install_locked(name, previous, serving, result, loading).await
        })
    }

    /// Puts a built model in place (the change lock held): an ensemble first gets its composing
    /// models loaded and is checked against them.
    async fn install_locked(
        &self,
        name: &str,
        previous: Option<Slot>,
        serving: Option<Arc<LoadedModel>>,
        mut result: Result<LoadedModel, Status>,
        loading: &mut Vec<String>,
    ) -> Result<(), Status> {
        if let Ok(model) = &mut result
            && model.cache_enabled
            && self.cache.is_none()
        {
            model.cache_enabled = false;
            model.warnings.push(
                "response_cache.enable is set but the worker has no response cache (--cache-config \
                 local,size=BYTES): responses are not cached"
                    .into(),
            );
        }
        if let Ok(model) = &result
            && let Some(plan) = &model.ensemble
        {
            loading.push(name.to_string());
            let composed = self.prepare_composing(&model.config, plan, loading).await;
            loading.pop();
            if let Err(e) = composed {
                result = Err(e);
            }
        }
        self.finish_load(name, previous, serving, result)
    }

    /// Loads an ensemble's composing models that are not ready (and, for a composing ensemble
    /// already loaded, what it needs in turn), then checks the ensemble's tensors against them.
    async fn prepare_composing(
        &self,
        config: &ModelConfig,
        plan: &Plan,
        loading: &mut Vec<String>,
    ) -> Result<(), Status> {
        for composing in plan.models() {
            if loading.iter().any(|l| l == composing) {
                return Err(Status::invalid(format!("ensembles form a cycle: {} → {composing}", loading.join(" → "))));
            }
            match self.model(composing) {
                Ok(loaded) => {
                    if let Some(inner) = &loaded.ensemble {
                        loading.push(composing.to_string());
                        let ready = Box::pin(self.prepare_composing(&loaded.config, inner, loading)).await;
                        loading.pop();
                        ready
                            .map_err(|e| Status::invalid(format!("composing ensemble '{composing}': {}", e.message)))?;
                    }
                }
                Err(_) => {
                    let named = ensemble_named_versions([plan], composing);
                    self.load_locked(composing, None, None, named, loading).await.map_err(|e| {
                        Status::invalid(format!("composing model '{composing}' could not be loaded: {}", e.message))
                    })?;
                }
            }
            // A step may name a version the composing model does not serve (its version policy,
            // or its placement, chose others): load it beside them when it exists on disk.
            if let Ok(loaded) = self.model(composing)
                && loaded.ensemble.is_none()
            {
                let on_disk =
                    scan_models(&self.options.paths).get(composing).map(|d| load::version_dirs(d)).unwrap_or_default();
                let missing: Vec<i64> = ensemble_named_versions([plan], composing)
                    .into_iter()
                    .filter(|v| !loaded.versions.contains_key(v) && on_disk.contains(v))
                    .collect();
                if !missing.is_empty() {
                    tracing::info!(model = %composing, ?missing, "loading the versions an ensemble's steps name");
                    let held = loaded.versions.keys().copied().collect();
                    // The config it serves with now (a load request's override included), not
                    // the one on disk.
                    let config = nereid_common::config::config_to_json(&loaded.config).to_string();
                    self.load_locked(composing, Some(config), Some(held), missing, loading).await.map_err(|e| {
                        Status::invalid(format!("composing model '{composing}' could not be loaded: {}", e.message))
                    })?;
                }
            }
        }
        ensemble::check_composing(config, plan, |step| {
            let model = self.model(&step.model).map_err(|e| e.message)?;
            self.version(&model, step.version).map_err(|e| e.message)?;
            Ok(model.spec.clone())
        })
        .map_err(|e| Status::invalid(format!("config: {e}")))
    }

    /// Versions of `name` that the loaded ensembles' steps name explicitly.
    fn ensemble_named_versions(&self, name: &str) -> Vec<i64> {
        let plans: Vec<Arc<Plan>> = {
            let slots = self.slots.read().unwrap_or_else(|e| e.into_inner());
            slots.values().filter_map(|s| s.model.as_ref().and_then(|m| m.ensemble.clone())).collect()
        };
        ensemble_named_versions(plans.iter().map(|p| p.as_ref()), name)
    }

    /// Swaps a loaded model in, or records why the load failed.
    fn finish_load(
        &self,
        name: &str,
        previous: Option<Slot>,
        serving: Option<Arc<LoadedModel>>,
        result: Result<LoadedModel, Status>,
    ) -> Result<(), Status> {
        match result {
            Ok(model) => {
                for w in &model.warnings {
                    tracing::warn!(model = %name, "{w}");
                }
                let model = Arc::new(model);
                let dropped: Vec<i64> = serving
                    .iter()
                    .flat_map(|old| old.versions.keys().copied())
                    .filter(|v| !model.versions.contains_key(v))
                    .collect();
                self.set_slot(name, Slot { state: State::Ready, model: Some(model), reload_error: None });
                self.epoch.fetch_add(1, Ordering::SeqCst);
                for v in dropped {
                    self.metrics.remove(name, v);
                }
                tracing::info!(model = %name, "model ready");
                Ok(())
            }
            Err(status) => {
                // Series a failed load created for versions that never served go again.
                let served: Vec<i64> = serving.iter().flat_map(|m| m.versions.keys().copied()).collect();
                self.metrics.retain_versions(name, &served);
                // A failed reload keeps the old model serving; a failed first load is UNAVAILABLE.
                let state = if serving.is_some() { State::Ready } else { State::Unavailable(status.message.clone()) };
                if serving.is_some() {
                    tracing::error!(model = %name, error = %status, "reload failed; the previous model keeps serving");
                }
                if status.code == Code::NotFound && previous.is_none() {
                    // Nothing by that name exists: leave no trace in the index.
                    self.slots.write().unwrap_or_else(|e| e.into_inner()).remove(name);
                } else {
                    let reload_error = serving.is_some().then(|| format!("reload failed: {}", status.message));
                    self.set_slot(name, Slot { state, model: serving, reload_error });
                }
                Err(Status::new(
                    if status.code == Code::NotFound { Code::NotFound } else { Code::InvalidArgument },
                    format!("failed to load '{name}': {}", status.message),
                ))
            }
        }
    }

    /// Unloads `name` in its turn. `keep_if_composed`: unless a loaded ensemble (other than
    /// those listed) has a step on it, checked under the change lock, where ensembles are
    /// installed — not before waiting for the turn, when one still loading would be missed.
    async fn unload_inner(&self, name: &str, keep_if_composed: Option<&[String]>) -> Result<Unloaded, Status> {
        // A load queued before this unload no longer answers for loads arriving after it:
        // those must run after the unload, not share a result that the unload then undoes.
        self.queued.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        let _turn = self.turn(name).await;
        let _serial = self.changes.lock().await;
        if let Some(except) = keep_if_composed
            && let Some(user) = self.ensembles_using(name, except).into_iter().next()
        {
            return Ok(Unloaded::Kept(user));
        }
        let Some(slot) = self.slot(name) else {
            if scan_models(&self.options.paths).contains_key(name) {
                return Ok(Unloaded::Removed(None)); // present but never loaded: nothing to do (Triton answers OK)
            }
            return Err(Status::not_found(format!("unknown model '{name}'")));
        };
        self.set_slot(name, Slot { state: State::Unloading, model: None, reload_error: None });
        if let Some(model) = &slot.model {
            for v in model.versions.keys() {
                self.metrics.remove(name, *v);
            }
            // In-flight requests hold their version; its scheduler drains once they finish.
        }
        // Noted before the slot says unloaded, so that the index never shows UNAVAILABLE in
        // between.
        if let Some(model) = &slot.model {
            let mut unloading = self.unloading.lock().unwrap_or_else(|e| e.into_inner());
            unloading.retain(|_, models| {
                models.retain(|m| m.strong_count() > 0);
                !models.is_empty()
            });
            unloading.entry(name.to_string()).or_default().push(Arc::downgrade(model));
        }
        self.set_slot(name, Slot { state: State::Unavailable(UNLOADED.into()), model: None, reload_error: None });
        self.epoch.fetch_add(1, Ordering::SeqCst);
        tracing::info!(model = %name, "model unloaded");
        Ok(Unloaded::Removed(slot.model))
    }

    /// Every model in the repository and every loaded one, with its state.
    pub fn index(&self, ready_only: bool) -> Vec<IndexEntry> {
        let on_disk = scan_models(&self.options.paths);
        let mut out = self.index_of(on_disk.keys());
        if ready_only {
            out.retain(|e| e.state == "READY");
        }
        out
    }

    /// The index rows of the models this repository holds state for (loaded, loading, failed
    /// or unloaded), without scanning the repository directories: what the etcd agent
    /// publishes as statuses, several times a second.
    pub fn held_index(&self) -> Vec<IndexEntry> {
        self.index_of(std::iter::empty())
    }

    /// Rows for `also` (models on disk) and every model with a slot, sorted by name.
    fn index_of<'a>(&self, also: impl Iterator<Item = &'a String>) -> Vec<IndexEntry> {
        let slots = self.slots.read().unwrap_or_else(|e| e.into_inner()).clone();
        let mut names: Vec<String> = also.cloned().chain(slots.keys().cloned()).collect();
        names.sort();
        names.dedup();
        let mut out = Vec::new();
        for name in &names {
            // An ensemble missing a composing model serves nothing: UNAVAILABLE, saying why.
            let missing = match slots.get(name) {
                Some(Slot { model: Some(m), .. }) => self.missing_step(m).map(|why| (m, why)),
                _ => None,
            };
            if let Some((m, why)) = missing {
                for v in m.versions.keys() {
                    out.push(IndexEntry {
                        name: name.clone(),
                        version: v.to_string(),
                        state: "UNAVAILABLE".to_string(),
                        reason: why.clone(),
                    });
                }
                continue;
            }
            match slots.get(name) {
                Some(Slot { model: Some(m), state, reload_error }) => {
                    for v in m.versions.keys() {
                        out.push(IndexEntry {
                            name: name.clone(),
                            version: v.to_string(),
                            state: State::Ready.name().to_string(),
                            // A READY row's reason carries the load's warnings (unsupported
                            // fields, skipped version folders, ...), as the config docs promise.
                            reason: match (state, reload_error) {
                                (_, Some(e)) => e.clone(),
                                (State::Ready, None) => m.warnings.join("; "),
                                (other, None) => other.name().to_string(),
                            },
                        });
                    }
                }
                // Unloaded, its last requests still running (the slot holds nothing, they hold
                // the model): UNLOADING until they finish.
                Some(Slot { state: State::Unavailable(r), model: None, .. })
                    if r == UNLOADED && self.still_unloading(name) =>
                {
                    out.push(IndexEntry {
                        name: name.clone(),
                        version: String::new(),
                        state: State::Unloading.name().to_string(),
                        reason: String::new(),
                    })
                }
                Some(Slot { state, model: None, .. }) => out.push(IndexEntry {
                    name: name.clone(),
                    version: String::new(),
                    state: state.name().to_string(),
                    reason: match state {
                        State::Unavailable(r) => r.clone(),
                        _ => String::new(),
                    },
                }),
                None => out.push(IndexEntry {
                    name: name.clone(),
                    version: String::new(),
                    state: String::new(),
                    reason: String::new(),
                }),
            }
        }
        out
    }

    /// Whether requests still run on `name`'s unloaded model.
    fn still_unloading(&self, name: &str) -> bool {
        let mut unloading = self.unloading.lock().unwrap_or_else(|e| e.into_inner());
        let Some(models) = unloading.get_mut(name) else { return false };
        models.retain(|m| m.strong_count() > 0);
        if models.is_empty() {
            unloading.remove(name);
            return false;
        }
        true
    }

    /// POLL mode: re-scan every `interval`; load new models, reload changed ones, unload
    /// removed ones. Runs until `shutdown`.
    pub async fn poll_task(self: Arc<Self>, interval: Duration, shutdown: tokio_util::sync::CancellationToken) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            self.poll_once().await;
        }
    }

    /// Loads `batch` (name, files' stamp, whether an ensemble) side by side after a repository
    /// change, remembering each stamp tried; how many loaded.
    async fn load_batch(&self, batch: Vec<(String, Stamp, bool)>) -> usize {
        let loads = batch.into_iter().map(|(name, stamp, _)| async move {
            tracing::info!(model = %name, "repository change detected; loading");
            let result = self.load_inner(&name, None, None).await;
            if let Err(e) = &result {
                tracing::error!(model = %name, error = %e, "load after repository change failed");
            }
            self.remember_stamp(&name, stamp);
            result.is_ok()
        });
        futures::future::join_all(loads).await.into_iter().filter(|ok| *ok).count()
    }

    /// One POLL pass (also used by tests).
    pub async fn poll_once(&self) {
        // The file-system walk (every model's files, through symbolic links: slow on a network
        // mount) runs off the async threads that serve requests.
        let paths = self.options.paths.clone();
        let Ok((on_disk, unlisted)) = tokio::task::spawn_blocking(move || {
            // A repository that cannot be listed now (a network mount's hiccup, a stale
            // handle) says nothing about its models. (A mount point without its mount lists
            // as empty: that is read as the models removed, as Triton reads it.)
            let (dirs, unlisted) = load::scan_model_dirs(&paths);
            // A name in several repositories (refused as ambiguous) is stamped over all of
            // them: removing the extra copies is a change that lets it load.
            let on_disk = dirs
                .into_iter()
                .filter_map(|(name, dirs)| Some((name, (Stamp::of_all(&dirs), dirs.into_iter().next()?))))
                .collect::<BTreeMap<_, _>>();
            (on_disk, unlisted)
        })
        .await
        else {
            return;
        };
        if !unlisted.is_empty() {
            tracing::warn!(
                repositories = ?unlisted,
                "poll: cannot list a model repository; models not found keep serving until it can be listed"
            );
        }
        let loaded: HashMap<String, Slot> = self.slots.read().unwrap_or_else(|e| e.into_inner()).clone();
        // Load what is new or changed, but retry a failed (re)load only once its files change
        // again.
        let mut changed = Vec::new();
        let mut failed = Vec::new();
        for (name, (stamp, dir)) in &on_disk {
            // A failed reload's files put back as they were (`cp -a`, `mv` keep the mtimes):
            // the serving model matches the disk again, and its failure is history.
            let restored =
                |slot: &Slot| slot.reload_error.is_some() && slot.model.as_ref().is_some_and(|m| m.stamp == *stamp);
            // Looked at under the read lock (every inference takes it); written only then.
            if self.slot(name).is_some_and(|slot| restored(&slot)) {
                let mut slots = self.slots.write().unwrap_or_else(|e| e.into_inner());
                if let Some(slot) = slots.get_mut(name).filter(|slot| restored(slot)) {
                    slot.reload_error = None;
                }
            }
            let needs_load = match self.slot(name).as_ref() {
                Some(Slot { model: Some(m), .. }) => m.stamp != *stamp && self.not_attempted(name, stamp),
                Some(Slot { state: State::Unavailable(_), .. }) => self.not_attempted(name, stamp),
                Some(_) => false,
                None => true,
            };
            if needs_load {
                changed.push((name.clone(), stamp.clone(), dir.clone()));
            } else if matches!(self.slot(name), Some(Slot { model: None, state: State::Unavailable(reason), .. }) if reason != UNLOADED)
            {
                // Failed, files unchanged: retried below if it is an ensemble and a model
                // loaded in this pass (the composing model it lacked may be that one).
                failed.push((name.clone(), stamp.clone(), dir.clone()));
            }
        }
        let config_name = self.options.config_name.clone();
        let Ok((changed, failed_ensembles)) = tokio::task::spawn_blocking(move || {
            let ensemble = |dir: &std::path::Path| load::declares_ensemble(dir, config_name.as_deref());
            let changed: Vec<_> = changed
                .into_iter()
                .map(|(name, stamp, dir)| {
                    let is_ensemble = ensemble(&dir);
                    (name, stamp, is_ensemble)
                })
                .collect();
            let failed: Vec<_> = failed
                .into_iter()
                .filter(|(_, _, dir)| ensemble(dir))
                .map(|(name, stamp, _)| (name, stamp, true))
                .collect();
            (changed, failed)
        })
        .await
        else {
            return;
        };
        // The changed models load side by side (their builds bounded by `load_threads`), the
        // ensembles after them: an ensemble then finds the models it composes in place
        // instead of building them itself while their own loads do too.
        let (mut ensembles, models): (Vec<_>, Vec<_>) = changed.into_iter().partition(|(_, _, ensemble)| *ensemble);
        let loaded_now = self.load_batch(models).await;
        // As Triton reloads an ensemble once the models it depends on load: one that failed
        // (its files unchanged since) is tried again after any model loaded in this pass.
        if loaded_now > 0 {
            ensembles.extend(failed_ensembles);
        }
        self.load_batch(ensembles).await;
        for (name, slot) in loaded {
            if on_disk.contains_key(&name) || !unlisted.is_empty() {
                continue;
            }
            if slot.model.is_some() {
                tracing::info!(model = %name, "model removed from the repository; unloading");
                let _ = self.unload_inner(&name, None).await;
                // Put back unchanged (`mv`, `cp -a` keep the mtimes), it is loaded again.
                self.attempted.lock().unwrap_or_else(|e| e.into_inner()).remove(&name);
            } else if matches!(&slot.state, State::Unavailable(reason) if reason != UNLOADED) {
                // A model that failed to load and is gone from disk no longer counts against
                // strict readiness: nothing is left to fix or to serve. Decided again under the
                // change lock: a load may have succeeded since this pass's snapshot.
                let _serial = self.changes.lock().await;
                let still_failed = matches!(
                    self.slot(&name),
                    Some(Slot { model: None, state: State::Unavailable(ref r), .. }) if r != UNLOADED
                );
                if still_failed {
                    tracing::info!(model = %name, "failed model removed from the repository");
                    self.set_slot(
                        &name,
                        Slot { state: State::Unavailable(UNLOADED.into()), model: None, reload_error: None },
                    );
                    self.attempted.lock().unwrap_or_else(|e| e.into_inner()).remove(&name);
                }
            }
        }
    }

    fn not_attempted(&self, name: &str, stamp: &Stamp) -> bool {
        self.attempted.lock().unwrap_or_else(|e| e.into_inner()).get(name) != Some(stamp)
    }

    fn remember_stamp(&self, name: &str, stamp: Stamp) {
        self.attempted.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), stamp);
    }
}

/// Above this many bytes of tensors, the response cache's hashing of a request (and its copy
/// of a response) runs on a blocking thread rather than on the I/O thread serving requests.
const CACHE_INLINE_BYTES: usize = 256 << 10;

/// What an unload did.
enum Unloaded {
    /// Removed: the model that was loaded, if one was.
    Removed(Option<Arc<LoadedModel>>),
    /// Kept: this loaded ensemble composes it.
    Kept(String),
}

/// Counts a request as CANCELED if its future is dropped before it finished.
struct CancelGuard<'a> {
    stats: &'a VersionStats,
    started: Instant,
    armed: bool,
}

impl Drop for CancelGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.stats.record_failure(self.started.elapsed(), "CANCELED");
        }
    }
}

/// Refuses, before anything runs, a classification of an output that has no order to rank by
/// (or that the model lacks: validation names that one).
fn check_classification(model: &LoadedModel, request: &InferRequest) -> Result<(), Status> {
    for wanted in request.outputs.iter().filter(|o| o.classification > 0) {
        if let Some(spec) = model.spec.outputs.iter().find(|s| s.name == wanted.name)
            && matches!(spec.datatype, DataType::Bytes | DataType::Bool)
        {
            return Err(Status::invalid(format!(
                "output '{}': classification needs numeric scores, but the output is {}",
                wanted.name,
                spec.datatype.wire_name()
            )));
        }
    }
    Ok(())
}

/// Outputs classified on the blocking pool above this size: ranking a large output's scores
/// and writing out its classes takes milliseconds, which an I/O thread must not spend.
const CLASSIFY_INLINE_BYTES: usize = 64 << 10;

/// `outputs` with those the request asked classified replaced by their top classes (off the
/// I/O thread when one of them is large).
async fn classified(
    model: &Arc<LoadedModel>,
    wanted: &[crate::tensor::RequestedOutput],
    outputs: Vec<crate::tensor::OutputTensor>,
) -> Result<Vec<crate::tensor::OutputTensor>, Status> {
    let large = |w: &crate::tensor::RequestedOutput| {
        w.classification > 0 && outputs.iter().any(|o| o.name == w.name && o.data.len() > CLASSIFY_INLINE_BYTES)
    };
    if !wanted.iter().any(large) {
        return classify_outputs(model, wanted, outputs);
    }
    let (model, wanted) = (model.clone(), wanted.to_vec());
    tokio::task::spawn_blocking(move || classify_outputs(&model, &wanted, outputs))
        .await
        .map_err(|e| Status::internal(format!("the classification task failed: {e}")))?
}

fn classify_outputs(
    model: &LoadedModel,
    wanted: &[crate::tensor::RequestedOutput],
    mut outputs: Vec<crate::tensor::OutputTensor>,
) -> Result<Vec<crate::tensor::OutputTensor>, Status> {
    for want in wanted.iter().filter(|o| o.classification > 0) {
        if let Some(output) = outputs.iter_mut().find(|o| o.name == want.name) {
            let labels = model.labels.get(&want.name).map(|l| &l[..]);
            *output = crate::classify::classify(output, want.classification, model.spec.max_batch_size > 0, labels)?;
        }
    }
    Ok(outputs)
}

/// The answer to `request` (served by `version`) from its outcome, counted in `stats`:
/// `success` records a success; a failure is recorded with its reason after `elapsed`.
fn answered(
    request: InferRequest,
    version: i64,
    outcome: Result<(Vec<crate::tensor::OutputTensor>, Vec<crate::shm::ShmWritten>), Status>,
    stats: &crate::metrics::VersionStats,
    elapsed: Duration,
    success: impl FnOnce(),
) -> Result<InferResponse, Status> {
    match outcome {
        Ok((outputs, shm_written)) => {
            success();
            Ok(InferResponse {
                model_name: request.model_name,
                model_version: version,
                id: request.id,
                outputs,
                shm_written,
            })
        }
        Err(status) => {
            stats.record_failure(elapsed, status.code.reason());
            Err(status)
        }
    }
}

/// Writes the outputs a request asked for in shared memory into their regions, before the
/// request counts as a success: an output that does not fit its region fails the request (as
/// in Triton, where the backend writes it), in the statistics too.
async fn write_shm_outputs(
    outcome: Result<Vec<crate::tensor::OutputTensor>, Status>,
    targets: Vec<(String, crate::shm::ShmTarget)>,
) -> Result<(Vec<crate::tensor::OutputTensor>, Vec<crate::shm::ShmWritten>), Status> {
    crate::shm::write_outputs_offloaded(outcome?, targets).await
}

/// The latest a request may wait for its turn: its deadline, or its `timeout` from now,
/// whichever comes first.
fn wait_limit(request: &InferRequest) -> Option<Instant> {
    let timeout = (request.timeout_us > 0).then(|| Instant::now() + Duration::from_micros(request.timeout_us));
    match (request.deadline, timeout) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A permit of `semaphore`, or DEADLINE_EXCEEDED when `deadline` passes first.
async fn acquire_before(
    semaphore: &Arc<tokio::sync::Semaphore>,
    deadline: Option<Instant>,
) -> Result<tokio::sync::OwnedSemaphorePermit, Status> {
    let acquire = semaphore.clone().acquire_owned();
    let permit = match deadline {
        Some(d) => tokio::time::timeout_at(d.into(), acquire)
            .await
            .map_err(|_| Status::new(Code::DeadlineExceeded, "deadline exceeded waiting for the ensemble's turn"))?,
        None => acquire.await,
    };
    permit.map_err(|_| Status::unavailable("the ensemble is unloading"))
}

/// Versions of `model` that the steps of `plans` name explicitly (not "latest").
fn ensemble_named_versions<'a>(plans: impl IntoIterator<Item = &'a Plan>, model: &str) -> Vec<i64> {
    let mut out: Vec<i64> =
        plans.into_iter().flat_map(|p| p.steps.iter()).filter(|s| s.model == model).filter_map(|s| s.version).collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// What an input takes in memory while its request is held: its bytes, and for BYTES some 64
/// bytes more per element (each becomes a string of its own to run: ours, a C string, ONNX
/// Runtime's), whatever its length on the wire.
fn input_weight(datatype: nereid_common::DataType, shape: &[i64], bytes: usize) -> u64 {
    let strings = match datatype {
        // A shape that overflows weighs nothing here: validation refuses it for what it is.
        nereid_common::DataType::Bytes => nereid_common::dtype::element_count(shape).unwrap_or(0),
        _ => 0,
    };
    (bytes as u64).saturating_add(strings.saturating_mul(64))
}

/// [`input_weight`] of every input of `request`.
fn request_weight(request: &InferRequest) -> u64 {
    request.inputs.iter().map(|i| input_weight(i.datatype, &i.shape, i.data.len())).fold(0, u64::saturating_add)
}

/// Validates and queues one request on `scheduler` (holding its inputs' place in `budget`,
/// where one is given, until answered).
async fn run(
    spec: &ModelSpec,
    scheduler: &Scheduler,
    budget: Option<&Arc<crate::scheduler::MemoryBudget>>,
    request: &mut InferRequest,
) -> Result<Answer, Status> {
    let v = validate(spec, request)?;
    let reserved = match budget {
        Some(budget) => {
            let weights = v.inputs.iter().zip(&spec.inputs).filter_map(|(input, spec)| {
                let (shape, data) = input.as_ref()?;
                Some(input_weight(spec.datatype, shape, data.len()))
            });
            Some(budget.reserve(weights.fold(0u64, u64::saturating_add))?)
        }
        None => None,
    };
    let (tx, rx) = oneshot::channel();
    let mut job = Job::new(v.rows, v.shape_key, v.inputs, v.wanted, request.priority, request.timeout_us, tx);
    job.deadline = request.deadline;
    job.reserved = reserved;
    scheduler.submit(job)?;
    let answer = match request.deadline {
        Some(deadline) => match tokio::time::timeout_at(deadline.into(), rx).await {
            Ok(answer) => answer,
            Err(_) => return Err(Status::new(Code::DeadlineExceeded, "deadline exceeded before the request ran")),
        },
        None => rx.await,
    };
    answer.map_err(|_| Status::internal("the model instance stopped before answering"))?
}
