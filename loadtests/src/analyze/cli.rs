//! `nereid-analyze` flags, parsed once and validated into an [`AnalyzeConfig`]. Errors name
//! the flag.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, ValueEnum};
use nereid_common::config::parse_model_config;
use nereid_proto::inference::ModelConfig;

use super::config::check_base;
use super::frontier::{Constraints, Objective};
use super::report::CHECKPOINT_JSON;
use super::space::{SearchSpace, parse_list};
use super::sweep::{LoadSettings, LoadSpec, Strategy};
use crate::cli::{DistributionArg, ProtocolArg, TlsArgs};
use crate::client::{Protocol, Tls, split_url};
use crate::driver::{Measurement, WindowMode};
use crate::schedule::{Distribution, concurrency_levels, rate_levels};
use crate::workload::{Entry, InputSource, MAX_SLO_MS, ModelInfo, TensorSpec, Workload};

/// Workers tried by default, in order, when neither --worker-bin nor --url is given.
pub const DEFAULT_WORKER_BINS: [&str; 2] = ["target/release/nereid-worker", "target/debug/nereid-worker"];
pub const DEFAULT_OUTPUT_DIR: &str = "nereid-analyze-results";

const EXIT_CODES: &str = "\
Exit codes (as nereid-perf's where they overlap):
  0  every variant visited; a variant meets the constraints and is recommended
  1  internal error, or an output file or the checkpoint could not be written
  2  bad input: invalid flags, model or config.pbtxt, checkpoint for another model; the
     worker cannot be started; the server (--url) cannot be reached (a failed TLS handshake
     included)
  3  the server stopped answering (or the started worker exited) mid-sweep; results so far
     are written and kept in the checkpoint (--resume continues)
  4  results written, but no variant met the constraints (\"no variant met the constraints\")
  5  results written, but no trusted variant met the constraints and some variant met them
     with numbers that cannot be trusted (as nereid-perf's exit 5: no stable measurement
     within --max-trials, or more than 1% of open-loop sends started over 1 ms late). Such
     variants are always listed with their reason but never on the frontier or recommended
  130 interrupted (Ctrl-C); results so far are written and kept in the checkpoint

Each variant: the base config.pbtxt with instance_group count, max_batch_size and
dynamic_batching { preferred_batch_size, max_queue_delay_microseconds } set. The queue policy
can be swept too: --max-queue-sizes and --queue-timeouts-us set dynamic_batching
{ default_queue_policy { max_queue_size, default_timeout_microseconds, timeout_action: REJECT } }
(0 sets nothing, keeping the base config's value). --priority-levels sets dynamic_batching
{ priority_levels: N default_priority_level: N }; with N >= 2 the swept queue policy goes to
priority_queue_policy for levels 2..N, so the top priority is never shed. Use a --workload
whose entries send \"priority\" (per-class SLOs and results per class). An invalid combination
(preferred > max batch, batching settings, a queue policy or priority levels with
max_batch_size 0) is skipped with its reason.
The variant is unloaded and loaded through the repository API (explicit model control,
Triton's parameters.config override); a load the server refuses is recorded with the
server's message and the sweep goes on. Then one nereid-perf load level is measured (warm-up,
windows until stable) while the worker's VmRSS is sampled every 100 ms (the peak is
reported; where /metrics carries nv_gpu_memory_used_bytes, the GPU memory in use too). With --concurrency-range or --request-rate-range each variant is measured at every
level (stopping at the first that misses the SLO) and credited with its best level: the best
by the objective among levels meeting the constraints, else the one closest to meeting them.
Requests the queue policy rejects count as errors, not toward throughput; --max-error-percent
keeps such variants from winning by refusing work.

Search: brute measures every variant; quick climbs from the smallest values one step along one
dimension at a time (queue delay, queue policy and priority levels included), moving to the best neighbour
while it improves, measuring at most --max-variants. Variants meeting the constraints beat
those that do not.

Outputs in --output-dir: results.json, results.csv, report.html, checkpoint.json (rewritten
after every variant), recommended/config.pbtxt, variants/KEY/config.pbtxt (every variant that
has a config, skipped ones excepted), worker.log (with --worker-bin).";

/// Config sweeps for a model on a KServe v2 server (Model Analyzer's job): measures each
/// variant of a search space, reports the Pareto frontier (throughput vs p99 vs memory) and
/// writes the best config under the constraints as a ready config.pbtxt.
#[derive(Parser, Debug, Clone)]
#[command(name = "nereid-analyze", version, after_help = EXIT_CODES)]
pub struct AnalyzeArgs {
    /// Model repository holding the model; its config.pbtxt is the base of every variant.
    #[arg(long, value_name = "DIR")]
    pub model_repository: PathBuf,
    /// Model to sweep.
    #[arg(short = 'm', long)]
    pub model: String,
    /// Start this nereid-worker (explicit model control, OS-assigned ports) and sweep it
    /// [default: target/release/nereid-worker if it exists, else target/debug/nereid-worker].
    // Every --url-only flag is listed: clap does not apply `requires = "url"` once a flag that
    // conflicts with --url is given.
    #[arg(
        long,
        value_name = "PATH",
        conflicts_with_all = ["url", "worker_pid", "metrics_url", "ssl", "ssl_ca", "ssl_cert", "ssl_key"]
    )]
    pub worker_bin: Option<PathBuf>,
    /// Extra argument for the started worker (repeat), e.g. --worker-arg=--intra-op-threads=2.
    #[arg(long = "worker-arg", value_name = "ARG", allow_hyphen_values = true, conflicts_with = "url")]
    pub worker_args: Vec<String>,
    /// Sweep an already-running server in explicit model-control mode at host:port or
    /// http(s)://host:port (its gRPC port with -i grpc, its HTTP port with -i http; https://
    /// turns TLS on).
    #[arg(short = 'u', long)]
    pub url: Option<String>,
    /// TLS for the measurement, the repository API and an https:// --metrics-url; with --url
    /// only (a started worker serves plain HTTP and gRPC).
    #[command(flatten)]
    pub tls: TlsArgs,
    /// With --url: the server's process id, to read its memory (else memory is unknown).
    #[arg(long, requires = "url")]
    pub worker_pid: Option<u32>,
    /// With --url: Prometheus endpoint for the server's average batch size: host:port or an
    /// http:// or https:// URL (HTTPS trusts what the --ssl flags trust, else the system's CA
    /// bundle) [default: the --url host, port 8002, /metrics, plain HTTP].
    #[arg(long, requires = "url")]
    pub metrics_url: Option<String>,
    /// Do not scrape /metrics.
    #[arg(long, conflicts_with = "metrics_url")]
    pub no_server_stats: bool,
    /// Wire protocol of the measurement and the repository API.
    #[arg(short = 'i', long, value_enum, default_value = "grpc")]
    pub protocol: ProtocolArg,
    /// HTTP: binary tensors instead of JSON.
    #[arg(long)]
    pub http_binary: bool,

    /// Instance counts to try (comma-separated).
    #[arg(long, default_value = "1,2")]
    pub instance_counts: String,
    /// max_batch_size values to try (0: no batching).
    #[arg(long, default_value = "1,8,32")]
    pub max_batch_sizes: String,
    /// dynamic_batching.preferred_batch_size values to try (0: none).
    #[arg(long, default_value = "0")]
    pub preferred_batch_sizes: String,
    /// dynamic_batching.max_queue_delay_microseconds values to try.
    #[arg(long, default_value = "0,100,1000")]
    pub max_queue_delays_us: String,
    /// dynamic_batching.default_queue_policy.max_queue_size values to try (0: not set, so
    /// unbounded unless the base config sets one). A full queue rejects requests at once: they count as errors, not
    /// toward throughput or goodput (see the errors column of results.csv).
    #[arg(long, default_value = "0")]
    pub max_queue_sizes: String,
    /// dynamic_batching.default_queue_policy.default_timeout_microseconds values to try, with
    /// timeout_action REJECT (0: not set, so none unless the base config sets one). Requests queued longer are
    /// rejected: they count as errors, not toward throughput or goodput.
    #[arg(long, default_value = "0")]
    pub queue_timeouts_us: String,
    /// dynamic_batching.priority_levels values to try (0: the base config's), the lowest
    /// level being the default. With 2 or more levels the swept queue policy applies to every
    /// level but the top one (priority_queue_policy). Give a --workload whose entries set
    /// "priority" to send requests at several levels.
    #[arg(long, default_value = "0")]
    pub priority_levels: String,
    /// Workload file (nereid-perf's format) instead of -b/--batch-size: weighted entries with
    /// batch sizes and shape mixes, priorities, deadlines and per-class SLOs. Every entry must
    /// name --model and no version.
    #[arg(long, value_name = "FILE", conflicts_with = "batch_size")]
    pub workload: Option<PathBuf>,

    /// Constraint: at least 99% of completed requests succeeded within this many
    /// milliseconds, failed ones counting as over (also goodput's SLO unless --slo-p99-ms is
    /// given; at most 3600000).
    #[arg(long)]
    pub max_p99_ms: Option<f64>,
    /// Constraint: the worker's peak RSS at most this many MiB (needs a known PID).
    #[arg(long)]
    pub max_memory_mb: Option<f64>,
    /// Constraint: GPU memory in use at most this many MiB, summed over the server's GPUs
    /// (nv_gpu_memory_used_bytes from its /metrics, highest at any scrape of the level).
    #[arg(long, conflicts_with = "no_server_stats")]
    pub max_gpu_memory_mb: Option<f64>,
    /// Constraint: failed requests (e.g. rejected by a swept queue policy) at most this
    /// percentage of the completed ones. Recommended with --max-queue-sizes /
    /// --queue-timeouts-us: without it, a variant can look good by refusing work.
    #[arg(long, value_name = "PERCENT")]
    pub max_error_percent: Option<f64>,
    /// Latency SLO for goodput, in milliseconds [default: --max-p99-ms].
    #[arg(long)]
    pub slo_p99_ms: Option<f64>,
    /// What the recommendation maximizes among variants meeting the constraints.
    #[arg(long, value_enum, default_value = "goodput")]
    pub objective: Objective,
    /// brute: every variant; quick: hill climbing, at most --max-variants measured.
    #[arg(long, value_enum, default_value = "brute")]
    pub search: SearchArg,
    /// Quick search: most variants measured.
    #[arg(long, default_value_t = 16)]
    pub max_variants: usize,

    /// Closed loop: requests outstanding while each variant is measured [default: 4].
    #[arg(long, conflicts_with_all = ["request_rate", "concurrency_range", "request_rate_range"])]
    pub concurrency: Option<u32>,
    /// Closed loop at several levels per variant (start:end[:step], as nereid-perf's): each
    /// variant is credited with its best level (by the objective, among levels meeting the
    /// constraints); levels stop at the first one that misses the SLO.
    #[arg(long, value_name = "START:END[:STEP]", conflicts_with_all = ["request_rate", "request_rate_range"])]
    pub concurrency_range: Option<String>,
    /// Open loop: requests per second instead of a concurrency.
    #[arg(long, conflicts_with = "request_rate_range")]
    pub request_rate: Option<f64>,
    /// Open loop at several rates per variant (start:end[:step] requests per second), each
    /// variant credited with its best level as with --concurrency-range.
    #[arg(long, value_name = "START:END[:STEP]")]
    pub request_rate_range: Option<String>,
    /// Open-loop arrival spacing.
    #[arg(long, value_enum, default_value = "constant")]
    pub request_distribution: DistributionArg,
    /// Rows per request (every max_batch_size tried must allow it).
    #[arg(short = 'b', long, default_value_t = 1)]
    pub batch_size: u32,
    /// Input contents, as nereid-perf's --input-data: zero, random, or the path of a JSON input
    /// data file in perf_analyzer's format (see nereid-perf --help); read and checked against
    /// the model's inputs before the sweep. A workload entry's "data" overrides it.
    #[arg(long, value_name = "zero|random|FILE.json", default_value = "random")]
    pub input_data: String,
    /// Sent as `authorization: Bearer <key>` with every measured request (by workload entries
    /// without their own api_key), as nereid-perf's --api-key, and with every repository call
    /// (load, unload, liveness).
    #[arg(long, env = "NEREID_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// system: pass tensors through POSIX shared memory registered with the server (as
    /// nereid-perf's --shared-memory; a started worker gets --allow-client-shm=true).
    #[arg(long, value_enum, default_value = "none")]
    pub shared_memory: crate::cli::SharedMemoryArg,
    /// With --shared-memory system: bytes reserved for each model output.
    #[arg(long, default_value_t = 102_400, value_parser = clap::value_parser!(u64).range(1..))]
    pub output_shared_memory_size: u64,
    /// Length of a measurement window, in milliseconds.
    #[arg(short = 'p', long, default_value_t = 2000)]
    pub measurement_interval: u64,
    /// Load before the first window of each variant, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub warmup_ms: u64,
    /// Stability band in percent (nereid-perf's -s).
    #[arg(short = 's', long, default_value_t = 10.0)]
    pub stability_percentage: f64,
    /// Most windows per variant.
    #[arg(short = 'r', long, default_value_t = 5)]
    pub max_trials: u32,
    #[arg(long, default_value_t = 10_000)]
    pub request_timeout_ms: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Where results, the report, the checkpoint and the recommended config go.
    #[arg(short = 'o', long, default_value = DEFAULT_OUTPUT_DIR)]
    pub output_dir: PathBuf,
    /// Checkpoint file [default: OUTPUT_DIR/checkpoint.json].
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Reuse every variant the checkpoint already holds (same key) instead of measuring it.
    #[arg(long)]
    pub resume: bool,
    /// Longest a model load (or unload) may take, in seconds.
    #[arg(long, default_value_t = 120)]
    pub load_timeout_s: u64,
    /// Longest the started worker may take to listen, in seconds.
    #[arg(long, default_value_t = 60)]
    pub worker_start_timeout_s: u64,
    /// Generator threads (tokio workers).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// No progress lines on stderr.
    #[arg(short = 'q', long)]
    pub quiet: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SearchArg {
    Brute,
    Quick,
}

