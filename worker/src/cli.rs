//! Command line. Flags follow tritonserver's where they overlap (`--model-repository`,
//! `--http-port`, `--model-control-mode=explicit`, `--strict-model-config=true`, ...), so Triton
//! users' scripts carry over; Nereid's own flags follow. Booleans read as tritonserver reads
//! them (`true`/`on`/`1`, `false`/`off`/`0`, any case). tritonserver flags with no counterpart here are
//! accepted and named in a warning, or refused where they ask for a missing feature
//! ([`TritonFlags`]).

use std::net::IpAddr;
use std::path::PathBuf;

use clap::builder::TypedValueParser;
use clap::{ArgAction, Parser, ValueEnum};

use crate::repository::ControlMode;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ControlModeArg {
    /// Load every model at start; never change them.
    None,
    /// Load every model at start; re-scan the repository every --repository-poll-secs.
    Poll,
    /// Load only --load-model models at start; then only through the repository API.
    Explicit,
}

impl From<ControlModeArg> for ControlMode {
    fn from(m: ControlModeArg) -> Self {
        match m {
            ControlModeArg::None => ControlMode::None,
            ControlModeArg::Poll => ControlMode::Poll,
            ControlModeArg::Explicit => ControlMode::Explicit,
        }
    }
}

/// nereid-worker: serves a Triton model repository (ONNX models) over KServe v2 HTTP and gRPC.
#[derive(Clone, Debug, Parser)]
#[command(name = "nereid-worker", version, about, long_about = None)]
pub struct Args {
    /// Model repository folder; repeat for several (a model name found in two is UNAVAILABLE,
    /// its reason naming both folders, as in Triton).
    #[arg(long = "model-repository", alias = "model-store", required = true, value_name = "DIR")]
    pub model_repository: Vec<PathBuf>,

    /// Address the HTTP, gRPC and metrics servers bind to (each overridable below).
    #[arg(long, default_value = "0.0.0.0", value_name = "IP", value_parser = parse_ip)]
    pub address: IpAddr,

    /// Address the HTTP server binds to. Default: --address.
    #[arg(long, value_name = "IP", value_parser = parse_ip)]
    pub http_address: Option<IpAddr>,

    /// Address the gRPC server binds to. Default: --address.
    #[arg(long, value_name = "IP", value_parser = parse_ip)]
    pub grpc_address: Option<IpAddr>,

    /// Address the metrics server binds to. Default: --address.
    #[arg(long, value_name = "IP", value_parser = parse_ip)]
    pub metrics_address: Option<IpAddr>,

    /// This server's identifier: the `name` in server metadata (HTTP `GET /v2`, gRPC
    /// ServerMetadata). Default: nereid.
    #[arg(long, value_name = "NAME", value_parser = parse_id)]
    pub id: Option<String>,

    /// HTTP port (KServe v2 REST). 0 picks a free port (see --port-file).
    #[arg(long, default_value_t = 8000)]
    pub http_port: u16,

    /// gRPC port (inference.GRPCInferenceService). 0 picks a free port.
    #[arg(long, default_value_t = 8001)]
    pub grpc_port: u16,

    /// Prometheus metrics port (`GET /metrics`). 0 picks a free port.
    #[arg(long, default_value_t = 8002)]
    pub metrics_port: u16,

    /// Serve HTTP.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub allow_http: bool,

    /// Serve gRPC.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub allow_grpc: bool,

    /// Serve metrics.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub allow_metrics: bool,

    /// Model control mode: none, poll or explicit.
    #[arg(long, value_enum, default_value = "none", ignore_case = true)]
    pub model_control_mode: ControlModeArg,

    /// With --model-control-mode=explicit: a model to load at start; repeat; `*` loads all.
    #[arg(long = "load-model", value_name = "NAME")]
    pub load_model: Vec<String>,

    /// With --model-control-mode=poll: seconds between repository scans.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    pub repository_poll_secs: u64,

    /// No auto-completion: a model without config.pbtxt, or whose config lacks inputs or
    /// outputs, fails to load (the reason says why).
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub strict_model_config: bool,

    /// The same as --strict-model-config=true (tritonserver's newer spelling; takes no value).
    #[arg(long)]
    pub disable_auto_complete_config: bool,

