//! The front-end independent face of a worker: everything the HTTP and gRPC front ends call.
//! Both front ends translate their wire format into these calls and render the results; no
//! protocol logic lives below this line.

use std::sync::Arc;

use nereid_common::Status;
use nereid_proto::inference::ModelConfig;

use crate::metrics::Metrics;
use crate::repository::Repository;
use crate::shm::SharedMemory;
use crate::tensor::{InferRequest, InferResponse};

pub const SERVER_NAME: &str = "nereid";
pub const SERVER_VERSION: &str = env!("CARGO_PKG_VERSION");
/// The KServe v2 / Triton protocol extensions this worker implements.
pub const EXTENSIONS: &[&str] = &[
    "binary_tensor_data",
    "classification",
    "model_repository",
    "model_repository(unload_dependents)",
    "model_configuration",
    "schedule_policy",
    "parameters",
    "statistics",
    "logging",
];
/// Reported besides [`EXTENSIONS`] when clients may register shared-memory regions.
pub const SHM_EXTENSION: &str = "system_shared_memory";

/// Per-request size limits, checked before anything a client claims is allocated.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest accepted request body / gRPC message, in bytes.
    pub max_request_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_request_bytes: 64 << 20 }
    }
}

/// Metadata of one tensor as `GET /v2/models/{m}` reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorMetadata {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

/// `GET /v2/models/{m}[/versions/{v}]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: String,
    pub inputs: Vec<TensorMetadata>,
    pub outputs: Vec<TensorMetadata>,
}

/// One row of the repository index.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexEntry {
    pub name: String,
    /// Empty when the model has no version loaded (e.g. UNAVAILABLE before any load).
    pub version: String,
    /// `READY`, `LOADING`, `UNLOADING`, `UNAVAILABLE`.
    pub state: String,
    pub reason: String,
}

/// A duration statistic: count of events and total nanoseconds (Triton's `StatisticDuration`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Duration {
    pub count: u64,
    pub ns: u64,
}

/// Statistics of one batch size (Triton's `InferBatchStatistics`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BatchStats {
    pub batch_size: u64,
    pub compute_input: Duration,
    pub compute_infer: Duration,
    pub compute_output: Duration,
}

/// Statistics of one model version (Triton's `ModelStatistics`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelStats {
    pub name: String,
    pub version: String,
    /// Milliseconds since the epoch of the last inference (0 if none).
    pub last_inference_ms: u64,
    pub inference_count: u64,
    pub execution_count: u64,
    pub success: Duration,
    pub fail: Duration,
    pub queue: Duration,
    pub compute_input: Duration,
    pub compute_infer: Duration,
    pub compute_output: Duration,
    /// Response cache lookups that answered the request, and those that did not.
    pub cache_hit: Duration,
    pub cache_miss: Duration,
    pub batch_stats: Vec<BatchStats>,
}

/// The worker as its front ends see it. Cheap to clone.
#[derive(Clone)]
pub struct Server {
    /// The name server metadata reports (`--id`; default [`SERVER_NAME`]).
    pub name: Arc<str>,
    pub repository: Arc<Repository>,
    pub metrics: Arc<Metrics>,
    pub limits: Limits,
    /// Registered system shared-memory regions (refusing them unless `--allow-client-shm`).
    pub shm: Arc<SharedMemory>,
}

impl Server {
    /// The protocol extensions this worker reports in its server metadata.
    pub fn extensions(&self) -> Vec<String> {
        let shm = self.shm.enabled().then_some(SHM_EXTENSION);
        EXTENSIONS.iter().copied().chain(shm).map(str::to_string).collect()
    }

    pub fn live(&self) -> bool {
        true
    }

    /// Ready when not draining and every model that should be loaded at start-up has loaded.
    pub fn ready(&self) -> bool {
        self.repository.server_ready()
    }

    pub fn model_ready(&self, name: &str, version: Option<i64>) -> bool {
        self.repository.model_ready(name, version)
    }

    pub fn model_metadata(&self, name: &str, version: Option<i64>) -> Result<ModelMetadata, Status> {
        self.repository.model_metadata(name, version)
    }

    pub fn model_config(&self, name: &str, version: Option<i64>) -> Result<ModelConfig, Status> {
        self.repository.model_config(name, version)
    }

    /// Statistics for one model (all its versions, or one), or every model when `name` is None.
    pub fn model_statistics(&self, name: Option<&str>, version: Option<i64>) -> Result<Vec<ModelStats>, Status> {
        self.repository.model_statistics(name, version)
    }

    /// Runs one inference. The returned future may be dropped: a dropped request is removed
    /// from its model's queue before its batch forms and counted as cancelled.
    pub async fn infer(&self, request: InferRequest) -> Result<InferResponse, Status> {
        self.repository.infer(request).await
    }

    pub fn repository_index(&self, ready_only: bool) -> Vec<IndexEntry> {
        self.repository.index(ready_only)
    }

    /// Loads (or reloads) a model from the repository; `config` overrides its `config.pbtxt`
    /// (JSON text of a ModelConfig, as Triton's load API accepts). The load runs to its end
    /// even when the caller goes away (a client that disconnects): stopped half-way, it would
    /// leave the model LOADING.
    pub async fn load_model(&self, name: &str, config: Option<String>) -> Result<(), Status> {
        let (repository, name) = (self.repository.clone(), name.to_string());
        finish(tokio::spawn(async move { repository.load(&name, config).await })).await
    }

    /// Unloads a model; with `dependents`, an ensemble's composing models too. Runs to its end
    /// whatever becomes of the caller, as a load does.
    pub async fn unload_model(&self, name: &str, dependents: bool) -> Result<(), Status> {
        let (repository, name) = (self.repository.clone(), name.to_string());
        finish(tokio::spawn(async move { repository.unload_with(&name, dependents).await })).await
    }

    /// Prometheus text exposition of every metric.
    pub fn metrics_text(&self) -> String {
        self.metrics.render()
    }
}

/// Parses a KServe version string ("" means none).
pub fn parse_version(model: &str, version: &str) -> Result<Option<i64>, Status> {
    if version.is_empty() {
        return Ok(None);
    }
    version.parse::<i64>().ok().filter(|v| *v >= 0).map(Some).ok_or_else(|| {
        // A malformed version is a malformed request (Triton: INVALID_ARGUMENT), not a missing one.
        Status::invalid(format!(
            "model '{model}': version '{version}' is not a version (versions are non-negative integers)"
        ))
    })
}

/// The result of a repository change run as its own task.
async fn finish(task: tokio::task::JoinHandle<Result<(), Status>>) -> Result<(), Status> {
    task.await.unwrap_or_else(|e| Err(Status::internal(format!("the repository change failed: {e}"))))
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called. From then
/// on a second signal exits at once (status 128 + its number), as tritonserver does: an
/// operator who asks twice does not want to wait for the drain.
pub fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term =
        signal(SignalKind::terminate()).map_err(|e| anyhow::anyhow!("cannot install the SIGTERM handler: {e}"))?;
    let mut int =
        signal(SignalKind::interrupt()).map_err(|e| anyhow::anyhow!("cannot install the SIGINT handler: {e}"))?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tokio::spawn(async move {
            let code = tokio::select! {
                _ = term.recv() => 128 + 15,
                _ = int.recv() => 128 + 2,
            };
            tracing::warn!("a second shutdown signal: exiting now, without finishing in-flight requests");
            std::process::exit(code);
        });
    })
}