/// Which server to sweep.
#[derive(Clone, Debug)]
pub enum ServerChoice {
    /// Start this worker binary (plain TCP on 127.0.0.1: a started worker has no TLS).
    Start { bin: PathBuf, args: Vec<String>, start_timeout: Duration },
    /// An already-running server at `url` (`host:port`), over TLS when `tls` is set (the
    /// measurement, the repository API and an `https://` metrics URL alike).
    External { url: String, pid: Option<u32>, metrics_url: Option<String>, tls: Option<Tls> },
}

/// Everything `nereid-analyze` needs, validated.
#[derive(Clone, Debug)]
pub struct AnalyzeConfig {
    pub model: String,
    pub model_repository: PathBuf,
    pub base: ModelConfig,
    pub server: ServerChoice,
    pub scrape_metrics: bool,
    pub space: SearchSpace,
    pub strategy: Strategy,
    pub constraints: Constraints,
    pub objective: Objective,
    pub load: LoadSettings,
    pub output_dir: PathBuf,
    pub checkpoint: PathBuf,
    pub resume: bool,
    pub load_timeout: Duration,
    pub threads: usize,
    pub quiet: bool,
}

impl AnalyzeArgs {
    pub fn into_config(self) -> Result<AnalyzeConfig, String> {
        let positive = |flag: &str, v: Option<f64>| match v {
            Some(x) if !(x.is_finite() && x > 0.0) => Err(format!("{flag} {x}: must be a positive number")),
            _ => Ok(()),
        };
        // An SLO (the p99 limit is goodput's by default) becomes a Duration: at most an hour.
        let latency = |flag: &str, v: Option<f64>| match v {
            Some(x) if x > MAX_SLO_MS => Err(format!("{flag} {x}: must be at most {MAX_SLO_MS} ms (1 hour)")),
            _ => Ok(()),
        };
        positive("--max-p99-ms", self.max_p99_ms)?;
        latency("--max-p99-ms", self.max_p99_ms)?;
        positive("--max-memory-mb", self.max_memory_mb)?;
        positive("--max-gpu-memory-mb", self.max_gpu_memory_mb)?;
        if let Some(e) = self.max_error_percent
            && !(e.is_finite() && (0.0..=100.0).contains(&e))
        {
            return Err(format!("--max-error-percent {e}: must be between 0 and 100"));
        }
        positive("--slo-p99-ms", self.slo_p99_ms)?;
        latency("--slo-p99-ms", self.slo_p99_ms)?;
        positive("--request-rate", self.request_rate)?;

        let base = read_base(&self.model_repository, &self.model)?;
        let space = SearchSpace::new(
            parse_list("--instance-counts", &self.instance_counts).map_err(|e| e.0)?,
            parse_list("--max-batch-sizes", &self.max_batch_sizes).map_err(|e| e.0)?,
            parse_list("--preferred-batch-sizes", &self.preferred_batch_sizes).map_err(|e| e.0)?,
            parse_list("--max-queue-delays-us", &self.max_queue_delays_us).map_err(|e| e.0)?,
        )
        .and_then(|space| {
            space.with_queue_policy(
                parse_list("--max-queue-sizes", &self.max_queue_sizes)?,
                parse_list("--queue-timeouts-us", &self.queue_timeouts_us)?,
            )
        })
        .and_then(|space| space.with_priority_levels(parse_list("--priority-levels", &self.priority_levels)?))
        .map_err(|e| e.0)?;
        let slo_p99_ms = self.slo_p99_ms.or(self.max_p99_ms);
        let workload = match &self.workload {
            None => None,
            Some(path) => Some(read_workload(path, &self.model, slo_p99_ms)?),
        };
        let input_data = InputSource::from_arg(&self.input_data).map_err(|e| format!("--input-data: {e}"))?;
        check_input_data(&input_data, &base, &self.model, &space.max_batch_sizes, workload.as_ref(), self.batch_size)?;
        let input_digests = input_digests(self.workload.as_deref(), workload.as_ref(), &input_data)?;
        // The measured SLO verdict is the p99 constraint's only when every class's SLO is its
        // limit (a workload class's own slo_ms overrides the default SLO).
        let slo_is_max_p99 = match (self.max_p99_ms, &workload) {
            (None, _) => false,
            (Some(max), Some(w)) => w.series.iter().all(|s| s.slo_ms == Some(max)),
            (Some(max), None) => slo_p99_ms == Some(max),
        };
        if let Some(key) = &self.api_key
            && (key.is_empty() || !key.chars().all(|c| c.is_ascii_graphic()))
        {
            return Err("--api-key: must be a non-empty token of visible ASCII characters (no spaces)".into());
        }
        let strategy = match self.search {
            SearchArg::Brute => Strategy::Brute,
            SearchArg::Quick if self.max_variants == 0 => return Err("--max-variants: must be at least 1".into()),
            SearchArg::Quick => Strategy::Quick { max_variants: self.max_variants },
        };

        let protocol = match (self.protocol, self.http_binary) {
            (ProtocolArg::Grpc, true) => return Err("--http-binary needs --protocol http".into()),
            (ProtocolArg::Grpc, false) => Protocol::Grpc,
            (ProtocolArg::Http, binary) => Protocol::Http { binary },
        };
        if self.url.is_none() && self.tls.given() {
            return Err("--ssl, --ssl-ca, --ssl-cert and --ssl-key need --url (a started worker serves plain \
                        HTTP and gRPC)"
                .into());
        }
        let shared_memory =
            (self.shared_memory == crate::cli::SharedMemoryArg::System).then_some(self.output_shared_memory_size);
        let server = match (&self.url, &self.worker_bin) {
            (Some(url), _) => {
                let (url, https) = split_url(url).map_err(|e| format!("--url {e}"))?;
                let tls = self.tls.tls(https)?;
                ServerChoice::External { url, pid: self.worker_pid, metrics_url: self.metrics_url.clone(), tls }
            }
            (None, bin) => {
                let bin = match bin {
                    Some(b) if b.is_file() => b.clone(),
                    Some(b) => return Err(format!("--worker-bin {}: no such file", b.display())),
                    None => DEFAULT_WORKER_BINS.iter().map(PathBuf::from).find(|p| p.is_file()).ok_or_else(|| {
                        format!(
                            "no worker to start: neither {} exists; give --worker-bin PATH or --url HOST:PORT",
                            DEFAULT_WORKER_BINS.join(" nor ")
                        )
                    })?,
                };
                let mut args = self.worker_args.clone();
                if shared_memory.is_some() && !args.iter().any(|a| a.starts_with("--allow-client-shm")) {
                    args.push("--allow-client-shm=true".into());
                }
                ServerChoice::Start {
                    bin,
                    args,
                    start_timeout: Duration::from_secs(self.worker_start_timeout_s.max(1)),
                }
            }
        };

        if self.measurement_interval == 0 {
            return Err("--measurement-interval: must be at least 1 ms".into());
        }
        if !(self.stability_percentage.is_finite() && self.stability_percentage > 0.0) {
            return Err(format!("--stability-percentage {}: must be above 0", self.stability_percentage));
        }
        if self.max_trials == 0 {
            return Err("--max-trials: must be at least 1".into());
        }
        if self.request_timeout_ms == 0 {
            return Err("--request-timeout-ms: must be at least 1".into());
        }
        if self.threads == 0 {
            return Err("--threads: must be at least 1".into());
        }
        if self.batch_size == 0 {
            return Err("--batch-size: must be at least 1".into());
        }
        let distribution = match self.request_distribution {
            DistributionArg::Constant => Distribution::Constant,
            DistributionArg::Poisson => Distribution::Poisson,
        };
        let load = if let Some(range) = &self.concurrency_range {
            LoadSpec::Concurrency(concurrency_levels(range).map_err(|e| e.to_string())?)
        } else if let Some(range) = &self.request_rate_range {
            LoadSpec::RequestRate { rates: rate_levels(range).map_err(|e| e.to_string())?, distribution }
        } else {
            match (self.concurrency, self.request_rate) {
                (Some(0), _) => return Err("--concurrency: must be at least 1".into()),
                (Some(c), None) => LoadSpec::Concurrency(vec![c]),
                (None, Some(rate)) => LoadSpec::RequestRate { rates: vec![rate], distribution },
                _ => LoadSpec::Concurrency(vec![4]),
            }
        };
        // nereid-perf's connections: over HTTP, one per concurrent request.
        if let (Protocol::Http { .. }, LoadSpec::Concurrency(levels)) = (protocol, &load)
            && let Some(&c) = levels.iter().find(|&&c| c as usize > crate::cli::MAX_CONNECTIONS)
        {
            let flag = if self.concurrency_range.is_some() { "--concurrency-range" } else { "--concurrency" };
            return Err(format!(
                "{flag}: {c} concurrent requests over HTTP would open as many connections, at most {}",
                crate::cli::MAX_CONNECTIONS
            ));
        }
        let checkpoint = self.checkpoint.clone().unwrap_or_else(|| self.output_dir.join(CHECKPOINT_JSON));
        Ok(AnalyzeConfig {
            model: self.model.clone(),
            model_repository: self.model_repository.clone(),
            base,
            server,
            scrape_metrics: !self.no_server_stats,
            space,
            strategy,
            constraints: Constraints {
                max_p99_ms: self.max_p99_ms,
                max_memory_mb: self.max_memory_mb,
                max_gpu_memory_mb: self.max_gpu_memory_mb,
                max_error_percent: self.max_error_percent,
                slo_is_max_p99,
            },
            objective: self.objective,
            load: LoadSettings {
                protocol,
                shared_memory,
                load,
                batch_size: self.batch_size,
                input_data,
                api_key: self.api_key.clone(),
                slo_p99_ms,
                workload_file: self.workload.as_ref().map(|p| p.display().to_string()),
                workload,
                input_digests,
                latency_limit_ms: self.max_p99_ms,
                measurement: Measurement {
                    window: WindowMode::Time { ms: self.measurement_interval },
                    warmup_ms: self.warmup_ms,
                    stability_percentage: self.stability_percentage,
                    max_trials: self.max_trials,
                    request_timeout_ms: self.request_timeout_ms,
                    max_inflight: 4096,
                },
                seed: self.seed,
            },
            output_dir: self.output_dir,
            checkpoint,
            resume: self.resume,
            load_timeout: Duration::from_secs(self.load_timeout_s.max(1)),
            threads: self.threads,
            quiet: self.quiet,
        })
    }
}

