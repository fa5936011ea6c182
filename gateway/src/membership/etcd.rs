//! [`EtcdMembership`]: the fleet as etcd says it is. One task reads everything under the prefix
//! once, then follows one prefix watch from the next revision, applying each event to a
//! [`FleetState`] and publishing a routing table built from it.
//!
//! - **Resume, not restart.** When the watch breaks (etcd restarted, network), the task
//!   reconnects with back-off and resumes the watch from the last revision it applied. It
//!   re-reads everything (counted in `nereid_gateway_etcd_resyncs_total`) only when resuming
//!   would miss events: etcd compacted that revision away, or etcd's history went back — its
//!   data was wiped or restored from an older backup, or it is another cluster
//!   ([`fleet::history_reset`]): a watch from the old revision would then see nothing while
//!   looking healthy.
//! - **Reads of any size.** The full read is paged and pinned to one revision
//!   ([`fleet::get_prefix`]) and the watch decodes large batches ([`fleet::watch`]), so values
//!   adding up past gRPC's default 4 MiB message limit neither stop the first table nor a
//!   resume. Every request requires an etcd leader ([`fleet::connect_options`]): a member cut
//!   off from its quorum ends the watch, which is then reported down, not healthy and stale.
//! - **Last good table.** While etcd is away nothing is published: requests keep routing on the
//!   last table, whose age (`nereid_gateway_routing_table_age_seconds`) grows, and
//!   `nereid_gateway_etcd_watch_connected` reads 0. An empty table is never published because
//!   etcd could not be read.
//! - **Invalid values** are rejected by [`FleetState::apply`]: the key keeps its last good
//!   value, the rejection is logged and counted in `nereid_gateway_etcd_invalid_values_total`.
//! - **Connections survive snapshots.** Each worker's [`Upstream`] (its pooled channel, load and
//!   ejection state) is created once and handed to every table while the worker's gRPC address
//!   stays the same.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use nereid_common::fleet::etcd_client::{self, Client, EventType, WatchOptions};
use nereid_common::fleet::records::{ModelState, WorkerState as RecordState};
use nereid_common::fleet::{self, Backoff, ClusterMark, FleetState, Keys, bounded, history_reset, too_large};
use nereid_proto::inference::repository_index_response::ModelIndex;
use tokio_util::sync::CancellationToken;

use super::Membership;

use crate::metrics::GatewayMetrics;
use crate::routing::{Declared, RoutesPublisher, RoutingTable, WorkerState, WorkerView};
use crate::upstream::{Upstream, UpstreamOptions};

/// While connected, the table is republished this often even without events (so its age says
/// how current it is).
const REFRESH_INTERVAL: Duration = Duration::from_secs(1);

pub struct EtcdMembership {
    endpoints: Vec<String>,
    keys: Keys,
    upstream: UpstreamOptions,
    metrics: GatewayMetrics,
    state: FleetState,
    /// Last revision applied (0: nothing read yet).
    revision: i64,
    /// The etcd history as far as seen (highest revision and term of every response header):
    /// compared with the cluster's on each reconnect, to notice a history that went back.
    seen: ClusterMark,
    /// worker id → (gRPC address, upstream), kept across tables.
    upstreams: HashMap<String, (String, Arc<Upstream>)>,
    /// Declared model → the version the last table sent requests naming no version to (see
    /// [`Declared::serving`]).
    serving: HashMap<String, i64>,
    /// worker id → the revision its record was created at: of two records naming one address,
    /// the later is the process listening there now (see [`EtcdMembership::publish`]).
    registered: HashMap<String, i64>,
}

enum Disconnect {
    /// Reconnect and resume from `revision`.
    Resume(String),
    /// The revision was compacted: re-read everything.
    Resync(String),
    Shutdown,
}

impl EtcdMembership {
    pub fn new(endpoints: Vec<String>, keys: Keys, upstream: UpstreamOptions, metrics: GatewayMetrics) -> Self {
        EtcdMembership {
            endpoints,
            keys,
            upstream,
            metrics,
            state: FleetState::default(),
            revision: 0,
            seen: ClusterMark::default(),
            upstreams: HashMap::new(),
            serving: HashMap::new(),
            registered: HashMap::new(),
        }
    }

    /// Notes when a worker record was created (`None`: deleted).
    fn note_registration(&mut self, key: &[u8], created: Option<i64>) {
        if let Some(fleet::keys::Key::Worker(id)) = self.keys.parse(key) {
            match created {
                Some(revision) => self.registered.insert(id, revision),
                None => self.registered.remove(&id),
            };
        }
    }

