//! The routing table: an immutable snapshot of the members and of the model versions each
//! holds, swapped whole whenever membership publishes a new one. Readers take an `Arc` of the
//! current snapshot and never wait on whoever builds the next one (the request path never waits
//! on discovery or, later, on etcd).
//!
//! Workers that are *ready* (not draining, reachable) route traffic, and only to versions they
//! report READY. A version READY on no ready worker falls back to the workers that answer but
//! are not ready — draining, or still loading other models — and still list it READY: a worker
//! keeps serving while it drains, and sending it the traffic beats failing every request until
//! a replacement has loaded (make before break). A model no member lists at all, and that is not
//! declared in etcd either, is unknown (NOT_FOUND); a model known but READY nowhere is
//! UNAVAILABLE.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nereid_proto::inference::repository_index_response::ModelIndex;
use tokio::sync::watch;

use crate::upstream::Upstream;

/// Metrics label of a model that is not in the routing table.
pub const UNKNOWN_MODEL_LABEL: &str = "_unknown";

/// What membership last observed about one worker.
#[derive(Clone, Debug)]
pub struct WorkerView {
    pub upstream: Arc<Upstream>,
    pub state: WorkerState,
    /// Its repository index (every model and version, any state).
    pub models: Vec<ModelIndex>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerState {
    /// Answers and reports itself ready: routes traffic.
    Ready,
    /// Answers but is not ready (starting, or draining): no new traffic.
    NotReady,
    /// Did not answer the last poll (or, later, lost its etcd lease).
    Unreachable,
}

impl WorkerState {
    pub fn label(self) -> &'static str {
        match self {
            WorkerState::Ready => "ready",
            WorkerState::NotReady => "not_ready",
            WorkerState::Unreachable => "unreachable",
        }
    }
}

/// Why a request has nowhere to go.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("model '{model}' is not found on any worker")]
    ModelNotFound { model: String },
    #[error("model '{model}' has no version '{version}' on any worker")]
    VersionNotFound { model: String, version: i64 },
    #[error("no worker has model '{model}'{} ready", version.map(|v| format!(" version {v}")).unwrap_or_default())]
    NoReadyWorker { model: String, version: Option<i64> },
}

#[derive(Debug, Default)]
struct ModelRoutes {
    /// Indices (into `workers`) of the ready workers holding each version READY.
    ready: BTreeMap<i64, Vec<usize>>,
    /// Indices of the not-ready (e.g. draining) workers that still hold each version READY: the
    /// last resort for a version no ready worker holds.
    fallback: BTreeMap<i64, Vec<usize>>,
    /// Every version some member lists, in any state.
    known_versions: BTreeSet<i64>,
    /// What its etcd declaration asks for, if declared.
    declared: Option<Declared>,
}

/// A model's declaration in etcd, as routing needs it: the versions to serve and the replicas
/// each is to have.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Declared {
    pub versions: Vec<i64>,
    pub replicas: u32,
    /// The version the previous table sent requests naming no version to: one still declared
    /// and READY keeps them when another version is retired (a model redeclared from [1, 2]
    /// to [2] while 2 is short of replicas must not send them back to 1).
    pub serving: Option<i64>,
}

impl ModelRoutes {
    /// Whether some member lists `version`, or etcd declares it: a request for it is then
    /// UNAVAILABLE while nobody serves it (it is being loaded or moved), not NOT_FOUND.
    fn knows_version(&self, version: i64) -> bool {
        self.known_versions.contains(&version) || self.declared.as_ref().is_some_and(|d| d.versions.contains(&version))
    }

