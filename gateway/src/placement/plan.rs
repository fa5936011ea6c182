//! The placement plan: a pure function from the fleet state to the set of (worker, model,
//! version) assignments that should exist.
//!
//! - Every declared version gets `replicas` workers, at most one replica per worker.
//! - Only *active* workers (registered, not draining, not drained) are given replicas.
//! - Capacity: a worker's `memory_mb` (when non-zero) bounds the sum of its assignments'
//!   `resources.memory_mb`; `max_models` (when non-zero) bounds their count.
//! - Stability: an existing assignment stays while it is valid (its worker active, the version
//!   still declared, its load not FAILED), so a re-plan moves nothing that works.
//! - Hand-over, make before break: a READY replica on a worker that is draining or drained (still
//!   registered) is replaced on an active worker, but its own assignment stays until the
//!   replacement is READY — removing it first would leave a `replicas: 1` model with no READY
//!   holder for as long as the replacement loads. Such a replica holds no slot (its replacement
//!   is placed as if it were gone) and uses no active worker's capacity; at most one stays per
//!   replacement still loading. Only a READY one is kept (one still loading serves nobody).
//! - Last resort: when a version has no READY replica on any active worker and none can be
//!   placed (no room, no other worker), a worker drained by the operator (`drain/<w>`) keeps one
//!   READY replica of it, until a replacement is READY — draining the last holder never takes a
//!   model offline. A worker draining itself does not: it is exiting, there is nothing to wait
//!   for. With another READY replica on an active worker, a drained worker's replica goes even
//!   if its replacement cannot be placed (reported unplaced).
//! - New replicas go, in order, to the worker with the fewest versions of the same model, then
//!   the fewest assignments, then the most free memory, then the smallest id — spreading models
//!   and load, deterministically.
//! - A worker where a version's load failed is not chosen for it again (`excluded`).
//! - A model with a `selector` goes only to workers carrying every label of it (an existing
//!   assignment on a worker that no longer matches is dropped).

use std::collections::{BTreeMap, BTreeSet};

use nereid_common::fleet::records::{ModelState, WorkerState};
use nereid_common::fleet::{Assignment, FleetState};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Every assignment that should exist, [`Plan::handing_over`] included.
    pub assignments: BTreeSet<Assignment>,
    /// (model, version, replicas missing) for versions no worker has room for.
    pub unplaced: Vec<(String, i64, u32)>,
    /// READY replicas on draining or drained workers, kept (in `assignments`) until their
    /// replacements on active workers are READY, or as a version's last resort.
    pub handing_over: BTreeSet<Assignment>,
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

/// READY holders of one version on registered workers that take no placements.
#[derive(Default)]
struct Inactive<'a> {
    /// Draining themselves: exiting.
    exiting: Vec<&'a str>,
    /// Drained by the operator, still serving.
    drained: Vec<&'a str>,
}

