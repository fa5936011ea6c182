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
//! A plan runs at most [`DEBOUNCE`] after the first change since the last one, however busy
//! etcd is ([`Schedule`]), and at least every [`REPLAN_INTERVAL`].
//!
//! A worker whose load of a version FAILED — or that did not report it READY within
//! `--placement-load-timeout-secs` of the leader first seeing it placed and not READY (a dead
//! agent, a load stuck in LOADING) — is remembered for [`FAILED_COOLDOWN`] so the version is
//! re-placed elsewhere instead of bouncing back to it ([`LoadWatch`]); each further failure of
//! the same worker and version doubles that, up to [`FAILED_COOLDOWN_MAX`] (a version broken
//! everywhere is not reloaded on every worker every minute for ever), until it has gone
//! [`FAILURE_MEMORY`] without failing there. The failure is logged
//! once, with the worker's reason, and remembered per version: a version left unplaced is then
//! reported with that reason, not only as a lack of room.
//!
//! A worker whose registration disappears (its lease expired: a GC pause, a network blip longer
//! than its TTL) usually re-registers a moment later with its models still loaded. For
//! [`VANISHED_GRACE`] after the leader last saw it registered, its placements are not deleted
//! (see the plan's vanished workers; [`Sightings`]): deleting them would make it unload a model
//! that a `replicas: 1` declaration then lacks for a whole cold load elsewhere.

pub mod plan;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::pin::Pin;
use std::time::Duration;

use nereid_common::fleet::etcd_client::{Client, Compare, CompareOp, LeaderKey, Txn, TxnOp, WatchOptions};
use nereid_common::fleet::records::{self, ModelState, PENDING_REASON, PlacementRecord, WorkerState};
use nereid_common::fleet::{self, Assignment, Backoff, CALL_TIMEOUT, FleetState, Keys, bounded, check_keepalive};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

use crate::config::EtcdConfig;
use crate::metrics::GatewayMetrics;

/// How long a worker that failed to load a version is not chosen for it again, after its first
/// failure; doubled with each further one, up to [`FAILED_COOLDOWN_MAX`].
pub const FAILED_COOLDOWN: Duration = Duration::from_secs(60);
/// The longest a worker is not chosen again for a version it keeps failing to load.
pub const FAILED_COOLDOWN_MAX: Duration = Duration::from_secs(16 * 60);
/// A worker's failures to load a version are forgotten once it has gone this long without one.
pub const FAILURE_MEMORY: Duration = Duration::from_secs(60 * 60);
/// Re-plan at least this often while leading.
const REPLAN_INTERVAL: Duration = Duration::from_secs(2);
/// Changes arriving within this window are planned together.
const DEBOUNCE: Duration = Duration::from_millis(50);
/// An unchanged warning about a version left unplaced is repeated at most this often.
const UNPLACED_REPORT_INTERVAL: Duration = Duration::from_secs(60);
/// etcd's default limit on operations per transaction.
const MAX_TXN_OPS: usize = 128;
/// How long the placements of a worker that vanished are kept after it was last seen: the
/// workers' default lease TTL (`--etcd-lease-ttl-secs`), the gateway does not know theirs. A
/// worker that lost its lease re-registers as soon as it notices, well within this; a longer
/// wait only delays removing keys nothing routes to (replacements are placed at once).
const VANISHED_GRACE: Duration = Duration::from_secs(10);

pub struct PlacementController {
    config: EtcdConfig,
    metrics: GatewayMetrics,
    /// The fleet as last read in this term: a value rejected as invalid keeps its last good
    /// value here, so a bad write to `models/<m>` never un-places the model. Emptied when a term
    /// begins: another leader may have changed the fleet meanwhile, and a value from an earlier
    /// term would roll its changes back (a rejected value with no good one in this term
    /// freezes what it governs instead: see [`frozen`]).
    last: FleetState,
    /// Load failures and waits, across terms (see [`LoadWatch::begin_term`]).
    loads: LoadWatch,
    /// When each worker was last seen registered, across terms.
    sightings: Sightings,
    /// The workers last reported over their declared capacity (warned about once each time
    /// they become so).
    overcommitted: BTreeSet<String>,
    /// Each model's `memory_mb` as last seen declared, across terms: only to charge a frozen
    /// model's replicas to their workers (a term's first read may find it frozen).
    memory_mb: BTreeMap<String, u64>,
    /// Placements this controller removed, and when: for [`RELEASE_HOLD`] their workers are
    /// taken to still hold them (serving out their unload grace), see [`plan::plan_with`].
    releasing: BTreeMap<Assignment, Instant>,
}

/// How long a removed placement's room is still counted taken: a worker serves a removed model
/// for its unload grace (`--drain-delay-ms`, 1 s by default) before unloading it. A worker with
/// a longer grace may briefly hold a model and its replacement both.
pub const RELEASE_HOLD: Duration = Duration::from_secs(3);

impl PlacementController {
    pub fn new(config: EtcdConfig, metrics: GatewayMetrics) -> Self {
        let loads = LoadWatch::new(config.placement_load_timeout);
        let sightings = Sightings::new(VANISHED_GRACE);
        PlacementController {
            config,
            metrics,
            last: FleetState::default(),
            loads,
            sightings,
            overcommitted: BTreeSet::new(),
            memory_mb: BTreeMap::new(),
            releasing: BTreeMap::new(),
        }
    }