    /// The version a request naming none goes to: the newest READY on a ready worker, else on
    /// a not-ready one — what a single Triton serving every version answers such a request with
    /// (a fleet serving versions 1 and 2 on different workers must not answer half of them
    /// with 1). Except during a roll-over of a model declared in etcd — a version it no longer
    /// declares still READY on a ready worker, which placement keeps until every replica of the
    /// declared versions is READY (make before break): then the newest declared version READY
    /// on as many ready workers as the declaration's replicas, else the declared version that
    /// was serving such requests if it still is READY, else the newest retired one — so the
    /// first READY replica of a new version does not take every such request off the old
    /// version's full set, and retiring an old version never sends them back to it.
    fn unversioned(&self) -> Option<i64> {
        if let Some(declared) = &self.declared {
            let newest_ready = |wanted: &dyn Fn(i64, usize) -> bool| {
                self.ready.iter().rev().find(|(v, h)| !h.is_empty() && wanted(**v, h.len())).map(|(v, _)| *v)
            };
            let is_declared = |v: i64| declared.versions.contains(&v);
            if let Some(retired) = newest_ready(&|v, _| !is_declared(v)) {
                let replicas = declared.replicas.max(1) as usize;
                let serving =
                    declared.serving.filter(|&v| is_declared(v) && self.ready.get(&v).is_some_and(|h| !h.is_empty()));
                return Some(
                    newest_ready(&|v, holders| is_declared(v) && holders >= replicas).or(serving).unwrap_or(retired),
                );
            }
        }
        let newest = |map: &BTreeMap<i64, Vec<usize>>| map.iter().rev().find(|(_, h)| !h.is_empty()).map(|(v, _)| *v);
        newest(&self.ready).or_else(|| newest(&self.fallback))
    }
}

/// Where a request for one model version may go.
#[derive(Debug)]
pub struct Route<'a> {
    /// The version resolved (see [`ModelRoutes::unversioned`] when the request named none).
    pub version: i64,
    /// Indices of the workers holding it READY (see [`RoutingTable::upstream`]).
    pub holders: &'a [usize],
    /// Not-ready workers that still list it READY (draining), for when every one of
    /// `holders` is excluded (a retry) or ejected; empty when `holders` are those already.
    pub fallback: &'a [usize],
}

#[derive(Debug)]
pub struct RoutingTable {
    built_at: Instant,
    workers: Vec<WorkerView>,
    models: HashMap<String, ModelRoutes>,
}

impl RoutingTable {
    /// The table before anything was discovered: no workers, no models.
    pub fn empty(now: Instant) -> Self {
        RoutingTable { built_at: now, workers: Vec::new(), models: HashMap::new() }
    }

    /// Builds a snapshot from what membership observed at `built_at`.
    pub fn build(workers: Vec<WorkerView>, built_at: Instant) -> Self {
        let mut models: HashMap<String, ModelRoutes> = HashMap::new();
        for (i, w) in workers.iter().enumerate() {
            for m in &w.models {
                let routes = models.entry(m.name.clone()).or_default();
                let Ok(version) = m.version.parse::<i64>() else {
                    continue; // A model without a loaded version: known, not routable.
                };
                routes.known_versions.insert(version);
                let holders = match w.state {
                    _ if m.state != "READY" => continue,
                    WorkerState::Ready => routes.ready.entry(version).or_default(),
                    WorkerState::NotReady => routes.fallback.entry(version).or_default(),
                    WorkerState::Unreachable => continue,
                };
                // Workers come in order: a duplicate can only be this worker's own (a model
                // listed twice), so the last entry is the only one to compare with.
                if holders.last() != Some(&i) {
                    holders.push(i);
                }
            }
        }
        RoutingTable { built_at, workers, models }
    }

    /// The table, with `declared` (models declared in etcd) known even where no member lists
    /// them yet or any more: a request for one is UNAVAILABLE (it is coming, or being moved),
    /// not NOT_FOUND — which clients take as final. The declarations decide where requests
    /// naming no version go during a roll-over (see [`RoutingTable::resolve`]).
    pub fn with_declared<I: IntoIterator<Item = (String, Declared)>>(mut self, declared: I) -> Self {
        for (model, declaration) in declared {
            self.models.entry(model).or_default().declared = Some(declaration);
        }
        self
    }

    /// The versions of `model` that route (READY on a ready worker, or only on not-ready ones),
    /// ascending.
    pub fn routable_versions(&self, model: &str) -> Vec<i64> {
        let Some(routes) = self.models.get(model) else { return Vec::new() };
        let held = |map: &BTreeMap<i64, Vec<usize>>| {
            map.iter().filter(|(_, h)| !h.is_empty()).map(|(v, _)| *v).collect::<Vec<_>>()
        };
        let mut versions: BTreeSet<i64> = held(&routes.ready).into_iter().collect();
        versions.extend(held(&routes.fallback));
        versions.into_iter().collect()
    }

