//! The placement plan: a pure function from the fleet state to the set of (worker, model,
//! version) assignments that should exist.
//!
//! - Every declared version gets `replicas` workers, at most one replica per worker.
//! - Only *active* workers (registered, not draining, not drained) hold assignments.
//! - Capacity: a worker's `memory_mb` (when non-zero) bounds the sum of its assignments'
//!   `resources.memory_mb`; `max_models` (when non-zero) bounds their count.
//! - Stability: an existing assignment stays while it is valid (its worker active, the version
//!   still declared, its load not FAILED), so a re-plan moves nothing that works.
//! - New replicas go, in order, to the worker with the fewest versions of the same model, then
//!   the fewest assignments, then the most free memory, then the smallest id — spreading models
//!   and load, deterministically.
//! - A worker where a version's load failed is not chosen for it again (`excluded`).
//! - A model with a `selector` goes only to workers carrying every label of it (an existing
//!   assignment on a worker that no longer matches is dropped).

use std::collections::{BTreeMap, BTreeSet};

use nereid_common::fleet::records::ModelState;
use nereid_common::fleet::{Assignment, FleetState};

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub assignments: BTreeSet<Assignment>,
    /// (model, version, replicas missing) for versions no worker has room for.
    pub unplaced: Vec<(String, i64, u32)>,
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
    let ready = |(w, m, v): &Assignment| {
        state.statuses.get(w).and_then(|s| s.get(&(m.clone(), *v))).is_some_and(|s| s.state == ModelState::Ready)
    };
    existing.sort_by_key(|a| (!ready(a), (*a).clone()));
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
    let assignments =
        kept.into_iter().flat_map(|((m, v), ws)| ws.into_iter().map(move |w| (w, m.clone(), v))).collect();
    Plan { assignments, unplaced }
}

#[cfg(test)]
mod tests {
    use nereid_common::fleet::records::{
        Capacity, DrainRecord, ModelRecord, Resources, StatusRecord, WorkerRecord, WorkerState,
    };
    use proptest::prelude::*;

    use super::*;

    fn worker(state: &mut FleetState, id: &str, memory_mb: u64, max_models: u32) {
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

    fn model(state: &mut FleetState, name: &str, versions: &[i64], replicas: u32, memory_mb: u64) {
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

    fn a(w: &str, m: &str, v: i64) -> Assignment {
        (w.into(), m.into(), v)
    }

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

    proptest! {
        #[test]
        fn plan_invariants(
            workers in proptest::collection::vec((0u64..2000, 0u32..4, any::<bool>()), 0..6),
            models in proptest::collection::vec((1usize..3, 1u32..4, 0u64..800), 0..5),
            existing in proptest::collection::vec((0usize..6, 0usize..5, 1i64..3), 0..10),
        ) {
            let mut s = FleetState::default();
            for (i, (mem, max, draining)) in workers.iter().enumerate() {
                let id = format!("w{i}");
                worker(&mut s, &id, *mem, *max);
                if *draining { s.workers.get_mut(&id).unwrap().state = WorkerState::Draining; }
            }
            for (i, (nv, replicas, mem)) in models.iter().enumerate() {
                let versions: Vec<i64> = (1..=*nv as i64).collect();
                model(&mut s, &format!("m{i}"), &versions, *replicas, *mem);
            }
            for (w, m, v) in existing {
                s.placements.insert((format!("w{w}"), format!("m{m}"), v));
            }
            let p = plan(&s, &BTreeSet::new());
            let mut per_version: BTreeMap<(String, i64), u32> = BTreeMap::new();
            for (w, m, v) in &p.assignments {
                prop_assert!(s.is_active(w), "assigned to inactive {w}");
                prop_assert!(s.models[m].versions.contains(v));
                *per_version.entry((m.clone(), *v)).or_default() += 1;
            }
            for ((m, v), n) in &per_version {
                prop_assert!(*n <= s.models[m].replicas, "{m}/{v} has {n} replicas");
            }
            // New placements never overfill a worker (kept ones predate capacity changes).
            for (id, w) in &s.workers {
                let new: Vec<_> = p.assignments.iter().filter(|a| &a.0 == id && !s.placements.contains(*a)).collect();
                if new.is_empty() { continue; }
                let all: Vec<_> = p.assignments.iter().filter(|a| &a.0 == id).collect();
                let mem: u64 = all.iter().map(|a| s.models[&a.1].resources.memory_mb).sum();
                if w.capacity.memory_mb > 0 { prop_assert!(mem <= w.capacity.memory_mb); }
                if w.capacity.max_models > 0 { prop_assert!(all.len() as u32 <= w.capacity.max_models); }
            }
            // Declared demand is either met or reported unplaced.
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
