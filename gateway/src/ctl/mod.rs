//! `nereidctl`, the operator CLI: reads the fleet's state from etcd and prints it ([`render`]),
//! and writes declared models, routes and drains — each value validated before it is sent (the
//! same [`records::encode`] every Nereid writer uses, plus checks against the fleet: a route may
//! only weight declared versions, a drain names a registered worker).
//!
//! Failure modes: invalid input, or a write the fleet's state refuses, is [`CtlError::Invalid`]
//! (exit 2, nothing written); etcd unreachable, slow (every call is bounded by
//! [`store::ETCD_TIMEOUT`]) or failing is [`CtlError::Failed`] (exit 1).

pub mod args;
pub mod render;
pub mod store;

use std::time::Duration;

use nereid_common::fleet::etcd_client::{Compare, CompareOp};
use nereid_common::fleet::records::{self, DrainRecord, ModelRecord, Record, Resources, RouteRecord};
use nereid_common::fleet::{FleetState, Rejected};
use serde_json::{Value, json};

pub use args::Cli;
use args::{Command, ModelCommand, Output, RoutesCommand};
use store::Store;

/// Why `nereidctl` stopped.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// Bad input, or refused by the fleet's state: nothing was written.
    #[error("{0}")]
    Invalid(String),
    /// etcd unreachable, too slow, failing, or changed under a conditional write.
    #[error("{0}")]
    Failed(String),
}

impl CtlError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CtlError::Invalid(_) => 2,
            CtlError::Failed(_) => 1,
        }
    }
}

