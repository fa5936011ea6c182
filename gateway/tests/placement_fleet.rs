//! The placement controller against a real etcd and real workers: it plans promptly however
//! busy etcd is, gives up on a worker that never reports a placed model READY, hands a drained
//! worker's replicas over make-before-break, and says why a version stays unplaced. Loopback,
//! ephemeral ports, every wait on a condition and bounded.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{
    Etcd, PREFIX, Proc, is_ready, keys_under, parse_key, put, ready_on, spawn_fleet_gateway, spawn_fleet_worker,
    wait_until,
};
use nereid_common::fleet::etcd_client::{EventType, GetOptions, PutOptions, WatchOptions};

const WAIT: Duration = Duration::from_secs(30);

async fn wait_registered(etcd: &Etcd, workers: &[&str]) {
    let want: Vec<String> = workers.iter().map(|w| format!("/workers/{w}")).collect();
    wait_until("the workers to register", WAIT, || async {
        keys_under(&mut etcd.client().await, "workers/").await == want
    })
    .await;
}

/// Waits (bounded) until the gateway's log has `needle`.
/// etcd, worker `w1` registered, and gateway `g1` leading the placement controller.
async fn one_worker_and_a_leading_gateway() -> (Etcd, Proc, Proc) {
    let etcd = Etcd::start().await;
    let w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_registered(&etcd, &["w1"]).await;
    wait_until("g1 to lead the placement controller", WAIT, || async {
        gateway.metric("nereid_gateway_placement_leader").await == Some(1.0)
    })
    .await;
    (etcd, w1, gateway)
}

async fn wait_log(gateway: &Proc, what: &str, needle: &str) {
    gateway.wait_log(what, needle, WAIT).await;
}

/// Keys outside the schema, under the prefix — etcd events the controller sees as changes —
/// written by [`CHURN_WRITERS`] tasks, each every ~15 ms, until stopped (or for at most 60 s).
/// Several writers, so that one stalled for a moment does not leave a 50 ms gap.
struct Churn {
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

const CHURN_WRITERS: usize = 3;

impl Churn {
    async fn start(etcd: &Etcd) -> Churn {
        let (stop, writes) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let mut tasks = Vec::new();
        for writer in 0..CHURN_WRITERS {
            let (s, n, mut client) = (stop.clone(), writes.clone(), etcd.client().await);
            tasks.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(15));
                for i in 0..4_000u64 {
                    if s.load(Ordering::Relaxed) {
                        break;
                    }
                    tick.tick().await;
                    if client.put(format!("{PREFIX}/churn/{writer}"), i.to_string(), None).await.is_ok() {
                        n.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
        }
        Churn { stop, writes, tasks }
    }

    fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Stops it; whether it was still running (no writer had run out of writes).
    async fn stop(self) -> bool {
        let running = self.tasks.iter().all(|t| !t.is_finished());
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        running
    }
}

/// Before the fix, any change within 50 ms of the last one restarted the debounce, so keys
/// written every few milliseconds kept a newly declared model from being placed until the
/// writes stopped (or, on a busy machine, until the writes happened to pause for 50 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_is_placed_while_an_unrelated_key_churns() {
    let (etcd, _w1, _gateway) = one_worker_and_a_leading_gateway().await;

    let churn = Churn::start(&etcd).await;
    wait_until("the churn to start", WAIT, || async { churn.writes() >= 10 }).await;
    put(&mut etcd.client().await, "models/identity_fp32", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    wait_until("identity_fp32 READY on w1 while the churn goes on", WAIT, || async {
        ready_on(&mut etcd.client().await, "identity_fp32", 1).await == ["w1"]
    })
    .await;
    let writes = churn.writes();
    assert!(churn.stop().await, "the churn ended before the model was placed ({writes} writes)");
}

/// A worker that is registered but never publishes a status (a dead agent) would hold its
/// replica forever; after --placement-load-timeout-secs the replica moves to a live worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_never_reported_ready_moves_after_the_load_timeout() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let _w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    // The ghost: the most free memory of any worker and the first id, so it is chosen first.
    let lease = client.lease_grant(120, None).await.unwrap().id();
    client
        .put(
            format!("{PREFIX}/workers/a-ghost"),
            r#"{"schema":1,"id":"a-ghost","grpc":"127.0.0.1:9","state":"ready","capacity":{"memory_mb":16777216}}"#,
            Some(PutOptions::new().with_lease(lease)),
        )
        .await
        .unwrap();
    wait_registered(&etcd, &["a-ghost", "w1"]).await;
    let gateway = spawn_fleet_gateway(&etcd, "g1", &["--placement-load-timeout-secs", "2"]);

