//! `nereid-perf` flags (perf_analyzer's names where they overlap), parsed once and validated
//! into a [`RunConfig`]. Errors name the flag or the file key.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, ValueEnum};

use crate::client::{Protocol, Target, Tls, TlsSettings, normalize_url, split_url};
use crate::driver::{Load, Measurement, RunConfig, WindowMode};
use crate::error::PerfError;
use crate::schedule::{Distribution, concurrency_bounds, concurrency_levels, parse_trace, rate_bounds, rate_levels};
use crate::search::{SearchAxis, SearchSpace};
use crate::workload::{Entry, InputSource, MAX_SLO_MS, Origin, Workload};

pub const DEFAULT_GRPC_URL: &str = "localhost:8001";
pub const DEFAULT_HTTP_URL: &str = "localhost:8000";
pub const DEFAULT_METRICS_PORT: u16 = 8002;
/// Load before the first window of a sweep or rate level, in milliseconds.
pub const DEFAULT_WARMUP_MS: u64 = 500;
/// gRPC: one HTTP/2 channel per this many outstanding requests (at most [`MAX_GRPC_CHANNELS`]).
pub const REQUESTS_PER_GRPC_CHANNEL: usize = 32;
pub const MAX_GRPC_CHANNELS: usize = 8;
/// Open-loop gRPC channels when `--connections` is not given.
pub const OPEN_LOOP_GRPC_CHANNELS: usize = 4;
/// Open-loop HTTP/1.1 connections when `--connections` is not given (all opened before the
/// load; about 25k req/s at 10 ms latency, beyond which requests queue for one, in latency).
pub const OPEN_LOOP_HTTP_CONNECTIONS: usize = 256;
/// Most `--connections` (each one opened before the load, with an open file of its own).
pub const MAX_CONNECTIONS: usize = 1_000_000;
/// Most `--max-inflight` (open-loop requests outstanding at once).
pub const MAX_INFLIGHT: usize = 1_000_000;

/// The gRPC channels or HTTP/1.1 connections a run opens when `--connections` is not given,
/// for `outstanding` requests at most (closed loop: the highest concurrency; open loop:
/// `--max-inflight`). nereid-perf and nereid-analyze share it, so a sweep's variant sees the
/// server load nereid-perf would offer: over HTTP, a closed loop opens one connection per
/// concurrent request (no client-side queue); an open loop at most
/// [`OPEN_LOOP_HTTP_CONNECTIONS`].
pub fn default_connections(protocol: Protocol, closed_loop: bool, outstanding: usize) -> usize {
    match (protocol, closed_loop) {
        (Protocol::Grpc, true) => outstanding.div_ceil(REQUESTS_PER_GRPC_CHANNEL).clamp(1, MAX_GRPC_CHANNELS),
        (Protocol::Grpc, false) => OPEN_LOOP_GRPC_CHANNELS,
        (Protocol::Http { .. }, true) => outstanding.max(1),
        (Protocol::Http { .. }, false) => outstanding.clamp(1, OPEN_LOOP_HTTP_CONNECTIONS),
    }
}