/// Plans from `state`; `excluded` lists assignments known to fail (beyond the FAILED statuses
/// currently in `state`).
pub fn plan(state: &FleetState, excluded: &BTreeSet<Assignment>) -> Plan {
    let failed = |w: &str, m: &str, v: i64| {
        excluded.contains(&(w.to_string(), m.to_string(), v))
            || state
                .statuses
                .get(w)
                .and_then(|s| s.get(&(m.to_string(), v)))
                .is_some_and(|s| s.state == ModelState::Failed)
    };
    let memory_of = |m: &str| state.models.get(m).map_or(0, |d| d.resources.memory_mb);
    let matches = |w: &str, m: &str| {
        let (Some(worker), Some(model)) = (state.workers.get(w), state.models.get(m)) else { return false };
        model.selector.iter().all(|(k, v)| worker.labels.get(k) == Some(v))
    };
    let ready = |w: &str, m: &str, v: i64| {
        state.statuses.get(w).and_then(|s| s.get(&(m.to_string(), v))).is_some_and(|s| s.state == ModelState::Ready)
    };
    let active: Vec<&String> = state.workers.keys().filter(|w| state.is_active(w)).collect();
    let mut load: BTreeMap<&str, Load> = active.iter().map(|w| (w.as_str(), Load::default())).collect();

    // Keep what is valid, up to the declared replica count (READY ones first).
    let mut kept: BTreeMap<(String, i64), Vec<String>> = BTreeMap::new();
    let mut existing: Vec<&Assignment> = state
        .placements
        .iter()
        .filter(|(w, m, v)| {
            load.contains_key(w.as_str())
                && state.models.get(m).is_some_and(|d| d.versions.contains(v))
                && matches(w, m)
                && !failed(w, m, *v)
        })
        .collect();
    existing.sort_by_key(|a| (!ready(&a.0, &a.1, a.2), (*a).clone()));
    for (w, m, v) in existing {
        let replicas = state.models[m].replicas as usize;
        let holders = kept.entry((m.clone(), *v)).or_default();
        if holders.len() < replicas {
            holders.push(w.clone());
            let l = load.get_mut(w.as_str()).expect("active worker");
            l.memory_mb += memory_of(m);
            l.count += 1;
            *l.per_model.entry(m.clone()).or_default() += 1;
        }
    }

    // Add the missing replicas.
    let mut unplaced = Vec::new();
    for (model, decl) in &state.models {
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
                let l = load.get_mut(w.as_str()).expect("active worker");
                l.memory_mb += need;
                l.count += 1;
                *l.per_model.entry(model.clone()).or_default() += 1;
                holders.push((*w).clone());
            }
        }
    }

    // Hand-over: READY replicas on registered but inactive workers, per version, the ones on
    // workers that are exiting (draining themselves) first. Counted after the additions: a new
    // holder that already has the version loaded (READY before it was placed there) releases
    // an inactive one at once.
    let mut inactive: BTreeMap<(&str, i64), Inactive> = BTreeMap::new();
    for (w, m, v) in &state.placements {
        let Some(record) = state.workers.get(w) else { continue };
        let valid = !state.is_active(w)
            && state.models.get(m).is_some_and(|d| d.versions.contains(v))
            && matches(w, m)
            && !failed(w, m, *v)
            && ready(w, m, *v);
        if valid {
            let holders = inactive.entry((m.as_str(), *v)).or_default();
            if record.state == WorkerState::Draining { holders.exiting.push(w) } else { holders.drained.push(w) }
        }
    }
    let mut handing_over = BTreeSet::new();
    for ((m, v), Inactive { exiting, drained }) in inactive {
        let holders = kept.get(&(m.to_string(), v)).map(Vec::as_slice).unwrap_or_default();
        let ready_active = holders.iter().filter(|w| ready(w, m, v)).count();
        let loading = holders.len() - ready_active;
        // One for each replacement still loading; and, when the version has no READY replica on
        // an active worker at all, one anyway — on an operator-drained worker only: an exiting
        // one cannot be the last resort.
        let missing = (state.models[m].replicas as usize).saturating_sub(ready_active);
        let slots = loading.max(usize::from(ready_active == 0)).min(missing);
        let keep_exiting = exiting.len().min(loading).min(slots);
        let keep_drained = drained.len().min(slots - keep_exiting);
        for w in exiting.into_iter().take(keep_exiting).chain(drained.into_iter().take(keep_drained)) {
            handing_over.insert((w.to_string(), m.to_string(), v));
        }
    }

    let mut assignments: BTreeSet<Assignment> =
        kept.into_iter().flat_map(|((m, v), ws)| ws.into_iter().map(move |w| (w, m.clone(), v))).collect();
    assignments.extend(handing_over.iter().cloned());
    Plan { assignments, unplaced, handing_over }
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

    #[test]
    fn spreads_replicas_and_respects_capacity() {
        let mut s = FleetState::default();
        for w in ["w1", "w2", "w3"] {
            worker(&mut s, w, 1000, 0);
        }
        model(&mut s, "big", &[1], 2, 600);
        model(&mut s, "small", &[1, 2], 2, 100);
        let p = plan(&s, &BTreeSet::new());
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
        // Not enough room: reported, not over-committed.
        model(&mut s, "huge", &[1], 2, 900);
        let p = plan(&s, &BTreeSet::new());
        assert_eq!(p.unplaced, vec![("huge".to_string(), 1, 1)]);
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
        let p = plan(&s, &BTreeSet::new());
        assert!(p.assignments.contains(&a("w3", "m", 1)), "stable: {p:?}");
        assert_eq!(p.assignments.len(), 2);

        // w3 leaves: its replica moves; a draining worker and a drained one get nothing.
        s.placements = p.assignments.clone();
        s.workers.remove("w3");
        s.workers.get_mut("w2").unwrap().state = WorkerState::Draining;
        worker(&mut s, "w4", 0, 0);
        worker(&mut s, "w5", 0, 0);
        s.drains.insert("w5".into(), DrainRecord { schema: 1, reason: String::new() });
        let p = plan(&s, &BTreeSet::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w4", "m", 1)]));

        // A failed load moves the replica elsewhere and is not retried there.
        s.placements = p.assignments.clone();
        s.workers.get_mut("w2").unwrap().state = WorkerState::Ready;
        s.statuses
            .entry("w4".into())
            .or_default()
            .insert(("m".into(), 1), StatusRecord { schema: 1, state: ModelState::Failed, reason: "boom".into() });
        let p = plan(&s, &BTreeSet::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1)]));
        let p = plan(&s, &BTreeSet::from([a("w2", "m", 1)]));
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1)]));
        assert_eq!(p.unplaced, vec![("m".to_string(), 1, 1)]);

        // Fewer replicas declared: extras are dropped; an undeclared model is removed.
        model(&mut s, "m", &[1], 1, 0);
        s.placements.insert(a("w9", "gone", 1));
        let p = plan(&s, &BTreeSet::new());
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
        let p = plan(&s, &BTreeSet::new());
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
        let p = plan(&s, &BTreeSet::new());
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
            assert_eq!(plan(&s, &BTreeSet::new()).assignments, BTreeSet::from([a("w1", "m", 1)]), "stable");

            if how == "operator drain" {
                s.drains.insert("w1".into(), DrainRecord { schema: 1, reason: String::new() });
            } else {
                s.workers.get_mut("w1").unwrap().state = WorkerState::Draining;
            }
            // Make: the replacement is placed, the drained replica stays.
            let p = plan(&s, &BTreeSet::new());
            assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1)]), "{how}");
            assert_eq!(p.handing_over, BTreeSet::from([a("w1", "m", 1)]), "{how}");
            assert!(p.unplaced.is_empty(), "{how}: {p:?}");

            // Still loading (or FAILED-then-excluded elsewhere): nothing changes.
            s.placements = p.assignments.clone();
            status(&mut s, "w2", "m", 1, Some((ModelState::Loading, "")));
            assert_eq!(plan(&s, &BTreeSet::new()), p, "{how}");

            // Break: the replacement is READY, the drained replica goes.
            status(&mut s, "w2", "m", 1, Some((ModelState::Ready, "")));
            let p = plan(&s, &BTreeSet::new());
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
        let p = plan(&s, &BTreeSet::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1), a("w3", "m", 1)]));
        s.placements = p.assignments.clone();
        status(&mut s, "w3", "m", 1, Some((ModelState::Ready, "")));
        assert_eq!(plan(&s, &BTreeSet::new()).assignments, BTreeSet::from([a("w2", "m", 1), a("w3", "m", 1)]));

        // Both drained, one still loading: only the READY one is worth keeping.
        let mut s2 = s.clone();
        s2.placements = BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1)]);
        s2.statuses.clear();
        status(&mut s2, "w1", "m", 1, Some((ModelState::Ready, "")));
        status(&mut s2, "w2", "m", 1, Some((ModelState::Loading, "")));
        s2.drains.insert("w2".into(), DrainRecord { schema: 1, reason: String::new() });
        let p = plan(&s2, &BTreeSet::new());
        assert_eq!(p.handing_over, BTreeSet::from([a("w1", "m", 1)]));
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1), a("w3", "m", 1), a("w4", "m", 1)]));
        // One replacement READY, the other still loading: the drained replica stays for it.
        s2.placements = p.assignments.clone();
        status(&mut s2, "w3", "m", 1, Some((ModelState::Ready, "")));
        assert_eq!(plan(&s2, &BTreeSet::new()).handing_over, BTreeSet::from([a("w1", "m", 1)]));
        status(&mut s2, "w4", "m", 1, Some((ModelState::Ready, "")));
        assert!(plan(&s2, &BTreeSet::new()).handing_over.is_empty());
        s2.placements = BTreeSet::from([a("w1", "m", 1), a("w2", "m", 1)]);
        status(&mut s2, "w3", "m", 1, None);
        status(&mut s2, "w4", "m", 1, None);

        // Deregistered (lease gone), undeclared, or FAILED: nothing to hand over.
        let mut s3 = s2.clone();
        s3.workers.remove("w1");
        assert!(plan(&s3, &BTreeSet::new()).handing_over.is_empty());
        let mut s4 = s2.clone();
        model(&mut s4, "m", &[2], 2, 0);
        assert!(plan(&s4, &BTreeSet::new()).handing_over.is_empty());
        assert!(plan(&s2, &BTreeSet::from([a("w1", "m", 1)])).handing_over.is_empty());
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
        let p = plan(&s, &BTreeSet::new());
        // Only one of them fits on w2 (400 of 500 MiB): a is handed over; b, with nowhere to go
        // and no other READY replica, stays on the drained worker as the last resort (and is
        // reported unplaced).
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "a", 1), a("w1", "b", 1), a("w2", "a", 1)]));
        assert_eq!(p.unplaced, vec![("b".to_string(), 1, 1)]);
        assert_eq!(p.handing_over, BTreeSet::from([a("w1", "a", 1), a("w1", "b", 1)]));
        s.placements = p.assignments.clone();
        status(&mut s, "w2", "a", 1, Some((ModelState::Ready, "")));
        let p = plan(&s, &BTreeSet::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "b", 1), a("w2", "a", 1)]));
        assert_eq!(p.unplaced, vec![("b".to_string(), 1, 1)]);
        // Room appears: b is placed there, then leaves w1 once READY.
        s.placements = p.assignments.clone();
        worker(&mut s, "w3", 500, 0);
        let p = plan(&s, &BTreeSet::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "b", 1), a("w2", "a", 1), a("w3", "b", 1)]));
        s.placements = p.assignments.clone();
        status(&mut s, "w3", "b", 1, Some((ModelState::Ready, "")));
        assert_eq!(plan(&s, &BTreeSet::new()).assignments, BTreeSet::from([a("w2", "a", 1), a("w3", "b", 1)]));
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
        let p = plan(&s, &BTreeSet::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w1", "m", 1)]));
        assert_eq!(p.handing_over, p.assignments);
        assert_eq!(p.unplaced, vec![("m".to_string(), 1, 1)]);

        s.workers.get_mut("w1").unwrap().state = WorkerState::Draining;
        let p = plan(&s, &BTreeSet::new());
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
        let p = plan(&s, &BTreeSet::new());
        assert_eq!(p.assignments, BTreeSet::from([a("w2", "m", 1)]));
        assert_eq!(p.unplaced, vec![("m".to_string(), 1, 1)]);
    }

    proptest! {
        #[test]
        fn plan_invariants(
            workers in proptest::collection::vec((0u64..2000, 0u32..4, 0u8..3), 0..6),
            models in proptest::collection::vec((1usize..3, 1u32..4, 0u64..800), 0..5),
            existing in proptest::collection::vec((0usize..6, 0usize..5, 1i64..3), 0..10),
            statuses in proptest::collection::vec((0usize..6, 0usize..5, 1i64..3, 0u8..3), 0..10),
        ) {
            let mut s = FleetState::default();
            for (i, (mem, max, how)) in workers.iter().enumerate() {
                let id = format!("w{i}");
                worker(&mut s, &id, *mem, *max);
                match how {
                    1 => s.workers.get_mut(&id).unwrap().state = WorkerState::Draining,
                    2 => { s.drains.insert(id.clone(), DrainRecord { schema: 1, reason: String::new() }); }
                    _ => {}
                }
            }
            for (i, (nv, replicas, mem)) in models.iter().enumerate() {
                let versions: Vec<i64> = (1..=*nv as i64).collect();
                model(&mut s, &format!("m{i}"), &versions, *replicas, *mem);
            }
            for (w, m, v) in existing {
                s.placements.insert((format!("w{w}"), format!("m{m}"), v));
            }
            let states = [ModelState::Ready, ModelState::Loading, ModelState::Failed];
            for (w, m, v, st) in statuses {
                status(&mut s, &format!("w{w}"), &format!("m{m}"), v, Some((states[st as usize], "")));
            }
            let status_of = |w: &str, m: &str, v: i64| {
                s.statuses.get(w).and_then(|x| x.get(&(m.to_string(), v))).map(|x| x.state)
            };
            let p = plan(&s, &BTreeSet::new());
            let mut per_version: BTreeMap<(String, i64), u32> = BTreeMap::new();
            let mut ready_active: BTreeMap<(String, i64), u32> = BTreeMap::new();
            let mut handing: BTreeMap<(String, i64), u32> = BTreeMap::new();
            prop_assert!(p.handing_over.is_subset(&p.assignments));
            for (w, m, v) in &p.assignments {
                prop_assert!(s.models[m].versions.contains(v));
                prop_assert_ne!(status_of(w, m, *v), Some(ModelState::Failed));
                if s.is_active(w) {
                    prop_assert!(!p.handing_over.contains(&(w.clone(), m.clone(), *v)));
                    *per_version.entry((m.clone(), *v)).or_default() += 1;
                    if status_of(w, m, *v) == Some(ModelState::Ready) {
                        *ready_active.entry((m.clone(), *v)).or_default() += 1;
                    }
                } else {
                    // Only a READY replica that was already there, on a registered worker.
                    prop_assert!(p.handing_over.contains(&(w.clone(), m.clone(), *v)), "assigned to inactive {w}");
                    prop_assert!(s.workers.contains_key(w));
                    prop_assert!(s.placements.contains(&(w.clone(), m.clone(), *v)));
                    prop_assert_eq!(status_of(w, m, *v), Some(ModelState::Ready));
                    *handing.entry((m.clone(), *v)).or_default() += 1;
                }
            }
            for ((m, v), n) in &per_version {
                prop_assert!(*n <= s.models[m].replicas, "{m}/{v} has {n} replicas");
            }
            // Handed-over replicas only stand in for replacements still loading (or, with no
            // READY replica on an active worker, as the one last resort), and an exiting
            // worker's only for a replacement that is loading.
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
            // New placements never overfill a worker (kept ones predate capacity changes).
            for (id, w) in &s.workers {
                let new: Vec<_> = p.assignments.iter().filter(|a| &a.0 == id && !s.placements.contains(*a)).collect();
                if new.is_empty() { continue; }
                prop_assert!(s.is_active(id));
                let all: Vec<_> = p.assignments.iter().filter(|a| &a.0 == id).collect();
                let mem: u64 = all.iter().map(|a| s.models[&a.1].resources.memory_mb).sum();
                if w.capacity.memory_mb > 0 { prop_assert!(mem <= w.capacity.memory_mb); }
                if w.capacity.max_models > 0 { prop_assert!(all.len() as u32 <= w.capacity.max_models); }
            }
            // Declared demand is either met (on active workers) or reported unplaced.
            for (m, d) in &s.models {
                for v in &d.versions {
                    let have = per_version.get(&(m.clone(), *v)).copied().unwrap_or(0);
                    let missing = p.unplaced.iter().find(|u| &u.0 == m && u.1 == *v).map_or(0, |u| u.2);
                    prop_assert_eq!(have + missing, d.replicas);
                }
            }
            // Deterministic, and a re-plan from its own output changes nothing.
            prop_assert_eq!(&plan(&s, &BTreeSet::new()), &p);
            let mut again = s.clone();
            again.placements = p.assignments.clone();
            prop_assert_eq!(plan(&again, &BTreeSet::new()).assignments, p.assignments.clone());
        }
    }
}
