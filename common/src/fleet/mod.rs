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
/// - lease keep-alive streams end too: a worker's [`KeptLease`] opens another stream for the same
///   lease, with back-off, and gives the lease up only once etcd says it is gone or its
///   [`LeaseDeadline`] passes (a leaderless cluster cannot renew it; the worker then registers
///   under a new lease when the quorum is back), and a placement leader steps down instead of
///   planning on a stale view — its election key, on a lease nobody renews, then expires for
///   the majority side to elect anew;
/// - campaigns and reads fail fast instead of hanging until their time-outs.
pub fn connect_options() -> etcd_client::ConnectOptions {
    etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        .with_keep_alive_while_idle(true)
        .with_require_leader(true)
}

/// Whether a watch (or read) failed because a response was too large to decode: resuming from
/// the same revision would fetch the same response and fail the same way for ever, so the
/// caller reads the prefix anew (paged) instead.
pub fn too_large(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::OutOfRange || s.message().contains("message length too large"))
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

/// Until when a kept lease lives as far as its holder can tell, the way etcd's own client
/// (clientv3) reckons it: each keep-alive answer moves the deadline to the answer's arrival plus
/// the TTL the answer granted. Once the deadline passes with no answer, the lease is presumed
/// lost — etcd expires it on its side all the same — whether or not the stream carrying the
/// keep-alives is still open: an etcd that stopped answering (a stalled process, a frozen VM,
/// a partition that keeps the connection up) would otherwise be noticed only when HTTP/2
/// keep-alives end the connection, long after the lease and everything under it is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseDeadline(tokio::time::Instant);

impl LeaseDeadline {
    /// The deadline of a lease granted (or last renewed) for `ttl` at `since`.
    pub fn new(since: tokio::time::Instant, ttl: Duration) -> LeaseDeadline {
        LeaseDeadline(since + ttl)
    }

    /// Notes a keep-alive answer that arrived `at` granting `ttl_secs` more seconds; `Err` (the
    /// deadline unchanged) when it says the lease is gone (a TTL of 0 or less: expired,
    /// revoked, or never granted on this cluster).
    pub fn renew(&mut self, at: tokio::time::Instant, ttl_secs: i64) -> Result<(), String> {
        if ttl_secs <= 0 {
            return Err("the lease expired".into());
        }
        self.0 = at + Duration::from_secs(ttl_secs as u64);
        Ok(())
    }

    /// When the lease is presumed lost unless an answer renews it first.
    pub fn at(&self) -> tokio::time::Instant {
        self.0
    }

    fn passed(&self) -> String {
        "no keep-alive answer renewed the lease before its TTL ran out".into()
    }
}

/// Why keeping a lease alive over one keep-alive stream stopped.
#[derive(Debug, PartialEq, Eq)]
enum StreamEnd {
    /// The lease is gone: etcd said so, or its [`LeaseDeadline`] passed with no answer.
    Lost(String),
    /// The stream failed or closed (an etcd restart, a leader change, a member that lost its
    /// quorum): the lease itself may well live on, and another stream can keep it.
    Broken(String),
}

/// Keeps a lease alive over one stream, sending a keep-alive every `interval` and moving
/// `deadline` with every answer, until the lease is lost or the stream breaks.
async fn keep_over(
    keeper: &mut etcd_client::LeaseKeeper,
    responses: &mut etcd_client::LeaseKeepAliveStream,
    interval: Duration,
    deadline: &mut LeaseDeadline,
) -> StreamEnd {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = tokio::time::sleep_until(deadline.at()) => return StreamEnd::Lost(deadline.passed()),
            msg = responses.message() => match msg {
                Ok(Some(r)) => {
                    if let Err(e) = deadline.renew(tokio::time::Instant::now(), r.ttl()) {
                        return StreamEnd::Lost(e);
                    }
                }
                Ok(None) => return StreamEnd::Broken("the keep-alive stream closed".into()),
                Err(e) => return StreamEnd::Broken(format!("keep-alive: {e}")),
            },
            _ = tick.tick() => {
                // Bounded by the deadline too: a send that cannot go out (the stream's buffer
                // full behind a stalled connection) must not hold the deadline off.
                let send = tokio::time::timeout(CALL_TIMEOUT, keeper.keep_alive());
                tokio::select! {
                    biased;
                    _ = tokio::time::sleep_until(deadline.at()) => return StreamEnd::Lost(deadline.passed()),
                    sent = send => match sent {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return StreamEnd::Broken(format!("keep-alive: {e}")),
                        Err(_) => return StreamEnd::Broken(format!("keep-alive: not sent within {CALL_TIMEOUT:?}")),
                    },
                }
            }
        }
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