    /// Export the GPUs' metrics (`nv_gpu_*`, where there are GPUs and the `cuda` feature).
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub allow_gpu_metrics: bool,

    /// Export the host's CPU utilization and memory (`nv_cpu_*`, from /proc).
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub allow_cpu_metrics: bool,

    /// Milliseconds between readings of the GPU and CPU metrics: scrapes closer together see
    /// the same values; CPU utilization covers the span between two readings.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub metrics_interval_ms: u64,

    /// Threads of the I/O runtime that serves HTTP and gRPC (they share it). Default: one per
    /// core.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub http_thread_count: Option<u64>,

    /// Models loaded at once (at start, through the repository API, by POLL or by fleet
    /// placement): reading each model, creating its ONNX Runtime sessions and its warm-up run
    /// on this many threads. One model's loads and unloads still run in order; ensembles are
    /// put in place after the models they compose.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub model_load_thread_count: u64,

    /// Report the server ready (HTTP /v2/health/ready, gRPC ServerReady) only while every model
    /// it tried to load is READY (a model unloaded on purpose excepted), as tritonserver's
    /// default; false: ready once start-up loading is done, whatever failed. Default: true, but
    /// false with --etcd-endpoints, where placement decides the loads and one bad model must
    /// not take the whole worker out of load balancers (each model's state is in etcd).
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub strict_readiness: Option<bool>,

    /// Exit at start if any model fails to load (Triton's default is true; Nereid keeps
    /// serving the models that loaded and reports the failure in the repository index).
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub exit_on_error: bool,

    /// Allow clients to register system shared-memory regions and pass tensors through them
    /// (Triton's shared-memory extension; the same flag and default as tritonserver). A
    /// registered key opens any POSIX shared-memory object this process can open, so allow it
    /// only where every client that can reach the worker shares the host's trust.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub allow_client_shm: bool,

    /// Verbose logging level (0 = info, 1 = debug, 2+ = trace; true/false as 1/0). RUST_LOG
    /// overrides.
    #[arg(long, default_value_t = 0, value_parser = parse_log_verbose)]
    pub log_verbose: u8,

    /// Log INFO events (switchable at run time too: `POST /v2/logging`, gRPC LogSettings).
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub log_info: bool,

    /// Log WARN events.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub log_warning: bool,

    /// Log ERROR events.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub log_error: bool,

    /// Log line format, as tritonserver's: `default` (`I1124 02:31:44.123456 4242
    /// fleet.rs:611] message`) or `ISO8601` (`2026-11-24T02:31:44Z I 4242 fleet.rs:611]
    /// message`); an event's fields follow its message as `key=value`.
    #[arg(long, default_value = "default", value_parser = ["default", "ISO8601"])]
    pub log_format: String,

    /// Append the log to this file instead of standard output.
    #[arg(long, value_name = "FILE")]
    pub log_file: Option<PathBuf>,

    /// gRPC keep-alive: milliseconds between the pings the server sends on an idle
    /// connection (tritonserver's default is 2 hours; Nereid's notices a dead client sooner).
    #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub grpc_keepalive_time: u64,

    /// gRPC keep-alive: milliseconds to wait for a ping's acknowledgement before closing the
    /// connection.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub grpc_keepalive_timeout: u64,

    /// Seconds to finish in-flight requests after SIGTERM/SIGINT before exiting.
    #[arg(long, default_value_t = 30)]
    pub exit_timeout_secs: u64,

    /// Path of the ONNX Runtime shared library (libonnxruntime.so). Default: $NEREID_ORT_LIB,
    /// else .deps/onnxruntime/libonnxruntime.so as installed by scripts/setup.sh.
    #[arg(long, value_name = "FILE")]
    pub onnxruntime_lib: Option<PathBuf>,

    /// Largest accepted request (HTTP body or gRPC message) in bytes; larger ones are refused
    /// before anything is allocated.
    #[arg(long, default_value_t = 64 << 20, value_parser = clap::value_parser!(u64).range(1024..=(1 << 32)))]
    pub max_request_bytes: u64,

    /// Bytes of input the requests of every model may hold at once, queued or running. Past
    /// it a request is refused at once with RESOURCE_EXHAUSTED / 429 (a client or gateway
    /// retries it elsewhere) rather than the queues growing until the process runs out of
    /// memory. 0: no bound. Default 8 GiB.
    #[arg(long, default_value_t = 8 << 30, value_name = "BYTES")]
    pub max_queued_bytes: u64,