/// Runs one command; what to print on stdout. Warnings (values in etcd every reader rejects,
/// routes left pointing at undeclared versions) go to stderr as they are found.
pub async fn run(cli: Cli) -> Result<String, CtlError> {
    let output = cli.output;
    let mut store = Store::connect(&cli.etcd_endpoints.0, cli.etcd_prefix).await?;
    match cli.command {
        Command::Workers => {
            let state = read_state(&mut store).await?;
            let rows = render::workers(&state);
            Ok(show(output, || render::workers_table(&rows), || render::workers_json(&rows)))
        }
        Command::Models => {
            let state = read_state(&mut store).await?;
            let rows = render::models(&state);
            Ok(show(output, || render::models_table(&rows), || render::models_json(&rows)))
        }
        Command::Placement => {
            let state = read_state(&mut store).await?;
            let rows = render::placement(&state);
            Ok(show(output, || render::placement_table(&rows), || render::placement_json(&rows)))
        }
        Command::Get => {
            let kvs = store.read_all().await?;
            let rows = render::keys(&store.keys, kvs.iter().map(|(k, v, l)| (k.as_slice(), v.as_slice(), *l)));
            Ok(show(output, || render::keys_table(&rows), || render::keys_json(&rows)))
        }
        Command::Model(ModelCommand::Declare { name, versions, replicas, memory_mb, cost_class, selector }) => {
            let mut labels = std::collections::BTreeMap::new();
            for (k, v) in selector {
                if let Some(before) = labels.insert(k.clone(), v.clone())
                    && before != v
                {
                    return Err(CtlError::Invalid(format!(
                        "--selector gives label {k} twice ({k}={before} and {k}={v}); a worker carries one value"
                    )));
                }
            }
            let (record, value) = model_record(&versions.0, replicas, memory_mb, cost_class, labels)?;
            if memory_mb == 0 {
                warn(&format!(
                    "--memory-mb not given: model {name} is not counted against workers' memory, so placement \
                     cannot keep it from overfilling a worker"
                ));
            }
            if !record.selector.is_empty() {
                let (state, _) = store.state().await?;
                let matching = state.workers.values().filter(|w| record.selects(&w.labels)).count();
                if matching == 0 {
                    warn(&format!(
                        "no registered worker carries every --selector label; model {name} stays unplaced until one does"
                    ));
                }
            }
            let key = store.keys.model(&name);
            let previous = store.put(&key, &value).await?;
            // A route may now weight a version no longer declared: say so (the write stands; a
            // failed read of the route only leaves the warning out).
            if let Some((route, _)) = store.get(&store.keys.route(&name)).await.ok().flatten()
                && let Ok(route) = records::decode::<RouteRecord>(&route)
            {
                let stale: Vec<String> =
                    route.weights.keys().filter(|v| !record.versions.contains(v)).map(i64::to_string).collect();
                if !stale.is_empty() {
                    warn(&format!(
                        "routes/{name} still weights version(s) {} that are no longer declared; \
                         update it with `nereidctl routes set {name} ...`",
                        stale.join(",")
                    ));
                }
            }
            let verb = if previous.is_some() { "redeclared" } else { "declared" };
            Ok(written(output, &format!("{verb} model {name}"), &key, Some(&value), previous.as_deref()))
        }
        Command::Model(ModelCommand::Remove { name }) => {
            let key = store.keys.model(&name);
            let Some(previous) = store.delete(&key).await? else {
                return Err(CtlError::Invalid(format!("model {name} is not declared (no {key}); nothing removed")));
            };
            if store.get(&store.keys.route(&name)).await.ok().flatten().is_some() {
                warn(&format!("routes/{name} is left in place; remove it with `nereidctl routes clear {name}`"));
            }
            let what = format!("removed model {name}: the placement controller unloads it from every worker");
            Ok(written(output, &what, &key, None, Some(&previous)))
        }
        Command::Routes(RoutesCommand::Set { model, weights, sticky_key }) => {
            let model_key = store.keys.model(&model);
            let Some((declared, revision)) = store.get(&model_key).await? else {
                return Err(CtlError::Invalid(format!(
                    "model {model} is not declared; declare it first with `nereidctl model declare {model} ...`"
                )));
            };
            let declared = records::decode::<ModelRecord>(&declared).map_err(|e| {
                CtlError::Invalid(format!("{model_key} holds an invalid value ({e}); redeclare the model first"))
            })?;
            let (_, value) = route_record(&model, &declared, &weights, sticky_key).map_err(CtlError::Invalid)?;
            let key = store.keys.route(&model);
            // Written only if the declaration it was checked against is still the current one.
            let when = vec![Compare::mod_revision(model_key.as_str(), CompareOp::Equal, revision)];
            if !store.put_if(when, &key, &value).await? {
                return Err(CtlError::Failed(format!(
                    "model {model} was redeclared or removed while its route was checked; nothing was written, \
                     run the command again"
                )));
            }
            eprintln!(
                "nereidctl: note: the weights are stored for the canary split; this gateway does not apply \
                 them yet (requests go to the version they name, or with none to the newest READY one)"
            );
            Ok(written(output, &format!("set routes of model {model}"), &key, Some(&value), None))
        }
        Command::Routes(RoutesCommand::Show { model }) => {
            let state = read_state(&mut store).await?;
            let rows = render::routes(&state, model.as_deref());
            if let (Some(m), true) = (&model, rows.is_empty()) {
                let why = if state.models.contains_key(m) {
                    "no weights are set: every request goes to the version it names, or with none to the newest READY one"
                } else {
                    "it is not declared either"
                };
                return Err(CtlError::Invalid(format!("model {m} has no routes ({why})")));
            }
            Ok(show(output, || render::routes_table(&rows), || render::routes_json(&rows)))
        }
        Command::Routes(RoutesCommand::Clear { model }) => {
            let key = store.keys.route(&model);
            let Some(previous) = store.delete(&key).await? else {
                return Err(CtlError::Invalid(format!("model {model} has no routes (no {key}); nothing cleared")));
            };
            Ok(written(output, &format!("cleared routes of model {model}"), &key, None, Some(&previous)))
        }
        Command::Drain { worker, reason, force, until_exit, wait_secs } => {
            let record = DrainRecord { schema: records::SCHEMA_VERSION, reason: reason.unwrap_or_default() };
            let value = records::encode(&record).map_err(|e| CtlError::Invalid(format!("--reason: {e}")))?;
            let key = store.keys.drain(&worker);
            let worker_key = store.keys.worker(&worker);
            let not_registered = || {
                CtlError::Invalid(format!(
                    "worker {worker} is not registered (no {worker_key}); nothing written \
                     (--force drains it anyway, e.g. before it starts)"
                ))
            };
            let mut kept_persistent = false;
            if force {
                store.put(&key, &value).await?;
            } else if until_exit {
                // Read, then written only if nothing changed since; read again (a few times) if
                // something did — the worker re-registering under a new lease in between (a
                // keep-alive hiccup), or an operator's drain or undrain — rather than leave a
                // pod's preStop with no drain at all.
                let mut attempts = 0;
                loop {
                    attempts += 1;
                    // Bound to the lease the worker's record holds, and written only while it still
                    // holds that one: the drain cannot outlive this registration.
                    let lease = store.lease_of(&worker_key).await?.ok_or_else(not_registered)?;
                    if lease == 0 {
                        return Err(CtlError::Invalid(format!(
                            "{worker_key} is bound to no lease: --until-exit needs a worker's own registration"
                        )));
                    }
                    // An operator's drain (bound to no lease: until `nereidctl undrain`) stands: bound
                    // to the worker's lease instead, it would end when the worker exits — and a pod
                    // restarted under the same name would take traffic and placements again.
                    match store.lease_of(&key).await? {
                        Some(0) => kept_persistent = true,
                        existing => {
                            // Written only if the drain record is as read (absent, or an earlier
                            // --until-exit's), besides the registration.
                            let drain_as_read = match existing {
                                None => Compare::version(key.as_str(), CompareOp::Equal, 0),
                                Some(l) => Compare::lease(key.as_str(), CompareOp::Equal, l),
                            };
                            let when =
                                vec![Compare::lease(worker_key.as_str(), CompareOp::Equal, lease), drain_as_read];
                            if !store.put_leased_if(when, &key, &value, lease).await? {
                                if attempts < UNTIL_EXIT_ATTEMPTS {
                                    continue;
                                }
                                // Changed under every conditional write: exit 1, as `routes set`.
                                return Err(CtlError::Failed(format!(
                                    "worker {worker}'s registration ({worker_key}) or drain record ({key}) changed \
                                 while this was written, {attempts} times; nothing written: run it again"
                                )));
                            }
                        }
                    }
                    break;
                }
            } else {
                // Written only while the worker is registered (its key exists).
                let when = vec![Compare::version(worker_key.as_str(), CompareOp::Greater, 0)];
                if !store.put_if(when, &key, &value).await? {
                    return Err(not_registered());
                }
            }
            let mut out = if kept_persistent {
                kept(
                    output,
                    &format!(
                        "worker {worker} is already drained until `nereidctl undrain`: --until-exit leaves that drain as it is"
                    ),
                    &key,
                )
            } else {
                let what = format!(
                    "drained worker {worker}: the gateway stops routing to it and the placement controller moves its models"
                );
                written(output, &what, &key, Some(&value), None)
            };
            if wait_secs > 0 {
                let moved = wait_moved(&mut store, &worker, Duration::from_secs(wait_secs)).await?;
                if output == Output::Table {
                    out.push_str(&format!("all models moved off worker {worker} in {:.1}s\n", moved.as_secs_f64()));
                }
            }
            Ok(out)
        }
        Command::Undrain { worker, force } => {
            let key = store.keys.drain(&worker);
            let not_drained =
                || CtlError::Invalid(format!("worker {worker} is not drained (no {key}); nothing removed"));
            let previous = if force {
                store.delete(&key).await?.ok_or_else(not_drained)?
            } else {
                // A drain bound to a lease is a worker's own way out (its preStop's `drain
                // --until-exit`): removed, the worker would take traffic and placements again
                // while it waits to be stopped.
                let lease = store.lease_of(&key).await?.ok_or_else(not_drained)?;
                if lease != 0 {
                    return Err(CtlError::Invalid(format!(
                        "worker {worker} is draining until it exits ({key} is bound to its lease {lease:x}, \
                         written by `nereidctl drain --until-exit`, e.g. its pod's preStop): nothing removed \
                         (--force removes it anyway)"
                    )));
                }
                // Removed only as read: an --until-exit drain written meanwhile stays.
                let when = vec![
                    Compare::version(key.as_str(), CompareOp::Greater, 0),
                    Compare::lease(key.as_str(), CompareOp::Equal, 0),
                ];
                store.delete_if(when, &key).await?.ok_or_else(|| {
                    CtlError::Failed(format!("{key} changed while it was removed; nothing removed: run it again"))
                })?
            };
            let what = format!("undrained worker {worker}: it takes traffic and placements again");
            Ok(written(output, &what, &key, None, Some(&previous)))
        }
    }
}

