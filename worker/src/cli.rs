//! Command line. Flags follow tritonserver's where they overlap (`--model-repository`,
//! `--http-port`, `--model-control-mode=explicit`, `--strict-model-config=true`, ...), so Triton
//! users' scripts carry over; Nereid's own flags follow.

use std::net::IpAddr;
use std::path::PathBuf;

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

    /// Address the HTTP, gRPC and metrics servers bind to.
    #[arg(long, default_value = "0.0.0.0", value_name = "IP")]
    pub address: IpAddr,

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
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub allow_http: bool,

    /// Serve gRPC.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub allow_grpc: bool,

    /// Serve metrics.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub allow_metrics: bool,

    /// Model control mode: none, poll or explicit.
    #[arg(long, value_enum, default_value = "none")]
    pub model_control_mode: ControlModeArg,

    /// With --model-control-mode=explicit: a model to load at start; repeat; `*` loads all.
    #[arg(long = "load-model", value_name = "NAME")]
    pub load_model: Vec<String>,

    /// With --model-control-mode=poll: seconds between repository scans.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    pub repository_poll_secs: u64,

    /// No auto-completion: a model without config.pbtxt, or whose config lacks inputs or
    /// outputs, fails to load (the reason says why).
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub strict_model_config: bool,

    /// Report the server ready (HTTP /v2/health/ready, gRPC ServerReady) only while every model
    /// it tried to load is READY (a model unloaded on purpose excepted), as tritonserver's
    /// default; false: ready once start-up loading is done, whatever failed. Default: true, but
    /// false with --etcd-endpoints, where placement decides the loads and one bad model must
    /// not take the whole worker out of load balancers (each model's state is in etcd).
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub strict_readiness: Option<bool>,

    /// Exit at start if any model fails to load (Triton's default is true; Nereid keeps
    /// serving the models that loaded and reports the failure in the repository index).
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub exit_on_error: bool,

    /// Allow clients to register system shared-memory regions and pass tensors through them
    /// (Triton's shared-memory extension; the same flag and default as tritonserver). A
    /// registered key opens any POSIX shared-memory object this process can open, so allow it
    /// only where every client that can reach the worker shares the host's trust.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub allow_client_shm: bool,

    /// Verbose logging level (0 = info, 1 = debug, 2+ = trace). RUST_LOG overrides.
    #[arg(long, default_value_t = 0)]
    pub log_verbose: u8,

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

    /// Response cache, as tritonserver takes it: `local,size=BYTES` (the only cache here). Models
    /// opt in with response_cache { enable: true }; without this flag none is cached.
    #[arg(long = "cache-config", value_name = "CACHE,KEY=VALUE")]
    pub cache_config: Vec<String>,

    /// Default ONNX Runtime intra-op threads per instance (a model's
    /// parameters { key: "intra_op_thread_count" } overrides; 0 = ONNX Runtime's default).
    #[arg(long, default_value_t = 1)]
    pub intra_op_threads: usize,

    /// Flush subnormal floats to zero on the threads that run models (FTZ/DAZ, as TensorFlow
    /// does by default): arithmetic on subnormals takes the CPU's slow path, so a model fed
    /// random or tiny values can run far slower. Results change only where an input or an
    /// intermediate value is subnormal (below ~1.2e-38 in FP32, ~2.2e-308 in FP64): it counts
    /// as zero. A model's parameters { key: "nereid.denormal_as_zero" } overrides.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
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
    /// --address, or 127.0.0.1 when that is a wildcard address.
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
}

impl Args {
    /// `--strict-readiness` as given, else its default: true, false in fleet mode.
    pub fn strict_readiness(&self) -> bool {
        self.strict_readiness.unwrap_or(self.etcd_endpoints.is_none())
    }
}