    /// Campaigns and leads, term after term, until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut backoff = Backoff::new();
        let mut lease = None;
        loop {
            let started = std::time::Instant::now();
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

        // While leading, the lease is kept alive on its own task: a reconcile (a paged read and
        // fenced writes, each bounded but together possibly longer than the lease's TTL on a
        // slow etcd) must not let the lease lapse and the leadership flip back and forth.
        // (Dropped with this term, however it ends.)
        let mut keepalive = fleet::spawn_keepalive(keeper, keepalives, self.config.election_ttl / 3);
        // Through fleet::watch: its responses may exceed tonic's default 4 MiB limit.
        let mut watch = bounded("watch", fleet::watch(&client, keys.all(), WatchOptions::new().with_prefix())).await?;
        self.loads.begin_term();
        self.sightings.begin_term();
        self.last = FleetState::default();
        let mut schedule = Schedule::new();
        let result = loop {
            tokio::select! {
                _ = shutdown.cancelled() => break Ok(()),
                stopped = &mut keepalive => break Err(stopped),
                msg = watch.message() => match msg {
                    // Its own placement writes are no news to the controller.
                    Ok(Some(r)) if !r.canceled() => {
                        // Its election key deleted (an operator's `etcdctl del`, a resign from
                        // elsewhere): no longer the leader, whatever its lease says. Its writes
                        // are fenced anyway; this stops it planning and claiming to lead.
                        let lost = r.events().iter().any(|e| {
                            e.event_type() == fleet::etcd_client::EventType::Delete
                                && e.kv().is_some_and(|kv| kv.key() == leader.key())
                        });
                        if lost {
                            break Err("its election key was deleted".into());
                        }
                        if r.events().iter().any(|e| e.kv().is_some_and(|kv| !is_placement(keys, kv.key()))) {
                            schedule.changed();
                        }
                    }
                    Ok(_) => break Err("the watch ended".into()),
                    Err(e) => break Err(format!("watch: {e}")),
                },
                _ = schedule.due() => {
                    let result = self.reconcile(&mut client, &leader).await;
                    schedule.planned();
                    if let Err(e) = result {
                        break Err(e);
                    }
                }
            }
        };
        drop(keepalive);
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
    async fn reconcile(&mut self, client: &mut Client, leader: &LeaderKey) -> Result<(), String> {
        let keys = self.config.keys.clone();
        // Paged (each page bounded): one read of a large fleet would exceed gRPC's message limit.
        let read = fleet::get_prefix(client, &keys.all()).await.map_err(|e| format!("read: {e}"))?;
        // Rejected values are logged and counted by the membership watch; here the last good
        // value of such a key is used.
        let (state, rejected) = self.last.reread(&keys, read.kvs.iter().map(|kv| (kv.key(), kv.value())));
        self.last = state.clone();
        // A declaration or a worker record rejected with no last good value to fall back on (a
        // leader that never saw it valid): the model is neither re-planned nor undeclared, the
        // worker neither used nor emptied — their placements stay as they are until a valid
        // value is written or the key is deleted. (A rejected drain needs no freezing: the state
        // takes it as a drain.)
        let (frozen_models, frozen_workers) = frozen(&keys, &rejected, &state);
        let now = Instant::now();
        for f in self.loads.observe(&state, now) {
            tracing::warn!(
                worker = %f.worker,
                model = %f.model,
                version = f.version,
                reason = %f.reason,
                "{f}; the replica goes to another worker if one has room, not back to this one for {}s",
                self.loads.cooldown_left(&(f.worker.clone(), f.model.clone(), f.version), now).as_secs()
            );
        }
        let excluded = self.loads.excluded();
        let vanished = self.sightings.observe(&state, now);
        // Frozen placements stay loaded, so they hold their workers' room in the plan: a model
        // slot each, and the model's memory_mb as last seen valid (0 if never: unknown).
        let frozen: BTreeMap<Assignment, u64> = state
            .placements
            .iter()
            .filter(|(w, m, _)| frozen_models.contains(m) || frozen_workers.contains(w))
            .map(|a| (a.clone(), self.memory_mb.get(&a.1).copied().unwrap_or(0)))
            .collect();
        self.memory_mb.extend(state.models.iter().map(|(m, d)| (m.clone(), d.resources.memory_mb)));
        self.memory_mb.retain(|m, _| state.models.contains_key(m) || frozen_models.contains(m));
        self.releasing
            .retain(|a, at| now.saturating_duration_since(*at) < RELEASE_HOLD && !state.placements.contains(a));
        let releasing: BTreeSet<Assignment> = self.releasing.keys().cloned().collect();
        let mut planned = plan::plan_with(&state, &excluded, &vanished, &frozen, &releasing);
        planned.assignments.extend(frozen.into_keys());
        self.metrics.placement_plans.inc();
        self.metrics.placement_unplaced.set(planned.unplaced_replicas() as i64);
        for r in self.loads.unplaced_reports(&state, &planned.unplaced, &excluded, now) {
            tracing::warn!(
                model = %r.model,
                version = r.version,
                missing = r.missing,
                excluded_after_failure = r.excluded_failed,
                "{r}"
            );
        }
        let over = plan::overcommitted(&state, &planned.assignments);
        self.metrics.placement_overcommitted.set(over.len() as i64);
        for o in &over {
            if !self.overcommitted.contains(&o.worker) {
                tracing::warn!(
                    worker = %o.worker,
                    memory_mb = o.memory_mb,
                    capacity_mb = o.capacity_mb,
                    models = o.models,
                    max_models = o.max_models,
                    "the worker's placements exceed its declared capacity (it shrank, or a model's memory_mb grew): \
                     they stay (nothing is unloaded for a declaration) and nothing new goes to it; \
                     drain it or remove models to bring it back within capacity"
                );
            }
        }
        self.overcommitted = over.into_iter().map(|o| o.worker).collect();
        let value =
            records::encode(&PlacementRecord { schema: records::SCHEMA_VERSION, leader_revision: leader.rev() })
                .map_err(|e| e.to_string())?;
        let mut ops = Vec::new();
        for (w, m, v) in planned.assignments.difference(&state.placements) {
            tracing::info!(worker = %w, model = %m, version = v, "placing");
            ops.push(TxnOp::put(keys.placement(w, m, *v), value.clone(), None));
        }
        // A placement key whose value was rejected is not in `state` (a hand edit, a newer
        // schema): workers may still obey it, so one the plan does not want is deleted, not left
        // for ever (one it wants was rewritten above, being missing from `state`) — unless its
        // worker or model is frozen: those keep their placements as they are.
        for r in &rejected {
            if let Some(fleet::Key::Placement { worker, model, version }) = keys.parse(r.key.as_bytes())
                && !frozen_workers.contains(&worker)
                && !frozen_models.contains(&model)
                && let assignment = (worker.clone(), model.clone(), version)
                && !planned.assignments.contains(&assignment)
                && !state.placements.contains(&assignment)
            {
                tracing::info!(%worker, %model, version, "removing a placement whose value was rejected");
                ops.push(TxnOp::delete(r.key.clone(), None));
            }
        }
        let removed: Vec<Assignment> = state.placements.difference(&planned.assignments).cloned().collect();
        for (w, m, v) in &removed {
            // On a draining or drained worker: handed over (its replacement is READY), or with
            // nothing to hand over (not READY there, or no replacement could be placed). On an
            // unregistered one: vanished longer than the grace ago, or its replacement is READY.
            let worker_active = state.is_active(w);
            let worker_registered = state.workers.contains_key(w);
            tracing::info!(worker = %w, model = %m, version = v, worker_active, worker_registered, "removing placement");
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
        // Only on active workers does the room matter (and can the worker still hold it).
        let at = Instant::now();
        for a in removed.into_iter().filter(|(w, _, _)| state.is_active(w)) {
            self.releasing.insert(a, at);
        }
        Ok(())
    }
}

/// When the next plan is due: one timer, set when the first change since the last plan arrives
/// and never pushed back by later ones — so a steady stream of etcd events (a key written every
/// few milliseconds, the workers' status churn, the keep-alive ticks of the select loop) cannot
/// postpone a plan past [`DEBOUNCE`] — and re-armed for [`REPLAN_INTERVAL`] after each plan.
struct Schedule {
    timer: Pin<Box<Sleep>>,
}

impl Schedule {
    /// Due at once: a new leader plans before anything else.
    fn new() -> Self {
        Schedule { timer: Box::pin(tokio::time::sleep_until(Instant::now())) }
    }

    /// Something changed: a plan within [`DEBOUNCE`], or sooner if one is due sooner.
    fn changed(&mut self) {
        let soon = Instant::now() + DEBOUNCE;
        if soon < self.timer.deadline() {
            self.timer.as_mut().reset(soon);
        }
    }

    /// A plan ran: the next one is due after [`REPLAN_INTERVAL`] unless something changes.
    fn planned(&mut self) {
        self.timer.as_mut().reset(Instant::now() + REPLAN_INTERVAL);
    }

    /// Resolves when a plan is due. Cancel-safe (the timer lives in `self`): a select loop may
    /// drop it every turn without moving the deadline.
    async fn due(&mut self) {
        self.timer.as_mut().await
    }
}

/// A load that failed: a FAILED status, or no READY within the load timeout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadFailure {
    pub worker: String,
    pub model: String,
    pub version: i64,
    /// The worker's own reason, or why the controller gave up waiting.
    pub reason: String,
}

impl fmt::Display for LoadFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the load of {} version {} failed on worker {}: {}",
            self.model, self.version, self.worker, self.reason
        )
    }
}

