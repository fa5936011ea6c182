//! Membership in the fleet through etcd: registration under a lease, the placement agent, and
//! per-model status.
//!
//! Everything here runs on one dedicated OS thread with its own single-threaded tokio runtime
//! ([`FleetAgent::start`]), so keep-alives never queue behind request work on the I/O runtime
//! — request load cannot starve the lease.
//!
//! The worker's *lease* lives as long as the process, not as long as a session: it is granted
//! once and kept alive on a task of its own ([`KeptLease`]: every TTL/3, re-opening its
//! keep-alive stream when that breaks). A new lease is granted only when that task reports the
//! lease lost — etcd answered that it is gone (expired, revoked), or no keep-alive answer came
//! for its TTL (clientv3's deadline) — and the lost one is revoked once the registration is
//! re-put under the new one. So an etcd that refuses writes for a while (a NOSPACE alarm, "too
//! many requests") while it still renews leases does not make the worker drop a valid lease
//! and fail to get another: its registration stays, and gateways keep routing to it.
//!
//! One *session* = connect → (grant a lease, if none is held) → put `workers/<id>` and every
//! `status/<id>/…` under the lease → watch this worker's own keys and `placement/<id>/` (after
//! reading it whole, the first time). Inside a session one loop applies placement events,
//! republishes statuses that changed, writes again the record or a status deleted behind the
//! worker's back (an operator's `etcdctl del`, another process with this id), and reacts to
//! drain/stop; a write that fails there is retried with back-off without ending the session
//! (the writes that open a session must all succeed: a failure there ends it, the lease kept).
//! A watch that fails, or a lost lease, ends the session; the next one starts after a bounded, jittered
//! back-off (started over only after a session that stayed up [`Backoff::STABLE`]) and
//! re-registers under the lease it holds, so an etcd restart or a leader change heals without
//! the registration ever leaving etcd. The placement watch resumes from the last revision seen
//! (placement is kept across sessions); only the first session, a resume whose revision etcd
//! has compacted away, or a session that finds etcd's history went back (its data wiped or
//! restored from an older backup, or another cluster: resuming from the old revision would see
//! nothing, forever — [`nereid_common::fleet::history_reset`]) reads the prefix whole, paged
//! and as of one revision. While etcd is away the worker keeps serving what it has: placement
//! is only acted on when it is read, never on a failure. Every etcd request requires a leader,
//! so a member that lost its quorum ends the session (its watch streams are cancelled) instead
//! of leaving the worker following a history that no longer advances.
//!
//! Loads and unloads run on a thread of their own (the *reconciler*) so a slow model load, or
//! a repository read from a stalled mount, never delays a keep-alive; up to
//! `--model-load-thread-count` placed models load at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nereid_common::fleet::etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchFilterType,
    WatchOptions, WatchStream,
};
use nereid_common::fleet::keys::check_name;
use nereid_common::fleet::records::{self, ModelState, PlacementRecord, StatusRecord, WorkerRecord, WorkerState};
use nereid_common::fleet::{
    self as fleet, Backoff, CALL_TIMEOUT, ClusterMark, KeptLease, Key, Keys, bounded, history_reset,
};
use tokio::sync::watch;

use crate::metrics::FleetCounters;
use crate::repository::Repository;
use crate::server::IndexEntry;

/// How often model states are compared with what was last published.
const STATUS_INTERVAL: Duration = Duration::from_millis(200);

#[derive(Clone, Debug)]
pub struct FleetOptions {
    pub endpoints: Vec<String>,
    pub keys: Keys,
    /// The record to register (its `state` is set by the agent).
    pub record: WorkerRecord,
    pub lease_ttl: Duration,
    /// How long a model whose placement was removed keeps serving, no longer published READY,
    /// before it is unloaded: gateways whose watches lag still send it requests meanwhile.
    pub unload_grace: Duration,
}

/// What the process wants of the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Serving,
    Draining,
    Stopped,
}

/// Versions of each model placed on this worker.
type Placement = BTreeMap<String, BTreeSet<i64>>;

/// This worker's placement as known, kept across sessions: the assignments as of `revision`
/// (`None` until first read, or after a compaction or a history reset made resuming
/// impossible).
#[derive(Default)]
struct PlacementView {
    placement: Placement,
    revision: Option<i64>,
    /// etcd's history as far as seen (every response header), compared with the cluster's at
    /// the start of each session.
    seen: ClusterMark,
    /// etcd's history went back (wiped, or restored from a backup) since the placement was
    /// last read.
    reset: bool,
    /// The placement was kept across such a reset because the new history holds none for this
    /// worker: the next placement written replaces it whole.
    kept: bool,
}

