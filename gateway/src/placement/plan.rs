//! The placement plan: a pure function from the fleet state to the set of (worker, model,
//! version) assignments that should exist.
//!
//! - Every declared version gets `replicas` workers, at most one replica per worker.
//! - Only *active* workers (registered, not draining, not drained) are given replicas.
//! - Capacity: a worker's `memory_mb` (when non-zero) bounds the sum of its assignments'
//!   `resources.memory_mb`; `max_models` (when non-zero) bounds their count.
//! - Stability: an existing assignment stays while it is valid (its worker active, the version
//!   still declared, its load not FAILED), so a re-plan moves nothing that works — even where a
//!   worker's declared capacity shrank (or a model's `memory_mb` grew) under it: as a
//!   Kubernetes node's allocatable shrinking evicts no running pod, nothing is unloaded for a
//!   declaration; [`overcommitted`] reports such workers (a metric and a warning), and nothing
//!   new goes to them.
//! - Hand-over, make before break: a READY replica on a worker that is draining or drained (still
//!   registered), or on an active worker that no longer matches the model's `selector`, is
//!   replaced on an active matching worker, but its own assignment stays until the replacement is
//!   READY — removing it first would leave a `replicas: 1` model with no READY holder for as long
//!   as the replacement loads (and narrowing a selector would take every replica down at once).
//!   Such a replica holds no slot (its replacement is placed as if it were gone); on a draining or
//!   drained worker it uses no active worker's capacity, on an active one it still counts against
//!   that worker's (it is loaded there). At most one stays per replacement still loading. Only a
//!   READY one is kept (one still loading serves nobody).
//! - Last resort: when a version has no READY replica on any active matching worker and none can
//!   be placed (no room, no other worker), a worker drained by the operator (`drain/<w>`) or no
//!   longer matching the selector keeps one READY replica of it, until a replacement is READY —
//!   draining the last holder or narrowing a selector never takes a model offline. A worker
//!   draining itself does not: it is exiting, there is nothing to wait for. With another READY
//!   replica on an active matching worker, such a replica goes even if its replacement cannot be
//!   placed (reported unplaced).
//! - Version roll-over, make before break: when a model's declaration drops a version (redeclared
//!   from `--versions 1` to `--versions 2`), its READY replicas on active workers stay while
//!   replicas of the declared versions are placed but not yet READY, or are missing because
//!   their loads failed (a broken new version does not take the model down), charged to their
//!   workers' capacity meanwhile; they go once every new replica is READY. (When the new
//!   version is missing only for lack of room, they go at once, freeing their room for it:
//!   break before make, as a Deployment's maxUnavailable.)
//! - Vanished workers: a worker whose registration disappeared (its lease expired: a GC pause, a
//!   network blip longer than its TTL) usually re-registers moments later with its models still
//!   loaded. For workers that vanished less than a grace period ago (the caller's `vanished`),
//!   placements are not deleted at once: their replacements are placed as if they were gone
//!   (they hold no slot and use no capacity), but the keys stay while the version has fewer
//!   READY replicas on active matching workers than declared, at most one per missing READY
//!   replica. A worker back within the grace finds its placements and reports them READY again;
//!   keeping READY replicas first, the next plan drops the surplus replacement still loading.
//!   Nothing routes to an unregistered worker, so keeping its keys meanwhile is harmless.
//! - Surplus: where a version has more valid assignments than `replicas`, those kept are the
//!   READY ones first, then those whose worker has published no status for them, then those
//!   still loading (see [`plan`]).
//! - Frozen: placements of a model whose declaration was rejected, with no good one to plan
//!   from, stay as they are (the caller keeps them) and use their workers' capacity.
//! - New replicas are placed for the models needing the most memory first (then by name):
//!   placed first, small models could split the free memory so that a big one fits nowhere
//!   though there was room for all (first-fit decreasing).
//! - New replicas go, in order, to the worker with the fewest versions of the same model, then
//!   the fewest assignments, then the most free memory, then the smallest id — spreading models
//!   and load, deterministically.
//! - A worker where a version's load failed is not chosen for it again (`excluded`).
//! - A model with a `selector` goes only to workers carrying every label of it (an existing
//!   assignment on a worker that no longer matches is dropped, once handed over if READY).

use std::collections::{BTreeMap, BTreeSet};

use nereid_common::fleet::records::{ModelState, WorkerState};
use nereid_common::fleet::{Assignment, FleetState};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Every assignment that should exist, [`Plan::handing_over`] and [`Plan::vanished`]
    /// included.
    pub assignments: BTreeSet<Assignment>,
    /// (model, version, replicas missing) for versions no worker has room for.
    pub unplaced: Vec<(String, i64, u32)>,
    /// READY replicas on draining or drained workers, or on active workers the model's selector
    /// no longer matches, kept (in `assignments`) until their replacements on active matching
    /// workers are READY, or as a version's last resort.
    pub handing_over: BTreeSet<Assignment>,
    /// Placements on workers that vanished within the grace, kept (in `assignments`) in case
    /// the worker comes back, until their replacements are READY.
    pub vanished: BTreeSet<Assignment>,
    /// READY replicas of versions a model's declaration no longer lists, kept (in
    /// `assignments`) while replicas of its declared versions are still loading.
    pub retiring: BTreeSet<Assignment>,
}

impl Plan {
    pub fn unplaced_replicas(&self) -> u32 {
        self.unplaced.iter().map(|(_, _, n)| n).sum()
    }
}

#[derive(Default)]
struct Load {
    memory_mb: u64,
    count: u32,
    per_model: BTreeMap<String, u32>,
}

impl Load {
    fn add(&mut self, model: &str, memory_mb: u64) {
        self.memory_mb += memory_mb;
        self.count += 1;
        *self.per_model.entry(model.to_string()).or_default() += 1;
    }
}

/// READY holders of one version on registered workers that are to give it up.
#[derive(Default)]
struct Outgoing<'a> {
    /// Draining themselves: exiting.
    exiting: Vec<&'a str>,
    /// Drained by the operator, still serving.
    drained: Vec<&'a str>,
    /// Active, but no longer matching the model's selector.
    unmatched: Vec<&'a str>,
}

/// Plans from `state`; `excluded` lists assignments known to fail (beyond the FAILED statuses
/// currently in `state`); `vanished` lists workers whose registration disappeared less than a
/// grace period ago (one registered again in `state` is not vanished); `frozen` maps placements
/// of models `state` does not declare that stay anyway (left out of the plan, the caller keeps
/// them) to the memory each uses (MiB).
pub fn plan(
    state: &FleetState,
    excluded: &BTreeSet<Assignment>,
    vanished: &BTreeSet<String>,
    frozen: &BTreeMap<Assignment, u64>,
) -> Plan {
    plan_with(state, excluded, vanished, frozen, &BTreeSet::new())
}