/// Why a version has fewer replicas than declared, as one warning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnplacedReport {
    pub model: String,
    pub version: i64,
    pub missing: u32,
    pub replicas: u32,
    /// Active workers not chosen because their load of this version failed (in cooldown).
    pub excluded_failed: usize,
    /// The last load failure of this version seen by this leader, if any.
    pub last_failure: Option<LoadFailure>,
}

impl fmt::Display for UnplacedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (model, version) = (&self.model, self.version);
        write!(f, "{} of {} replica(s) of {model} version {version} not placed: ", self.missing, self.replicas)?;
        if self.excluded_failed > 0 {
            write!(
                f,
                "{} active worker(s) excluded because their load of it failed (not retried there for {}s \
                 after a failure, doubling with each further one up to {}s); ",
                self.excluded_failed,
                FAILED_COOLDOWN.as_secs(),
                FAILED_COOLDOWN_MAX.as_secs()
            )?;
        }
        write!(f, "no other active worker both has room (memory_mb, max_models) and matches its selector")?;
        if let Some(last) = &self.last_failure {
            write!(f, "; last load failure, on worker {}: {}", last.worker, last.reason)?;
        }
        Ok(())
    }
}

/// What the leader learns about loads from plan to plan: which (worker, version) pairs failed
/// and since when, how long each placement has gone without READY, the last failure per
/// version, and which unplaced warnings were already given.
///
/// A worker's statuses exist only while it is placed there, and the controller removes a
/// FAILED placement at once, so the reason would vanish within one plan if it were not kept
/// here.
/// How many load timeouts a load still waiting its turn on the worker (pending) is given.
const PENDING_TIMEOUT_FACTOR: u32 = 4;

/// A status as far as the load timeout cares: its state and reason.
type StatusKey = (ModelState, String);

/// The exclusion after a worker's `failures`-th failure in a row to load a version.
fn cooldown_after(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    FAILED_COOLDOWN.saturating_mul(1 << doublings).min(FAILED_COOLDOWN_MAX)
}

struct LoadWatch {
    load_timeout: Duration,
    /// Assignments whose load failed lately: excluded until the instant given.
    failed: BTreeMap<Assignment, Instant>,
    /// Failures per assignment (how many in a row, the last when): each doubles the next
    /// exclusion; forgotten after [`FAILURE_MEMORY`] without one.
    strikes: BTreeMap<Assignment, (u32, Instant)>,
    /// Placements on active workers seen without a READY (or FAILED) status: since when, and
    /// the status they had then. A worker that queues its loads says PENDING (LOADING with
    /// reason [`PENDING_REASON`]) until it starts a load: the wait restarts with each change, so
    /// the timeout measures the load itself, not the queue before it.
    not_ready_since: BTreeMap<Assignment, (Instant, Option<StatusKey>)>,
    /// The last failure per (model, version), while the version is declared.
    last_failure: BTreeMap<(String, i64), LoadFailure>,
    /// The last unplaced warning per (model, version) and when it was given.
    reported: BTreeMap<(String, i64), (UnplacedReport, Instant)>,
    /// Each model's declaration as last observed: one redeclared with any change (versions,
    /// replicas, resources, selector) forgets its load failures. An identical value written
    /// again is no change (its record is all that is compared).
    declared: BTreeMap<String, records::ModelRecord>,
}

impl LoadWatch {
    fn new(load_timeout: Duration) -> Self {
        LoadWatch {
            load_timeout,
            failed: BTreeMap::new(),
            strikes: BTreeMap::new(),
            not_ready_since: BTreeMap::new(),
            last_failure: BTreeMap::new(),
            reported: BTreeMap::new(),
            declared: BTreeMap::new(),
        }
    }

    /// A new term of leadership: what happened while another gateway led was not watched, so
    /// waits for READY start over and shortages are reported afresh; failures (with their
    /// cooldown, in absolute time) and their reasons are kept.
    fn begin_term(&mut self) {
        self.not_ready_since.clear();
        self.reported.clear();
    }