const EXIT_CODES: &str = "\
Exit codes:
  0  every level measured; the SLO (if any) was met at some level
  1  internal error, or an output file could not be written
  2  bad input: invalid flags, workload or trace file (the message names the key or line),
     unknown model, or the server cannot be reached (after 3 attempts; a failed TLS
     handshake included)
  3  the server stopped answering mid-run; results so far are printed and written
  4  results printed, but no load level met the SLO (\"no load level met the SLO\"; with
     --binary-search: the range's lower bound misses it)
  5  results printed, but untrustworthy: no stable measurement within --max-trials, more than
     1% of open-loop sends started over 1 ms late, no request succeeded at a level, or a
     workload class with an SLO completed no request at a level (no SLO verdict)
  6  the server's outputs differ from the input data file's validation_data (checked once per
     distinct request before any load); nothing was measured
  130 interrupted (Ctrl-C); results so far are printed and written

Open loop: each request has a scheduled send time; latency runs from that time, so a server
or generator that falls behind shows in the latencies (no coordinated omission). A send that
starts more than 1 ms late counts as late. A level meets the SLO when at least 99% of its
completed requests succeeded within it (failures count as misses); a sweep stops at the first
level that misses. SLOs are at most 3600000 ms (1 hour).

Binary search (--binary-search, needs an SLO): probes the range's lower bound, then its upper
bound, then bisects between the highest load that met the SLO and the lowest that missed it
until they are at most the precision apart (--binary-search-precision, default the range's
step). Each probe is measured like a sweep level. The answer is the highest probed load that
met the SLO; every probe is reported.

Workload file (--workload), JSON; unknown keys are errors:
  {\"entries\": [{\"model\": \"mlp_fp32\", \"version\": \"1\", \"weight\": 3, \"batch_size\": 4,
                \"shapes\": {\"INPUT0\": [256]}, \"data\": \"random\", \"tenant\": \"acme\",
                \"api_key\": \"...\", \"priority\": 1, \"timeout_us\": 50000, \"slo_ms\": 20,
                \"class\": \"small\"}]}
  \"data\" is zero, random, or an input data file (see --input-data) relative to the workload file.

Input data file (--input-data FILE.json), perf_analyzer's format; one entry per batch-1
request, cycled in order (with -b B, a request's rows are B consecutive entries):
  {\"data\": [{\"INPUT0\": [1.0, 2.0, 3.0]},
            {\"INPUT0\": {\"content\": [1, 2, 3], \"shape\": [3]}},
            {\"INPUT0\": {\"b64\": \"AACAPwAAAEAAAEBA\"}}]}
  A flat array takes its shape from --shape or the model; \"shape\" has no batch dimension;
  b64 is raw little-endian bytes; BYTES inputs take strings. Every value is checked against
  the model before the run (exit 2 naming data[i] and the input).

Trace file (--trace-file): one arrival offset per line, in milliseconds, non-decreasing;
'#' comments. Offsets are replayed relative to the first (a trace starting at 60000 ms sends
its first request at once). The whole trace is measured as one window, from its first
arrival (no warm-up).";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProtocolArg {
    Grpc,
    Http,
}

/// `--shared-memory`: perf_analyzer's values, CUDA excepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SharedMemoryArg {
    None,
    System,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DistributionArg {
    Constant,
    Poisson,
}

/// Load generator for KServe v2 servers: throughput, latency percentiles and goodput under a
/// latency SLO, with the server-side breakdown from /metrics.
#[derive(Parser, Debug, Clone)]
#[command(name = "nereid-perf", version, after_help = EXIT_CODES)]
pub struct Args {
    /// Model to load (or give --workload).
    #[arg(short = 'm', long, required_unless_present = "workload", conflicts_with = "workload")]
    pub model: Option<String>,
    /// Model version (default: the server's latest ready version).
    #[arg(short = 'x', long = "model-version", conflicts_with = "workload")]
    pub model_version: Option<String>,
    /// Server address, host:port or http(s)://host:port (https:// turns TLS on) [default:
    /// localhost:8001 for gRPC, localhost:8000 for HTTP].
    #[arg(short = 'u', long)]
    pub url: Option<String>,
    /// Wire protocol.
    #[arg(short = 'i', long, value_enum, default_value = "grpc")]
    pub protocol: ProtocolArg,
    /// HTTP: send inputs and ask for outputs in the binary-tensor extension instead of JSON.
    #[arg(long)]
    pub http_binary: bool,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Prometheus endpoint for the server-side breakdown: host:port or an http:// or https://
    /// URL (HTTPS trusts what the --ssl flags trust, else the system's CA bundle) [default:
    /// the --url host, port 8002, /metrics, plain HTTP].
    #[arg(long)]
    pub metrics_url: Option<String>,
    /// Do not scrape /metrics.
    #[arg(long, conflicts_with = "metrics_url")]
    pub no_server_stats: bool,
    /// Rows per request (the model must batch for more than 1).
    #[arg(short = 'b', long, default_value_t = 1, conflicts_with = "workload")]
    pub batch_size: u32,
    /// Non-batch dims of an input with variable dims, NAME:D1,D2,... (repeatable).
    #[arg(long = "shape", value_name = "NAME:DIMS", conflicts_with = "workload")]
    pub shapes: Vec<String>,
    /// Input contents: zero, random, or the path of a JSON input data file in perf_analyzer's
    /// format (see below); a workload entry's "data" overrides it.
    #[arg(long, value_name = "zero|random|FILE.json", default_value = "random")]
    pub input_data: String,
    /// system: pass inputs and outputs through POSIX shared memory registered with the server
    /// (Triton's system shared-memory extension; the server must be on this host and allow
    /// it, e.g. nereid-worker --allow-client-shm=true), as perf_analyzer's --shared-memory.
    #[arg(long, value_enum, default_value = "none")]
    pub shared_memory: SharedMemoryArg,
    /// With --shared-memory system: bytes reserved for each model output.
    #[arg(long, default_value_t = 102_400, value_parser = clap::value_parser!(u64).range(1..))]
    pub output_shared_memory_size: u64,
    /// Closed loop: start[:end[:step]] outstanding requests [default: 1].
    #[arg(long, conflicts_with_all = ["request_rate_range", "trace_file"])]
    pub concurrency_range: Option<String>,
    /// Open loop: start[:end[:step]] requests per second.
    #[arg(long, conflicts_with = "trace_file")]
    pub request_rate_range: Option<String>,
    /// Find the highest load meeting the SLO by bisecting the concurrency or request-rate range
    /// (between its start and end) instead of sweeping it; needs --slo-p99-ms (or slo_ms on every
    /// workload entry).
    #[arg(long, conflicts_with = "trace_file")]
    pub binary_search: bool,
    /// --binary-search stops when the loads that met and missed the SLO are at most this far
    /// apart (concurrency: a whole number) [default: the range's step].
    #[arg(long, requires = "binary_search", value_name = "LOAD")]
    pub binary_search_precision: Option<f64>,
    /// Open-loop arrival spacing.
    #[arg(long, value_enum, default_value = "constant")]
    pub request_distribution: DistributionArg,
    /// Open loop: replay arrival offsets from a file (see below).
    #[arg(long)]
    pub trace_file: Option<PathBuf>,
    /// JSON workload file mixing models, shapes, tenants, priorities and SLOs (see below).
    #[arg(long)]
    pub workload: Option<PathBuf>,
    /// Length of a measurement window, in milliseconds.
    #[arg(short = 'p', long, default_value_t = 5000)]
    pub measurement_interval: u64,
    /// Count windows instead of time windows: close each after this many responses (at most 60 s).
    #[arg(long)]
    pub measurement_request_count: Option<u64>,
    /// Load before the first window, not measured, in milliseconds [default: 500; with
    /// --trace-file: 0, the whole trace is measured].
    #[arg(long)]
    pub warmup_ms: Option<u64>,
    /// Stability band: the last 3 windows' throughput and average latency within ±this % of their mean.
    #[arg(short = 's', long, default_value_t = 10.0)]
    pub stability_percentage: f64,
    /// Most windows per level; below 3, stability compares that many windows (1: no check).
    #[arg(short = 'r', long, default_value_t = 10)]
    pub max_trials: u32,
    /// Latency SLO in milliseconds for goodput and the verdict (workload entries may set their own).
    #[arg(long)]
    pub slo_p99_ms: Option<f64>,
    /// Sent as `authorization: Bearer <key>` by entries without their own api_key.
    #[arg(long, env = "NEREID_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Write perf_analyzer-style CSV here.
    #[arg(short = 'f', long = "latency-report-file", visible_alias = "csv")]
    pub csv: Option<PathBuf>,
    /// Write the full report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write a self-contained HTML report with plots (one file, no external resources) here.
    #[arg(long, visible_alias = "html-report", value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Seed of arrivals, input data and workload picks.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Client-side timeout of each request, in milliseconds (counted as CLIENT_TIMEOUT).
    #[arg(long, default_value_t = 10_000)]
    pub request_timeout_ms: u64,
    /// Open loop: most requests outstanding; a send waiting for a slot is late.
    #[arg(long, default_value_t = 4096)]
    pub max_inflight: usize,
    /// gRPC channels / HTTP/1.1 connections, all opened before measuring; HTTP requests beyond
    /// them wait for a free one, and the wait counts in latency [default: from the load].
    #[arg(long)]
    pub connections: Option<usize>,
    /// Generator threads (tokio workers).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// No progress lines on stderr.
    #[arg(short = 'q', long)]
    pub quiet: bool,
}

/// TLS to the server, with perf_analyzer's flag names as aliases; shared by nereid-perf and
/// nereid-analyze.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// Use TLS: gRPC over TLS or HTTPS (also --ssl-grpc-use-ssl); implied by an https:// URL
    /// or any other --ssl flag. The server's certificate must match the URL's host.
    #[arg(long, alias = "ssl-grpc-use-ssl")]
    pub ssl: bool,
    /// PEM file of the CA certificates that sign the server's certificate [default: the system's
    /// CA bundle] (also --ssl-grpc-root-certifications-file, --ssl-https-ca-certificates-file).
    #[arg(
        long,
        value_name = "FILE",
        aliases = ["ssl-grpc-root-certifications-file", "ssl-https-ca-certificates-file"]
    )]
    pub ssl_ca: Option<PathBuf>,
    /// Client certificate chain (PEM) for mutual TLS; needs --ssl-key (also
    /// --ssl-grpc-certificate-chain-file, --ssl-https-client-certificate-file).
    #[arg(
        long,
        value_name = "FILE",
        requires = "ssl_key",
        aliases = ["ssl-grpc-certificate-chain-file", "ssl-https-client-certificate-file"]
    )]
    pub ssl_cert: Option<PathBuf>,
    /// Private key (PEM: PKCS#8, PKCS#1 or SEC1) of --ssl-cert (also --ssl-grpc-private-key-file,
    /// --ssl-https-private-key-file).
    #[arg(
        long,
        value_name = "FILE",
        requires = "ssl_cert",
        aliases = ["ssl-grpc-private-key-file", "ssl-https-private-key-file"]
    )]
    pub ssl_key: Option<PathBuf>,
}