    /// Response cache, as tritonserver takes it: `local,size=BYTES` (the only cache here). Models
    /// opt in with response_cache { enable: true }; without this flag none is cached.
    #[arg(long = "cache-config", value_name = "CACHE,KEY=VALUE")]
    pub cache_config: Vec<String>,

    /// Backend settings, as tritonserver takes them: `[BACKEND,]SETTING=VALUE`, repeatable.
    /// `default-max-batch-size=N` (global, or for `onnxruntime`, which wins) is the
    /// max_batch_size auto-complete gives a model that can batch (4 when not set; 0: such
    /// models do not batch). onnxruntime's `enable-global-threadpool`, `intra_op_thread_count`
    /// and `inter_op_thread_count`, and settings for backends Nereid has not, are accepted
    /// and named in a warning: each instance has its own thread pool (a model's
    /// `parameters`, or --intra-op-threads).
    #[arg(long, value_name = "[BACKEND,]SETTING=VALUE")]
    pub backend_config: Vec<String>,

    /// tritonserver's custom model configuration: each model's config is read from
    /// `<model>/configs/<NAME>.pbtxt` where that file exists, else from its config.pbtxt.
    #[arg(long, value_name = "NAME", value_parser = parse_config_name)]
    pub model_config_name: Option<String>,

    /// Restricts HTTP APIs to requests carrying a header (tritonserver's flag, repeatable):
    /// `API[,API...]:KEY=VALUE` — a request to one of the APIs without header KEY set to
    /// VALUE is answered 403. APIs: health, metadata, inference, shared-memory, model-config,
    /// model-repository, statistics, trace, logging; each in one group at most.
    #[arg(long, value_name = "APIS:KEY=VALUE")]
    pub http_restricted_api: Vec<String>,

    /// Restricts gRPC protocols as --http-restricted-api does HTTP APIs; the header is
    /// `triton-grpc-protocol-KEY`, and a refused call is answered UNAVAILABLE (as tritonserver
    /// answers it).
    #[arg(long, value_name = "PROTOCOLS:KEY=VALUE")]
    pub grpc_restricted_protocol: Vec<String>,

    /// gRPC response compression, by tritonserver's levels: `none`, or `low`/`medium`/`high` —
    /// responses gzipped (at one level) for clients that accept gzip.
    #[arg(long, default_value = "none", value_parser = ["none", "low", "medium", "high"], ignore_case = true)]
    pub grpc_infer_response_compression_level: String,

    /// Largest accepted HTTP request body in bytes (tritonserver's flag; default: the
    /// --max-request-bytes limit, which then bounds gRPC messages alone).
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1024..=(1 << 32)))]
    pub http_max_input_size: Option<u64>,

    /// Default ONNX Runtime intra-op threads per instance (a model's
    /// parameters { key: "intra_op_thread_count" } overrides; 0 = ONNX Runtime's default).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(0..=1024).map(|v| v as usize))]
    pub intra_op_threads: usize,

    /// Flush subnormal floats to zero on the threads that run models (FTZ/DAZ, as TensorFlow
    /// does by default): arithmetic on subnormals takes the CPU's slow path, so a model fed
    /// random or tiny values can run far slower. Results change only where an input or an
    /// intermediate value is subnormal (below ~1.2e-38 in FP32, ~2.2e-308 in FP64): it counts
    /// as zero. A model's parameters { key: "nereid.denormal_as_zero" } overrides.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = triton_bool(), ignore_case = true)]
    pub denormal_as_zero: bool,

    /// Write the bound ports as JSON ({"http":..,"grpc":..,"metrics":..}) to this file once
    /// listening (useful with port 0).
    #[arg(long, value_name = "FILE")]
    pub port_file: Option<PathBuf>,

    /// etcd endpoints (comma-separated http://host:port). With it the worker joins the fleet:
    /// it registers under a lease, loads what the placement controller assigns it (requires
    /// --model-control-mode=explicit) and publishes each model's state.
    #[arg(long, env = "NEREID_ETCD_ENDPOINTS", value_name = "URLS")]
    pub etcd_endpoints: Option<String>,

    /// Prefix of every Nereid key in etcd.
    #[arg(long, default_value = nereid_common::fleet::DEFAULT_PREFIX, value_name = "PREFIX")]
    pub etcd_prefix: String,

    /// This worker's id in the fleet (unique). Default: <hostname>-<grpc port>.
    #[arg(long, value_name = "ID")]
    pub worker_id: Option<String>,

    /// Host the gateway dials for this worker (with the bound gRPC/HTTP ports). Default: the
    /// --grpc-address (else --address), or 127.0.0.1 when that is a wildcard address.
    #[arg(long, value_name = "HOST")]
    pub advertise_address: Option<String>,

    /// TTL of the etcd lease in seconds: a worker that stops sending keep-alives (crash,
    /// partition) leaves the fleet this long after its last one.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=300))]
    pub etcd_lease_ttl_secs: u64,

    /// A label (key=value) in the worker record, for placement and operators; repeatable.
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,

    /// Memory this worker offers for models, in MiB, as the placement controller counts it
    /// against each model's declared resources.memory_mb. Default: the host's total memory.
    #[arg(long, value_name = "MIB")]
    pub memory_capacity_mb: Option<u64>,

    /// Most model versions the placement controller may assign to this worker (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub max_models: u32,

    /// After SIGTERM, milliseconds between marking this worker draining in etcd and closing
    /// the listeners, so gateways stop sending before connections are refused (etcd mode only).
    /// Also how long a model whose placement was removed keeps serving, no longer published
    /// READY, before it is unloaded (at least 500 ms).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub drain_delay_ms: u64,

    #[command(flatten)]
    pub triton: TritonFlags,
}

