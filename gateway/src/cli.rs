//! Command line: parsed once by clap, validated into a typed [`GatewayConfig`]. The listener
//! flags mean what they mean for `nereid-worker` (0 = an ephemeral port, `--port-file`).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::config::{
    AdmissionConfig, DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_DISCOVERY_INTERVAL_MS, DEFAULT_DISCOVERY_TIMEOUT_MS,
    DEFAULT_EJECTION_BASE_MS, DEFAULT_EJECTION_CONSECUTIVE_FAILURES, DEFAULT_EJECTION_HUNG_AFTER_MS,
    DEFAULT_EJECTION_MAX_MS, DEFAULT_EXIT_TIMEOUT_SECS, DEFAULT_MAX_CONCURRENT_REQUESTS, DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_PLACEMENT_LOAD_TIMEOUT_SECS, DEFAULT_REQUEST_TIMEOUT_MS, DEFAULT_RETRY_BUDGET_MIN_PER_SEC,
    DEFAULT_RETRY_BUDGET_PERCENT, DiscoveryConfig, EtcdConfig, GatewayConfig, ListenConfig,
    MAX_PLACEMENT_LOAD_TIMEOUT_SECS, OutlierConfig, RetryConfig,
};

/// `--request-timeout-ms` at most: a year (every deadline is now + this; a value near u64::MAX
/// would overflow the clock on every request).
const MAX_REQUEST_TIMEOUT_MS: u64 = 365 * 24 * 3600 * 1000;

/// nereid-gateway: one KServe v2 (HTTP + gRPC) endpoint in front of a fleet of nereid-workers.
#[derive(Clone, Debug, Parser)]
#[command(name = "nereid-gateway", version, about, long_about = None)]
pub struct Args {
    /// gRPC address (host:port) of a worker; repeat for each worker (static membership).
    #[arg(long = "worker-grpc", value_name = "HOST:PORT")]
    pub worker_grpc: Vec<String>,

    /// etcd endpoints (comma-separated http://host:port): the fleet's membership, model
    /// placement and status come from etcd instead of --worker-grpc.
    #[arg(long, env = "NEREID_ETCD_ENDPOINTS", value_name = "URLS")]
    pub etcd_endpoints: Option<String>,

    /// Prefix of every Nereid key in etcd.
    #[arg(long, default_value = nereid_common::fleet::DEFAULT_PREFIX, value_name = "PREFIX")]
    pub etcd_prefix: String,

    /// This gateway's name in the placement controller's election. Default: <hostname>-<pid>.
    #[arg(long, value_name = "ID")]
    pub gateway_id: Option<String>,

    /// Run for leader of the placement controller (assigns declared models to workers); at
    /// most one gateway leads at a time.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub placement: bool,

    /// TTL of the placement election lease in seconds (how long a dead leader blocks the next).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=300))]
    pub election_ttl_secs: u64,