impl TlsArgs {
    /// Whether any TLS flag was given.
    pub fn given(&self) -> bool {
        self.ssl || self.ssl_ca.is_some() || self.ssl_cert.is_some() || self.ssl_key.is_some()
    }

    /// The TLS configuration when a flag or an `https://` URL asks for TLS (files read and
    /// checked now; errors name the flag and file), else `None`.
    pub fn tls(&self, https: bool) -> Result<Option<Tls>, String> {
        if !(https || self.given()) {
            return Ok(None);
        }
        let settings =
            TlsSettings { ca_file: self.ssl_ca.clone(), client_auth: self.ssl_cert.clone().zip(self.ssl_key.clone()) };
        Tls::new(&settings).map(Some)
    }
}

impl Args {
    /// Validates the flags and reads the workload and trace files.
    pub fn into_config(self) -> Result<RunConfig, PerfError> {
        let usage = |s: String| PerfError::Usage(s);
        let protocol = match (self.protocol, self.http_binary) {
            (ProtocolArg::Grpc, true) => return Err(usage("--http-binary needs --protocol http".into())),
            (ProtocolArg::Grpc, false) => Protocol::Grpc,
            (ProtocolArg::Http, binary) => Protocol::Http { binary },
        };
        let default_url = if protocol == Protocol::Grpc { DEFAULT_GRPC_URL } else { DEFAULT_HTTP_URL };
        let (url, https) =
            split_url(self.url.as_deref().unwrap_or(default_url)).map_err(|e| usage(format!("--url {e}")))?;
        let tls = self.tls.tls(https).map_err(usage)?;
        let metrics_url =
            if self.no_server_stats { None } else { Some(metrics_uri(self.metrics_url.as_deref(), &url)?) };

        if let Some(s) = self.slo_p99_ms
            && !(s.is_finite() && s > 0.0 && s <= MAX_SLO_MS)
        {
            return Err(usage(format!(
                "--slo-p99-ms {s}: must be a positive number of milliseconds, at most {MAX_SLO_MS} (1 hour)"
            )));
        }
        let mut workload = match (&self.model, &self.workload) {
            (Some(model), None) => {
                let mut entry = Entry::for_model(model.clone());
                entry.version = self.model_version.clone().filter(|v| !v.is_empty());
                entry.batch_size = self.batch_size;
                for s in &self.shapes {
                    let (name, dims) = parse_shape(s)?;
                    entry.shapes.insert(name, dims);
                }
                Workload::new(Origin::Flags, vec![entry], self.slo_p99_ms)?
            }
            (None, Some(path)) => {
                let shown = path.display().to_string();
                let text = std::fs::read_to_string(path)
                    .map_err(|e| PerfError::Usage(format!("workload file {shown}: cannot read it: {e}")))?;
                Workload::from_json(&shown, &text, self.slo_p99_ms)?
            }
            _ => return Err(usage("give either -m/--model or --workload".into())),
        };
        let input_data = InputSource::from_arg(&self.input_data).map_err(|e| usage(format!("--input-data: {e}")))?;
        if let Some(key) = &self.api_key {
            if key.is_empty() || key.chars().any(|c| c.is_control() || c == ' ') {
                return Err(usage("--api-key: must be a non-empty token without spaces".into()));
            }
            for e in &mut workload.entries {
                e.api_key.get_or_insert_with(|| key.clone());
            }
            workload.default_api_key = Some(key.clone());
        }

        // A trace is its own schedule and is measured whole: a warm-up would cut its start off
        // (and a trace shorter than the warm-up would measure nothing).
        let warmup_ms = match (self.warmup_ms, &self.trace_file) {
            (Some(ms), Some(_)) if ms > 0 => {
                return Err(usage(format!(
                    "--warmup-ms {ms}: a trace is measured whole, from its first arrival; put the warm-up \
                     traffic at the start of the trace file and leave --warmup-ms out"
                )));
            }
            (_, Some(_)) => 0,
            (Some(ms), None) => ms,
            (None, None) => DEFAULT_WARMUP_MS,
        };

        let load = if self.binary_search {
            self.search_load(&workload)?
        } else if let Some(path) = &self.trace_file {
            let shown = path.display();
            let text =
                std::fs::read_to_string(path).map_err(|e| usage(format!("trace file {shown}: cannot read it: {e}")))?;
            let offsets = parse_trace(&text).map_err(|e| usage(format!("trace file {shown}: {e}")))?;
            Load::Trace(Arc::from(offsets))
        } else if let Some(r) = &self.request_rate_range {
            let distribution = match self.request_distribution {
                DistributionArg::Constant => Distribution::Constant,
                DistributionArg::Poisson => Distribution::Poisson,
            };
            Load::RequestRate { rates: rate_levels(r).map_err(|e| usage(e.to_string()))?, distribution }
        } else {
            let c = self.concurrency_range.as_deref().unwrap_or("1");
            Load::Concurrency(concurrency_levels(c).map_err(|e| usage(e.to_string()))?)
        };

        if self.measurement_interval == 0 {
            return Err(usage("--measurement-interval: must be at least 1 ms".into()));
        }
        if self.measurement_request_count == Some(0) {
            return Err(usage("--measurement-request-count: must be at least 1".into()));
        }
        if !(self.stability_percentage.is_finite() && self.stability_percentage > 0.0) {
            return Err(usage(format!("--stability-percentage {}: must be above 0", self.stability_percentage)));
        }
        if self.max_trials == 0 {
            return Err(usage("--max-trials: must be at least 1".into()));
        }
        if self.request_timeout_ms == 0 {
            return Err(usage("--request-timeout-ms: must be at least 1".into()));
        }
        if !(1..=MAX_INFLIGHT).contains(&self.max_inflight) {
            return Err(usage(format!("--max-inflight {}: must be between 1 and {MAX_INFLIGHT}", self.max_inflight)));
        }
        if self.threads == 0 {
            return Err(usage("--threads: must be at least 1".into()));
        }
        if let Some(n) = self.connections
            && !(1..=MAX_CONNECTIONS).contains(&n)
        {
            return Err(usage(format!("--connections {n}: must be between 1 and {MAX_CONNECTIONS}")));
        }

        let outstanding = match &load {
            Load::Concurrency(levels) => levels.iter().copied().max().unwrap_or(1) as usize,
            Load::BinarySearch { axis: SearchAxis::Concurrency, space } => space.high as usize,
            _ => self.max_inflight,
        };
        let closed_loop =
            matches!(load, Load::Concurrency(_) | Load::BinarySearch { axis: SearchAxis::Concurrency, .. });
        let connections = self.connections.unwrap_or_else(|| default_connections(protocol, closed_loop, outstanding));
        if connections > MAX_CONNECTIONS {
            // Only the default gets here: over HTTP, one connection per concurrent request.
            return Err(usage(format!(
                "--concurrency-range: {outstanding} concurrent requests over HTTP would open as many connections, \
                 at most {MAX_CONNECTIONS}; give --connections to share fewer"
            )));
        }

        let window = match self.measurement_request_count {
            Some(n) => WindowMode::Count { requests: n },
            None => WindowMode::Time { ms: self.measurement_interval },
        };
        Ok(RunConfig {
            target: Target { protocol, url, connections, tls },
            metrics_url,
            workload,
            input_data,
            load,
            measurement: Measurement {
                window,
                warmup_ms,
                stability_percentage: self.stability_percentage,
                max_trials: self.max_trials,
                request_timeout_ms: self.request_timeout_ms,
                max_inflight: self.max_inflight,
            },
            seed: self.seed,
            shared_memory: (self.shared_memory == SharedMemoryArg::System).then_some(self.output_shared_memory_size),
            latency_limit: None,
        })
    }
}