/// How many times `drain --until-exit` reads and writes again when what it read changed.
const UNTIL_EXIT_ATTEMPTS: u32 = 3;

/// Waits (polling, bounded by `within`) until `worker` holds no placement; how long it took.
/// What is still placed on it at the end is the error — at once when no other worker could
/// take any of it (a single GPU worker, the others drained): a preStop hook would otherwise
/// hold the pod's SIGTERM for the whole wait, for nothing.
async fn wait_moved(store: &mut Store, worker: &str, within: Duration) -> Result<Duration, CtlError> {
    let start = tokio::time::Instant::now();
    let prefix = store.keys.placement_of(worker);
    // Since when no other worker could take anything of it, as last looked (the whole fleet's
    // state, read every [`NOWHERE_POLL`] only): a replacement pod registering moments later
    // (a node drain's ReplicaSet starts one at once) is waited for, for [`NOWHERE_PATIENCE`].
    let mut nowhere_since: Option<tokio::time::Instant> = None;
    let mut looked_at: Option<tokio::time::Instant> = None;
    loop {
        let left = store.keys_under(&prefix).await?;
        if left.is_empty() {
            return Ok(start.elapsed());
        }
        if looked_at.is_none_or(|at| at.elapsed() >= NOWHERE_POLL) {
            looked_at = Some(tokio::time::Instant::now());
            // (Rejected values were warned about by the command itself; not again every poll.)
            let (state, _) = store.state().await?;
            let stuck = nowhere_to_go(&state, worker);
            let all = state.placements.iter().filter(|(w, _, _)| w == worker).count();
            if stuck.is_empty() || stuck.len() != all {
                nowhere_since = None;
            } else if nowhere_since.get_or_insert_with(tokio::time::Instant::now).elapsed() >= NOWHERE_PATIENCE {
                return Err(CtlError::Failed(format!(
                    "the drain is in place, but no other worker can take what worker {worker} holds ({}): \
                     none has been registered, ready and undrained with the labels the models' selectors ask \
                     for in {}s; not waiting longer",
                    stuck.join(", "),
                    NOWHERE_PATIENCE.as_secs()
                )));
            }
        }
        if start.elapsed() >= within {
            let names: Vec<&str> = left.iter().map(|k| k.strip_prefix(prefix.as_str()).unwrap_or(k)).collect();
            return Err(CtlError::Failed(format!(
                "the drain is in place, but after {}s worker {worker} still holds {} (model/version): no \
                 other worker has loaded them yet — see `nereidctl placement` and the gateway's placement log",
                within.as_secs(),
                names.join(", ")
            )));
        }
        tokio::time::sleep(WAIT_POLL.min(within.saturating_sub(start.elapsed()))).await;
    }
}