    /// Where `model` (`version`, or with none [`ModelRoutes::unversioned`]'s) may be served: on ready workers, else
    /// on the fallback (not-ready) holders.
    pub fn resolve(&self, model: &str, version: Option<i64>) -> Result<Route<'_>, RouteError> {
        let routes = self.models.get(model).ok_or_else(|| RouteError::ModelNotFound { model: model.to_string() })?;
        let holding = |map: &'_ BTreeMap<i64, Vec<usize>>, v: i64| map.get(&v).filter(|h| !h.is_empty()).is_some();
        let fallback_of = |v: i64| routes.fallback.get(&v).map_or(&[][..], Vec::as_slice);
        let version = match version {
            Some(v) if holding(&routes.ready, v) || holding(&routes.fallback, v) => v,
            Some(v) if routes.knows_version(v) => {
                return Err(RouteError::NoReadyWorker { model: model.to_string(), version: Some(v) });
            }
            Some(v) => return Err(RouteError::VersionNotFound { model: model.to_string(), version: v }),
            None => routes
                .unversioned()
                .ok_or_else(|| RouteError::NoReadyWorker { model: model.to_string(), version: None })?,
        };
        Ok(match routes.ready.get(&version).filter(|h| !h.is_empty()) {
            Some(holders) => Route { version, holders, fallback: fallback_of(version) },
            None => Route { version, holders: fallback_of(version), fallback: &[] },
        })
    }

    /// The worker at `index` (from a [`Route`]).
    pub fn upstream(&self, index: usize) -> &Arc<Upstream> {
        &self.workers[index].upstream
    }

    pub fn workers(&self) -> &[WorkerView] {
        &self.workers
    }

    /// Ready when at least one worker routes at least one model version.
    pub fn ready(&self) -> bool {
        self.models.values().any(|m| m.ready.values().any(|h| !h.is_empty()))
    }

    /// Whether `model` is known to any member (in any state).
    pub fn knows(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    /// The bounded metrics label for a model name: itself when the table knows it.
    pub fn model_label<'a>(&self, model: &'a str) -> &'a str {
        if self.knows(model) { model } else { UNKNOWN_MODEL_LABEL }
    }

    /// The bounded metrics label for the version of `model` a request for `version` goes to:
    /// the version named when the table knows it for that model; with none named, the one
    /// [`RoutingTable::resolve`] picks (see [`ModelRoutes::unversioned`]), which the forwarded
    /// request is pinned to. Empty only when no version can be resolved (the model is unknown
    /// or READY nowhere, or the version named is one nobody has).
    pub fn version_label(&self, model: &str, version: Option<i64>) -> String {
        match (self.models.get(model), version) {
            (Some(routes), Some(v)) if routes.knows_version(v) => v.to_string(),
            (Some(_), None) => self.resolve(model, None).map(|r| r.version.to_string()).unwrap_or_default(),
            _ => String::new(),
        }
    }

    /// The union of the members' repository indexes: one row per (model, version), READY when
    /// any ready worker has it READY, else the state some member reports.
    pub fn index(&self, ready_only: bool) -> Vec<ModelIndex> {
        let mut rows: BTreeMap<(String, String), ModelIndex> = BTreeMap::new();
        for w in &self.workers {
            for m in &w.models {
                let routable = w.state == WorkerState::Ready && m.state == "READY";
                let key = (m.name.clone(), m.version.clone());
                match rows.get_mut(&key) {
                    Some(row) if row.state != "READY" && routable => *row = m.clone(),
                    Some(_) => {}
                    None => {
                        let mut row = m.clone();
                        if m.state == "READY" && !routable {
                            row.state = "UNAVAILABLE".into();
                            row.reason = format!("worker {} is {}", w.upstream.id, w.state.label().replace('_', " "));
                        }
                        rows.insert(key, row);
                    }
                }
            }
        }
        // A versionless row ("not loaded") is dropped when some version of the model is listed.
        let versioned: BTreeSet<String> = rows.keys().filter(|(_, v)| !v.is_empty()).map(|(n, _)| n.clone()).collect();
        rows.into_iter()
            .filter(|((n, v), _)| !(v.is_empty() && versioned.contains(n)))
            .map(|(_, row)| row)
            .filter(|row| !ready_only || row.state == "READY")
            .collect()
    }

    pub fn age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.built_at)
    }
}