    /// Takes in a fresh read of the fleet at `now`; returns the failures seen for the first
    /// time (each FAILED status once per cooldown, each load timeout once), to be logged.
    fn observe(&mut self, state: &FleetState, now: Instant) -> Vec<LoadFailure> {
        self.failed.retain(|_, until| now < *until);
        self.strikes.retain(|_, (_, at)| now.saturating_duration_since(*at) < FAILURE_MEMORY);
        // Failures are forgotten — the worker may be given the version again at once — where
        // what failed may have been fixed: a model redeclared or no longer declared, a worker
        // gone from the fleet (restarted, perhaps with its files fixed; it registers anew).
        let redeclared: BTreeSet<&String> = (self.declared.iter())
            .filter(|(m, record)| state.models.get(*m) != Some(*record))
            .map(|(m, _)| m)
            .collect();
        let fixed = |(w, m, _): &Assignment| redeclared.contains(m) || !state.workers.contains_key(w);
        self.failed.retain(|a, _| !fixed(a));
        self.strikes.retain(|a, _| !fixed(a));
        self.declared = state.models.clone();
        let mut new = Vec::new();
        let mut note = |failed: &mut BTreeMap<Assignment, Instant>, a: &Assignment, reason: String| {
            let (count, at) = self.strikes.entry(a.clone()).or_insert((0, now));
            *count = count.saturating_add(1);
            *at = now;
            failed.insert(a.clone(), now + cooldown_after(*count));
            let f = LoadFailure { worker: a.0.clone(), model: a.1.clone(), version: a.2, reason };
            self.last_failure.insert((a.1.clone(), a.2), f.clone());
            new.push(f);
        };
        // Of registered workers only: a worker's statuses outlive a record deleted by hand (and
        // its failures were forgotten with it above), until the worker writes it again.
        for (worker, statuses) in state.statuses.iter().filter(|(w, _)| state.workers.contains_key(*w)) {
            for ((model, version), s) in statuses {
                let a = (worker.clone(), model.clone(), *version);
                if s.state == ModelState::Failed && !self.failed.contains_key(&a) {
                    let reason =
                        if s.reason.is_empty() { "(the worker gave no reason)".to_string() } else { s.reason.clone() };
                    note(&mut self.failed, &a, reason);
                }
            }
        }
        // Placements that should become READY: on an active worker, of a declared version.
        let mut waiting = BTreeSet::new();
        for a @ (w, m, v) in &state.placements {
            if !state.is_active(w) || !state.models.get(m).is_some_and(|d| d.versions.contains(v)) {
                continue;
            }
            let status = state.statuses.get(w).and_then(|s| s.get(&(m.clone(), *v))).map(|s| s.state);
            if matches!(status, Some(ModelState::Ready | ModelState::Failed)) || self.failed.contains_key(a) {
                continue;
            }
            waiting.insert(a.clone());
            let key = state.statuses.get(w).and_then(|s| s.get(&(m.clone(), *v))).map(|s| (s.state, s.reason.clone()));
            let entry = self.not_ready_since.entry(a.clone()).or_insert((now, key.clone()));
            if entry.1 != key {
                *entry = (now, key);
            }
            let since = entry.0;
            // A pending load waits for the worker's others (each bounded by the timeout); it
            // gets four times as long, in case the worker's queue is stuck behind a hung load.
            let pending = entry.1.as_ref().is_some_and(|(_, reason)| reason == PENDING_REASON);
            let limit =
                if pending { self.load_timeout.saturating_mul(PENDING_TIMEOUT_FACTOR) } else { self.load_timeout };
            if now.saturating_duration_since(since) >= limit {
                let seen = match status {
                    Some(s) => format!("it was still {}", s.name()),
                    None => "the worker published no status for it".to_string(),
                };
                let reason = format!(
                    "not READY within {}s (--placement-load-timeout-secs); {seen}",
                    self.load_timeout.as_secs()
                );
                note(&mut self.failed, a, reason);
                waiting.remove(a);
            }
        }
        self.not_ready_since.retain(|a, _| waiting.contains(a));
        self.last_failure.retain(|(m, v), _| state.models.get(m).is_some_and(|d| d.versions.contains(v)));
        new
    }

    /// How much longer `a` is excluded (zero when it is not).
    fn cooldown_left(&self, a: &Assignment, now: Instant) -> Duration {
        self.failed.get(a).map_or(Duration::ZERO, |until| until.saturating_duration_since(now))
    }

    /// The assignments the plan must not make (or keep): those whose load failed lately.
    fn excluded(&self) -> BTreeSet<Assignment> {
        self.failed.keys().cloned().collect()
    }

    /// The warnings to give about versions left unplaced: each when it first appears or changes,
    /// and again every [`UNPLACED_REPORT_INTERVAL`] while it lasts — not on every plan.
    fn unplaced_reports(
        &mut self,
        state: &FleetState,
        unplaced: &[(String, i64, u32)],
        excluded: &BTreeSet<Assignment>,
        now: Instant,
    ) -> Vec<UnplacedReport> {
        let mut out = Vec::new();
        let mut current = BTreeSet::new();
        for (model, version, missing) in unplaced {
            let key = (model.clone(), *version);
            let report = UnplacedReport {
                model: model.clone(),
                version: *version,
                missing: *missing,
                replicas: state.models.get(model).map_or(0, |d| d.replicas),
                excluded_failed: excluded
                    .iter()
                    .filter(|(w, m, v)| m == model && v == version && state.is_active(w))
                    .count(),
                last_failure: self.last_failure.get(&key).cloned(),
            };
            let repeat = self.reported.get(&key).is_some_and(|(last, at)| {
                *last == report && now.saturating_duration_since(*at) < UNPLACED_REPORT_INTERVAL
            });
            if !repeat {
                self.reported.insert(key.clone(), (report.clone(), now));
                out.push(report);
            }
            current.insert(key);
        }
        // Placed again (or undeclared): a later shortage is news again.
        self.reported.retain(|k, _| current.contains(k));
        out
    }
}

/// How many graces what [`Sightings`] remembers about exits and term graces lasts.
const TERM_MEMORY_GRACES: u32 = 6;

/// When each worker was last seen registered, so that one whose registration vanished is given
/// a grace before its placements are deleted.
///
/// Kept across terms: a worker this gateway saw registered a moment ago is evidence whoever led
/// meanwhile, and the plan only keeps placement keys that still exist.
///
/// A term's first read also counts as a sighting of every unregistered worker that still holds
/// placements: what happened before it, the leader could not see. After a partition between
/// etcd and the fleet (every worker's lease expired meanwhile, the placements stayed), the new
/// leader would otherwise find every worker gone for longer than the grace and delete every
/// placement while the workers, still serving, are re-registering: a fleet-wide cold reload.
/// Once per absence (renewed after [`TERM_MEMORY_GRACES`] graces): terms that keep ending (a
/// flapping leadership) do not keep a dead worker's placements for ever. Not for a worker this
/// gateway saw draining itself (exiting) lately: its placements go at once, as within a term. (One that drained and exited unseen by this gateway
/// keeps its placements for one grace more; its replacements are placed at once.)
struct Sightings {
    grace: Duration,
    last_seen: BTreeMap<String, Instant>,
    /// The next read is a term's first.
    term_begins: bool,
    /// Workers seen draining themselves (when last seen so), until seen serving again.
    exiting: BTreeMap<String, Instant>,
    /// Workers given a term's grace (when), until seen registered again.
    term_granted: BTreeMap<String, Instant>,
}