impl KeepAliveTask {
    /// Whether the task has ended (the lease lost, or the stream broken) without awaiting it.
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}

impl Drop for KeepAliveTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Keeps a lease alive every `interval` on a task of its own, so that nothing its holder
/// awaits meanwhile (a paged read of a large fleet, a burst of writes to a slow etcd) can make
/// it miss a keep-alive. The task ends, with why, when the lease is lost — etcd answers that it
/// expired, or no answer renewed it within its TTL (a [`LeaseDeadline`]: the TTL each answer
/// grants; until the first answer, `3 × interval`, the TTL/3 cadence every holder keeps) — or
/// when the stream breaks (this task does not open another: for a holder that must give up what
/// the lease stands for at once, such as a placement leader; see [`KeptLease`] for one that
/// keeps its lease across broken streams); or when the returned handle is dropped.
pub fn spawn_keepalive(
    mut keeper: etcd_client::LeaseKeeper,
    mut responses: etcd_client::LeaseKeepAliveStream,
    interval: Duration,
) -> KeepAliveTask {
    KeepAliveTask(tokio::spawn(async move {
        let mut deadline = LeaseDeadline::new(tokio::time::Instant::now(), interval * 3);
        match keep_over(&mut keeper, &mut responses, interval, &mut deadline).await {
            StreamEnd::Lost(why) | StreamEnd::Broken(why) => why,
        }
    }))
}

/// A lease whose lifetime is its holder's, not one connection's or one stream's: a task of its
/// own keeps it alive every TTL/3, and when its keep-alive stream breaks (an etcd restart, a
/// leader change, a member without quorum) opens another, with back-off, for the same lease.
/// The lease is reported lost ([`KeptLease::lost`], [`KeptLease::until_lost`]) only when etcd
/// answers that it is gone (expired, revoked) or when its [`LeaseDeadline`] passes with no
/// answer — then, and only then, does its holder need a new one. Dropping it stops the
/// keep-alives (the lease then expires within its TTL, unless revoked first).
pub struct KeptLease {
    id: i64,
    lost: tokio::sync::watch::Receiver<Option<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl KeptLease {
    /// Grants a lease of `ttl` (whole seconds, at least 1) and keeps it from then on.
    pub async fn grant(client: &etcd_client::Client, ttl: Duration) -> Result<KeptLease, String> {
        let mut grant_client = client.clone();
        // Its TTL runs from when etcd granted it: at the latest, now.
        let since = tokio::time::Instant::now();
        let granted = bounded("lease grant", grant_client.lease_grant(ttl.as_secs().max(1) as i64, None)).await?;
        Ok(KeptLease::keep(client.clone(), granted.id(), Duration::from_secs(granted.ttl().max(1) as u64), since))
    }

    /// Keeps lease `id`, of `ttl`, granted or last renewed at `since`.
    pub fn keep(client: etcd_client::Client, id: i64, ttl: Duration, since: tokio::time::Instant) -> KeptLease {
        let (tx, lost) = tokio::sync::watch::channel(None);
        let task = tokio::spawn(async move {
            let why = keep_lease(client, id, ttl, LeaseDeadline::new(since, ttl)).await;
            tracing::warn!(lease = id, "lease lost: {why}");
            tx.send_replace(Some(why));
        });
        KeptLease { id, lost, task }
    }

    pub fn id(&self) -> i64 {
        self.id
    }

    /// Why the lease was lost, once it was; `None` while it is kept.
    pub fn lost(&self) -> Option<String> {
        if let Some(why) = self.lost.borrow().clone() {
            return Some(why);
        }
        self.task.is_finished().then(|| "the keep-alive task ended".to_string())
    }

    /// Resolves, with why, once the lease is lost (at once if it already is). Owns what it
    /// needs: awaiting it borrows nothing of this handle.
    pub fn until_lost(&self) -> impl Future<Output = String> + Send + 'static {
        let mut lost = self.lost.clone();
        async move {
            match lost.wait_for(Option::is_some).await {
                Ok(why) => why.clone().unwrap_or_default(),
                Err(_) => "the keep-alive task ended".to_string(),
            }
        }
    }
}