/// [`plan`], with `releasing`: placements removed a moment ago, which their workers still hold
/// loaded while they serve out their unload grace. Their room is still taken (what replaces
/// them would otherwise load beside them: two models in one GPU's memory), and a model with a
/// retired version releasing room waits for it before releasing more.
pub fn plan_with(
    state: &FleetState,
    excluded: &BTreeSet<Assignment>,
    vanished: &BTreeSet<String>,
    frozen: &BTreeMap<Assignment, u64>,
    releasing: &BTreeSet<Assignment>,
) -> Plan {
    let failed = |w: &str, m: &str, v: i64| {
        excluded.contains(&(w.to_string(), m.to_string(), v))
            || state
                .statuses
                .get(w)
                .and_then(|s| s.get(&(m.to_string(), v)))
                .is_some_and(|s| s.state == ModelState::Failed)
    };
    let declared = |m: &str, v: i64| state.models.get(m).is_some_and(|d| d.versions.contains(&v));
    let memory_of = |m: &str| state.models.get(m).map_or(0, |d| d.resources.memory_mb);
    let matches = |w: &str, m: &str| {
        let (Some(worker), Some(model)) = (state.workers.get(w), state.models.get(m)) else { return false };
        model.selects(&worker.labels)
    };
    let status =
        |w: &str, m: &str, v: i64| state.statuses.get(w).and_then(|s| s.get(&(m.to_string(), v))).map(|s| s.state);
    let ready = |w: &str, m: &str, v: i64| status(w, m, v) == Some(ModelState::Ready);
    let active: Vec<&String> = state.workers.keys().filter(|w| state.is_active(w)).collect();
    let mut load: BTreeMap<&str, Load> = active.iter().map(|w| (w.as_str(), Load::default())).collect();

    // Keep what is valid, up to the declared replica count: READY ones first, then those with no
    // status yet, then those LOADING. A worker that re-registers (a new lease) writes its record
    // before its statuses, one at a time: until they land, a replica it still has loaded has no
    // status, and losing it to a replacement known to be still loading would unload the one that
    // serves. A placement with no status that never gets one (a dead agent) is not kept for
    // ever: the caller's load timeout excludes it. Deterministic (ties go to the smaller
    // assignment), and no thrash: the ones dropped are deleted, never compared again.
    let mut kept: BTreeMap<(String, i64), Vec<String>> = BTreeMap::new();
    let mut existing: Vec<&Assignment> = state
        .placements
        .iter()
        .filter(|(w, m, v)| load.contains_key(w.as_str()) && declared(m, *v) && matches(w, m) && !failed(w, m, *v))
        .collect();
    let rank = |a: &Assignment| match status(&a.0, &a.1, a.2) {
        Some(ModelState::Ready) => 0,
        None => 1,
        Some(ModelState::Loading | ModelState::Failed) => 2,
    };
    existing.sort_by_key(|a| (rank(a), (*a).clone()));
    for (w, m, v) in existing {
        let replicas = state.models[m].replicas as usize;
        let holders = kept.entry((m.clone(), *v)).or_default();
        if holders.len() < replicas {
            holders.push(w.clone());
            load.get_mut(w.as_str()).expect("active worker").add(m, memory_of(m));
        }
    }
    // A READY replica on an active worker its model's selector no longer matches may be handed
    // over (below): it stays loaded there meanwhile, so its memory and count are charged to the
    // worker before anything new is placed — whether or not it turns out to be kept, since which
    // ones are depends on the replacements placed next (one dropped frees its room for the next
    // plan).
    for (w, m, v) in &state.placements {
        if let Some(l) = load.get_mut(w.as_str())
            && declared(m, *v)
            && !matches(w, m)
            && !failed(w, m, *v)
            && ready(w, m, *v)
        {
            l.add(m, memory_of(m));
        }
    }
    // A READY replica of a version no longer declared (a model redeclared from version 1 to 2)
    // may be kept while the new version loads (below): charged to its worker likewise.
    let retired = |w: &str, m: &str, v: i64| {
        state.models.get(m).is_some_and(|d| !d.versions.contains(&v)) && !failed(w, m, v) && ready(w, m, v)
    };
    for (w, m, v) in &state.placements {
        if let Some(l) = load.get_mut(w.as_str())
            && retired(w, m, *v)
        {
            l.add(m, memory_of(m));
        }
    }
    // Frozen placements stay loaded whatever the plan: their room is taken. The memory is the
    // caller's best knowledge (0 when it never saw the model valid: the worker's memory_mb may
    // then be overfilled, its max_models never).
    for ((w, m, _), memory_mb) in frozen {
        if let Some(l) = load.get_mut(w.as_str())
            && !state.models.contains_key(m)
        {
            l.add(m, *memory_mb);
        }
    }
    for a @ (w, m, _) in releasing {
        if let Some(l) = load.get_mut(w.as_str())
            && !state.placements.contains(a)
        {
            l.add(m, memory_of(m));
        }
    }

    // Add the missing replicas, the models needing the most memory first (first-fit decreasing).
    let mut unplaced = Vec::new();
    let mut by_size: Vec<_> = state.models.iter().collect();
    by_size.sort_by_key(|(name, decl)| (std::cmp::Reverse(decl.resources.memory_mb), *name));
    for (model, decl) in by_size {
        let need = memory_of(model);
        for &version in &decl.versions {
            let holders = kept.entry((model.clone(), version)).or_default();
            while holders.len() < decl.replicas as usize {
                let choice = active
                    .iter()
                    .filter(|w| !holders.contains(**w) && matches(w, model) && !failed(w, model, version))
                    .filter(|w| {
                        let cap = state.workers[w.as_str()].capacity;
                        let l = &load[w.as_str()];
                        (cap.memory_mb == 0 || l.memory_mb + need <= cap.memory_mb)
                            && (cap.max_models == 0 || l.count < cap.max_models)
                    })
                    .min_by_key(|w| {
                        let cap = state.workers[w.as_str()].capacity;
                        let l = &load[w.as_str()];
                        let free = cap.memory_mb.saturating_sub(l.memory_mb);
                        (
                            l.per_model.get(model).copied().unwrap_or(0),
                            l.count,
                            std::cmp::Reverse(free),
                            (*w).to_string(),
                        )
                    });
                let Some(w) = choice else {
                    unplaced.push((model.clone(), version, decl.replicas - holders.len() as u32));
                    break;
                };
                load.get_mut(w.as_str()).expect("active worker").add(model, need);
                holders.push((*w).clone());
            }
        }
    }
    // Reported in name order, as declared.
    unplaced.sort_by(|a, b| a.0.cmp(&b.0));
    // READY replicas among a version's holders (on active matching workers), counted after the
    // additions: a new holder that already has the version loaded (READY before it was placed
    // there) counts at once.
    let ready_holders = |m: &str, v: i64| {
        let holders = kept.get(&(m.to_string(), v)).map(Vec::as_slice).unwrap_or_default();
        (holders.len(), holders.iter().filter(|w| ready(w, m, v)).count())
    };

    // Hand-over: READY replicas on registered workers that are to give them up, per version, the
    // ones on workers that are exiting (draining themselves) first, then those drained by the
    // operator (no active worker's room is held up by them), then the unmatched ones.
    let mut outgoing: BTreeMap<(&str, i64), Outgoing> = BTreeMap::new();
    for (w, m, v) in &state.placements {
        let Some(record) = state.workers.get(w) else { continue };
        let is_active = state.is_active(w);
        let valid = (!is_active || !matches(w, m)) && declared(m, *v) && !failed(w, m, *v) && ready(w, m, *v);
        if valid {
            let holders = outgoing.entry((m.as_str(), *v)).or_default();
            if is_active {
                holders.unmatched.push(w);
            } else if record.state == WorkerState::Draining {
                holders.exiting.push(w);
            } else {
                holders.drained.push(w);
            }
        }
    }
    let mut handing_over = BTreeSet::new();
    for ((m, v), Outgoing { exiting, drained, unmatched }) in outgoing {
        let (holders, ready_active) = ready_holders(m, v);
        let loading = holders - ready_active;
        // One for each replacement still loading; and, when the version has no READY replica on
        // an active matching worker at all, one anyway — not on an exiting worker: it cannot be
        // the last resort.
        let missing = (state.models[m].replicas as usize).saturating_sub(ready_active);
        let slots = loading.max(usize::from(ready_active == 0)).min(missing);
        let keep_exiting = exiting.len().min(loading).min(slots);
        let keep_drained = drained.len().min(slots - keep_exiting);
        let keep_unmatched = unmatched.len().min(slots - keep_exiting - keep_drained);
        let keep = exiting
            .into_iter()
            .take(keep_exiting)
            .chain(drained.into_iter().take(keep_drained))
            .chain(unmatched.into_iter().take(keep_unmatched));
        for w in keep {
            handing_over.insert((w.to_string(), m.to_string(), v));
        }
    }

    // Vanished workers: their placements are kept, one per READY replica the version still
    // lacks on active matching workers. Their statuses vanished with them, so READY or not is
    // unknown; labels too, so the selector is not checked (a worker that comes back unmatched
    // hands over as above).
    let mut gone: BTreeMap<(&str, i64), Vec<&str>> = BTreeMap::new();
    for (w, m, v) in &state.placements {
        if vanished.contains(w) && !state.workers.contains_key(w) && declared(m, *v) && !failed(w, m, *v) {
            gone.entry((m.as_str(), *v)).or_default().push(w);
        }
    }
    let mut kept_vanished = BTreeSet::new();
    for ((m, v), workers) in gone {
        let (_, ready_active) = ready_holders(m, v);
        let missing = (state.models[m].replicas as usize).saturating_sub(ready_active);
        for w in workers.into_iter().take(missing) {
            kept_vanished.insert((w.to_string(), m.to_string(), v));
        }
    }

    // Version roll-over, make before break: a model's retired versions keep their READY replicas
    // on active workers while any replica of its declared versions is placed but not READY yet —
    // dropping them first would leave the model with nothing to serve for as long as the new
    // version loads — and while a declared version is short of replicas because its loads
    // failed (a broken new version must not take the model down). Otherwise (all READY, or
    // short only for lack of room: the room they hold is then freed for the next plan) they go.
    let failing = |m: &str, d: i64| {
        unplaced.iter().any(|(um, uv, _)| um == m && *uv == d)
            && (excluded.iter().any(|(_, em, ev)| em == m && *ev == d)
                || state
                    .statuses
                    .values()
                    .any(|s| s.get(&(m.to_string(), d)).is_some_and(|st| st.state == ModelState::Failed)))
    };
    // Short only for lack of room (a full fleet), they go one at a time, not all at once (a
    // Deployment's rolling update with no surge room, maxUnavailable 1): one is released, its
    // room takes a replica of the new version in the next plan, the rest stay until that one
    // is READY — then the next goes. Dropping them all would leave the model nothing to serve
    // until the new version loads.
    let mut retired_ready: BTreeMap<&str, Vec<&Assignment>> = BTreeMap::new();
    for a @ (w, m, v) in &state.placements {
        if load.contains_key(w.as_str()) && retired(w, m, *v) {
            retired_ready.entry(m.as_str()).or_default().push(a);
        }
    }
    let mut retiring = BTreeSet::new();
    for (m, replicas) in retired_ready {
        let versions = &state.models[m].versions;
        let waiting = versions.iter().any(|&d| {
            let (holders, ready) = ready_holders(m, d);
            holders > ready || failing(m, d)
        });
        let short_of_room = versions.iter().any(|&d| unplaced.iter().any(|(um, uv, _)| um == m && *uv == d));
        // A replica of this model released a moment ago: its room comes (to the new version)
        // once its worker has unloaded it; until then, none more goes.
        let room_coming = releasing.iter().any(|(_, rm, _)| rm == m);
        let keep = if waiting || (short_of_room && room_coming) {
            replicas.len()
        } else if short_of_room {
            replicas.len() - 1
        } else {
            0
        };
        // The last ones (in key order) are released first: deterministic, and no thrash.
        retiring.extend(replicas.into_iter().take(keep).cloned());
    }

    let mut assignments: BTreeSet<Assignment> =
        kept.into_iter().flat_map(|((m, v), ws)| ws.into_iter().map(move |w| (w, m.clone(), v))).collect();
    assignments.extend(handing_over.iter().cloned());
    assignments.extend(kept_vanished.iter().cloned());
    assignments.extend(retiring.iter().cloned());
    Plan { assignments, unplaced, handing_over, vanished: kept_vanished, retiring }
}