impl Sightings {
    fn new(grace: Duration) -> Self {
        Sightings {
            grace,
            last_seen: BTreeMap::new(),
            term_begins: false,
            exiting: BTreeMap::new(),
            term_granted: BTreeMap::new(),
        }
    }

    /// A new term of leadership: its first read sees the placed workers afresh.
    fn begin_term(&mut self) {
        self.term_begins = true;
    }

    /// Takes in a fresh read of the fleet at `now`; returns the workers not registered in it
    /// that were last seen less than the grace ago.
    fn observe(&mut self, state: &FleetState, now: Instant) -> BTreeSet<String> {
        if std::mem::take(&mut self.term_begins) {
            let placed: BTreeSet<&String> = state.placements.iter().map(|(w, _, _)| w).collect();
            // What this gateway saw may be old news after a while it did not lead (the
            // worker restarted, served and vanished again meanwhile): forgotten after
            // TERM_MEMORY_GRACES graces.
            let recent = |at: &Instant| now.saturating_duration_since(*at) < self.grace * TERM_MEMORY_GRACES;
            self.term_granted.retain(|w, at| placed.contains(w) && recent(at));
            self.exiting.retain(|w, at| (placed.contains(w) || state.workers.contains_key(w)) && recent(at));
            for worker in placed {
                if !state.workers.contains_key(worker)
                    && !self.exiting.contains_key(worker)
                    && !self.term_granted.contains_key(worker)
                {
                    self.term_granted.insert(worker.clone(), now);
                    self.last_seen.insert(worker.clone(), now);
                }
            }
        }
        for (id, record) in &state.workers {
            self.term_granted.remove(id);
            if record.state == WorkerState::Draining {
                // Exiting: its registration goes when it stops (lease revoked), for good. Its
                // placements must go then too, not be found by a process restarted under the
                // same id moments later while replacements load elsewhere.
                self.last_seen.remove(id);
                self.exiting.insert(id.clone(), now);
            } else {
                self.last_seen.insert(id.clone(), now);
                self.exiting.remove(id);
            }
        }
        self.last_seen.retain(|_, seen| now.saturating_duration_since(*seen) < self.grace);
        self.last_seen.keys().filter(|w| !state.workers.contains_key(*w)).cloned().collect()
    }
}

fn is_placement(keys: &Keys, key: &[u8]) -> bool {
    matches!(keys.parse(key), Some(fleet::Key::Placement { .. }))
}

/// The models and the workers whose value was rejected with no good one to fall back on.
fn frozen(keys: &Keys, rejected: &[fleet::Rejected], state: &FleetState) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut models, mut workers) = (BTreeSet::new(), BTreeSet::new());
    for r in rejected {
        match keys.parse(r.key.as_bytes()) {
            Some(fleet::Key::Model(m)) if !state.models.contains_key(&m) => {
                models.insert(m);
            }
            Some(fleet::Key::Worker(w)) if !state.workers.contains_key(&w) => {
                workers.insert(w);
            }
            _ => {}
        }
    }
    (models, workers)
}

#[cfg(test)]
mod tests {
    use nereid_common::fleet::records::DrainRecord;

    use super::plan::fixtures::{a, model, status, worker};
    use super::*;

    /// A rejected value freezes what it governs only where no good value stands in for it: a
    /// model or a worker the controller never saw valid (this term) keeps its placements.
    #[test]
    fn rejected_values_without_a_fallback_freeze_their_model_or_worker() {
        let keys = Keys::new("/nereid").unwrap();
        let mut state = FleetState::default();
        worker(&mut state, "w1", 1000, 10);
        model(&mut state, "m", &[1], 1, 10);
        let rejected = |key: String| fleet::Rejected { kind: "x", key, reason: "bad".into() };
        let found = [
            rejected(keys.worker("w1")), // has its last good value: used
            rejected(keys.worker("w2")), // none: frozen
            rejected(keys.model("m")),
            rejected(keys.model("n")),
            rejected(keys.placement("w1", "m", 1)),
        ];
        let (models, workers) = frozen(&keys, &found, &state);
        assert_eq!(models, BTreeSet::from(["n".to_string()]));
        assert_eq!(workers, BTreeSet::from(["w2".to_string()]));
    }

    /// A change every 20 ms, for a second: a plan still runs at most DEBOUNCE after the first
    /// change since the previous plan (virtual time, so exact), instead of waiting for the
    /// churn to stop.
    #[tokio::test(start_paused = true)]
    async fn a_steady_stream_of_changes_does_not_starve_the_plan() {
        let mut schedule = Schedule::new();
        let mut churn = tokio::time::interval(Duration::from_millis(20));
        let mut first_change: Option<Instant> = None;
        let (mut changes, mut plans) = (0, 0);
        while changes < 50 {
            tokio::select! {
                _ = churn.tick() => {
                    changes += 1;
                    first_change.get_or_insert_with(Instant::now);
                    schedule.changed();
                }
                _ = schedule.due() => {
                    if let Some(first) = first_change.take() {
                        assert!(Instant::now() - first <= DEBOUNCE, "planned {:?} after a change", Instant::now() - first);
                        plans += 1;
                    }
                    schedule.planned();
                }
            }
        }
        // One plan per debounce window (and the change after it), not one at the end.
        assert!(plans >= 10, "{plans} plans during the churn");
    }

    #[tokio::test(start_paused = true)]
    async fn plans_are_due_at_once_then_on_change_or_every_interval() {
        let start = Instant::now();
        let mut schedule = Schedule::new();
        schedule.due().await;
        assert_eq!(Instant::now(), start, "a new leader plans at once");

        // Nothing changes: the periodic re-plan.
        schedule.planned();
        schedule.due().await;
        assert_eq!(Instant::now(), start + REPLAN_INTERVAL);

        // A change, then another 30 ms later: the first one's deadline holds.
        schedule.planned();
        let first = Instant::now();
        schedule.changed();
        tokio::time::sleep(Duration::from_millis(30)).await;
        schedule.changed();
        schedule.due().await;
        assert_eq!(Instant::now(), first + DEBOUNCE);
    }

    fn fleet() -> FleetState {
        let mut s = FleetState::default();
        worker(&mut s, "w1", 0, 0);
        worker(&mut s, "w2", 0, 0);
        model(&mut s, "m", &[1], 1, 0);
        s
    }

