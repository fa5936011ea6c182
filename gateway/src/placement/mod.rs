//! The placement controller: assigns declared models (`models/<m>`) to workers by writing
//! `placement/<worker>/<m>/<v>` keys, which the workers' placement agents act on.
//!
//! Every gateway may run it; etcd's election (`leader/placement`) makes one the leader. A term:
//! grant a lease, campaign (keeping the lease alive while waiting), then lead — re-plan
//! ([`plan::plan`]) whenever anything under the prefix changes (and every few seconds), and
//! write the difference in transactions **fenced on the leader key's create revision**: a
//! leader that lost its lease (partition, pause) can no longer write, even before it notices.
//! Losing the lease or a fenced write ends the term; the gateway campaigns again.
//!
//! A worker whose load of a version FAILED is remembered for [`FAILED_COOLDOWN`] so the version
//! is re-placed elsewhere instead of bouncing back to it.

pub mod plan;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use nereid_common::fleet::etcd_client::{Client, Compare, CompareOp, GetOptions, LeaderKey, Txn, TxnOp, WatchOptions};
use nereid_common::fleet::records::{self, ModelState, PlacementRecord};
use nereid_common::fleet::{self, Assignment, Backoff, CALL_TIMEOUT, FleetState, Keys, bounded, check_keepalive};
use tokio_util::sync::CancellationToken;

use crate::config::EtcdConfig;
use crate::metrics::GatewayMetrics;

/// How long a worker that failed to load a version is not chosen for it again.
pub const FAILED_COOLDOWN: Duration = Duration::from_secs(60);
/// Re-plan at least this often while leading.
const REPLAN_INTERVAL: Duration = Duration::from_secs(2);
/// Changes arriving within this window are planned together.
const DEBOUNCE: Duration = Duration::from_millis(50);
/// etcd's default limit on operations per transaction.
const MAX_TXN_OPS: usize = 128;

pub struct PlacementController {
    config: EtcdConfig,
    metrics: GatewayMetrics,
    /// The fleet as last read, across terms: a value rejected as invalid keeps its last good
    /// value here, so a bad write to `models/<m>` never un-places the model.
    last: FleetState,
}

impl PlacementController {
    pub fn new(config: EtcdConfig, metrics: GatewayMetrics) -> Self {
        PlacementController { config, metrics, last: FleetState::default() }
    }