/// Handle to the agent thread.
pub struct FleetAgent {
    phase: watch::Sender<Phase>,
    /// True once the draining record is in etcd (or the agent gave up trying).
    drained: watch::Receiver<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FleetAgent {
    /// Starts the agent thread. Returns at once; registration happens in the background (and
    /// is retried until etcd answers).
    pub fn start(
        options: FleetOptions,
        repository: Arc<Repository>,
        counters: Arc<FleetCounters>,
    ) -> std::io::Result<FleetAgent> {
        let (phase_tx, phase_rx) = watch::channel(Phase::Serving);
        let (drained_tx, drained_rx) = watch::channel(false);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let thread = std::thread::Builder::new().name("nereid-etcd".into()).spawn(move || {
            runtime.block_on(agent(options, repository, counters, phase_rx, drained_tx));
        })?;
        Ok(FleetAgent { phase: phase_tx, drained: drained_rx, thread: Some(thread) })
    }

    /// Marks this worker draining in etcd (gateways stop routing to it, the placement
    /// controller stops placing on it); waits until that is written, at most `timeout`.
    pub async fn drain(&mut self, timeout: Duration) {
        self.phase.send_replace(Phase::Draining);
        let wait = self.drained.wait_for(|d| *d);
        if tokio::time::timeout(timeout, wait).await.is_err() {
            tracing::warn!("could not mark this worker draining in etcd within {timeout:?}");
        }
    }

    /// Revokes the lease (removing the registration and statuses at once) and stops the thread,
    /// waiting at most `timeout`.
    pub async fn stop(mut self, timeout: Duration) {
        self.phase.send_replace(Phase::Stopped);
        if let Some(thread) = self.thread.take() {
            let join = tokio::task::spawn_blocking(move || thread.join());
            if tokio::time::timeout(timeout, join).await.is_err() {
                tracing::warn!("the etcd agent did not stop within {timeout:?}");
            }
        }
    }
}

async fn agent(
    options: FleetOptions,
    repository: Arc<Repository>,
    counters: Arc<FleetCounters>,
    mut phase: watch::Receiver<Phase>,
    drained: watch::Sender<bool>,
) {
    let failures: Failures = Default::default();
    let retiring: Retiring = Default::default();
    let loading: Loading = Default::default();
    let (desired_tx, desired_rx) = watch::channel(None::<Placement>);
    // On a thread (and runtime) of its own: loads and unloads read the model repository from
    // disk (scans, configs), which on a slow or stalled mount would otherwise hold up this
    // thread — and with it the lease's keep-alives — past the lease's TTL. It ends once
    // `desired_tx` is dropped (when this function returns).
    let reconciler = {
        let (repository, failures, retiring, loading) =
            (repository.clone(), failures.clone(), retiring.clone(), loading.clone());
        let grace = options.unload_grace;
        std::thread::Builder::new().name("nereid-placement".into()).spawn(move || {
            match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime.block_on(reconcile(repository, desired_rx, failures, retiring, loading, grace)),
                Err(e) => tracing::error!("placement: cannot start the reconciler's runtime: {e}"),
            }
        })
    };
    if let Err(e) = &reconciler {
        tracing::error!("placement: cannot start the reconciler's thread ({e}): placements will not be loaded");
    }
    let mut backoff = Backoff::new();
    // The lease this process is registered under, kept alive from its grant until it is lost
    // (or revoked at exit), whatever happens to the sessions in between.
    let mut lease: Option<KeptLease> = None;
    // Leases this process held before, possibly still alive in etcd (one presumed lost when no
    // keep-alive answer came for its TTL may live on, still holding a drain record: etcd
    // extends every lease by a TTL when it restarts or changes leader, however long it was
    // away), kept until a session carries their drain and revokes them — the most recent
    // PREVIOUS_LEASES of them.
    let mut previous: Vec<i64> = Vec::new();
    let mut view = PlacementView::default();
    loop {
        counters.sessions.fetch_add(1, Ordering::Relaxed);
        if let Some(why) = lease.as_ref().and_then(KeptLease::lost)
            && let Some(lost) = lease.take()
        {
            tracing::warn!(worker = %options.record.id, lease = lost.id(), "lease lost ({why}): registering under a new one");
            previous.push(lost.id());
            let excess = previous.len().saturating_sub(PREVIOUS_LEASES);
            previous.drain(..excess);
        }
        let mut previous_leases: Vec<i64> = previous.clone();
        let started = std::time::Instant::now();
        let mut session = Session {
            options: &options,
            repository: &repository,
            failures: &failures,
            retiring: &retiring,
            loading: &loading,
            desired: &desired_tx,
            drained: &drained,
            counters: &counters,
            lease: &mut lease,
            published: HashMap::new(),
            record: None,
            view: &mut view,
        };
        let result = session.run(&mut phase, &mut previous_leases).await;
        counters.connected.store(0, Ordering::Relaxed);
        // Those the session revoked are gone.
        previous.retain(|lease| previous_leases.contains(lease));
        match result {
            Ok(()) => break,
            Err(e) => {
                if fleet::lease_not_found(&e)
                    && let Some(gone) = lease.take()
                {
                    tracing::warn!(worker = %options.record.id, lease = gone.id(), "etcd no longer holds the lease");
                }
                tracing::warn!(worker = %options.record.id, "etcd session ended: {e}; reconnecting");
                if *phase.borrow() == Phase::Draining {
                    // No etcd to tell: do not hold up the drain.
                    drained.send_replace(true);
                }
                // Only a session that stayed up a while starts the back-off over: one that etcd
                // drops as soon as it is registered (a flapping member) is retried ever more
                // slowly, not every 100 ms.
                backoff.reset_if_stable(started.elapsed());
                let delay = backoff.next_delay();
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = phase.wait_for(|p| *p == Phase::Stopped) => break,
                }
                if *phase.borrow() == Phase::Stopped {
                    break;
                }
            }
        }
    }
    // The reconciler stops at its next look at the placement (not joined: a load it runs may
    // take a while, and this process is on its way out).
    drop(desired_tx);
    drop(reconciler);
    // Stopped between sessions (or while revoking its lease failed): the registration would
    // outlive this process by up to a TTL, gateways still counting on it. A last, bounded try.
    // (A revoke of an earlier lease that failed inside a session is not retried: its drain was
    // carried already, and the lease expires by itself within a TTL of etcd's last renewal.)
    let mut leftover: Vec<i64> = previous;
    leftover.extend(lease.as_ref().map(KeptLease::id));
    if !leftover.is_empty()
        && let Ok(mut client) = bounded("connect", nereid_common::fleet::connect(&options.endpoints)).await
    {
        for lease in leftover {
            let _ = tokio::time::timeout(CALL_TIMEOUT, client.lease_revoke(lease)).await;
        }
    }
}

type Failures = Arc<Mutex<HashMap<String, String>>>;

/// Models no longer placed here that still serve during the unload grace.
type Retiring = Arc<Mutex<BTreeSet<String>>>;

/// The models whose placement the reconciler is loading now, with the versions each load is
/// for.
type Loading = Arc<Mutex<BTreeMap<String, BTreeSet<i64>>>>;

struct Session<'a> {
    options: &'a FleetOptions,
    repository: &'a Repository,
    failures: &'a Failures,
    retiring: &'a Retiring,
    loading: &'a Loading,
    desired: &'a watch::Sender<Option<Placement>>,
    drained: &'a watch::Sender<bool>,
    counters: &'a FleetCounters,
    /// The process's lease: granted by this session when there is none (the first session, or
    /// the last lease was lost), kept from the last session otherwise.
    lease: &'a mut Option<KeptLease>,
    /// Statuses as last written in this session, each with the revision of its write.
    published: HashMap<(String, i64), (StatusRecord, i64)>,
    /// The phase the worker record was last written with in this session, and the revision
    /// of that write; `None` when it is to be written (again).
    record: Option<(Phase, i64)>,
    view: &'a mut PlacementView,
}

type SessionResult = Result<(), String>;

/// Most earlier leases remembered for carrying a drain and revoking (each lost one adds one).
const PREVIOUS_LEASES: usize = 16;

