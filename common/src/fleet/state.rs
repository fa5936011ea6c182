//! [`FleetState`]: the fleet as read from etcd — every record under the prefix, decoded and
//! validated — kept current by applying watch events. Gateways build routing tables from it, the
//! placement controller plans from it, `nereidctl` prints it.
//!
//! An invalid value never replaces a good one: [`FleetState::apply`] reports the rejection and
//! the key keeps its last good value (or stays absent) — except that an invalid `drain/<w>` with
//! no good value drains the worker all the same: the key's presence is the operator's intent (a
//! hand-written `etcdctl put …/drain/w1 ''`), and taking it as absent would send traffic and
//! placements to a worker being cordoned.

use std::collections::{BTreeMap, BTreeSet};

use super::keys::{Key, Keys};
use super::records::{self, DrainRecord, ModelRecord, PlacementRecord, RouteRecord, StatusRecord, WorkerRecord};

/// A (worker, model, version) triple.
pub type Assignment = (String, String, i64);

#[derive(Clone, Debug, Default, PartialEq)]
pub struct FleetState {
    pub workers: BTreeMap<String, WorkerRecord>,
    /// worker → (model, version) → status.
    pub statuses: BTreeMap<String, BTreeMap<(String, i64), StatusRecord>>,
    pub models: BTreeMap<String, ModelRecord>,
    pub placements: BTreeSet<Assignment>,
    pub routes: BTreeMap<String, RouteRecord>,
    pub drains: BTreeMap<String, DrainRecord>,
}

/// A value that was not applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// Bounded label: the key's kind.
    pub kind: &'static str,
    pub key: String,
    pub reason: String,
}

impl std::fmt::Display for Rejected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rejected {} value at {}: {}", self.kind, self.key, self.reason)
    }
}

impl FleetState {
    /// Applies a put (`Some(value)`) or a delete (`None`) of `key`. Returns whether anything
    /// changed; keys outside the schema are ignored. A put under a malformed key of one of the
    /// schema's kinds (`models/bad name`, `placement/w/m/01`) is rejected like an invalid value
    /// (so it is logged and counted, not silently dropped); its delete changes nothing.
    pub fn apply(&mut self, keys: &Keys, key: &[u8], value: Option<&[u8]>) -> Result<bool, Rejected> {
        let parsed = match keys.classify(key) {
            None => return Ok(false),
            Some(Ok(parsed)) => parsed,
            Some(Err(_)) if value.is_none() => return Ok(false),
            Some(Err(invalid)) => {
                return Err(Rejected {
                    kind: invalid.kind,
                    key: String::from_utf8_lossy(key).into_owned(),
                    reason: format!("malformed key: {}", invalid.reason),
                });
            }
        };
        let reject =
            |reason: String| Rejected { kind: parsed.kind(), key: String::from_utf8_lossy(key).into_owned(), reason };
        fn decoded<T: records::Record>(v: &[u8]) -> Result<T, String> {
            records::decode::<T>(v).map_err(|e| e.to_string())
        }
        Ok(match (&parsed, value) {
            (Key::Worker(id), Some(v)) => {
                let record: WorkerRecord = decoded(v).map_err(reject)?;
                if record.id != *id {
                    return Err(reject(format!("record id '{}' does not match the key", record.id)));
                }
                self.workers.insert(id.clone(), record.clone()) != Some(record)
            }
            // Only the record: a lease that expires deletes the statuses under it too, each
            // with an event of its own; a record deleted by hand (`etcdctl del`) leaves them,
            // and the worker, writing its record again, finds them still there.
            (Key::Worker(id), None) => self.workers.remove(id).is_some(),
            (Key::Status { worker, model, version }, Some(v)) => {
                let record: StatusRecord = decoded(v).map_err(reject)?;
                let per_worker = self.statuses.entry(worker.clone()).or_default();
                per_worker.insert((model.clone(), *version), record.clone()) != Some(record)
            }
            (Key::Status { worker, model, version }, None) => {
                let Some(per_worker) = self.statuses.get_mut(worker) else { return Ok(false) };
                let removed = per_worker.remove(&(model.clone(), *version)).is_some();
                if per_worker.is_empty() {
                    self.statuses.remove(worker);
                }
                removed
            }
            (Key::Model(m), Some(v)) => {
                let record: ModelRecord = decoded(v).map_err(reject)?;
                self.models.insert(m.clone(), record.clone()) != Some(record)
            }
            (Key::Model(m), None) => self.models.remove(m).is_some(),
            (Key::Placement { worker, model, version }, Some(v)) => {
                let _: PlacementRecord = decoded(v).map_err(reject)?;
                self.placements.insert((worker.clone(), model.clone(), *version))
            }
            (Key::Placement { worker, model, version }, None) => {
                self.placements.remove(&(worker.clone(), model.clone(), *version))
            }
            (Key::Route(m), Some(v)) => {
                let record: RouteRecord = decoded(v).map_err(reject)?;
                self.routes.insert(m.clone(), record.clone()) != Some(record)
            }
            (Key::Route(m), None) => self.routes.remove(m).is_some(),
            (Key::Drain(w), Some(v)) => match decoded::<DrainRecord>(v) {
                Ok(record) => self.drains.insert(w.clone(), record.clone()) != Some(record),
                Err(e) => {
                    // Fail safe: drained, though still rejected (logged and counted).
                    self.drains.entry(w.clone()).or_insert_with(invalid_drain);
                    return Err(reject(e));
                }
            },
            (Key::Drain(w), None) => self.drains.remove(w).is_some(),
            (Key::Other, _) => false,
        })
    }

