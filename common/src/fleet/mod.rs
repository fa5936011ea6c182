//! The fleet's shared state in etcd: the key schema ([`keys`]), the JSON records stored under it
//! ([`records`]), a connection helper ([`connect`]), paged prefix reads and watches without the
//! 4 MiB message limit in the way ([`read`]), and the check that tells a watch resume from a
//! history etcd lost ([`history`]). Workers, gateways and `nereidctl` all read and write etcd
//! through these, so the schema lives in one place.
//!
//! ```text
//! <prefix>/workers/<id>                worker record, under the worker's lease
//! <prefix>/models/<model>              declared model: versions, replicas, resources
//! <prefix>/placement/<worker>/<m>/<v>  assignment written by the placement controller
//! <prefix>/status/<worker>/<m>/<v>     LOADING | READY | FAILED(reason), under the worker's lease
//! <prefix>/routes/<model>              version weights, sticky key, pins
//! <prefix>/drain/<worker>              operator's drain (cordon) request
//! <prefix>/leader/placement            election of the placement controller
//! ```
//!
//! Values are JSON objects with a `schema` version; a value with an unknown version, unknown
//! fields or impossible numbers is rejected by [`records::decode`] — readers keep their last good
//! state and count the rejection.

pub mod history;
pub mod keys;
pub mod read;
pub mod records;
pub mod state;

use std::time::Duration;

pub use etcd_client;
pub use history::{ClusterMark, history_reset};
pub use keys::{Key, Keys};
pub use read::{PrefixRead, get_prefix, watch};
pub use state::{Assignment, FleetState, Rejected};

/// Response header (gRPC metadata and HTTP) in which a worker reports, in-band, how many
/// requests are queued across its models when it answers; gateways balance on it. Load figures
/// travel this way, not through etcd, so etcd's load does not grow with the request rate.
pub const QUEUE_REPORT_HEADER: &str = "nereid-queue";

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "/nereid/v1";

/// Options every Nereid etcd client uses: bounded connect time, and HTTP/2 keep-alives so an
/// etcd that vanished without closing the connection (a partition) is noticed on an idle watch
/// within ~15 s. The ping interval stays above etcd's `--grpc-keepalive-min-time` (5 s by
/// default): pinging more often makes etcd close the connection ("too many pings").
///
/// Every request also requires a leader (etcd's `hasleader` metadata). A member cut off from its
/// quorum still answers pings and keeps idle watch streams open, so without it a gateway
/// attached to that member would keep a stale table with its watch reported healthy. With it,
/// the member refuses new requests at once ("etcdserver: no leader") and cancels open streams
/// a few election timeouts after losing its leader, so each stream's owner notices:
/// - watches (gateway membership, the worker's placement agent) end, are reported down, and
///   are re-opened with back-off, resuming once a member with a leader answers;
/// - lease keep-alive streams end too: a worker starts a new session (it re-registers under a
///   new lease when the quorum is back; a leaderless cluster could not renew the old lease
///   anyway), and a placement leader steps down instead of planning on a stale view — its
///   election key, on a lease nobody renews, then expires for the majority side to elect anew;
/// - campaigns and reads fail fast instead of hanging until their time-outs.
pub fn connect_options() -> etcd_client::ConnectOptions {
    etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        .with_keep_alive_while_idle(true)
        .with_require_leader(true)
}

/// Splits and checks `--etcd-endpoints` (comma-separated `http://host:port`).
pub fn parse_endpoints(value: &str) -> Result<Vec<String>, String> {
    let endpoints: Vec<String> = value.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect();
    if endpoints.is_empty() {
        return Err("no endpoint given".into());
    }
    for e in &endpoints {
        let rest = e
            .strip_prefix("http://")
            .ok_or_else(|| format!("'{e}': expected http://host:port (TLS to etcd is not supported yet)"))?;
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("'{e}': expected http://host:port"))?;
        if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) || rest.contains('/') {
            return Err(format!("'{e}': expected http://host:port"));
        }
    }
    Ok(endpoints)
}

/// Connects (lazily: the first request fails if etcd is down) with [`connect_options`].
pub async fn connect(endpoints: &[String]) -> Result<etcd_client::Client, etcd_client::Error> {
    etcd_client::Client::connect(endpoints, Some(connect_options())).await
}