impl Session<'_> {
    fn lease_id(&self) -> i64 {
        self.lease.as_ref().map_or(0, KeptLease::id)
    }

    /// Runs one session; `Ok` only when stopped.
    async fn run(&mut self, phase: &mut watch::Receiver<Phase>, previous_leases: &mut Vec<i64>) -> SessionResult {
        let id = self.options.record.id.clone();
        let mut client = bounded("connect", nereid_common::fleet::connect(&self.options.endpoints)).await?;
        // Before this session writes anything: its own writes would move a wiped etcd's
        // revision toward the old one.
        self.check_history(&mut client).await?;
        let granted = self.lease.is_none();
        if granted {
            // Kept alive on a task of its own: a burst of status writes to a slow etcd, or the
            // reads below, cannot make the lease miss a keep-alive; nor does the end of this
            // session end the lease.
            *self.lease = Some(KeptLease::grant(&client, self.options.lease_ttl).await?);
            self.counters.leases.fetch_add(1, Ordering::Relaxed);
        }
        let lease = self.lease_id();
        let lost = self.lease.as_ref().map(KeptLease::until_lost).ok_or("no lease")?;
        tokio::pin!(lost);
        // Registered afresh under the lease, new or kept: whatever happened to the keys while
        // this process was cut off (deleted, or written by another process with this id), they
        // are this process's again.
        let registered_at = self.put_record(&mut client, *phase.borrow()).await?;
        self.publish_statuses(&mut client).await?;
        self.clear_stale_statuses(&mut client).await?;
        if !previous_leases.is_empty() {
            self.carry_drain(&mut client, previous_leases, lease).await?;
            // Only now: the registration and statuses were re-put under the new lease, so this
            // removes just what is stale (revoking first would make gateways see this worker
            // leave and come back).
            for old in std::mem::take(previous_leases) {
                let _ = tokio::time::timeout(CALL_TIMEOUT, client.lease_revoke(old)).await;
            }
        }
        // From the registration on: a deletion of this worker's keys since is replayed.
        let mut own = self.watch_own_keys(&client, registered_at + 1).await?;
        let mut watch = self.watch_placement(&mut client, *phase.borrow()).await?;
        tracing::info!(worker = %id, lease, granted, models = self.view.placement.len(), "registered in etcd");
        self.counters.connected.store(1, Ordering::Relaxed);
        // As written, not as asked: a drain asked for after the record went in as serving is
        // done once the write below lands.
        if self.record.is_some_and(|(written, _)| written == Phase::Draining) {
            self.drained.send_replace(true);
        }

        let mut status_tick = tokio::time::interval(STATUS_INTERVAL);
        // A failed write (a status, the record) does not end the session: it is retried, with
        // back-off, while the session's watches and the lease carry on.
        let mut retry = Backoff::new();
        let mut retry_at: Option<tokio::time::Instant> = None;
        loop {
            let mut write_now = false;
            tokio::select! {
                why = &mut lost => return Err(format!("the lease was lost: {why}")),
                msg = watch.message() => {
                    let resp = msg.map_err(|e| {
                        // Resumed from the same revision, the same response would fail again
                        // for ever: the next session reads the placement whole (paged).
                        if nereid_common::fleet::too_large(&e) {
                            self.view.revision = None;
                        }
                        format!("placement watch: {e}")
                    })?.ok_or("the placement watch closed")?;
                    self.view.seen.observe(resp.header());
                    if resp.compact_revision() > 0 {
                        // The revision to resume from is gone: read the placement whole.
                        tracing::warn!(worker = %id, compacted = resp.compact_revision(), "placement watch behind a compaction; re-reading");
                        self.view.revision = None;
                        watch = self.watch_placement(&mut client, *phase.borrow()).await?;
                        continue;
                    }
                    if resp.canceled() {
                        return Err(format!("the placement watch was cancelled: {}", resp.cancel_reason()));
                    }
                    if !resp.events().is_empty() && std::mem::take(&mut self.view.kept) {
                        // The first placement written since a reset replaces the kept one.
                        self.view.placement.clear();
                    }
                    for event in resp.events() {
                        let Some(kv) = event.kv() else { continue };
                        let value = (event.event_type() == EventType::Put).then(|| kv.value());
                        self.apply_placement(kv.key(), value);
                        self.view.revision = self.view.revision.max(Some(kv.mod_revision()));
                    }
                    // A draining worker keeps what it serves until it exits.
                    if *phase.borrow() == Phase::Serving {
                        self.desired.send_replace(Some(self.view.placement.clone()));
                    }
                }
                msg = own.message() => {
                    let resp = msg.map_err(|e| format!("watch of this worker's keys: {e}"))?
                        .ok_or("the watch of this worker's keys closed")?;
                    if resp.canceled() || resp.compact_revision() > 0 {
                        // The next session writes everything again, under the same lease.
                        return Err(format!("the watch of this worker's keys was cancelled: {}", resp.cancel_reason()));
                    }
                    write_now = self.own_keys_deleted(resp.events());
                }
                _ = status_tick.tick() => write_now = true,
                changed = phase.changed() => {
                    let now = if changed.is_ok() { *phase.borrow_and_update() } else { Phase::Stopped };
                    match now {
                        Phase::Serving => {}
                        Phase::Draining => {
                            // Written at once, ahead of any back-off: the drain waits on it.
                            retry_at = None;
                            write_now = true;
                        }
                        Phase::Stopped => {
                            bounded("lease revoke", client.lease_revoke(lease)).await?;
                            *self.lease = None;
                            tracing::info!(worker = %id, "lease revoked: deregistered from etcd");
                            return Ok(());
                        }
                    }
                }
            }
            if !write_now || retry_at.is_some_and(|at| tokio::time::Instant::now() < at) {
                continue;
            }
            match self.write(&mut client, *phase.borrow()).await {
                Ok(()) => {
                    retry.reset();
                    retry_at = None;
                }
                // Every write under it would fail alike: the next session registers anew.
                Err(e) if fleet::lease_not_found(&e) => return Err(e),
                Err(e) => {
                    let delay = retry.next_delay();
                    tracing::warn!(worker = %id, "{e}; retrying in {delay:?}");
                    retry_at = Some(tokio::time::Instant::now() + delay);
                    if *phase.borrow() == Phase::Draining {
                        // etcd will not take it now: do not hold up the drain.
                        self.drained.send_replace(true);
                    }
                }
            }
        }
    }

    /// Writes what is due: the worker record when it is not in etcd as this session last
    /// wrote it (deleted behind this worker's back, or the phase changed), then the statuses
    /// that changed or were deleted.
    async fn write(&mut self, client: &mut Client, phase: Phase) -> SessionResult {
        if self.record.is_none_or(|(written, _)| written != phase) {
            self.put_record(client, phase).await?;
            if phase == Phase::Draining {
                self.drained.send_replace(true);
                tracing::info!(worker = %self.options.record.id, "marked draining in etcd");
            }
        }
        self.publish_statuses(client).await
    }

    /// Notes which of this worker's keys were deleted behind its back (an operator's `etcdctl
    /// del`, another process with this id revoking its lease, a restore): they are written
    /// again. A deletion older than this session's own last write of the key is not news.
    /// Whether any is to be written again (at once).
    fn own_keys_deleted(&mut self, events: &[nereid_common::fleet::etcd_client::Event]) -> bool {
        let mut rewrite = false;
        for event in events.iter().filter(|e| e.event_type() == EventType::Delete) {
            let Some(kv) = event.kv() else { continue };
            match self.options.keys.parse(kv.key()) {
                Some(Key::Worker(_)) if self.record.is_some_and(|(_, at)| at < kv.mod_revision()) => {
                    tracing::warn!(worker = %self.options.record.id, "the worker record was deleted; registering again");
                    self.record = None;
                    rewrite = true;
                }
                Some(Key::Status { model, version, .. }) => {
                    let key = (model, version);
                    if self.published.get(&key).is_some_and(|(_, at)| *at < kv.mod_revision()) {
                        tracing::warn!(worker = %self.options.record.id, model = %key.0, version = key.1, "a status was deleted; writing it again");
                        self.published.remove(&key);
                        rewrite = true;
                    }
                }
                _ => {}
            }
        }
        rewrite
    }

    /// Watches, from revision `from`, for deletions of this worker's record and statuses.
    async fn watch_own_keys(&self, client: &Client, from: i64) -> Result<WatchStream, String> {
        let keys = &self.options.keys;
        let id = &self.options.record.id;
        let deletions = || WatchOptions::new().with_start_revision(from).with_filters([WatchFilterType::NoPut]);
        let mut watch =
            bounded("watch this worker's record", fleet::watch(client, keys.worker(id), deletions())).await?;
        let statuses = format!("{}{}/", keys.statuses(), id);
        bounded("watch this worker's statuses", watch.watch(statuses, Some(deletions().with_prefix()))).await?;
        Ok(watch)
    }

    /// Moves a drain bound to an earlier lease of this process (`nereidctl drain --until-exit`,
    /// meant to last until this worker exits) onto the new one before the old lease goes:
    /// otherwise a lease presumed lost (no keep-alive answer for a TTL) but still alive in etcd
    /// would undrain, once revoked, a worker that is still on its way out. Written only if the
    /// key is unchanged since read.
    async fn carry_drain(&self, client: &mut Client, old: &[i64], new: i64) -> SessionResult {
        let key = self.options.keys.drain(&self.options.record.id);
        let resp = bounded("read the drain record", client.get(key.as_str(), None)).await?;
        let Some(kv) = resp.kvs().first().filter(|kv| old.contains(&kv.lease())) else {
            return Ok(());
        };
        let txn = Txn::new()
            .when([Compare::mod_revision(key.as_str(), CompareOp::Equal, kv.mod_revision())])
            .and_then([TxnOp::put(key.as_str(), kv.value(), Some(PutOptions::new().with_lease(new)))]);
        if bounded("carry the drain record", client.txn(txn)).await?.succeeded() {
            tracing::info!(worker = %self.options.record.id, "drain record moved to the new lease");
        } else {
            // Changed since read (an operator undrained or re-drained it): theirs stands.
            tracing::info!(worker = %self.options.record.id, "drain record changed meanwhile; left as it is");
        }
        Ok(())
    }

    /// Forgets the revision to resume the placement watch from when etcd's history went back
    /// since it was seen (the next watch then starts from a full read); otherwise notes the
    /// cluster's mark.
    async fn check_history(&mut self, client: &mut Client) -> SessionResult {
        if self.view.revision.is_none() {
            return Ok(());
        }
        let prefix = self.options.keys.placement_of(&self.options.record.id);
        let now = bounded("read the revision", ClusterMark::current(client, &prefix)).await?;
        match history_reset(&self.view.seen, &now) {
            Some(why) => {
                tracing::warn!(worker = %self.options.record.id, "{why}; re-reading the placement");
                self.view.revision = None;
                self.view.reset = true;
            }
            None => self.view.seen.observe_mark(now),
        }
        Ok(())
    }

    /// Watches this worker's placement prefix: from the revision after the last one seen, or —
    /// the first time, after a compaction or a history reset — from a full read of it. Hands
    /// the (unchanged or re-read) placement to the reconciler while `phase` is serving: a
    /// draining worker keeps what it serves until it exits, whatever it reads.
    async fn watch_placement(&mut self, client: &mut Client, phase: Phase) -> Result<WatchStream, String> {
        let prefix = self.options.keys.placement_of(&self.options.record.id);
        let start = match self.view.revision {
            Some(seen) => {
                self.counters.watch_resumes.fetch_add(1, Ordering::Relaxed);
                seen + 1
            }
            None => {
                let read = fleet::get_prefix(client, &prefix).await.map_err(|e| format!("read placement: {e}"))?;
                self.counters.placement_reads.fetch_add(1, Ordering::Relaxed);
                let reset = std::mem::take(&mut self.view.reset);
                // Still kept (nothing placed here since the reset) counts as well: a re-read after
                // a compaction must not unload what the reset kept.
                if (reset || self.view.kept) && read.kvs.is_empty() && !self.view.placement.is_empty() {
                    // A wiped etcd (or one restored from an old backup) holds no placement for
                    // this worker: unloading on its word would take the whole fleet down at once.
                    // Keep serving until the placement is written again.
                    tracing::warn!(
                        worker = %self.options.record.id,
                        models = self.view.placement.len(),
                        "etcd's history was reset and holds no placement for this worker; keeping \
                         what it serves until a placement is written"
                    );
                    self.view.kept = true;
                } else {
                    self.view.kept = false;
                    self.view.placement.clear();
                    for kv in &read.kvs {
                        self.apply_placement(kv.key(), Some(kv.value()));
                    }
                }
                self.view.revision = Some(read.mark.revision);
                // The history seen restarts from this read's (after a reset, the old marks are
                // another history's).
                self.view.seen = read.mark;
                read.mark.revision + 1
            }
        };
        if phase == Phase::Serving {
            self.desired.send_replace(Some(self.view.placement.clone()));
        }
        bounded(
            "watch placement",
            fleet::watch(client, prefix, WatchOptions::new().with_prefix().with_start_revision(start)),
        )
        .await
    }

    /// Writes the worker record, as of `phase`, under the lease; the revision of the write.
    async fn put_record(&mut self, client: &mut Client, phase: Phase) -> Result<i64, String> {
        let mut record = self.options.record.clone();
        record.state = if phase == Phase::Serving { WorkerState::Ready } else { WorkerState::Draining };
        let value = records::encode(&record).map_err(|e| format!("worker record: {e}"))?;
        let key = self.options.keys.worker(&record.id);
        let put = client.put(key, value, Some(PutOptions::new().with_lease(self.lease_id())));
        let resp = bounded("put worker record", put).await?;
        // Every header counts toward the history seen: a reset that this worker's own writes
        // (and the fleet's) move past the old revision is still caught by the raft term.
        self.view.seen.observe(resp.header());
        let revision = resp.header().map_or(0, |h| h.revision());
        self.record = Some((phase, revision));
        Ok(revision)
    }

    /// Updates the local placement from one key (`None`: deleted). Invalid values are logged,
    /// counted (`nereid_worker_etcd_invalid_values_total{kind="placement"}`) and otherwise
    /// ignored — the assignment is the key; the value only names the writer. A malformed key is
    /// logged, counted and skipped.
    fn apply_placement(&mut self, key: &[u8], value: Option<&[u8]>) {
        let (worker, model, version) = match self.options.keys.classify(key) {
            Some(Ok(Key::Placement { worker, model, version })) => (worker, model, version),
            // Never an alias of a real assignment: `placement/<id>/m/01` is not version 1.
            Some(Err(invalid)) => {
                tracing::warn!(key = %String::from_utf8_lossy(key), "ignoring a malformed placement key: {}", invalid.reason);
                self.counters.invalid_placements.fetch_add(1, Ordering::Relaxed);
                return;
            }
            _ => {
                tracing::warn!(key = %String::from_utf8_lossy(key), "ignoring a key under the placement prefix that is not an assignment");
                return;
            }
        };
        if worker != self.options.record.id {
            return;
        }
        match value {
            Some(v) => {
                if let Err(e) = records::decode::<PlacementRecord>(v) {
                    tracing::warn!(%model, version, "placement value rejected ({e}); assignment kept by key");
                    self.counters.invalid_placements.fetch_add(1, Ordering::Relaxed);
                }
                self.view.placement.entry(model).or_default().insert(version);
            }
            None => {
                if let Some(vs) = self.view.placement.get_mut(&model) {
                    vs.remove(&version);
                    if vs.is_empty() {
                        self.view.placement.remove(&model);
                    }
                }
            }
        }
    }

    /// Deletes this worker's statuses that this session did not write: those of an earlier
    /// process with the same id (a crash, a kill) live on under its lease until the lease's TTL,
    /// and gateways would route to models this process does not serve meanwhile.
    async fn clear_stale_statuses(&self, client: &mut Client) -> SessionResult {
        let keys = &self.options.keys;
        let prefix = format!("{}{}/", keys.statuses(), self.options.record.id);
        let options = GetOptions::new().with_prefix().with_keys_only();
        let found = bounded("read statuses", client.get(prefix.as_str(), Some(options))).await?;
        for kv in found.kvs() {
            let stale = match keys.parse(kv.key()) {
                Some(Key::Status { model, version, .. }) => !self.published.contains_key(&(model, version)),
                _ => false,
            };
            if stale {
                tracing::info!(key = %String::from_utf8_lossy(kv.key()), "deleting a status this process did not write");
                bounded("delete status", client.delete(kv.key(), None::<DeleteOptions>)).await?;
            }
        }
        Ok(())
    }

    /// Writes the statuses that changed since the last call (and deletes the ones gone).
    async fn publish_statuses(&mut self, client: &mut Client) -> SessionResult {
        let failures = self.failures.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let retiring = self.retiring.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let loading = self.loading.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let current =
            model_statuses(&self.repository.held_index(), &self.view.placement, &failures, &retiring, &loading);
        let keys = &self.options.keys;
        let id = &self.options.record.id;
        let lease = self.lease_id();
        for ((model, version), status) in &current {
            if self.published.get(&(model.clone(), *version)).map(|(written, _)| written) != Some(status) {
                // One record that cannot be written must not stop every other status (nor,
                // failing the session each time, the agent itself).
                let value = match records::encode(status) {
                    Ok(value) => value,
                    Err(e) => {
                        tracing::error!(%model, version, "status record not written: {e}");
                        continue;
                    }
                };
                let put =
                    client.put(keys.status(id, model, *version), value, Some(PutOptions::new().with_lease(lease)));
                let resp = bounded("put status", put).await?;
                self.view.seen.observe(resp.header());
                let revision = resp.header().map_or(0, |h| h.revision());
                self.published.insert((model.clone(), *version), (status.clone(), revision));
            }
        }
        let gone: Vec<(String, i64)> = self.published.keys().filter(|k| !current.contains_key(*k)).cloned().collect();
        for (model, version) in gone {
            bounded("delete status", client.delete(keys.status(id, &model, version), None::<DeleteOptions>)).await?;
            self.published.remove(&(model, version));
        }
        Ok(())
    }
}