    /// Seconds a placed model version may go without being reported READY by its worker (no
    /// status at all, or stuck in LOADING) before the placement controller treats the load as
    /// failed: the replica is placed on another worker and this one is not chosen for that
    /// version again for a minute. Counted from when the leader sees the worker's status for
    /// it change (a worker loads a few models at a time, --model-load-thread-count; one still
    /// waiting its turn, "pending", gets four times as long); allow for the slowest load and
    /// warm-up of your largest model, with the others loading beside it (1-86400).
    #[arg(
        long,
        default_value_t = DEFAULT_PLACEMENT_LOAD_TIMEOUT_SECS,
        value_parser = clap::value_parser!(u64).range(1..=MAX_PLACEMENT_LOAD_TIMEOUT_SECS),
        value_name = "SECS"
    )]
    pub placement_load_timeout_secs: u64,

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

    /// Write the bound ports as JSON ({"http":..,"grpc":..,"metrics":..}) to this file once
    /// listening (useful with port 0).
    #[arg(long, value_name = "FILE")]
    pub port_file: Option<PathBuf>,

    /// Longest time a request may take through the gateway, in milliseconds (at most a year);
    /// a client's deadline (grpc-timeout, x-nereid-deadline-ms) is capped by it.
    #[arg(long, default_value_t = DEFAULT_REQUEST_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..=MAX_REQUEST_TIMEOUT_MS))]
    pub request_timeout_ms: u64,

    /// Most inference requests in flight through the gateway; more are refused at once with
    /// RESOURCE_EXHAUSTED / 429 + Retry-After.
    #[arg(long, default_value_t = DEFAULT_MAX_CONCURRENT_REQUESTS, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_concurrent_requests: u64,

    /// Retries allowed, as a percentage of requests over the last 10 s (plus
    /// --retry-budget-min-per-sec). 0 disables retries.
    #[arg(long, default_value_t = DEFAULT_RETRY_BUDGET_PERCENT, value_parser = clap::value_parser!(u32).range(0..=100))]
    pub retry_budget_percent: u32,

    /// Retries always allowed per second, whatever the request rate.
    #[arg(long, default_value_t = DEFAULT_RETRY_BUDGET_MIN_PER_SEC)]
    pub retry_budget_min_per_sec: u32,

    /// Consecutive connection failures / UNAVAILABLE answers after which a worker is ejected.
    #[arg(long, default_value_t = DEFAULT_EJECTION_CONSECUTIVE_FAILURES, value_parser = clap::value_parser!(u32).range(1..))]
    pub ejection_consecutive_failures: u32,

    /// First ejection period in milliseconds; it doubles with each ejection in a row.
    #[arg(long, default_value_t = DEFAULT_EJECTION_BASE_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub ejection_base_ms: u64,

    /// Longest ejection period in milliseconds.
    #[arg(long, default_value_t = DEFAULT_EJECTION_MAX_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub ejection_max_ms: u64,

    /// A worker that has answered nothing for this long (milliseconds) while 4 × the
    /// consecutive-failure count of requests in a row ran into their clients' own deadlines is
    /// hung (a stuck model still answers pings and readiness polls): ejected like a failing one.
    #[arg(long, default_value_t = DEFAULT_EJECTION_HUNG_AFTER_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub ejection_hung_after_ms: u64,

    /// How often each worker's repository index is polled, in milliseconds.
    #[arg(long, default_value_t = DEFAULT_DISCOVERY_INTERVAL_MS, value_parser = clap::value_parser!(u64).range(10..))]
    pub discovery_interval_ms: u64,

    /// Time limit of one poll of one worker, in milliseconds (a worker that does not answer
    /// in time has no routable models until it does).
    #[arg(long, default_value_t = DEFAULT_DISCOVERY_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub discovery_timeout_ms: u64,

    /// Largest accepted request (HTTP body or gRPC message) in bytes, at most 2 GiB - 1: the
    /// largest message the gateway forwards (an HTTP/2 frame payload's limit).
    #[arg(long, default_value_t = DEFAULT_MAX_REQUEST_BYTES, value_parser = clap::value_parser!(u64).range(1024..=i32::MAX as u64))]
    pub max_request_bytes: u64,

    /// Seconds to finish in-flight requests after SIGTERM/SIGINT before exiting.
    #[arg(long, default_value_t = DEFAULT_EXIT_TIMEOUT_SECS)]
    pub exit_timeout_secs: u64,

    /// Threads serving requests. 1 (the default): one event loop — no cross-thread wake-ups on
    /// the request path, the lowest added latency, enough for tens of thousands of requests per
    /// second; 0: a work-stealing pool with one thread per core; N: a pool of N threads.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(0..=1024))]
    pub io_threads: u64,

    /// HTTP/2 connections to each worker that inference calls are spread over (round robin).
    /// Each connection's frames are handled in order by one task on either side: with one per
    /// worker, a 16-core host passed ~22k identity calls/s whether the gateway ran 1, 2 or 4
    /// I/O threads. With several I/O threads, several connections let each thread carry some.
    /// 0 (the default): one per I/O thread, at most 8.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=64))]
    pub upstream_connections: u64,

    /// Time to connect to a worker, in milliseconds (Envoy's cluster `connect_timeout`): the
    /// TCP connection and, on inference connections, the HTTP/2 handshake; on the control
    /// channel (metadata, config, statistics, health polls) the TCP connection.
    /// A call whose connection is not up in time fails as never sent, and is retried on
    /// another worker where the retry budget allows.
    #[arg(long, default_value_t = DEFAULT_CONNECT_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub connect_timeout_ms: u64,

    /// Verbose logging level (0 = info, 1 = debug, 2+ = trace). RUST_LOG overrides.
    #[arg(long, default_value_t = 0)]
    pub log_verbose: u8,
}