/// Bound on one etcd call made by a Nereid component (connect, read, write, grant, revoke).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// Awaits one etcd call, bounded by [`CALL_TIMEOUT`]; the error names `what`.
pub async fn bounded<T>(what: &str, f: impl Future<Output = Result<T, etcd_client::Error>>) -> Result<T, String> {
    match tokio::time::timeout(CALL_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {CALL_TIMEOUT:?}")),
    }
}

/// Checks one message of a lease's keep-alive stream: `Ok` while the lease lives.
pub fn check_keepalive(
    msg: Result<Option<etcd_client::LeaseKeepAliveResponse>, etcd_client::Error>,
) -> Result<(), String> {
    match msg {
        Ok(Some(r)) if r.ttl() > 0 => Ok(()),
        Ok(Some(_)) => Err("the lease expired".into()),
        Ok(None) => Err("the keep-alive stream closed".into()),
        Err(e) => Err(format!("keep-alive: {e}")),
    }
}

/// A lease kept alive on a task of its own ([`spawn_keepalive`]): resolves, with why, only when
/// the lease is lost; dropping it stops the keep-alives.
pub struct KeepAliveTask(tokio::task::JoinHandle<String>);

impl std::future::Future for KeepAliveTask {
    type Output = String;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<String> {
        std::pin::Pin::new(&mut self.0)
            .poll(cx)
            .map(|ended| ended.unwrap_or_else(|e| format!("the keep-alive task failed: {e}")))
    }
}

impl Drop for KeepAliveTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Keeps a lease alive every `interval` on a task of its own, so that nothing its holder
/// awaits meanwhile (a paged read of a large fleet, a burst of writes to a slow etcd) can make
/// it miss a keep-alive. The task ends only when the lease is lost, with why, or when the
/// returned handle is dropped.
pub fn spawn_keepalive(
    mut keeper: etcd_client::LeaseKeeper,
    mut responses: etcd_client::LeaseKeepAliveStream,
    interval: Duration,
) -> KeepAliveTask {
    KeepAliveTask(tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if let Err(e) = bounded("keep-alive", keeper.keep_alive()).await {
                        return e;
                    }
                }
                msg = responses.message() => {
                    if let Err(e) = check_keepalive(msg) {
                        return e;
                    }
                }
            }
        }
    }))
}

/// This host's name (for default worker and gateway ids), `fallback` when unknown.
pub fn hostname(fallback: &str) -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| fallback.to_string())
}

/// Bounded exponential back-off for reconnect loops: 100 ms doubling to 2 s.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    pub const MIN: Duration = Duration::from_millis(100);
    pub const MAX: Duration = Duration::from_secs(2);

    pub fn new() -> Self {
        Backoff { next: Self::MIN }
    }

    /// The delay before the next attempt (and doubles the one after).
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        d
    }

    pub fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(parse_endpoints("http://127.0.0.1:2379").unwrap(), vec!["http://127.0.0.1:2379"]);
        assert_eq!(parse_endpoints("http://a:1, http://b:2").unwrap().len(), 2);
        assert!(parse_endpoints("").is_err());
        assert!(parse_endpoints("127.0.0.1:2379").unwrap_err().contains("http://host:port"));
        assert!(parse_endpoints("https://a:1").is_err());
        assert!(parse_endpoints("http://a").is_err());
        assert!(parse_endpoints("http://a:0").is_err());
        assert!(parse_endpoints("http://a:1/x").is_err());
    }

    #[test]
    fn every_request_requires_a_leader() {
        // The options' fields are private; their Debug form is the only way to read them back.
        let options = format!("{:?}", connect_options());
        assert!(options.contains("require_leader: true"), "{options}");
    }

    #[test]
    fn backoff_doubles_to_a_cap() {
        let mut b = Backoff::new();
        let delays: Vec<u64> = (0..7).map(|_| b.next_delay().as_millis() as u64).collect();
        assert_eq!(delays, vec![100, 200, 400, 800, 1600, 2000, 2000]);
        b.reset();
        assert_eq!(b.next_delay(), Backoff::MIN);
    }
}
