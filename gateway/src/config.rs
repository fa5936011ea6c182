//! The gateway's configuration as typed values, validated once at start-up and passed down.
//! Nothing below `main` reads flags or the environment.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 60_000;
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: u64 = 4096;
pub const DEFAULT_RETRY_BUDGET_PERCENT: u32 = 20;
pub const DEFAULT_RETRY_BUDGET_MIN_PER_SEC: u32 = 10;
pub const DEFAULT_EJECTION_CONSECUTIVE_FAILURES: u32 = 5;
pub const DEFAULT_EJECTION_BASE_MS: u64 = 1_000;
pub const DEFAULT_EJECTION_MAX_MS: u64 = 30_000;
/// How long a worker must have answered nothing before client timeouts alone eject it.
pub const DEFAULT_EJECTION_HUNG_AFTER_MS: u64 = 10_000;
pub const DEFAULT_DISCOVERY_INTERVAL_MS: u64 = 1_000;
pub const DEFAULT_DISCOVERY_TIMEOUT_MS: u64 = 500;
pub const DEFAULT_MAX_REQUEST_BYTES: u64 = 64 << 20;
pub const DEFAULT_EXIT_TIMEOUT_SECS: u64 = 30;
/// Time to connect to a worker (TCP and the HTTP/2 handshake). One second is the first SYN
/// retransmission: a worker's host that drops one SYN is given up on, and the request retried
/// elsewhere, rather than waited for; a fleet across slow links needs more.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 1_000;
/// Generous: a large model on a busy worker may take minutes to load and warm up.
pub const DEFAULT_PLACEMENT_LOAD_TIMEOUT_SECS: u64 = 600;
/// The longest accepted `--placement-load-timeout-secs` (a day).
pub const MAX_PLACEMENT_LOAD_TIMEOUT_SECS: u64 = 86_400;

#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Workers' gRPC addresses (`host:port`), for the static membership.
    pub workers: Vec<String>,
    /// The fleet in etcd (instead of `workers`).
    pub etcd: Option<EtcdConfig>,
    pub listen: ListenConfig,
    /// Cap on every request's deadline.
    pub request_timeout: Duration,
    pub admission: AdmissionConfig,
    pub retry: RetryConfig,
    pub outlier: OutlierConfig,
    /// HTTP/2 connections to each worker that inference is spread over (at least 1).
    pub upstream_connections: usize,
    /// Time to connect to a worker (TCP and the HTTP/2 handshake).
    pub connect_timeout: Duration,
    pub discovery: DiscoveryConfig,
    pub max_request_bytes: usize,
    /// Grace period for in-flight requests after SIGTERM.
    pub exit_timeout: Duration,
}

#[derive(Clone, Debug)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub keys: nereid_common::fleet::Keys,
    /// This gateway's name in the placement election.
    pub gateway_id: String,
    /// Whether this gateway runs for placement controller leader.
    pub placement: bool,
    /// TTL of the election lease: how long a dead leader blocks a new one.
    pub election_ttl: Duration,
    /// How long the placement controller waits for a placed version to be READY before it
    /// treats the load as failed and places the replica elsewhere.
    pub placement_load_timeout: Duration,
}

#[derive(Clone, Debug)]
pub struct ListenConfig {
    pub address: IpAddr,
    pub http_port: u16,
    pub grpc_port: u16,
    pub metrics_port: u16,
    pub port_file: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug)]
pub struct AdmissionConfig {
    pub max_concurrent_requests: usize,
}

#[derive(Clone, Copy, Debug)]
pub struct RetryConfig {
    /// Retries allowed as a percentage of the requests in the budget's window.
    pub budget_percent: u32,
    /// Retries per second always allowed.
    pub min_per_sec: u32,
}

#[derive(Clone, Copy, Debug)]
pub struct OutlierConfig {
    pub consecutive_failures: u32,
    pub base_ejection: Duration,
    pub max_ejection: Duration,
    /// Client timeouts eject a worker only once it has answered nothing for this long.
    pub hung_after: Duration,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            consecutive_failures: DEFAULT_EJECTION_CONSECUTIVE_FAILURES,
            base_ejection: Duration::from_millis(DEFAULT_EJECTION_BASE_MS),
            max_ejection: Duration::from_millis(DEFAULT_EJECTION_MAX_MS),
            hung_after: Duration::from_millis(DEFAULT_EJECTION_HUNG_AFTER_MS),
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct DiscoveryConfig {
    pub interval: Duration,
    pub timeout: Duration,
}

impl GatewayConfig {
    /// Checks what clap's per-flag parsers cannot; messages name the flag.
    pub fn validate(&self) -> Result<(), String> {
        match (&self.etcd, self.workers.is_empty()) {
            (None, true) => {
                return Err("give the fleet with --etcd-endpoints, or static workers with --worker-grpc".into());
            }
            (Some(_), false) => return Err("--worker-grpc and --etcd-endpoints cannot be combined".into()),
            _ => {}
        }
        for w in &self.workers {
            validate_host_port(w).map_err(|e| format!("--worker-grpc '{w}': {e}"))?;
        }
        let mut sorted = self.workers.clone();
        sorted.sort();
        if let Some(dup) = sorted.windows(2).find(|p| p[0] == p[1]) {
            return Err(format!("--worker-grpc '{}' is given twice", dup[0]));
        }
        if self.outlier.max_ejection < self.outlier.base_ejection {
            return Err("--ejection-max-ms must be at least --ejection-base-ms".into());
        }
        if self.discovery.timeout > self.discovery.interval.saturating_mul(10) {
            return Err("--discovery-timeout-ms must be at most 10 × --discovery-interval-ms".into());
        }
        Ok(())
    }
}

/// `host:port` with a non-empty host and a non-zero numeric port (no scheme, no path).
fn validate_host_port(s: &str) -> Result<(), String> {
    if s.contains("://") || s.contains('/') {
        return Err("expected host:port without a scheme or path".into());
    }
    let (host, port) = s.rsplit_once(':').ok_or("expected host:port")?;
    if host.is_empty() || host == "[]" {
        return Err("the host is empty".into());
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("'{port}' is not a port number (1-65535)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_validation() {
        assert!(validate_host_port("127.0.0.1:8001").is_ok());
        assert!(validate_host_port("worker-0.svc:8001").is_ok());
        assert!(validate_host_port("[::1]:8001").is_ok());
        assert!(validate_host_port("127.0.0.1").is_err());
        assert!(validate_host_port(":8001").is_err());
        assert!(validate_host_port("h:0").is_err());
        assert!(validate_host_port("h:x").is_err());
        assert!(validate_host_port("http://h:1").is_err());
    }
}