    /// Applies one put/delete, counting a rejected value; whether the state changed.
    fn apply(&mut self, key: &[u8], value: Option<&[u8]>) -> bool {
        // A rejected drain value still drains its worker (fail safe): a change to publish now,
        // not at the next refresh.
        let drains = self.state.drains.len();
        match self.state.apply(&self.keys, key, value) {
            Ok(changed) => changed,
            Err(rejected) => {
                tracing::warn!("{rejected}; keeping the last good value");
                self.metrics.etcd_invalid_values.with_label_values(&[rejected.kind]).inc();
                self.state.drains.len() != drains
            }
        }
    }

    /// Reads everything under the prefix (paged, as of one revision) and notes its revision.
    /// The history seen restarts from this read's: after a reset, the old marks are another
    /// history's.
    async fn resync(&mut self, client: &Client) -> Result<(), String> {
        let read = fleet::get_prefix(client, &self.keys.all()).await.map_err(|e| format!("read: {e}"))?;
        let (state, rejected) = self.state.reread(&self.keys, read.kvs.iter().map(|kv| (kv.key(), kv.value())));
        for r in rejected {
            tracing::warn!("{r}; keeping the last good value");
            self.metrics.etcd_invalid_values.with_label_values(&[r.kind]).inc();
        }
        self.state = state;
        self.registered.clear();
        for kv in &read.kvs {
            self.note_registration(kv.key(), Some(kv.create_revision()));
        }
        self.revision = read.mark.revision;
        self.seen = read.mark;
        self.metrics.etcd_resyncs.inc();
        Ok(())
    }

    /// Whether resuming from `self.revision` would miss events because etcd's history went
    /// back while we were away; `Some(why)` then. Otherwise notes the cluster's mark.
    async fn history_lost(&mut self, client: &mut Client) -> Result<Option<String>, String> {
        let now = bounded("read the revision", ClusterMark::current(client, &self.keys.all())).await?;
        let why = history_reset(&self.seen, &now);
        if why.is_none() {
            self.seen.observe_mark(now);
        }
        Ok(why)
    }

    fn publish(&mut self, publisher: &RoutesPublisher) {
        let mut views = Vec::with_capacity(self.state.workers.len());
        let mut upstreams = HashMap::with_capacity(self.state.workers.len());
        // One process listens on an address: where two records name it (a worker restarted
        // under a new id while its old lease lives on), the one created last is it, and the
        // other's statuses — what the old process held — would send it requests for models it
        // may not have. Only the newer routes.
        let mut newest: HashMap<&str, (i64, &str)> = HashMap::new();
        for (id, record) in &self.state.workers {
            let created = self.registered.get(id).copied().unwrap_or(0);
            let entry = newest.entry(record.grpc.as_str()).or_insert((created, id));
            if (created, id.as_str()) > *entry {
                *entry = (created, id);
            }
        }
        for (id, record) in &self.state.workers {
            if newest.get(record.grpc.as_str()).is_some_and(|(_, newer)| *newer != id.as_str()) {
                tracing::debug!(worker = %id, address = %record.grpc, "another worker registered at this address later; not routed");
                continue;
            }
            let upstream = match self.upstreams.remove(id) {
                Some((address, u)) if address == record.grpc => u,
                _ => match Upstream::new(&record.grpc, self.upstream) {
                    Ok(u) => Arc::new(u),
                    Err(e) => {
                        tracing::warn!(worker = %id, address = %record.grpc, "cannot use the worker's address: {e}");
                        continue;
                    }
                },
            };
            let state = if record.state == RecordState::Draining || self.state.drains.contains_key(id) {
                WorkerState::NotReady
            } else {
                WorkerState::Ready
            };
            let models = self
                .state
                .statuses
                .get(id)
                .into_iter()
                .flatten()
                .map(|((model, version), status)| ModelIndex {
                    name: model.clone(),
                    version: version.to_string(),
                    state: match status.state {
                        ModelState::Ready => "READY",
                        ModelState::Loading => "LOADING",
                        ModelState::Failed => "UNAVAILABLE",
                    }
                    .to_string(),
                    reason: status.reason.clone(),
                })
                .collect();
            upstreams.insert(id.clone(), (record.grpc.clone(), upstream.clone()));
            views.push(WorkerView { upstream, state, models });
        }
        self.upstreams = upstreams;
        // Declared models are known even before (or while) any worker lists them: UNAVAILABLE,
        // not NOT_FOUND, which clients take as final.
        let declared = self.state.models.iter().map(|(name, record)| {
            let serving = self.serving.get(name).copied();
            (name.clone(), Declared { versions: record.versions.clone(), replicas: record.replicas, serving })
        });
        let table = RoutingTable::build(views, Instant::now()).with_declared(declared);
        self.serving = (self.state.models.keys())
            .filter_map(|m| Some((m.clone(), table.resolve(m, None).ok()?.version)))
            .collect();
        publisher.publish(table);
    }