impl Args {
    /// `--binary-search` over the concurrency or request-rate range's bounds.
    fn search_load(&self, workload: &Workload) -> Result<Load, PerfError> {
        let usage = |s: String| PerfError::Usage(s);
        if workload.series.iter().any(|s| s.slo_ms.is_none()) {
            return Err(usage(
                "--binary-search needs an SLO: give --slo-p99-ms (or slo_ms on every workload entry)".into(),
            ));
        }
        let (axis, (low, high, step), flag) = match (&self.concurrency_range, &self.request_rate_range) {
            (Some(c), None) => {
                let (low, high, step) = concurrency_bounds(c).map_err(|e| usage(e.to_string()))?;
                (SearchAxis::Concurrency, (low as f64, high as f64, step as f64), "--concurrency-range")
            }
            (None, Some(r)) => {
                let distribution = match self.request_distribution {
                    DistributionArg::Constant => Distribution::Constant,
                    DistributionArg::Poisson => Distribution::Poisson,
                };
                let bounds = rate_bounds(r).map_err(|e| usage(e.to_string()))?;
                (SearchAxis::RequestRate { distribution }, bounds, "--request-rate-range")
            }
            _ => {
                return Err(usage(
                    "--binary-search needs a range to search: --concurrency-range START:END[:STEP] or \
                     --request-rate-range START:END[:STEP]"
                        .into(),
                ));
            }
        };
        let precision = self.binary_search_precision.unwrap_or(step);
        let integer = axis == SearchAxis::Concurrency;
        let space = SearchSpace::new(low, high, precision, integer).map_err(|e| match e {
            crate::search::SearchSpaceError::Precision { .. } => usage(format!("--binary-search-precision: {e}")),
            crate::search::SearchSpaceError::Bounds { .. } => usage(format!("{flag}: {e}")),
        })?;
        Ok(Load::BinarySearch { axis, space })
    }
}

