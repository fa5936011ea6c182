//! The non-inference KServe v2 calls: model readiness, metadata, config and statistics are
//! forwarded to workers holding the model; the repository index is answered from the routing
//! table (the union of the members' indexes), so it costs no fan-out.
//!
//! A forwarded call goes to one holder picked like an inference (p2c, ejected workers skipped)
//! and is retried once on another holder when the first provably did not answer it. Statistics
//! are summed over every reachable worker that lists the model, so they describe the fleet —
//! what perf_analyzer and dashboards reading them through the gateway expect.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use nereid_proto::inference::repository_index_response::ModelIndex;
use nereid_proto::inference::*;
use tonic::transport::Channel;

use crate::balance::choose_route;
use crate::deadline::DeadlineExceeded;
use crate::error::GatewayError;
use crate::forward::UpstreamError;
use crate::routing::{RouteError, Routes, WorkerState};
use crate::upstream::UpstreamId;

type Client = GrpcInferenceServiceClient<Channel>;

#[derive(Clone)]
pub struct Control {
    routes: Routes,
    shapes: Arc<ConfigCache>,
}

impl Control {
    pub fn new(routes: Routes) -> Self {
        Control { routes, shapes: Arc::default() }
    }

    /// The config of the version of `name` a request for `version` is routed to, for shaping
    /// Triton's raw binary requests (the body is the only input's bytes; the config says what
    /// it is). Asked of a holder once and then reused for [`SHAPE_CONFIG_TTL`], not fetched
    /// from a worker on every such request: a config that changes within that time (a model
    /// reloaded with other tensors) is refused by the worker the request goes to, naming the
    /// tensor.
    pub async fn shape_config(
        &self,
        name: &str,
        version: Option<i64>,
        deadline: Instant,
    ) -> Result<Arc<ModelConfig>, GatewayError> {
        let resolved = self.routes.snapshot().resolve(name, version)?.version;
        let started = Instant::now();
        let stale = match self.shapes.lookup(name, resolved, started) {
            Lookup::Hit(config) => return Ok(config),
            Lookup::Refresh(stale) => Some(stale),
            Lookup::Fetch => None,
        };
        // This request refreshes an expired config (others meanwhile use the one it replaces).
        let _refreshing = stale.is_some().then(|| Refreshing { cache: &self.shapes, name, version: resolved, started });
        let fetched = self.model_config(name, Some(resolved), deadline).await.and_then(|response| {
            response.config.map(Arc::new).ok_or_else(|| {
                GatewayError::from(nereid_common::Status::internal("the worker answered no model config"))
            })
        });
        match (fetched, stale) {
            (Ok(config), _) => {
                // As of when it was asked for: a slow answer is not fresher than it is.
                self.shapes.insert(name, resolved, config.clone(), started);
                Ok(config)
            }
            // The model still routes (resolved above): what it was a moment ago serves on.
            (Err(_), Some(stale)) => Ok(stale),
            (Err(e), None) => Err(e),
        }
    }