/// A worker whose assignments exceed its declared capacity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overcommit {
    pub worker: String,
    /// What its assignments need, and its capacity (0: unbounded).
    pub memory_mb: u64,
    pub capacity_mb: u64,
    pub models: u32,
    pub max_models: u32,
}

/// The registered workers that `assignments` (a plan's) put over their declared capacity:
/// only assignments that existed before a capacity change can (new ones never do).
pub fn overcommitted(state: &FleetState, assignments: &BTreeSet<Assignment>) -> Vec<Overcommit> {
    let mut per_worker: BTreeMap<&str, (u64, u32)> = BTreeMap::new();
    for (w, m, _) in assignments {
        let memory = state.models.get(m).map_or(0, |d| d.resources.memory_mb);
        let entry = per_worker.entry(w.as_str()).or_default();
        entry.0 = entry.0.saturating_add(memory);
        entry.1 += 1;
    }
    per_worker
        .into_iter()
        .filter_map(|(w, (memory_mb, models))| {
            let cap = state.workers.get(w)?.capacity;
            let over =
                (cap.memory_mb > 0 && memory_mb > cap.memory_mb) || (cap.max_models > 0 && models > cap.max_models);
            over.then(|| Overcommit {
                worker: w.to_string(),
                memory_mb,
                capacity_mb: cap.memory_mb,
                models,
                max_models: cap.max_models,
            })
        })
        .collect()
}

/// Fleet states built by hand, for this module's tests and the controller's.
#[cfg(test)]
pub(crate) mod fixtures {
    use nereid_common::fleet::records::{Capacity, ModelRecord, Resources, StatusRecord, WorkerRecord};

    use super::*;

    pub fn worker(state: &mut FleetState, id: &str, memory_mb: u64, max_models: u32) {
        state.workers.insert(
            id.into(),
            WorkerRecord {
                schema: 1,
                id: id.into(),
                grpc: "127.0.0.1:1".into(),
                http: None,
                state: WorkerState::Ready,
                capacity: Capacity { memory_mb, max_models },
                devices: vec![],
                labels: Default::default(),
                cost_classes: vec![],
            },
        );
    }

    pub fn model(state: &mut FleetState, name: &str, versions: &[i64], replicas: u32, memory_mb: u64) {
        state.models.insert(
            name.into(),
            ModelRecord {
                schema: 1,
                versions: versions.to_vec(),
                replicas,
                resources: Resources { memory_mb },
                cost_class: None,
                selector: Default::default(),
            },
        );
    }

    /// Sets (or, with `None`, removes) the status `w` publishes for `m`/`v`.
    pub fn status(state: &mut FleetState, w: &str, m: &str, v: i64, status: Option<(ModelState, &str)>) {
        let per_worker = state.statuses.entry(w.into()).or_default();
        match status {
            Some((s, reason)) => {
                per_worker.insert((m.into(), v), StatusRecord { schema: 1, state: s, reason: reason.into() });
            }
            None => {
                per_worker.remove(&(m.to_string(), v));
            }
        }
    }

    pub fn a(w: &str, m: &str, v: i64) -> Assignment {
        (w.into(), m.into(), v)
    }

    /// `m`/`v` placed on each of `workers` and READY there.
    pub fn ready_on(state: &mut FleetState, workers: &[&str], m: &str, v: i64) {
        for w in workers {
            state.placements.insert(a(w, m, v));
            status(state, w, m, v, Some((ModelState::Ready, "")));
        }
    }
}

#[cfg(test)]
mod tests {
    use nereid_common::fleet::records::{DrainRecord, StatusRecord};
    use proptest::prelude::*;

    use super::fixtures::*;
    use super::*;