/// `--shape NAME:D1,D2` → (name, dims).
pub fn parse_shape(value: &str) -> Result<(String, Vec<i64>), PerfError> {
    let bad = |why: &str| PerfError::Usage(format!("--shape '{value}': {why}; expected NAME:D1,D2,..."));
    let (name, dims) = value.rsplit_once(':').ok_or_else(|| bad("no ':'"))?;
    if name.is_empty() {
        return Err(bad("empty input name"));
    }
    let dims = dims
        .split(',')
        .map(|d| d.trim().parse::<i64>().ok().filter(|d| *d >= 0))
        .collect::<Option<Vec<i64>>>()
        .ok_or_else(|| bad("dims must be non-negative integers"))?;
    Ok((name.to_string(), dims))
}

/// The `/metrics` URI from `--metrics-url` or, by default, the server host on port 8002.
pub fn metrics_uri(flag: Option<&str>, server: &str) -> Result<http::Uri, PerfError> {
    let bad = |v: &str, e: String| PerfError::Usage(format!("--metrics-url '{v}': {e}"));
    let text = match flag {
        Some(v) if v.contains("://") => {
            if !(v.starts_with("http://") || v.starts_with("https://")) {
                return Err(bad(v, "the scheme must be http:// or https://".into()));
            }
            let uri: http::Uri = v.parse().map_err(|e| bad(v, format!("{e}")))?;
            if uri.path() == "/" && !v.ends_with('/') {
                format!("{}/metrics", v.trim_end_matches('/'))
            } else {
                v.to_string()
            }
        }
        Some(v) => {
            let hp = normalize_url(v).map_err(|e| bad(v, e))?;
            format!("http://{hp}/metrics")
        }
        None => {
            let uri: http::Uri = format!("http://{server}").parse().map_err(|e| bad(server, format!("{e}")))?;
            format!("http://{}:{DEFAULT_METRICS_PORT}/metrics", uri.host().unwrap_or("localhost"))
        }
    };
    text.parse().map_err(|e| bad(&text, format!("{e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Result<RunConfig, PerfError> {
        let mut argv = vec!["nereid-perf"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).map_err(|e| PerfError::Usage(e.to_string()))?.into_config()
    }

    #[test]
    fn a_trace_is_measured_whole_without_warm_up() {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("t.txt");
        std::fs::write(&trace, "0\n1\n2\n").unwrap();
        let trace = trace.to_str().unwrap();
        assert_eq!(args(&["-m", "m", "--trace-file", trace]).unwrap().measurement.warmup_ms, 0);
        assert_eq!(args(&["-m", "m", "--trace-file", trace, "--warmup-ms", "0"]).unwrap().measurement.warmup_ms, 0);
        let e = args(&["-m", "m", "--trace-file", trace, "--warmup-ms", "200"]).unwrap_err().to_string();
        assert!(e.contains("--warmup-ms 200") && e.contains("measured whole"), "{e}");
        assert_eq!(args(&["-m", "m"]).unwrap().measurement.warmup_ms, DEFAULT_WARMUP_MS);
        assert_eq!(args(&["-m", "m", "--warmup-ms", "7"]).unwrap().measurement.warmup_ms, 7);
    }

    #[test]
    fn flags_build_a_single_entry_workload() {
        let c = args(&["-m", "mlp", "-x", "2", "-b", "4", "--shape", "IN:3,4", "--slo-p99-ms", "5", "--api-key", "k"])
            .unwrap();
        let e = &c.workload.entries[0];
        assert_eq!((e.model.as_str(), e.version.as_deref(), e.batch_size), ("mlp", Some("2"), 4));
        assert_eq!(e.shapes["IN"], vec![3, 4]);
        assert_eq!(e.api_key.as_deref(), Some("k"));
        assert_eq!(c.workload.series[0].slo_ms, Some(5.0));
        assert_eq!(c.target.url, "localhost:8001");
        assert_eq!(c.metrics_url.unwrap().to_string(), "http://localhost:8002/metrics");
        assert!(matches!(c.load, Load::Concurrency(ref l) if l == &vec![1]));
    }

    #[test]
    fn flag_errors_name_the_flag() {
        let e = |a: &[&str]| args(a).unwrap_err().to_string();
        assert!(e(&["-m", "m", "--shape", "X"]).contains("--shape"));
        assert!(e(&["-m", "m", "--concurrency-range", "0"]).contains("--concurrency-range"));
        assert!(e(&["-m", "m", "--request-rate-range", "x"]).contains("--request-rate-range"));
        assert!(e(&["-m", "m", "--http-binary"]).contains("--protocol http"));
        assert!(e(&["-m", "m", "--ssl-ca", "/nonexistent/ca.pem"]).contains("--ssl-ca /nonexistent/ca.pem"));
        assert!(e(&["-m", "m", "--ssl", "--ssl-cert", "c.pem"]).contains("--ssl-key"));
        assert!(e(&["-m", "m", "--ssl-https-private-key-file", "k.pem"]).contains("--ssl-cert"));
        assert!(e(&["-m", "m", "--max-trials", "0"]).contains("--max-trials"));
        assert!(e(&["-m", "m", "--slo-p99-ms", "0"]).contains("--slo-p99-ms"));
        assert!(e(&["-m", "m", "--workload", "w.json"]).contains("cannot be used with"));
        assert!(e(&[]).contains("--model"));
        assert!(e(&["--workload", "/nonexistent/w.json"]).contains("cannot read"));
        assert!(e(&["-m", "m", "--trace-file", "/nonexistent/t"]).contains("trace file"));
        let data = e(&["-m", "m", "--input-data", "/nonexistent/d.json"]);
        assert!(data.contains("--input-data") && data.contains("/nonexistent/d.json"), "{data}");
    }

    #[test]
    fn urls_and_metrics_urls() {
        let c = args(&["-m", "m", "-i", "http", "--http-binary", "-u", "http://10.0.0.1:9000/"]).unwrap();
        assert_eq!(c.target.url, "10.0.0.1:9000");
        assert_eq!(c.target.protocol, Protocol::Http { binary: true });
        assert_eq!(c.metrics_url.unwrap().to_string(), "http://10.0.0.1:8002/metrics");
        assert_eq!(metrics_uri(Some("h:1"), "x:2").unwrap().to_string(), "http://h:1/metrics");
        assert_eq!(metrics_uri(Some("http://h:1"), "x:2").unwrap().to_string(), "http://h:1/metrics");
        assert_eq!(metrics_uri(Some("http://h:1/m"), "x:2").unwrap().to_string(), "http://h:1/m");
        assert!(args(&["-m", "m", "--no-server-stats"]).unwrap().metrics_url.is_none());
    }

    #[test]
    fn tls_flags() {
        assert!(args(&["-m", "m"]).unwrap().target.tls.is_none());
        let dir = tempfile::tempdir().unwrap();
        let (ca, k) = crate::client::tls::write_test_cert(dir.path());
        let (ca, k) = (ca.to_str().unwrap(), k.to_str().unwrap());
        // Any --ssl flag, or https://, turns TLS on; perf_analyzer's names are aliases.
        let c = args(&["-m", "m", "--ssl-grpc-root-certifications-file", ca]).unwrap();
        assert!(c.target.tls.is_some());
        assert_eq!(c.target.url, "localhost:8001");
        let c = args(&["-m", "m", "-i", "http", "-u", "https://h:8443", "--ssl-ca", ca]).unwrap();
        assert_eq!((c.target.url.as_str(), c.target.tls.is_some()), ("h:8443", true));
        assert_eq!(c.metrics_url.unwrap().to_string(), "http://h:8002/metrics");
        let c = args(&["-m", "m", "--ssl-ca", ca, "--ssl-grpc-certificate-chain-file", ca, "--ssl-key", k]).unwrap();
        assert!(c.target.tls.is_some());
        // /metrics over HTTPS (trusting what --ssl* trusts, else the system's bundle).
        let c = args(&["-m", "m", "--metrics-url", "https://h:1"]).unwrap();
        assert_eq!(c.metrics_url.unwrap().to_string(), "https://h:1/metrics");
        let e = args(&["-m", "m", "--metrics-url", "ftp://h:1"]).unwrap_err().to_string();
        assert!(e.contains("http:// or https://"), "{e}");
    }

    #[test]
    fn binary_search_flags() {
        let c = args(&["-m", "m", "--binary-search", "--concurrency-range", "2:300:4", "--slo-p99-ms", "5"]).unwrap();
        let Load::BinarySearch { axis, space } = c.load else { panic!("{:?}", c.load) };
        assert_eq!(axis, SearchAxis::Concurrency);
        assert_eq!((space.low, space.high, space.precision, space.integer), (2.0, 300.0, 4.0, true));
        assert_eq!(c.target.connections, MAX_GRPC_CHANNELS, "sized for the upper bound");
        // A range wider than a sweep may expand to is fine for a search.
        let c = args(&[
            "-m",
            "m",
            "--binary-search",
            "--request-rate-range",
            "10:50000",
            "--request-distribution",
            "poisson",
            "--binary-search-precision",
            "2.5",
            "--slo-p99-ms",
            "5",
        ])
        .unwrap();
        let Load::BinarySearch { axis, space } = c.load else { panic!("{:?}", c.load) };
        assert_eq!(axis, SearchAxis::RequestRate { distribution: Distribution::Poisson });
        assert_eq!((space.low, space.high, space.precision, space.integer), (10.0, 50_000.0, 2.5, false));

        let e = |a: &[&str]| args(a).unwrap_err().to_string();
        assert!(e(&["-m", "m", "--binary-search", "--concurrency-range", "1:8"]).contains("--slo-p99-ms"));
        assert!(e(&["-m", "m", "--binary-search", "--slo-p99-ms", "5"]).contains("--concurrency-range START:END"));
        let precision = e(&[
            "-m",
            "m",
            "--binary-search",
            "--concurrency-range",
            "1:8",
            "--slo-p99-ms",
            "5",
            "--binary-search-precision",
            "0.5",
        ]);
        assert!(precision.contains("--binary-search-precision") && precision.contains("whole number"), "{precision}");
        assert!(e(&["-m", "m", "--binary-search-precision", "2"]).contains("--binary-search"));
        assert!(e(&["-m", "m", "--binary-search", "--trace-file", "t"]).contains("cannot be used with"));
    }

    #[test]
    fn connections_follow_the_load() {
        let c = args(&["-m", "m", "--concurrency-range", "1:100:33"]).unwrap();
        assert_eq!(c.target.connections, 4);
        let c = args(&["-m", "m", "-i", "http", "--concurrency-range", "8"]).unwrap();
        assert_eq!(c.target.connections, 8);
        let c = args(&["-m", "m", "--request-rate-range", "100", "--connections", "2"]).unwrap();
        assert_eq!(c.target.connections, 2);
        let c = args(&["-m", "m", "-i", "http", "--request-rate-range", "100"]).unwrap();
        assert_eq!(c.target.connections, OPEN_LOOP_HTTP_CONNECTIONS);
        let c = args(&["-m", "m", "-i", "http", "--request-rate-range", "100", "--max-inflight", "8"]).unwrap();
        assert_eq!(c.target.connections, 8, "never more connections than requests in flight");
        // What nereid-analyze opens too (one rule): over HTTP a closed loop of 512 gets 512.
        let c = args(&["-m", "m", "-i", "http", "--concurrency-range", "512"]).unwrap();
        assert_eq!(c.target.connections, 512);
        assert_eq!(default_connections(Protocol::Http { binary: false }, true, 512), 512);
    }

    #[test]
    fn values_that_would_not_fit_are_refused_naming_the_flag() {
        let e = |a: &[&str]| args(a).unwrap_err().to_string();
        // An SLO beyond what a Duration (and the histograms) hold.
        for slo in ["1e30", "3600000.5"] {
            let msg = e(&["-m", "m", "--slo-p99-ms", slo]);
            assert!(msg.contains(&format!("--slo-p99-ms {}", slo.parse::<f64>().unwrap())), "{msg}");
            assert!(msg.contains("at most 3600000"), "{msg}");
        }
        assert_eq!(args(&["-m", "m", "--slo-p99-ms", "3600000"]).unwrap().workload.series[0].slo_ms, Some(3.6e6));
        let dir = tempfile::tempdir().unwrap();
        let w = dir.path().join("w.json");
        std::fs::write(&w, r#"{"entries": [{"model": "m", "slo_ms": 1e30}]}"#).unwrap();
        let msg = e(&["--workload", w.to_str().unwrap()]);
        assert!(msg.contains("entries[0].slo_ms") && msg.contains("at most 3600000"), "{msg}");
        // More open-loop slots than a semaphore holds; more connections than could be opened.
        let huge = (usize::MAX >> 2).to_string();
        let msg = e(&["-m", "m", "--request-rate-range", "10", "--max-inflight", &huge]);
        assert!(msg.contains("--max-inflight") && msg.contains("between 1 and 1000000"), "{msg}");
        assert!(e(&["-m", "m", "--max-inflight", "0"]).contains("--max-inflight"));
        let msg = e(&["-m", "m", "-i", "http", "--connections", &huge]);
        assert!(msg.contains("--connections") && msg.contains("between 1 and 1000000"), "{msg}");
        assert!(e(&["-m", "m", "--connections", "0"]).contains("--connections"));
        assert_eq!(args(&["-m", "m", "--connections", "1000000"]).unwrap().target.connections, MAX_CONNECTIONS);
        // The default over HTTP: a connection per concurrent request.
        let msg = e(&["-m", "m", "-i", "http", "--concurrency-range", "2000000"]);
        assert!(msg.contains("--concurrency-range") && msg.contains("--connections"), "{msg}");
        let c = args(&["-m", "m", "-i", "http", "--concurrency-range", "2000000", "--connections", "64"]).unwrap();
        assert_eq!(c.target.connections, 64);
    }
}