/// The status of every model version this worker serves or was asked to serve: READY for each
/// loaded version; for a placed version not (yet) loaded, LOADING while its load runs or is
/// pending, FAILED with the load error otherwise.
fn model_statuses(
    index: &[IndexEntry],
    placement: &Placement,
    failures: &HashMap<String, String>,
    retiring: &BTreeSet<String>,
    loading: &BTreeMap<String, BTreeSet<i64>>,
) -> BTreeMap<(String, i64), StatusRecord> {
    let status = StatusRecord::new;
    let mut out = BTreeMap::new();
    for e in index {
        // A name no key can hold (a folder named with a space, loaded by hand): its status
        // would be refused by every reader, and never cleared by a later process.
        if check_name("model", &e.name).is_err() {
            continue;
        }
        // Serving out its unload grace — the whole model, or versions no longer placed (the
        // end of a roll-over): no new traffic.
        let placed = |v: &i64| placement.get(&e.name).is_some_and(|vs| vs.contains(v));
        if retiring.contains(&e.name) && e.version.parse::<i64>().map_or(true, |v| !placed(&v)) {
            continue;
        }
        // A placed model publishes its placed versions only: one it still serves beside them
        // (while it reloads without it at the end of a roll-over, after a failed reload that
        // kept the old model, or kept for an ensemble's step) is not this worker's to route to.
        if placement.contains_key(&e.name) && e.version.parse::<i64>().is_ok_and(|v| !placed(&v)) {
            continue;
        }
        match (e.version.parse::<i64>(), e.state.as_str()) {
            (Ok(v), "READY") => {
                out.insert((e.name.clone(), v), status(ModelState::Ready, ""));
            }
            // Loaded but serving nothing (an ensemble whose composing model is gone): FAILED,
            // saying why, so that placement moves it rather than wait for it as still loading.
            (Ok(v), "UNAVAILABLE") => {
                out.insert((e.name.clone(), v), status(ModelState::Failed, &e.reason));
            }
            _ => {}
        }
    }
    for (model, versions) in placement {
        let row = index.iter().find(|e| e.name == *model && e.version.is_empty());
        for v in versions {
            if out.contains_key(&(model.clone(), *v)) {
                continue;
            }
            let s = match (row.map(|r| r.state.as_str()), failures.get(model)) {
                _ if loading.get(model).is_some_and(|vs| vs.contains(v)) => status(ModelState::Loading, ""),
                // Placed anew while a load for other versions runs: its turn comes after.
                _ if loading.contains_key(model) => status(ModelState::Loading, records::PENDING_REASON),
                (Some("LOADING"), _) => status(ModelState::Loading, ""),
                // The reconciler's record of the load for this placement, not the repository's
                // row: a row left UNAVAILABLE by a failed load of an earlier placement (or at
                // start) says nothing about the load this placement waits for.
                (_, Some(reason)) => status(ModelState::Failed, reason),
                // Its load has not started: the reconciler loads a few models at a time. The
                // placement controller gives a pending load four times its load timeout.
                _ => status(ModelState::Loading, records::PENDING_REASON),
            };
            out.insert((model.clone(), *v), s);
        }
    }
    out
}