    /// Campaigns and leads, term after term, until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut backoff = Backoff::new();
        let mut lease = None;
        loop {
            let started = Instant::now();
            let result = self.term(&shutdown, &mut lease).await;
            self.metrics.placement_leader.set(0);
            match result {
                Ok(()) => return,
                Err(e) => tracing::warn!(gateway = %self.config.gateway_id, "placement controller: {e}"),
            }
            if started.elapsed() > Backoff::MAX * 5 {
                backoff.reset();
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }

    /// One term: `Ok` only on shutdown. `previous` is the last term's lease: revoked first, so
    /// a candidacy that outlived an etcd restart does not queue ahead of this one.
    async fn term(&mut self, shutdown: &CancellationToken, previous: &mut Option<i64>) -> Result<(), String> {
        let keys = &self.config.keys.clone();
        let mut client = bounded("connect", fleet::connect(&self.config.endpoints)).await?;
        if let Some(old) = *previous {
            bounded("revoke the previous lease", client.lease_revoke(old)).await.ok();
        }
        let ttl = self.config.election_ttl.as_secs().max(1) as i64;
        let lease = bounded("lease grant", client.lease_grant(ttl, None)).await?.id();
        *previous = Some(lease);
        let (mut keeper, mut keepalives) = bounded("keep-alive", client.lease_keep_alive(lease)).await?;
        let mut keepalive_tick = tokio::time::interval(self.config.election_ttl / 3);

        // Campaign, keeping the lease alive while another gateway leads.
        let mut campaign_client = client.clone();
        let name = keys.placement_election();
        let id = self.config.gateway_id.clone();
        let campaign = campaign_client.campaign(name.as_str(), id.as_str(), lease);
        tokio::pin!(campaign);
        let leader: LeaderKey = loop {
            tokio::select! {
                _ = shutdown.cancelled() => {
                    let _ = tokio::time::timeout(CALL_TIMEOUT, client.lease_revoke(lease)).await;
                    return Ok(());
                }
                _ = keepalive_tick.tick() => bounded("keep-alive", keeper.keep_alive()).await?,
                msg = keepalives.message() => check_keepalive(msg)?,
                won = &mut campaign => {
                    let resp = won.map_err(|e| format!("campaign: {e}"))?;
                    break resp.leader().cloned().ok_or("campaign: no leader key in the answer")?;
                }
            }
        };
        self.metrics.placement_leader.set(1);
        tracing::info!(gateway = %id, revision = leader.rev(), "leading the placement controller");

        let mut watch = bounded("watch", client.watch(keys.all(), Some(WatchOptions::new().with_prefix()))).await?;
        let mut replan = tokio::time::interval(REPLAN_INTERVAL);
        let mut failed: BTreeMap<Assignment, Instant> = BTreeMap::new();
        let mut dirty = true;
        let result = loop {
            let debounce = tokio::time::sleep(if dirty { DEBOUNCE } else { REPLAN_INTERVAL });
            tokio::select! {
                _ = shutdown.cancelled() => break Ok(()),
                _ = keepalive_tick.tick() => {
                    if let Err(e) = bounded("keep-alive", keeper.keep_alive()).await { break Err(e) }
                }
                msg = keepalives.message() => {
                    if let Err(e) = check_keepalive(msg) { break Err(e) }
                }
                msg = watch.message() => match msg {
                    Ok(Some(r)) if !r.canceled() => dirty |= r.events().iter().any(|e| e.kv().is_some_and(|kv| !is_placement(keys, kv.key()))) ,
                    Ok(_) => break Err("the watch ended".into()),
                    Err(e) => break Err(format!("watch: {e}")),
                },
                _ = replan.tick() => dirty = true,
                _ = debounce, if dirty => {
                    dirty = false;
                    if let Err(e) = self.reconcile(&mut client, &leader, &mut failed).await {
                        break Err(e);
                    }
                }
            }
        };
        // Step down: resign (others may lead at once) and drop the lease.
        let _ = tokio::time::timeout(
            CALL_TIMEOUT,
            client.resign(Some(fleet::etcd_client::ResignOptions::new().with_leader(leader))),
        )
        .await;
        let _ = tokio::time::timeout(CALL_TIMEOUT, client.lease_revoke(lease)).await;
        self.metrics.placement_leader.set(0);
        tracing::info!(gateway = %id, "no longer leading the placement controller");
        result
    }

    /// Reads the fleet, plans, and writes the difference (fenced on leadership).
    async fn reconcile(
        &mut self,
        client: &mut Client,
        leader: &LeaderKey,
        failed: &mut BTreeMap<Assignment, Instant>,
    ) -> Result<(), String> {
        let keys = self.config.keys.clone();
        let resp = bounded("read", client.get(keys.all(), Some(GetOptions::new().with_prefix()))).await?;
        // Rejected values are logged and counted by the membership watch; here the last good
        // value of such a key is used.
        let (state, rejected) = self.last.reread(&keys, resp.kvs().iter().map(|kv| (kv.key(), kv.value())));
        self.last = state.clone();
        // A declaration rejected with no last good value to fall back on (a leader that never
        // saw it valid): the model is neither re-planned nor undeclared — its placements stay
        // as they are until a valid value is written or the key is deleted.
        let frozen = frozen_models(&keys, &rejected, &state);
        let now = Instant::now();
        failed.retain(|_, at| now.duration_since(*at) < FAILED_COOLDOWN);
        for (worker, statuses) in &state.statuses {
            for ((model, version), s) in statuses {
                if s.state == ModelState::Failed {
                    failed.entry((worker.clone(), model.clone(), *version)).or_insert(now);
                }
            }
        }
        let excluded: BTreeSet<Assignment> = failed.keys().cloned().collect();
        let mut planned = plan::plan(&state, &excluded);
        planned.assignments.extend(state.placements.iter().filter(|(_, m, _)| frozen.contains(m)).cloned());
        self.metrics.placement_plans.inc();
        self.metrics.placement_unplaced.set(planned.unplaced_replicas() as i64);
        for (model, version, missing) in &planned.unplaced {
            tracing::warn!(%model, version, missing, "not enough active workers with room for every replica");
        }
        let value =
            records::encode(&PlacementRecord { schema: records::SCHEMA_VERSION, leader_revision: leader.rev() })
                .map_err(|e| e.to_string())?;
        let mut ops = Vec::new();
        for (w, m, v) in planned.assignments.difference(&state.placements) {
            tracing::info!(worker = %w, model = %m, version = v, "placing");
            ops.push(TxnOp::put(keys.placement(w, m, *v), value.clone(), None));
        }
        for (w, m, v) in state.placements.difference(&planned.assignments) {
            tracing::info!(worker = %w, model = %m, version = v, "removing placement");
            ops.push(TxnOp::delete(keys.placement(w, m, *v), None));
        }
        for chunk in ops.chunks(MAX_TXN_OPS) {
            let txn = Txn::new()
                .when([Compare::create_revision(leader.key(), CompareOp::Equal, leader.rev())])
                .and_then(chunk.to_vec());
            let resp = bounded("placement write", client.txn(txn)).await?;
            if !resp.succeeded() {
                return Err("lost leadership: the fenced placement write was refused".into());
            }
            self.metrics.placement_writes.inc();
        }
        Ok(())
    }
}

fn is_placement(keys: &Keys, key: &[u8]) -> bool {
    matches!(keys.parse(key), Some(fleet::Key::Placement { .. }))
}
/// Models whose `models/<m>` value was rejected and has no last good value in `state`.
fn frozen_models(keys: &Keys, rejected: &[fleet::Rejected], state: &FleetState) -> BTreeSet<String> {
    rejected
        .iter()
        .filter_map(|r| match keys.parse(r.key.as_bytes()) {
            Some(fleet::Key::Model(m)) if !state.models.contains_key(&m) => Some(m),
            _ => None,
        })
        .collect()
}