/// `model/version`s placed on `worker` that no other worker could take: none other is active
/// (registered, ready, undrained) with the labels the model's selector asks for. (Room is the
/// placement controller's to judge: a full worker may have room later.)
fn nowhere_to_go(state: &FleetState, worker: &str) -> Vec<String> {
    state
        .placements
        .iter()
        .filter(|(w, m, _)| {
            w == worker
                && !state.workers.iter().any(|(other, record)| {
                    other != worker
                        && state.is_active(other)
                        && state.models.get(m).is_none_or(|d| d.selects(&record.labels))
                })
        })
        .map(|(_, m, v)| format!("{m}/{v}"))
        .collect()
}

/// How often `drain --wait-secs` reads the whole fleet's state to see whether another worker
/// could take the drained one's models at all.
const NOWHERE_POLL: Duration = Duration::from_secs(2);
/// How long `drain --wait-secs` waits with no other worker able to take the drained one's
/// models before it gives up (a replacement pod may register meanwhile).
const NOWHERE_PATIENCE: Duration = Duration::from_secs(20);

/// How often `drain --wait-secs` looks at the worker's placements.
const WAIT_POLL: Duration = Duration::from_millis(250);

/// The record `model declare` writes, validated and encoded; errors name the flags.
pub fn model_record(
    versions: &[i64],
    replicas: u32,
    memory_mb: u64,
    cost_class: Option<String>,
    selector: std::collections::BTreeMap<String, String>,
) -> Result<(ModelRecord, String), CtlError> {
    let record = ModelRecord {
        schema: records::SCHEMA_VERSION,
        versions: versions.to_vec(),
        replicas,
        resources: Resources { memory_mb },
        cost_class,
        selector,
    };
    let value = records::encode(&record).map_err(|e| {
        CtlError::Invalid(format!(
            "invalid model (--versions {} --replicas {replicas} --memory-mb {memory_mb}{}): {e}",
            versions.iter().map(i64::to_string).collect::<Vec<_>>().join(","),
            record.cost_class.as_ref().map(|c| format!(" --cost-class {c}")).unwrap_or_default(),
        ))
    })?;
    Ok((record, value))
}