/// A boolean as tritonserver reads one: `true`/`on`/`1` or `false`/`off`/`0`, in any case
/// (with the argument's `ignore_case`).
fn triton_bool() -> impl TypedValueParser<Value = bool> {
    clap::builder::PossibleValuesParser::new(["true", "false", "on", "off", "1", "0"])
        .map(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "on" | "1"))
}

/// `--log-verbose`: a level, or a boolean as tritonserver also takes it (true = 1).
fn parse_log_verbose(s: &str) -> Result<u8, String> {
    match s.to_ascii_lowercase().as_str() {
        "true" | "on" => Ok(1),
        "false" | "off" => Ok(0),
        n => n.parse().map_err(|_| format!("'{s}' is neither a level (0-255) nor a boolean")),
    }
}

/// An address flag's IP, also in brackets as IPv6 addresses are written in URLs (`[::]`).
fn parse_ip(s: &str) -> Result<IpAddr, String> {
    let bare = s.strip_prefix('[').and_then(|r| r.strip_suffix(']')).unwrap_or(s);
    bare.parse().map_err(|e| format!("'{s}' is not an IP address: {e}"))
}

/// `--model-config-name`: a file name without its `.pbtxt`, naming a file in `configs/`.
fn parse_config_name(s: &str) -> Result<String, String> {
    if s.is_empty() || s.contains(['/', '\\']) || s == "." || s == ".." || s.chars().any(char::is_control) {
        return Err("must name a file in each model's configs/ folder (no path, no .pbtxt)".into());
    }
    Ok(s.strip_suffix(".pbtxt").unwrap_or(s).to_string())
}

/// What `--backend-config` sets here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendSettings {
    /// `default-max-batch-size`: the max_batch_size auto-complete gives a model that can batch.
    pub default_max_batch_size: Option<i32>,
}