    /// A model redeclared from version 1 to version 2 keeps serving version 1 until version 2
    /// is READY (make before break); version 1's replica holds its room meanwhile. When version
    /// 2 fits nowhere, version 1 goes at once, freeing the room for it.
    #[test]
    fn a_version_change_keeps_the_old_version_until_the_new_one_is_ready() {
        let none = || (BTreeSet::new(), BTreeSet::new(), BTreeMap::new());
        let (ex, van, fr) = none();
        let mut s = FleetState::default();
        worker(&mut s, "w1", 1000, 0);
        worker(&mut s, "w2", 1000, 0);
        model(&mut s, "m", &[2], 1, 600);
        ready_on(&mut s, &["w1"], "m", 1);
        let p = plan(&s, &ex, &van, &fr);
        // Version 2 goes where version 1's 600 MiB leave room; version 1 stays while it loads.
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w2", "m", 2)]));
        assert_eq!(p.retiring, BTreeSet::from([a("w1", "m", 1)]));
        s.placements.insert(a("w2", "m", 2));
        status(&mut s, "w2", "m", 2, Some((ModelState::Loading, "")));
        assert!(plan(&s, &ex, &van, &fr).assignments.contains(&a("w1", "m", 1)), "still loading");
        status(&mut s, "w2", "m", 2, Some((ModelState::Ready, "")));
        let p = plan(&s, &ex, &van, &fr);
        assert_eq!(p.assignments, BTreeSet::from([a("w2", "m", 2)]), "version 2 READY: version 1 goes");
        assert!(p.retiring.is_empty());

        // One worker with room for one copy: version 1 goes now, version 2 is placed next.
        let mut s = FleetState::default();
        worker(&mut s, "w1", 1000, 0);
        model(&mut s, "m", &[2], 1, 600);
        ready_on(&mut s, &["w1"], "m", 1);
        let p = plan(&s, &ex, &van, &fr);
        assert!(p.assignments.is_empty(), "{p:?}");
        assert_eq!(p.unplaced, vec![("m".to_string(), 2, 1)]);
        s.placements.clear();
        assert_eq!(plan(&s, &ex, &van, &fr).assignments, BTreeSet::from([a("w1", "m", 2)]));

        // Version 2 fails to load everywhere: version 1 keeps serving (a broken version does
        // not take the model down), whether the failure is a status or an exclusion.
        let mut s = FleetState::default();
        worker(&mut s, "w1", 0, 0);
        worker(&mut s, "w2", 0, 0);
        model(&mut s, "m", &[2], 1, 0);
        ready_on(&mut s, &["w1"], "m", 1);
        s.placements.insert(a("w2", "m", 2));
        status(&mut s, "w2", "m", 2, Some((ModelState::Failed, "corrupt")));
        let excluded = BTreeSet::from([a("w1", "m", 2)]);
        let p = plan(&s, &excluded, &van, &fr);
        assert_eq!(p.unplaced, vec![("m".to_string(), 2, 1)]);
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1)]), "{p:?}");
        s.placements.remove(&a("w2", "m", 2));
        status(&mut s, "w2", "m", 2, None);
        let both = BTreeSet::from([a("w1", "m", 2), a("w2", "m", 2)]);
        assert_eq!(plan(&s, &both, &van, &fr).assignments, BTreeSet::from([a("w1", "m", 1)]));
    }

    /// Three workers with room for one 600 MiB replica each, all holding `m` version 1 READY,
    /// and `m` now declared as version 2 on three replicas.
    fn full_fleet_rolling_to_version_2() -> FleetState {
        let mut s = FleetState::default();
        for w in ["w1", "w2", "w3"] {
            worker(&mut s, w, 1000, 0);
        }
        model(&mut s, "m", &[2], 3, 600);
        ready_on(&mut s, &["w1", "w2", "w3"], "m", 1);
        s
    }

    /// A full fleet rolls a model from version 1 to 2 one replica at a time: version 1's
    /// replicas go one by one, each once the version 2 replica placed in the room the last one
    /// freed is READY — the model is never left without a READY replica.
    #[test]
    fn a_full_fleet_rolls_versions_one_replica_at_a_time() {
        let (ex, van, fr) = (BTreeSet::new(), BTreeSet::new(), BTreeMap::new());
        let mut s = full_fleet_rolling_to_version_2();
        for step in 0..3 {
            let p = plan(&s, &ex, &van, &fr);
            let old: Vec<&Assignment> = p.assignments.iter().filter(|a| a.2 == 1).collect();
            assert_eq!(old.len(), 2 - step, "step {step}: one version 1 replica released: {p:?}");
            assert_eq!(p.retiring.len(), 2 - step);
            // The plan lands; the released replica's room takes version 2, which loads.
            s.placements = p.assignments.clone();
            let p = plan(&s, &ex, &van, &fr);
            let new: Vec<Assignment> = p.assignments.iter().filter(|a| a.2 == 2).cloned().collect();
            assert_eq!(new.len(), step + 1, "step {step}: {p:?}");
            assert_eq!(p.assignments.iter().filter(|a| a.2 == 1).count(), 2 - step, "kept while 2 loads");
            s.placements = p.assignments.clone();
            for (w, m, v) in &new {
                if status_of(&s, w, m, *v).is_none() {
                    status(&mut s, w, m, *v, Some((ModelState::Loading, "")));
                }
            }
            assert_eq!(plan(&s, &ex, &van, &fr).assignments, s.placements, "nothing moves while it loads");
            for (w, m, v) in &new {
                status(&mut s, w, m, *v, Some((ModelState::Ready, "")));
            }
            // Version 1's statuses go with their placements.
            for w in ["w1", "w2", "w3"] {
                if !s.placements.contains(&a(w, "m", 1)) {
                    status(&mut s, w, "m", 1, None);
                }
            }
        }
        let p = plan(&s, &ex, &van, &fr);
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 2), a("w2", "m", 2), a("w3", "m", 2)]));
        assert!(p.unplaced.is_empty() && p.retiring.is_empty());
    }

    /// A replica released a moment ago still holds its worker's room (the worker serves it
    /// out its unload grace): nothing is placed into that room, and no other replica of the
    /// model is released meanwhile. Once it is gone, the room takes the new version.
    #[test]
    fn room_released_a_moment_ago_is_still_taken() {
        let (ex, van, fr) = (BTreeSet::new(), BTreeSet::new(), BTreeMap::new());
        let mut s = full_fleet_rolling_to_version_2();
        let p = plan(&s, &ex, &van, &fr);
        let released: BTreeSet<Assignment> = s.placements.difference(&p.assignments).cloned().collect();
        assert_eq!(released, BTreeSet::from([a("w3", "m", 1)]));
        s.placements = p.assignments.clone();
        status(&mut s, "w3", "m", 1, None);
        // While w3 still holds it: nothing new, nothing more released.
        let p = plan_with(&s, &ex, &van, &fr, &released);
        assert_eq!(p.assignments, s.placements, "{p:?}");
        // Gone: version 2 goes into the room.
        let p = plan_with(&s, &ex, &van, &fr, &BTreeSet::new());
        assert!(p.assignments.contains(&a("w3", "m", 2)), "{p:?}");
    }

    fn status_of(s: &FleetState, w: &str, m: &str, v: i64) -> Option<ModelState> {
        s.statuses.get(w).and_then(|x| x.get(&(m.to_string(), v))).map(|x| x.state)
    }

    #[test]
    fn spreads_replicas_and_respects_capacity() {
        let mut s = FleetState::default();
        for w in ["w1", "w2", "w3"] {
            worker(&mut s, w, 1000, 0);
        }
        model(&mut s, "big", &[1], 2, 600);
        model(&mut s, "small", &[1, 2], 2, 100);
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert!(p.unplaced.is_empty(), "{p:?}");
        assert_eq!(p.assignments.len(), 6);
        // No worker holds two replicas of one version, or more than its memory.
        for w in ["w1", "w2", "w3"] {
            let mem: u64 = p
                .assignments
                .iter()
                .filter(|(x, _, _)| x == w)
                .map(|(_, m, _)| if m == "big" { 600 } else { 100 })
                .sum();
            assert!(mem <= 1000, "{w} holds {mem} MiB");
        }
        // Not enough room: reported, not over-committed (planned from scratch, the biggest
        // first: huge gets both its replicas, big lacks one).
        model(&mut s, "huge", &[1], 2, 900);
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.unplaced, vec![("big".to_string(), 1, 1)]);
        assert_eq!(p.unplaced_replicas(), 1);
    }

    #[test]
    fn keeps_valid_assignments_and_replaces_lost_ones() {
        let mut s = FleetState::default();
        for w in ["w1", "w2", "w3"] {
            worker(&mut s, w, 0, 0);
        }
        model(&mut s, "m", &[1], 2, 0);
        s.placements.insert(a("w3", "m", 1));
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert!(p.assignments.contains(&a("w3", "m", 1)), "stable: {p:?}");
        assert_eq!(p.assignments.len(), 2);

        // w3 leaves: its replica moves; a draining worker and a drained one get nothing.
        s.placements = p.assignments.clone();
        s.workers.remove("w3");
        s.workers.get_mut("w2").unwrap().state = WorkerState::Draining;
        worker(&mut s, "w4", 0, 0);
        worker(&mut s, "w5", 0, 0);
        s.drains.insert("w5".into(), DrainRecord { schema: 1, reason: String::new() });
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w4", "m", 1)]));

        // A failed load moves the replica elsewhere and is not retried there.
        s.placements = p.assignments.clone();
        s.workers.get_mut("w2").unwrap().state = WorkerState::Ready;
        s.statuses
            .entry("w4".into())
            .or_default()
            .insert(("m".into(), 1), StatusRecord { schema: 1, state: ModelState::Failed, reason: "boom".into() });
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1)]));
        let p = plan(&s, &BTreeSet::from([a("w2", "m", 1)]), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1)]));
        assert_eq!(p.unplaced, vec![("m".to_string(), 1, 1)]);

        // Fewer replicas declared: extras are dropped; an undeclared model is removed.
        model(&mut s, "m", &[1], 1, 0);
        s.placements.insert(a("w9", "gone", 1));
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments.len(), 1);
    }

    #[test]
    fn selectors_restrict_workers() {
        let mut s = FleetState::default();
        for w in ["cpu1", "cpu2", "gpu1"] {
            worker(&mut s, w, 0, 0);
        }
        s.workers.get_mut("gpu1").unwrap().labels.insert("device".into(), "gpu".into());
        model(&mut s, "big", &[1], 2, 0);
        s.models.get_mut("big").unwrap().selector.insert("device".into(), "gpu".into());
        s.placements.insert(a("cpu1", "big", 1)); // placed before the selector: moved
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("gpu1", "big", 1)]));
        assert_eq!(p.unplaced, vec![("big".to_string(), 1, 1)]);
    }

    #[test]
    fn max_models_bounds_the_count() {
        let mut s = FleetState::default();
        worker(&mut s, "w1", 0, 1);
        worker(&mut s, "w2", 0, 1);
        model(&mut s, "a", &[1], 1, 0);
        model(&mut s, "b", &[1], 1, 0);
        model(&mut s, "c", &[1], 1, 0);
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments.len(), 2);
        assert_eq!(p.unplaced_replicas(), 1);
    }

    /// A drained holder of a `replicas: 1` model keeps it until the replacement is READY.
    #[test]
    fn a_drained_worker_hands_over_before_its_replica_is_removed() {
        for how in ["operator drain", "worker draining"] {
            let mut s = FleetState::default();
            worker(&mut s, "w1", 0, 0);
            worker(&mut s, "w2", 0, 0);
            model(&mut s, "m", &[1], 1, 0);
            s.placements.insert(a("w1", "m", 1));
            status(&mut s, "w1", "m", 1, Some((ModelState::Ready, "")));
            assert_eq!(
                plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new()).assignments,
                BTreeSet::from([a("w1", "m", 1)]),
                "stable"
            );

            if how == "operator drain" {
                s.drains.insert("w1".into(), DrainRecord { schema: 1, reason: String::new() });
            } else {
                s.workers.get_mut("w1").unwrap().state = WorkerState::Draining;
            }
            // Make: the replacement is placed, the drained replica stays.
            let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
            assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1)]), "{how}");
            assert_eq!(p.handing_over, BTreeSet::from([a("w1", "m", 1)]), "{how}");
            assert!(p.unplaced.is_empty(), "{how}: {p:?}");

            // Still loading (or FAILED-then-excluded elsewhere): nothing changes.
            s.placements = p.assignments.clone();
            status(&mut s, "w2", "m", 1, Some((ModelState::Loading, "")));
            assert_eq!(plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new()), p, "{how}");

            // Break: the replacement is READY, the drained replica goes.
            status(&mut s, "w2", "m", 1, Some((ModelState::Ready, "")));
            let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
            assert_eq!(p.assignments, BTreeSet::from([a("w2", "m", 1)]), "{how}");
            assert!(p.handing_over.is_empty(), "{how}");
        }
    }

    #[test]
    fn hand_over_keeps_only_ready_replicas_and_only_as_many_as_are_missing() {
        let mut s = FleetState::default();
        for w in ["w1", "w2", "w3", "w4"] {
            worker(&mut s, w, 0, 0);
        }
        model(&mut s, "m", &[1], 2, 0);
        ready_on(&mut s, &["w1", "w2"], "m", 1);
        // One of two READY holders drained: it stays until its replacement (w3) is READY.
        s.drains.insert("w1".into(), DrainRecord { schema: 1, reason: String::new() });
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1), a("w3", "m", 1)]));
        s.placements = p.assignments.clone();
        status(&mut s, "w3", "m", 1, Some((ModelState::Ready, "")));
        assert_eq!(
            plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new()).assignments,
            BTreeSet::from([a("w2", "m", 1), a("w3", "m", 1)])
        );

        // Both drained, one still loading: only the READY one is worth keeping.
        let mut s2 = s.clone();
        s2.placements = BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1)]);
        s2.statuses.clear();
        status(&mut s2, "w1", "m", 1, Some((ModelState::Ready, "")));
        status(&mut s2, "w2", "m", 1, Some((ModelState::Loading, "")));
        s2.drains.insert("w2".into(), DrainRecord { schema: 1, reason: String::new() });
        let p = plan(&s2, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.handing_over, BTreeSet::from([a("w1", "m", 1)]));
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w3", "m", 1), a("w4", "m", 1)]));
        // One replacement READY, the other still loading: the drained replica stays for it.
        s2.placements = p.assignments.clone();
        status(&mut s2, "w3", "m", 1, Some((ModelState::Ready, "")));
        assert_eq!(
            plan(&s2, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new()).handing_over,
            BTreeSet::from([a("w1", "m", 1)])
        );
        status(&mut s2, "w4", "m", 1, Some((ModelState::Ready, "")));
        assert!(plan(&s2, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new()).handing_over.is_empty());
        s2.placements = BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1)]);
        status(&mut s2, "w3", "m", 1, None);
        status(&mut s2, "w4", "m", 1, None);

        // Deregistered (lease gone), undeclared, or FAILED: nothing to hand over.
        let mut s3 = s2.clone();
        s3.workers.remove("w1");
        assert!(plan(&s3, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new()).handing_over.is_empty());
        let mut s4 = s2.clone();
        model(&mut s4, "m", &[2], 2, 0);
        assert!(plan(&s4, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new()).handing_over.is_empty());
        assert!(
            plan(&s2, &BTreeSet::from([a("w1", "m", 1)]), &BTreeSet::new(), &BTreeMap::new()).handing_over.is_empty()
        );
    }

    /// The replacement needs room on an active worker; the drained holder's memory is not
    /// counted there, and without room the drained holder simply stays.
    #[test]
    fn hand_over_respects_capacity() {
        let mut s = FleetState::default();
        worker(&mut s, "w1", 1000, 0);
        worker(&mut s, "w2", 500, 0);
        model(&mut s, "a", &[1], 1, 400);
        model(&mut s, "b", &[1], 1, 400);
        for m in ["a", "b"] {
            s.placements.insert(a("w1", m, 1));
            status(&mut s, "w1", m, 1, Some((ModelState::Ready, "")));
        }
        s.drains.insert("w1".into(), DrainRecord { schema: 1, reason: String::new() });
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        // Only one of them fits on w2 (400 of 500 MiB): a is handed over; b, with nowhere to go
        // and no other READY replica, stays on the drained worker as the last resort (and is
        // reported unplaced).
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "a", 1), a("w1", "b", 1), a("w2", "a", 1)]));
        assert_eq!(p.unplaced, vec![("b".to_string(), 1, 1)]);
        assert_eq!(p.handing_over, BTreeSet::from([a("w1", "a", 1), a("w1", "b", 1)]));
        s.placements = p.assignments.clone();
        status(&mut s, "w2", "a", 1, Some((ModelState::Ready, "")));
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "b", 1), a("w2", "a", 1)]));
        assert_eq!(p.unplaced, vec![("b".to_string(), 1, 1)]);
        // Room appears: b is placed there, then leaves w1 once READY.
        s.placements = p.assignments.clone();
        worker(&mut s, "w3", 500, 0);
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "b", 1), a("w2", "a", 1), a("w3", "b", 1)]));
        s.placements = p.assignments.clone();
        status(&mut s, "w3", "b", 1, Some((ModelState::Ready, "")));
        assert_eq!(
            plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new()).assignments,
            BTreeSet::from([a("w2", "a", 1), a("w3", "b", 1)])
        );
    }

    /// With no other worker, an operator-drained worker keeps its READY replicas (the last
    /// resort); a worker draining itself — exiting — has its placement removed.
    #[test]
    fn only_an_operator_drained_worker_is_the_last_resort() {
        let mut s = FleetState::default();
        worker(&mut s, "w1", 0, 0);
        model(&mut s, "m", &[1], 1, 0);
        s.placements.insert(a("w1", "m", 1));
        status(&mut s, "w1", "m", 1, Some((ModelState::Ready, "")));
        s.drains.insert("w1".into(), DrainRecord { schema: 1, reason: String::new() });
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1)]));
        assert_eq!(p.handing_over, p.assignments);
        assert_eq!(p.unplaced, vec![("m".to_string(), 1, 1)]);

        s.workers.get_mut("w1").unwrap().state = WorkerState::Draining;
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert!(p.assignments.is_empty(), "{p:?}");
        assert_eq!(p.unplaced, vec![("m".to_string(), 1, 1)]);

        // Another READY replica on an active worker: the drained one is not needed as a last
        // resort, and goes although its replacement has nowhere to go (w2 holds one already).
        let mut s = FleetState::default();
        worker(&mut s, "w1", 0, 0);
        worker(&mut s, "w2", 0, 0);
        model(&mut s, "m", &[1], 2, 0);
        ready_on(&mut s, &["w1", "w2"], "m", 1);
        s.drains.insert("w1".into(), DrainRecord { schema: 1, reason: String::new() });
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w2", "m", 1)]));
        assert_eq!(p.unplaced, vec![("m".to_string(), 1, 1)]);
    }

    /// The worker's lease lapsed (a pause longer than its TTL) and it re-registers within the
    /// grace: its replica of a `replicas: 1` model is never removed, the replacement placed
    /// meanwhile is dropped once the worker reports READY again.
    #[test]
    fn a_vanished_worker_keeps_its_placement_within_the_grace() {
        let mut s = FleetState::default();
        worker(&mut s, "w1", 0, 0);
        worker(&mut s, "w2", 0, 0);
        model(&mut s, "m", &[1], 1, 0);
        ready_on(&mut s, &["w1"], "m", 1);
        let vanished = BTreeSet::from(["w1".to_string()]);

        // The lease expires: record and statuses gone. The replacement is placed at once, as if
        // w1's replica were gone; w1's key stays.
        let registered = s.clone();
        s.workers.remove("w1");
        s.statuses.remove("w1");
        let p = plan(&s, &BTreeSet::new(), &vanished, &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1)]));
        assert_eq!(p.vanished, BTreeSet::from([a("w1", "m", 1)]));
        assert!(p.handing_over.is_empty() && p.unplaced.is_empty(), "{p:?}");
        // Past the grace (the caller no longer lists it): removed, as before.
        assert_eq!(
            plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new()).assignments,
            BTreeSet::from([a("w2", "m", 1)])
        );

        // Back within the grace, READY again: the replacement still loading is the surplus.
        s.placements = p.assignments.clone();
        status(&mut s, "w2", "m", 1, Some((ModelState::Loading, "")));
        let mut back = s.clone();
        back.workers = registered.workers.clone();
        status(&mut back, "w1", "m", 1, Some((ModelState::Ready, "")));
        let p = plan(&back, &BTreeSet::new(), &vanished, &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1)]), "registered: not vanished any more");
        assert!(p.vanished.is_empty());

        // Not back, and the replacement is READY: the vanished worker's key goes.
        status(&mut s, "w2", "m", 1, Some((ModelState::Ready, "")));
        let p = plan(&s, &BTreeSet::new(), &vanished, &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w2", "m", 1)]));
        assert!(p.vanished.is_empty());
    }

    /// Kept only as long as READY replicas are missing, one per missing replica; never for an
    /// undeclared version or a failed load; kept also when no replacement can be placed.
    #[test]
    fn vanished_placements_are_kept_only_while_ready_replicas_are_missing() {
        let mut s = FleetState::default();
        for w in ["w1", "w2", "w3"] {
            worker(&mut s, w, 0, 0);
        }
        model(&mut s, "m", &[1], 2, 0);
        model(&mut s, "old", &[1], 1, 0);
        ready_on(&mut s, &["w1"], "m", 1);
        // w8 and w9 both held m/1 (a stale surplus on one of them) and old/2 (undeclared now).
        for w in ["w8", "w9"] {
            s.placements.insert(a(w, "m", 1));
            s.placements.insert(a(w, "old", 2));
        }
        let vanished = BTreeSet::from(["w8".to_string(), "w9".to_string()]);
        let p = plan(&s, &BTreeSet::new(), &vanished, &BTreeMap::new());
        // m/1 lacks one READY replica (w1 is READY): one of the vanished keys stays, and the
        // replacement goes to w2.
        assert_eq!(p.vanished, BTreeSet::from([a("w8", "m", 1)]));
        assert!(p.assignments.contains(&a("w2", "m", 1)), "{p:?}");
        assert!(!p.assignments.iter().any(|(_, m, v)| m == "old" && *v == 2), "{p:?}");
        // Failed there (excluded by the controller): not kept.
        let p = plan(&s, &BTreeSet::from([a("w8", "m", 1)]), &vanished, &BTreeMap::new());
        assert_eq!(p.vanished, BTreeSet::from([a("w9", "m", 1)]));

        // No room for a replacement: the vanished key stays (the version is reported unplaced).
        let mut s = FleetState::default();
        model(&mut s, "m", &[1], 1, 0);
        s.placements.insert(a("w1", "m", 1));
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::from(["w1".to_string()]), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1)]));
        assert_eq!(p.vanished, p.assignments);
        assert_eq!(p.unplaced, vec![("m".to_string(), 1, 1)]);
    }

    /// Narrowing a selector replaces READY replicas on workers no longer matching one by one:
    /// each stays (handed over) until its replacement is READY.
    #[test]
    fn a_narrowed_selector_hands_over_ready_replicas() {
        let mut s = FleetState::default();
        for w in ["cpu1", "cpu2", "gpu1", "gpu2"] {
            worker(&mut s, w, 0, 0);
        }
        for w in ["gpu1", "gpu2"] {
            s.workers.get_mut(w).unwrap().labels.insert("device".into(), "gpu".into());
        }
        model(&mut s, "big", &[1], 2, 0);
        ready_on(&mut s, &["cpu1", "cpu2"], "big", 1);
        s.models.get_mut("big").unwrap().selector.insert("device".into(), "gpu".into());

        let both = [a("cpu1", "big", 1), a("cpu2", "big", 1)];
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.handing_over, BTreeSet::from(both.clone()));
        let replacements = [a("gpu1", "big", 1), a("gpu2", "big", 1)];
        assert_eq!(p.assignments, BTreeSet::from_iter(both.iter().chain(&replacements).cloned()));
        assert!(p.unplaced.is_empty(), "{p:?}");

        // One replacement READY: one CPU replica goes, the other stays for the one loading.
        s.placements = p.assignments.clone();
        status(&mut s, "gpu1", "big", 1, Some((ModelState::Ready, "")));
        status(&mut s, "gpu2", "big", 1, Some((ModelState::Loading, "")));
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.handing_over, BTreeSet::from([a("cpu1", "big", 1)]));
        // Both READY: no CPU replica left.
        s.placements = p.assignments.clone();
        status(&mut s, "gpu2", "big", 1, Some((ModelState::Ready, "")));
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from(replacements));
        assert!(p.handing_over.is_empty());

        // No matching worker at all: the READY replica stays as the last resort (reported
        // unplaced); one still loading serves nobody and is dropped at once.
        let mut s = FleetState::default();
        worker(&mut s, "cpu1", 0, 0);
        worker(&mut s, "cpu2", 0, 0);
        model(&mut s, "big", &[1], 2, 0);
        ready_on(&mut s, &["cpu1"], "big", 1);
        s.placements.insert(a("cpu2", "big", 1));
        status(&mut s, "cpu2", "big", 1, Some((ModelState::Loading, "")));
        s.models.get_mut("big").unwrap().selector.insert("device".into(), "gpu".into());
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("cpu1", "big", 1)]));
        assert_eq!(p.handing_over, p.assignments);
        assert_eq!(p.unplaced, vec![("big".to_string(), 1, 2)]);
    }

    /// A replica handed over by an active worker is still loaded there: its memory counts
    /// against that worker until the plan removing it, and the next plan uses the room.
    #[test]
    fn an_unmatched_replica_holds_its_room_until_it_is_removed() {
        let mut s = FleetState::default();
        worker(&mut s, "cpu1", 1000, 0);
        worker(&mut s, "gpu1", 0, 0);
        s.workers.get_mut("gpu1").unwrap().labels.insert("device".into(), "gpu".into());
        model(&mut s, "big", &[1], 1, 600);
        model(&mut s, "other", &[1], 1, 600);
        ready_on(&mut s, &["cpu1"], "big", 1);
        s.models.get_mut("big").unwrap().selector.insert("device".into(), "gpu".into());
        // `other` fits only on cpu1 (a selector gpu1 lacks), beside nothing else of 600 MiB.
        s.workers.get_mut("cpu1").unwrap().labels.insert("device".into(), "cpu".into());
        s.models.get_mut("other").unwrap().selector.insert("device".into(), "cpu".into());

        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("cpu1", "big", 1), a("gpu1", "big", 1)]));
        assert_eq!(p.unplaced, vec![("other".to_string(), 1, 1)]);
        // The replacement is READY: big leaves cpu1, whose room is still charged in this plan…
        s.placements = p.assignments.clone();
        status(&mut s, "gpu1", "big", 1, Some((ModelState::Ready, "")));
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("gpu1", "big", 1)]));
        assert_eq!(p.unplaced, vec![("other".to_string(), 1, 1)]);
        // …and free for the next one.
        s.placements = p.assignments.clone();
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("cpu1", "other", 1), a("gpu1", "big", 1)]));
        assert!(p.unplaced.is_empty());
    }

    /// A worker whose capacity shrank under its placements keeps them (nothing is unloaded for
    /// a declaration) and is reported; nothing new goes to it.
    #[test]
    fn a_shrunk_capacity_keeps_what_is_placed_and_is_reported() {
        let mut s = FleetState::default();
        worker(&mut s, "w1", 1000, 0);
        worker(&mut s, "w2", 1000, 0);
        model(&mut s, "a", &[1], 1, 600);
        model(&mut s, "b", &[1], 1, 600);
        ready_on(&mut s, &["w1"], "a", 1);
        ready_on(&mut s, &["w2"], "b", 1);
        assert!(
            overcommitted(&s, &plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new()).assignments).is_empty()
        );
        // w1 restarts declaring 500 MB; a new model is declared.
        s.workers.get_mut("w1").unwrap().capacity.memory_mb = 500;
        model(&mut s, "c", &[1], 1, 100);
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert!(p.assignments.contains(&a("w1", "a", 1)), "{p:?}");
        assert!(p.assignments.contains(&a("w2", "c", 1)), "the new model goes where there is room: {p:?}");
        assert_eq!(
            overcommitted(&s, &p.assignments),
            vec![Overcommit { worker: "w1".into(), memory_mb: 600, capacity_mb: 500, models: 1, max_models: 0 }]
        );
    }

    /// A model whose declaration was rejected (never seen valid) keeps its placements, and they
    /// keep their room: nothing new overfills their workers.
    #[test]
    fn a_frozen_models_replicas_hold_their_workers_room() {
        let mut s = FleetState::default();
        worker(&mut s, "w1", 0, 1);
        worker(&mut s, "w2", 1000, 0);
        model(&mut s, "b", &[1], 2, 600);
        s.placements.insert(a("w1", "a", 1));
        s.placements.insert(a("w2", "c", 1));
        let frozen = BTreeMap::from([(a("w1", "a", 1), 0), (a("w2", "c", 1), 600)]);
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &frozen);
        assert!(p.assignments.is_empty(), "{p:?}");
        assert_eq!(p.unplaced, vec![("b".to_string(), 1, 2)]);
    }

    /// Small models placed first could split the free memory so that a big one fits nowhere;
    /// the biggest go first.
    #[test]
    fn the_models_needing_the_most_memory_are_placed_first() {
        let mut s = FleetState::default();
        worker(&mut s, "w1", 1000, 0);
        worker(&mut s, "w2", 1000, 0);
        model(&mut s, "a", &[1], 1, 500);
        model(&mut s, "b", &[1], 1, 500);
        model(&mut s, "c", &[1], 1, 1000);
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert!(p.unplaced.is_empty(), "{p:?}");
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "c", 1), a("w2", "a", 1), a("w2", "b", 1)]));
    }

    /// A worker that re-registered (a new lease) writes its record before its statuses: until
    /// they land, its replica is kept over a replacement known to be still loading.
    #[test]
    fn a_replica_with_no_status_yet_is_kept_over_one_still_loading() {
        let mut s = FleetState::default();
        worker(&mut s, "w1", 0, 0);
        worker(&mut s, "w2", 0, 0);
        model(&mut s, "m", &[1], 1, 0);
        s.placements.insert(a("w1", "m", 1));
        s.placements.insert(a("w2", "m", 1));
        status(&mut s, "w1", "m", 1, Some((ModelState::Loading, "")));
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w2", "m", 1)]));
        // READY still comes first.
        status(&mut s, "w1", "m", 1, Some((ModelState::Ready, "")));
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1)]));
    }

    /// A drain key with an invalid value (`etcdctl put …/drain/w1 ''`) still drains: the
    /// worker gets no placement, and no traffic (the routing table reads the same drains).
    #[test]
    fn an_invalid_drain_value_still_drains_the_worker() {
        let keys = nereid_common::fleet::Keys::new("/n").unwrap();
        let record = |id: &str| format!(r#"{{"schema":1,"id":"{id}","grpc":"127.0.0.1:9","state":"ready"}}"#);
        let (w1, w2) = (record("w1"), record("w2"));
        let (s, rejected) = FleetState::from_kvs(
            &keys,
            [
                (b"/n/workers/w1".as_slice(), w1.as_bytes()),
                (b"/n/workers/w2", w2.as_bytes()),
                (b"/n/models/m", br#"{"schema":1,"versions":[1],"replicas":2}"#),
                (b"/n/drain/w1", b""),
            ],
        );
        assert_eq!(rejected.len(), 1, "still reported: {rejected:?}");
        assert!(s.drains.contains_key("w1") && !s.is_active("w1"));
        let p = plan(&s, &BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w2", "m", 1)]));
        assert_eq!(p.unplaced, vec![("m".to_string(), 1, 1)]);
    }

    proptest! {
        #[test]
        fn plan_invariants(
            workers in proptest::collection::vec((0u64..2000, 0u32..4, 0u8..3, 0u8..3), 0..6),
            models in proptest::collection::vec((1usize..3, 1u32..4, 0u64..800, 0u8..3), 0..5),
            existing in proptest::collection::vec((0usize..6, 0usize..5, 1i64..3, 0u8..4), 0..10),
            statuses in proptest::collection::vec((0usize..6, 0usize..5, 1i64..3, 0u8..3), 0..10),
            vanished_mask in 0u8..64,
        ) {
            // Workers labelled zone=a, zone=b or nothing; models selecting one zone or none.
            let zones = ["", "a", "b"];
            let mut s = FleetState::default();
            for (i, (mem, max, how, zone)) in workers.iter().enumerate() {
                let id = format!("w{i}");
                worker(&mut s, &id, *mem, *max);
                match how {
                    1 => s.workers.get_mut(&id).unwrap().state = WorkerState::Draining,
                    2 => { s.drains.insert(id.clone(), DrainRecord { schema: 1, reason: String::new() }); }
                    _ => {}
                }
                if *zone > 0 {
                    s.workers.get_mut(&id).unwrap().labels.insert("zone".into(), zones[*zone as usize].into());
                }
            }
            for (i, (nv, replicas, mem, zone)) in models.iter().enumerate() {
                let versions: Vec<i64> = (1..=*nv as i64).collect();
                let name = format!("m{i}");
                model(&mut s, &name, &versions, *replicas, *mem);
                if *zone > 0 {
                    s.models.get_mut(&name).unwrap().selector.insert("zone".into(), zones[*zone as usize].into());
                }
            }
            // Most placements with a status of their own (the hand-over rules need READY ones),
            // more statuses at random (a version loaded where it is not placed).
            let states = [ModelState::Ready, ModelState::Loading, ModelState::Failed];
            for (w, m, v, st) in existing {
                let (w, m) = (format!("w{w}"), format!("m{m}"));
                if let Some(state) = states.get(st as usize) {
                    status(&mut s, &w, &m, v, Some((*state, "")));
                }
                s.placements.insert((w, m, v));
            }
            for (w, m, v, st) in statuses {
                status(&mut s, &format!("w{w}"), &format!("m{m}"), v, Some((states[st as usize], "")));
            }
            // Registered workers among them are back: not vanished for the plan.
            let vanished: BTreeSet<String> =
                (0..6).filter(|i| vanished_mask & (1 << i) != 0).map(|i| format!("w{i}")).collect();
            let status_of = |w: &str, m: &str, v: i64| {
                s.statuses.get(w).and_then(|x| x.get(&(m.to_string(), v))).map(|x| x.state)
            };
            let matches = |w: &str, m: &str| {
                s.models[m].selector.iter().all(|(k, v)| s.workers[w].labels.get(k) == Some(v))
            };
            let p = plan(&s, &BTreeSet::new(), &vanished, &BTreeMap::new());
            let mut per_version: BTreeMap<(String, i64), u32> = BTreeMap::new();
            let mut ready_active: BTreeMap<(String, i64), u32> = BTreeMap::new();
            let mut handing: BTreeMap<(String, i64), u32> = BTreeMap::new();
            let mut gone: BTreeMap<(String, i64), u32> = BTreeMap::new();
            prop_assert!(p.handing_over.is_subset(&p.assignments));
            prop_assert!(p.vanished.is_subset(&p.assignments));
            prop_assert!(p.retiring.is_subset(&p.assignments));
            for (w, m, v) in &p.assignments {
                let assignment = (w.clone(), m.clone(), *v);
                if p.retiring.contains(&assignment) {
                    // Only a READY replica that was already there, of a version no longer
                    // declared, on an active worker, while a declared version still loads.
                    prop_assert!(!s.models[m].versions.contains(v));
                    prop_assert!(s.placements.contains(&assignment) && s.is_active(w));
                    prop_assert_eq!(status_of(w, m, *v), Some(ModelState::Ready));
                    let loading = p.assignments.iter().any(|(w2, m2, v2)| {
                        m2 == m && s.models[m].versions.contains(v2) && status_of(w2, m2, *v2) != Some(ModelState::Ready)
                    });
                    let failing = p.unplaced.iter().any(|(um, uv, _)| {
                        um == m && s.statuses.values().any(|st| st.get(&(m.clone(), *uv)).is_some_and(|x| x.state == ModelState::Failed))
                    });
                    // Or short for lack of room: then at least one of its retired replicas
                    // was released, to make room.
                    let short = p.unplaced.iter().any(|(um, _, _)| um == m);
                    let released = s.placements.iter().any(|a @ (w2, m2, v2)| {
                        m2 == m && !s.models[m].versions.contains(v2) && s.is_active(w2)
                            && status_of(w2, m2, *v2) == Some(ModelState::Ready) && !p.assignments.contains(a)
                    });
                    prop_assert!(
                        loading || failing || (short && released),
                        "{m}/{v} kept on {w} with nothing loading or failing, and none released for room"
                    );
                    continue;
                }
                prop_assert!(s.models[m].versions.contains(v));
                prop_assert_ne!(status_of(w, m, *v), Some(ModelState::Failed));
                if !s.workers.contains_key(w) {
                    // Only a placement that was already there, on a worker vanished lately.
                    prop_assert!(p.vanished.contains(&assignment), "assigned to unregistered {w}");
                    prop_assert!(vanished.contains(w));
                    prop_assert!(s.placements.contains(&assignment));
                    *gone.entry((m.clone(), *v)).or_default() += 1;
                } else if s.is_active(w) && matches(w, m) {
                    prop_assert!(!p.handing_over.contains(&assignment));
                    prop_assert!(!p.vanished.contains(&assignment));
                    *per_version.entry((m.clone(), *v)).or_default() += 1;
                    if status_of(w, m, *v) == Some(ModelState::Ready) {
                        *ready_active.entry((m.clone(), *v)).or_default() += 1;
                    }
                } else {
                    // Only a READY replica that was already there, on a registered worker that
                    // is inactive or no longer matches the selector.
                    prop_assert!(p.handing_over.contains(&assignment), "assigned to inactive or unmatched {w}");
                    prop_assert!(!p.vanished.contains(&assignment));
                    prop_assert!(s.placements.contains(&assignment));
                    prop_assert_eq!(status_of(w, m, *v), Some(ModelState::Ready));
                    *handing.entry((m.clone(), *v)).or_default() += 1;
                }
            }
            for ((m, v), n) in &per_version {
                prop_assert!(*n <= s.models[m].replicas, "{m}/{v} has {n} replicas");
            }
            // Handed-over replicas only stand in for replacements still loading (or, with no
            // READY replica on an active matching worker, as the one last resort), and an
            // exiting worker's only for a replacement that is loading.
            for ((m, v), n) in &handing {
                let r = ready_active.get(&(m.clone(), *v)).copied().unwrap_or(0);
                let active = per_version.get(&(m.clone(), *v)).copied().unwrap_or(0);
                prop_assert!(n + r <= s.models[m].replicas, "{m}/{v}: {n} handing over, {r} READY");
                prop_assert!(*n <= (active - r).max(u32::from(r == 0)), "{m}/{v}: {n} kept, {r} of {active} READY");
                let exiting = p
                    .handing_over
                    .iter()
                    .filter(|(w, hm, hv)| hm == m && hv == v && s.workers[w].state == WorkerState::Draining)
                    .count() as u32;
                prop_assert!(exiting <= active - r, "{m}/{v}: {exiting} exiting kept, {r} of {active} READY");
            }
            // Vanished workers' placements stand in only for READY replicas still missing.
            for ((m, v), n) in &gone {
                let r = ready_active.get(&(m.clone(), *v)).copied().unwrap_or(0);
                prop_assert!(n + r <= s.models[m].replicas, "{m}/{v}: {n} vanished kept, {r} READY");
            }
            // New placements never overfill a worker (kept ones predate capacity changes),
            // counting the replicas it is handing over.
            for (id, w) in &s.workers {
                let new: Vec<_> = p.assignments.iter().filter(|a| &a.0 == id && !s.placements.contains(*a)).collect();
                if new.is_empty() { continue; }
                prop_assert!(s.is_active(id));
                let all: Vec<_> = p.assignments.iter().filter(|a| &a.0 == id).collect();
                let mem: u64 = all.iter().map(|a| s.models[&a.1].resources.memory_mb).sum();
                if w.capacity.memory_mb > 0 { prop_assert!(mem <= w.capacity.memory_mb); }
                if w.capacity.max_models > 0 { prop_assert!(all.len() as u32 <= w.capacity.max_models); }
            }
            // Declared demand is either met (on active matching workers) or reported unplaced.
            for (m, d) in &s.models {
                for v in &d.versions {
                    let have = per_version.get(&(m.clone(), *v)).copied().unwrap_or(0);
                    let missing = p.unplaced.iter().find(|u| &u.0 == m && u.1 == *v).map_or(0, |u| u.2);
                    prop_assert_eq!(have + missing, d.replicas);
                }
            }
            // Deterministic, and a re-plan from its own output changes nothing — unless the plan
            // removed a READY replica from an active worker no longer matching its selector:
            // its room was still charged to that worker, and the next plan may use it. That
            // happens at most once per such replica (nothing new is placed on an unmatched
            // worker), so re-planning settles.
            prop_assert_eq!(&plan(&s, &BTreeSet::new(), &vanished, &BTreeMap::new()), &p);
            let (mut current, mut planned) = (s.clone(), p.clone());
            for _ in 0..=s.placements.len() {
                // (Likewise a READY replica of a version no longer declared, dropped because
                // nothing of the declared versions was loading.)
                let freed = current.placements.iter().any(|a @ (w, m, v)| {
                    !planned.assignments.contains(a)
                        && current.is_active(w)
                        && current.models.get(m).is_some_and(|d| !d.versions.contains(v) || !matches(w, m))
                        && status_of(w, m, *v) == Some(ModelState::Ready)
                });
                current.placements = planned.assignments.clone();
                let next = plan(&current, &BTreeSet::new(), &vanished, &BTreeMap::new());
                if !freed {
                    prop_assert_eq!(&next.assignments, &planned.assignments);
                    break;
                }
                planned = next;
            }
            prop_assert_eq!(plan(&current, &BTreeSet::new(), &vanished, &BTreeMap::new()).assignments, planned.assignments);
        }
    }
}