/// Applies each new placement to the repository: loads a model whose placed versions changed
/// (exactly those versions), unloads one no longer placed here. A failed load is remembered
/// (reported FAILED) and not retried until its placement changes. Up to `load_threads` models
/// load at once (the repository bounds its builds the same way); a model whose placement
/// changes while it loads is loaded again, as placed now, once that load is done.
///
/// A model no longer placed is not unloaded at once: for `grace` it keeps serving while no
/// longer published READY, so gateways whose watches have not caught up yet (and still route
/// to it) are answered instead of failed; placed again meanwhile, it simply stays.
async fn reconcile(
    repository: Arc<Repository>,
    mut desired: watch::Receiver<Option<Placement>>,
    failures: Failures,
    retiring: Retiring,
    loading: Loading,
    grace: Duration,
) {
    let limit = repository.options().load_threads.max(1);
    // What each placed model was last asked to load (loading now, or done).
    let mut applied = Placement::new();
    // Each running load says why it failed, if it did; `tasks` names their models.
    let mut loads: tokio::task::JoinSet<Option<String>> = tokio::task::JoinSet::new();
    let mut tasks: HashMap<tokio::task::Id, String> = HashMap::new();
    // Models whose placement was removed, still loaded: when they unload, and with which
    // versions. Unloads happen here, in this one task, and never for a model loading now, so a
    // re-placement and an unload of the same model can never cross.
    let mut retired: BTreeMap<String, (tokio::time::Instant, BTreeSet<i64>)> = BTreeMap::new();
    // Models placed here with fewer versions than they serve (the end of a roll-over: 1 and 2
    // placed, then 2 only): they serve on, the versions no longer placed unpublished, until the
    // instant given; then they load as placed. The same grace as a whole model's, for the same
    // gateways and for requests naming the old version.
    let mut shrinking: BTreeMap<String, tokio::time::Instant> = BTreeMap::new();
    let set_retiring = |retired: &BTreeMap<String, (tokio::time::Instant, BTreeSet<i64>)>,
                        shrinking: &BTreeMap<String, tokio::time::Instant>| {
        *retiring.lock().unwrap_or_else(|e| e.into_inner()) = retired.keys().chain(shrinking.keys()).cloned().collect();
    };
    let in_flight = || loading.lock().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect::<BTreeSet<_>>();
    // The models an ensemble's load brought in (its composing models not loaded before, and
    // not placed here): unloaded after it. A model loaded otherwise (placed, or by an
    // operator through the repository API) is never unloaded for an ensemble's sake.
    let mut brought_in: HashMap<String, BTreeSet<String>> = HashMap::new();
    let mut loaded_before: HashMap<tokio::task::Id, BTreeSet<String>> = HashMap::new();
    let loaded_names = |repository: &Repository| -> BTreeSet<String> {
        repository.held_index().into_iter().filter(|e| e.state == "READY").map(|e| e.name).collect()
    };
    loop {
        // A model whose fewer versions are due but wait for a load slot is looked at again when
        // a load ends, not by the timer (which would fire at once, again and again).
        let now = tokio::time::Instant::now();
        let shrink_due = shrinking.values().copied().filter(|at| *at > now);
        let next_unload = retired.values().map(|(at, _)| *at).chain(shrink_due).min();
        tokio::select! {
            // A new placement first: one that places a retired model again must win over its
            // unload when both are due.
            biased;
            changed = desired.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            Some(done) = loads.join_next_with_id(), if !loads.is_empty() => {
                let (id, failure) = match done {
                    Ok((id, failure)) => (id, failure),
                    // Only a panic ends a load task early (the set is never aborted while this
                    // loop runs): its model is reported failed.
                    Err(e) => (e.id(), Some(format!("the load task failed: {e}"))),
                };
                let model = tasks.remove(&id).unwrap_or_default();
                if let Some(before) = loaded_before.remove(&id) {
                    let new: BTreeSet<String> = (loaded_names(&repository).into_iter())
                        .filter(|m| *m != model && !before.contains(m))
                        .collect();
                    brought_in.entry(model.clone()).or_default().extend(new);
                }
                loading.lock().unwrap_or_else(|e| e.into_inner()).remove(&model);
                if let Some(reason) = failure {
                    tracing::warn!(%model, "placement: load failed: {reason}");
                    failures.lock().unwrap_or_else(|e| e.into_inner()).insert(model, reason);
                }
            }
            _ = tokio::time::sleep_until(next_unload.unwrap_or_else(tokio::time::Instant::now)), if next_unload.is_some() => {
                let now = tokio::time::Instant::now();
                let mut due: Vec<String> = retired.iter().filter(|(_, (at, _))| *at <= now).map(|(m, _)| m.clone()).collect();
                // Ensembles first: a composing model unloaded while its ensemble is still loaded
                // is kept (and would then stay after the ensemble goes).
                let ensembles = repository.ensembles_among(due.iter());
                due.sort_by_key(|m| !ensembles.contains(m));
                for model in due {
                    // Loaded for this ensemble, not placed here themselves: they go after it.
                    let brought = brought_in.remove(&model).unwrap_or_default();
                    // Its direct steps' models among them; all of them for an ensemble that did
                    // not load (it has no steps, yet its attempt may have loaded some).
                    let direct = repository.composing_models(&model);
                    let composing: Vec<String> = if direct.is_empty() {
                        brought.iter().cloned().collect()
                    } else {
                        direct.into_iter().filter(|c| brought.contains(c)).collect()
                    };
                    tracing::info!(%model, "placement: unloading");
                    if let Err(e) = repository.unload_placed(&model).await {
                        tracing::warn!(%model, "placement: unload failed: {}", e.message);
                    }
                    // Retiring (not published READY) until unloaded: the unload may wait on the
                    // repository's change lock while statuses are written.
                    retired.remove(&model);
                    // Kept, as a loaded ensemble composes it: it goes with that ensemble.
                    if !applied.contains_key(&model)
                        && let Some(user) = repository.ensembles_composing(&model).first()
                    {
                        brought_in.entry(user.clone()).or_default().insert(model.clone());
                    }
                    let busy = in_flight();
                    for c in composing {
                        // A nested ensemble takes what was brought in with it (its own steps'
                        // models among them), to unload after itself.
                        if !repository.composing_models(&c).is_empty() {
                            let rest = brought.iter().filter(|m| **m != c).cloned();
                            brought_in.entry(c.clone()).or_default().extend(rest);
                        }
                        // Still composed by another loaded ensemble: it goes with that one.
                        let users = repository.ensembles_composing(&c);
                        if let Some(user) = users.first() {
                            brought_in.entry(user.clone()).or_default().insert(c);
                            continue;
                        }
                        if !applied.contains_key(&c) && !busy.contains(&c) && !retired.contains_key(&c) {
                            tracing::info!(model = %c, ensemble = %model, ?grace, "placement: composing model no longer used, unloading after the grace");
                            retired.insert(c, (tokio::time::Instant::now() + grace, BTreeSet::new()));
                        }
                    }
                    set_retiring(&retired, &shrinking);
                }
                // A model whose fewer versions are due to load: the placement is looked at below.
                if !shrinking.values().any(|at| *at <= now) {
                    continue;
                }
            }
        }
        let Some(want) = desired.borrow_and_update().clone() else { continue };
        let busy = in_flight();
        // Placed again while serving out the grace: with the same versions it simply stays.
        for (model, versions) in &want {
            if let Some((_, had)) = retired.remove(model)
                && had == *versions
            {
                applied.insert(model.clone(), had);
            }
        }
        // Placed with all its versions again, or otherwise: no longer waiting to drop some.
        shrinking.retain(|m, _| {
            want.get(m).is_some_and(|vs| applied.get(m).is_some_and(|had| vs.is_subset(had) && vs != had))
        });
        set_retiring(&retired, &shrinking);
        // Ensembles load after the other models: an ensemble put in place before its composing
        // models loads them itself, under the repository's change lock (stalling every other
        // change), and their own loads then build them again.
        let ensembles = repository.ensembles_among(want.keys().chain(busy.iter()));
        let mut others_loading = busy.iter().any(|m| !ensembles.contains(m));
        let in_order = want
            .iter()
            .filter(|(m, _)| !ensembles.contains(*m))
            .chain(want.iter().filter(|(m, _)| ensembles.contains(*m)));
        for (model, versions) in in_order {
            let ensemble = ensembles.contains(model);
            if applied.get(model) == Some(versions) || busy.contains(model) {
                continue; // as placed, or loading: looked at again once that load is done
            }
            if applied.get(model).is_some_and(|had| versions.is_subset(had)) {
                let now = tokio::time::Instant::now();
                let due = *shrinking.entry(model.clone()).or_insert_with(|| {
                    tracing::info!(%model, ?versions, ?grace, "placement: fewer versions, loading them after the grace");
                    now + grace
                });
                if now < due {
                    continue;
                }
                // Due: unpublished until its load with fewer versions is under way (then the
                // load's own versions say what is published).
            }
            // Placed otherwise than when its last load failed: that failure is history.
            failures.lock().unwrap_or_else(|e| e.into_inner()).remove(model);
            if ensemble && others_loading {
                continue; // after the other models' loads (reported pending)
            }
            if loading.lock().unwrap_or_else(|e| e.into_inner()).len() >= limit {
                others_loading |= !ensemble;
                continue; // waits its turn (reported pending)
            }
            others_loading |= !ensemble;
            shrinking.remove(model);
            applied.insert(model.clone(), versions.clone());
            tracing::info!(%model, ?versions, "placement: loading");
            loading.lock().unwrap_or_else(|e| e.into_inner()).insert(model.clone(), versions.clone());
            // Loaded before it: those serving out their grace excepted (they would have gone,
            // and this load keeps them).
            let before = ensemble.then(|| {
                let mut names = loaded_names(&repository);
                names.retain(|m| !retired.contains_key(m));
                names
            });
            let (repository, name, versions) = (repository.clone(), model.clone(), versions.clone());
            let id = loads.spawn(async move { load_placed(&repository, &name, &versions).await }).id();
            tasks.insert(id, model.clone());
            if let Some(before) = before {
                loaded_before.insert(id, before);
            }
        }
        let removed: Vec<String> =
            applied.keys().filter(|m| !want.contains_key(*m) && !busy.contains(*m)).cloned().collect();
        for model in removed {
            let versions = applied.remove(&model).unwrap_or_default();
            failures.lock().unwrap_or_else(|e| e.into_inner()).remove(&model);
            tracing::info!(%model, ?grace, "placement removed: unloading after the grace");
            retired.insert(model, (tokio::time::Instant::now() + grace, versions));
        }
        set_retiring(&retired, &shrinking);
    }
}