/// A digest of the contents of every file the measured requests come from — the `--workload`
/// file, the input data files its entries name, the `--input-data` file — by path, so that a
/// resume after one of them was edited reuses nothing (the checkpoint's settings differ).
fn input_digests(
    workload_path: Option<&Path>,
    workload: Option<&Workload>,
    input_data: &InputSource,
) -> Result<std::collections::BTreeMap<String, String>, String> {
    let mut paths: Vec<(String, PathBuf)> = Vec::new();
    if let Some(p) = workload_path {
        paths.push(("--workload".into(), p.to_path_buf()));
    }
    let data_files = workload.into_iter().flat_map(|w| w.data.iter().flatten()).chain(std::iter::once(input_data));
    for source in data_files {
        if let InputSource::File(f) = source {
            paths.push(("input data".into(), PathBuf::from(&f.path)));
        }
    }
    let mut digests = std::collections::BTreeMap::new();
    for (what, path) in paths {
        let shown = path.display().to_string();
        if digests.contains_key(&shown) {
            continue;
        }
        let bytes = std::fs::read(&path).map_err(|e| format!("{what} {shown}: cannot read it: {e}"))?;
        digests.insert(shown, super::sweep::content_digest(&bytes));
    }
    Ok(digests)
}

/// Reads and checks a `--workload` file: valid for nereid-perf, and every entry for `model`
/// without a version (the sweep loads the variant's versions as its config says).
fn read_workload(path: &Path, model: &str, slo_p99_ms: Option<f64>) -> Result<Workload, String> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| format!("--workload {shown}: cannot read it: {e}"))?;
    let workload = Workload::from_json(&shown, &text, slo_p99_ms).map_err(|e| e.0)?;
    for (i, e) in workload.entries.iter().enumerate() {
        let name = workload.entry_name(i);
        if e.model != model {
            return Err(format!(
                "workload file {shown}: {name}.model: '{}' is not the swept model '{model}' (--model)",
                e.model
            ));
        }
        if e.version.is_some() {
            return Err(format!(
                "workload file {shown}: {name}.version: leave it out; each variant is loaded with the versions its \
                 config serves"
            ));
        }
    }
    Ok(workload)
}