/// The record `routes set` writes: each weighted version listed once and declared by the model;
/// weights validated by [`RouteRecord`]. Errors name the flag.
pub fn route_record(
    model: &str,
    declared: &ModelRecord,
    weights: &[(i64, u32)],
    sticky_key: Option<String>,
) -> Result<(RouteRecord, String), String> {
    let mut map = std::collections::BTreeMap::new();
    for &(version, weight) in weights {
        if map.insert(version, weight).is_some() {
            return Err(format!("--weight lists version {version} more than once"));
        }
        if !declared.versions.contains(&version) {
            let mut versions = declared.versions.clone();
            versions.sort_unstable();
            return Err(format!(
                "--weight {version}={weight}: model {model} does not declare version {version} (declared: {}); \
                 redeclare the model first with `nereidctl model declare {model} --versions ...`",
                versions.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
            ));
        }
    }
    let record = RouteRecord { schema: records::SCHEMA_VERSION, weights: map, sticky_key };
    record.validate().map_err(|e| format!("--weight: {e}"))?;
    let value = records::encode(&record).map_err(|e| format!("--weight: {e}"))?;
    Ok((record, value))
}

async fn read_state(store: &mut Store) -> Result<FleetState, CtlError> {
    let (state, rejected) = store.state().await?;
    warn_rejected(&rejected);
    Ok(state)
}

fn warn_rejected(rejected: &[Rejected]) {
    for r in rejected {
        warn(&format!("{r} (ignored, as every Nereid reader ignores it; `nereidctl get` shows it)"));
    }
}

fn warn(message: &str) {
    eprintln!("nereidctl: warning: {message}");
}

fn show(output: Output, table: impl FnOnce() -> String, json: impl FnOnce() -> Value) -> String {
    match output {
        Output::Table => table(),
        Output::Json => pretty(&json()),
    }
}

fn pretty(value: &Value) -> String {
    let mut s = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    s.push('\n');
    s
}

/// What a write did: a sentence and the key/value for people, or an object for scripts.
/// What a command that found its work done already prints: `key` left as it is.
fn kept(output: Output, what: &str, key: &str) -> String {
    match output {
        Output::Table => format!("{what}\n  kept {key}\n"),
        Output::Json => pretty(&json!({ "action": "none", "key": key, "message": what })),
    }
}