/// The settings of `--backend-config` entries (`[BACKEND,]SETTING=VALUE`), with a warning for
/// each entry that changes nothing here, or the error naming the first malformed one. A
/// backend's own `default-max-batch-size` wins over the global one, in any order.
pub fn backend_settings(entries: &[String]) -> Result<(BackendSettings, Vec<String>), String> {
    let (mut global, mut onnxruntime) = (None, None);
    let mut warnings = Vec::new();
    for entry in entries {
        let malformed = || format!("--backend-config '{entry}': expected [BACKEND,]SETTING=VALUE");
        let (setting, value) = entry.split_once('=').ok_or_else(malformed)?;
        let (backend, setting) = match setting.split_once(',') {
            Some((backend, setting)) => (Some(backend.trim()), setting.trim()),
            None => (None, setting.trim()),
        };
        if setting.is_empty() || backend == Some("") {
            return Err(malformed());
        }
        let ignored = |why: &str| format!("--backend-config {entry} has no effect in nereid-worker: {why}");
        match (backend, setting) {
            (None | Some("onnxruntime"), "default-max-batch-size") => {
                let n = value.trim().parse::<i32>().ok().filter(|n| *n >= 0).ok_or_else(|| {
                    format!("--backend-config '{entry}': default-max-batch-size must be a non-negative integer")
                })?;
                *if backend.is_some() { &mut onnxruntime } else { &mut global } = Some(n);
            }
            (Some("onnxruntime"), "enable-global-threadpool" | "intra_op_thread_count" | "inter_op_thread_count") => {
                warnings.push(ignored(
                    "each model instance has its own thread pool (a model's parameters, or --intra-op-threads)",
                ));
            }
            (Some("onnxruntime") | None, _) => warnings.push(ignored("not a setting nereid-worker knows")),
            (Some(other), _) => warnings.push(ignored(&format!("there is no '{other}' backend (ONNX Runtime only)"))),
        }
    }
    Ok((BackendSettings { default_max_batch_size: onnxruntime.or(global) }, warnings))
}

fn parse_id(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 256 || s.chars().any(char::is_control) {
        return Err("must be 1 to 256 characters, none of them control characters".into());
    }
    Ok(s.to_string())
}