/// The model as the server's metadata would describe it when loaded with `base`'s inputs and
/// `max_batch_size` (a leading -1 batch dimension when it batches); `None` when the config does
/// not list its inputs or uses a datatype the generator does not know (then the server's
/// metadata is the only judge, at each variant).
fn model_info_of(base: &ModelConfig, model: &str, max_batch_size: u32) -> Option<ModelInfo> {
    use nereid_common::dtype::DataType;
    let spec = |name: &str, data_type: i32, dims: &[i64]| -> Option<TensorSpec> {
        let datatype = DataType::from_config_value(data_type)?.wire_name().to_string();
        let batch = (max_batch_size > 0).then_some(-1);
        Some(TensorSpec { name: name.into(), datatype, shape: batch.into_iter().chain(dims.iter().copied()).collect() })
    };
    if base.input.is_empty() {
        return None;
    }
    Some(ModelInfo {
        name: model.into(),
        versions: Vec::new(),
        max_batch_size,
        inputs: base.input.iter().map(|i| spec(&i.name, i.data_type, &i.dims)).collect::<Option<_>>()?,
        outputs: base.output.iter().map(|o| spec(&o.name, o.data_type, &o.dims)).collect::<Option<_>>()?,
    })
}

/// Checks an `--input-data` file against the model before the sweep (every entry that takes
/// it, under each batching mode of `max_batch_sizes`), so that a mismatch is exit 2 naming the
/// file and key instead of a failure at every variant.
fn check_input_data(
    source: &InputSource,
    base: &ModelConfig,
    model: &str,
    max_batch_sizes: &[u32],
    workload: Option<&Workload>,
    batch_size: u32,
) -> Result<(), String> {
    let InputSource::File(file) = source else { return Ok(()) };
    let flags_entry = Entry { batch_size, ..Entry::for_model(model) };
    let entries: Vec<&Entry> = match workload {
        Some(w) => w.entries.iter().enumerate().filter(|(i, _)| w.data[*i].is_none()).map(|(_, e)| e).collect(),
        None => vec![&flags_entry],
    };
    // One model without batching and one with (the smallest max batch the sweep tries).
    let modes =
        [max_batch_sizes.iter().copied().find(|b| *b == 0), max_batch_sizes.iter().copied().filter(|b| *b > 0).min()];
    for max_batch_size in modes.into_iter().flatten() {
        let Some(info) = model_info_of(base, model, max_batch_size) else { return Ok(()) };
        for entry in &entries {
            file.requests(entry, &info).map_err(|e| format!("--input-data: {}", e.0))?;
        }
    }
    Ok(())
}