    /// A worker whose lease expired keeps its placement for the grace after it was last seen
    /// registered (its replacement placed at once); then, or when it exits on purpose, the
    /// placement goes.
    #[test]
    fn a_vanished_worker_keeps_its_placements_for_the_grace() {
        let t0 = Instant::now();
        let mut sightings = Sightings::new(VANISHED_GRACE);
        let mut s = fleet();
        s.placements.insert(a("w1", "m", 1));
        status(&mut s, "w1", "m", 1, Some((ModelState::Ready, "")));
        assert!(sightings.observe(&s, t0).is_empty());

        let mut gone = s.clone();
        gone.workers.remove("w1");
        gone.statuses.remove("w1");
        let vanished = sightings.observe(&gone, t0 + Duration::from_secs(1));
        assert_eq!(vanished, BTreeSet::from(["w1".to_string()]));
        let p = plan::plan(&gone, &BTreeSet::new(), &vanished, &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1)]));
        // Counted from when it was last seen, not from when it was found gone.
        let almost = t0 + VANISHED_GRACE - Duration::from_millis(1);
        assert_eq!(sightings.observe(&gone, almost), vanished);
        let vanished = sightings.observe(&gone, t0 + VANISHED_GRACE);
        assert!(vanished.is_empty());
        assert_eq!(
            plan::plan(&gone, &BTreeSet::new(), &vanished, &BTreeMap::new()).assignments,
            BTreeSet::from([a("w2", "m", 1)])
        );

        // Back: seen again, and a later loss gets a grace of its own.
        let later = t0 + VANISHED_GRACE * 2;
        assert!(sightings.observe(&s, later).is_empty());
        assert_eq!(sightings.observe(&gone, later + Duration::from_secs(1)).len(), 1);

        // A worker never seen registered (by this leader) gets none within a term; one draining
        // itself (exiting) neither, when its registration goes.
        let mut fresh = Sightings::new(VANISHED_GRACE);
        assert!(fresh.observe(&gone, t0).is_empty());
        s.workers.get_mut("w1").unwrap().state = WorkerState::Draining;
        assert!(fresh.observe(&s, t0).is_empty());
        assert!(fresh.observe(&gone, t0 + Duration::from_secs(1)).is_empty());
    }

    /// A new term cannot tell how long a placed worker has been unregistered (etcd out of reach
    /// meanwhile, a partition longer than the workers' leases): its first read gives every
    /// placed, unregistered worker the grace — whether this gateway never saw it, or saw it
    /// last long ago — so re-registering workers keep their models.
    #[test]
    fn a_new_term_gives_placed_workers_the_grace_from_its_first_read() {
        let t0 = Instant::now();
        let mut s = fleet();
        s.placements.insert(a("w1", "m", 1));
        let mut gone = s.clone();
        gone.workers.remove("w1");
        let after_outage = t0 + VANISHED_GRACE * 6;
        for seen_before in [false, true] {
            let mut sightings = Sightings::new(VANISHED_GRACE);
            if seen_before {
                assert!(sightings.observe(&s, t0).is_empty());
            }
            sightings.begin_term();
            let vanished = sightings.observe(&gone, after_outage);
            assert_eq!(vanished, BTreeSet::from(["w1".to_string()]), "seen before: {seen_before}");
            assert!(
                plan::plan(&gone, &BTreeSet::new(), &vanished, &BTreeMap::new()).assignments.contains(&a("w1", "m", 1))
            );
            // Only the term's first read: the grace then runs out as usual.
            assert_eq!(sightings.observe(&gone, after_outage + Duration::from_secs(1)).len(), 1);
            assert!(sightings.observe(&gone, after_outage + VANISHED_GRACE).is_empty());
        }
        // A worker without placements is not remembered.
        let mut empty = fleet();
        empty.workers.remove("w1");
        let mut sightings = Sightings::new(VANISHED_GRACE);
        sightings.begin_term();
        assert!(sightings.observe(&empty, t0).is_empty());
    }

    /// The term's grace comes once per absence — terms that keep ending do not keep a dead
    /// worker's placements for ever — and never for a worker this gateway saw exiting.
    #[test]
    fn the_terms_grace_comes_once_per_absence_and_not_for_an_exiting_worker() {
        let t0 = Instant::now();
        let mut s = fleet();
        s.placements.insert(a("w1", "m", 1));
        let mut gone = s.clone();
        gone.workers.remove("w1");
        let mut sightings = Sightings::new(VANISHED_GRACE);
        sightings.begin_term();
        assert_eq!(sightings.observe(&gone, t0).len(), 1);
        // Term after term, the grace runs from the first.
        for k in 1..4 {
            sightings.begin_term();
            let vanished = sightings.observe(&gone, t0 + VANISHED_GRACE * k);
            assert!(vanished.is_empty(), "term {k}: {vanished:?}");
        }
        // Back, then gone again: a new absence, a new grace in the next term.
        assert!(sightings.observe(&s, t0 + VANISHED_GRACE * 5).is_empty());
        sightings.begin_term();
        assert_eq!(sightings.observe(&gone, t0 + VANISHED_GRACE * 9).len(), 1);

        // Seen draining itself, then gone: no grace, in this term or the next.
        let mut draining = s.clone();
        draining.workers.get_mut("w1").unwrap().state = WorkerState::Draining;
        let mut sightings = Sightings::new(VANISHED_GRACE);
        assert!(sightings.observe(&draining, t0).is_empty());
        sightings.begin_term();
        assert!(sightings.observe(&gone, t0 + Duration::from_secs(1)).is_empty());
        // What it saw is forgotten after a while (the worker may have come back and gone again
        // while another gateway led): a term much later gives the grace again.
        sightings.begin_term();
        let later = t0 + VANISHED_GRACE * TERM_MEMORY_GRACES;
        assert_eq!(sightings.observe(&gone, later).len(), 1);
    }

    /// A worker that fails a version again after its cooldown is excluded twice as long each
    /// time (up to the cap), and its streak is forgotten after an hour without failing.
    #[test]
    fn repeated_load_failures_double_the_cooldown_up_to_a_cap() {
        let t0 = Instant::now();
        let mut loads = LoadWatch::new(Duration::from_secs(600));
        let mut s = fleet();
        s.placements.insert(a("w1", "m", 1));
        status(&mut s, "w1", "m", 1, Some((ModelState::Failed, "boom")));
        let mut at = t0;
        let mut cooldowns = Vec::new();
        for _ in 0..6 {
            assert_eq!(loads.observe(&s, at).len(), 1, "a new failure once the cooldown ended");
            let left = loads.cooldown_left(&a("w1", "m", 1), at);
            cooldowns.push(left.as_secs());
            assert!(loads.observe(&s, at + left - Duration::from_secs(1)).is_empty(), "still cooling down");
            assert!(loads.excluded().contains(&a("w1", "m", 1)));
            at += left;
        }
        assert_eq!(cooldowns, [60, 120, 240, 480, 960, 960]);
        // An hour without failing there (the worker still in the fleet, the model declared as
        // it was): the next failure starts over.
        let mut quiet = s.clone();
        quiet.placements.clear();
        quiet.statuses.clear();
        loads.observe(&quiet, at);
        assert!(!loads.strikes.is_empty(), "remembered within the hour");
        loads.observe(&quiet, at + FAILURE_MEMORY);
        assert_eq!(loads.observe(&s, at + FAILURE_MEMORY).len(), 1);
        assert_eq!(loads.cooldown_left(&a("w1", "m", 1), at + FAILURE_MEMORY), FAILED_COOLDOWN);
    }

    /// A load failure's exclusion (and streak) is forgotten once the operator redeclares the
    /// model, or the worker leaves the fleet (a restart): the fix is tried at once, not after
    /// up to 16 minutes of cooldown.
    #[test]
    fn load_failures_are_forgotten_on_a_redeclare_or_a_worker_restart() {
        let t0 = Instant::now();
        let mut loads = LoadWatch::new(Duration::from_secs(600));
        let mut s = fleet();
        s.placements.insert(a("w1", "m", 1));
        status(&mut s, "w1", "m", 1, Some((ModelState::Failed, "boom")));
        assert_eq!(loads.observe(&s, t0).len(), 1);
        // The failed placement and its status go; the exclusion stays through a same read.
        s.placements.clear();
        status(&mut s, "w1", "m", 1, None);
        loads.observe(&s, t0);
        assert!(loads.excluded().contains(&a("w1", "m", 1)));
        // Redeclared (here: one replica more): forgotten.
        s.models.get_mut("m").unwrap().replicas += 1;
        loads.observe(&s, t0);
        assert!(loads.excluded().is_empty(), "{:?}", loads.excluded());
        assert!(loads.strikes.is_empty());
        // Failed again; then w1 leaves (and comes back): forgotten too.
        s.placements.insert(a("w1", "m", 1));
        status(&mut s, "w1", "m", 1, Some((ModelState::Failed, "boom")));
        assert_eq!(loads.observe(&s, t0).len(), 1);
        s.placements.clear();
        s.statuses.clear();
        let record = s.workers.remove("w1").unwrap();
        loads.observe(&s, t0);
        s.workers.insert("w1".into(), record);
        loads.observe(&s, t0);
        assert!(loads.excluded().is_empty());
    }

    #[test]
    fn a_failed_load_is_reported_once_and_remembered_after_its_status_is_gone() {
        let t0 = Instant::now();
        let mut loads = LoadWatch::new(Duration::from_secs(600));
        let mut s = fleet();
        s.placements.insert(a("w1", "m", 1));
        status(&mut s, "w1", "m", 1, Some((ModelState::Failed, "model file is corrupt")));
        let new = loads.observe(&s, t0);
        assert_eq!(
            new,
            vec![LoadFailure {
                worker: "w1".into(),
                model: "m".into(),
                version: 1,
                reason: "model file is corrupt".into()
            }]
        );
        assert_eq!(new[0].to_string(), "the load of m version 1 failed on worker w1: model file is corrupt");
        assert!(loads.observe(&s, t0 + Duration::from_secs(1)).is_empty(), "logged once");
        assert_eq!(loads.excluded(), BTreeSet::from([a("w1", "m", 1)]));

        // The controller removed the placement; the worker removed the status. The reason stays.
        s.placements.clear();
        status(&mut s, "w1", "m", 1, None);
        assert!(loads.observe(&s, t0 + Duration::from_secs(2)).is_empty());
        assert_eq!(loads.last_failure[&("m".to_string(), 1)].reason, "model file is corrupt");
        // Cooldown over: the worker may be chosen again; the last reason is still known.
        loads.observe(&s, t0 + FAILED_COOLDOWN);
        assert!(loads.excluded().is_empty());
        assert!(loads.last_failure.contains_key(&("m".to_string(), 1)));
        // Undeclared: forgotten.
        s.models.clear();
        loads.observe(&s, t0 + FAILED_COOLDOWN);
        assert!(loads.last_failure.is_empty());

        // No reason given by the worker: said so.
        let mut loads = LoadWatch::new(Duration::from_secs(600));
        let mut s = fleet();
        status(&mut s, "w2", "m", 1, Some((ModelState::Failed, "")));
        assert!(loads.observe(&s, t0)[0].reason.contains("no reason"));
    }

    /// A placement that never becomes READY (the worker publishes nothing, or stays LOADING)
    /// counts as failed after the load timeout, and the plan then moves it.
    #[test]
    fn a_placement_not_ready_within_the_load_timeout_is_moved() {
        let timeout = Duration::from_secs(600);
        let t0 = Instant::now();
        let mut loads = LoadWatch::new(timeout);
        let mut s = fleet();
        s.placements.insert(a("w1", "m", 1));
        status(&mut s, "w1", "m", 1, Some((ModelState::Loading, "")));
        assert!(loads.observe(&s, t0).is_empty());
        assert!(loads.observe(&s, t0 + timeout - Duration::from_secs(1)).is_empty());
        assert_eq!(
            plan::plan(&s, &loads.excluded(), &BTreeSet::new(), &BTreeMap::new()).assignments,
            BTreeSet::from([a("w1", "m", 1)])
        );

        let new = loads.observe(&s, t0 + timeout);
        assert_eq!(new.len(), 1, "{new:?}");
        assert_eq!((new[0].worker.as_str(), new[0].model.as_str(), new[0].version), ("w1", "m", 1));
        assert!(new[0].reason.contains("not READY within 600s"), "{}", new[0].reason);
        assert!(new[0].reason.contains("still LOADING"), "{}", new[0].reason);
        let p = plan::plan(&s, &loads.excluded(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w2", "m", 1)]), "moved to w2");
        assert!(loads.observe(&s, t0 + timeout + Duration::from_secs(1)).is_empty(), "logged once");

        // w2 never publishes anything either.
        s.placements = p.assignments;
        status(&mut s, "w1", "m", 1, None);
        let t1 = t0 + timeout + Duration::from_secs(2);
        assert!(loads.observe(&s, t1).is_empty());
        let new = loads.observe(&s, t1 + timeout);
        assert!(new[0].reason.contains("published no status"), "{new:?}");
    }

    /// A load queued behind the worker's other loads (LOADING, reason pending) is timed from
    /// when the worker starts it, not from when it was placed.
    #[test]
    fn the_load_timeout_counts_from_the_start_of_the_load_not_the_queue() {
        let timeout = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut loads = LoadWatch::new(timeout);
        let mut s = fleet();
        s.placements.insert(a("w1", "m", 1));
        status(&mut s, "w1", "m", 1, Some((ModelState::Loading, PENDING_REASON)));
        assert!(loads.observe(&s, t0).is_empty());
        // Queued for 30 s, longer than the timeout: not a failure, no load of it has run.
        assert!(loads.observe(&s, t0 + Duration::from_secs(15)).is_empty());
        assert!(loads.observe(&s, t0 + Duration::from_secs(30)).is_empty());
        status(&mut s, "w1", "m", 1, Some((ModelState::Loading, "")));
        assert!(loads.observe(&s, t0 + Duration::from_secs(30)).is_empty());
        assert!(loads.observe(&s, t0 + Duration::from_secs(39)).is_empty());
        assert_eq!(loads.observe(&s, t0 + Duration::from_secs(40)).len(), 1, "10 s into the load itself");

        // A queue that never moves (stuck behind a hung load) still ends, after four timeouts.
        let mut loads = LoadWatch::new(timeout);
        status(&mut s, "w1", "m", 1, Some((ModelState::Loading, PENDING_REASON)));
        assert!(loads.observe(&s, t0).is_empty());
        assert!(loads.observe(&s, t0 + Duration::from_secs(39)).is_empty());
        assert_eq!(loads.observe(&s, t0 + Duration::from_secs(40)).len(), 1);
    }

    #[test]
    fn the_load_timeout_restarts_when_the_placement_was_ready_and_skips_inactive_workers() {
        let timeout = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut loads = LoadWatch::new(timeout);
        let mut s = fleet();
        s.placements.insert(a("w1", "m", 1));
        status(&mut s, "w1", "m", 1, Some((ModelState::Loading, "")));
        loads.observe(&s, t0);
        status(&mut s, "w1", "m", 1, Some((ModelState::Ready, "")));
        loads.observe(&s, t0 + Duration::from_secs(5));
        assert!(loads.not_ready_since.is_empty(), "READY: nothing pending");
        // LOADING again (a reload): counted from now, not from t0.
        status(&mut s, "w1", "m", 1, Some((ModelState::Loading, "")));
        assert!(loads.observe(&s, t0 + Duration::from_secs(12)).is_empty());
        assert!(loads.observe(&s, t0 + Duration::from_secs(21)).is_empty());
        assert_eq!(loads.observe(&s, t0 + Duration::from_secs(22)).len(), 1);

        // Leadership lost and won back: the wait starts over, known failures stay.
        loads.begin_term();
        assert!(loads.not_ready_since.is_empty());
        assert!(loads.last_failure.contains_key(&("m".to_string(), 1)));
        assert!(loads.observe(&s, t0 + Duration::from_secs(31)).is_empty(), "in cooldown, not failed again");
        assert_eq!(loads.excluded(), BTreeSet::from([a("w1", "m", 1)]));

        // A drained worker's (or an undeclared version's) placement is not waited on.
        let mut loads = LoadWatch::new(timeout);
        let mut s = fleet();
        s.placements.insert(a("w1", "m", 1));
        s.placements.insert(a("w2", "gone", 1));
        s.drains.insert("w1".into(), DrainRecord { schema: 1, reason: String::new() });
        loads.observe(&s, t0);
        assert!(loads.observe(&s, t0 + timeout).is_empty());
        assert!(loads.not_ready_since.is_empty());
    }

    #[test]
    fn unplaced_versions_are_reported_with_their_failures_and_rate_limited() {
        let t0 = Instant::now();
        let mut loads = LoadWatch::new(Duration::from_secs(600));
        let mut s = fleet();
        model(&mut s, "m", &[1], 2, 0);
        for w in ["w1", "w2"] {
            s.placements.insert(a(w, "m", 1));
        }
        status(&mut s, "w1", "m", 1, Some((ModelState::Failed, "out of memory")));
        status(&mut s, "w2", "m", 1, Some((ModelState::Ready, "")));
        loads.observe(&s, t0);
        let excluded = loads.excluded();
        let p = plan::plan(&s, &excluded, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.unplaced, vec![("m".to_string(), 1, 1)]);

        let reports = loads.unplaced_reports(&s, &p.unplaced, &excluded, t0);
        assert_eq!(reports.len(), 1);
        let r = &reports[0];
        assert_eq!((r.missing, r.replicas, r.excluded_failed), (1, 2, 1));
        let text = r.to_string();
        assert!(text.starts_with("1 of 2 replica(s) of m version 1 not placed: "), "{text}");
        assert!(text.contains("1 active worker(s) excluded because their load of it failed"), "{text}");
        assert!(text.ends_with("last load failure, on worker w1: out of memory"), "{text}");

        // The same shortage on the next plans: not repeated until a minute has passed.
        for secs in [2, 4, 58] {
            let at = t0 + Duration::from_secs(secs);
            assert!(loads.unplaced_reports(&s, &p.unplaced, &excluded, at).is_empty(), "repeated at {secs}s");
        }
        assert_eq!(loads.unplaced_reports(&s, &p.unplaced, &excluded, t0 + UNPLACED_REPORT_INTERVAL).len(), 1);
        // A new term reports it afresh.
        loads.begin_term();
        let at = t0 + UNPLACED_REPORT_INTERVAL + Duration::from_secs(1);
        assert_eq!(loads.unplaced_reports(&s, &p.unplaced, &excluded, at).len(), 1);

        // A change (the cooldown ended: no worker excluded) is reported at once, without the
        // exclusion but with the last known reason.
        let at = t0 + UNPLACED_REPORT_INTERVAL + Duration::from_secs(2);
        let r = loads.unplaced_reports(&s, &p.unplaced, &BTreeSet::new(), at);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].excluded_failed, 0);
        assert!(!r[0].to_string().contains("excluded"), "{}", r[0]);
        assert!(r[0].to_string().contains("out of memory"), "{}", r[0]);

        // Placed in full, then short again: news again at once.
        assert!(loads.unplaced_reports(&s, &[], &BTreeSet::new(), at).is_empty());
        assert_eq!(loads.unplaced_reports(&s, &p.unplaced, &BTreeSet::new(), at).len(), 1);

        // No failure known: only the lack of room.
        let mut fresh = LoadWatch::new(Duration::from_secs(600));
        let text = fresh.unplaced_reports(&s, &p.unplaced, &BTreeSet::new(), t0)[0].to_string();
        assert_eq!(
            text,
            "1 of 2 replica(s) of m version 1 not placed: no other active worker both has room (memory_mb, \
             max_models) and matches its selector"
        );
    }
}