impl Drop for KeptLease {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// [`KeptLease`]'s task: keeps lease `id` over one stream after another until it is lost; why.
async fn keep_lease(mut client: etcd_client::Client, id: i64, ttl: Duration, mut deadline: LeaseDeadline) -> String {
    let interval = ttl / 3;
    let mut backoff = Backoff::new();
    loop {
        let opened = tokio::select! {
            biased;
            _ = tokio::time::sleep_until(deadline.at()) => return deadline.passed(),
            opened = tokio::time::timeout(CALL_TIMEOUT, client.lease_keep_alive(id)) => opened,
        };
        let started = tokio::time::Instant::now();
        let end = match opened {
            // Opening sent a keep-alive, and etcd answered it with a TTL above 0.
            Ok(Ok((mut keeper, mut responses))) => match deadline.renew(started, ttl.as_secs().max(1) as i64) {
                Ok(()) => keep_over(&mut keeper, &mut responses, interval, &mut deadline).await,
                Err(e) => StreamEnd::Lost(e),
            },
            // etcd-client's words for a first answer with a TTL of 0.
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(e))) if e == "lease not found" => {
                StreamEnd::Lost("the lease expired".into())
            }
            Ok(Err(e)) => StreamEnd::Broken(format!("opening a keep-alive stream: {e}")),
            Err(_) => StreamEnd::Broken(format!("opening a keep-alive stream: no answer within {CALL_TIMEOUT:?}")),
        };
        match end {
            StreamEnd::Lost(why) => return why,
            StreamEnd::Broken(why) => {
                backoff.reset_if_stable(started.elapsed());
                let delay = backoff.next_delay();
                tracing::info!(lease = id, "{why}; keeping the lease over a new stream in {delay:?}");
                tokio::select! {
                    biased;
                    _ = tokio::time::sleep_until(deadline.at()) => return deadline.passed(),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// Whether an etcd write failed because the lease it named is gone (expired or revoked).
pub fn lease_not_found(error: &str) -> bool {
    error.contains("requested lease not found")
}

/// This host's name (for default worker and gateway ids), `fallback` when unknown.
pub fn hostname(fallback: &str) -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| fallback.to_string())
}

/// Bounded exponential back-off for reconnect loops, with jitter: the step doubles from 100 ms
/// to 2 s, and each delay is drawn uniformly between half the step and the step ("equal
/// jitter"), so that clients cut off together (an etcd restart, a leader change) do not retry
/// in lockstep.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    pub const MIN: Duration = Duration::from_millis(100);
    pub const MAX: Duration = Duration::from_secs(2);
    /// How long an attempt must have stayed up for the back-off to start over after it ends
    /// ([`Backoff::reset_if_stable`]): a flapping etcd, accepting each attempt only to drop it
    /// at once, is retried ever more slowly, not every 100 ms.
    pub const STABLE: Duration = Duration::from_secs(10);

    pub fn new() -> Self {
        Backoff { next: Self::MIN }
    }

    /// The delay before the next attempt (and doubles the step of the one after).
    pub fn next_delay(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        let half = step / 2;
        half + half.mul_f64(random_unit())
    }

    pub fn reset(&mut self) {
        self.next = Self::MIN;
    }

    /// Starts over when the attempt that just ended had been up for at least
    /// [`Backoff::STABLE`].
    pub fn reset_if_stable(&mut self, up_for: Duration) {
        if up_for >= Self::STABLE {
            self.reset();
        }
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

/// A number drawn uniformly from [0, 1): SipHash under keys std seeds from the OS once per
/// thread and changes on every call — random enough to spread retries, with no dependency.
fn random_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let bits = std::collections::hash_map::RandomState::new().build_hasher().finish();
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_response_too_large_to_decode_is_re_read_not_resumed() {
        let status = |code, message: &str| etcd_client::Error::GRpcStatus(tonic::Status::new(code, message));
        let tonic_limit = "Error, decoded message length too large: found 70000000 bytes, the limit is: 67108864 bytes";
        assert!(too_large(&status(tonic::Code::OutOfRange, tonic_limit)));
        assert!(too_large(&status(tonic::Code::Internal, tonic_limit)));
        assert!(!too_large(&status(tonic::Code::Unavailable, "connection reset")));
        assert!(!too_large(&etcd_client::Error::WatchError("the watch stream ended".into())));
    }

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
    fn backoff_doubles_to_a_cap_with_jitter() {
        let mut b = Backoff::new();
        let steps = [100, 200, 400, 800, 1600, 2000, 2000];
        for step in steps {
            let d = b.next_delay();
            let step = Duration::from_millis(step);
            assert!(d >= step / 2 && d <= step, "{d:?} outside [{:?}, {step:?}]", step / 2);
        }
        // Jittered: many delays at the cap are not all one value (clients do not retry in
        // lockstep).
        let at_cap: std::collections::BTreeSet<Duration> = (0..50).map(|_| b.next_delay()).collect();
        assert!(at_cap.len() > 10, "{at_cap:?}");
        assert!(at_cap.iter().all(|d| *d >= Backoff::MAX / 2 && *d <= Backoff::MAX));
        b.reset();
        assert!(b.next_delay() <= Backoff::MIN);
    }

    #[test]
    fn backoff_starts_over_only_after_a_stable_attempt() {
        let mut b = Backoff::new();
        for _ in 0..6 {
            b.next_delay();
        }
        // Up a moment (a flapping etcd): still at the cap.
        b.reset_if_stable(Duration::from_millis(50));
        assert!(b.next_delay() >= Backoff::MAX / 2);
        b.reset_if_stable(Backoff::STABLE);
        assert!(b.next_delay() <= Backoff::MIN);
    }

    #[test]
    fn random_units_are_in_range_and_vary() {
        let draws: Vec<f64> = (0..1000).map(|_| random_unit()).collect();
        assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
        // Spread over the range, not stuck in one part of it.
        assert!(draws.iter().any(|u| *u < 0.25) && draws.iter().any(|u| *u > 0.75));
    }

    #[test]
    fn a_lease_deadline_moves_with_each_answer_and_an_expired_answer_is_a_loss() {
        let t0 = tokio::time::Instant::now();
        let mut deadline = LeaseDeadline::new(t0, Duration::from_secs(6));
        assert_eq!(deadline.at(), t0 + Duration::from_secs(6));
        // An answer 2 s later granting 6 s: the lease lives until 8 s.
        let t2 = t0 + Duration::from_secs(2);
        deadline.renew(t2, 6).unwrap();
        assert_eq!(deadline.at(), t0 + Duration::from_secs(8));
        // etcd answered the lease is gone: lost, the deadline untouched.
        assert_eq!(deadline.renew(t0 + Duration::from_secs(3), 0).unwrap_err(), "the lease expired");
        assert!(deadline.renew(t0 + Duration::from_secs(3), -1).is_err());
        assert_eq!(deadline.at(), t0 + Duration::from_secs(8));
    }

    #[test]
    fn a_write_under_a_lease_that_is_gone_is_told_apart() {
        assert!(lease_not_found("put status: etcdserver: requested lease not found"));
        assert!(!lease_not_found("put status: etcdserver: mvcc: database space exceeded"));
    }
}