/// tritonserver flags that deployments pass (KServe ModelMesh's Triton runtime, Helm charts)
/// and that have no counterpart here. Accepted so those command lines start Nereid unchanged;
/// each one given is named in a warning at start saying why it changes nothing, and one that
/// asks for a feature Nereid lacks (`--grpc-use-ssl=true`, ...) is refused instead
/// ([`TritonFlags::check`]).
#[derive(Clone, Debug, Default, clap::Args)]
#[command(next_help_heading = "tritonserver flags accepted for compatibility (see --help of each)")]
pub struct TritonFlags {
    /// Accepted; requests are not pooled.
    #[arg(long, value_name = "N")]
    pub grpc_infer_allocation_pool_size: Option<u64>,
    /// Accepted; the server pings idle connections too (as with true), and allows client pings
    /// with or without calls in flight.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool(), ignore_case = true)]
    pub grpc_keepalive_permit_without_calls: Option<bool>,
    /// Accepted; the server's keep-alive pings follow --grpc-keepalive-time alone.
    #[arg(long, value_name = "N")]
    pub grpc_http2_max_pings_without_data: Option<u64>,
    /// Accepted; client pings are allowed at any interval.
    #[arg(long, value_name = "MS")]
    pub grpc_http2_min_recv_ping_interval_without_data: Option<u64>,
    /// Accepted; no ping is a strike (as 0).
    #[arg(long, value_name = "N")]
    pub grpc_http2_max_ping_strikes: Option<u64>,
    /// Accepted; no pinned host-memory pool (tensors go to ONNX Runtime from request buffers).
    #[arg(long, value_name = "BYTES")]
    pub pinned_memory_pool_byte_size: Option<u64>,
    /// Accepted (`GPU:BYTES`, repeatable); ONNX Runtime's CUDA provider allocates its own.
    #[arg(long, value_name = "GPU:BYTES")]
    pub cuda_memory_pool_byte_size: Vec<String>,
    /// Accepted; the backend (ONNX Runtime) is built in: see --onnxruntime-lib.
    #[arg(long, value_name = "DIR")]
    pub backend_directory: Option<PathBuf>,
    /// Accepted; no repository agents.
    #[arg(long, value_name = "DIR")]
    pub repoagent_directory: Option<PathBuf>,
    /// Accepted only as false: no SageMaker endpoint.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool(), ignore_case = true)]
    pub allow_sagemaker: Option<bool>,
    /// Accepted only as false: no Vertex AI endpoint.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool(), ignore_case = true)]
    pub allow_vertex_ai: Option<bool>,
    /// Accepted only as false: no TLS on the gRPC port (terminate TLS in front of it).
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool(), ignore_case = true)]
    pub grpc_use_ssl: Option<bool>,
    /// Accepted only as false: no TLS on the gRPC port.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool(), ignore_case = true)]
    pub grpc_use_ssl_mutual: Option<bool>,
    /// Accepted only as false: ports are not shared between processes.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool(), ignore_case = true)]
    pub reuse_http_port: Option<bool>,
    /// Accepted only as false: ports are not shared between processes.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool(), ignore_case = true)]
    pub reuse_grpc_port: Option<bool>,
    /// Accepted only as false: model names are unique across repositories.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool(), ignore_case = true)]
    pub model_namespacing: Option<bool>,
    /// Accepted only as `off`: instances run as soon as they have work (no rate limiter).
    #[arg(long, value_name = "MODE", value_parser = ["off", "execution_count"], ignore_case = true)]
    pub rate_limit: Option<String>,
    /// Accepted (repeatable); there is no rate limiter to give resources to.
    #[arg(long, value_name = "NAME:COUNT:DEVICE")]
    pub rate_limit_resource: Vec<String>,
    /// Accepted; inputs are not staged through buffer-manager threads.
    #[arg(long, value_name = "N")]
    pub buffer_manager_thread_count: Option<u64>,
    /// Accepted (repeatable) while it turns no tracing on (`level=OFF`, or settings without a
    /// level): Triton's trace extension is not implemented.
    #[arg(long, value_name = "[MODE,]SETTING=VALUE")]
    pub trace_config: Vec<String>,
    /// Accepted only as OFF (tritonserver's older trace flags, like the ones below).
    #[arg(long, value_name = "LEVEL")]
    pub trace_level: Vec<String>,
    /// Accepted; nothing is traced.
    #[arg(long, value_name = "FILE")]
    pub trace_file: Option<PathBuf>,
    /// Accepted; nothing is traced.
    #[arg(long, value_name = "N")]
    pub trace_rate: Option<u64>,
    /// Accepted; nothing is traced.
    #[arg(long, value_name = "N")]
    pub trace_count: Option<i64>,
    /// Accepted; nothing is traced.
    #[arg(long, value_name = "N")]
    pub trace_log_frequency: Option<u64>,
    /// Accepted (repeatable); no NUMA host policies.
    #[arg(long, value_name = "NAME,SETTING=VALUE")]
    pub host_policy: Vec<String>,
    /// Accepted; GPUs are used where ONNX Runtime's CUDA provider accepts them.
    #[arg(long, value_name = "VERSION")]
    pub min_supported_compute_capability: Option<String>,
    /// Accepted; no backend reads forwarded headers.
    #[arg(long, value_name = "REGEX")]
    pub http_header_forward_pattern: Option<String>,
    /// Accepted; no backend reads forwarded headers.
    #[arg(long, value_name = "REGEX")]
    pub grpc_header_forward_pattern: Option<String>,
    /// Accepted; the response cache (--cache-config local,...) is built in.
    #[arg(long, value_name = "DIR")]
    pub cache_directory: Option<PathBuf>,
    /// Accepted (repeatable); /metrics always has Triton's counters, summaries are not
    /// kept.
    #[arg(long, value_name = "SETTING=VALUE")]
    pub metrics_config: Vec<String>,
    /// Accepted; a failed load is not retried (another load request or a repository change
    /// loads it again).
    #[arg(long, value_name = "N")]
    pub model_load_retry_count: Option<u64>,
    /// Accepted; gRPC requests run on the server's async threads.
    #[arg(long, value_name = "N")]
    pub grpc_infer_thread_count: Option<u64>,
    /// Accepted; responses are not pooled.
    #[arg(long, value_name = "N")]
    pub grpc_max_response_pool_size: Option<u64>,
    /// tritonserver's older spelling of `--cache-config local,size=BYTES`: sizes the response
    /// cache when --cache-config is not given.
    #[arg(long, value_name = "BYTES")]
    pub response_cache_byte_size: Option<u64>,
    /// Accepted; ONNX Runtime's CUDA provider manages its own address space.
    #[arg(long, value_name = "GPU:BYTES")]
    pub cuda_virtual_address_size: Vec<String>,
    /// Accepted; GPU memory is not limited per load.
    #[arg(long, value_name = "GPU:FRACTION")]
    pub model_load_gpu_limit: Vec<String>,
    /// Accepted; peer access between GPUs is left as the driver sets it.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = triton_bool(), ignore_case = true)]
    pub enable_peer_access: Option<bool>,
}