    /// Builds a state from a full read (`(key, value)` pairs), with every rejection.
    pub fn from_kvs<'a>(
        keys: &Keys,
        kvs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
    ) -> (FleetState, Vec<Rejected>) {
        FleetState::default().reread(keys, kvs)
    }

    /// Re-reads the whole state from `kvs`; a key whose new value is rejected keeps the value
    /// it has in `self` (the last good one).
    pub fn reread<'a>(
        &self,
        keys: &Keys,
        kvs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
    ) -> (FleetState, Vec<Rejected>) {
        let mut state = FleetState::default();
        let mut rejected = Vec::new();
        for (k, v) in kvs {
            if let Err(r) = state.apply(keys, k, Some(v)) {
                if let Some(parsed) = keys.parse(k) {
                    state.carry(self, &parsed);
                }
                rejected.push(r);
            }
        }
        (state, rejected)
    }

    /// Copies the entry for `key` from `from`, if it has one.
    fn carry(&mut self, from: &FleetState, key: &Key) {
        match key {
            Key::Worker(id) => {
                if let Some(w) = from.workers.get(id) {
                    self.workers.insert(id.clone(), w.clone());
                }
            }
            Key::Status { worker, model, version } => {
                if let Some(s) = from.statuses.get(worker).and_then(|m| m.get(&(model.clone(), *version))) {
                    self.statuses.entry(worker.clone()).or_default().insert((model.clone(), *version), s.clone());
                }
            }
            Key::Model(m) => {
                if let Some(r) = from.models.get(m) {
                    self.models.insert(m.clone(), r.clone());
                }
            }
            Key::Placement { worker, model, version } => {
                let a = (worker.clone(), model.clone(), *version);
                if from.placements.contains(&a) {
                    self.placements.insert(a);
                }
            }
            Key::Route(m) => {
                if let Some(r) = from.routes.get(m) {
                    self.routes.insert(m.clone(), r.clone());
                }
            }
            Key::Drain(w) => {
                if let Some(r) = from.drains.get(w) {
                    self.drains.insert(w.clone(), r.clone());
                }
            }
            Key::Other => {}
        }
    }

    /// Whether the worker takes traffic and placements: registered, not draining itself, not
    /// drained by an operator (by a drain key, valid or not).
    pub fn is_active(&self, worker: &str) -> bool {
        self.workers.get(worker).is_some_and(|w| w.state == records::WorkerState::Ready)
            && !self.drains.contains_key(worker)
    }
}