    put(&mut client, "models/identity_fp32", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    wait_log(
        &gateway,
        "the controller to give up on the ghost",
        "the load of identity_fp32 version 1 failed on worker a-ghost: not READY within 2s",
    )
    .await;
    wait_until("identity_fp32 READY on w1", WAIT, || async {
        ready_on(&mut etcd.client().await, "identity_fp32", 1).await == ["w1"]
    })
    .await;
    wait_until("the ghost's placement removed", WAIT, || async {
        keys_under(&mut etcd.client().await, "placement/").await == ["/placement/w1/identity_fp32/1"]
    })
    .await;
}

/// Draining the only holder of a `replicas: 1` model: the replacement is placed and becomes
/// READY before the drained worker's placement (and so its READY status) goes — checked on
/// etcd's own history, event by event, so at no revision does the model lack a READY holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_holder_keeps_its_replica_until_the_replacement_is_ready() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let _w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let _w2 = spawn_fleet_worker(&etcd, "w2", &[]);
    let _gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_registered(&etcd, &["w1", "w2"]).await;
    put(&mut client, "models/identity_fp32", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    wait_until("identity_fp32 READY on one worker, placed only there", WAIT, || async {
        let mut c = etcd.client().await;
        let ready = ready_on(&mut c, "identity_fp32", 1).await;
        ready.len() == 1
            && keys_under(&mut c, "placement/").await == [format!("/placement/{}/identity_fp32/1", ready[0])]
    })
    .await;

    // The READY holders at one revision, then every change after it.
    let resp = client.get(format!("{PREFIX}/status/"), Some(GetOptions::new().with_prefix())).await.unwrap();
    let revision = resp.header().unwrap().revision();
    let mut ready: BTreeSet<String> = resp
        .kvs()
        .iter()
        .filter_map(|kv| Some((parse_key(kv.key_str().ok()?)?, kv.value())))
        .filter(|((_, _, m, v), value)| m == "identity_fp32" && *v == 1 && is_ready(value))
        .map(|((_, w, _, _), _)| w)
        .collect();
    assert_eq!(ready.len(), 1, "{ready:?}");
    let holder = ready.iter().next().unwrap().clone();
    let other = if holder == "w1" { "w2" } else { "w1" }.to_string();
    let mut events = client
        .watch(format!("{PREFIX}/"), Some(WatchOptions::new().with_prefix().with_start_revision(revision + 1)))
        .await
        .unwrap();

    put(&mut client, &format!("drain/{holder}"), r#"{"schema":1,"reason":"hand-over test"}"#).await;
    let deadline = Instant::now() + WAIT;
    let (mut old_removed, mut new_placed) = (false, false);
    for _ in 0..100_000 {
        if old_removed && ready == BTreeSet::from([other.clone()]) {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let msg = tokio::time::timeout(left, events.message()).await;
        let resp = msg
            .unwrap_or_else(|_| panic!("timed out: old placement removed {old_removed}, READY on {ready:?}"))
            .unwrap()
            .unwrap();
        for e in resp.events() {
            let Some(kv) = e.kv() else { continue };
            let Some((kind, w, m, v)) = kv.key_str().ok().and_then(parse_key) else { continue };
            if m != "identity_fp32" || v != 1 {
                continue;
            }
            let put = e.event_type() == EventType::Put;
            match kind.as_str() {
                "status" if put && is_ready(kv.value()) => {
                    ready.insert(w);
                }
                "status" => {
                    ready.remove(&w);
                }
                "placement" if put && w == other => new_placed = true,
                "placement" if !put && w == holder => {
                    assert!(new_placed, "the drained holder's placement went before a replacement was placed");
                    assert!(
                        ready.contains(&other),
                        "the drained holder's placement went at revision {} before {other} was READY",
                        kv.mod_revision()
                    );
                    old_removed = true;
                }
                _ => {}
            }
            assert!(!ready.is_empty(), "no READY holder of identity_fp32 at revision {}", kv.mod_revision());
        }
    }
    assert!(old_removed, "the drained holder's placement was never removed");
    assert_eq!(ready, BTreeSet::from([other.clone()]));
    assert_eq!(keys_under(&mut client, "placement/").await, [format!("/placement/{other}/identity_fp32/1")]);
}

/// A load that fails is logged with the worker's reason, and the version left unplaced is
/// reported as excluded after that failure — not only as "not enough room".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_is_reported_with_its_reason() {
    let etcd = Etcd::start().await;
    let _w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_registered(&etcd, &["w1"]).await;
    // Not in the worker's repository: its load fails.
    put(&mut etcd.client().await, "models/no_such_model", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    wait_log(&gateway, "the failure logged", "the load of no_such_model version 1 failed on worker w1: ").await;
    wait_log(
        &gateway,
        "the shortage explained",
        "1 of 1 replica(s) of no_such_model version 1 not placed: 1 active worker(s) excluded because their load \
         of it failed",
    )
    .await;
    let log = gateway.log();
    let line = log.lines().find(|l| l.contains("the load of no_such_model version 1 failed on worker w1")).unwrap();
    assert!(line.contains("WARN"), "{line}");
    let reason = line.split("failed on worker w1: ").nth(1).unwrap_or_default();
    assert!(!reason.trim().is_empty() && !reason.starts_with("(the worker gave no reason)"), "{line}");
    let shortage = log.lines().find(|l| l.contains("no_such_model version 1 not placed")).unwrap();
    assert!(shortage.contains("last load failure, on worker w1: "), "{shortage}");
}

/// A model whose placement goes away stops being published READY at once but keeps serving
/// for the worker's grace (`--drain-delay-ms`): gateways that have not caught up are still
/// answered. Placed again within the grace, it stays loaded — no reload; after the grace it
/// unloads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_placement_serves_out_its_grace_and_a_re_placement_keeps_it_loaded() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let w1 = spawn_fleet_worker(&etcd, "w1", &["--drain-delay-ms", "30000"]);
    let _gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_registered(&etcd, &["w1"]).await;
    let declared = r#"{"schema":1,"versions":[1],"replicas":1}"#;
    put(&mut client, "models/identity_fp32", declared).await;
    let ready = || async { ready_on(&mut etcd.client().await, "identity_fp32", 1).await == ["w1"] };
    wait_until("identity_fp32 READY on w1", WAIT, ready).await;
    let served = || async {
        let request = common::fp32_request("identity_fp32", "1", &[1, 16], |i| i as f32);
        w1.client().await.model_infer(request).await.is_ok()
    };

    // Undeclared: the placement and the READY status go; the worker still answers.
    client.delete(format!("{PREFIX}/models/identity_fp32"), None).await.unwrap();
    wait_until("the READY status to go", WAIT, || async { !ready().await }).await;
    assert!(served().await, "served during the grace: {}", w1.log());

    // Declared again within the grace: READY again, never unloaded, loaded once in all.
    put(&mut client, "models/identity_fp32", declared).await;
    wait_until("identity_fp32 READY on w1 again", WAIT, ready).await;
    assert!(served().await);
    let log = w1.log();
    assert_eq!(log.matches("placement: loading model=identity_fp32").count(), 1, "{log}");
    assert!(!log.contains("placement: unloading"), "{log}");
}

/// With a short grace the removed model does unload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_placement_unloads_after_its_grace() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let _gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_registered(&etcd, &["w1"]).await;
    put(&mut client, "models/identity_fp32", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    wait_until("identity_fp32 READY on w1", WAIT, || async {
        ready_on(&mut etcd.client().await, "identity_fp32", 1).await == ["w1"]
    })
    .await;
    client.delete(format!("{PREFIX}/models/identity_fp32"), None).await.unwrap();
    w1.wait_log("the unload", "placement: unloading model=identity_fp32", WAIT).await;
    wait_until("the worker to stop serving it", WAIT, || async {
        let request = common::fp32_request("identity_fp32", "1", &[1, 16], |i| i as f32);
        w1.client().await.model_infer(request).await.is_err()
    })
    .await;
}

/// A placed version that is not in the worker's repository is reported FAILED with that reason
/// at once (not LOADING until the load timeout), while the versions that are there serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placed_version_missing_from_the_repository_fails_and_the_others_serve() {
    let etcd = Etcd::start().await;
    let _w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_registered(&etcd, &["w1"]).await;
    put(&mut etcd.client().await, "models/identity_fp32", r#"{"schema":1,"versions":[1,7],"replicas":1}"#).await;
    wait_log(&gateway, "the failure logged", "the load of identity_fp32 version 7 failed on worker w1: ").await;
    let log = gateway.log();
    let line = log.lines().find(|l| l.contains("identity_fp32 version 7 failed on worker w1")).unwrap();
    assert!(line.contains("version 7 of 'identity_fp32' is not in the model repository"), "{line}");
    wait_until("identity_fp32 version 1 READY on w1", WAIT, || async {
        ready_on(&mut etcd.client().await, "identity_fp32", 1).await == ["w1"]
    })
    .await;
}

/// A worker loads the models placed on it side by side (`--model-load-thread-count`): a model
/// whose load cannot finish — its warm-up reads a FIFO nobody writes yet — does not hold up
/// another placed after it, which is READY and serving meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placed_models_load_side_by_side() {
    let config = r#"
name: "gated_identity"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
model_warmup [ { name: "gate" batch_size: 1 inputs { key: "INPUT0" value {
  data_type: TYPE_FP32 dims: [ 16 ] input_data_file: "gate" } } } ]
"#;
    let repo = common::identity_repo(&[("gated_identity", config)]);
    let warmup = repo.path().join("gated_identity/warmup");
    std::fs::create_dir_all(&warmup).unwrap();
    let fifo = warmup.join("gate");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let w1 = spawn_fleet_worker(&etcd, "w1", &["--model-repository", &repo.path().display().to_string()]);
    let _gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_registered(&etcd, &["w1"]).await;
    put(&mut client, "models/gated_identity", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    w1.wait_log("the gated load to start", "placement: loading model=gated_identity", WAIT).await;
    put(&mut client, "models/identity_fp32", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    wait_until("identity_fp32 READY on w1 while gated_identity loads", WAIT, || async {
        ready_on(&mut etcd.client().await, "identity_fp32", 1).await == ["w1"]
    })
    .await;
    let request = common::fp32_request("identity_fp32", "1", &[1, 16], |i| i as f32);
    w1.client().await.model_infer(request).await.unwrap();
    assert!(ready_on(&mut client, "gated_identity", 1).await.is_empty(), "the gate is still shut");

    // The warm-up reads its file to the end: the reader blocked on the FIFO gets 64 bytes, then
    // end of file once the writer closes (opening the FIFO read-write never blocks, on Linux).
    // A plain file of those bytes takes the FIFO's place, for a reader that opens it later.
    let mut gate = std::fs::OpenOptions::new().read(true).write(true).open(&fifo).unwrap();
    std::fs::write(warmup.join("plain"), [0u8; 64]).unwrap();
    std::fs::rename(warmup.join("plain"), &fifo).unwrap();
    std::io::Write::write_all(&mut gate, &[0u8; 64]).unwrap();
    drop(gate);
    wait_until("gated_identity READY on w1", WAIT, || async {
        ready_on(&mut etcd.client().await, "gated_identity", 1).await == ["w1"]
    })
    .await;
}

/// A placement key whose value is invalid (a hand edit, another schema) is invisible to the
/// plan, yet a worker may obey it: the controller deletes one it does not want instead of
/// leaving it for ever. A valid placement the plan wants beside it stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_with_an_invalid_value_the_plan_does_not_want_is_deleted() {
    let (etcd, _w1, _gateway) = one_worker_and_a_leading_gateway().await;
    let mut client = etcd.client().await;
    put(&mut client, "models/identity_fp32", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    wait_until("identity_fp32 READY on w1", WAIT, || async {
        ready_on(&mut etcd.client().await, "identity_fp32", 1).await == ["w1"]
    })
    .await;
    put(&mut client, "placement/w1/mlp_fp32/1", "{}").await;
    wait_until("the invalid placement to be deleted", WAIT, || async {
        !keys_under(&mut etcd.client().await, "placement/w1/").await.iter().any(|k| k.contains("mlp_fp32"))
    })
    .await;
    assert!(
        keys_under(&mut client, "placement/w1/").await.iter().any(|k| k.contains("identity_fp32")),
        "the wanted placement stays"
    );
}

/// A worker process starting with the id of one that died (its lease, and the statuses under
/// it, still alive) deletes the statuses it did not write: gateways would otherwise route to
/// models it does not serve until that lease ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_deletes_the_statuses_of_the_process_before_it() {
    use nereid_common::fleet::records::{self, ModelState, StatusRecord};
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    // What a killed process left behind, under a lease that outlives the test's wait.
    let lease = client.lease_grant(300, None).await.unwrap().id();
    let ready = records::encode(&StatusRecord { schema: 1, state: ModelState::Ready, reason: String::new() }).unwrap();
    client
        .put(format!("{PREFIX}/status/w1/mlp_fp32/1"), ready, Some(PutOptions::new().with_lease(lease)))
        .await
        .unwrap();
    let _w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    wait_registered(&etcd, &["w1"]).await;
    wait_until("the stale status to be deleted", WAIT, || async {
        !keys_under(&mut etcd.client().await, "status/w1/").await.iter().any(|k| k.contains("mlp_fp32"))
    })
    .await;
}

/// A roll-over from version 1 to 2 of a model declared with two replicas, where version 2
/// loads on one worker only (the other's repository lacks it): placement keeps version 1 on
/// both, and requests naming no version stay on version 1 — held by two, as declared — rather
/// than all going to the one replica of version 2. Requests naming 2 are served by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_naming_no_version_stay_on_the_old_version_until_the_new_one_has_its_replicas() {
    let etcd = Etcd::start().await;
    // w2's repository: versioned_scale with version 1 only.
    let repo = tempfile::tempdir().unwrap();
    let model = repo.path().join("versioned_scale");
    std::fs::create_dir_all(model.join("1")).unwrap();
    let examples = common::example_models().join("versioned_scale");
    std::fs::copy(examples.join("config.pbtxt"), model.join("config.pbtxt")).unwrap();
    std::fs::copy(examples.join("1/model.onnx"), model.join("1/model.onnx")).unwrap();
    let _w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let _w2 = common::spawn_fleet_worker_on(&etcd, "w2", repo.path(), &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_registered(&etcd, &["w1", "w2"]).await;

    let mut client = etcd.client().await;
    put(&mut client, "models/versioned_scale", r#"{"schema":1,"versions":[1],"replicas":2}"#).await;
    wait_until("version 1 READY on both", WAIT, || async {
        ready_on(&mut etcd.client().await, "versioned_scale", 1).await == ["w1", "w2"]
    })
    .await;
    put(&mut client, "models/versioned_scale", r#"{"schema":1,"versions":[2],"replicas":2}"#).await;
    wait_log(&gateway, "w2's load of version 2 to fail", "the load of versioned_scale version 2 failed on worker w2")
        .await;
    wait_until("version 2 READY on w1 and routed", WAIT, || async {
        infer_version(&gateway, "2").await.as_deref() == Some("2")
    })
    .await;
    assert_eq!(ready_on(&mut client, "versioned_scale", 1).await, ["w1", "w2"], "version 1 kept on both");
    for _ in 0..20 {
        assert_eq!(infer_version(&gateway, "").await.as_deref(), Some("1"), "a request naming no version");
    }
    // Metadata asked for no version lists every version the fleet routes, whichever holder of
    // version 1 answers (w1 holds 1 and 2, w2 only 1).
    for _ in 0..10 {
        let request =
            nereid_proto::inference::ModelMetadataRequest { name: "versioned_scale".into(), version: String::new() };
        let metadata = gateway.client().await.model_metadata(request).await.unwrap().into_inner();
        assert_eq!(metadata.versions, ["1", "2"]);
    }
}

/// Infers versioned_scale `version` ("" for none) through the gateway; the version that answered.
async fn infer_version(gateway: &Proc, version: &str) -> Option<String> {
    let request = common::fp32_request("versioned_scale", version, &[1, 4], |i| i as f32);
    let response = gateway.client().await.model_infer(request).await.ok()?;
    Some(response.into_inner().model_version)
}