impl TritonFlags {
    /// The warnings to log for the flags given that change nothing here, or the error naming
    /// the first that asks for a feature Nereid does not have.
    pub fn check(&self) -> Result<Vec<String>, String> {
        let refused = [
            ("--allow-sagemaker", self.allow_sagemaker, "nereid-worker has no SageMaker endpoint"),
            ("--allow-vertex-ai", self.allow_vertex_ai, "nereid-worker has no Vertex AI endpoint"),
            (
                "--grpc-use-ssl",
                self.grpc_use_ssl,
                "nereid-worker serves gRPC without TLS: terminate TLS in front of it",
            ),
            ("--grpc-use-ssl-mutual", self.grpc_use_ssl_mutual, "nereid-worker serves gRPC without TLS"),
            ("--reuse-http-port", self.reuse_http_port, "nereid-worker does not share its ports"),
            ("--reuse-grpc-port", self.reuse_grpc_port, "nereid-worker does not share its ports"),
            ("--model-namespacing", self.model_namespacing, "model names must be unique across repositories"),
        ];
        if let Some((flag, _, why)) = refused.iter().find(|(_, v, _)| *v == Some(true)) {
            return Err(format!("{flag}=true is not supported: {why}"));
        }
        let tracing_on = |setting: &str| {
            let level = setting.rsplit(',').next().unwrap_or(setting);
            level.split_once('=').is_some_and(|(k, v)| k.trim() == "level" && !v.trim().eq_ignore_ascii_case("off"))
        };
        let refused_values: [(&str, Option<&String>, &str); 3] = [
            (
                "--rate-limit",
                self.rate_limit.as_ref().filter(|m| !m.eq_ignore_ascii_case("off")),
                "there is no rate limiter: instances run as soon as they have work",
            ),
            (
                "--trace-config",
                self.trace_config.iter().find(|c| tracing_on(c)),
                "Triton's trace extension is not implemented",
            ),
            (
                "--trace-level",
                // tritonserver takes OFF, or false, as no tracing.
                self.trace_level.iter().find(|l| !l.eq_ignore_ascii_case("off") && !l.eq_ignore_ascii_case("false")),
                "Triton's trace extension is not implemented",
            ),
        ];
        if let Some((flag, Some(value), why)) = refused_values.iter().find(|(_, v, _)| v.is_some()) {
            return Err(format!("{flag}={value} is not supported: {why}"));
        }
        let traced = self.trace_file.is_some()
            || self.trace_rate.is_some()
            || self.trace_count.is_some()
            || self.trace_log_frequency.is_some()
            || !self.trace_config.is_empty()
            || !self.trace_level.is_empty();
        let ignored: Vec<(&str, bool, &str)> = vec![
            (
                "--grpc-infer-allocation-pool-size",
                self.grpc_infer_allocation_pool_size.is_some(),
                "requests are not pooled",
            ),
            (
                "--grpc-keepalive-permit-without-calls",
                self.grpc_keepalive_permit_without_calls == Some(false),
                "the server sends its keep-alive pings on idle connections too (as with true)",
            ),
            (
                "--grpc-http2-max-pings-without-data",
                self.grpc_http2_max_pings_without_data.is_some_and(|n| n != 0),
                "the server's keep-alive pings follow --grpc-keepalive-time alone",
            ),
            (
                "--grpc-http2-min-recv-ping-interval-without-data",
                self.grpc_http2_min_recv_ping_interval_without_data.is_some(),
                "client pings are allowed at any interval",
            ),
            (
                "--grpc-http2-max-ping-strikes",
                self.grpc_http2_max_ping_strikes.is_some_and(|n| n != 0),
                "no client ping counts as a strike",
            ),
            (
                "--pinned-memory-pool-byte-size",
                self.pinned_memory_pool_byte_size.is_some(),
                "there is no pinned host-memory pool",
            ),
            (
                "--cuda-memory-pool-byte-size",
                !self.cuda_memory_pool_byte_size.is_empty(),
                "ONNX Runtime's CUDA provider allocates its own memory",
            ),
            (
                "--backend-directory",
                self.backend_directory.is_some(),
                "the ONNX Runtime backend is built in (its library: --onnxruntime-lib)",
            ),
            ("--repoagent-directory", self.repoagent_directory.is_some(), "there are no repository agents"),
            (
                "--rate-limit-resource",
                !self.rate_limit_resource.is_empty(),
                "there is no rate limiter to give resources to",
            ),
            (
                "--buffer-manager-thread-count",
                self.buffer_manager_thread_count.is_some(),
                "inputs are not staged through buffer-manager threads",
            ),
            ("--trace-*", traced, "nothing is traced (Triton's trace extension is not implemented)"),
            ("--host-policy", !self.host_policy.is_empty(), "there are no NUMA host policies"),
            (
                "--min-supported-compute-capability",
                self.min_supported_compute_capability.is_some(),
                "GPUs are used where ONNX Runtime's CUDA provider accepts them",
            ),
            (
                "--http-header-forward-pattern",
                self.http_header_forward_pattern.is_some(),
                "no backend reads forwarded headers",
            ),
            (
                "--grpc-header-forward-pattern",
                self.grpc_header_forward_pattern.is_some(),
                "no backend reads forwarded headers",
            ),
            (
                "--cache-directory",
                self.cache_directory.is_some(),
                "the response cache (--cache-config local,size=BYTES) is built in",
            ),
            ("--metrics-config", !self.metrics_config.is_empty(), "/metrics has Triton's counters; no summaries"),
            (
                "--model-load-retry-count",
                self.model_load_retry_count.is_some_and(|n| n > 0),
                "a failed load is not retried by itself",
            ),
            (
                "--grpc-infer-thread-count",
                self.grpc_infer_thread_count.is_some(),
                "gRPC requests run on the server's async threads",
            ),
            ("--grpc-max-response-pool-size", self.grpc_max_response_pool_size.is_some(), "responses are not pooled"),
            (
                "--cuda-virtual-address-size",
                !self.cuda_virtual_address_size.is_empty(),
                "ONNX Runtime's CUDA provider manages its own address space",
            ),
            ("--model-load-gpu-limit", !self.model_load_gpu_limit.is_empty(), "GPU memory is not limited per load"),
            (
                "--enable-peer-access",
                self.enable_peer_access.is_some(),
                "peer access between GPUs is left as the driver sets it",
            ),
        ];
        Ok(ignored
            .iter()
            .filter(|(_, given, _)| *given)
            .map(|(flag, _, why)| format!("{flag} has no effect in nereid-worker: {why}"))
            .collect())
    }
}