    /// One connection: (re)read if needed, watch from the next revision, apply events until
    /// the watch breaks or shutdown.
    async fn follow(&mut self, publisher: &RoutesPublisher, shutdown: &CancellationToken, resync: bool) -> Disconnect {
        let mut client = match bounded("connect", fleet::connect(&self.endpoints)).await {
            Ok(c) => c,
            Err(e) => return Disconnect::Resume(e),
        };
        let mut resync = resync || self.revision == 0;
        if !resync {
            match self.history_lost(&mut client).await {
                Ok(None) => {}
                Ok(Some(why)) => {
                    tracing::warn!(revision = self.revision, "{why}; re-reading the fleet state");
                    resync = true;
                }
                Err(e) => return Disconnect::Resume(e),
            }
        }
        if resync {
            if let Err(e) = self.resync(&client).await {
                return Disconnect::Resync(e);
            }
            self.publish(publisher);
        }
        let options = WatchOptions::new().with_prefix().with_start_revision(self.revision + 1).with_progress_notify();
        let mut watch = match bounded("watch", fleet::watch(&client, self.keys.all(), options)).await {
            Ok(w) => w,
            Err(e) => return Disconnect::Resume(e),
        };
        self.metrics.etcd_watch_connected.set(1);
        tracing::info!(revision = self.revision, "following etcd");
        let mut refresh = tokio::time::interval(REFRESH_INTERVAL);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Disconnect::Shutdown,
                _ = refresh.tick() => self.publish(publisher),
                msg = watch.message() => {
                    let mut changed = match self.take_response(msg) {
                        Ok(changed) => changed,
                        Err(disconnect) => return disconnect,
                    };
                    // Responses already waiting (a burst of writes: a fleet-wide roll-out
                    // sends one per write) go into the same table: one rebuild for the burst,
                    // not one per write. Bounded, so that the refresh and shutdown still run.
                    for _ in 0..COALESCED_RESPONSES {
                        let Some(msg) = futures::FutureExt::now_or_never(watch.message()) else { break };
                        match self.take_response(msg) {
                            Ok(more) => changed |= more,
                            Err(disconnect) => {
                                if changed {
                                    self.publish(publisher);
                                }
                                return disconnect;
                            }
                        }
                    }
                    if changed {
                        self.publish(publisher);
                    }
                }
            }
        }
    }

    /// Applies one watch response; whether the state changed, or why the watch ends.
    fn take_response(
        &mut self,
        msg: Result<Option<etcd_client::WatchResponse>, etcd_client::Error>,
    ) -> Result<bool, Disconnect> {
        let resp = match msg {
            Ok(Some(r)) => r,
            Ok(None) => return Err(Disconnect::Resume("the watch stream ended".into())),
            Err(e) if too_large(&e) => return Err(Disconnect::Resync(format!("watch: {e}"))),
            Err(e) => return Err(Disconnect::Resume(format!("watch: {e}"))),
        };
        self.seen.observe(resp.header());
        if resp.compact_revision() > 0 {
            return Err(Disconnect::Resync(format!("revision {} was compacted", self.revision + 1)));
        }
        if resp.canceled() {
            return Err(Disconnect::Resume(format!("the watch was cancelled: {}", resp.cancel_reason())));
        }
        let mut changed = false;
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            let value = (event.event_type() == EventType::Put).then(|| kv.value());
            changed |= self.apply(kv.key(), value);
            self.note_registration(kv.key(), value.map(|_| kv.create_revision()));
            self.revision = self.revision.max(kv.mod_revision());
        }
        if let Some(r) =
            progress_revision(resp.events().is_empty(), resp.created(), resp.header().map(|h| h.revision()))
        {
            self.revision = self.revision.max(r);
        }
        Ok(changed)
    }
}

/// Most further watch responses, already received, applied before a table is published.
const COALESCED_RESPONSES: usize = 256;