impl Args {
    /// The validated configuration; errors name the flag.
    pub fn into_config(self) -> Result<GatewayConfig, String> {
        let etcd = match &self.etcd_endpoints {
            None => None,
            Some(e) => Some(EtcdConfig {
                endpoints: nereid_common::fleet::parse_endpoints(e).map_err(|e| format!("--etcd-endpoints: {e}"))?,
                keys: nereid_common::fleet::Keys::new(&self.etcd_prefix).map_err(|e| format!("--etcd-prefix: {e}"))?,
                gateway_id: match &self.gateway_id {
                    Some(id) => {
                        nereid_common::fleet::keys::check_name("--gateway-id", id)?;
                        id.clone()
                    }
                    None => default_gateway_id(),
                },
                placement: self.placement,
                election_ttl: Duration::from_secs(self.election_ttl_secs),
                placement_load_timeout: Duration::from_secs(self.placement_load_timeout_secs),
            }),
        };
        let config = GatewayConfig {
            workers: self.worker_grpc,
            etcd,
            listen: ListenConfig {
                address: self.address,
                http_port: self.http_port,
                grpc_port: self.grpc_port,
                metrics_port: self.metrics_port,
                port_file: self.port_file,
            },
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            admission: AdmissionConfig { max_concurrent_requests: self.max_concurrent_requests as usize },
            retry: RetryConfig {
                budget_percent: self.retry_budget_percent,
                min_per_sec: self.retry_budget_min_per_sec,
            },
            outlier: OutlierConfig {
                consecutive_failures: self.ejection_consecutive_failures,
                base_ejection: Duration::from_millis(self.ejection_base_ms),
                max_ejection: Duration::from_millis(self.ejection_max_ms),
                hung_after: Duration::from_millis(self.ejection_hung_after_ms),
            },
            discovery: DiscoveryConfig {
                interval: Duration::from_millis(self.discovery_interval_ms),
                timeout: Duration::from_millis(self.discovery_timeout_ms),
            },
            max_request_bytes: self.max_request_bytes as usize,
            exit_timeout: Duration::from_secs(self.exit_timeout_secs),
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            // One per I/O thread by default, at most 8 (each worker gets them all).
            upstream_connections: match (self.upstream_connections, self.io_threads) {
                (0, 0) => std::thread::available_parallelism().map_or(1, |n| n.get()).min(8),
                (0, threads) => (threads as usize).min(8),
                (n, _) => n as usize,
            },
        };
        config.validate()?;
        Ok(config)
    }
}

fn default_gateway_id() -> String {
    format!("{}-{}", nereid_common::fleet::hostname("gateway"), std::process::id())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn parse(extra: &[&str]) -> Result<GatewayConfig, String> {
        let args = ["nereid-gateway", "--etcd-endpoints", "http://127.0.0.1:2379"].iter().chain(extra);
        Args::try_parse_from(args).map_err(|e| e.to_string())?.into_config()
    }

    #[test]
    fn connect_timeout_is_validated_and_documented() {
        assert_eq!(parse(&[]).unwrap().connect_timeout, Duration::from_millis(DEFAULT_CONNECT_TIMEOUT_MS));
        assert_eq!(parse(&["--connect-timeout-ms", "5000"]).unwrap().connect_timeout, Duration::from_secs(5));
        for bad in ["0", "600001", "-1", "1s"] {
            let e = parse(&[&format!("--connect-timeout-ms={bad}")]).unwrap_err();
            assert!(e.contains("--connect-timeout-ms"), "{bad}: {e}");
        }
        let help = Args::command().render_long_help().to_string();
        assert!(help.contains("--connect-timeout-ms"), "{help}");
    }

    #[test]
    fn placement_load_timeout_is_validated_and_documented() {
        let etcd = |c: GatewayConfig| c.etcd.expect("etcd config");
        assert_eq!(
            etcd(parse(&[]).unwrap()).placement_load_timeout,
            Duration::from_secs(DEFAULT_PLACEMENT_LOAD_TIMEOUT_SECS)
        );
        let c = etcd(parse(&["--placement-load-timeout-secs", "30"]).unwrap());
        assert_eq!(c.placement_load_timeout, Duration::from_secs(30));
        for bad in ["0", "86401", "-1", "ten"] {
            let e = parse(&[&format!("--placement-load-timeout-secs={bad}")]).unwrap_err();
            assert!(e.contains("--placement-load-timeout-secs"), "{bad}: {e}");
        }
        let help = Args::command().render_long_help().to_string();
        assert!(help.contains("--placement-load-timeout-secs"), "{help}");
        assert!(help.contains("[default: 600]"), "{help}");
    }
}