    /// Runs `call` on a worker holding `model` (`version`) READY, within `deadline`; once more on
    /// another holder when the first provably did not answer. `call` is given the version to
    /// name in what it sends: the one the request was routed to (a holder of a newer version
    /// asked for none would answer for that one, where inference is pinned to the routed
    /// version) — or, asked for no version, `None` once the worker answered that it no longer
    /// has the routed one (a roll-over the table has not caught up with), as inference resends
    /// unpinned.
    async fn on_holder<T, F, Fut>(
        &self,
        model: &str,
        version: Option<i64>,
        deadline: Instant,
        call: F,
    ) -> Result<T, GatewayError>
    where
        F: Fn(Client, Option<i64>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut excluded: Vec<UpstreamId> = Vec::new();
        let mut last_error: Option<UpstreamError> = None;
        loop {
            let (worker, routed) = {
                let table = self.routes.snapshot();
                let route = table.resolve(model, version)?;
                // As inference picks: healthy ready holders, then healthy draining ones, then
                // ejected ones — a control call whose ready holder failed goes on to a draining
                // holder rather than fail where inference would succeed.
                (choose_route(&table, &route, &excluded, Instant::now(), &mut rand::rng()).cloned(), route.version)
            };
            let Some(worker) = worker else {
                return Err(match last_error {
                    Some(e) => e.into(),
                    None => RouteError::NoReadyWorker { model: model.to_string(), version }.into(),
                });
            };
            let mut timeout = deadline.saturating_duration_since(Instant::now());
            if timeout.is_zero() {
                return Err(DeadlineExceeded.into());
            }
            // Whole milliseconds at least: a zero grpc-timeout would fail at once.
            timeout = timeout.max(std::time::Duration::from_millis(1));
            let client = Client::new(worker.channel()).max_decoding_message_size(usize::MAX);
            let answer = tokio::time::timeout(timeout, async {
                match call(client.clone(), Some(routed)).await {
                    Err(status)
                        if version.is_none()
                            && UpstreamError::new(worker.id.clone(), status.clone()).is_version_gone(model) =>
                    {
                        call(client, None).await
                    }
                    answer => answer,
                }
            })
            .await;
            match answer {
                Ok(Ok(response)) => return Ok(response.into_inner()),
                Ok(Err(status)) => {
                    let e = UpstreamError::new(worker.id.clone(), status);
                    if !e.kind.safe_to_retry() || !excluded.is_empty() {
                        return Err(e.into());
                    }
                    excluded.push(worker.id.clone());
                    last_error = Some(e);
                }
                Err(_) => return Err(DeadlineExceeded.into()),
            }
        }
    }