/// The read side: the current snapshot, without waiting. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Routes(watch::Receiver<Arc<RoutingTable>>);

/// The write side, held by the membership task.
#[derive(Debug)]
pub struct RoutesPublisher(watch::Sender<Arc<RoutingTable>>);

/// A publisher with the empty table, and its reader.
pub fn routes(now: Instant) -> (RoutesPublisher, Routes) {
    let (tx, rx) = watch::channel(Arc::new(RoutingTable::empty(now)));
    (RoutesPublisher(tx), Routes(rx))
}

impl Routes {
    /// The current snapshot (an `Arc` clone under a short read lock).
    pub fn snapshot(&self) -> Arc<RoutingTable> {
        self.0.borrow().clone()
    }
}

impl RoutesPublisher {
    /// Makes `table` the current snapshot for every reader.
    pub fn publish(&self, table: RoutingTable) {
        self.0.send_replace(Arc::new(table));
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::OutlierConfig;

    pub fn row(name: &str, version: &str, state: &str) -> ModelIndex {
        ModelIndex { name: name.into(), version: version.into(), state: state.into(), reason: String::new() }
    }

    pub fn view(addr: &str, state: WorkerState, models: Vec<ModelIndex>) -> WorkerView {
        WorkerView { upstream: Arc::new(Upstream::new(addr, OutlierConfig::default()).unwrap()), state, models }
    }

    #[tokio::test]
    async fn resolution_and_index() {
        let t = RoutingTable::build(
            vec![
                view(
                    "a:1",
                    WorkerState::Ready,
                    vec![row("m", "1", "READY"), row("m", "2", "READY"), row("x", "", "UNAVAILABLE")],
                ),
                view("b:1", WorkerState::Ready, vec![row("m", "1", "READY"), row("m", "3", "LOADING")]),
                view("c:1", WorkerState::NotReady, vec![row("m", "2", "READY"), row("d", "1", "READY")]),
            ],
            Instant::now(),
        );
        assert!(t.ready());
        // None named: the latest READY version (3 is only loading), on its holders only — b
        // holds only version 1, and a request naming no version is not answered by it.
        let r = t.resolve("m", None).unwrap();
        assert_eq!((r.version, r.holders, r.fallback), (2, &[0usize][..], &[2usize][..]));
        assert_eq!(t.resolve("m", Some(1)).unwrap().holders, &[0, 1]);
        assert_eq!(
            t.resolve("m", Some(3)).unwrap_err(),
            RouteError::NoReadyWorker { model: "m".into(), version: Some(3) }
        );
        assert_eq!(t.resolve("m", Some(9)).unwrap_err(), RouteError::VersionNotFound { model: "m".into(), version: 9 });
        assert_eq!(t.resolve("nope", None).unwrap_err(), RouteError::ModelNotFound { model: "nope".into() });
        // READY only on a not-ready (draining) worker: it serves as the last resort...
        let r = t.resolve("d", None).unwrap();
        assert_eq!((r.version, r.holders), (1, &[2usize][..]));
        assert_eq!(t.resolve("d", Some(1)).unwrap().holders, &[2]);
        // ... but never while a ready worker holds the version: version 2 stays on a alone.
        assert_eq!(t.resolve("m", Some(2)).unwrap().holders, &[0]);
        assert_eq!(t.resolve("x", None).unwrap_err(), RouteError::NoReadyWorker { model: "x".into(), version: None });
        assert_eq!(t.model_label("m"), "m");
        assert_eq!(t.model_label("nope"), UNKNOWN_MODEL_LABEL);
        assert_eq!(t.version_label("m", Some(3)), "3");
        assert_eq!(t.version_label("m", Some(99)), "");
        // None named: the version it resolves to (not 3, only loading); empty when none does.
        assert_eq!(t.version_label("m", None), "2");
        assert_eq!(t.version_label("d", None), "1");
        assert_eq!(t.version_label("x", None), "");
        assert_eq!(t.version_label("nope", None), "");
        assert_eq!(t.version_label("nope", Some(1)), "");

        let index: Vec<(String, String, String)> =
            t.index(false).into_iter().map(|r| (r.name, r.version, r.state)).collect();
        assert_eq!(
            index,
            vec![
                ("d".into(), "1".into(), "UNAVAILABLE".into()),
                ("m".into(), "1".into(), "READY".into()),
                ("m".into(), "2".into(), "READY".into()),
                ("m".into(), "3".into(), "LOADING".into()),
                ("x".into(), "".into(), "UNAVAILABLE".into()),
            ]
        );
        let ready: Vec<String> = t.index(true).into_iter().map(|r| format!("{}/{}", r.name, r.version)).collect();
        assert_eq!(ready, vec!["m/1", "m/2"]);
    }

    #[tokio::test]
    async fn fallback_holders_and_declared_models() {
        let t = RoutingTable::build(
            vec![
                view("a:1", WorkerState::Ready, vec![row("m", "1", "READY")]),
                view("b:1", WorkerState::NotReady, vec![row("m", "2", "READY"), row("m", "3", "LOADING")]),
                view("c:1", WorkerState::Unreachable, vec![row("m", "4", "READY"), row("u", "1", "READY")]),
            ],
            Instant::now(),
        )
        .with_declared([
            ("declared".to_string(), Declared { versions: vec![1], replicas: 1, serving: None }),
            ("m".to_string(), Declared { versions: vec![1, 2, 3, 4], replicas: 1, serving: None }),
        ]);
        // None named: the latest version on a ready worker wins over a later one only a draining
        // worker holds; named, the draining worker serves it.
        assert_eq!(t.resolve("m", None).unwrap().version, 1);
        assert_eq!(t.resolve("m", Some(2)).unwrap().holders, &[1]);
        assert!(matches!(t.resolve("m", Some(3)), Err(RouteError::NoReadyWorker { .. })));
        // An unreachable worker is never a fallback.
        assert!(matches!(t.resolve("m", Some(4)), Err(RouteError::NoReadyWorker { .. })));
        assert!(matches!(t.resolve("u", None), Err(RouteError::NoReadyWorker { .. })));
        // Declared but listed by no member: unavailable (coming), not unknown; a label of its own.
        assert_eq!(
            t.resolve("declared", None).unwrap_err(),
            RouteError::NoReadyWorker { model: "declared".into(), version: None }
        );
        assert_eq!(t.model_label("declared"), "declared");
        assert!(matches!(t.resolve("other", None), Err(RouteError::ModelNotFound { .. })));
        // So is a declared version no member lists (its holder died; or it is not loading yet),
        // with its own version label; a version neither listed nor declared is unknown.
        assert_eq!(
            t.resolve("declared", Some(1)).unwrap_err(),
            RouteError::NoReadyWorker { model: "declared".into(), version: Some(1) }
        );
        assert_eq!(t.version_label("declared", Some(1)), "1");
        assert!(matches!(t.resolve("declared", Some(2)), Err(RouteError::VersionNotFound { .. })));
        assert_eq!(t.version_label("declared", Some(2)), "");
        // Only a draining worker holds m 2: the table alone is ready through a.
        assert!(t.ready());
        let draining_only =
            RoutingTable::build(vec![view("b:1", WorkerState::NotReady, vec![row("m", "2", "READY")])], Instant::now());
        assert!(!draining_only.ready(), "a gateway whose only holders drain is not ready for new clients");
        assert_eq!(draining_only.resolve("m", None).unwrap().holders, &[0]);
    }

    /// A request naming no version, during a roll-over of a model declared with two replicas
    /// from version 1 to 2: version 1 until version 2 is READY on two ready workers. Outside a
    /// roll-over (no retired version READY), the newest READY version, as before.
    #[tokio::test]
    async fn requests_naming_no_version_move_to_a_new_version_once_its_replicas_are_ready() {
        let m = |versions: &[&str]| versions.iter().map(|v| row("m", v, "READY")).collect::<Vec<_>>();
        let fleet = |b: &[&str], c: &[&str]| {
            vec![
                view("a:1", WorkerState::Ready, m(&["1", "2"])),
                view("b:1", WorkerState::Ready, m(b)),
                view("c:1", WorkerState::Ready, m(c)),
            ]
        };
        let unversioned = |views, declared: Option<(&[i64], u32)>| {
            let t = RoutingTable::build(views, Instant::now());
            let t = match declared {
                Some((versions, replicas)) => {
                    let d = Declared { versions: versions.to_vec(), replicas, serving: None };
                    t.with_declared([("m".to_string(), d)])
                }
                None => t,
            };
            let r = t.resolve("m", None).unwrap();
            (r.version, r.holders.to_vec(), t.version_label("m", None))
        };
        let rolling: &[i64] = &[2];
        // One replica of 2 READY (a), two of 1 (a, b): 1, on both.
        assert_eq!(unversioned(fleet(&["1"], &[]), Some((rolling, 2))), (1, vec![0, 1], "1".into()));
        // Two of 2 READY: 2, on them.
        assert_eq!(unversioned(fleet(&["1"], &["2"]), Some((rolling, 2))), (2, vec![0, 2], "2".into()));
        // Not declared (static discovery), or declared with one replica: the newest at once.
        assert_eq!(unversioned(fleet(&["1"], &[]), None).0, 2);
        assert_eq!(unversioned(fleet(&["1"], &[]), Some((rolling, 1))).0, 2);
        // Rolled back from 2 to 1: 2 until 1 is READY on the replicas asked for.
        assert_eq!(unversioned(fleet(&[], &[]), Some((&[1], 2))).0, 2);
        assert_eq!(unversioned(fleet(&["1"], &[]), Some((&[1], 2))).0, 1);
        // Both declared, 2 short of replicas (a holder draining, a load failed, no room): no
        // roll-over, the newest.
        assert_eq!(unversioned(fleet(&["1"], &[]), Some((&[1, 2], 2))).0, 2);
        // Redeclared from [1, 2] to [2] while 2 is short of replicas (b draining): 2 was serving
        // and still is READY, so it keeps serving; only without that memory would 1 take over.
        let short = || {
            vec![
                view("a:1", WorkerState::Ready, m(&["2"])),
                view("b:1", WorkerState::NotReady, m(&["2"])),
                view("c:1", WorkerState::Ready, m(&["1"])),
                view("d:1", WorkerState::Ready, m(&["1"])),
            ]
        };
        let retiring = |serving| {
            let d = Declared { versions: vec![2], replicas: 2, serving };
            RoutingTable::build(short(), Instant::now())
                .with_declared([("m".to_string(), d)])
                .resolve("m", None)
                .unwrap()
                .version
        };
        assert_eq!(retiring(Some(2)), 2);
        assert_eq!(retiring(None), 1);
        // A serving version that is itself retired (a roll-over from 1) does not stick.
        assert_eq!(retiring(Some(1)), 1);
        // Version 1 retired and gone (placement removed it once 2 was READY everywhere): 2.
        let retired = vec![view("a:1", WorkerState::Ready, m(&["2"])), view("b:1", WorkerState::Ready, m(&["2"]))];
        assert_eq!(unversioned(retired, Some((rolling, 2))).0, 2);
        // Only draining workers hold the model: the newest they hold.
        let draining = vec![view("a:1", WorkerState::NotReady, m(&["1", "2"]))];
        assert_eq!(unversioned(draining, Some((rolling, 2))).0, 2);
        // The versions a request naming none may be told of: those that route.
        let t = RoutingTable::build(fleet(&["1"], &["3"]), Instant::now());
        assert_eq!(t.routable_versions("m"), [1, 2, 3]);
        assert!(t.routable_versions("nope").is_empty());
    }

    #[tokio::test]
    async fn empty_table_is_not_ready() {
        let t = RoutingTable::empty(Instant::now());
        assert!(!t.ready());
        let t = RoutingTable::build(vec![view("a:1", WorkerState::Unreachable, vec![])], Instant::now());
        assert!(!t.ready());
    }
}