/// Loads exactly `versions` of `model`; why that failed, if it did.
async fn load_placed(repository: &Repository, model: &str, versions: &BTreeSet<i64>) -> Option<String> {
    match repository.load_versions(model, versions.iter().copied().collect()).await {
        Err(e) => Some(e.message),
        // A `specific` load serves the versions found on disk: a placed one that is not there
        // will not come by waiting.
        Ok(()) => {
            let served: BTreeSet<i64> = repository
                .held_index()
                .iter()
                .filter(|e| e.name == model && e.state == "READY")
                .filter_map(|e| e.version.parse().ok())
                .collect();
            let missing: Vec<String> = versions.difference(&served).map(i64::to_string).collect();
            (!missing.is_empty())
                .then(|| format!("version {} of '{model}' is not in the model repository", missing.join(", ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, version: &str, state: &str, reason: &str) -> IndexEntry {
        IndexEntry { name: name.into(), version: version.into(), state: state.into(), reason: reason.into() }
    }

    /// A load error longer than a status record may carry (a config naming tensors of a model
    /// with hundreds) is cut, not refused: refused, it failed every session of the agent.
    #[test]
    fn a_long_load_error_is_cut_to_what_a_status_record_carries() {
        let index = vec![];
        let mut placement = Placement::new();
        placement.insert("m".to_string(), BTreeSet::from([1]));
        let failures = HashMap::from([("m".to_string(), "é".repeat(5000))]);
        let s = model_statuses(&index, &placement, &failures, &BTreeSet::new(), &BTreeMap::new());
        let status = &s[&("m".to_string(), 1)];
        assert_eq!(status.state, ModelState::Failed);
        assert!(status.reason.len() <= records::MAX_REASON_BYTES && status.reason.ends_with('…'));
        assert!(status.reason.starts_with("éé"));
        records::encode(status).expect("writable");
    }

    /// A model loaded under a name no key can hold (a folder with a space in it) publishes no
    /// status: every reader would refuse it, and no later process would clear it.
    #[test]
    fn a_model_whose_name_no_key_can_hold_publishes_no_status() {
        let index = vec![entry("my model", "1", "READY", ""), entry("ok", "1", "READY", "")];
        let s = model_statuses(&index, &Placement::new(), &HashMap::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(s.keys().cloned().collect::<Vec<_>>(), vec![("ok".to_string(), 1)]);
    }

    #[test]
    fn statuses_from_index_and_placement() {
        let index = vec![
            entry("a", "1", "READY", ""),
            entry("b", "", "LOADING", ""),
            entry("c", "", "UNAVAILABLE", "bad model"),
            entry("d", "", "", ""),
            entry("e", "1", "READY", "reload failed: x"),
            entry("f", "1", "UNAVAILABLE", "composing model 'g': model 'g' is not ready"),
        ];
        let placement: Placement = [
            ("a".to_string(), BTreeSet::from([1, 2])),
            ("b".to_string(), BTreeSet::from([1])),
            ("c".to_string(), BTreeSet::from([3])),
            ("d".to_string(), BTreeSet::from([1])),
            ("e".to_string(), BTreeSet::from([1, 2])),
            ("f".to_string(), BTreeSet::from([1])),
        ]
        .into();
        let failures = HashMap::from([("e".to_string(), "failed to load 'e': boom".to_string())]);
        // The reconciler is loading `a` (its version 2 next to the READY 1).
        let loading = BTreeMap::from([("a".to_string(), BTreeSet::from([1, 2]))]);
        let s = model_statuses(&index, &placement, &failures, &BTreeSet::new(), &loading);
        let show: Vec<String> =
            s.iter().map(|((m, v), r)| format!("{m}/{v}={}:{}", r.state.name(), r.reason)).collect();
        let pending = format!("d/1=LOADING:{}", records::PENDING_REASON);
        let pending_c = format!("c/3=LOADING:{}", records::PENDING_REASON);
        assert_eq!(
            show,
            vec![
                "a/1=READY:",
                "a/2=LOADING:",
                "b/1=LOADING:", // the repository says so
                &pending_c,     // UNAVAILABLE in the repository, but its load for this placement is to come
                &pending,       // not yet attempted: waits its turn
                "e/1=READY:",
                "e/2=FAILED:failed to load 'e': boom",
                // Loaded, serving nothing (its composing model is gone): FAILED, saying why.
                "f/1=FAILED:composing model 'g': model 'g' is not ready",
            ]
        );
        // Nothing loading now: `a`'s version 2 waits its turn too.
        let s = model_statuses(&index, &placement, &failures, &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(s[&("a".to_string(), 2)].reason, records::PENDING_REASON);
        // Placed anew while a load of version 1 alone runs: version 2 waits for that load.
        let loading = BTreeMap::from([("a".to_string(), BTreeSet::from([1]))]);
        let s = model_statuses(&index, &placement, &failures, &BTreeSet::new(), &loading);
        assert_eq!(s[&("a".to_string(), 2)].reason, records::PENDING_REASON);
        // A model serving out its unload grace (placement removed) is no longer READY.
        let retiring = BTreeSet::from(["a".to_string()]);
        let unplaced: Placement = placement.into_iter().filter(|(m, _)| m != "a").collect();
        let s = model_statuses(&index, &unplaced, &failures, &retiring, &BTreeMap::new());
        assert!(!s.keys().any(|(m, _)| m == "a"), "{s:?}");
        assert!(s.contains_key(&("e".to_string(), 1)));
        // The end of a roll-over, its grace over: `a` reloads with version 2 alone. Version 1,
        // still served until the swap, is not published READY again meanwhile.
        let narrowed: Placement = [("a".to_string(), BTreeSet::from([2]))].into();
        let loading = BTreeMap::from([("a".to_string(), BTreeSet::from([2]))]);
        let s = model_statuses(&index, &narrowed, &failures, &BTreeSet::new(), &loading);
        assert!(!s.contains_key(&("a".to_string(), 1)), "{s:?}");
        assert_eq!(s[&("a".to_string(), 2)].state, ModelState::Loading);
    }

    /// Polls (bounded: 30 s) until `cond` holds of `repository`; panics naming `what` and the
    /// repository's state otherwise.
    async fn until(repository: &Repository, what: &str, cond: impl Fn(&Repository) -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !cond(repository) {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}: {:?}",
                repository.held_index()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A repository over `dir` in EXPLICIT mode (what fleet placement drives), ONNX Runtime
    /// loaded.
    fn explicit_repository(dir: &std::path::Path) -> Arc<Repository> {
        crate::backend::init_runtime(&crate::backend::default_runtime_path()).expect("ONNX Runtime (scripts/setup.sh)");
        let options = crate::repository::RepositoryOptions {
            paths: vec![dir.to_path_buf()],
            mode: crate::repository::ControlMode::Explicit,
            strict_config: false,
            startup_models: vec![],
            session_defaults: Default::default(),
            load_threads: 4,
            default_max_batch_size: crate::repository::AUTOCOMPLETE_MAX_BATCH_SIZE,
            config_name: None,
        };
        Arc::new(Repository::new(options, Arc::new(crate::metrics::Metrics::new())))
    }

    /// A reconciler over `repository` with `grace`, what it shares with the agent, its task.
    struct Reconciler {
        desired: watch::Sender<Option<Placement>>,
        retiring: Retiring,
        loading: Loading,
        task: tokio::task::JoinHandle<()>,
    }

    impl Reconciler {
        fn start(repository: &Arc<Repository>, grace: Duration) -> Reconciler {
            let (desired, placements) = watch::channel(None::<Placement>);
            let (retiring, loading): (Retiring, Loading) = Default::default();
            let task = tokio::spawn(reconcile(
                repository.clone(),
                placements,
                Default::default(),
                retiring.clone(),
                loading.clone(),
                grace,
            ));
            Reconciler { desired, retiring, loading, task }
        }
    }

    /// Polls (bounded: 30 s) until `cond` holds of the retiring set; panics naming `what`.
    async fn until_retiring(retiring: &Retiring, what: &str, cond: impl Fn(&BTreeSet<String>) -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !cond(&retiring.lock().unwrap()) {
            assert!(std::time::Instant::now() < deadline, "{what}: {:?}", retiring.lock().unwrap());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A repository in explicit mode over a copy of the example ensemble and its composing
    /// model (the folder lives as long as the first value).
    fn ensemble_repository() -> (tempfile::TempDir, Arc<Repository>) {
        let dir = tempfile::tempdir().unwrap();
        for model in ["versioned_scale", "scale_ensemble"] {
            copy_example(dir.path(), model);
        }
        let repository = explicit_repository(dir.path());
        (dir, repository)
    }

    /// The models with a READY version.
    fn ready_models(repository: &Repository) -> BTreeSet<String> {
        repository.held_index().into_iter().filter(|e| e.state == "READY").map(|e| e.name).collect()
    }

    /// Copies an example model (its config, version folders and files) into `repo`.
    fn copy_example(repo: &std::path::Path, name: &str) {
        let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models").join(name);
        let copy = std::process::Command::new("cp").arg("-r").arg(&from).arg(repo.join(name)).status().unwrap();
        assert!(copy.success(), "cp {}", from.display());
    }

    /// An ensemble placed together with its composing model loads after it: loaded first, it
    /// would build the composing model itself under the repository's change lock, and that
    /// model's own load would build it again — four builds instead of two.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_ensemble_placed_with_its_composing_model_loads_after_it() {
        let dir = tempfile::tempdir().unwrap();
        for model in ["versioned_scale", "scale_ensemble"] {
            copy_example(dir.path(), model);
        }
        assert!(dir.path().join("versioned_scale/2/model.onnx").is_file(), "run scripts/setup.sh (example models)");
        let repository = explicit_repository(dir.path());
        let Reconciler { desired, retiring: _, loading, task: reconciler } =
            Reconciler::start(&repository, Duration::from_secs(60));
        let placement: Placement = [
            ("scale_ensemble".to_string(), BTreeSet::from([1])),
            ("versioned_scale".to_string(), BTreeSet::from([1, 2])),
        ]
        .into();
        desired.send(Some(placement)).unwrap();
        until(&repository, "all READY, no load running", |r| {
            let ready: BTreeSet<(String, String)> =
                r.held_index().into_iter().filter(|e| e.state == "READY").map(|e| (e.name, e.version)).collect();
            let all = [("scale_ensemble", "1"), ("versioned_scale", "1"), ("versioned_scale", "2")];
            all.iter().all(|(m, v)| ready.contains(&(m.to_string(), v.to_string())))
                && loading.lock().unwrap().is_empty()
        })
        .await;
        assert_eq!(repository.builds_started(), 2, "one build per model");
        reconciler.abort();
    }

    /// Both taken away at once, an ensemble and its composing model are both unloaded after the
    /// grace, whatever their names' order: the ensemble goes first (a composing model unloaded
    /// while its ensemble is loaded is kept, and would have stayed for good).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_ensemble_and_its_composing_model_removed_together_both_unload() {
        let dir = tempfile::tempdir().unwrap();
        for model in ["versioned_scale", "scale_ensemble"] {
            copy_example(dir.path(), model);
        }
        // The composing model renamed to sort before the ensemble.
        std::fs::rename(dir.path().join("versioned_scale"), dir.path().join("a_scale")).unwrap();
        for config in ["a_scale/config.pbtxt", "scale_ensemble/config.pbtxt"] {
            let path = dir.path().join(config);
            let text = std::fs::read_to_string(&path).unwrap().replace("versioned_scale", "a_scale");
            std::fs::write(&path, text).unwrap();
        }
        let repository = explicit_repository(dir.path());
        let Reconciler { desired, retiring: _, loading: _, task: reconciler } =
            Reconciler::start(&repository, Duration::from_millis(10));
        let ready = ready_models;
        let placement: Placement =
            [("scale_ensemble".to_string(), BTreeSet::from([1])), ("a_scale".to_string(), BTreeSet::from([1, 2]))]
                .into();
        desired.send(Some(placement)).unwrap();
        until(&repository, "both READY", |r| ready(r).len() == 2).await;
        desired.send(Some(Placement::new())).unwrap();
        until(&repository, "both unloaded", |r| ready(r).is_empty()).await;
        reconciler.abort();
    }

    /// The end of a roll-over (1 and 2 placed, then 2 only): version 1 serves on, unpublished,
    /// for the grace — gateways that have not caught up, and requests naming it, are answered —
    /// and is dropped only then; placed again meanwhile, it simply stays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_version_no_longer_placed_serves_out_the_grace_unpublished() {
        let dir = tempfile::tempdir().unwrap();
        copy_example(dir.path(), "versioned_scale");
        let repository = explicit_repository(dir.path());
        let ready = |repository: &Repository| -> BTreeSet<String> {
            let index = repository.held_index().into_iter();
            index.filter(|e| e.state == "READY").map(|e| e.version).collect()
        };
        let placed = |versions: &[i64]| -> Placement {
            [("versioned_scale".to_string(), versions.iter().copied().collect())].into()
        };
        for grace in [Duration::from_secs(600), Duration::from_millis(10)] {
            let Reconciler { desired, retiring, loading: _, task: reconciler } = Reconciler::start(&repository, grace);
            desired.send(Some(placed(&[1, 2]))).unwrap();
            until(&repository, "versions 1 and 2 READY", |r| ready(r).len() == 2).await;
            desired.send(Some(placed(&[2]))).unwrap();
            if grace > Duration::from_secs(1) {
                until_retiring(&retiring, "version 1 retiring", |r| !r.is_empty()).await;
                assert_eq!(ready(&repository).len(), 2, "version 1 still serves within the grace");
                let statuses = model_statuses(
                    &repository.held_index(),
                    &placed(&[2]),
                    &HashMap::new(),
                    &retiring.lock().unwrap(),
                    &BTreeMap::new(),
                );
                let published: Vec<i64> = statuses.keys().map(|(_, v)| *v).collect();
                assert_eq!(published, [2], "only the placed version is published READY");
                // Placed again: no longer retiring, both still serve.
                desired.send(Some(placed(&[1, 2]))).unwrap();
                until_retiring(&retiring, "no longer retiring", BTreeSet::is_empty).await;
                assert_eq!(ready(&repository).len(), 2);
            } else {
                until(&repository, "version 1 dropped after the grace", |r| {
                    ready(r) == BTreeSet::from(["2".to_string()])
                })
                .await;
            }
            reconciler.abort();
        }
    }

    /// A composing model placed first, then unplaced while an ensemble placed later still
    /// composes it, is kept for that ensemble — and unloaded after it once the ensemble's
    /// placement goes too, rather than left loaded (and published READY) for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_composing_model_kept_for_an_ensemble_goes_with_it() {
        let (_dir, repository) = ensemble_repository();
        let Reconciler { desired, retiring, loading: _, task: reconciler } =
            Reconciler::start(&repository, Duration::from_secs(1));
        let ready = ready_models;
        let composing = ("versioned_scale".to_string(), BTreeSet::from([1, 2]));
        let ensemble = ("scale_ensemble".to_string(), BTreeSet::from([1]));
        desired.send(Some([composing.clone()].into())).unwrap();
        until(&repository, "versioned_scale READY", |r| ready(r).contains("versioned_scale")).await;
        desired.send(Some([composing, ensemble.clone()].into())).unwrap();
        until(&repository, "both READY", |r| ready(r).len() == 2).await;
        // versioned_scale unplaced: it serves out its grace, then is kept (the ensemble uses it).
        desired.send(Some([ensemble].into())).unwrap();
        until_retiring(&retiring, "versioned_scale retiring", |r| r.contains("versioned_scale")).await;
        until_retiring(&retiring, "its unload tried", BTreeSet::is_empty).await;
        assert_eq!(ready(&repository).len(), 2, "kept for the ensemble");
        // The ensemble goes: versioned_scale after it.
        desired.send(Some(Placement::new())).unwrap();
        until(&repository, "both unloaded", |r| ready(r).is_empty()).await;
        reconciler.abort();
    }

    /// An ensemble placed without its composing model loads that model itself; once the
    /// ensemble's placement is removed, the composing model (placed nowhere here) is unloaded
    /// after it rather than left loaded, and published READY, for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_composing_model_loaded_only_for_its_ensemble_unloads_after_it() {
        let (_dir, repository) = ensemble_repository();
        let Reconciler { desired, retiring, loading: _, task: reconciler } =
            Reconciler::start(&repository, Duration::from_millis(10));
        let ready = ready_models;
        desired.send(Some([("scale_ensemble".to_string(), BTreeSet::from([1]))].into())).unwrap();
        until(&repository, "the ensemble and its composing model READY", |r| ready(r).len() == 2).await;
        desired.send(Some(Placement::new())).unwrap();
        until(&repository, "both unloaded", |r| ready(r).is_empty()).await;
        until_retiring(&retiring, "nothing retiring", BTreeSet::is_empty).await;
        // A composing model that was loaded before the ensemble (here by hand, through the
        // repository API) is not the ensemble's to unload: it stays.
        repository.load("versioned_scale", None).await.unwrap();
        desired.send(Some([("scale_ensemble".to_string(), BTreeSet::from([1]))].into())).unwrap();
        until(&repository, "the ensemble READY", |r| ready(r).len() == 2).await;
        desired.send(Some(Placement::new())).unwrap();
        until(&repository, "the ensemble unloaded", |r| !ready(r).contains("scale_ensemble")).await;
        // The ensemble leaves the retiring set in the same step that would have put its
        // composing model there: once it has, versioned_scale was not retired, and stays.
        until_retiring(&retiring, "the ensemble's unload done", |r| !r.contains("scale_ensemble")).await;
        assert!(!retiring.lock().unwrap().contains("versioned_scale"));
        assert_eq!(ready(&repository), BTreeSet::from(["versioned_scale".to_string()]));
        reconciler.abort();
    }
}