    /// Ready when some worker holds the model (version) READY and confirms it.
    pub async fn model_ready(&self, name: &str, version: Option<i64>, deadline: Instant) -> Result<bool, GatewayError> {
        match self
            .on_holder(name, version, deadline, |mut c, named| {
                let ask =
                    move |v: Option<i64>| ModelReadyRequest { name: name.to_string(), version: version_string(v) };
                async move {
                    let answer = c.model_ready(ask(named)).await?;
                    // Not ready for the routed version when asked for none: it may have just
                    // gone from this worker (a roll-over the table has not caught up with).
                    if version.is_none() && named.is_some() && !answer.get_ref().ready {
                        return c.model_ready(ask(None)).await;
                    }
                    Ok(answer)
                }
            })
            .await
        {
            Ok(r) => Ok(r.ready),
            Err(GatewayError::Route(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub async fn model_metadata(
        &self,
        name: &str,
        version: Option<i64>,
        deadline: Instant,
    ) -> Result<ModelMetadataResponse, GatewayError> {
        let mut metadata = self
            .on_holder(name, version, deadline, |mut c, named| {
                let r = ModelMetadataRequest { name: name.to_string(), version: version_string(named) };
                async move { c.model_metadata(r).await }
            })
            .await?;
        // Asked for no version: every version the fleet routes, as a worker lists all of its own.
        if version.is_none() {
            let routable = self.routes.snapshot().routable_versions(name);
            if !routable.is_empty() {
                metadata.versions = routable.iter().map(i64::to_string).collect();
            }
        }
        Ok(metadata)
    }

    pub async fn model_config(
        &self,
        name: &str,
        version: Option<i64>,
        deadline: Instant,
    ) -> Result<ModelConfigResponse, GatewayError> {
        self.on_holder(name, version, deadline, |mut c, named| {
            let r = ModelConfigRequest { name: name.to_string(), version: version_string(named) };
            async move { c.model_config(r).await }
        })
        .await
    }

    /// Statistics of one model (`name`), or of every model (`None`), summed over the reachable
    /// workers that list it. Fails when every one of them fails (with the first error), and
    /// for a model no reachable worker lists (NOT_FOUND when unknown, else UNAVAILABLE).
    pub async fn model_statistics(
        &self,
        name: Option<&str>,
        version: Option<i64>,
        deadline: Instant,
    ) -> Result<ModelStatisticsResponse, GatewayError> {
        let table = self.routes.snapshot();
        if let Some(name) = name
            && !table.knows(name)
        {
            return Err(RouteError::ModelNotFound { model: name.to_string() }.into());
        }
        let workers: Vec<_> = table
            .workers()
            .iter()
            .filter(|w| w.state != WorkerState::Unreachable)
            .filter(|w| name.is_none_or(|n| w.models.iter().any(|m| m.name == n)))
            .map(|w| w.upstream.clone())
            .collect();
        drop(table);
        // A model known (listed by unreachable workers only, or declared in etcd) that no
        // reachable worker lists: unavailable for now, not an empty answer.
        if let Some(name) = name
            && workers.is_empty()
        {
            return Err(RouteError::NoReadyWorker { model: name.to_string(), version }.into());
        }
        let request = ModelStatisticsRequest { name: name.unwrap_or("").to_string(), version: version_string(version) };
        let timeout = deadline.saturating_duration_since(Instant::now());
        let calls = workers.iter().map(|w| {
            let mut client = Client::new(w.channel()).max_decoding_message_size(usize::MAX);
            let request = request.clone();
            let id = w.id.clone();
            async move {
                match tokio::time::timeout(timeout, client.model_statistics(request)).await {
                    Ok(Ok(r)) => Ok(r.into_inner()),
                    Ok(Err(status)) => Err(GatewayError::from(UpstreamError::new(id, status))),
                    Err(_) => Err(GatewayError::from(DeadlineExceeded)),
                }
            }
        });
        let results = futures::future::join_all(calls).await;
        let mut first_error = None;
        let mut responses = Vec::new();
        for r in results {
            match r {
                Ok(r) => responses.push(r),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match (responses.is_empty(), first_error) {
            (true, Some(e)) => Err(e),
            _ => Ok(merge_statistics(responses)),
        }
    }

    /// The union of the members' repository indexes (see [`crate::routing::RoutingTable::index`]).
    pub fn repository_index(&self, ready_only: bool) -> Vec<ModelIndex> {
        self.routes.snapshot().index(ready_only)
    }
}

fn version_string(version: Option<i64>) -> String {
    version.map(|v| v.to_string()).unwrap_or_default()
}

fn add(a: &mut Option<StatisticDuration>, b: &Option<StatisticDuration>) {
    if let Some(b) = b {
        let a = a.get_or_insert_with(Default::default);
        a.count += b.count;
        a.ns += b.ns;
    }
}

/// Sums per-worker statistics by (model, version): counts and durations add up, the last
/// inference is the latest, batch statistics add up per batch size.
pub fn merge_statistics(responses: Vec<ModelStatisticsResponse>) -> ModelStatisticsResponse {
    let mut merged: BTreeMap<(String, i64, String), ModelStatistics> = BTreeMap::new();
    for s in responses.into_iter().flat_map(|r| r.model_stats) {
        let key = (s.name.clone(), s.version.parse::<i64>().unwrap_or(-1), s.version.clone());
        let Some(m) = merged.get_mut(&key) else {
            merged.insert(key, s);
            continue;
        };
        m.last_inference = m.last_inference.max(s.last_inference);
        m.inference_count += s.inference_count;
        m.execution_count += s.execution_count;
        if let Some(b) = &s.inference_stats {
            let a = m.inference_stats.get_or_insert_with(Default::default);
            add(&mut a.success, &b.success);
            add(&mut a.fail, &b.fail);
            add(&mut a.queue, &b.queue);
            add(&mut a.compute_input, &b.compute_input);
            add(&mut a.compute_infer, &b.compute_infer);
            add(&mut a.compute_output, &b.compute_output);
            add(&mut a.cache_hit, &b.cache_hit);
            add(&mut a.cache_miss, &b.cache_miss);
        }
        for b in s.batch_stats {
            match m.batch_stats.iter_mut().find(|x| x.batch_size == b.batch_size) {
                Some(a) => {
                    add(&mut a.compute_input, &b.compute_input);
                    add(&mut a.compute_infer, &b.compute_infer);
                    add(&mut a.compute_output, &b.compute_output);
                }
                None => m.batch_stats.push(b),
            }
        }
        m.batch_stats.sort_by_key(|b| b.batch_size);
    }
    ModelStatisticsResponse { model_stats: merged.into_values().collect() }
}

/// How long [`Control::shape_config`] reuses a model's config before one request refreshes it.
pub const SHAPE_CONFIG_TTL: Duration = Duration::from_secs(1);
/// How long an expired config still serves while one request refreshes it; older, every
/// request fetches (none refreshed it for that long: there was no traffic).
const SHAPE_CONFIG_STALE_MAX: Duration = Duration::from_secs(10);
/// Most configs [`ConfigCache`] holds; when full, it starts over (only models that resolved
/// and answered are ever inserted).
const SHAPE_CONFIG_ENTRIES: usize = 1024;

struct CachedConfig {
    fetched: Instant,
    config: Arc<ModelConfig>,
    /// A request is fetching its replacement: since when (which tells that request's guard
    /// from a later one's).
    refreshing: Option<Instant>,
}

/// What [`ConfigCache::lookup`] found.
enum Lookup {
    /// A config to use.
    Hit(Arc<ModelConfig>),
    /// Expired, and nobody refreshes it: the caller does (it is now marked as refreshing), and
    /// may fall back on the expired one.
    Refresh(Arc<ModelConfig>),
    /// None to use: the caller fetches one.
    Fetch,
}

/// Model configs by model and version: fresh for [`SHAPE_CONFIG_TTL`] after they were fetched,
/// then refreshed by one request while the others go on using them (single flight), at most
/// [`SHAPE_CONFIG_STALE_MAX`].
#[derive(Default)]
struct ConfigCache {
    entries: Mutex<HashMap<String, BTreeMap<i64, CachedConfig>>>,
}

impl ConfigCache {
    fn lookup(&self, name: &str, version: i64, now: Instant) -> Lookup {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let Some(entry) = entries.get_mut(name).and_then(|versions| versions.get_mut(&version)) else {
            return Lookup::Fetch;
        };
        let age = now.saturating_duration_since(entry.fetched);
        if age < SHAPE_CONFIG_TTL || (age < SHAPE_CONFIG_STALE_MAX && entry.refreshing.is_some()) {
            Lookup::Hit(entry.config.clone())
        } else if age < SHAPE_CONFIG_STALE_MAX {
            entry.refreshing = Some(now);
            Lookup::Refresh(entry.config.clone())
        } else {
            Lookup::Fetch
        }
    }

    /// Puts a config fetched as of `fetched` in place, unless the one there is newer.
    fn insert(&self, name: &str, version: i64, config: Arc<ModelConfig>, fetched: Instant) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.get(name).and_then(|versions| versions.get(&version)).is_some_and(|e| e.fetched > fetched) {
            return;
        }
        if entries.values().map(BTreeMap::len).sum::<usize>() >= SHAPE_CONFIG_ENTRIES {
            entries.clear();
        }
        let entry = CachedConfig { fetched, config, refreshing: None };
        entries.entry(name.to_string()).or_default().insert(version, entry);
    }

    /// The refresh that began at `started` ended: unless a later one runs, the next request
    /// after it may refresh.
    fn refresh_ended(&self, name: &str, version: i64, started: Instant) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = entries.get_mut(name).and_then(|versions| versions.get_mut(&version))
            && entry.refreshing == Some(started)
        {
            entry.refreshing = None;
        }
    }
}

/// Held by the request refreshing a config: however it ends (fetched, failed, or dropped with
/// its client), the next request after it may refresh.
struct Refreshing<'a> {
    cache: &'a ConfigCache,
    name: &'a str,
    version: i64,
    started: Instant,
}

impl Drop for Refreshing<'_> {
    fn drop(&mut self) {
        self.cache.refresh_ended(self.name, self.version, self.started);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(lookup: Lookup) -> Option<String> {
        match lookup {
            Lookup::Hit(config) => Some(config.name.clone()),
            _ => None,
        }
    }

    #[test]
    fn shape_configs_are_reused_then_refreshed_by_one_request() {
        let cache = ConfigCache::default();
        let t0 = Instant::now();
        let config = |name: &str| Arc::new(ModelConfig { name: name.into(), ..Default::default() });
        assert!(matches!(cache.lookup("m", 1, t0), Lookup::Fetch));
        cache.insert("m", 1, config("m"), t0);
        assert_eq!(hit(cache.lookup("m", 1, t0 + SHAPE_CONFIG_TTL / 2)).as_deref(), Some("m"));
        // Another version of the same model, or another model, is its own entry.
        assert!(matches!(cache.lookup("m", 2, t0), Lookup::Fetch));
        assert!(matches!(cache.lookup("n", 1, t0), Lookup::Fetch));
        // Expired: the first request refreshes it, the next ones use it meanwhile.
        let expired = t0 + SHAPE_CONFIG_TTL;
        assert!(matches!(cache.lookup("m", 1, expired), Lookup::Refresh(c) if c.name == "m"));
        assert_eq!(hit(cache.lookup("m", 1, expired)).as_deref(), Some("m"));
        // The refresh ended without a new config (failed, or its client left): the next refreshes.
        // (A guard of an earlier refresh does not end a later one's.)
        drop(Refreshing { cache: &cache, name: "m", version: 1, started: t0 });
        assert_eq!(hit(cache.lookup("m", 1, expired)).as_deref(), Some("m"));
        drop(Refreshing { cache: &cache, name: "m", version: 1, started: expired });
        assert!(matches!(cache.lookup("m", 1, expired), Lookup::Refresh(_)));
        // A slow refresh that began before the config in place was fetched does not replace it.
        cache.insert("m", 1, config("newer"), expired);
        cache.insert("m", 1, config("older"), t0);
        assert_eq!(hit(cache.lookup("m", 1, expired)).as_deref(), Some("newer"));
        // Refetched: fresh again.
        cache.insert("m", 1, config("m"), expired);
        assert!(hit(cache.lookup("m", 1, expired)).is_some());
        // Expired for too long, nobody refreshing or not: every request fetches.
        let old = expired + SHAPE_CONFIG_STALE_MAX;
        assert!(matches!(cache.lookup("m", 1, old - SHAPE_CONFIG_TTL), Lookup::Refresh(_)));
        assert!(matches!(cache.lookup("m", 1, old), Lookup::Fetch));
    }

    #[test]
    fn the_shape_config_cache_is_bounded() {
        let cache = ConfigCache::default();
        let t0 = Instant::now();
        for i in 0..SHAPE_CONFIG_ENTRIES as i64 + 10 {
            cache.insert("m", i, Arc::new(ModelConfig::default()), t0);
        }
        let held: usize = cache.entries.lock().unwrap().values().map(BTreeMap::len).sum();
        assert!(held <= SHAPE_CONFIG_ENTRIES, "{held}");
        assert!(hit(cache.lookup("m", SHAPE_CONFIG_ENTRIES as i64 + 9, t0)).is_some(), "the newest is kept");
    }

    fn stats(name: &str, version: &str, count: u64, last: u64, batches: &[(u64, u64)]) -> ModelStatistics {
        let d = |c: u64| Some(StatisticDuration { count: c, ns: c * 1000 });
        ModelStatistics {
            name: name.into(),
            version: version.into(),
            last_inference: last,
            inference_count: count,
            execution_count: count,
            inference_stats: Some(InferStatistics { success: d(count), queue: d(count), ..Default::default() }),
            batch_stats: batches
                .iter()
                .map(|&(size, n)| InferBatchStatistics { batch_size: size, compute_infer: d(n), ..Default::default() })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn statistics_sum_over_workers() {
        let a = ModelStatisticsResponse {
            model_stats: vec![stats("m", "1", 3, 10, &[(1, 3)]), stats("m", "2", 1, 5, &[])],
        };
        let b = ModelStatisticsResponse { model_stats: vec![stats("m", "1", 4, 20, &[(1, 2), (4, 1)])] };
        let m = merge_statistics(vec![a, b]);
        assert_eq!(m.model_stats.len(), 2);
        let v1 = &m.model_stats[0];
        assert_eq!((v1.version.as_str(), v1.inference_count, v1.last_inference), ("1", 7, 20));
        let s = v1.inference_stats.as_ref().unwrap();
        assert_eq!(s.success, Some(StatisticDuration { count: 7, ns: 7000 }));
        assert_eq!(v1.batch_stats.len(), 2);
        assert_eq!(v1.batch_stats[0].compute_infer, Some(StatisticDuration { count: 5, ns: 5000 }));
        assert_eq!(m.model_stats[1].version, "2");
    }
}