impl Args {
    /// `--strict-readiness` as given, else its default: true, false in fleet mode.
    pub fn strict_readiness(&self) -> bool {
        self.strict_readiness.unwrap_or(self.etcd_endpoints.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(e: &[&str]) -> Vec<String> {
        e.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn backend_config_sets_the_autocomplete_batch_size_and_names_what_it_ignores() {
        let (settings, warnings) = backend_settings(&entries(&["default-max-batch-size=8"])).unwrap();
        assert_eq!(settings.default_max_batch_size, Some(8));
        assert!(warnings.is_empty());
        // The backend's own setting wins over the global one, in either order.
        for order in [
            ["onnxruntime,default-max-batch-size=16", "default-max-batch-size=2"],
            ["default-max-batch-size=2", "onnxruntime,default-max-batch-size=16"],
        ] {
            assert_eq!(backend_settings(&entries(&order)).unwrap().0.default_max_batch_size, Some(16));
        }
        let (settings, warnings) = backend_settings(&entries(&[
            "onnxruntime,enable-global-threadpool=1",
            "tensorflow,version=2",
            "onnxruntime,no-such-setting=1",
        ]))
        .unwrap();
        assert_eq!(settings, BackendSettings::default());
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        assert!(warnings[0].contains("own thread pool"), "{}", warnings[0]);
        assert!(warnings[1].contains("no 'tensorflow' backend"), "{}", warnings[1]);
        assert!(warnings[2].contains("not a setting"), "{}", warnings[2]);
        for bad in ["nonsense", "=4", ",x=1", "default-max-batch-size=-1", "onnxruntime,default-max-batch-size=x"] {
            let e = backend_settings(&entries(&[bad])).unwrap_err();
            assert!(e.starts_with("--backend-config"), "{bad}: {e}");
        }
    }

    #[test]
    fn config_names_are_file_names() {
        assert_eq!(parse_config_name("h100").unwrap(), "h100");
        assert_eq!(parse_config_name("h100.pbtxt").unwrap(), "h100");
        for bad in ["", "a/b", "..", "x\ty"] {
            assert!(parse_config_name(bad).is_err(), "{bad}");
        }
    }
}