/// The revision a watch response proves delivered when it carries no events: a progress
/// notification's header revision. Not the creation response's: its header is the store's
/// revision when the watch was made, sent before the history from the start revision arrives,
/// so resuming from it after a disconnect would skip events never received.
fn progress_revision(no_events: bool, created: bool, header_revision: Option<i64>) -> Option<i64> {
    if no_events && !created { header_revision } else { None }
}

impl Membership for EtcdMembership {
    fn run(mut self: Box<Self>, publisher: RoutesPublisher, shutdown: CancellationToken) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let mut backoff = Backoff::new();
            let mut resync = true;
            loop {
                let started = Instant::now();
                let outcome = self.follow(&publisher, &shutdown, resync).await;
                self.metrics.etcd_watch_connected.set(0);
                resync = false;
                match outcome {
                    Disconnect::Shutdown => return,
                    Disconnect::Resume(e) => {
                        tracing::warn!(revision = self.revision, "etcd: {e}; routing on the last good table");
                    }
                    Disconnect::Resync(e) => {
                        tracing::warn!("etcd: {e}; re-reading the fleet state");
                        resync = true;
                    }
                }
                if started.elapsed() > Backoff::MAX * 5 {
                    backoff.reset();
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff.next_delay()) => {}
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Of two worker records naming one address, only the one created last routes.
    #[tokio::test]
    async fn of_two_records_at_one_address_the_newer_routes() {
        let keys = Keys::new("/t").unwrap();
        let upstream = UpstreamOptions::from(crate::config::OutlierConfig::default());
        let mut membership = EtcdMembership::new(vec![], keys.clone(), upstream, GatewayMetrics::new());
        let record =
            |id: &str, address: &str| format!(r#"{{"schema":1,"id":"{id}","grpc":"{address}","state":"ready"}}"#);
        for (id, address, created) in
            [("new", "127.0.0.1:1", 9), ("old", "127.0.0.1:1", 5), ("other", "127.0.0.1:2", 7)]
        {
            let key = keys.worker(id);
            assert!(membership.apply(key.as_bytes(), Some(record(id, address).as_bytes())));
            membership.note_registration(key.as_bytes(), Some(created));
        }
        let (publisher, routes) = crate::routing::routes(Instant::now());
        membership.publish(&publisher);
        let routed = |routes: &crate::routing::Routes| {
            let mut ids: Vec<String> = routes.snapshot().workers().iter().map(|w| w.upstream.id.to_string()).collect();
            ids.sort();
            ids
        };
        assert_eq!(routed(&routes), ["127.0.0.1:1", "127.0.0.1:2"], "one view per address");
        assert!(membership.upstreams.contains_key("new") && !membership.upstreams.contains_key("old"));
        // The newer one gone (its lease), the older routes again.
        let key = keys.worker("new");
        membership.apply(key.as_bytes(), None);
        membership.note_registration(key.as_bytes(), None);
        membership.publish(&publisher);
        assert!(membership.upstreams.contains_key("old"));
        assert_eq!(routed(&routes), ["127.0.0.1:1", "127.0.0.1:2"]);
    }

    /// An invalid drain value drains its worker at once (a change that publishes a table),
    /// while it is counted as rejected; a second one changes nothing more.
    #[test]
    fn an_invalid_drain_value_is_a_change() {
        let keys = Keys::new("/t").unwrap();
        let metrics = GatewayMetrics::new();
        let upstream = UpstreamOptions::from(crate::config::OutlierConfig::default());
        let mut membership = EtcdMembership::new(vec![], keys.clone(), upstream, metrics.clone());
        let drain = keys.drain("w1");
        assert!(membership.apply(drain.as_bytes(), Some(b"not json")));
        assert!(membership.state.drains.contains_key("w1"));
        assert!(!membership.apply(drain.as_bytes(), Some(b"still not json")));
        assert_eq!(metrics.etcd_invalid_values.with_label_values(&["drain"]).get(), 2);
        assert!(membership.apply(drain.as_bytes(), None), "deleting the key undrains");
    }

    #[test]
    fn only_a_progress_notification_advances_the_resume_revision() {
        assert_eq!(progress_revision(true, false, Some(42)), Some(42), "progress notification");
        assert_eq!(progress_revision(true, true, Some(42)), None, "the creation response: history still to come");
        assert_eq!(progress_revision(false, false, Some(42)), None, "events advance it by their own revisions");
        assert_eq!(progress_revision(true, false, None), None);
    }
}