/// Reads and checks `DIR/MODEL/config.pbtxt`.
pub fn read_base(repository: &Path, model: &str) -> Result<ModelConfig, String> {
    if model.is_empty() || model.contains(['/', '\\']) || model == "." || model == ".." {
        return Err(format!("--model '{model}': not a model directory name"));
    }
    let dir = repository.join(model);
    if !dir.is_dir() {
        return Err(format!("--model {model}: no directory {} in --model-repository", dir.display()));
    }
    let path = dir.join("config.pbtxt");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: cannot read it: {e}", path.display()))?;
    let config = parse_model_config(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    check_base(&config).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::super::sweep::ServerHandle;
    use super::*;

    fn repo() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m");
        std::fs::create_dir(&model).unwrap();
        std::fs::write(
            model.join("config.pbtxt"),
            "name: \"m\"\nmax_batch_size: 8\ninput [ { name: \"I\" data_type: TYPE_FP32 dims: [ 4 ] } ]\n\
             output [ { name: \"O\" data_type: TYPE_FP32 dims: [ 4 ] } ]\n",
        )
        .unwrap();
        let worker = dir.path().join("worker");
        std::fs::write(&worker, "").unwrap();
        (dir, worker)
    }

    fn parse(repo: &Path, extra: &[&str]) -> Result<AnalyzeConfig, String> {
        let mut argv = vec!["nereid-analyze", "--model-repository", repo.to_str().unwrap(), "-m", "m"];
        argv.extend_from_slice(extra);
        AnalyzeArgs::try_parse_from(argv).map_err(|e| e.to_string())?.into_config()
    }

    #[test]
    fn flags_build_a_sweep() {
        let (dir, worker) = repo();
        let c = parse(
            dir.path(),
            &[
                "--worker-bin",
                worker.to_str().unwrap(),
                "--instance-counts",
                "2,1",
                "--max-batch-sizes",
                "8",
                "--max-queue-delays-us",
                "0,500",
                "--max-p99-ms",
                "20",
                "--search",
                "quick",
                "--max-variants",
                "3",
                "--worker-arg=--intra-op-threads=2",
            ],
        )
        .unwrap();
        assert_eq!(c.space.len(), 2 * 2);
        assert!(!c.space.sweeps_queue_policy(), "no queue policy by default");
        assert_eq!(c.strategy, Strategy::Quick { max_variants: 3 });
        assert_eq!(c.load.slo_p99_ms, Some(20.0), "the p99 constraint is the SLO");
        assert_eq!(c.load.load, LoadSpec::Concurrency(vec![4]));
        assert_eq!(c.checkpoint, PathBuf::from(DEFAULT_OUTPUT_DIR).join("checkpoint.json"));
        let ServerChoice::Start { args, .. } = &c.server else { panic!("{:?}", c.server) };
        assert_eq!(args, &vec!["--intra-op-threads=2".to_string()]);
        let c = parse(
            dir.path(),
            &[
                "--worker-bin",
                worker.to_str().unwrap(),
                "--instance-counts",
                "1",
                "--max-batch-sizes",
                "8",
                "--max-queue-delays-us",
                "0",
                "--max-queue-sizes",
                "0,64",
                "--queue-timeouts-us",
                "5000,0,5000",
            ],
        )
        .unwrap();
        assert_eq!(c.space.max_queue_sizes, vec![0, 64]);
        assert_eq!(c.space.queue_timeouts_us, vec![0, 5000]);
        assert_eq!(c.space.len(), 4);
        let c = parse(dir.path(), &["-u", "http://h:9", "--worker-pid", "42", "--request-rate", "100"]).unwrap();
        let ServerChoice::External { url, pid, metrics_url, tls } = &c.server else { panic!("{:?}", c.server) };
        assert_eq!((url.as_str(), *pid, metrics_url), ("h:9", Some(42), &None));
        assert!(tls.is_none(), "plain TCP unless asked");
        assert!(matches!(c.load.load, LoadSpec::RequestRate { ref rates, .. } if rates == &[100.0]));
        let c =
            parse(dir.path(), &["--worker-bin", worker.to_str().unwrap(), "--concurrency-range", "1:16:5"]).unwrap();
        assert_eq!(c.load.load, LoadSpec::Concurrency(vec![1, 6, 11, 16]));
        assert_eq!(c.load.describe(), "concurrency 1, 6, 11, 16 (each variant at its best level)");
        let c = parse(dir.path(), &["-u", "h:9", "--request-rate-range", "100:300:100"]).unwrap();
        assert!(matches!(c.load.load, LoadSpec::RequestRate { ref rates, .. } if rates == &[100.0, 200.0, 300.0]));
        assert_eq!(c.load.describe(), "100, 200, 300 req/s (constant) (each variant at its best level)");
    }

    #[test]
    fn errors_name_the_flag() {
        let (dir, worker) = repo();
        let w = worker.to_str().unwrap();
        let e = |extra: &[&str]| parse(dir.path(), extra).unwrap_err();
        assert!(e(&["--worker-bin", w, "--instance-counts", "0"]).contains("--instance-counts"));
        assert!(e(&["--worker-bin", w, "--max-batch-sizes", "x"]).contains("--max-batch-sizes"));
        assert!(e(&["--worker-bin", w, "--max-p99-ms", "0"]).contains("--max-p99-ms"));
        assert!(e(&["--worker-bin", w, "--max-queue-sizes", "4,x"]).contains("--max-queue-sizes"));
        assert!(e(&["--worker-bin", w, "--concurrency-range", "4:1"]).contains("--concurrency-range"));
        assert!(e(&["--worker-bin", w, "--priority-levels", "1,x"]).contains("--priority-levels"));
        assert!(e(&["--worker-bin", w, "--max-gpu-memory-mb", "0"]).contains("--max-gpu-memory-mb"));
        assert!(e(&["--worker-bin", w, "--max-gpu-memory-mb", "1", "--no-server-stats"]).contains("cannot be used"));
        let missing = e(&["--worker-bin", w, "--workload", "/nonexistent/w.json"]);
        assert!(missing.contains("--workload /nonexistent/w.json: cannot read it"), "{missing}");
        let file = dir.path().join("w.json");
        std::fs::write(&file, r#"{"entries": [{"model": "m", "batch_size": 0}]}"#).unwrap();
        let f = file.to_str().unwrap();
        assert!(e(&["--worker-bin", w, "--workload", f]).contains("entries[0].batch_size: must be at least 1"));
        std::fs::write(&file, r#"{"entries": [{"model": "m", "version": 2}]}"#).unwrap();
        assert!(e(&["--worker-bin", w, "--workload", f]).contains("entries[0].version: leave it out"));
        std::fs::write(&file, r#"{"entries": [{"model": "m"}]}"#).unwrap();
        assert!(e(&["--worker-bin", w, "--workload", f, "-b", "2"]).contains("cannot be used"));
        assert!(parse(dir.path(), &["--worker-bin", w, "--workload", f]).unwrap().load.workload.is_some());
        assert!(e(&["--worker-bin", w, "--concurrency-range", "0:4"]).contains("--concurrency-range"));
        assert!(e(&["--worker-bin", w, "--request-rate-range", "x"]).contains("--request-rate-range"));
        assert!(e(&["--worker-bin", w, "--concurrency", "2", "--concurrency-range", "1:4"]).contains("cannot be used"));
        assert!(e(&["--worker-bin", w, "--max-error-percent", "101"]).contains("--max-error-percent"));
        assert!(e(&["--worker-bin", w, "--max-error-percent", "NaN"]).contains("--max-error-percent"));
        assert!(e(&["--worker-bin", w, "--queue-timeouts-us", ","]).contains("--queue-timeouts-us"));
        assert!(e(&["--worker-bin", "/nonexistent/w"]).contains("--worker-bin"));
        assert!(e(&["--worker-bin", w, "--url", "h:1"]).contains("cannot be used with"));
        assert!(e(&["--worker-pid", "1"]).contains("--url"));
        assert!(e(&["--worker-bin", w, "--search", "quick", "--max-variants", "0"]).contains("--max-variants"));
        let missing = AnalyzeArgs::try_parse_from([
            "nereid-analyze",
            "--model-repository",
            dir.path().to_str().unwrap(),
            "-m",
            "nope",
            "--worker-bin",
            w,
        ])
        .unwrap()
        .into_config()
        .unwrap_err();
        assert!(missing.contains("--model nope"), "{missing}");
    }

    #[test]
    fn input_data_and_api_key_are_nereid_perfs() {
        let (dir, worker) = repo();
        let w = worker.to_str().unwrap();
        let c = parse(dir.path(), &["--worker-bin", w]).unwrap();
        assert_eq!(c.load.input_data, InputSource::Generated(crate::workload::InputData::Random));
        assert_eq!(c.load.api_key, None);
        let c = parse(dir.path(), &["--worker-bin", w, "--input-data", "zero", "--api-key", "k-1"]).unwrap();
        assert_eq!(c.load.input_data, InputSource::Generated(crate::workload::InputData::Zero));
        assert_eq!(serde_json::to_value(&c.load).unwrap()["input_data"], "zero");
        assert!(!serde_json::to_string(&c.load).unwrap().contains("k-1"), "the key is never written out");

        // The key reaches every measured request: entries without their own key get it.
        let server = ServerHandle {
            url: "127.0.0.1:1".into(),
            tls: None,
            repository: super::super::server::RepositoryClient::new(
                Protocol::Grpc,
                "127.0.0.1:1",
                Duration::from_secs(1),
                None,
            ),
            metrics_url: None,
            pid: None,
            worker: None,
        };
        let run = c.load.run_config("m", &server).unwrap();
        assert_eq!(run.workload.entries[0].api_key.as_deref(), Some("k-1"));
        assert_eq!(run.workload.default_api_key.as_deref(), Some("k-1"), "metadata calls too");
        assert_eq!(run.input_data, InputSource::Generated(crate::workload::InputData::Zero));
        let file = dir.path().join("w.json");
        std::fs::write(&file, r#"{"entries": [{"model": "m", "api_key": "own"}, {"model": "m"}]}"#).unwrap();
        let c =
            parse(dir.path(), &["--worker-bin", w, "--workload", file.to_str().unwrap(), "--api-key", "k-1"]).unwrap();
        let keys: Vec<Option<String>> =
            c.load.run_config("m", &server).unwrap().workload.entries.iter().map(|e| e.api_key.clone()).collect();
        assert_eq!(keys, [Some("own".into()), Some("k-1".into())]);

        // An input data file, read and checked against the model's inputs before the sweep.
        let data = dir.path().join("data.json");
        std::fs::write(&data, r#"{"data": [{"I": [1, 2, 3, 4]}, {"I": [5, 6, 7, 8]}]}"#).unwrap();
        let d = data.to_str().unwrap();
        let c =
            parse(dir.path(), &["--worker-bin", w, "--input-data", d, "--max-batch-sizes", "0,8", "-b", "2"]).unwrap();
        let InputSource::File(f) = &c.load.input_data else { panic!("{:?}", c.load.input_data) };
        assert_eq!(f.entries.len(), 2);
        assert_eq!(serde_json::to_value(&c.load).unwrap()["input_data"], d);
        assert!(c.load.describe().contains(&format!(", input data {d}")), "a resume under other data warns");
        let run = c.load.run_config("m", &server).unwrap();
        assert!(matches!(run.input_data, InputSource::File(_)));

        let e = |extra: &[&str]| parse(dir.path(), &[&["--worker-bin", w][..], extra].concat()).unwrap_err();
        let missing = e(&["--input-data", "/nonexistent/d.json"]);
        assert!(missing.contains("--input-data") && missing.contains("/nonexistent/d.json"), "{missing}");
        std::fs::write(&data, r#"{"data": [{"X": [1, 2, 3, 4]}]}"#).unwrap();
        let wrong = e(&["--input-data", d]);
        assert!(
            wrong.contains("--input-data") && wrong.contains("data[0].X") && wrong.contains("no input 'X'"),
            "{wrong}"
        );
        std::fs::write(&data, r#"{"data": [{"I": [1, 2, 3]}]}"#).unwrap();
        let short = e(&["--input-data", d]);
        assert!(short.contains("data[0].I") && short.contains("3 values given"), "{short}");
        std::fs::write(&data, "not json").unwrap();
        assert!(e(&["--input-data", d]).contains("--input-data"));
        assert!(e(&["--api-key", "a b"]).contains("--api-key"));
        assert!(e(&["--api-key", ""]).contains("--api-key"));
        assert!(e(&["--api-key", "clé"]).contains("--api-key"), "it must fit a header");
    }

    #[test]
    fn the_slo_verdict_is_the_p99_constraints_only_when_every_class_has_its_limit() {
        let (dir, worker) = repo();
        let w = worker.to_str().unwrap();
        let c = parse(dir.path(), &["--worker-bin", w, "--max-p99-ms", "100"]).unwrap();
        assert!(c.constraints.slo_is_max_p99, "the default SLO is the limit");
        let c = parse(dir.path(), &["--worker-bin", w, "--max-p99-ms", "100", "--slo-p99-ms", "20"]).unwrap();
        assert!(!c.constraints.slo_is_max_p99);
        // A class with its own slo_ms overrides the default SLO: its verdict is not the limit's.
        let file = dir.path().join("classes.json");
        std::fs::write(
            &file,
            r#"{"entries": [{"model": "m", "class": "fast", "slo_ms": 5}, {"model": "m", "class": "bulk"}]}"#,
        )
        .unwrap();
        let f = file.to_str().unwrap();
        let c = parse(dir.path(), &["--worker-bin", w, "--max-p99-ms", "100", "--workload", f]).unwrap();
        assert!(!c.constraints.slo_is_max_p99);
        assert_eq!(c.load.latency_limit_ms, Some(100.0), "successes within 100 ms are counted instead");
        std::fs::write(
            &file,
            r#"{"entries": [{"model": "m", "class": "a"}, {"model": "m", "class": "b", "slo_ms": 100}]}"#,
        )
        .unwrap();
        let c = parse(dir.path(), &["--worker-bin", w, "--max-p99-ms", "100", "--workload", f]).unwrap();
        assert!(c.constraints.slo_is_max_p99, "every class's SLO is 100 ms");
    }

    #[test]
    fn an_edited_workload_or_data_file_changes_the_settings() {
        let (dir, worker) = repo();
        let w = worker.to_str().unwrap();
        let file = dir.path().join("w.json");
        let data = dir.path().join("d.json");
        std::fs::write(&data, r#"{"data": [{"I": [1, 2, 3, 4]}]}"#).unwrap();
        let settings = |workload: &str| {
            std::fs::write(&file, workload).unwrap();
            let c = parse(dir.path(), &["--worker-bin", w, "--workload", file.to_str().unwrap()]).unwrap();
            serde_json::to_string(&c.load).unwrap()
        };
        let before = settings(r#"{"entries": [{"model": "m", "slo_ms": 5, "data": "d.json"}]}"#);
        assert_eq!(settings(r#"{"entries": [{"model": "m", "slo_ms": 5, "data": "d.json"}]}"#), before);
        assert_ne!(settings(r#"{"entries": [{"model": "m", "slo_ms": 6, "data": "d.json"}]}"#), before);
        // The data file a workload entry names, and --input-data's.
        std::fs::write(&data, r#"{"data": [{"I": [5, 6, 7, 8]}]}"#).unwrap();
        assert_ne!(settings(r#"{"entries": [{"model": "m", "slo_ms": 5, "data": "d.json"}]}"#), before);
        let d = data.to_str().unwrap();
        let with_data = || {
            let c = parse(dir.path(), &["--worker-bin", w, "--input-data", d]).unwrap();
            serde_json::to_string(&c.load).unwrap()
        };
        let first = with_data();
        std::fs::write(&data, r#"{"data": [{"I": [0, 6, 7, 8]}]}"#).unwrap();
        assert_ne!(with_data(), first);
        // Generated data and no workload: no digest at all (older checkpoints still match).
        let c = parse(dir.path(), &["--worker-bin", w]).unwrap();
        assert!(!serde_json::to_string(&c.load).unwrap().contains("digests"));
    }

    #[test]
    fn latency_limits_beyond_an_hour_are_refused() {
        let (dir, worker) = repo();
        let w = worker.to_str().unwrap();
        let e = |extra: &[&str]| parse(dir.path(), &[&["--worker-bin", w][..], extra].concat()).unwrap_err();
        let msg = e(&["--max-p99-ms", "1e30"]);
        assert!(msg.contains("--max-p99-ms") && msg.contains("at most 3600000"), "{msg}");
        let msg = e(&["--max-p99-ms", "10", "--slo-p99-ms", "1e30"]);
        assert!(msg.contains("--slo-p99-ms") && msg.contains("at most 3600000"), "{msg}");
        let file = dir.path().join("w.json");
        std::fs::write(&file, r#"{"entries": [{"model": "m", "slo_ms": 1e30}]}"#).unwrap();
        let msg = e(&["--workload", file.to_str().unwrap()]);
        assert!(msg.contains("entries[0].slo_ms") && msg.contains("at most 3600000"), "{msg}");
        assert!(parse(dir.path(), &["--worker-bin", w, "--max-p99-ms", "3600000"]).is_ok());
        // Over HTTP each concurrent request has a connection, as in nereid-perf.
        let msg = e(&["-i", "http", "--concurrency", "2000000"]);
        assert!(msg.contains("--concurrency: 2000000") && msg.contains("at most 1000000"), "{msg}");
        assert!(parse(dir.path(), &["--worker-bin", w, "--concurrency", "2000000"]).is_ok(), "gRPC shares channels");
    }

    #[test]
    fn tls_flags_need_url_and_turn_tls_on() {
        let (dir, worker) = repo();
        let (ca, k) = crate::client::tls::write_test_cert(dir.path());
        let (ca, k) = (ca.to_str().unwrap(), k.to_str().unwrap());
        let tls_of = |c: AnalyzeConfig| match c.server {
            ServerChoice::External { url, tls, .. } => (url, tls.is_some()),
            other => panic!("{other:?}"),
        };

        // An https:// --url, --ssl or any other --ssl flag turns TLS on; perf_analyzer's
        // names are aliases.
        let c = parse(dir.path(), &["-u", "https://h:8443", "--ssl-ca", ca]).unwrap();
        assert_eq!(tls_of(c), ("h:8443".into(), true));
        let c = parse(dir.path(), &["-u", "h:1", "--ssl-grpc-root-certifications-file", ca]).unwrap();
        assert_eq!(tls_of(c), ("h:1".into(), true));
        let c =
            parse(dir.path(), &["-u", "h:1", "--ssl-ca", ca, "--ssl-grpc-certificate-chain-file", ca, "--ssl-key", k])
                .unwrap();
        assert_eq!(tls_of(c), ("h:1".into(), true));
        let c = parse(dir.path(), &["-u", "http://h:1"]).unwrap();
        assert_eq!(tls_of(c), ("h:1".into(), false));

        let e = |extra: &[&str]| parse(dir.path(), extra).unwrap_err();
        // Only with --url: a started worker has no TLS.
        let w = worker.to_str().unwrap();
        assert!(e(&["--ssl-ca", ca]).contains("--url"));
        assert!(e(&["--worker-bin", w, "--ssl"]).contains("cannot be used with"));
        assert!(e(&["--worker-bin", w, "--ssl-ca", ca]).contains("cannot be used with"));
        assert!(e(&["--ssl-grpc-use-ssl"]).contains("--url"));
        // The certificate and the key need each other.
        assert!(e(&["-u", "h:1", "--ssl-cert", ca]).contains("--ssl-key"));
        assert!(e(&["-u", "h:1", "--ssl-https-private-key-file", k]).contains("--ssl-cert"));
        // Unreadable files are named with their flag.
        let missing = e(&["-u", "h:1", "--ssl-ca", "/nonexistent/ca.pem"]);
        assert!(missing.contains("--ssl-ca /nonexistent/ca.pem"), "{missing}");
        assert!(e(&["-u", "h:1", "--ssl-ca", ca, "--ssl-cert", ca, "--ssl-key", ca]).contains("--ssl-key"));
        assert!(e(&["-u", "ftp://h:1"]).contains("--url"));
    }
}