fn written(output: Output, what: &str, key: &str, value: Option<&str>, previous: Option<&[u8]>) -> String {
    let as_json = |bytes: &[u8]| {
        serde_json::from_slice::<Value>(bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into()))
    };
    match output {
        Output::Table => {
            let mut s = format!("{what}\n");
            match value {
                Some(v) => s.push_str(&format!("  put {key} = {v}\n")),
                None => s.push_str(&format!("  deleted {key}\n")),
            }
            if let Some(p) = previous.filter(|_| value.is_some()) {
                s.push_str(&format!("  (replaced {})\n", String::from_utf8_lossy(p)));
            }
            s
        }
        Output::Json => pretty(&json!({
            "action": if value.is_some() { "put" } else { "delete" },
            "key": key,
            "value": value.map(|v| as_json(v.as_bytes())),
            "previous": previous.map(as_json),
            "message": what,
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A drained worker's placements can go elsewhere only to an active worker carrying the
    /// model's selector labels.
    #[test]
    fn placements_with_no_other_active_worker_matching_have_nowhere_to_go() {
        let keys = nereid_common::fleet::Keys::new("/n").unwrap();
        let worker = |id: &str, state: &str, labels: &str| {
            format!(r#"{{"schema":1,"id":"{id}","grpc":"127.0.0.1:1","state":"{state}","labels":{labels}}}"#)
        };
        let kvs = [
            ("/n/workers/gpu1", worker("gpu1", "ready", r#"{"device":"gpu"}"#)),
            ("/n/workers/gpu2", worker("gpu2", "draining", r#"{"device":"gpu"}"#)),
            ("/n/workers/gpu3", worker("gpu3", "ready", r#"{"device":"gpu"}"#)),
            ("/n/drain/gpu3", r#"{"schema":1}"#.into()),
            ("/n/workers/cpu1", worker("cpu1", "ready", "{}")),
            ("/n/models/big", r#"{"schema":1,"versions":[1],"replicas":1,"selector":{"device":"gpu"}}"#.into()),
            ("/n/models/small", r#"{"schema":1,"versions":[1],"replicas":1}"#.into()),
            ("/n/placement/gpu1/big/1", r#"{"schema":1,"leader_revision":7}"#.into()),
            ("/n/placement/gpu1/small/1", r#"{"schema":1,"leader_revision":7}"#.into()),
        ];
        let (mut state, rejected) = FleetState::from_kvs(&keys, kvs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
        assert!(rejected.is_empty(), "{rejected:?}");
        // The other GPU workers are draining or drained; small may go to cpu1.
        assert_eq!(nowhere_to_go(&state, "gpu1"), ["big/1"]);
        state.drains.remove("gpu3");
        assert!(nowhere_to_go(&state, "gpu1").is_empty());
        state.workers.clear();
        assert_eq!(nowhere_to_go(&state, "gpu1"), ["big/1", "small/1"]);
    }

    fn declared(versions: &[i64]) -> ModelRecord {
        ModelRecord {
            schema: 1,
            versions: versions.to_vec(),
            replicas: 1,
            resources: Resources::default(),
            cost_class: None,
            selector: Default::default(),
        }
    }

    #[test]
    fn routes_only_weight_declared_versions() {
        let m = declared(&[2, 1]);
        let (r, json) = route_record("m", &m, &[(1, 90), (2, 10)], Some("x-user".into())).unwrap();
        assert_eq!(r.weights, [(1, 90), (2, 10)].into());
        assert_eq!(json, r#"{"schema":1,"weights":{"1":90,"2":10},"sticky_key":"x-user"}"#);
        let e = route_record("m", &m, &[(1, 90), (3, 10)], None).unwrap_err();
        assert!(e.contains("--weight 3=10") && e.contains("does not declare version 3 (declared: 1,2)"), "{e}");
        let e = route_record("m", &m, &[(1, 90), (1, 10)], None).unwrap_err();
        assert!(e.contains("version 1 more than once"), "{e}");
        let e = route_record("m", &m, &[(1, 0), (2, 0)], None).unwrap_err();
        assert!(e.contains("--weight: every weight is 0"), "{e}");
        let e = route_record("m", &m, &[(1, records::MAX_WEIGHT + 1)], None).unwrap_err();
        assert!(e.contains("larger than"), "{e}");
    }

    #[test]
    fn model_records_are_validated_and_name_the_flags() {
        let (r, json) = model_record(&[1, 2], 2, 64, None, Default::default()).unwrap();
        assert_eq!(r.versions, [1, 2]);
        assert_eq!(json, r#"{"schema":1,"versions":[1,2],"replicas":2,"resources":{"memory_mb":64}}"#);
        let e = model_record(&[1], 0, 0, None, Default::default()).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("--replicas 0") && e.to_string().contains("outside 1..="), "{e}");
        let e = model_record(&[], 1, 0, None, Default::default()).unwrap_err().to_string();
        assert!(e.contains("versions is empty"), "{e}");
        let e = model_record(&[1], 1, 0, Some("a b".into()), Default::default()).unwrap_err().to_string();
        assert!(e.contains("--cost-class a b"), "{e}");
    }

    #[test]
    fn writes_report_key_value_and_previous() {
        let t = written(Output::Table, "declared model m", "/n/models/m", Some("{\"schema\":1}"), Some(b"{}"));
        assert_eq!(t, "declared model m\n  put /n/models/m = {\"schema\":1}\n  (replaced {})\n");
        let j: Value =
            serde_json::from_str(&written(Output::Json, "x", "/n/drain/w", None, Some(b"{\"schema\":1}"))).unwrap();
        assert_eq!(j["action"], "delete");
        assert_eq!(j["previous"]["schema"], 1);
        assert_eq!(j["value"], Value::Null);
    }
}