/// The drain standing for a `drain/<w>` whose value was rejected, with no good one to keep.
fn invalid_drain() -> DrainRecord {
    DrainRecord { schema: records::SCHEMA_VERSION, reason: INVALID_DRAIN_REASON.into() }
}

/// The reason of a drain whose value was rejected (shown by `nereidctl workers`).
const INVALID_DRAIN_REASON: &str = "invalid drain value: drained while the key exists";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::records::ModelState;

    fn worker_json(id: &str) -> String {
        format!(r#"{{"schema":1,"id":"{id}","grpc":"127.0.0.1:9","state":"ready"}}"#)
    }

    #[test]
    fn applies_events_and_keeps_last_good_values() {
        let keys = Keys::new("/n").unwrap();
        let (mut s, rejected) = FleetState::from_kvs(
            &keys,
            [
                (b"/n/workers/a".as_slice(), worker_json("a").as_bytes()),
                (b"/n/status/a/m/1", br#"{"schema":1,"state":"READY"}"#),
                (b"/n/models/m", br#"{"schema":1,"versions":[1],"replicas":2}"#),
                (b"/n/placement/a/m/1", br#"{"schema":1,"leader_revision":5}"#),
                (b"/n/workers/b", b"{not json"),
                (b"/n/leader/placement/1234", b"anything"),
            ],
        );
        assert_eq!(rejected.len(), 1);
        assert_eq!(rejected[0].kind, "worker");
        assert!(rejected[0].to_string().contains("/n/workers/b"), "{}", rejected[0]);
        assert!(s.is_active("a"));
        assert!(!s.is_active("b"));
        assert_eq!(s.statuses["a"][&("m".to_string(), 1)].state, ModelState::Ready);
        assert!(s.placements.contains(&("a".into(), "m".into(), 1)));

        // A bad update keeps the previous good value.
        let before = s.clone();
        let r = s.apply(&keys, b"/n/models/m", Some(br#"{"schema":2,"versions":[1],"replicas":2}"#)).unwrap_err();
        assert!(r.reason.contains("unknown schema version 2"), "{r}");
        let r = s.apply(&keys, b"/n/models/m", Some(br#"{"schema":1,"versions":[1],"replicas":-3}"#)).unwrap_err();
        assert_eq!(r.kind, "model");
        let r = s.apply(&keys, b"/n/workers/a", Some(worker_json("z").as_bytes())).unwrap_err();
        assert!(r.reason.contains("does not match"), "{r}");
        assert_eq!(s, before);

        // Same value again: no change. Drain, then lease expiry removes the worker, then its
        // statuses (each key deleted has its event). The record alone going leaves them: an
        // operator's `etcdctl del` of the record, which the worker writes again.
        assert!(!s.apply(&keys, b"/n/workers/a", Some(worker_json("a").as_bytes())).unwrap());
        assert!(s.apply(&keys, b"/n/drain/a", Some(br#"{"schema":1}"#)).unwrap());
        assert!(!s.is_active("a"));
        assert!(s.apply(&keys, b"/n/workers/a", None).unwrap());
        assert_eq!(s.statuses["a"][&("m".to_string(), 1)].state, ModelState::Ready);
        assert!(s.apply(&keys, b"/n/status/a/m/1", None).unwrap());
        assert!(s.statuses.is_empty());
        assert!(!s.apply(&keys, b"/other/workers/a", None).unwrap());
    }

    #[test]
    fn reread_keeps_last_good_values_of_rejected_keys() {
        let keys = Keys::new("/n").unwrap();
        let (old, _) = FleetState::from_kvs(
            &keys,
            [
                (b"/n/models/m".as_slice(), br#"{"schema":1,"versions":[1],"replicas":2}"#.as_slice()),
                (b"/n/models/gone", br#"{"schema":1,"versions":[1],"replicas":1}"#),
            ],
        );
        let (new, rejected) =
            old.reread(&keys, [(b"/n/models/m".as_slice(), br#"{"schema":1,"versions":[1],"replicas":0}"#.as_slice())]);
        assert_eq!(rejected.len(), 1);
        assert_eq!(new.models["m"].replicas, 2, "last good value kept");
        assert!(!new.models.contains_key("gone"), "deleted keys are gone");
    }

    /// A drain key present with an invalid value (`etcdctl put …/drain/w1 ''`) drains the
    /// worker, from a full read or a watch event, and is still reported; a good value it
    /// would replace is kept.
    #[test]
    fn an_invalid_drain_value_drains_the_worker_and_is_rejected() {
        let keys = Keys::new("/n").unwrap();
        let (mut s, rejected) = FleetState::from_kvs(
            &keys,
            [
                (b"/n/workers/w1".as_slice(), worker_json("w1").as_bytes()),
                (b"/n/workers/w2", worker_json("w2").as_bytes()),
                (b"/n/drain/w1", b""),
            ],
        );
        assert_eq!(rejected.iter().map(|r| (r.kind, r.key.as_str())).collect::<Vec<_>>(), [("drain", "/n/drain/w1")]);
        assert!(!s.is_active("w1"));
        assert!(s.is_active("w2"));
        assert_eq!(s.drains["w1"].reason, INVALID_DRAIN_REASON);

        // The same through a watch event; its delete un-drains.
        assert_eq!(s.apply(&keys, b"/n/drain/w2", Some(b"{not json")).unwrap_err().kind, "drain");
        assert!(!s.is_active("w2"));
        assert!(s.apply(&keys, b"/n/drain/w2", None).unwrap());
        assert!(s.is_active("w2"));

        // A good value is not replaced, by an event or a re-read.
        assert!(s.apply(&keys, b"/n/drain/w2", Some(br#"{"schema":1,"reason":"kernel"}"#)).unwrap());
        assert!(s.apply(&keys, b"/n/drain/w2", Some(b"")).is_err());
        assert_eq!(s.drains["w2"].reason, "kernel");
        let (again, rejected) = s.reread(&keys, [(b"/n/drain/w2".as_slice(), b"".as_slice())]);
        assert_eq!(rejected.len(), 1);
        assert_eq!(again.drains["w2"].reason, "kernel");
    }

    #[test]
    fn malformed_keys_are_rejected_and_never_alias_good_ones() {
        let keys = Keys::new("/n").unwrap();
        let placed = br#"{"schema":1,"leader_revision":5}"#.as_slice();
        let (mut s, rejected) = FleetState::from_kvs(
            &keys,
            [
                (b"/n/placement/w0/mlp_fp32/1".as_slice(), placed),
                (b"/n/placement/w0/mlp_fp32/01", placed),
                (b"/n/models/bad name", br#"{"schema":1,"versions":[1],"replicas":1}"#),
                (b"/n/leader/placement/694d", b"g1"),
            ],
        );
        let shown: Vec<(&str, &str)> = rejected.iter().map(|r| (r.kind, r.key.as_str())).collect();
        assert_eq!(shown, [("placement", "/n/placement/w0/mlp_fp32/01"), ("model", "/n/models/bad name")]);
        assert!(rejected[0].reason.contains("malformed key: version '01'"), "{}", rejected[0]);
        assert!(s.models.is_empty());
        // Deleting the alias leaves version 1's assignment alone.
        assert!(!s.apply(&keys, b"/n/placement/w0/mlp_fp32/01", None).unwrap());
        assert!(!s.apply(&keys, b"/n/placement/w0/mlp_fp32/+1", None).unwrap());
        assert!(s.placements.contains(&("w0".into(), "mlp_fp32".into(), 1)));
        let r = s.apply(&keys, b"/n/workers/a/b", Some(worker_json("a").as_bytes())).unwrap_err();
        assert_eq!(r.kind, "worker");
    }
}
